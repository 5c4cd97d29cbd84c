//! A running cluster: formation, health, faults and slot migration.

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use shardgate_crds::{NodeRef, ShardIndex};

use super::node::{self, Node};
use super::server::{self, bus_port, BUS_PORT_OFFSET};
use super::view::{parse_cluster_nodes, NodesLine};
use super::{ClusterSpec, Restart, SLOTS};
use crate::{addr, tools};

/// How long formation, and settling after a fault, may take. Generous: two cores may be
/// running several clusters at once.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Keys per MIGRATE round trip.
const MIGRATE_BATCH: usize = 100;

/// A Valkey cluster of local `valkey-server` processes. See the [module docs](super).
pub struct ValkeyCluster {
    spec: ClusterSpec,
    exe: PathBuf,
    root: PathBuf,
    /// Shard by shard, as [`ClusterSpec::node_refs`].
    nodes: Vec<Node>,
    /// Serializes faults, so two threads cannot restart the same node at once.
    ops: Mutex<()>,
}

/// A slot migration in progress: the destination is IMPORTING and the source MIGRATING, so
/// clients get `-ASK` for keys already moved. From [`ValkeyCluster::begin_slot_migration`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotMigration {
    pub slot: u16,
    /// The source primary.
    pub from: NodeRef,
    /// The destination primary.
    pub to: NodeRef,
}

impl ValkeyCluster {
    /// Starts the nodes, forms the cluster (slots in even contiguous ranges, node `s-0` the
    /// primary of shard `s`, the others its replicas) and waits until it is healthy (see
    /// [`wait_healthy`](Self::wait_healthy)).
    pub fn start(spec: ClusterSpec) -> Result<Self> {
        ensure!(
            (1..=u32::from(SLOTS)).contains(&spec.shards),
            "a cluster needs 1 to {SLOTS} shards, not {}",
            spec.shards
        );
        ensure!(
            spec.port != 0 && bus_port(spec.port).is_some(),
            "port {} leaves no room for the cluster bus port (port + {BUS_PORT_OFFSET})",
            spec.port
        );
        crate::procs::reap_strays_once();
        let exe = tools::valkey_server()?;
        let root = crate::procs::new_root_dir("")?;
        // From here on, Drop cleans up whatever has been started.
        let mut cluster = ValkeyCluster {
            spec,
            exe,
            root,
            nodes: Vec::new(),
            ops: Mutex::new(()),
        };
        let port = cluster.spec.port;
        for pos in cluster.spec.node_refs().collect::<Vec<_>>() {
            let ip = addr::node_ip(&[port, port + BUS_PORT_OFFSET])?;
            let dir = cluster.root.join(pos.to_string());
            std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let config = cluster.launch_config(pos, ip, &dir, &[]);
            let child = node::spawn(&cluster.exe, &dir, &config)
                .with_context(|| format!("starting node {pos} on {ip}:{port}"))?;
            cluster.nodes.push(Node::new(pos, ip, port, dir, child));
        }
        for node in &mut cluster.nodes {
            node::wait_ready(node)?;
            node.node_id = node.query(&["CLUSTER", "MYID"])?;
        }
        cluster.form()?;
        Ok(cluster)
    }

