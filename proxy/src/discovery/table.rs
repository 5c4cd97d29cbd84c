//! The route table for the view chosen: each node the [`Assignment`] places, at its port,
//! with the address it announces.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use shardgate_crds::PortLayout;

use super::{Assignment, Choice, DiscoveryError};
use crate::model::{Backend, Route, Routes};

/// How the seed source lays its nodes out on ports.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    pub base_port: u16,
    /// `None`: the largest shard of the first discovery.
    pub ports_per_shard: Option<u32>,
    /// Whether replies on these listeners have their topology rewritten.
    pub rewrite: bool,
}

/// A table, and the nodes not in it with why.
#[derive(Debug)]
pub struct Table {
    pub routes: Routes,
    pub skipped: Vec<String>,
}

/// Places the nodes of the view chosen with `assignment` and builds their routes. `known` is
/// the table in force: a node listed without an address keeps the one it had there.
pub fn build(
    assignment: &mut Assignment,
    layout: Layout,
    choice: &Choice,
    known: &Routes,
) -> Result<Table, DiscoveryError> {
    let shards = choice.shards.as_slice();
    let (placed, mut skipped) = assignment.assign(layout.ports_per_shard, shards, &choice.disputed);
    let stride = assignment.stride().unwrap_or(1);
    let shard_count = placed.iter().map(|(r, _)| r.shard.0 + 1).max().unwrap_or(1);
    let ports = PortLayout::new(
        u32::from(layout.base_port),
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
        // A node the others list without an address (`noaddr`: another node answered at
        // its address, say one restarted empty) keeps the address it had.
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
        let port = ports.port(r)?;
        // The assignment gives each node its own index; were two on one, the second would
        // silently take the first's port.
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
                rewrite: layout.rewrite,
                primary: node.primary,
                tls_backend,
                slots: slots_of
                    .get(node.id.as_str())
                    .map(|s| s.to_vec())
                    .unwrap_or_default(),
            }),
        );
    }
    Ok(Table { routes, skipped })
}

#[cfg(test)]
mod tests {
    //! The route table over a sequence of refreshes, each through [`views::choose`], the
    //! assignment and the table build, as seed discovery runs them: a node joining while
    //! the views disagree, then a replica moved to another shard.

    use super::*;
    use crate::discovery::assignment::HOLD_REFRESHES;
    use crate::discovery::fixtures::*;
    use crate::discovery::{views, Answer};

    const J: &str = "c100000000000000000000000000000000000000";

    const LAYOUT: Layout = Layout {
        base_port: 30000,
        ports_per_shard: Some(4),
        rewrite: true,
    };

    /// How an answering node sees the joiner J (at 127.0.0.9).
    #[derive(Clone, Copy)]
    enum Seen {
        Not,
        /// Still in the handshake: listed alone, flagged `handshake`.
        Handshake,
        /// Met: a shard of its own without slots.
        Alone,
        /// A replica of shard `sa`.
        Replica,
    }

    fn with_joiner(me: &str, at: u8, seen: Seen) -> Answer {
        let mut a = healthy(me, at);
        let j = |primary| node(J, "127.0.0.9", primary, "online");
        match seen {
            Seen::Not => {}
            Seen::Handshake | Seen::Alone => {
                a.shards.push(shard("sj", vec![], vec![j(true)]));
                let flags = match seen {
                    Seen::Handshake => "master,handshake",
                    _ => "master",
                };
                a.nodes.push(line(J, flags, 0));
            }
            Seen::Replica => {
                a.shards[0].nodes.push(j(false));
                a.nodes.push(replica_line(J, A1, 1));
            }
        }
        a
    }

    /// `a` with B2 a replica of A1 in shard `sa` (`CLUSTER REPLICATE` from `sb`).
    fn b2_moved(mut a: Answer) -> Answer {
        let at = a.shards[1].nodes.iter().position(|n| n.id == B2);
        if let Some(i) = at {
            let b2 = a.shards[1].nodes.remove(i);
            a.shards[0].nodes.push(b2);
        }
        for l in &mut a.nodes {
            if l.id == B2 {
                *l = replica_line(B2, A1, 1);
            }
        }
        a
    }

