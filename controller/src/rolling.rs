//! Rolling a change that running pods cannot take on (config, image, resources, announce
//! flags: [`crate::statefulset::pod_hash`]): the StatefulSets use `OnDelete`, and the
//! operator replaces the pods itself, one at a time, only while the cluster is formed and
//! every pod ready: replicas first; a primary only after a `CLUSTER FAILOVER` has made one
//! of its replicas the primary (graceful: no acknowledged write lost), so that it is a
//! replica when its pod goes.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams};
use shardgate_admin_client::{Client, Dial};
use shardgate_crds::valkey_cluster::ValkeyCluster;
use shardgate_crds::NodeRef;

use crate::context::Context;
use crate::error::Result;
use crate::formation::{FormationError, Formed};
use crate::objects::namespace;
use crate::pods::Pods;

/// What to do next for a roll.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Restart this node's pod: a replica, or a primary whose data survives the restart.
    Restart { node: NodeRef, primary: bool },
    /// Fail this replica's shard over to it, so that `node`, its primary, restarts as a
    /// replica.
    FailOver { replica: NodeRef, node: NodeRef },
    /// Only primaries without a replica are left, and their data lives in the pod (no
    /// `persistence`): a restart would lose their shards' keys, so the roll stops there.
    Blocked(Vec<NodeRef>),
}

/// The next step of a roll over `stale` (nodes not yet on the current config): replicas
/// first; then a primary, failed over to a replica of its shard if it has one, or restarted
/// if its data is `persistent`. `None` when nothing is to be done now.
pub fn next(stale: &[NodeRef], formed: &Formed, pods: &Pods, persistent: bool) -> Option<Next> {
    let primary = |n: &NodeRef| formed.nodes.get(n).is_some_and(|s| s.primary);
    if let Some(&node) = stale
        .iter()
        .find(|n| !primary(n) && pods.nodes.contains_key(n))
    {
        return Some(Next::Restart {
            node,
            primary: false,
        });
    }
    let mut blocked = Vec::new();
    for &node in stale.iter().filter(|n| pods.nodes.contains_key(n)) {
        let replica = formed
            .nodes
            .iter()
            .find(|(n, s)| {
                n.shard == node.shard
                    && !s.primary
                    && pods.nodes.get(n).is_some_and(|p| p.addr.is_some())
            })
            .map(|(n, _)| *n);
        match replica {
            Some(replica) => return Some(Next::FailOver { replica, node }),
            None if persistent => {
                return Some(Next::Restart {
                    node,
                    primary: true,
                })
            }
            None => blocked.push(node),
        }
    }
    (!blocked.is_empty()).then_some(Next::Blocked(blocked))
}

/// What a rolling step did, or why it cannot go on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Acted(String),
    Blocked(String),
}

/// Takes the next step of a roll over `stale` (see [`next`]), only while every pod is ready.
/// `None` when there was nothing it could do now.
pub async fn step(
    vc: &ValkeyCluster,
    ctx: &Context,
    dial: &Dial,
    pods: &Pods,
    formed: &Formed,
    stale: &[NodeRef],
    changes: impl Fn(&[NodeRef]) -> String,
) -> Result<Option<Step>> {
    if stale.is_empty() || pods.nodes.values().any(|p| !p.ready || p.deleting) {
        return Ok(None);
    }
    let Some(next) = next(stale, formed, pods, vc.spec.persistence.is_some()) else {
        return Ok(None);
    };
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace(vc)?);
    match next {
        Next::Restart { node, primary } => {
            let Some(pod) = pods.nodes.get(&node).map(|p| &p.name) else {
                return Ok(None);
            };
            api.delete(pod, &DeleteParams::default()).await?;
            let what = if primary {
                "a primary without replicas, its data on its volume: its shard is unavailable \
                 until it is back"
            } else {
                "a replica"
            };
            Ok(Some(Step::Acted(format!(
                "restarted pod {pod} (node {node}, {what}) for the new {}",
                changes(&[node])
            ))))
        }
        Next::FailOver { replica, node } => {
            let Some(addr) = pods.nodes.get(&replica).and_then(|p| p.addr) else {
                return Ok(None);
            };
            let failover = async {
                let mut client = Client::dial(addr, dial).await?;
                client.command(["CLUSTER", "FAILOVER"]).await
            };
            failover.await.map_err(|source| FormationError::Node {
                node: replica,
                addr,
                source,
            })?;
            Ok(Some(Step::Acted(format!(
                "failed shard {} over to node {replica} so that node {node} can restart as a \
                 replica",
                node.shard
            ))))
        }
        Next::Blocked(nodes) => {
            let names: Vec<String> = nodes.iter().map(NodeRef::to_string).collect();
            Ok(Some(Step::Blocked(format!(
                "node(s) {} are their shards' only copy and keep their data in the pod (no \
                 spec.persistence): restarting them for the new {} would lose their keys, \
                 so the roll stops here. Add a replica (spec.replicas: 1) and it goes on, or \
                 delete the pod(s) to accept the loss",
                names.join(", "),
                changes(&nodes)
            ))))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formation::NodeState;
    use crate::pods::NodePod;

    /// 2 shards of `nodes` nodes each; node 0 of each is primary.
    fn cluster(nodes: u32) -> (Formed, Pods) {
        let refs: Vec<NodeRef> = (0..2)
            .flat_map(|s| (0..nodes).map(move |n| NodeRef::new(s, n)))
            .collect();
        let formed = Formed {
            nodes: refs
                .iter()
                .map(|n| {
                    let state = NodeState {
                        id: n.to_string(),
                        primary: n.node.0 == 0,
                        current_certificate: false,
                    };
                    (*n, state)
                })
                .collect(),
        };
        let pod = NodePod {
            ready: true,
            addr: Some("127.0.0.1:6379".parse().unwrap()),
            ..NodePod::default()
        };
        let pods = Pods {
            nodes: refs.iter().map(|n| (*n, pod.clone())).collect(),
            unlabelled: vec![],
        };
        (formed, pods)
    }

    /// Replicas first, then each primary after a failover; a primary without a replica is
    /// restarted only when its data is on a volume, and otherwise stops the roll, naming it.
    #[test]
    fn a_roll_never_restarts_the_only_copy_of_a_shard_kept_in_the_pod() {
        let all = |nodes| -> Vec<NodeRef> {
            (0..2)
                .flat_map(|s| (0..nodes).map(move |n| NodeRef::new(s, n)))
                .collect()
        };
        let (formed, pods) = cluster(2);
        let p0 = NodeRef::new(0, 0);
        assert_eq!(
            next(&all(2), &formed, &pods, false),
            Some(Next::Restart {
                node: NodeRef::new(0, 1),
                primary: false
            })
        );
        assert_eq!(
            next(&[p0], &formed, &pods, false),
            Some(Next::FailOver {
                replica: NodeRef::new(0, 1),
                node: p0
            })
        );
        // No replicas.
        let (formed, pods) = cluster(1);
        assert_eq!(
            next(&all(1), &formed, &pods, false),
            Some(Next::Blocked(all(1)))
        );
        assert_eq!(
            next(&all(1), &formed, &pods, true),
            Some(Next::Restart {
                node: p0,
                primary: true
            })
        );
        assert_eq!(next(&[], &formed, &pods, false), None);
    }
}