    /// The command-line settings of a node: the harness's, then the spec's, then the node's,
    /// then those set at runtime. Valkey applies them in order, so later ones win.
    fn launch_config(
        &self,
        pos: NodeRef,
        ip: Ipv4Addr,
        dir: &Path,
        runtime: &[(String, String)],
    ) -> Vec<(String, String)> {
        let harness = [
            ("port", self.spec.port.to_string().as_str()),
            ("cluster-enabled", "yes"),
            (
                "cluster-node-timeout",
                &self.spec.node_timeout_ms.to_string(),
            ),
            ("cluster-config-file", "nodes.conf"),
            ("dir", &dir.display().to_string()),
            // So that no acknowledged write is lost across a restart.
            ("appendonly", "yes"),
            ("save", ""),
            ("daemonize", "no"),
            ("protected-mode", "no"),
            ("enable-debug-command", "yes"),
            // Nodes stay in their shard: a primary that loses its last slot stays a primary.
            ("cluster-allow-replica-migration", "no"),
            // A replica can always take over, however long it was cut off.
            ("cluster-replica-validity-factor", "0"),
            // Full syncs start at once instead of after 5 s.
            ("repl-diskless-sync-delay", "0"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        // Its own address, and the harness marker of `--dir` kept in /proc/<pid>/cmdline.
        let local = server::local_settings(ip).map(|(k, v)| (k.to_string(), v));
        let per_node = self
            .spec
            .node_config
            .as_ref()
            .map(|f| f(pos))
            .unwrap_or_default();
        local
            .into_iter()
            .chain(harness)
            .chain(self.spec.config.iter().cloned())
            .chain(per_node)
            .chain(runtime.iter().cloned())
            .collect()
    }

    /// Distinct config epochs, slots, MEET, REPLICATE; then waits until healthy.
    fn form(&self) -> Result<()> {
        // Distinct epochs up front spare the cluster the epoch-collision dance.
        for (i, node) in self.nodes.iter().enumerate() {
            node.query::<()>(&["CLUSTER", "SET-CONFIG-EPOCH", &(i + 1).to_string()])?;
        }
        for shard in 0..self.spec.shards {
            let slots = self.spec.initial_slots(shard);
            self.node(NodeRef::new(shard, 0)).query::<()>(&[
                "CLUSTER",
                "ADDSLOTSRANGE",
                &slots.start().to_string(),
                &slots.end().to_string(),
            ])?;
        }
        let first = &self.nodes[0];
        for other in &self.nodes[1..] {
            first.query::<()>(&[
                "CLUSTER",
                "MEET",
                &other.ip().to_string(),
                &other.port.to_string(),
            ])?;
        }
        // REPLICATE needs the replica to know its primary.
        self.wait_for(
            "every node to know every other node",
            SETTLE_TIMEOUT,
            || {
                let mut problems = Vec::new();
                for node in &self.nodes {
                    match self.view(node.pos) {
                        Ok(view) => {
                            for other in &self.nodes {
                                match view.iter().find(|l| l.id == other.node_id) {
                                    None => problems.push(format!(
                                        "node {} does not know node {} yet",
                                        node.pos, other.pos
                                    )),
                                    Some(line) if line.is_troubled() => problems.push(format!(
                                        "node {} sees node {} as {}",
                                        node.pos,
                                        other.pos,
                                        line.flags.join(",")
                                    )),
                                    Some(_) => {}
                                }
                            }
                        }
                        Err(e) => problems.push(format!("{e:#}")),
                    }
                }
                problems
            },
        )?;
        for node in self.nodes.iter().filter(|n| n.pos.node.0 > 0) {
            let primary = self.node(NodeRef::new(node.pos.shard.0, 0));
            node.query::<()>(&["CLUSTER", "REPLICATE", &primary.node_id])?;
        }
        self.wait_healthy(SETTLE_TIMEOUT)
    }

    /// The spec the cluster was started with.
    pub fn spec(&self) -> &ClusterSpec {
        &self.spec
    }

    /// The directory holding every node's directory (`<tmp>/shardgate-harness-<pid>-<n>`).
    pub fn root_dir(&self) -> &Path {
        &self.root
    }

    /// All nodes, shard by shard (`0-0, 0-1, ..., 1-0, ...`).
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// The node at `pos`.
    ///
    /// # Panics
    /// If the cluster has no such node.
    pub fn node(&self, pos: NodeRef) -> &Node {
        let stride = self.spec.replicas + 1;
        assert!(
            pos.shard.0 < self.spec.shards && pos.node.0 < stride,
            "node {pos} does not exist in a cluster of {} shards x {} replicas",
            self.spec.shards,
            self.spec.replicas
        );
        &self.nodes[(pos.shard.0 * stride + pos.node.0) as usize]
    }

    /// The node with Valkey id `id`.
    pub fn node_by_id(&self, id: &str) -> Option<&Node> {
        self.nodes.iter().find(|n| n.node_id == id)
    }

    /// Node `pos`'s `CLUSTER NODES`, parsed.
    pub fn view(&self, pos: NodeRef) -> Result<Vec<NodesLine>> {
        let text: String = self.node(pos).query(&["CLUSTER", "NODES"])?;
        parse_cluster_nodes(&text).with_context(|| format!("CLUSTER NODES of node {pos}"))
    }

    /// The live primary of `shard`, asked from Valkey (`ROLE`): after a failover it is no
    /// longer node `s-0`. If two nodes of the shard claim to be primary (an old primary back
    /// before it learned of the failover), the one with the higher config epoch.
    pub fn primary_of(&self, shard: impl Into<ShardIndex>) -> Result<NodeRef> {
        let shard = shard.into();
        let mut best: Option<(u64, NodeRef)> = None;
        for node in self
            .nodes
            .iter()
            .filter(|n| n.pos.shard == shard && n.is_running())
        {
            if node.role()? != "master" {
                continue;
            }
            let epoch = self
                .view(node.pos)?
                .iter()
                .find(|l| l.is_myself())
                .map_or(0, |l| l.config_epoch);
            if best.is_none_or(|(e, _)| epoch > e) {
                best = Some((epoch, node.pos));
            }
        }
        best.map(|(_, pos)| pos)
            .with_context(|| format!("shard {shard} has no running primary"))
    }

    /// The node that owns `slot`, in the view of the first running node.
    pub fn slot_owner(&self, slot: u16) -> Result<NodeRef> {
        ensure!(slot < SLOTS, "slot {slot} is out of range");
        let asked = self
            .nodes
            .iter()
            .find(|n| n.is_running())
            .context("no node is running")?;
        let view = self.view(asked.pos)?;
        let owner = view
            .iter()
            .find(|l| l.is_primary() && l.owns(slot))
            .with_context(|| format!("node {} sees no owner of slot {slot}", asked.pos))?;
        self.node_by_id(&owner.id).map(|n| n.pos).with_context(|| {
            format!(
                "node {} sees slot {slot} owned by {}, which is not a node of this cluster",
                asked.pos, owner.id
            )
        })
    }

    // ---------------------------------------------------------------- health

    /// Waits until the cluster is healthy:
    /// - every running node reports `cluster_state:ok`,
    /// - every running node knows every running node, connected and without `fail`, `fail?`,
    ///   `handshake` or `noaddr`, and knows no node outside the cluster,
    /// - all running nodes agree on every running node's address, role, primary and slots,
    /// - all 16384 slots are owned by running primaries,
    /// - every running replica has `master_link_status:up`.
    ///
    /// Nodes that are not running are ignored (others may see them as failed).
    pub fn wait_healthy(&self, timeout: Duration) -> Result<()> {
        self.wait_for("the cluster to be healthy", timeout, || {
            self.health_problems()
        })
    }

    /// Polls `check` (a list of problems, empty when satisfied) until it is satisfied, or
    /// fails with the last problems. Fails at once if a node died on its own.
    fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        mut check: impl FnMut() -> Vec<String>,
    ) -> Result<()> {
        let start = Instant::now();
        loop {
            for node in &self.nodes {
                if let Some(status) = node.unexpected_exit() {
                    bail!(
                        "node {} ({}) exited on its own ({status}) while waiting for {what}; \
                         log tail:\n{}",
                        node.pos,
                        node.addr(),
                        node.log_tail(30)
                    );
                }
            }
            let problems = check();
            if problems.is_empty() {
                return Ok(());
            }
            if start.elapsed() > timeout {
                bail!(
                    "timed out after {timeout:?} waiting for {what}:\n  {}",
                    problems.join("\n  ")
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Everything that keeps the cluster from being healthy right now.
    fn health_problems(&self) -> Vec<String> {
        let running: Vec<&Node> = self.nodes.iter().filter(|n| n.is_running()).collect();
        if running.is_empty() {
            return vec!["no node is running".to_string()];
        }
        let mut problems = Vec::new();
        // What each running node says about the running nodes: id -> (address, primary,
        // primary's id, slots).
        type Facts = BTreeMap<String, (String, bool, Option<String>, Vec<(u16, u16)>)>;
        let mut views: Vec<(NodeRef, Vec<NodesLine>, Facts)> = Vec::new();
        for node in &running {
            let name = format!("node {} ({})", node.pos, node.addr());
            match node.info_field("cluster", "cluster_state") {
                Ok(Some(state)) if state == "ok" => {}
                Ok(state) => problems.push(format!(
                    "{name}: cluster_state:{}",
                    state.as_deref().unwrap_or("(missing)")
                )),
                Err(e) => {
                    problems.push(format!("{e:#}"));
                    continue;
                }
            }
            let view = match self.view(node.pos) {
                Ok(view) => view,
                Err(e) => {
                    problems.push(format!("{e:#}"));
                    continue;
                }
            };
            match view.iter().find(|l| l.is_myself()) {
                Some(me) if me.id == node.node_id => {
                    if !me.is_primary() {
                        match node.info_field("replication", "master_link_status") {
                            Ok(Some(s)) if s == "up" => {}
                            Ok(s) => problems.push(format!(
                                "{name} is a replica with master_link_status:{}",
                                s.as_deref().unwrap_or("(missing)")
                            )),
                            Err(e) => problems.push(format!("{e:#}")),
                        }
                    }
                }
                _ => problems.push(format!(
                    "{name}: CLUSTER NODES has no myself line with its id"
                )),
            }
            problems.extend(self.replicas_missing_from_slots(node, &name, &view));
            for line in &view {
                if self.node_by_id(&line.id).is_none() {
                    problems.push(format!(
                        "{name} sees a node outside the cluster: {} {} {}",
                        line.id,
                        line.address,
                        line.flags.join(",")
                    ));
                }
            }
            let mut facts = Facts::new();
            for other in &running {
                match view.iter().find(|l| l.id == other.node_id) {
                    None => problems.push(format!("{name} does not know node {}", other.pos)),
                    Some(line) => {
                        if line.is_troubled() {
                            problems.push(format!(
                                "{name} sees node {} as {}",
                                other.pos,
                                line.flags.join(",")
                            ));
                        } else if !line.connected && !line.is_myself() {
                            problems.push(format!("{name} has no link to node {}", other.pos));
                        }
                        facts.insert(
                            line.id.clone(),
                            (
                                line.address.clone(),
                                line.is_primary(),
                                line.master.clone(),
                                line.slots.clone(),
                            ),
                        );
                    }
                }
            }
            views.push((node.pos, view, facts));
        }
        let Some((first_pos, first_view, first_facts)) = views.first() else {
            return problems;
        };
        for (pos, _, facts) in &views[1..] {
            for (id, fact) in facts {
                if let Some(theirs) = first_facts.get(id).filter(|f| *f != fact) {
                    let about = self
                        .node_by_id(id)
                        .map_or(id.clone(), |n| n.pos.to_string());
                    problems.push(format!(
                        "nodes {first_pos} and {pos} disagree about node {about}: {theirs:?} vs {fact:?}"
                    ));
                }
            }
        }
        // Slot coverage by running primaries, in the first node's view.
        let mut covered = vec![false; usize::from(SLOTS)];
        for line in first_view.iter().filter(|l| l.is_primary()) {
            let owner = self.node_by_id(&line.id);
            for &(lo, hi) in &line.slots {
                if owner.is_some_and(|n| running.iter().any(|r| r.pos == n.pos)) {
                    covered[usize::from(lo)..=usize::from(hi)].fill(true);
                } else {
                    let who = owner.map_or(line.id.clone(), |n| n.pos.to_string());
                    problems.push(format!(
                        "slots {lo}-{hi} are owned by node {who}, which is not running"
                    ));
                }
            }
        }
        if let Some(first_gap) = covered.iter().position(|c| !c) {
            let gaps = covered.iter().filter(|c| !**c).count();
            problems.push(format!(
                "{gaps} slots have no running owner (the first is {first_gap})"
            ));
        }
        problems
    }

    /// The running replicas of slot-owning primaries that `node`'s CLUSTER SLOTS leaves
    /// out. Valkey lists a replica there only once it knows the replica's replication
    /// offset to be past 0 (from gossip, a ping after the sync), which can come after
    /// `master_link_status:up`: a test that reads the topology right after the cluster
    /// started once saw a replica missing.
    fn replicas_missing_from_slots(
        &self,
        node: &Node,
        name: &str,
        view: &[NodesLine],
    ) -> Vec<String> {
        let slots = match node.query::<redis::Value>(&["CLUSTER", "SLOTS"]) {
            Ok(slots) => slots,
            Err(e) => return vec![format!("{e:#}")],
        };
        let mut listed = Vec::new();
        strings_in(&slots, &mut listed);
        view.iter()
            .filter(|line| {
                let serves = line
                    .master
                    .as_ref()
                    .and_then(|m| view.iter().find(|p| &p.id == m))
                    .is_some_and(|p| !p.slots.is_empty());
                let running = self.node_by_id(&line.id).is_some_and(Node::is_running);
                serves && running && !listed.contains(&line.id)
            })
            .map(|line| {
                format!(
                    "{name}: CLUSTER SLOTS does not list replica {} yet",
                    line.id
                )
            })
            .collect()
    }

    // ---------------------------------------------------------------- faults

    fn lock_ops(&self) -> std::sync::MutexGuard<'_, ()> {
        self.ops.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// SIGKILLs node `pos` (no AOF flush, no goodbye to the cluster). Returns at once: the
    /// others notice after the node timeout, and a replica may take over.
    pub fn kill(&self, pos: NodeRef) {
        let _ops = self.lock_ops();
        node::kill(&mut self.node(pos).lock());
    }

    /// Pauses writes on primary `pos` (`CLIENT PAUSE <pause> WRITE`: writers wait, nothing
    /// fails) and waits until every replica has acknowledged its whole replication stream,
    /// so a [`kill`](Self::kill) right after loses no write the primary acknowledged: what a
    /// forced failover may lose to asynchronous replication is Valkey's, not a proxy's.
    pub fn pause_writes_until_replicated(&self, pos: NodeRef, pause: Duration) -> Result<()> {
        let node = self.node(pos);
        node.query::<()>(&["CLIENT", "PAUSE", &pause.as_millis().to_string(), "WRITE"])?;
        self.wait_for(
            &format!("the replicas of node {pos} to catch up"),
            pause,
            || {
                let info: String = match node.query(&["INFO", "replication"]) {
                    Ok(info) => info,
                    Err(e) => return vec![format!("{e:#}")],
                };
                let head = info
                    .lines()
                    .find_map(|l| l.trim_end().strip_prefix("master_repl_offset:"))
                    .unwrap_or("?")
                    .to_string();
                let replicas: Vec<&str> = info
                    .lines()
                    .filter(|l| l.starts_with("slave") && l.contains("offset="))
                    .collect();
                let mut problems = Vec::new();
                if replicas.is_empty() {
                    problems.push(format!("node {pos} has no replica"));
                }
                for r in replicas {
                    let offset = r
                        .split(',')
                        .find_map(|f| f.strip_prefix("offset="))
                        .unwrap_or("?");
                    if offset != head {
                        problems.push(format!("{} behind master_repl_offset {head}", r.trim()));
                    }
                }
                problems
            },
        )
    }

    /// Stops node `pos` gracefully with `SHUTDOWN` (the AOF is flushed). Returns once the
    /// process has exited; does not wait for the cluster to settle.
    pub fn stop(&self, pos: NodeRef) -> Result<()> {
        let _ops = self.lock_ops();
        self.stop_locked(pos)
    }

    fn stop_locked(&self, pos: NodeRef) -> Result<()> {
        let node = self.node(pos);
        if !node.is_running() {
            node::kill(&mut node.lock());
            return Ok(());
        }
        // The connection closes under the reply; only a refusal is an error worth keeping.
        let reply = node.query::<()>(&["SHUTDOWN"]);
        let mut state = node.lock();
        if node::wait_exit(&mut state, Duration::from_secs(20)) {
            return Ok(());
        }
        node::kill(&mut state);
        drop(state);
        bail!(
            "node {pos} did not exit after SHUTDOWN ({}), so it was killed; log tail:\n{}",
            reply
                .err()
                .map_or("no error".to_string(), |e| format!("{e:#}")),
            node.log_tail(20)
        )
    }

    /// Restarts node `pos` (stopping it gracefully first if it runs) with the same id and
    /// data, at the same or a new address, and waits until the cluster is healthy again.
    ///
    /// With [`Restart::NewAddress`] the node gets a fresh loopback address and every other
    /// running node sends it `CLUSTER MEET`: the others update the address they have for it,
    /// and the node learns its own new address (a node learns its IP from incoming MEETs).
    pub fn restart(&self, pos: NodeRef, how: Restart) -> Result<()> {
        let _ops = self.lock_ops();
        let node = self.node(pos);
        if node.is_running() {
            self.stop_locked(pos)?;
        }
        {
            let mut state = node.lock();
            node::kill(&mut state);
            if how == Restart::NewAddress {
                let old = state.ip;
                state.ip = addr::node_ip(&[node.port, node.port + BUS_PORT_OFFSET])?;
                tracing::info!("node {pos} moves from {old} to {}", state.ip);
            }
            let config = self.launch_config(pos, state.ip, &node.dir, &state.runtime_config);
            state.child = Some(
                node::spawn(&self.exe, &node.dir, &config)
                    .with_context(|| format!("restarting node {pos}"))?,
            );
        }
        node::wait_ready(node)?;
        let id: String = node.query(&["CLUSTER", "MYID"])?;
        ensure!(
            id == node.node_id,
            "node {pos} came back with id {id}, not {}; log tail:\n{}",
            node.node_id,
            node.log_tail(20)
        );
        if how == Restart::NewAddress {
            let (ip, port) = (node.ip().to_string(), node.port.to_string());
            for other in self.nodes.iter().filter(|n| n.pos != pos && n.is_running()) {
                other.query::<()>(&["CLUSTER", "MEET", &ip, &port])?;
            }
        }
        self.wait_healthy(SETTLE_TIMEOUT)
            .with_context(|| format!("after restarting node {pos} ({how:?})"))
    }

    /// Makes replica `pos` the primary of its shard with `CLUSTER FAILOVER` (`FORCE` if its
    /// primary is not running), and waits until it is primary and the cluster is healthy.
    pub fn failover(&self, pos: NodeRef) -> Result<()> {
        let _ops = self.lock_ops();
        let node = self.node(pos);
        ensure!(node.is_running(), "node {pos} is not running");
        ensure!(
            node.role()? != "master",
            "node {pos} is already a primary; failover needs a replica"
        );
        let view = self.view(pos)?;
        let primary_id = view
            .iter()
            .find(|l| l.is_myself())
            .and_then(|l| l.master.clone())
            .with_context(|| format!("node {pos} does not name its primary"))?;
        let primary_running = self.node_by_id(&primary_id).is_some_and(Node::is_running);
        let mut args = vec!["CLUSTER", "FAILOVER"];
        if !primary_running {
            args.push("FORCE");
        }
        // A manual failover can time out (e.g. the primary is slow to pause clients); retry.
        let mut promoted = false;
        for _ in 0..3 {
            node.query::<()>(&args)?;
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if node.role()? == "master" {
                    promoted = true;
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            if promoted {
                break;
            }
        }
        ensure!(
            promoted,
            "node {pos} did not become primary after {}; log tail:\n{}",
            args.join(" "),
            node.log_tail(20)
        );
        self.wait_healthy(SETTLE_TIMEOUT)
            .with_context(|| format!("after failing over to node {pos}"))
    }

    // ---------------------------------------------------------------- slots

    /// Moves `slot` and its keys to the primary of shard `to`, with the full
    /// IMPORTING / MIGRATING / MIGRATE / SETSLOT NODE sequence (SETSLOT NODE alone does not
    /// bump the epoch), and waits until the cluster is healthy and agrees on the new owner.
    pub fn migrate_slot(&self, slot: u16, to: impl Into<ShardIndex>) -> Result<()> {
        let to = to.into();
        if self.slot_owner(slot)?.shard == to {
            return Ok(());
        }
        let migration = self.begin_slot_migration(slot, to)?;
        self.finish_slot_migration(&migration)
    }

    /// Starts moving `slot` to the primary of shard `to`: `SETSLOT IMPORTING` on the
    /// destination, `SETSLOT MIGRATING` on the source. Moves no keys; see
    /// [`migrate_keys`](Self::migrate_keys) and [`finish_slot_migration`](Self::finish_slot_migration).
    pub fn begin_slot_migration(
        &self,
        slot: u16,
        to: impl Into<ShardIndex>,
    ) -> Result<SlotMigration> {
        let _ops = self.lock_ops();
        let to = to.into();
        let from = self.slot_owner(slot)?;
        let dest = self.primary_of(to)?;
        ensure!(
            from != dest,
            "slot {slot} is already on node {dest} (shard {to})"
        );
        let slot_s = slot.to_string();
        let (src, dst) = (self.node(from), self.node(dest));
        dst.query::<()>(&["CLUSTER", "SETSLOT", &slot_s, "IMPORTING", &src.node_id])?;
        src.query::<()>(&["CLUSTER", "SETSLOT", &slot_s, "MIGRATING", &dst.node_id])?;
        Ok(SlotMigration {
            slot,
            from,
            to: dest,
        })
    }

    /// Moves the given keys (which must be in the migrating slot) from the source to the
    /// destination with `MIGRATE`; keys that are not on the source are skipped.
    pub fn migrate_keys(&self, migration: &SlotMigration, keys: &[&[u8]]) -> Result<()> {
        for key in keys {
            ensure!(
                super::key_slot(key) == migration.slot,
                "key {:?} is in slot {}, not in the migrating slot {}",
                String::from_utf8_lossy(key),
                super::key_slot(key),
                migration.slot
            );
        }
        for batch in keys.chunks(MIGRATE_BATCH) {
            self.migrate_batch(migration, batch)?;
        }
        Ok(())
    }

    fn migrate_batch(&self, migration: &SlotMigration, keys: &[&[u8]]) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let (src, dst) = (self.node(migration.from), self.node(migration.to));
        let mut cmd = redis::cmd("MIGRATE");
        cmd.arg(dst.ip().to_string())
            .arg(dst.port)
            .arg("")
            .arg(0)
            .arg(10_000)
            .arg("KEYS");
        for key in keys {
            cmd.arg(*key);
        }
        // "OK", or "NOKEY" if none of the keys was there.
        src.query_cmd::<String>(&cmd).with_context(|| {
            format!(
                "MIGRATE of {} keys of slot {} from node {} to node {}",
                keys.len(),
                migration.slot,
                migration.from,
                migration.to
            )
        })?;
        Ok(())
    }

    /// Moves the slot's remaining keys, assigns the slot to the destination with
    /// `SETSLOT NODE` (destination, source, then every other running primary), and waits
    /// until the cluster is healthy and agrees on the new owner.
    pub fn finish_slot_migration(&self, migration: &SlotMigration) -> Result<()> {
        let _ops = self.lock_ops();
        let slot_s = migration.slot.to_string();
        let (src, dst) = (self.node(migration.from), self.node(migration.to));
        loop {
            let keys: Vec<Vec<u8>> = src.query(&[
                "CLUSTER",
                "GETKEYSINSLOT",
                &slot_s,
                &MIGRATE_BATCH.to_string(),
            ])?;
            if keys.is_empty() {
                break;
            }
            let keys: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
            self.migrate_batch(migration, &keys)?;
        }
        let setslot = ["CLUSTER", "SETSLOT", &slot_s, "NODE", &dst.node_id];
        dst.query::<()>(&setslot)?;
        src.query::<()>(&setslot)?;
        for other in &self.nodes {
            if other.pos != migration.from && other.pos != migration.to && other.is_running() {
                // Replicas learn it from their primary; only primaries take SETSLOT.
                if other.role()? == "master" {
                    other.query::<()>(&setslot)?;
                }
            }
        }
        self.wait_for(
            &format!(
                "every node to see slot {} on node {}",
                migration.slot, migration.to
            ),
            SETTLE_TIMEOUT,
            || {
                let mut problems = Vec::new();
                for node in self.nodes.iter().filter(|n| n.is_running()) {
                    match self.view(node.pos) {
                        Ok(view) => {
                            let owner = view
                                .iter()
                                .find(|l| l.is_primary() && l.owns(migration.slot));
                            if owner.is_none_or(|l| l.id != dst.node_id) {
                                problems.push(format!(
                                    "node {} sees slot {} owned by {:?}",
                                    node.pos,
                                    migration.slot,
                                    owner.map(|l| &l.id)
                                ));
                            }
                        }
                        Err(e) => problems.push(format!("{e:#}")),
                    }
                }
                problems
            },
        )?;
        self.wait_healthy(SETTLE_TIMEOUT)
            .with_context(|| format!("after migrating slot {}", migration.slot))
    }

    // ---------------------------------------------------------------- config

    /// `CONFIG SET key value` on node `pos` if it runs; remembered and applied again at every
    /// restart (also recorded for a stopped node, which gets it at its next start).
    pub fn config_set(&self, pos: NodeRef, key: &str, value: &str) -> Result<()> {
        let node = self.node(pos);
        {
            let mut state = node.lock();
            state.runtime_config.retain(|(k, _)| k != key);
            state
                .runtime_config
                .push((key.to_string(), value.to_string()));
        }
        if node.is_running() {
            node.query::<()>(&["CONFIG", "SET", key, value])?;
        }
        Ok(())
    }

    /// [`config_set`](Self::config_set) on every node.
    pub fn config_set_all(&self, key: &str, value: &str) -> Result<()> {
        for node in &self.nodes {
            self.config_set(node.pos, key, value)?;
        }
        Ok(())
    }

    /// Every node's position by Valkey id, e.g. to map `CLUSTER NODES` lines to nodes.
    pub fn ids(&self) -> HashMap<String, NodeRef> {
        self.nodes
            .iter()
            .map(|n| (n.node_id.clone(), n.pos))
            .collect()
    }
}

impl Drop for ValkeyCluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // The test failed: the nodes' last words are often the explanation.
            for node in &self.nodes {
                eprintln!(
                    "--- valkey node {} ({}) log tail ---\n{}",
                    node.pos,
                    node.addr(),
                    node.log_tail(15)
                );
            }
        }
        for node in &self.nodes {
            node::kill(&mut node.lock());
        }
        if std::env::var_os("SHARDGATE_KEEP_VALKEY_DIRS").is_some() {
            eprintln!("keeping valkey cluster dirs in {}", self.root.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

impl std::fmt::Debug for ValkeyCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ValkeyCluster")
            .field("spec", &self.spec)
            .field("root", &self.root)
            .field("nodes", &self.nodes)
            .finish()
    }
}

/// Every string in a reply, depth first.
fn strings_in(v: &redis::Value, out: &mut Vec<String>) {
    match v {
        redis::Value::BulkString(b) => out.push(String::from_utf8_lossy(b).into_owned()),
        redis::Value::SimpleString(s) => out.push(s.clone()),
        redis::Value::Array(items) | redis::Value::Set(items) => {
            for item in items {
                strings_in(item, out);
            }
        }
        _ => {}
    }
}
