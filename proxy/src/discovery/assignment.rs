//! Sticky (shard, node) indices: which listener port each discovered node gets.
//!
//! The first discovery orders shards by their lowest slot and nodes by role (primary first)
//! then node id; later discoveries keep every known node on its index, so a failover or a
//! restart never renumbers the listeners, and new nodes take the lowest free index of their
//! shard. A node still joining (a shard of its own without slots) waits for its place.
//!
//! Views of the cluster disagree for a moment: gossip reaches the nodes one by one, so the
//! view chosen may be one that has not heard the news yet. A node placed last time is held
//! where it was, as a replica, for [`HOLD_REFRESHES`] refreshes in a row at most, instead of
//! losing its port and getting it back (or another) a refresh later, when the view chosen
//! shows it:
//! - alone in a shard without slots (a join the answering node has not caught up with);
//! - not at all, while another answer lists it (it is still in the handshake at the node
//!   chosen, or unknown to it);
//! - as a replica of another shard that has ports, while the answers disagree on its shard
//!   (a `CLUSTER REPLICATE` that not every node has heard of).
//!
//! After that the view is believed: the node waits for its place like a new node, leaves the
//! table, or moves to its new shard. When every answer agrees, a node not listed leaves at
//! once and a moved replica moves at once.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};

use shardgate_admin_client::{NodeView, ShardView};
use shardgate_crds::NodeRef;

/// How many refreshes in a row a node may be held where it was (module docs): gossip
/// catches up within a second, and a node that really left its shard (reset, or starting a
/// new one) gives up its port after this.
pub const HOLD_REFRESHES: u32 = 5;

/// Why a node placed last time is held where it was (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    Alone,
    Missing,
    Moved,
}

impl Hold {
    fn describe(self) -> &'static str {
        match self {
            Hold::Alone => "the view chosen shows the node alone without slots",
            Hold::Missing => "the view chosen does not list the node, another answer does",
            Hold::Moved => {
                "the view chosen shows the node as a replica of another shard, not every answer does"
            }
        }
    }
}

/// Sticky (shard, node) indices across refreshes.
#[derive(Debug, Default)]
pub struct Assignment {
    stride: Option<u32>,
    shards: HashMap<String, u32>,
    nodes: HashMap<String, NodeRef>,
    /// The nodes placed by the last discovery, as they were described then.
    last: HashMap<String, NodeView>,
    /// Nodes held where they were, and for how many refreshes in a row.
    held: HashMap<String, u32>,
}

