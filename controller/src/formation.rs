//! Cluster formation and healing, by talking RESP to the pods: one step per reconcile.
//!
//! [`step`] looks at every node (its id and its `CLUSTER NODES` view), does the first thing
//! the cluster needs, and says what it did or what it waits for. It is idempotent: a formed
//! cluster is left alone, and a step that was cut short is taken again next time. In order:
//!
//! 1. every pod runs and answers (else wait);
//! 2. a fresh node gets its config epoch (`CLUSTER SET-CONFIG-EPOCH`), so that the first
//!    slot assignment does not start with epoch collisions;
//! 3. nodes the others do not know, or know at an old address (a pod that came back on a
//!    new IP), are introduced (`CLUSTER MEET`), once: not again while the handshake is
//!    under way;
//! 4. nodes no pod has any more (a pod wiped and restarted with a new id) are forgotten on
//!    every node (`CLUSTER FORGET`);
//! 5. slots no node serves are given to their shard's primary (`CLUSTER ADDSLOTSRANGE`):
//!    all of them on a new cluster, the lost ones after a shard lost every copy;
//! 6. a node that is not a replica of its shard's primary becomes one (`CLUSTER
//!    REPLICATE`): new replicas, a wiped node, a replica that lost its primary;
//! 7. formed: every slot served, every node agrees the cluster is ok, each shard has one
//!    primary and its replicas.
//!
//! While shards leave (a scale-in moving their slots away, [`Plan::leaving`]), it heals
//! the nodes that stay (steps 1 to 6) but never forgets a leaving node that answers, moves
//! no slot between the staying shards and does not call the cluster formed: scale-in does
//! those, and formation goes on once the nodes have left.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use shardgate_admin_client::{Client, Dial, NodeLine};
use shardgate_crds::NodeRef;

/// Hash slots in a cluster.
pub const SLOTS: u32 = 16384;

/// The slots shard `shard` of `shards` starts with: an even split, as `valkey-cli --cluster
/// create` makes it.
pub fn initial_slots(shard: u32, shards: u32) -> (u16, u16) {
    // valkey-cli rounds each shard's end to the nearest slot.
    let edge = |s: u32| (2 * SLOTS * s + shards) / (2 * shards);
    (edge(shard) as u16, (edge(shard + 1) - 1) as u16)
}

/// The shard whose initial range holds `slot`.
fn home_shard(slot: u16, shards: u32) -> u32 {
    (0..shards)
        .find(|&s| {
            let (lo, hi) = initial_slots(s, shards);
            (lo..=hi).contains(&slot)
        })
        .unwrap_or(0)
}

/// What formation needs to know of the desired cluster.
#[derive(Debug, Clone)]
pub struct Plan {
    pub shards: u32,
    pub replicas: u32,
    /// Every desired node with its pod's address, if it has one and is ready.
    pub nodes: BTreeMap<NodeRef, Option<SocketAddr>>,
    /// What a node announces to clients instead of its pod's address, if anything (announce
    /// mode: `cluster-announce-client-ipv4` and `-client-port`, or `-client-tls-port` on TLS,
    /// which the operator dials over TLS and so is shown). CLUSTER NODES shows that
    /// address, so that is where the others must know it.
    pub announced: BTreeMap<NodeRef, Announced>,
    /// The pods of nodes on their way out while their shard's slots move away (scale-in):
    /// members still, whom healing must not forget. Empty otherwise.
    pub leaving: Vec<SocketAddr>,
    /// Every pod a node could come back from is among `nodes` (no node is leaving): a node
    /// id that none of them has is gone for good, so a lost primary without a replica may
    /// be forgotten with its slots rather than waited for.
    pub lost_are_gone: bool,
    /// How the nodes are dialled (TLS with `spec.tls`).
    pub dial: Dial,
}

/// A node's announced client address, each part optional (the pod's own otherwise).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Announced {
    pub ip: Option<IpAddr>,
    pub port: Option<u16>,
}

impl Announced {
    /// The address CLUSTER NODES shows for a node whose pod is at `addr`.
    pub fn shown(&self, addr: SocketAddr) -> SocketAddr {
        SocketAddr::new(
            self.ip.unwrap_or(addr.ip()),
            self.port.unwrap_or(addr.port()),
        )
    }
}

/// What a step did, or why it did nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// Nothing to do until something else happens (a pod starts, gossip spreads).
    Waiting(String),
    /// It changed the cluster: look again soon.
    Acted(String),
    /// It started again what the node reported failed (a slot migration): look again
    /// soon, and warn.
    Retried(String),
    /// The cluster is whole.
    Formed(Formed),
}

/// A formed cluster, as observed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Formed {
    /// Each node's id and whether it is its shard's primary now.
    pub nodes: BTreeMap<NodeRef, NodeState>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeState {
    pub id: String,
    pub primary: bool,
    /// It presented the operator's own certificate (`spec.tls`'s Secret's) on this look's
    /// connection: [`crate::tls::reload`] need not dial it again to ask.
    pub current_certificate: bool,
}

impl fmt::Display for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Progress::Waiting(why) => write!(f, "waiting: {why}"),
            Progress::Acted(what) | Progress::Retried(what) => f.write_str(what),
            Progress::Formed(formed) => write!(f, "formed ({} nodes)", formed.nodes.len()),
        }
    }
}

