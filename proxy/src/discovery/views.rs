//! Choosing what the cluster is from several nodes' answers, so that one confused node (one
//! restarted empty, still in the handshake, cut off in `cluster_state:fail`, or not yet told
//! of a failover) cannot replace the table.
//!
//! Each [`Answer`] is first made self-consistent ([`Answer::normalize`]): the answering node's
//! own empty `ip` (a node that was never sent a MEET does not know it) becomes the address it
//! was dialled at, entries with one shard id are merged, nodes still in the handshake are
//! dropped, a replica listed apart from its primary's shard joins it, and each shard keeps
//! one primary: its highest-epoch primary that is not marked failed. Then
//! [`choose`] refuses the answers that cover no slot, and those in `cluster_state:fail` when
//! another is `ok`, and keeps the one whose slots are owned with the highest config epochs
//! (the newest news of failovers and migrations). A node that a majority of the answers
//! report is kept even when the chosen answer does not list it; the nodes the answers
//! disagree on are named ([`Choice::disputed`]).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;

use shardgate_admin_client::{NodeLine, NodeView, ShardView};

use crate::model::SLOTS;

/// What one node said: `CLUSTER MYID`, `CLUSTER INFO`'s state, `CLUSTER SHARDS` and
/// `CLUSTER NODES` (for config epochs and flags, which `CLUSTER SHARDS` does not give).
#[derive(Debug, Clone)]
pub struct Answer {
    /// Where it was dialled.
    pub addr: SocketAddr,
    /// Its own node id.
    pub myself: String,
    /// `cluster_state:ok`.
    pub state_ok: bool,
    pub shards: Vec<ShardView>,
    pub nodes: Vec<NodeLine>,
}

/// Why an answer was not used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// It covers no slot: a node restarted empty, or a cluster not formed yet.
    NoSlots,
    /// It is in `cluster_state:fail` while another node is `ok`.
    StateFail,
    /// Another answer has newer slot owners (higher config epochs) or covers more slots.
    Older,
}

impl Refusal {
    /// A metric label (`discovery_views_refused_total{reason}`).
    pub fn label(self) -> &'static str {
        match self {
            Refusal::NoSlots => "no_slots",
            Refusal::StateFail => "state_fail",
            Refusal::Older => "older",
        }
    }

    /// What it means, for logs.
    pub fn describe(self) -> &'static str {
        match self {
            Refusal::NoSlots => "it serves no slot (restarted empty, or not in the cluster)",
            Refusal::StateFail => "it says cluster_state:fail while another node says ok",
            Refusal::Older => "another node knows newer slot owners (higher config epochs)",
        }
    }
}

/// The view discovery goes on with.
#[derive(Debug)]
pub struct Choice {
    pub shards: Vec<ShardView>,
    /// The node whose answer it is.
    pub chosen: SocketAddr,
    /// The answers not used, and why.
    pub refused: Vec<(SocketAddr, Refusal)>,
    /// Nodes added because a majority reported them and the chosen answer did not.
    pub kept: Vec<String>,
    /// Nodes the usable answers disagree on: listed by some and not by others, or in
    /// different shards. The news of a join or a move that has not reached every node yet:
    /// the assignment keeps such a node where it was for a while rather than believe the
    /// answer chosen at once.
    pub disputed: HashSet<String>,
}

/// Failed according to `CLUSTER SHARDS` (`health failed`) or `CLUSTER NODES` (`fail`).
fn failed(node: &NodeView, line: Option<&NodeLine>) -> bool {
    node.health == "failed" || node.health == "fail" || line.is_some_and(|l| l.has_flag("fail"))
}

