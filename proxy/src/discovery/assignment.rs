//! Sticky (shard, node) indices: which listener port each discovered node gets.
//!
//! The first discovery orders shards by their lowest slot and nodes by role (primary first)
//! then node id; later discoveries keep every known node on its index, so a failover or a
//! restart never renumbers the listeners, and new nodes take the lowest free index of their
//! shard.

use std::collections::HashMap;

use shardgate_admin_client::{NodeView, ShardView};
use shardgate_crds::NodeRef;

/// Sticky (shard, node) indices across refreshes.
#[derive(Debug, Default)]
pub struct Assignment {
    stride: Option<u32>,
    shards: HashMap<String, u32>,
    nodes: HashMap<String, NodeRef>,
}

impl Assignment {
    /// Places every node; returns the placed nodes and what could not be placed.
    pub fn assign<'a>(
        &mut self,
        ports_per_shard: Option<u32>,
        shards: &'a [ShardView],
    ) -> (Vec<(NodeRef, &'a NodeView)>, Vec<String>) {
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
        for shard in order {
            let key = shard.key();
            let next_shard = self.shards.values().map(|s| s + 1).max().unwrap_or(0);
            let s = *self.shards.entry(key).or_insert(next_shard);
            let mut nodes: Vec<&NodeView> = shard.nodes.iter().collect();
            nodes.sort_by(|a, b| b.primary.cmp(&a.primary).then(a.id.cmp(&b.id)));
            let mut used: Vec<u32> = nodes
                .iter()
                .filter_map(|n| self.nodes.get(&n.id))
                .filter(|r| r.shard.0 == s)
                .map(|r| r.node.0)
                .collect();
            for node in nodes {
                let known = self.nodes.get(&node.id).filter(|r| r.shard.0 == s).copied();
                let r = match known {
                    Some(r) => r,
                    None => match (0..stride).find(|i| !used.contains(i)) {
                        Some(i) => {
                            used.push(i);
                            let r = NodeRef::new(s, i);
                            self.nodes.insert(node.id.clone(), r);
                            r
                        }
                        None => {
                            skipped.push(format!(
                                "node {} of shard {s}: no free port (ports per shard: {stride})",
                                node.id
                            ));
                            continue;
                        }
                    },
                };
                placed.push((r, node));
            }
        }
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
        let (p, _) = a.assign(None, shards);
        let mut v: Vec<_> = p.into_iter().map(|(r, n)| (n.id.clone(), r)).collect();
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
        let (p, skipped) = a.assign(None, &three);
        assert_eq!(p.len(), 2);
        assert!(skipped[0].contains("a4"), "{skipped:?}");
    }
}