/// Why a step failed: a node misbehaved in a way waiting will not fix.
#[derive(Debug, thiserror::Error)]
pub enum FormationError {
    #[error("node {node} ({addr}): {source}")]
    Node {
        node: NodeRef,
        addr: SocketAddr,
        #[source]
        source: shardgate_admin_client::Error,
    },
}

/// One node, connected, with what it says.
struct Seen {
    node: NodeRef,
    addr: SocketAddr,
    /// Where CLUSTER NODES shows it: `addr`, or the address it announces to clients.
    shown: SocketAddr,
    client: Client,
    id: String,
    view: Vec<NodeLine>,
}

impl Seen {
    fn me(&self) -> Option<&NodeLine> {
        self.view.iter().find(|l| l.is_myself())
    }

    /// Whether this node knows `other` at its current address, past the handshake.
    fn knows(&self, other: &Seen) -> bool {
        self.view.iter().any(|l| {
            l.id == other.id
                && !l.is_joining()
                && l.ip.parse::<IpAddr>().ok() == Some(other.shown.ip())
                && l.port == other.shown.port()
        })
    }

    async fn run(&mut self, args: &[&str]) -> Result<(), FormationError> {
        self.client
            .command(args)
            .await
            .map(|_| ())
            .map_err(|source| FormationError::Node {
                node: self.node,
                addr: self.addr,
                source,
            })
    }
}

