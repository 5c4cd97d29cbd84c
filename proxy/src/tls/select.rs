//! SNI name → the node(s) a connection may go to. Matching is kept apart from parsing: the
//! names are `shardgate_crds::Hostnames`' (one place for the naming scheme):
//!
//! | name | routes to |
//! | --- | --- |
//! | `<prefix>-<s>-<n>.<domain>` | node (s, n) |
//! | `<prefix>-<s>.<domain>` | shard s's primary ([`Route::primary`]: live from the seed source; node 0 from a route file) |
//! | `<prefix>.<domain>` | any node: every node in turn from a rotating start, the first that answers |

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use shardgate_crds::{HostnameTarget, Hostnames};

use crate::model::{Route, RouteTable};

/// Where a name routes: the candidates, in the order they are tried.
#[derive(Debug, Clone)]
pub struct Selected {
    /// `node`, `shard` or `bootstrap` (a metric label).
    pub target: &'static str,
    pub candidates: Vec<Arc<Route>>,
}

/// Why a name does not route.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectError {
    /// Not one of this cluster's names.
    #[error("{0:?} is not a name of this cluster")]
    Unknown(String),
    /// One of its names, but no such node or shard in the table now.
    #[error("{0:?} names no node in the route table")]
    NoRoute(String),
}

impl SelectError {
    /// A metric label (`tls_refused_total{reason}`).
    pub fn label(&self) -> &'static str {
        match self {
            SelectError::Unknown(_) => "unknown_sni",
            SelectError::NoRoute(_) => "no_route",
        }
    }
}

/// Picks routes for SNI names.
#[derive(Debug)]
pub struct Selector {
    names: Hostnames,
    /// Where the bootstrap name's rotation starts next.
    next: AtomicUsize,
}

impl Selector {
    pub fn new(names: Hostnames) -> Self {
        Selector {
            names,
            next: AtomicUsize::new(0),
        }
    }

    /// The routes `name` goes to in `table`.
    pub fn select(&self, table: &RouteTable, name: &str) -> Result<Selected, SelectError> {
        let target = self
            .names
            .target(name)
            .ok_or_else(|| SelectError::Unknown(name.to_string()))?;
        let no_route = || SelectError::NoRoute(name.to_string());
        match target {
            HostnameTarget::Node(node) => {
                let route = table.node(node).ok_or_else(no_route)?;
                Ok(Selected {
                    target: "node",
                    candidates: vec![route.clone()],
                })
            }
            HostnameTarget::Shard(shard) => {
                let in_shard = || table.routes.values().filter(|r| r.node.shard == shard);
                // The primary; without one (a table mid-failover), the lowest node index.
                let route = in_shard()
                    .find(|r| r.primary)
                    .or_else(|| in_shard().min_by_key(|r| r.node.node.0))
                    .ok_or_else(no_route)?;
                Ok(Selected {
                    target: "shard",
                    candidates: vec![route.clone()],
                })
            }
            HostnameTarget::Bootstrap => {
                let all: Vec<Arc<Route>> = table.routes.values().cloned().collect();
                if all.is_empty() {
                    return Err(no_route());
                }
                let start = self.next.fetch_add(1, Ordering::Relaxed) % all.len();
                let mut candidates = all[start..].to_vec();
                candidates.extend_from_slice(&all[..start]);
                Ok(Selected {
                    target: "bootstrap",
                    candidates,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Routes;
    use shardgate_crds::NodeRef;

    fn table(primary_of_shard_1: u32) -> RouteTable {
        let routes: Routes = (0..4u32)
            .map(|i| {
                let node = NodeRef::new(i / 2, i % 2);
                let mut r = Route::new(node, format!("10.0.0.{}:6379", i + 1).parse().unwrap());
                if node.shard.0 == 1 {
                    r.primary = node.node.0 == primary_of_shard_1;
                }
                (30000 + i as u16, Arc::new(r))
            })
            .collect();
        RouteTable {
            version: 1,
            routes,
            ..RouteTable::default()
        }
    }

    fn selector() -> Selector {
        Selector::new(Hostnames {
            prefix: "vc".into(),
            domain: "example.test".into(),
        })
    }

    fn backends(s: &Selected) -> Vec<String> {
        s.candidates.iter().map(|r| r.backend.to_string()).collect()
    }

    #[test]
    fn node_shard_and_bootstrap_names() {
        let s = selector();
        let t = table(1);
        let node = s.select(&t, "vc-1-0.example.test").unwrap();
        assert_eq!(backends(&node), ["10.0.0.3:6379"]);
        // Shard 1's primary is node 1 after a failover.
        let shard = s.select(&t, "vc-1.example.test").unwrap();
        assert_eq!(backends(&shard), ["10.0.0.4:6379"]);
        assert_eq!(shard.target, "shard");
        let a = s.select(&t, "vc.example.test").unwrap();
        let b = s.select(&t, "vc.example.test").unwrap();
        assert_eq!(a.candidates.len(), 4);
        assert_ne!(backends(&a)[0], backends(&b)[0], "the start rotates");
    }

    #[test]
    fn a_shard_without_a_known_primary_goes_to_its_lowest_node() {
        let t = table(7);
        let shard = selector().select(&t, "vc-1.example.test").unwrap();
        assert_eq!(backends(&shard), ["10.0.0.3:6379"]);
    }

    #[test]
    fn unknown_names_and_missing_nodes() {
        let s = selector();
        let t = table(0);
        for name in ["other.example.test", "vc-1-0.example.org", "example.test"] {
            assert_eq!(
                s.select(&t, name).unwrap_err().label(),
                "unknown_sni",
                "{name}"
            );
        }
        for name in [
            "vc-5-0.example.test",
            "vc-0-9.example.test",
            "vc-9.example.test",
        ] {
            assert_eq!(
                s.select(&t, name).unwrap_err().label(),
                "no_route",
                "{name}"
            );
        }
    }
}
