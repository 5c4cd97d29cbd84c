//! A small RESP client for administering Valkey nodes, shared by the proxy's seed discovery
//! and the operator. It does not link the proxy.
//!
//! - [`client`]: [`Client`], one connection to one node; one command at a time, each reply
//!   read whole within a timeout. Error replies are [`Error::Server`].
//! - [`depth`]: the bounds every reply is checked against before it is decoded (nesting
//!   depth and size), since redis-protocol's decoder recurses without a limit.
//! - [`shards`]: the typed view of `CLUSTER SHARDS` ([`ShardView`], [`NodeView`],
//!   [`parse_shards`]).
//! - [`nodes`]: the typed view of `CLUSTER NODES` ([`NodeLine`], [`parse_nodes`]), what the
//!   operator forms and heals clusters from.
//! - `commands`: the other typed helpers, one command each: [`Client::ping`],
//!   [`Client::cluster_myid`], [`Client::cluster_info`].
//! - [`tls`]: [`Tls`], for nodes that speak only TLS ([`Client::dial`] with a [`Dial`]).
//! - [`error`]: [`Error`], whose [`label`](Error::label) is the metric label.
//!
//! Replies are redis-protocol's RESP2 [`BytesFrame`](redis_protocol::resp2::types::BytesFrame),
//! re-exported as [`Reply`].

#![cfg_attr(not(test), warn(clippy::unwrap_used))]

pub mod client;
mod commands;
pub mod depth;
pub mod error;
pub mod nodes;
pub mod pem;
pub mod shards;
pub mod tls;

pub use client::{Client, Dial, Timeouts};
pub use error::Error;
pub use nodes::{parse_nodes, NodeLine};
pub use redis_protocol::resp2::types::BytesFrame as Reply;
pub use shards::{parse_shards, NodeView, ShardView};
pub use tls::{Tls, TlsError};