/// Takes one step towards the formed cluster `plan` describes.
pub async fn step(plan: &Plan) -> Result<Progress, FormationError> {
    // 1. Every pod runs and answers.
    let mut seen = Vec::new();
    for (&node, addr) in &plan.nodes {
        let Some(addr) = *addr else {
            return Ok(Progress::Waiting(format!("node {node} has no ready pod")));
        };
        let mut client = match Client::dial(addr, &plan.dial).await {
            Ok(c) => c,
            Err(e) => return Ok(Progress::Waiting(format!("node {node} at {addr}: {e}"))),
        };
        let view = match client.cluster_nodes().await {
            Ok(v) => v,
            Err(e) => return Ok(Progress::Waiting(format!("node {node} at {addr}: {e}"))),
        };
        let Some(id) = view.iter().find(|l| l.is_myself()).map(|l| l.id.clone()) else {
            return Ok(Progress::Waiting(format!(
                "node {node} at {addr}: CLUSTER NODES has no myself line"
            )));
        };
        // Where the others are to show it: what it shows itself (its client address,
        // announced by flag or set at run time, which a change of mode can leave behind
        // until the pod rolls); else what its flags say.
        let own = view
            .iter()
            .find(|l| l.is_myself())
            .and_then(|l| Some(SocketAddr::new(l.ip.parse().ok()?, l.port)));
        let shown =
            own.unwrap_or_else(|| plan.announced.get(&node).map_or(addr, |a| a.shown(addr)));
        seen.push(Seen {
            node,
            addr,
            shown,
            client,
            id,
            view,
        });
    }
    if seen.is_empty() {
        return Ok(Progress::Waiting("no nodes".into()));
    }
    // Leaving nodes that answer are members still. (One that does not, and serves no
    // slot, may be forgotten: it is going anyway.)
    let mut leaving_ids = BTreeSet::new();
    for &addr in &plan.leaving {
        let view = async {
            let mut client = Client::dial(addr, &plan.dial).await?;
            client.cluster_nodes().await
        };
        if let Some(me) = view
            .await
            .ok()
            .and_then(|v| v.into_iter().find(|l| l.is_myself()))
        {
            leaving_ids.insert(me.id);
        }
    }

    // 2. Fresh nodes get distinct config epochs before they meet anyone.
    let mut acted = Vec::new();
    for (i, s) in seen.iter_mut().enumerate() {
        let fresh = s.view.len() == 1 && s.me().is_some_and(|m| m.config_epoch == 0);
        if fresh && plan.nodes.len() > 1 {
            let epoch = (i + 1).to_string();
            // A node that met someone meanwhile refuses; that is fine, gossip settles it.
            let _ = s.run(&["CLUSTER", "SET-CONFIG-EPOCH", &epoch]).await;
        }
    }

    // 3. Introduce nodes the others do not know, or know at an old address. The introducer
    // is the node that knows the most nodes (an established cluster member).
    let introducer = (0..seen.len())
        .max_by_key(|&i| (seen[i].view.len(), std::cmp::Reverse(i)))
        .unwrap_or(0);
    let strangers: Vec<(String, SocketAddr)> = seen
        .iter()
        .enumerate()
        .filter(|(i, s)| *i != introducer && !seen[introducer].knows(s))
        .map(|(_, s)| (s.id.clone(), s.addr))
        .collect();
    let mut greeting = Vec::new();
    for (id, addr) in &strangers {
        // Met already, the handshake under way: another MEET would do nothing but say so.
        let handshake = seen[introducer].view.iter().any(|l| {
            l.has_flag("handshake")
                && l.ip.parse::<IpAddr>().ok() == Some(addr.ip())
                && l.port == addr.port()
        });
        if handshake {
            greeting.push(format!("{id:.8} at {addr}"));
            continue;
        }
        let (ip, port) = (addr.ip().to_string(), addr.port().to_string());
        seen[introducer]
            .run(&["CLUSTER", "MEET", &ip, &port])
            .await?;
        acted.push(format!("introduced {id:.8} at {addr}"));
    }
    if !acted.is_empty() {
        return Ok(Progress::Acted(acted.join("; ")));
    }
    if !greeting.is_empty() {
        return Ok(Progress::Waiting(format!(
            "handshake with {} under way",
            greeting.join(", ")
        )));
    }
    // Everyone must know everyone before slots and roles are decided.
    for a in &seen {
        for b in &seen {
            if a.id != b.id && !a.knows(b) {
                return Ok(Progress::Waiting(format!(
                    "node {} does not know node {} yet (gossip)",
                    a.node, b.node
                )));
            }
        }
    }

    // 4. Forget nodes no pod has any more.
    let mut current: BTreeSet<String> = seen.iter().map(|s| s.id.clone()).collect();
    current.append(&mut leaving_ids);
    let gone: BTreeSet<String> = seen
        .iter()
        .flat_map(|s| s.view.iter())
        .filter(|l| !current.contains(&l.id))
        .map(|l| l.id.clone())
        .collect();
    for id in &gone {
        // A lost primary that still holds slots is forgotten only after its replica took
        // them over: the other primaries must remember it to vote for that failover. With
        // no replica left to do so, and no pod that could bring it back, nobody ever will:
        // its slots (their keys are gone with it) are served again, empty, from step 5.
        let holds_slots = seen
            .iter()
            .flat_map(|s| s.view.iter())
            .any(|l| &l.id == id && l.is_primary() && !l.slots.is_empty());
        let live_replica = seen
            .iter()
            .flat_map(|s| s.view.iter())
            .any(|l| l.primary_id.as_deref() == Some(id.as_str()) && current.contains(&l.id));
        let beyond_recovery = plan.lost_are_gone && !live_replica;
        if holds_slots && !beyond_recovery {
            let waiting =
                format!("waiting for a replica to take over the slots of lost node {id:.8}");
            if acted.is_empty() {
                return Ok(Progress::Waiting(waiting));
            }
            continue;
        }
        let mut sent = false;
        for s in seen.iter_mut() {
            if !s.view.iter().any(|l| &l.id == id) {
                continue;
            }
            // A replica refuses to forget its own primary; it is re-attached below and then
            // forgets it next time.
            if s.me().and_then(|m| m.primary_id.as_deref()) == Some(id.as_str()) {
                continue;
            }
            s.run(&["CLUSTER", "FORGET", id]).await?;
            sent = true;
        }
        if sent && holds_slots {
            acted.push(format!(
                "forgot {id:.8}, a primary no pod has any more and no replica can replace: \
                 its slots are lost and will be served again, empty"
            ));
        } else if sent {
            acted.push(format!("forgot {id:.8}, which no pod has any more"));
        }
    }
    if !acted.is_empty() {
        return Ok(Progress::Acted(acted.join("; ")));
    }

    // Each shard's primary: the shard's node that serves slots, per the introducer's view.
    let view = seen[introducer].view.clone();
    let line = |id: &str| view.iter().find(|l| l.id == id);
    let mut primaries: BTreeMap<u32, usize> = BTreeMap::new();
    for (i, s) in seen.iter().enumerate() {
        if line(&s.id).is_some_and(|l| l.is_primary() && !l.slots.is_empty()) {
            if let Some(&other) = primaries.get(&s.node.shard.0) {
                return Ok(Progress::Waiting(format!(
                    "shard {} has two primaries serving slots (nodes {} and {}); \
                     waiting for a failover or a migration to settle",
                    s.node.shard, seen[other].node, s.node
                )));
            }
            primaries.insert(s.node.shard.0, i);
        }
    }
    // A new shard (every node an empty primary: a scale-out) leads with its node 0. A shard
    // with a replica of someone else is not new: it waits for that node or a failover,
    // rather than have a node with data replicate an empty one.
    for shard in 0..plan.shards {
        if primaries.contains_key(&shard) {
            continue;
        }
        let members: Vec<usize> = (0..seen.len())
            .filter(|&i| seen[i].node.shard.0 == shard)
            .collect();
        let ids: Vec<&str> = members.iter().map(|&i| seen[i].id.as_str()).collect();
        // New: nobody serves slots, and every node is an empty primary or a replica of one
        // of the shard's own nodes.
        let fresh = !members.is_empty()
            && members.iter().all(|&i| {
                seen[i].me().is_some_and(|m| {
                    m.slots.is_empty()
                        && (m.is_primary()
                            || m.primary_id.as_deref().is_some_and(|p| ids.contains(&p)))
                })
            });
        if fresh {
            let lead = members
                .iter()
                .find(|&&i| {
                    seen[i].me().is_some_and(|m| m.is_primary()) && seen[i].node.node.0 == 0
                })
                .or_else(|| {
                    members
                        .iter()
                        .find(|&&i| seen[i].me().is_some_and(|m| m.is_primary()))
                });
            if let Some(&lead) = lead {
                primaries.insert(shard, lead);
            }
        }
    }

    // 5. Slots nobody serves go to their shard's primary, or its node 0 on a new shard.
    // Served as far as anyone knows: the introducer's view and each node's own (gossip may
    // not have carried a fresh assignment to the introducer yet).
    let mut served = vec![false; SLOTS as usize];
    let own = seen.iter().filter_map(|s| s.me());
    for l in view.iter().chain(own) {
        if l.is_primary() {
            for &(a, b) in &l.slots {
                for slot in a..=b {
                    served[usize::from(slot)] = true;
                }
            }
        }
    }
    let mut missing: BTreeMap<u32, Vec<(u16, u16)>> = BTreeMap::new();
    let mut slot = 0u32;
    while slot < SLOTS {
        if served[slot as usize] {
            slot += 1;
            continue;
        }
        let start = slot as u16;
        let shard = home_shard(start, plan.shards);
        let (_, home_hi) = initial_slots(shard, plan.shards);
        while slot < SLOTS && !served[slot as usize] && slot <= u32::from(home_hi) {
            slot += 1;
        }
        missing
            .entry(shard)
            .or_default()
            .push((start, (slot - 1) as u16));
    }
    for (shard, ranges) in &missing {
        let owner = match primaries.get(shard) {
            Some(&i) => i,
            None => match seen
                .iter()
                .position(|s| s.node.shard.0 == *shard && s.node.node.0 == 0)
            {
                Some(i) => i,
                None => continue,
            },
        };
        // A replica cannot take slots; it would be reset first, which is not ours to do.
        if line(&seen[owner].id).is_some_and(|l| !l.is_primary()) {
            return Ok(Progress::Waiting(format!(
                "slots of shard {shard} are not served and its node {} is a replica",
                seen[owner].node
            )));
        }
        let mut args = vec!["CLUSTER".to_string(), "ADDSLOTSRANGE".to_string()];
        for (a, b) in ranges {
            args.push(a.to_string());
            args.push(b.to_string());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        seen[owner].run(&args).await?;
        let count: u32 = ranges
            .iter()
            .map(|(a, b)| u32::from(*b) - u32::from(*a) + 1)
            .sum();
        acted.push(format!(
            "assigned {count} slots to shard {shard} (node {})",
            seen[owner].node
        ));
    }
    if !acted.is_empty() {
        return Ok(Progress::Acted(acted.join("; ")));
    }

    // 6. Every other node of a shard replicates its primary.
    for i in 0..seen.len() {
        let shard = seen[i].node.shard.0;
        let Some(&p) = primaries.get(&shard) else {
            return Ok(Progress::Waiting(format!(
                "shard {shard} has no primary yet"
            )));
        };
        if p == i {
            continue;
        }
        let primary_id = seen[p].id.clone();
        let me = seen[i].me().cloned();
        let attached = me
            .as_ref()
            .is_some_and(|m| m.primary_id.as_deref() == Some(primary_id.as_str()));
        if attached {
            continue;
        }
        if me.as_ref().is_some_and(|m| !m.slots.is_empty()) {
            return Ok(Progress::Waiting(format!(
                "node {} serves slots but shard {shard}'s primary is node {}",
                seen[i].node, seen[p].node
            )));
        }
        seen[i].run(&["CLUSTER", "REPLICATE", &primary_id]).await?;
        acted.push(format!(
            "node {} now replicates node {}",
            seen[i].node, seen[p].node
        ));
    }
    if !acted.is_empty() {
        return Ok(Progress::Acted(acted.join("; ")));
    }
    if !plan.leaving.is_empty() {
        return Ok(Progress::Waiting(
            "the staying nodes are whole; the rest waits for the leaving nodes to go".into(),
        ));
    }

    // 6b. Slots live with their shard: after a scale-out, each primary hands the slots
    // outside its even share to their new shard with Valkey 9's atomic slot migration
    // (`CLUSTER MIGRATESLOTS`: keys move with the slots, writes keep being served, no
    // acknowledged write is lost).
    let mut moves: BTreeMap<usize, BTreeMap<usize, Vec<(u16, u16)>>> = BTreeMap::new();
    for (&shard, &p) in &primaries {
        // The slots it serves by its own word: the introducer may not have heard yet of a
        // migration that just moved some away (Valkey refuses to move a slot not served).
        let Some(me) = seen[p].me() else {
            continue;
        };
        for (home, range) in by_home_shard(&me.slots, plan.shards) {
            if home != shard {
                let Some(&dst) = primaries.get(&home) else {
                    return Ok(Progress::Waiting(format!(
                        "shard {home} has no primary to take its slots yet"
                    )));
                };
                moves
                    .entry(p)
                    .or_default()
                    .entry(dst)
                    .or_default()
                    .push(range);
            }
        }
    }
    let (mut retried, mut waiting) = (false, Vec::new());
    for (src, targets) in &moves {
        let (node, addr) = (seen[*src].node, seen[*src].addr);
        let history = migrations(&mut seen[*src].client)
            .await
            .map_err(|source| FormationError::Node { node, addr, source })?;
        // A source that must wait does not hold back the others.
        let again = match history {
            Migrations::Idle => None,
            Migrations::Running(state) => {
                waiting.push(format!("node {node} is migrating slots ({state})"));
                continue;
            }
            Migrations::Failed(failed) if !failed.retry_in.is_zero() => {
                waiting.push(format!("node {node}'s {failed}"));
                continue;
            }
            Migrations::Failed(failed) => Some(failed),
        };
        let (args, count) = migrate_slots(
            targets
                .iter()
                .map(|(dst, ranges)| (ranges.as_slice(), seen[*dst].id.as_str())),
        );
        let to: Vec<String> = targets
            .keys()
            .map(|dst| seen[*dst].node.shard.to_string())
            .collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        seen[*src].run(&args).await?;
        let mut what = format!(
            "migrating {count} slots from shard {} to shard {}",
            node.shard,
            to.join(", ")
        );
        if let Some(failed) = again {
            retried = true;
            what.push_str(&format!(" again: {failed}"));
        }
        acted.push(what);
    }
    if !acted.is_empty() {
        let what = acted.join("; ");
        return Ok(if retried {
            Progress::Retried(what)
        } else {
            Progress::Acted(what)
        });
    }
    if !waiting.is_empty() {
        return Ok(Progress::Waiting(waiting.join("; ")));
    }

    // 7. Formed when every node says so.
    for s in seen.iter_mut() {
        let info = match s.client.cluster_info().await {
            Ok(i) => i,
            Err(e) => return Ok(Progress::Waiting(format!("node {}: {e}", s.node))),
        };
        if info.get("cluster_state").map(String::as_str) != Some("ok") {
            return Ok(Progress::Waiting(format!(
                "node {} reports cluster_state {}",
                s.node,
                info.get("cluster_state").map_or("?", |v| v)
            )));
        }
    }
    // Replicas hold a copy: their link to the primary is up (a replica that never synced
    // cannot take over).
    for (i, s) in seen.iter_mut().enumerate() {
        if primaries.get(&s.node.shard.0) == Some(&i) {
            continue;
        }
        let info = match s.client.info("replication").await {
            Ok(i) => i,
            Err(e) => return Ok(Progress::Waiting(format!("node {}: {e}", s.node))),
        };
        if info.get("master_link_status").map(String::as_str) != Some("up") {
            return Ok(Progress::Waiting(format!(
                "node {} is still copying its primary's data",
                s.node
            )));
        }
    }
    for s in &seen {
        if s.view
            .iter()
            .any(|l| !l.is_myself() && (!l.connected || l.is_failing()))
        {
            return Ok(Progress::Waiting(format!(
                "node {} sees a node failing or disconnected",
                s.node
            )));
        }
    }
    let own = plan
        .dial
        .tls
        .as_ref()
        .and_then(shardgate_admin_client::tls::Tls::certificate);
    Ok(Progress::Formed(Formed {
        nodes: seen
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let primary = primaries.get(&s.node.shard.0) == Some(&i);
                (
                    s.node,
                    NodeState {
                        id: s.id.clone(),
                        primary,
                        current_certificate: own.is_some() && s.client.peer_certificate() == own,
                    },
                )
            })
            .collect(),
    }))
}

