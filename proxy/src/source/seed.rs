//! Routes discovered from seed nodes with `CLUSTER SHARDS`, refreshed periodically and
//! whenever a rewriter meets an address the table does not know.
//!
//! Seed mode needs nodes that announce addresses the proxy can reach (Valkey's default). In
//! the announce mode of the design the nodes announce the proxy's own address; discovery then
//! finds the proxy itself, which the publisher refuses: give such routes in a file.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use shardgate_crds::PortLayout;
use tokio_util::sync::CancellationToken;

use super::{RoutePublisher, RouteSource};
use crate::dial::Resolver;
use crate::discovery::{self, Assignment, DiscoveryError};
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
    assignment: Assignment,
}

impl SeedSource {
    pub fn new(
        seeds: Vec<Backend>,
        base_port: u16,
        ports_per_shard: Option<u32>,
        interval: Duration,
        timeout: Duration,
        resolver: Resolver,
        rewrite: bool,
    ) -> Self {
        SeedSource {
            rewrite,
            seeds,
            base_port,
            ports_per_shard,
            interval,
            timeout,
            resolver,
            assignment: Assignment::default(),
        }
    }

    /// One discovery → routes: the seeds are asked first, then the nodes of the table in
    /// force.
    async fn refresh(&mut self, known: &Routes) -> Result<(Routes, Vec<String>), DiscoveryError> {
        let mut candidates: Vec<Backend> = self.seeds.clone();
        for r in known.values() {
            if !candidates.contains(&r.backend) {
                candidates.push(r.backend.clone());
            }
        }
        let shards = discovery::discover(&self.resolver, &candidates, self.timeout).await?;
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
        let mut routes = BTreeMap::new();
        for (r, node) in placed {
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
            routes.insert(
                layout.port(r)?,
                Arc::new(Route {
                    node: r,
                    backend,
                    node_id: Some(node.id.clone()),
                    hostname: node.hostname.clone(),
                    rewrite: self.rewrite,
                    primary: node.primary,
                    tls_backend: match (node.port, node.tls_port) {
                        (Some(_), Some(tls)) => format!("{}:{tls}", node.ip).parse().ok(),
                        _ => None,
                    },
                    slots: slots_of
                        .get(node.id.as_str())
                        .map(|s| s.to_vec())
                        .unwrap_or_default(),
                }),
            );
        }
        Ok((routes, skipped))
    }
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
            let wait = match self.refresh(&known).await {
                Ok((routes, skipped)) => {
                    for s in skipped {
                        tracing::warn!(source = name, "not routed: {s}");
                    }
                    match publisher.publish(name, routes) {
                        Ok(_) => publisher.report_ok(name),
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
