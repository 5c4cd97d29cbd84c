//! One listener's route: the node behind a port, and what the proxy knows of it.

use std::collections::BTreeMap;
use std::sync::Arc;

use shardgate_crds::{Backend, NodeRef};

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
    /// Whether the node is its shard's primary, as far as the source knows: the seed source
    /// reads the live role from `CLUSTER SHARDS` on every refresh; the route file knows no
    /// roles and marks node 0 of each shard (the initial primary). The SNI name of a shard
    /// routes to it.
    pub primary: bool,
    /// Where the node speaks TLS, if not at `backend` (its `tls-port`): what the TLS port
    /// dials in passthrough mode and with `--tls-backend tls`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_backend: Option<Backend>,
    /// The slot ranges the node serves as a primary, where the source knows them (seed
    /// discovery): redirects that name no host (`-MOVED 12182 :6379`, the unknown-endpoint
    /// mode) are mapped by slot.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub slots: Vec<(u16, u16)>,
}

impl Route {
    /// A route to `backend` with nothing else known: no id, no hostname, no rewriting, a
    /// primary if it is node 0 of its shard.
    pub fn new(node: NodeRef, backend: Backend) -> Self {
        Route {
            node,
            backend,
            node_id: None,
            hostname: None,
            rewrite: false,
            primary: node.node.0 == 0,
            tls_backend: None,
            slots: Vec::new(),
        }
    }

    /// Where TLS connections to the node go: its TLS address, else its address.
    pub fn tls_backend(&self) -> &Backend {
        self.tls_backend.as_ref().unwrap_or(&self.backend)
    }

    /// The address a plain leg (`tls` false) or a TLS leg to the node dials.
    pub fn dialled(&self, tls: bool) -> &Backend {
        if tls {
            self.tls_backend()
        } else {
            &self.backend
        }
    }
}

/// Listener port → route.
pub type Routes = BTreeMap<u16, Arc<Route>>;
