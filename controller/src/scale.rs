//! Scaling in: the nodes a smaller `replicas` or `shards` no longer has. A node that is its
//! shard's primary hands its role to a remaining replica first (`CLUSTER FAILOVER`); a
//! shard that goes hands its slots to the shards that stay first (`CLUSTER MIGRATESLOTS`,
//! as after a scale-out: keys move with their slots and writes keep being served). Then
//! the StatefulSet is deleted, and formation forgets the node once its pod is gone.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::StatefulSet;
use kube::api::{Api, DeleteParams, ListParams};
use kube::ResourceExt;
use shardgate_admin_client::{Client, Dial, NodeLine};
use shardgate_crds::names::labels;
use shardgate_crds::valkey_cluster::ValkeyCluster;
use shardgate_crds::NodeRef;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::formation::{by_home_shard, migrate_slots, migrations, FormationError, Migrations};
use crate::objects::{cluster_selector, namespace};
use crate::pods::Pods;

/// What scaling in did this time.
#[derive(Debug, PartialEq, Eq)]
pub enum ScaleIn {
    /// Nothing to remove.
    Done,
    /// It changed something (a failover, a migration started, a node removed).
    Acted(String),
    /// It started a shard's migration again after the last one failed.
    Retried(String),
    /// A shard's slots are still moving; look again soon.
    Waiting(String),
}

/// Removes one node the spec no longer has, or fails it over or moves its shard's slots
/// away first.
pub async fn remove_extra_nodes(
    vc: &ValkeyCluster,
    ctx: &Context,
    dial: &Dial,
    pods: &Pods,
) -> Result<ScaleIn> {
    let api: Api<StatefulSet> = Api::namespaced(ctx.client.clone(), &namespace(vc)?);
    let desired: Vec<NodeRef> = vc.spec.node_refs().collect();
    let shards = vc.spec.shards.max(0) as u32;
    let index = |sts: &StatefulSet| {
        let l = sts.labels();
        let s = l.get(labels::SHARD_INDEX)?.parse().ok()?;
        let n = l.get(labels::NODE_INDEX)?.parse().ok()?;
        Some(NodeRef::new(s, n))
    };
    let statefulsets = api
        .list(&ListParams::default().labels(&cluster_selector(vc)))
        .await?;
    // The nodes of each shard that goes, from their StatefulSets not being deleted (a node
    // whose pod is gone for now has one all the same).
    let mut leaving: BTreeMap<u32, Vec<NodeRef>> = BTreeMap::new();
    let staying = |sts: &&StatefulSet| sts.metadata.deletion_timestamp.is_none();
    for node in statefulsets.iter().filter(staying).filter_map(index) {
        if node.shard.0 >= shards {
            leaving.entry(node.shard.0).or_default().push(node);
        }
    }
    for sts in statefulsets {
        let Some(node) = index(&sts) else {
            continue;
        };
        let s = node.shard.0;
        if desired.contains(&node) || sts.metadata.deletion_timestamp.is_some() {
            continue;
        }
        if s >= shards {
            let nodes = leaving.get(&s).map_or(&[][..], Vec::as_slice);
            match drain_shard(dial, pods, s, shards, nodes).await? {
                ScaleIn::Done => {}
                other => return Ok(other),
            }
        }
        // A primary hands over to a remaining node of its shard first.
        let addr = pods
            .nodes
            .get(&node)
            .and_then(|p| p.addr)
            .filter(|_| s < shards);
        if let Some(addr) = addr {
            let primary = async {
                let mut c = Client::dial(addr, dial).await?;
                let lines = c.cluster_nodes().await?;
                Ok::<_, shardgate_admin_client::Error>(
                    lines
                        .iter()
                        .any(|l| l.is_myself() && l.is_primary() && !l.slots.is_empty()),
                )
            };
            if primary.await.unwrap_or(false) {
                let heir = desired
                    .iter()
                    .filter(|d| d.shard.0 == s)
                    .find_map(|d| pods.nodes.get(d).and_then(|p| p.addr).map(|a| (*d, a)));
                let Some((heir, heir_addr)) = heir else {
                    return Ok(ScaleIn::Done);
                };
                let failover = async {
                    let mut c = Client::dial(heir_addr, dial).await?;
                    c.command(["CLUSTER", "FAILOVER"]).await
                };
                failover.await.map_err(|source| FormationError::Node {
                    node: heir,
                    addr: heir_addr,
                    source,
                })?;
                return Ok(ScaleIn::Acted(format!(
                    "failed shard {s} over to node {heir} before removing node {node}"
                )));
            }
        }
        api.delete(&sts.name_any(), &DeleteParams::default())
            .await?;
        let why = if s >= shards { "shards" } else { "replicas" };
        return Ok(ScaleIn::Acted(format!(
            "removed node {node} (StatefulSet {}): {why} went down",
            sts.name_any()
        )));
    }
    Ok(ScaleIn::Done)
}