/// `ranges` cut where the initial ranges of a cluster of `shards` shards meet: each piece
/// with the shard whose initial range holds it.
pub fn by_home_shard(ranges: &[(u16, u16)], shards: u32) -> Vec<(u32, (u16, u16))> {
    let mut out = Vec::new();
    for &(a, b) in ranges {
        let mut slot = u32::from(a);
        while slot <= u32::from(b) {
            let home = home_shard(slot as u16, shards);
            let (_, home_hi) = initial_slots(home, shards);
            let end = u32::from(b).min(u32::from(home_hi));
            out.push((home, (slot as u16, end as u16)));
            slot = end + 1;
        }
    }
    out
}

/// `CLUSTER MIGRATESLOTS` with a `SLOTSRANGE ... NODE <id>` group per destination, and
/// how many slots it moves.
pub fn migrate_slots<'a>(
    groups: impl IntoIterator<Item = (&'a [(u16, u16)], &'a str)>,
) -> (Vec<String>, u32) {
    let mut args = vec!["CLUSTER".to_string(), "MIGRATESLOTS".to_string()];
    let mut count = 0u32;
    for (ranges, id) in groups {
        args.push("SLOTSRANGE".into());
        for &(a, b) in ranges {
            args.extend([a.to_string(), b.to_string()]);
            count += u32::from(b) - u32::from(a) + 1;
        }
        args.extend(["NODE".to_string(), id.to_string()]);
    }
    (args, count)
}