impl Answer {
    /// Makes the answer self-consistent; see the module docs.
    pub fn normalize(&mut self) {
        let lines: HashMap<&str, &NodeLine> =
            self.nodes.iter().map(|l| (l.id.as_str(), l)).collect();
        let dialled = self.addr.ip().to_string();
        // One entry per shard id. Two would each number their nodes from index 0 and give
        // two nodes one port; Valkey versions that print an entry's id from its primary
        // list a lagging replica's entry under its primary's id.
        let mut merged: Vec<ShardView> = Vec::with_capacity(self.shards.len());
        for shard in self.shards.drain(..) {
            match merged.iter_mut().find(|m| m.key() == shard.key()) {
                Some(m) => {
                    for range in shard.slots {
                        if !m.slots.contains(&range) {
                            m.slots.push(range);
                        }
                    }
                    m.nodes.extend(shard.nodes);
                }
                None => merged.push(shard),
            }
        }
        self.shards = merged;
        for shard in &mut self.shards {
            // A node in the handshake may not stay. A `noaddr` one is kept: the others mark
            // a known node so when another one answers at its address (say, it restarted
            // empty), and it is still theirs.
            shard.nodes.retain(|n| {
                !lines
                    .get(n.id.as_str())
                    .is_some_and(|l| l.has_flag("handshake"))
            });
        }
        // A replica whose shard id the answering node has not caught up with (the id and
        // the role travel separately: a ping extension and the header) would be listed
        // under its old id. Valkey lists one shard per id, with the slots of its first
        // node's primary: a second shard with the same slots. It belongs with its primary.
        let home: HashMap<String, usize> = self
            .shards
            .iter()
            .enumerate()
            .flat_map(|(i, s)| {
                s.nodes
                    .iter()
                    .filter(|n| n.primary)
                    .map(move |n| (n.id.clone(), i))
            })
            .collect();
        let mut moved: Vec<(usize, NodeView)> = vec![];
        let mut lost: HashSet<usize> = HashSet::new();
        for (i, shard) in self.shards.iter_mut().enumerate() {
            shard.nodes.retain(|n| {
                let primary = lines
                    .get(n.id.as_str())
                    .and_then(|l| l.primary_id.as_deref());
                match primary.and_then(|p| home.get(p)) {
                    Some(&j) if j != i && !n.primary => {
                        moved.push((j, n.clone()));
                        lost.insert(i);
                        false
                    }
                    _ => true,
                }
            });
        }
        for (j, node) in moved {
            self.shards[j].nodes.push(node);
        }
        for shard in &mut self.shards {
            for node in &mut shard.nodes {
                if node.id == self.myself && node.ip.is_empty() {
                    node.ip = dialled.clone();
                    if node.port.is_none() && node.tls_port.is_none() {
                        node.port = Some(self.addr.port());
                    }
                }
            }
            // One primary per shard: after a failover the old primary may still be listed
            // as a failed `master` beside the promoted replica.
            let epoch = |n: &NodeView| lines.get(n.id.as_str()).map_or(0, |l| l.config_epoch);
            let primary = shard
                .nodes
                .iter()
                .filter(|n| n.primary && !failed(n, lines.get(n.id.as_str()).copied()))
                .max_by_key(|n| epoch(n))
                .map(|n| n.id.clone());
            for node in &mut shard.nodes {
                node.primary = primary.as_deref() == Some(node.id.as_str());
            }
        }
        // A shard that lost a misfiled replica may have been listed with that replica's
        // primary's slots (it was its first node): its own primary's line says its own.
        for i in lost {
            let shard = &mut self.shards[i];
            let own = shard
                .nodes
                .iter()
                .find(|n| n.primary)
                .and_then(|p| lines.get(p.id.as_str()));
            if let Some(line) = own {
                shard.slots = line.slots.clone();
            }
        }
        self.shards.retain(|s| !s.nodes.is_empty());
    }

    /// Slots covered, and the sum over slots of their owner's config epoch. A slot two
    /// shards claim counts once, at the higher epoch: listing a slot twice is no news.
    fn score(&self) -> (u32, u64) {
        let epochs: HashMap<&str, u64> = self
            .nodes
            .iter()
            .map(|l| (l.id.as_str(), l.config_epoch))
            .collect();
        let mut owner: Vec<Option<u64>> = vec![None; SLOTS];
        for shard in &self.shards {
            // A shard without a live primary still covers its slots, at the epoch its
            // (failed) owner had: a view that knows the promotion scores higher.
            let owner_epoch = shard
                .nodes
                .iter()
                .filter_map(|n| epochs.get(n.id.as_str()).copied())
                .max()
                .unwrap_or(0);
            for &(a, b) in &shard.slots {
                for slot in owner
                    .iter_mut()
                    .take(usize::from(b) + 1)
                    .skip(usize::from(a))
                {
                    *slot = Some(slot.map_or(owner_epoch, |e| e.max(owner_epoch)));
                }
            }
        }
        let covered = owner.iter().flatten().count() as u32;
        let weight = owner.iter().flatten().sum();
        (covered, weight)
    }
}

