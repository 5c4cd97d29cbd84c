//! Real Valkey 9 clusters on loopback, for tests, benchmarks and the demo.
//!
//! [`ValkeyCluster::start`] runs `shards * (replicas + 1)` `valkey-server` processes, each on
//! its own loopback address and all on the same port (as pods are), forms the cluster with
//! even slot ranges and replicas attached, and waits until every node agrees it is healthy.
//! Faults (kill, graceful stop, restart at the same or a new address, manual failover, slot
//! migration) each wait for the cluster to settle again, so a test can assert right after.
//!
//! Everything is synchronous (std processes, blocking connections), so it can be used from
//! plain tests and, via `spawn_blocking` or directly, from async ones. A [`ValkeyCluster`]
//! is `Sync`: one can share it in an `Arc` with a thread that injects faults.
//!
//! Dropping the cluster kills its processes and removes its directories, also when a test
//! panics; processes left behind by a test process that was killed are reaped by the next
//! cluster start (see [`stray_processes`]). Set `SHARDGATE_KEEP_VALKEY_DIRS=1` to keep the
//! directories (logs, `nodes.conf`, AOF) for a look after the test.
//!
//! ```no_run
//! use shardgate_harness::valkey::{key_slot, ClusterSpec, ValkeyCluster};
//! use shardgate_crds::NodeRef;
//!
//! let cluster = ValkeyCluster::start(ClusterSpec::new(3, 1))?;
//! let owner = cluster.slot_owner(key_slot(b"foo"))?;
//! let mut con = cluster.node(owner).connection()?;
//! redis::cmd("SET").arg("foo").arg("bar").exec(&mut con)?;
//! cluster.kill(NodeRef::new(0, 0));
//! # anyhow::Ok(())
//! ```

mod cluster;
mod node;
pub mod server;
mod slot;
mod standalone;
mod view;

use std::fmt;
use std::ops::RangeInclusive;
use std::sync::Arc;

use shardgate_crds::{NodeRef, ShardIndex};

pub use crate::procs::{processes_mentioning, stray_processes, MARKER};
pub use cluster::{SlotMigration, ValkeyCluster};
pub use node::{Node, LOG_FILE};
pub use server::{bus_port, BUS_PORT_OFFSET, DEFAULT_PORT};
pub use slot::{hash_tag_for_slot, key_slot, slot_tags, SLOTS};
pub use standalone::Standalone;
pub use view::{parse_cluster_nodes, zero_ping_pong, NodesLine};

/// Extra settings for one node, computed from its position.
pub type NodeConfigFn = Arc<dyn Fn(NodeRef) -> Vec<(String, String)> + Send + Sync>;

/// The shape and settings of a cluster to start.
#[derive(Clone)]
pub struct ClusterSpec {
    /// Number of shards (primaries), at least 1.
    pub shards: u32,
    /// Replicas per shard.
    pub replicas: u32,
    /// The port of every node (each on its own address). Default [`DEFAULT_PORT`] (6379).
    pub port: u16,
    /// `cluster-node-timeout`. Default 1000 ms, for fast failure detection and failover.
    pub node_timeout_ms: u64,
    /// Extra settings for every node, applied after the harness's own (so they win).
    pub config: Vec<(String, String)>,
    /// Extra settings per node, applied after `config`, e.g. announced client addresses.
    pub node_config: Option<NodeConfigFn>,
}

impl ClusterSpec {
    pub fn new(shards: u32, replicas: u32) -> Self {
        ClusterSpec {
            shards,
            replicas,
            port: DEFAULT_PORT,
            node_timeout_ms: 1000,
            config: Vec::new(),
            node_config: None,
        }
    }

    pub fn with_port(mut self, port: u16) -> Self {
        self.port = port;
        self
    }

    pub fn with_node_timeout_ms(mut self, ms: u64) -> Self {
        self.node_timeout_ms = ms;
        self
    }

    /// Adds a setting for every node (`key` without the leading `--`).
    pub fn with_config(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.config.push((key.into(), value.into()));
        self
    }

    /// Sets the per-node settings, e.g.
    /// `|n| vec![("cluster-announce-client-port".into(), (base + flat(n)).to_string())]`.
    pub fn with_node_config(
        mut self,
        f: impl Fn(NodeRef) -> Vec<(String, String)> + Send + Sync + 'static,
    ) -> Self {
        self.node_config = Some(Arc::new(f));
        self
    }

    /// Every node position, shard by shard (the order of [`ValkeyCluster::nodes`]).
    pub fn node_refs(&self) -> impl Iterator<Item = NodeRef> + '_ {
        (0..self.shards).flat_map(move |s| (0..=self.replicas).map(move |n| NodeRef::new(s, n)))
    }

    /// The slots shard `s` gets at start: the `s`-th of `shards` contiguous, even ranges.
    pub fn initial_slots(&self, shard: impl Into<ShardIndex>) -> RangeInclusive<u16> {
        let s = u64::from(shard.into().0);
        let n = u64::from(self.shards.max(1));
        let slots = u64::from(SLOTS);
        let lo = s * slots / n;
        let hi = (s + 1) * slots / n - 1;
        // Both are below SLOTS for s < shards.
        (lo as u16)..=(hi as u16)
    }
}

impl fmt::Debug for ClusterSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterSpec")
            .field("shards", &self.shards)
            .field("replicas", &self.replicas)
            .field("port", &self.port)
            .field("node_timeout_ms", &self.node_timeout_ms)
            .field("config", &self.config)
            .field("node_config", &self.node_config.as_ref().map(|_| "<fn>"))
            .finish()
    }
}

/// Where a restarted node comes back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restart {
    /// The same address: what a restarted process in the same pod sees.
    SameAddress,
    /// A fresh loopback address: what a rescheduled pod sees. The node keeps its id and data.
    NewAddress,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initial_slots_cover_everything_evenly() {
        let spec = ClusterSpec::new(3, 1);
        assert_eq!(spec.initial_slots(0), 0..=5460);
        assert_eq!(spec.initial_slots(1), 5461..=10921);
        assert_eq!(spec.initial_slots(2), 10922..=16383);
        assert_eq!(ClusterSpec::new(1, 0).initial_slots(0), 0..=16383);
        let refs: Vec<_> = spec.node_refs().map(|r| r.to_string()).collect();
        assert_eq!(refs, ["0-0", "0-1", "1-0", "1-1", "2-0", "2-1"]);
    }

    #[test]
    fn a_cluster_can_be_shared_with_a_fault_injecting_thread() {
        fn shareable<T: Send + Sync>() {}
        shareable::<ValkeyCluster>();
    }
}
