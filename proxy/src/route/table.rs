//! The route table: which node each listener port forwards to. Lookup only; building and
//! validation live with the sources and the publisher.

use std::collections::BTreeMap;
use std::sync::Arc;

use shardgate_crds::NodeRef;

use super::Backend;

/// One listener's route: the node behind the port.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Route {
    /// The node's place in the cluster; its port is `basePort + flatIndex`.
    pub node: NodeRef,
    /// Where the proxy connects.
    pub backend: Backend,
    /// The node's Valkey id, where the source knows it (used by topology rewriting).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    /// The hostname the node announces, where the source knows it (it may appear in
    /// redirects instead of the address).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// Whether replies on this listener have their topology rewritten.
    pub rewrite: bool,
}

/// Listener port → route.
pub type Routes = BTreeMap<u16, Arc<Route>>;

/// A snapshot of the routes, swapped atomically as a whole. Connections take their route
/// when they are accepted and keep it for their lifetime.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RouteTable {
    /// 0 until a source has published its first table; then bumped on every change.
    pub version: u64,
    /// Which source built it (`file`, `seed`).
    pub source: &'static str,
    pub routes: Routes,
    /// Internal address → external address, for the rewriters.
    #[serde(skip)]
    pub addresses: Arc<crate::rewrite::AddressMap>,
}

/// Every listener and connection reads the latest table from here.
pub type RouteRx = tokio::sync::watch::Receiver<Arc<RouteTable>>;

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
        self.routes.values().any(|r| &r.backend == backend)
    }
}
