//! Routes discovered from seed nodes with `CLUSTER SHARDS`, refreshed periodically and
//! whenever a rewriter meets an address the table does not know. Several nodes are asked
//! and their views compared ([`discovery::views`]), so that one confused node cannot
//! replace the table; when no view can be used, the table in force stays, stale.
//!
//! Seed mode needs nodes that announce addresses the proxy can reach (Valkey's default). In
//! the announce mode of the design the nodes announce the proxy's own address; discovery then
//! finds the proxy itself, which the publisher refuses: give such routes in a file.

use std::net::SocketAddr;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{RoutePublisher, RouteSource};
use crate::dial::{BackendTlsRx, Resolver};
use crate::discovery::table::Table;
use crate::discovery::{self, Assignment, DiscoveryError, Refusal};
use crate::metrics::{Metrics, ReasonLabels};
use crate::model::{Backend, Routes};

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
        let layout = discovery::table::Layout {
            base_port: self.base_port,
            ports_per_shard: self.ports_per_shard,
            rewrite: self.rewrite,
        };
        let Table { routes, skipped } =
            discovery::table::build(&mut self.assignment, layout, &choice, known)?;
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
