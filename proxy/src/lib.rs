//! shardgate-proxy: a tokio data plane that fronts a Valkey cluster.
//!
//! The modules layer one way: each imports only those above it in this list.
//!
//! - [`model`]: the route table (listener port → node); imports nothing else.
//! - `throttle`: log lines a flood would repeat, one per key per period.
//! - `resp`: the RESP scanner, frame model, request scanner and reply pairing.
//! - `metrics`: Prometheus metrics, one struct per concern.
//! - `rewrite`: the topology rewriters, the address map built from a table, and the
//!   two-direction stream (where MOVED, CLUSTER SLOTS/SHARDS/NODES... are rewritten).
//! - `tls`: the ClientHello parser and detector, SNI selection, certificates.
//! - `dial`: reaching a node: resolver, connect timeout, socket options, the TLS leg.
//! - `discovery`: `CLUSTER SHARDS` from seed nodes (the shared admin client) and sticky
//!   indices.
//! - `source`: route sources (a file, seed discovery, the pods on the Kubernetes API with
//!   the feature `kubernetes`, on by default) and the publisher (where the table is swapped).
//! - `conn`: where a connection lives: listeners, the copy loop, the TLS port.
//! - `admin`: `/metrics`, `/healthz`, `/readyz`, `/routes`.
//! - [`config`] and [`app`]: the configuration from the settings, and the app that wires
//!   the parts and drains on shutdown.
//!
//! `proxy/tests/layers.rs` fails on any import cycle between these modules (CI runs it). The
//! modules shown in code font are the crate's own; the `test-util` feature makes them public
//! for the tests, benchmarks and fuzzers.
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

/// Modules the crate keeps to itself, public with `test-util` for tests, benches and fuzzers.
macro_rules! internal {
    ($($(#[$doc:meta])* $name:ident;)*) => {$(
        $(#[$doc])*
        #[cfg(feature = "test-util")]
        pub mod $name;
        $(#[$doc])*
        #[cfg(not(feature = "test-util"))]
        pub(crate) mod $name;
    )*};
}

pub mod model;
internal! {
    throttle;
    resp;
    metrics;
    rewrite;
    tls;
    dial;
    discovery;
    source;
    conn;
    admin;
}

// rustfmt does not expand macros, so it would skip the modules above: this list, which the
// compiler never sees, is for `cargo fmt` alone (`scripts/test` checks every file as well).
#[cfg(rustfmt)]
mod admin;
#[cfg(rustfmt)]
mod conn;
#[cfg(rustfmt)]
mod dial;
#[cfg(rustfmt)]
mod discovery;
#[cfg(rustfmt)]
mod metrics;
#[cfg(rustfmt)]
mod resp;
#[cfg(rustfmt)]
mod rewrite;
#[cfg(rustfmt)]
mod source;
#[cfg(rustfmt)]
mod throttle;
#[cfg(rustfmt)]
mod tls;

pub mod app;
pub mod config;

pub use app::{Proxy, ProxyHandle, StartError};
pub use config::{ConfigError, ProxyConfig, SourceConfig, TlsConfig, TlsModeConfig};
pub use source::{RouteRx, Snapshot};