/// A primary's slot migrations (`CLUSTER GETSLOTMIGRATIONS`), as far as starting another
/// one is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Migrations {
    /// None runs, and the newest did not fail.
    Idle,
    /// One runs: its state.
    Running(String),
    /// None runs and the newest failed.
    Failed(FailedMigration),
}

/// The newest of a primary's slot migrations failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedMigration {
    /// Why, in the node's words.
    pub message: String,
    /// How many of the newest failed in a row.
    pub failures: u32,
    /// How long to hold off before starting it again: zero once [`retry_delay`] has passed
    /// since it failed.
    pub retry_in: Duration,
}

impl fmt::Display for FailedMigration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let attempts = match self.failures {
            1 => String::new(),
            n => format!(", {n} attempts in a row"),
        };
        write!(f, "last slot migration failed ({}{attempts})", self.message)?;
        if !self.retry_in.is_zero() {
            // The delay, not the time left: this text is in status, and one that changed
            // on every look would be a write, and so another look, every second.
            let delay = retry_delay(self.failures).as_secs();
            write!(f, "; trying again {delay} s after it failed")?;
        }
        Ok(())
    }
}

/// How long after the `failures`-th failure in a row a migration is started again: 5 s,
/// doubling to 5 minutes, so that a migration that cannot succeed (a target that times out,
/// say) is not restarted, and announced, on every look.
pub fn retry_delay(failures: u32) -> Duration {
    let secs = 5u64.saturating_mul(1 << failures.saturating_sub(1).min(6));
    Duration::from_secs(secs.min(300))
}

/// One job of `CLUSTER GETSLOTMIGRATIONS`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct Job {
    /// `EXPORT` (slots leaving this node) or `IMPORT`.
    operation: String,
    state: String,
    message: String,
    /// The node's Unix time of the job's start and of its last change, in seconds.
    created: u64,
    last_update: u64,
}