/// Whether every slot is served by a node that answers, in the view of each node that
/// does: `views`, of the shard's nodes (`asked`) that answered, and those of every other
/// node, asked here (another shard that goes may still hold its slots). A node that
/// answered none of them may then go without a slot lost.
async fn served_by_answering(
    dial: &Dial,
    pods: &Pods,
    asked: &[NodeRef],
    mut views: Vec<Vec<NodeLine>>,
) -> bool {
    for pod in pods
        .nodes
        .iter()
        .filter(|(n, _)| !asked.contains(n))
        .map(|(_, p)| p)
    {
        let Some(addr) = pod.addr else { continue };
        let view = async {
            let mut c = Client::dial(addr, dial).await?;
            c.cluster_nodes().await
        };
        if let Ok(view) = view.await {
            views.push(view);
        }
    }
    all_served_by_answering(&views)
}

/// Whether, in every one of `views` (of the nodes that answered), all 16384 slots are
/// served, each by a primary that is one of them.
fn all_served_by_answering(views: &[Vec<NodeLine>]) -> bool {
    let answering: Vec<&str> = views
        .iter()
        .filter_map(|v| v.iter().find(|l| l.is_myself()))
        .map(|l| l.id.as_str())
        .collect();
    let serves = |l: &NodeLine| l.is_primary() && !l.slots.is_empty();
    let covered = |view: &Vec<NodeLine>| {
        let mut slots = vec![false; 16384];
        for &(a, b) in view.iter().filter(|l| serves(l)).flat_map(|l| &l.slots) {
            for s in a..=b.min(16383) {
                slots[usize::from(s)] = true;
            }
        }
        slots.iter().all(|&s| s)
    };
    !answering.is_empty()
        && views.iter().all(covered)
        && views
            .iter()
            .flatten()
            .all(|l| !serves(l) || answering.contains(&l.id.as_str()))
}

