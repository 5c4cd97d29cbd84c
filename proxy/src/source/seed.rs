//! Routes discovered from seed nodes with `CLUSTER SHARDS`, refreshed periodically and
//! whenever a rewriter meets an address the table does not know. Several nodes are asked
//! and their views compared ([`discovery::views`]), so that one confused node cannot
//! replace the table; when no view can be used, the table in force stays, stale.
//!
//! Seed mode needs nodes that announce addresses the proxy can reach (Valkey's default). In
//! the announce mode of the design the nodes announce the proxy's own address; discovery then
//! finds the proxy itself, which the publisher refuses: give such routes in a file.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use shardgate_crds::PortLayout;
use tokio_util::sync::CancellationToken;

use super::{RoutePublisher, RouteSource};
use crate::dial::{BackendTlsRx, Resolver};
use crate::discovery::{self, Assignment, DiscoveryError, Refusal};
use crate::metrics::{Metrics, ReasonLabels};
use crate::model::{Backend, Route, Routes};

/// Routes from seed nodes.
pub struct SeedSource {
    rewrite: bool,
    seeds: Vec<Backend>,
    base_port: u16,
    ports_per_shard: Option<u32>,
    interval: Duration,
    timeout: Duration,
    resolver: Resolver,
    /// Nodes that speak TLS: asked over TLS, at their TLS addresses.
    tls: Option<BackendTlsRx>,
    assignment: Assignment,
    /// The answers the last discovery did not use, so that a change is logged once.
    refused: Vec<(SocketAddr, Refusal)>,
    /// The nodes the last discovery kept on the majority's word.
    kept: Vec<String>,
}

impl SeedSource {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        seeds: Vec<Backend>,
        base_port: u16,
        ports_per_shard: Option<u32>,
        interval: Duration,
        timeout: Duration,
        resolver: Resolver,
        rewrite: bool,
        tls: Option<BackendTlsRx>,
    ) -> Self {
        SeedSource {
            rewrite,
            tls,
            seeds,
            base_port,
            ports_per_shard,
            interval,
            timeout,
            resolver,
            assignment: Assignment::default(),
            refused: vec![],
            kept: vec![],
        }
    }

    /// One discovery → routes: a few nodes are asked (the seeds first, then the nodes of
    /// the table in force), and their answers compared ([`discovery::views`]).
    async fn refresh(
        &mut self,
        known: &Routes,
        metrics: &Metrics,
    ) -> Result<Discovered, DiscoveryError> {
        let mut candidates: Vec<Backend> = self.seeds.clone();
        for r in known.values() {
            // Over TLS, a node is asked at its TLS address.
            let at = match self.tls {
                Some(_) => r.tls_backend(),
                None => &r.backend,
            };
            if !candidates.contains(at) {
                candidates.push(at.clone());
            }
        }
        let dial = discovery::dial(self.timeout, self.tls.as_ref());
        let choice = discovery::discover(&self.resolver, &candidates, &dial).await;
        let choice = match choice {
            Ok(c) => c,
            Err(e) => {
                self.refused.clear();
                self.kept.clear();
                return Err(e);
            }
        };
        for (_, why) in &choice.refused {
            metrics
                .routes
                .views_refused
                .get_or_create(&ReasonLabels {
                    reason: why.label(),
                })
                .inc();
        }
        // Said once per change, not on every refresh while a node stays confused.
        if choice.refused != self.refused || choice.kept != self.kept {
            for (addr, why) in &choice.refused {
                tracing::warn!(
                    source = "seed",
                    node = %addr,
                    reason = why.label(),
                    chosen = %choice.chosen,
                    "a node's view of the cluster was not used: {}",
                    why.describe()
                );
            }
            if !choice.kept.is_empty() {
                tracing::warn!(source = "seed", kept = ?choice.kept, chosen = %choice.chosen, "nodes that most nodes still report were kept");
            }
            self.refused = choice.refused.clone();
            self.kept = choice.kept.clone();
        }
        let shards = choice.shards;
        let (placed, mut skipped) = self.assignment.assign(self.ports_per_shard, &shards);
        let stride = self.assignment.stride().unwrap_or(1);
        let shard_count = placed.iter().map(|(r, _)| r.shard.0 + 1).max().unwrap_or(1);
        let layout = PortLayout::new(
            u32::from(self.base_port),
            shard_count,
            stride - 1,
            Some(stride),
        )?;
        // A primary serves its shard's slots.
        let slots_of: HashMap<&str, &[(u16, u16)]> = shards
            .iter()
            .flat_map(|s| {
                s.nodes
                    .iter()
                    .filter(|n| n.primary)
                    .map(|n| (n.id.as_str(), s.slots.as_slice()))
            })
            .collect();
        let mut routes: Routes = BTreeMap::new();
        for (r, node) in placed {
            // A node the others list without an address (`noaddr`: another node answered
            // at its address, say one restarted empty) keeps the address it had.
            let last = known
                .values()
                .find(|k| k.node_id.as_deref() == Some(node.id.as_str()))
                .filter(|_| node.ip.is_empty());
            let (backend, tls_backend) = match last {
                Some(k) => (k.backend.clone(), k.tls_backend.clone()),
                None => {
                    let Some(port) = node.port.or(node.tls_port) else {
                        skipped.push(format!("node {}: no port announced", node.id));
                        continue;
                    };
                    let backend = match format!("{}:{port}", node.ip).parse::<Backend>() {
                        Ok(b) if !node.ip.is_empty() => b,
                        _ => {
                            skipped.push(format!("node {}: no usable ip ({:?})", node.id, node.ip));
                            continue;
                        }
                    };
                    let tls_backend = match (node.port, node.tls_port) {
                        (Some(_), Some(tls)) => format!("{}:{tls}", node.ip).parse().ok(),
                        _ => None,
                    };
                    (backend, tls_backend)
                }
            };
            let port = layout.port(r)?;
            // The assignment gives each node its own index; were two on one, the second
            // would silently take the first's port.
            if let Some(first) = routes.get(&port) {
                skipped.push(format!(
                    "node {}: port {port} is already {:?}'s",
                    node.id, first.node_id
                ));
                continue;
            }
            routes.insert(
                port,
                Arc::new(Route {
                    node: r,
                    backend,
                    node_id: Some(node.id.clone()),
                    hostname: node.hostname.clone(),
                    rewrite: self.rewrite,
                    primary: node.primary,
                    tls_backend,
                    slots: slots_of
                        .get(node.id.as_str())
                        .map(|s| s.to_vec())
                        .unwrap_or_default(),
                }),
            );
        }
        Ok(Discovered {
            routes,
            skipped,
            chosen: choice.chosen,
        })
    }
}