    /// One refresh: port → (node id, primary).
    fn refresh(
        a: &mut Assignment,
        known: &mut Routes,
        answers: Vec<Answer>,
    ) -> Vec<(u16, String, bool)> {
        let choice = views::choose(answers).expect("a usable view");
        let table = build(a, LAYOUT, &choice, known).expect("a table");
        assert!(table.skipped.is_empty(), "{:?}", table.skipped);
        *known = table.routes;
        known
            .iter()
            .map(|(p, r)| (*p, r.node_id.clone().unwrap_or_default(), r.primary))
            .collect()
    }

    fn table(rows: &[(u16, &str, bool)]) -> Vec<(u16, String, bool)> {
        rows.iter()
            .map(|(p, id, primary)| (*p, id.to_string(), *primary))
            .collect()
    }

    #[test]
    fn a_joining_node_gets_one_port_and_keeps_it_while_the_views_disagree() {
        let mut a = Assignment::default();
        let mut known = Routes::new();
        let before = table(&[
            (30000, A1, true),
            (30001, A2, false),
            (30004, B1, true),
            (30005, B2, false),
        ]);
        let three = |x: Seen, y: Seen, z: Seen| {
            vec![
                with_joiner(A1, 1, x),
                with_joiner(B1, 3, y),
                with_joiner(A2, 2, z),
            ]
        };
        use Seen::*;
        assert_eq!(refresh(&mut a, &mut known, three(Not, Not, Not)), before);
        let a1 = &known[&30000];
        assert_eq!(a1.backend.to_string(), "127.0.0.1:6379");
        assert_eq!(a1.slots, [(0, 8191)]);
        assert!(a1.rewrite);
        // Met: no port while it has no place.
        let met = refresh(&mut a, &mut known, three(Alone, Handshake, Not));
        assert_eq!(met, before);
        let mut with_j = before.clone();
        with_j.insert(2, (30002, J.to_string(), false));
        // A replica of sa in the view chosen (the first of equals): the free index of sa.
        // Then views that say it is alone, that do not list it (in the handshake at the node
        // chosen, and listed by only one of three), then all agree: it never moves.
        for (step, seen) in [
            (Replica, Alone, Not),
            (Alone, Replica, Not),
            (Handshake, Replica, Not),
            (Not, Alone, Replica),
            (Replica, Replica, Replica),
        ]
        .into_iter()
        .enumerate()
        {
            let got = refresh(&mut a, &mut known, three(seen.0, seen.1, seen.2));
            assert_eq!(got, with_j, "refresh {step}");
            assert_eq!(known[&30002].backend.to_string(), "127.0.0.9:6379");
        }
    }

    #[test]
    fn a_replica_moved_to_another_shard_moves_once_when_the_views_agree() {
        let mut a = Assignment::default();
        let mut known = Routes::new();
        let three = |moved: [bool; 3]| {
            [(A1, 1), (B1, 3), (A2, 2)]
                .into_iter()
                .zip(moved)
                .map(|((me, at), m)| {
                    let h = healthy(me, at);
                    if m {
                        b2_moved(h)
                    } else {
                        h
                    }
                })
                .collect::<Vec<_>>()
        };
        let before = table(&[
            (30000, A1, true),
            (30001, A2, false),
            (30004, B1, true),
            (30005, B2, false),
        ]);
        assert_eq!(refresh(&mut a, &mut known, three([false; 3])), before);
        // Views that disagree, the one chosen saying moved, then not, then moved...
        for (step, first) in [true, false, true, false].into_iter().enumerate() {
            let got = refresh(&mut a, &mut known, three([first, !first, false]));
            assert_eq!(got, before, "disagreeing refresh {step}");
        }
        // ...then the news everywhere: it moves at once, to sa's first free index.
        let after = table(&[
            (30000, A1, true),
            (30001, A2, false),
            (30002, B2, false),
            (30004, B1, true),
        ]);
        assert_eq!(refresh(&mut a, &mut known, three([true; 3])), after);
        // A stale view chosen once more does not move it back.
        assert_eq!(
            refresh(&mut a, &mut known, three([false, true, true])),
            after
        );
        assert_eq!(refresh(&mut a, &mut known, three([true; 3])), after);
        // Stale views chosen for longer than HOLD_REFRESHES refreshes in a row are believed.
        for step in 0..HOLD_REFRESHES {
            let got = refresh(&mut a, &mut known, three([false, true, true]));
            assert_eq!(got, after, "stale refresh {step}");
        }
        assert_eq!(
            refresh(&mut a, &mut known, three([false, true, true])),
            table(&[
                (30000, A1, true),
                (30001, A2, false),
                (30004, B1, true),
                (30005, B2, false),
            ])
        );
    }
}
