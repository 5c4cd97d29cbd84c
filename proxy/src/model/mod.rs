//! The proxy's model of the cluster: which node each listener port leads to. It imports
//! nothing else of the proxy; every other part builds on it.
//!
//! - [`route`]: one listener's [`Route`] (node, backend, id, role, slots) and [`Routes`].
//! - [`table`]: the [`RouteTable`], a numbered snapshot of the routes.
//!
//! Backends (an IP or a DNS name, and a port) are the contracts crate's [`Backend`].

pub mod route;
pub mod table;

pub use route::{Route, Routes};
pub use shardgate_crds::{Backend, Host};
pub use table::RouteTable;

/// Hash slots in a cluster.
pub const SLOTS: usize = 16384;