/// Picks the view to route by; see the module docs. `answers` in the order the nodes were
/// asked (seeds first): ties go to the earlier answer. `None` when no answer covers a slot.
pub fn choose(mut answers: Vec<Answer>) -> Option<Choice> {
    for a in &mut answers {
        a.normalize();
    }
    let mut refused = vec![];
    let scores: Vec<(u32, u64)> = answers.iter().map(Answer::score).collect();
    let any_ok = answers
        .iter()
        .zip(&scores)
        .any(|(a, s)| a.state_ok && s.0 > 0);
    let mut usable: Vec<(&Answer, (u32, u64))> = vec![];
    for (a, &score) in answers.iter().zip(&scores) {
        if score.0 == 0 {
            refused.push((a.addr, Refusal::NoSlots));
        } else if any_ok && !a.state_ok {
            refused.push((a.addr, Refusal::StateFail));
        } else {
            usable.push((a, score));
        }
    }
    let (best, best_score) = usable
        .iter()
        .enumerate()
        // The earliest of equals: max_by_key keeps the last, so order by (score, -index).
        .max_by_key(|(i, (_, (covered, weight)))| (*covered, *weight, std::cmp::Reverse(*i)))
        .map(|(_, (a, score))| (*a, *score))?;
    for (a, score) in &usable {
        if !std::ptr::eq(*a, best) && *score != best_score {
            refused.push((a.addr, Refusal::Older));
        }
    }
    let usable: Vec<&Answer> = usable.into_iter().map(|(a, _)| a).collect();
    let disputed = disputed(&usable);
    let mut shards = best.shards.clone();
    let listed: HashSet<String> = shards
        .iter()
        .flat_map(|s| s.nodes.iter().map(|n| n.id.clone()))
        .collect();
    // Nodes a majority of the usable answers still report, missing from the best one.
    let mut votes: HashMap<&str, (usize, &ShardView, &NodeView)> = HashMap::new();
    for a in &usable {
        for s in &a.shards {
            for n in &s.nodes {
                votes.entry(n.id.as_str()).or_insert((0, s, n)).0 += 1;
            }
        }
    }
    let mut kept: Vec<String> = vec![];
    let mut missing: Vec<_> = votes
        .into_iter()
        .filter(|(id, (count, _, _))| !listed.contains(*id) && count * 2 > usable.len())
        .collect();
    missing.sort_by(|a, b| a.0.cmp(b.0));
    for (id, (_, shard, node)) in missing {
        let mut node = node.clone();
        // The best answer knows the shard's primary; a node it does not list is not it.
        node.primary = false;
        match shards.iter_mut().find(|s| s.key() == shard.key()) {
            Some(s) => s.nodes.push(node),
            None => shards.push(ShardView {
                id: shard.id.clone(),
                slots: vec![],
                nodes: vec![node],
            }),
        }
        kept.push(id.to_string());
    }
    Some(Choice {
        shards,
        chosen: best.addr,
        refused,
        kept,
        disputed,
    })
}