/// Moves the slots of `shard`, which goes, to the `shards` that stay: each range to the
/// shard whose initial range holds it, as formation places slots after a scale-out (one
/// `CLUSTER MIGRATESLOTS` on its primary, a `SLOTSRANGE ... NODE` group per destination).
/// `Done` once no node of the shard (`leaving`, from its StatefulSets) serves a slot: by
/// its own word for those that answer; for one that does not (down, or a pod not
/// scheduled), only when every answering node's view has every slot served by answering
/// nodes (a node that did not answer may hold slots, and removing it would drop them).
async fn drain_shard(
    dial: &Dial,
    pods: &Pods,
    shard: u32,
    shards: u32,
    leaving: &[NodeRef],
) -> Result<ScaleIn> {
    let node_error = |node: NodeRef, addr| {
        move |source| Error::from(FormationError::Node { node, addr, source })
    };
    // Its primary: the node of the shard that serves slots. One that does not answer (a
    // crash-looping replica, say) does not stop the one that does.
    let mut source = None;
    let mut unanswered = Vec::new();
    let mut views = Vec::new();
    for &node in leaving {
        let Some(addr) = pods.nodes.get(&node).and_then(|p| p.addr) else {
            unanswered.push(node);
            continue;
        };
        let view = async {
            let mut client = Client::dial(addr, dial).await?;
            let view = client.cluster_nodes().await?;
            Ok::<_, shardgate_admin_client::Error>((client, view))
        };
        let Ok((client, view)) = view.await else {
            unanswered.push(node);
            continue;
        };
        match view.iter().find(|l| l.is_myself()) {
            Some(me) if me.is_primary() && !me.slots.is_empty() => {
                source = Some((node, addr, client, me.slots.clone()));
                break;
            }
            Some(_) => views.push(view),
            None => unanswered.push(node),
        }
    }
    let Some((node, addr, mut client, slots)) = source else {
        if !unanswered.is_empty() && !served_by_answering(dial, pods, leaving, views).await {
            let names: Vec<String> = unanswered.iter().map(NodeRef::to_string).collect();
            return Ok(ScaleIn::Waiting(format!(
                "shard {shard} goes; node(s) {} do not answer and may still hold slots: \
                 waiting for them, or for every slot to be served by nodes that answer",
                names.join(", ")
            )));
        }
        return Ok(ScaleIn::Done);
    };
    let again = match migrations(&mut client)
        .await
        .map_err(node_error(node, addr))?
    {
        Migrations::Idle => None,
        Migrations::Running(state) => {
            return Ok(ScaleIn::Waiting(format!(
                "shard {shard} goes; its slots are moving ({state})"
            )));
        }
        Migrations::Failed(failed) if !failed.retry_in.is_zero() => {
            return Ok(ScaleIn::Waiting(format!(
                "shard {shard} goes; its primary's {failed}"
            )));
        }
        Migrations::Failed(failed) => Some(failed),
    };
    // Each staying shard's primary, as the source sees the cluster: the one that serves
    // its slots (a wiped pod restarted as an empty primary of its own is not it).
    let view = client
        .cluster_nodes()
        .await
        .map_err(node_error(node, addr))?;
    let mut primaries: BTreeMap<u32, String> = BTreeMap::new();
    for (&n, pod) in pods.nodes.iter().filter(|(n, _)| n.shard.0 < shards) {
        if primaries.contains_key(&n.shard.0) {
            continue;
        }
        let Some(a) = pod.addr.filter(|_| pod.ready && !pod.deleting) else {
            continue;
        };
        let id = async {
            let mut c = Client::dial(a, dial).await?;
            let me = c.cluster_nodes().await?.into_iter().find(|l| l.is_myself());
            Ok::<_, shardgate_admin_client::Error>(me.map(|m| m.id))
        };
        let Ok(Some(id)) = id.await else {
            continue;
        };
        let serving = view
            .iter()
            .any(|l| l.id == id && l.is_primary() && !l.slots.is_empty());
        if serving {
            primaries.insert(n.shard.0, id);
        }
    }
    let mut moves: BTreeMap<u32, Vec<(u16, u16)>> = BTreeMap::new();
    for (home, range) in by_home_shard(&slots, shards) {
        moves.entry(home).or_default().push(range);
    }
    let mut groups = Vec::new();
    for (home, ranges) in &moves {
        let Some(id) = primaries.get(home) else {
            return Ok(ScaleIn::Waiting(format!(
                "shard {shard} goes; shard {home} has no primary to take its slots yet"
            )));
        };
        groups.push((ranges.as_slice(), id.as_str()));
    }
    let (args, count) = migrate_slots(groups);
    client
        .command(&args)
        .await
        .map_err(node_error(node, addr))?;
    let to: Vec<String> = moves.keys().map(u32::to_string).collect();
    let what = format!(
        "shard {shard} goes: migrating its {count} slots to shard {}",
        to.join(", ")
    );
    Ok(match again {
        None => ScaleIn::Acted(what),
        Some(failed) => ScaleIn::Retried(format!("{what} again: {failed}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardgate_admin_client::parse_nodes;

    /// Nodes a, b answer; c does not. `myself` marks whose view it is.
    fn view(me: &str, c_line: &str) -> Vec<NodeLine> {
        let lines = [
            "a 10.0.0.1:6379@16379 master - 0 0 1 connected 0-8191",
            "b 10.0.0.2:6379@16379 master - 0 0 2 connected 8192-16383",
            c_line,
        ]
        .map(|l| {
            if l.starts_with(me) {
                l.replacen(" master", " myself,master", 1)
            } else {
                l.to_string()
            }
        });
        parse_nodes(&lines.join("\n")).expect("hand-written CLUSTER NODES")
    }

    #[test]
    fn a_silent_node_may_go_only_when_answering_nodes_serve_every_slot() {
        let replica = "c 10.0.0.3:6379@16379 slave,fail b 0 0 2 disconnected";
        assert!(all_served_by_answering(&[
            view("a", replica),
            view("b", replica)
        ]));
        // It serves slots by one view (a failover the other has not heard of): it stays.
        let primary = "c 10.0.0.3:6379@16379 master,fail - 0 0 3 disconnected 100-200";
        assert!(!all_served_by_answering(&[
            view("a", replica),
            view("b", primary)
        ]));
        // An empty primary holds nothing.
        let empty = "c 10.0.0.3:6379@16379 master - 0 0 3 connected";
        assert!(all_served_by_answering(&[
            view("a", empty),
            view("b", empty)
        ]));
        // A primary serving slots that did not answer (b, here only in a's view) stays.
        assert!(!all_served_by_answering(&[view("a", empty)]));
        // No view: nothing known.
        assert!(!all_served_by_answering(&[]));
        // A slot no view has served (its holder forgotten, say) may be the silent node's.
        let mut gap = view("a", replica);
        gap[0].slots = vec![(0, 99), (101, 8191)];
        assert!(!all_served_by_answering(&[gap, view("b", replica)]));
    }
}
