//! The route table: which node each listener port forwards to. Lookup only; building and
//! validation live with the sources and the publisher.

use std::sync::Arc;

use shardgate_crds::{Backend, NodeRef};

use super::{Route, Routes};

/// A snapshot of the routes, swapped atomically as a whole. Connections take their route
/// when they are accepted and keep it for their lifetime.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RouteTable {
    /// 0 until a source has published its first table; then bumped on every change.
    pub version: u64,
    /// Which source built it (`file`, `seed`).
    pub source: &'static str,
    pub routes: Routes,
}

impl RouteTable {
    /// The route of a listener port.
    pub fn route(&self, port: u16) -> Option<&Arc<Route>> {
        self.routes.get(&port)
    }

    /// Whether a source has published a table yet.
    pub fn is_loaded(&self) -> bool {
        self.version > 0
    }

    pub fn ports(&self) -> impl Iterator<Item = u16> + '_ {
        self.routes.keys().copied()
    }

    /// Whether `backend` is one of this table's nodes (the proxy dials nothing else).
    pub fn has_backend(&self, backend: &Backend) -> bool {
        self.routes
            .values()
            .any(|r| &r.backend == backend || r.tls_backend.as_ref() == Some(backend))
    }

    /// The route of the node at `node`.
    pub fn node(&self, node: NodeRef) -> Option<&Arc<Route>> {
        self.routes.values().find(|r| r.node == node)
    }
}