const FINISHED: [&str; 4] = ["success", "failed", "cancelled", "canceled"];

/// The jobs of a `CLUSTER GETSLOTMIGRATIONS` reply, newest first as Valkey lists them.
fn jobs(reply: &shardgate_admin_client::Reply) -> Vec<Job> {
    use shardgate_admin_client::Reply;
    let Reply::Array(jobs) = reply else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for job in jobs {
        let Reply::Array(fields) = job else { continue };
        let mut j = Job::default();
        for kv in fields.chunks(2) {
            let [Reply::BulkString(k), v] = kv else {
                continue;
            };
            let text = match v {
                Reply::BulkString(b) | Reply::SimpleString(b) => String::from_utf8_lossy(b),
                Reply::Integer(i) => i.to_string().into(),
                _ => continue,
            };
            match &k[..] {
                b"operation" => j.operation = text.into_owned(),
                b"state" => j.state = text.into_owned(),
                b"message" => j.message = text.into_owned(),
                b"create_time" => j.created = text.parse().unwrap_or(0),
                b"last_update_time" => j.last_update = text.parse().unwrap_or(0),
                _ => {}
            }
        }
        out.push(j);
    }
    out
}

/// What `jobs` (newest first) mean for starting another migration from this node, at the
/// node's time `now`. One `MIGRATESLOTS` makes an export job per destination, all created
/// in the same second: an attempt is the exports sharing the newest start time, failed if
/// any of them failed. Imports (slots this node received) are not its attempts.
fn assess(jobs: &[Job], now: u64) -> Migrations {
    if let Some(running) = jobs.iter().find(|j| !FINISHED.contains(&j.state.as_str())) {
        return Migrations::Running(running.state.clone());
    }
    let exports = jobs
        .iter()
        .filter(|j| j.operation.eq_ignore_ascii_case("export"));
    let mut attempts: Vec<Vec<&Job>> = Vec::new();
    for job in exports {
        match attempts.last_mut() {
            Some(attempt) if attempt[0].created == job.created => attempt.push(job),
            _ => attempts.push(vec![job]),
        }
    }
    let failed = |attempt: &Vec<&Job>| attempt.iter().any(|j| j.state == "failed");
    let failures = attempts.iter().take_while(|a| failed(a)).count();
    let Some(newest) = attempts.first().filter(|_| failures > 0) else {
        return Migrations::Idle;
    };
    let failures = u32::try_from(failures).unwrap_or(u32::MAX);
    let ended = newest.iter().map(|j| j.last_update).max().unwrap_or(0);
    let since = Duration::from_secs(now.saturating_sub(ended));
    let message = newest
        .iter()
        .filter(|j| j.state == "failed")
        .map(|j| j.message.trim())
        .find(|m| !m.is_empty())
        .unwrap_or("no reason given")
        .to_string();
    Migrations::Failed(FailedMigration {
        message,
        failures,
        retry_in: retry_delay(failures).saturating_sub(since),
    })
}

/// The slot migrations of the node `client` talks to. Its own clock (`TIME`) dates a
/// failure, so that the controller's clock does not matter.
pub async fn migrations(client: &mut Client) -> Result<Migrations, shardgate_admin_client::Error> {
    use shardgate_admin_client::Reply;
    let reply = client.command(["CLUSTER", "GETSLOTMIGRATIONS"]).await?;
    let jobs = jobs(&reply);
    // Only a failure needs the node's time (to date it).
    let seen = assess(&jobs, u64::MAX);
    if !matches!(seen, Migrations::Failed(_)) {
        return Ok(seen);
    }
    let now = match client.command(["TIME"]).await {
        Ok(Reply::Array(parts)) => match parts.first() {
            Some(Reply::BulkString(secs)) => {
                std::str::from_utf8(secs).ok().and_then(|s| s.parse().ok())
            }
            _ => None,
        },
        _ => None,
    };
    // No TIME (refused, or a reply that does not parse): retry as if the delay had passed.
    Ok(assess(&jobs, now.unwrap_or(u64::MAX)))
}