impl Assignment {
    /// Places every node of `shards` (the view chosen); returns the placed nodes and what
    /// could not be placed. `disputed`: the nodes the answers disagree on
    /// ([`super::Choice::disputed`]). A node held where it was (see the module docs) comes
    /// back as a replica.
    pub fn assign<'a>(
        &mut self,
        ports_per_shard: Option<u32>,
        shards: &'a [ShardView],
        disputed: &HashSet<String>,
    ) -> (Vec<(NodeRef, Cow<'a, NodeView>)>, Vec<String>) {
        let stride = *self.stride.get_or_insert_with(|| {
            ports_per_shard
                .unwrap_or_else(|| {
                    shards
                        .iter()
                        .map(|s| s.nodes.len() as u32)
                        .max()
                        .unwrap_or(1)
                })
                .max(1)
        });
        // First-time order: by lowest slot, slotless shards last.
        let mut order: Vec<&ShardView> = shards.iter().collect();
        order.sort_by_key(|s| {
            (
                s.slots
                    .iter()
                    .map(|r| r.0)
                    .min()
                    .map_or(u32::MAX, u32::from),
                s.key(),
            )
        });
        let mut placed = vec![];
        let mut skipped = vec![];
        // A new shard without slots is a node still joining (met, not yet a replica nor
        // given slots): it gets its port once it has settled in its shard, so that clients
        // never see it move. A node of it placed last time is the stale news of a join (or
        // a node reset): it keeps its index.
        let unsettled: HashSet<String> = order
            .iter()
            .filter(|s| s.slots.is_empty() && !self.shards.contains_key(&s.key()))
            .map(|s| s.key())
            .collect();
        let listed: HashMap<&str, (&ShardView, &NodeView)> = shards
            .iter()
            .flat_map(|s| s.nodes.iter().map(move |n| (n.id.as_str(), (s, n))))
            .collect();
        let mut was_placed: Vec<(&String, &NodeView)> = self.last.iter().collect();
        was_placed.sort_by_key(|(id, _)| *id);
        let mut held: Vec<(NodeRef, Cow<'a, NodeView>, Hold, u32)> = vec![];
        let mut held_times: HashMap<String, u32> = HashMap::new();
        for (id, last_view) in was_placed {
            let Some(&r) = self.nodes.get(id) else {
                continue;
            };
            let hold = match listed.get(id.as_str()) {
                None if disputed.contains(id) => Hold::Missing,
                None => continue,
                Some((s, _)) if unsettled.contains(&s.key()) => Hold::Alone,
                Some((s, n))
                    if !n.primary
                        && disputed.contains(id)
                        && self.shards.get(&s.key()).is_some_and(|&i| i != r.shard.0) =>
                {
                    Hold::Moved
                }
                Some(_) => continue,
            };
            let times = self.held.get(id).copied().unwrap_or(0);
            if times >= HOLD_REFRESHES {
                tracing::info!(
                    node = %id,
                    "{} for {HOLD_REFRESHES} refreshes: it gives up its port",
                    hold.describe()
                );
                continue;
            }
            held_times.insert(id.clone(), times + 1);
            // The view's description if it has one (the node may have a new address), else
            // last time's.
            let mut node = listed
                .get(id.as_str())
                .map_or_else(|| last_view.clone(), |(_, n)| (*n).clone());
            node.primary = false;
            held.push((r, Cow::Owned(node), hold, times + 1));
        }
        let held_ids: HashSet<String> = held.iter().map(|(_, n, ..)| n.id.clone()).collect();
        for shard in order {
            let key = shard.key();
            if unsettled.contains(&key) {
                continue;
            }
            let next_shard = self.shards.values().map(|s| s + 1).max().unwrap_or(0);
            let s = *self.shards.entry(key).or_insert(next_shard);
            let mut nodes: Vec<&NodeView> = shard
                .nodes
                .iter()
                .filter(|n| !held_ids.contains(&n.id))
                .collect();
            // Nodes placed last time claim their index first.
            nodes.sort_by_key(|n| (!self.last.contains_key(&n.id), !n.primary, n.id.clone()));
            // Known nodes keep their index, unless a node placed last time holds it (a node
            // that was gone came back after its index was reused): the returning one is
            // placed again like a new node. A node held that the view does not list at all
            // is the likeliest to be gone for good: a node the view lists may take its index.
            let mut used: Vec<u32> = vec![];
            let mut yielding: Vec<u32> = vec![];
            for (r, _, hold, _) in held.iter().filter(|(r, ..)| r.shard.0 == s) {
                match hold {
                    Hold::Missing => yielding.push(r.node.0),
                    _ => used.push(r.node.0),
                }
            }
            let mut fresh: Vec<&NodeView> = vec![];
            for node in nodes {
                match self.nodes.get(&node.id).copied().filter(|r| r.shard.0 == s) {
                    Some(r) if !used.contains(&r.node.0) && !yielding.contains(&r.node.0) => {
                        used.push(r.node.0);
                        placed.push((r, Cow::Borrowed(node)));
                    }
                    _ => fresh.push(node),
                }
            }
            for node in fresh {
                let free = (0..stride)
                    .find(|i| !used.contains(i) && !yielding.contains(i))
                    .or_else(|| yielding.iter().copied().find(|i| !used.contains(i)));
                match free {
                    Some(i) => {
                        used.push(i);
                        let r = NodeRef::new(s, i);
                        self.nodes.insert(node.id.clone(), r);
                        placed.push((r, Cow::Borrowed(node)));
                    }
                    None => skipped.push(format!(
                        "node {} of shard {s}: no free port (ports per shard: {stride})",
                        node.id
                    )),
                }
            }
        }
        // A node held whose index a listed node took is no longer held.
        let taken: HashSet<NodeRef> = placed.iter().map(|(r, _)| *r).collect();
        held.retain(|(r, n, ..)| {
            let keep = !taken.contains(r);
            if !keep {
                tracing::info!(node = %n.id, port_index = ?r, "a node the view lists took the port of a node it does not list");
                held_times.remove(&n.id);
            }
            keep
        });
        for (r, n, hold, times) in &held {
            // The first refresh of a hold at info: what explains a node that went on
            // answering at its port as a replica.
            if *times == 1 {
                tracing::info!(node = %n.id, port_index = ?r, for_at_most = HOLD_REFRESHES, "{}: kept where it was", hold.describe());
            } else {
                tracing::debug!(node = %n.id, port_index = ?r, refresh = times, of = HOLD_REFRESHES, "{}: kept where it was", hold.describe());
            }
        }
        self.held = held_times;
        placed.extend(held.into_iter().map(|(r, n, ..)| (r, n)));
        self.last = placed
            .iter()
            .map(|(_, n)| (n.id.clone(), n.as_ref().clone()))
            .collect();
        (placed, skipped)
    }

    pub fn stride(&self) -> Option<u32> {
        self.stride
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, primary: bool) -> NodeView {
        NodeView {
            id: id.into(),
            ip: "10.0.0.1".into(),
            endpoint: Some("10.0.0.1".into()),
            port: Some(6379),
            tls_port: None,
            primary,
            health: "online".into(),
            hostname: None,
            replication_offset: None,
        }
    }

    fn shard(id: &str, first_slot: u16, nodes: Vec<NodeView>) -> ShardView {
        ShardView {
            id: Some(id.into()),
            slots: vec![(first_slot, first_slot + 10)],
            nodes,
        }
    }

    fn placed(a: &mut Assignment, shards: &[ShardView]) -> Vec<(String, NodeRef)> {
        let (p, _) = a.assign(None, shards, &agreed());
        let mut v: Vec<_> = p.into_iter().map(|(r, n)| (n.id.clone(), r)).collect();
        v.sort();
        v
    }

    /// Every answer agrees.
    fn agreed() -> HashSet<String> {
        HashSet::new()
    }

    fn disputed(ids: &[&str]) -> HashSet<String> {
        ids.iter().map(|id| id.to_string()).collect()
    }

    /// (id, index, primary), sorted.
    fn roles<'a>(p: &'a [(NodeRef, Cow<'_, NodeView>)]) -> Vec<(&'a str, NodeRef, bool)> {
        let mut v: Vec<_> = p
            .iter()
            .map(|(r, n)| (n.id.as_str(), *r, n.primary))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn first_discovery_orders_by_slot_then_primary_first() {
        let shards = vec![
            shard("s-b", 100, vec![node("b2", false), node("b1", true)]),
            shard("s-a", 0, vec![node("a1", true), node("a2", false)]),
        ];
        let got = placed(&mut Assignment::default(), &shards);
        assert_eq!(
            got,
            vec![
                ("a1".into(), NodeRef::new(0, 0)),
                ("a2".into(), NodeRef::new(0, 1)),
                ("b1".into(), NodeRef::new(1, 0)),
                ("b2".into(), NodeRef::new(1, 1)),
            ]
        );
    }

    #[test]
    fn failover_and_reorder_keep_every_port() {
        let mut a = Assignment::default();
        let before = placed(
            &mut a,
            &[
                shard("s-a", 0, vec![node("a1", true), node("a2", false)]),
                shard("s-b", 100, vec![node("b1", true), node("b2", false)]),
            ],
        );
        // a2 took over; the reply lists shards in another order.
        let after = placed(
            &mut a,
            &[
                shard("s-b", 100, vec![node("b2", false), node("b1", true)]),
                shard("s-a", 0, vec![node("a2", true), node("a1", false)]),
            ],
        );
        assert_eq!(before, after);
    }

    #[test]
    fn new_nodes_take_free_indices_and_overflow_is_reported() {
        let mut a = Assignment::default();
        placed(
            &mut a,
            &[shard("s-a", 0, vec![node("a1", true), node("a2", false)])],
        );
        // a2 is gone, a3 joins: it takes a2's free index.
        let got = placed(
            &mut a,
            &[shard("s-a", 0, vec![node("a1", true), node("a3", false)])],
        );
        assert_eq!(got[1], ("a3".into(), NodeRef::new(0, 1)));
        // A third node has no port left (stride 2 from the first discovery).
        let three = [shard(
            "s-a",
            0,
            vec![node("a1", true), node("a3", false), node("a4", false)],
        )];
        let (p, skipped) = a.assign(None, &three, &agreed());
        assert_eq!(p.len(), 2);
        assert!(skipped[0].contains("a4"), "{skipped:?}");
        // a2 comes back while a3 holds its index: a2 is placed again, and not on a3's port.
        let back = [shard(
            "s-a",
            0,
            vec![node("a1", true), node("a3", false), node("a2", false)],
        )];
        let (p, skipped) = a.assign(None, &back, &agreed());
        let refs: Vec<_> = p.iter().map(|(r, n)| (n.id.as_str(), *r)).collect();
        assert_eq!(
            refs,
            [("a1", NodeRef::new(0, 0)), ("a3", NodeRef::new(0, 1))]
        );
        assert!(skipped[0].contains("a2"), "{skipped:?}");
    }

    #[test]
    fn a_joining_node_gets_one_port_once_its_shard_is_settled() {
        let mut a = Assignment::default();
        let ports = Some(3);
        let settled = shard("s-a", 0, vec![node("a1", true), node("a2", false)]);
        a.assign(ports, std::slice::from_ref(&settled), &agreed());
        // Met: a slotless shard of its own. No port yet.
        let mut joining = shard("s-new", 0, vec![node("j", true)]);
        joining.slots.clear();
        let both = [settled.clone(), joining];
        let (p, skipped) = a.assign(ports, &both, &agreed());
        assert!(p.iter().all(|(_, n)| n.id != "j") && skipped.is_empty());
        // A replica of shard 0 now: it takes the free index there, for good.
        let mut with_replica = settled.clone();
        with_replica.nodes.push(node("j", false));
        for _ in 0..2 {
            let (p, _) = a.assign(ports, std::slice::from_ref(&with_replica), &agreed());
            let j = p.iter().find(|(_, n)| n.id == "j").map(|(r, _)| *r);
            assert_eq!(j, Some(NodeRef::new(0, 2)));
        }
    }

    #[test]
    fn a_view_that_has_not_heard_of_the_join_yet_does_not_move_the_node() {
        let mut a = Assignment::default();
        let ports = Some(4);
        let mut settled = shard("s-a", 0, vec![node("a1", true), node("a2", false)]);
        settled.nodes.push(node("j", false));
        let (p, _) = a.assign(ports, std::slice::from_ref(&settled), &agreed());
        let j = p.iter().find(|(_, n)| n.id == "j").map(|(r, _)| *r);
        assert_eq!(j, Some(NodeRef::new(0, 2)));
        // The next answer chosen is from a node that still sees j alone, and that already
        // sees another node k join shard a.
        let mut stale = shard("s-a", 0, vec![node("a1", true), node("a2", false)]);
        stale.nodes.push(node("k", false));
        let mut alone = shard("s-j", 0, vec![node("j", true)]);
        alone.slots.clear();
        let midway = [stale, alone];
        let (p, skipped) = a.assign(ports, &midway, &agreed());
        let got = roles(&p);
        assert_eq!(
            got,
            [
                ("a1", NodeRef::new(0, 0), true),
                ("a2", NodeRef::new(0, 1), false),
                // Held where it was, and not called the primary of shard 0.
                ("j", NodeRef::new(0, 2), false),
                ("k", NodeRef::new(0, 3), false),
            ]
        );
        assert!(skipped.is_empty(), "{skipped:?}");
        // The news arrives: nothing moves. (Had it not: see the next test.)
        settled.nodes.push(node("k", false));
        let (p, _) = a.assign(ports, std::slice::from_ref(&settled), &agreed());
        let mut again: Vec<_> = p.iter().map(|(r, n)| (n.id.as_str(), *r)).collect();
        again.sort();
        let before: Vec<_> = got.iter().map(|(id, r, _)| (*id, *r)).collect();
        assert_eq!(again, before);
    }

    #[test]
    fn a_node_that_stays_alone_without_slots_gives_up_its_port() {
        // j left shard a for good (reset, say, or the first node of a shard to be).
        let mut a = Assignment::default();
        let ports = Some(3);
        let mut settled = shard("s-a", 0, vec![node("a1", true)]);
        settled.nodes.push(node("j", false));
        a.assign(ports, std::slice::from_ref(&settled), &agreed());
        let mut alone = shard("s-j", 0, vec![node("j", true)]);
        alone.slots.clear();
        let gone = [shard("s-a", 0, vec![node("a1", true)]), alone.clone()];
        let mut held_times = 0;
        for _ in 0..HOLD_REFRESHES + 3 {
            let (p, _) = a.assign(ports, &gone, &agreed());
            if p.iter().any(|(_, n)| n.id == "j") {
                held_times += 1;
            }
        }
        assert_eq!(held_times, HOLD_REFRESHES);
        // Its new shard gets slots: it is placed there, once.
        alone.slots = vec![(100, 200)];
        let now = [shard("s-a", 0, vec![node("a1", true)]), alone];
        let (p, _) = a.assign(ports, &now, &agreed());
        let j = p
            .iter()
            .find(|(_, n)| n.id == "j")
            .map(|(r, n)| (*r, n.primary));
        assert_eq!(j, Some((NodeRef::new(1, 0), true)));
    }

    #[test]
    fn a_node_only_some_answers_list_keeps_its_port_for_a_few_refreshes() {
        let mut a = Assignment::default();
        let ports = Some(3);
        let both = [shard("s-a", 0, vec![node("a1", true), node("a2", false)])];
        a.assign(ports, &both, &agreed());
        // The view chosen lacks a2, another answer lists it, and a3 joins: a3 takes the
        // free index, a2 keeps its own.
        let without = [shard("s-a", 0, vec![node("a1", true), node("a3", false)])];
        let a2 = disputed(&["a2"]);
        let (p, _) = a.assign(ports, &without, &a2);
        assert_eq!(
            roles(&p),
            [
                ("a1", NodeRef::new(0, 0), true),
                ("a2", NodeRef::new(0, 1), false),
                ("a3", NodeRef::new(0, 2), false),
            ]
        );
        // Held HOLD_REFRESHES refreshes in a row in all, then gone.
        let mut held = 1;
        for _ in 0..HOLD_REFRESHES + 2 {
            let (p, _) = a.assign(ports, &without, &a2);
            if roles(&p).contains(&("a2", NodeRef::new(0, 1), false)) {
                held += 1;
            }
        }
        assert_eq!(held, HOLD_REFRESHES);
    }

    #[test]
    fn a_node_no_answer_lists_leaves_at_once() {
        let mut a = Assignment::default();
        placed(
            &mut a,
            &[shard("s-a", 0, vec![node("a1", true), node("a2", false)])],
        );
        let got = placed(&mut a, &[shard("s-a", 0, vec![node("a1", true)])]);
        assert_eq!(got, [("a1".to_string(), NodeRef::new(0, 0))]);
    }

    #[test]
    fn a_node_coming_back_does_not_take_the_port_of_a_node_held() {
        let mut a = Assignment::default();
        let ports = Some(3);
        let a1 = || node("a1", true);
        a.assign(
            ports,
            &[shard("s-a", 0, vec![a1(), node("a2", false)])],
            &agreed(),
        );
        // a2 leaves for good, and a3 takes its index.
        a.assign(ports, &[shard("s-a", 0, vec![a1()])], &agreed());
        a.assign(
            ports,
            &[shard("s-a", 0, vec![a1(), node("a3", false)])],
            &agreed(),
        );
        // A view that lists a2 again and not a3, while another lists a3: a3 is held, and a2
        // takes the free index, not a3's.
        let back = [shard("s-a", 0, vec![a1(), node("a2", false)])];
        let (p, _) = a.assign(ports, &back, &disputed(&["a2", "a3"]));
        let got = roles(&p);
        assert_eq!(
            got,
            [
                ("a1", NodeRef::new(0, 0), true),
                ("a2", NodeRef::new(0, 2), false),
                ("a3", NodeRef::new(0, 1), false),
            ]
        );
        // Every answer lists all three: nothing moves.
        let all = [shard(
            "s-a",
            0,
            vec![a1(), node("a2", false), node("a3", false)],
        )];
        let (p, _) = a.assign(ports, &all, &agreed());
        assert_eq!(roles(&p), got);
    }
}
