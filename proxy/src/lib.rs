//! shardgate-proxy: a tokio data plane that fronts a Valkey cluster.
//!
//! - [`route`]: the route table (listener port → Valkey node), its sources (a YAML file, a
//!   seed node) and how a new table is published.
//! - [`listener`]: one accept loop per port, and the supervisor that keeps the set of
//!   listeners equal to the table's ports.
//! - [`forward`]: one client connection: connect to its node, copy bytes both ways.
//! - [`resolve`]: backends given by DNS name, resolved at connect time.
//! - [`metrics`] and [`admin`]: Prometheus metrics, `/healthz`, `/readyz`, `/routes`.
//! - [`tls`]: the TLS port, routed by SNI: passthrough or termination.
//! - [`proxy`]: puts the parts together; [`config`] holds the settings.
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

pub mod admin;
pub mod config;
pub mod forward;
pub mod listener;
pub mod metrics;
pub mod proxy;
pub mod resolve;
pub mod resp;
pub mod rewrite;
pub mod route;
pub mod tls;

pub use config::{ProxyConfig, SourceConfig};
pub use proxy::{Proxy, ProxyHandle};