/// One discovery's outcome.
struct Discovered {
    routes: Routes,
    /// The nodes not routed, and why.
    skipped: Vec<String>,
    /// The node whose view the routes are.
    chosen: SocketAddr,
}

impl RouteSource for SeedSource {
    fn name(&self) -> &'static str {
        "seed"
    }

    async fn run(mut self, publisher: RoutePublisher, shutdown: CancellationToken) {
        let name = self.name();
        let mut backoff = Duration::from_millis(250);
        let refresh = publisher.refresh_requests();
        loop {
            let known = publisher.current().routes.clone();
            let wait = match self.refresh(&known, publisher.metrics()).await {
                Ok(Discovered {
                    routes,
                    skipped,
                    chosen,
                }) => {
                    for s in skipped {
                        tracing::warn!(source = name, "not routed: {s}");
                    }
                    match publisher.publish(name, routes) {
                        Ok(changed) => {
                            if changed {
                                // Which answer a table came from: what explains a table
                                // that a stale view changed.
                                tracing::info!(source = name, %chosen, "the new table is this node's view");
                            }
                            publisher.report_ok(name)
                        }
                        Err(e) => publisher.report_error(name, &e),
                    }
                    backoff = Duration::from_millis(250);
                    self.interval
                }
                Err(e) => {
                    publisher.report_error(name, &e);
                    backoff = (backoff * 2).min(self.interval);
                    backoff
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
                // A rewriter met an unknown address: look again now, but not more than
                // once per MIN_REFRESH, whatever the rate of unknown addresses.
                _ = refresh.notified() => {
                    tracing::info!(source = name, "refresh requested: a reply named an unknown node");
                    tokio::time::sleep(MIN_REFRESH).await;
                }
            }
        }
    }
}

/// The shortest time between two refreshes asked for by rewriters.
const MIN_REFRESH: Duration = Duration::from_millis(500);