/// The nodes that `answers` do not all list, or list in different shards.
fn disputed(answers: &[&Answer]) -> HashSet<String> {
    let placed: Vec<HashMap<&str, String>> = answers
        .iter()
        .map(|a| {
            a.shards
                .iter()
                .flat_map(|s| {
                    let key = s.key();
                    s.nodes.iter().map(move |n| (n.id.as_str(), key.clone()))
                })
                .collect()
        })
        .collect();
    let mut disputed = HashSet::new();
    for id in placed.iter().flat_map(|m| m.keys()) {
        let first = placed[0].get(id);
        if placed.iter().any(|m| m.get(id) != first) {
            disputed.insert(id.to_string());
        }
    }
    disputed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::fixtures::*;

    const FRESH: &str = "f000000000000000000000000000000000000000";

    /// What a node restarted with no `nodes.conf` says: one shard, itself, no slots, and no
    /// ip of its own (nobody sent it a MEET).
    fn restarted_empty(at: u8) -> Answer {
        Answer {
            addr: addr(at),
            myself: FRESH.into(),
            state_ok: false,
            shards: vec![shard(
                "fresh",
                vec![],
                vec![node(FRESH, "", true, "online")],
            )],
            nodes: vec![line(FRESH, "myself,master", 0)],
        }
    }

    /// A shard's (id, primary) list: a primary, a replica, and FRESH as a replica.
    fn with_fresh(primary: &str, replica: &str) -> Vec<(String, bool)> {
        vec![
            (primary.to_string(), true),
            (replica.to_string(), false),
            (FRESH.to_string(), false),
        ]
    }

    fn ids(shards: &[ShardView]) -> Vec<Vec<(String, bool)>> {
        shards
            .iter()
            .map(|s| s.nodes.iter().map(|n| (n.id.clone(), n.primary)).collect())
            .collect()
    }

    #[test]
    fn a_node_restarted_empty_does_not_replace_the_cluster() {
        // It is asked first (it is the seed) and answers at once.
        let c = choose(vec![restarted_empty(1), healthy(B1, 3)]).unwrap();
        assert_eq!(c.chosen, addr(3));
        assert_eq!(c.refused, vec![(addr(1), Refusal::NoSlots)]);
        assert_eq!(ids(&c.shards), ids(&healthy(B1, 3).shards));
        // Alone it is no cluster at all.
        assert!(choose(vec![restarted_empty(1)]).is_none());
    }

    #[test]
    fn a_new_replica_listed_under_its_old_shard_id_is_put_with_its_primary() {
        // FRESH was met and made a replica of A1. B1 has its role but not its new shard
        // id: Valkey's CLUSTER SHARDS then lists FRESH's old shard id with the slots of
        // FRESH's primary, a second shard with the same slots. Built by hand from Valkey's
        // code: a loopback cluster polled through a REPLICATE never showed it (the role
        // and the id came in one packet), but nothing keeps them together.
        let mut midway = healthy(B1, 3);
        midway.shards.push(shard(
            "fresh",
            vec![(0, 8191)],
            vec![node(FRESH, "127.0.0.9", false, "online")],
        ));
        midway.nodes.push(replica_line(FRESH, A1, 1));
        // A1 has heard nothing yet: FRESH is a shard of its own, without slots.
        let mut before = healthy(A1, 1);
        before.shards.push(shard(
            "fresh",
            vec![],
            vec![node(FRESH, "127.0.0.9", true, "online")],
        ));
        before.nodes.push(line(FRESH, "master", 0));
        // A1, asked first, is not outscored: the midway answer is the same cluster.
        let c = choose(vec![before.clone(), midway.clone()]).unwrap();
        assert_eq!(c.chosen, addr(1));
        assert!(c.refused.is_empty(), "{:?}", c.refused);
        // Nor when FRESH's primary is not known to the answer: slots listed twice are no
        // news.
        let mut unlinked = midway.clone();
        unlinked.nodes.pop();
        assert_eq!(choose(vec![before, unlinked]).unwrap().chosen, addr(1));
        // Alone, the midway answer puts FRESH with A1.
        let c = choose(vec![midway]).unwrap();
        assert_eq!(c.shards.len(), 2, "{:?}", ids(&c.shards));
        assert_eq!(ids(&c.shards)[0], with_fresh(A1, A2));
    }

    #[test]
    fn a_shard_listed_with_a_misfiled_replicas_slots_gets_its_own_back() {
        // FRESH moved from shard a to B1's shard; its shard id lags and it is the first
        // node of a's entry, so Valkey gives that entry B1's slots.
        let mut lagging = healthy(B1, 3);
        lagging.shards[0].slots = vec![(8192, 16383)];
        lagging.shards[0]
            .nodes
            .insert(0, node(FRESH, "127.0.0.9", false, "online"));
        lagging.nodes.push(replica_line(FRESH, B1, 2));
        lagging.nodes[0].slots = vec![(0, 8191)];
        let c = choose(vec![lagging]).unwrap();
        assert_eq!(c.shards[0].slots, vec![(0, 8191)]);
        assert_eq!(ids(&c.shards)[1], with_fresh(B1, B2));
    }

    #[test]
    fn two_entries_with_one_shard_id_are_one_shard() {
        // FRESH, a replica of A1, listed in an entry of its own under A1's shard id (and
        // with A1's slots), and with no CLUSTER NODES line to tell its primary.
        let mut twice = healthy(A1, 1);
        twice.shards.push(shard(
            "sa",
            vec![(0, 8191)],
            vec![node(FRESH, "127.0.0.9", false, "online")],
        ));
        let c = choose(vec![twice]).unwrap();
        assert_eq!(c.shards.len(), 2, "{:?}", ids(&c.shards));
        assert_eq!(c.shards[0].slots, vec![(0, 8191)]);
        assert_eq!(ids(&c.shards)[0], with_fresh(A1, A2));
    }

    #[test]
    fn a_lone_node_that_never_heard_a_meet_is_routed_at_the_dialled_address() {
        // A 1-shard, 0-replica cluster: `ip` is empty in its own CLUSTER SHARDS.
        let mut lone = restarted_empty(9);
        lone.state_ok = true;
        lone.shards[0].slots = vec![(0, 16383)];
        let c = choose(vec![lone]).unwrap();
        let n = &c.shards[0].nodes[0];
        assert_eq!(
            (n.ip.as_str(), n.port, n.primary),
            ("127.0.0.9", Some(6379), true)
        );
    }

    #[test]
    fn a_node_in_cluster_state_fail_loses_to_one_that_is_ok() {
        // A node cut off from the others still lists every slot, at the same epochs.
        let mut cut_off = healthy(A1, 1);
        cut_off.state_ok = false;
        cut_off.shards[1].nodes.truncate(1);
        let c = choose(vec![cut_off, healthy(B1, 3)]).unwrap();
        assert_eq!(c.chosen, addr(3));
        assert_eq!(c.refused, vec![(addr(1), Refusal::StateFail)]);
        // With nobody ok, the best of the failing ones is used: a table that still
        // routes beats none.
        let mut also = healthy(B1, 3);
        also.state_ok = false;
        let mut first = healthy(A1, 1);
        first.state_ok = false;
        assert_eq!(choose(vec![first, also]).unwrap().chosen, addr(1));
    }

    #[test]
    fn the_view_with_the_newer_epochs_wins_and_a_failed_primary_is_not_primary() {
        // B2 took over from B1 (epoch 5): its view lists B1 as a failed master beside it.
        let mut new = healthy(B2, 4);
        new.shards[1].nodes = vec![
            node(B1, "127.0.0.3", true, "failed"),
            node(B2, "127.0.0.4", true, "online"),
        ];
        new.nodes[2] = line(B1, "master,fail", 2);
        new.nodes[3] = line(B2, "master", 5);
        // A2 has not heard yet: B1 is still the primary at epoch 2.
        let old = healthy(A2, 2);
        let c = choose(vec![old, new]).unwrap();
        assert_eq!(c.chosen, addr(4));
        assert_eq!(c.refused, vec![(addr(2), Refusal::Older)]);
        assert_eq!(
            ids(&c.shards)[1],
            vec![(B1.to_string(), false), (B2.to_string(), true)]
        );
        // Before the promotion, a failed primary leaves its shard without one.
        let mut failing = healthy(A1, 1);
        failing.shards[1].nodes[0].health = "failed".into();
        failing.nodes[2] = line(B1, "master,fail", 2);
        let c = choose(vec![failing]).unwrap();
        assert!(c.shards[1].nodes.iter().all(|n| !n.primary));
    }

    #[test]
    fn nodes_in_the_handshake_get_nothing_and_a_majority_keeps_a_node() {
        let mut meeting = healthy(A1, 1);
        meeting.shards.push(shard(
            "new",
            vec![],
            vec![node(FRESH, "127.0.0.9", true, "online")],
        ));
        meeting.nodes.push(line(FRESH, "handshake", 0));
        let c = choose(vec![meeting]).unwrap();
        assert_eq!(c.shards.len(), 2, "{:?}", ids(&c.shards));
        // A2 is missing from the best-scored answer (it forgot it, or has not met it
        // again), but the two others list it: it stays, as a replica.
        let mut forgetful = healthy(B1, 3);
        forgetful.shards[0].nodes.truncate(1);
        forgetful.nodes[3].config_epoch = 3; // the best score
        let c = choose(vec![healthy(A1, 1), forgetful, healthy(B2, 4)]).unwrap();
        assert_eq!(c.chosen, addr(3));
        assert_eq!(c.kept, vec![A2.to_string()]);
        assert_eq!(
            ids(&c.shards)[0],
            vec![(A1.to_string(), true), (A2.to_string(), false)]
        );
    }

    #[test]
    fn the_nodes_the_answers_disagree_on_are_named() {
        let agreed = choose(vec![healthy(A1, 1), healthy(B1, 3)]).unwrap();
        assert!(agreed.disputed.is_empty(), "{:?}", agreed.disputed);
        // The first still has B2 in the handshake; the second has A2 moved to sb.
        let mut first = healthy(A1, 1);
        if let Some(l) = first.nodes.iter_mut().find(|l| l.id == B2) {
            l.flags.push("handshake".into());
        }
        let mut second = healthy(B1, 3);
        let a2 = second.shards[0].nodes.remove(1);
        second.shards[1].nodes.push(a2);
        second.nodes[1] = replica_line(A2, B1, 2);
        let c = choose(vec![first, second]).unwrap();
        let mut got: Vec<String> = c.disputed.into_iter().collect();
        got.sort();
        assert_eq!(got, [A2, B2]);
    }
}