/// How long to wait before the next step, after `progress`.
pub fn next_look(progress: &Progress) -> Duration {
    match progress {
        Progress::Acted(_) | Progress::Retried(_) => Duration::from_secs(1),
        Progress::Waiting(_) => Duration::from_secs(3),
        Progress::Formed(_) => Duration::from_secs(30),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initial_slots_split_like_valkey_cli() {
        // valkey-cli --cluster create with 3 primaries: 0-5460, 5461-10922, 10923-16383.
        assert_eq!(initial_slots(0, 3), (0, 5460));
        assert_eq!(initial_slots(1, 3), (5461, 10922));
        assert_eq!(initial_slots(2, 3), (10923, 16383));
        assert_eq!(initial_slots(0, 1), (0, 16383));
        assert_eq!(home_shard(5461, 3), 1);
        assert_eq!(home_shard(16383, 3), 2);
    }

    /// An export job started and last changed at `at`.
    fn job(state: &str, at: u64) -> Job {
        Job {
            operation: "EXPORT".into(),
            state: state.into(),
            message: format!("{state} at {at}"),
            created: at,
            last_update: at,
        }
    }

    #[test]
    fn a_failed_migration_is_retried_after_a_doubling_delay() {
        assert_eq!(assess(&[], 100), Migrations::Idle);
        // Newest first, as Valkey lists them.
        let older_failure = [job("success", 90), job("failed", 50)];
        assert_eq!(assess(&older_failure, 100), Migrations::Idle);
        assert_eq!(
            assess(&[job("replicating", 99), job("failed", 50)], 100),
            Migrations::Running("replicating".into())
        );
        let failed = |jobs: &[Job], now| match assess(jobs, now) {
            Migrations::Failed(f) => (f.failures, f.retry_in.as_secs()),
            other => panic!("not failed: {other:?}"),
        };
        assert_eq!(failed(&[job("failed", 100)], 100), (1, 5));
        assert_eq!(failed(&[job("failed", 100)], 103), (1, 2));
        assert_eq!(failed(&[job("failed", 100)], 200), (1, 0));
        let three = [
            job("failed", 100),
            job("failed", 80),
            job("failed", 60),
            job("success", 1),
        ];
        assert_eq!(failed(&three, 101), (3, 19));
        // Its text (in status) is the same on every look while it waits.
        let text = |now| match assess(&three, now) {
            Migrations::Failed(f) => f.to_string(),
            other => panic!("not failed: {other:?}"),
        };
        assert_eq!(text(101), text(110));
        assert!(text(101).ends_with("3 attempts in a row); trying again 20 s after it failed"));
        // A node clock behind the failure: the whole delay.
        assert_eq!(failed(&three, 0), (3, 20));
        // One command to three shards: three exports of one start time, one attempt, failed
        // if any failed; whatever the order Valkey lists them in.
        let mut one = [job("success", 100), job("failed", 100), job("success", 100)];
        assert_eq!(failed(&one, 100), (1, 5));
        one.rotate_left(1);
        assert_eq!(failed(&one, 100), (1, 5));
        // An import that failed here is the other node's attempt, not this one's.
        let import = Job {
            operation: "IMPORT".into(),
            ..job("failed", 100)
        };
        assert_eq!(
            assess(&[import.clone(), job("success", 90)], 100),
            Migrations::Idle
        );
        assert_eq!(failed(&[import, job("failed", 90)], 91), (1, 4));
        let secs = |n| retry_delay(n).as_secs();
        assert_eq!(
            [1, 2, 3, 6, 7, 8, 60].map(secs),
            [5, 10, 20, 160, 300, 300, 300]
        );
    }

    /// Against a real cluster: a migration whose target goes away is reported failed, with
    /// Valkey's reason, and the delay before the next attempt doubles with the second
    /// failure in a row.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn failed_migrations_are_read_from_a_real_node() {
        use shardgate_harness::valkey::{ClusterSpec, Restart, ValkeyCluster};
        let cluster = tokio::task::spawn_blocking(|| ValkeyCluster::start(ClusterSpec::new(2, 0)))
            .await
            .unwrap()
            .expect("a two-shard Valkey cluster (run scripts/setup for valkey-server)");
        let (source, target) = (NodeRef::new(0, 0), NodeRef::new(1, 0));
        let mut client = Client::connect(cluster.node(source).addr(), Default::default())
            .await
            .unwrap();
        assert_eq!(migrations(&mut client).await.unwrap(), Migrations::Idle);
        let target_id = cluster.node(target).node_id.clone();
        let signal = |sig: &str| {
            let pid = cluster.node(target).pid().expect("the target runs");
            let status = std::process::Command::new("kill")
                .args([sig, &pid.to_string()])
                .status()
                .unwrap();
            assert!(status.success(), "kill {sig} {pid}");
        };
        // The node's clock, in seconds: an attempt is the exports of one start second.
        let node_secs = |reply: shardgate_admin_client::Reply| match reply {
            shardgate_admin_client::Reply::Array(p) => match p.first() {
                Some(shardgate_admin_client::Reply::BulkString(b)) => {
                    std::str::from_utf8(b).unwrap().parse::<u64>().unwrap()
                }
                other => panic!("TIME: {other:?}"),
            },
            other => panic!("TIME: {other:?}"),
        };
        let mut started = 0;
        for attempt in 1..=2u32 {
            while node_secs(client.command(["TIME"]).await.unwrap()) <= started {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            started = node_secs(client.command(["TIME"]).await.unwrap());
            // The target stopped, then killed: the source's link to it breaks mid-migration.
            signal("-STOP");
            let (args, _) = migrate_slots([(&[(0u16, 99u16)][..], target_id.as_str())]);
            client.command(&args).await.unwrap();
            cluster.kill(target);
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            let failed = loop {
                match migrations(&mut client).await.unwrap() {
                    Migrations::Failed(f) => break f,
                    other => assert!(
                        tokio::time::Instant::now() < deadline,
                        "attempt {attempt}: still {other:?} after 30 s"
                    ),
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            assert_eq!(failed.failures, attempt, "{failed:?}");
            // Valkey's words: "Connection lost to target ..." once the link was up,
            // "Unable to connect to target node: ..." when the kill came first.
            assert!(
                failed.message.contains("target"),
                "Valkey's reason: {failed:?}"
            );
            // Read within a second or two of the failure: most of the delay is left.
            let delay = retry_delay(attempt);
            assert!(
                failed.retry_in <= delay && failed.retry_in + Duration::from_secs(3) > delay,
                "attempt {attempt}: {failed:?}"
            );
            let c = &cluster;
            tokio::task::block_in_place(|| c.restart(target, Restart::SameAddress)).unwrap();
        }
    }

    /// Against a real cluster of 3 shards x 1 replica whose shard 2 is leaving (a scale-in
    /// to 2 shards, its slots still to move): a staying replica reset (a wiped pod back at
    /// its address, under a new id) is met, its old id forgotten, and it replicates its
    /// primary again. Meanwhile the leaving nodes stay known to every node, no slot moves
    /// between the staying shards, and the cluster is not called formed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_staying_nodes_heal_while_a_shard_leaves() {
        use shardgate_harness::valkey::{ClusterSpec, ValkeyCluster};
        let cluster = tokio::task::spawn_blocking(|| ValkeyCluster::start(ClusterSpec::new(3, 1)))
            .await
            .unwrap()
            .expect("a three-shard Valkey cluster (run scripts/setup for valkey-server)");
        let (primary, wiped) = (NodeRef::new(1, 0), NodeRef::new(1, 1));
        let old_id = cluster.node(wiped).node_id.clone();
        let addr = |n: NodeRef| cluster.node(n).addr();
        let mut client = Client::connect(addr(wiped), Default::default())
            .await
            .unwrap();
        client.command(["CLUSTER", "RESET", "HARD"]).await.unwrap();

        let staying: Vec<NodeRef> = (0..2)
            .flat_map(|s| (0..2).map(move |n| NodeRef::new(s, n)))
            .collect();
        let leaving = [NodeRef::new(2, 0), NodeRef::new(2, 1)];
        let plan = Plan {
            shards: 2,
            replicas: 1,
            nodes: staying.iter().map(|&n| (n, Some(addr(n)))).collect(),
            announced: BTreeMap::new(),
            leaving: leaving.iter().map(|&n| addr(n)).collect(),
            lost_are_gone: false,
            dial: Dial::default(),
        };
        // It is met, and asked again at once (the handshake takes a cluster tick or more):
        // not met again while that is under way.
        let first = step(&plan).await.unwrap();
        assert!(
            matches!(&first, Progress::Acted(w) if w.starts_with("introduced")),
            "{first:?}"
        );
        let again = step(&plan).await.unwrap();
        assert!(!again.to_string().contains("introduced"), "{again}");
        let mut acted = vec![first.to_string()];
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            match step(&plan).await.unwrap() {
                // Looked at again a second later by the operator; sooner here.
                Progress::Acted(what) => {
                    acted.push(what);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Progress::Waiting(why) if why.contains("leaving nodes") => break,
                // Gossip spreading: look again.
                Progress::Waiting(why) => {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "still waiting after 60 s: {why}; did {acted:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                other => panic!("{other:?} while shard 2 leaves; did {acted:?}"),
            }
        }
        let did = acted.join("; ");
        for what in [
            "introduced",
            "forgot",
            &format!("node {wiped} now replicates node {primary}"),
        ] {
            assert!(did.contains(what), "no {what:?} in {did}");
        }
        assert!(!did.contains("migrating"), "slots moved: {did}");
        let primary_id = cluster.node(primary).node_id.clone();
        for n in staying {
            let view = Client::connect(addr(n), Default::default())
                .await
                .unwrap()
                .cluster_nodes()
                .await
                .unwrap();
            let me = view.iter().find(|l| l.is_myself()).unwrap();
            if n == wiped {
                assert_eq!(me.primary_id.as_deref(), Some(primary_id.as_str()));
                continue;
            }
            assert!(
                view.iter().all(|l| l.id != old_id),
                "{n} still knows the old id"
            );
            for l in leaving {
                let id = &cluster.node(l).node_id;
                assert!(
                    view.iter().any(|v| &v.id == id),
                    "{n} forgot leaving node {l}"
                );
            }
        }
    }

    /// Against a real cluster of 2 shards without replicas: shard 1's primary is reset (a
    /// pod without a volume replaced: a new id, its keys gone). No replica can take its
    /// slots over, so formation forgets the old id and serves the slots again from the new
    /// node, rather than wait for ever with those slots down (and the whole cluster with
    /// them).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lost_primary_without_a_replica_is_replaced_not_waited_for() {
        use shardgate_harness::valkey::{ClusterSpec, ValkeyCluster};
        let cluster = tokio::task::spawn_blocking(|| ValkeyCluster::start(ClusterSpec::new(2, 0)))
            .await
            .unwrap()
            .expect("a two-shard Valkey cluster (run scripts/setup for valkey-server)");
        let lost = NodeRef::new(1, 0);
        let addr = |n: NodeRef| cluster.node(n).addr();
        let mut client = Client::connect(addr(lost), Default::default())
            .await
            .unwrap();
        client.command(["CLUSTER", "RESET", "HARD"]).await.unwrap();
        let nodes = [NodeRef::new(0, 0), lost];
        let plan = Plan {
            shards: 2,
            replicas: 0,
            nodes: nodes.iter().map(|&n| (n, Some(addr(n)))).collect(),
            announced: BTreeMap::new(),
            leaving: Vec::new(),
            lost_are_gone: true,
            dial: Dial::default(),
        };
        let mut acted = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            match step(&plan).await.unwrap() {
                Progress::Formed(_) => break,
                Progress::Acted(what) => acted.push(what),
                Progress::Retried(what) => panic!("{what}"),
                Progress::Waiting(why) => assert!(
                    tokio::time::Instant::now() < deadline,
                    "still waiting after 60 s: {why}; did {acted:?}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let did = acted.join("; ");
        assert!(did.contains("no replica can replace"), "{did}");
        assert!(did.contains("assigned"), "{did}");
    }
}
