//! Types and helpers shared by the shardgate operator and proxy.
//!
//! - [`ports`]: node identity (shard index, node index), flat indices and external ports.
//! - [`names`]: hostnames (per shard, per node, bootstrap) and the labels on every object.
//!
//! Everything that turns a (shard, node) pair into a number or a name lives here, so that
//! the operator, the proxy and the tests can never disagree about it.
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

pub mod names;
pub mod ports;

pub use names::{bootstrap_hostname, node_hostname, shard_hostname, HostnameTarget, Hostnames};
pub use ports::{NodeIndex, NodeRef, PortError, PortLayout, ShardIndex};
