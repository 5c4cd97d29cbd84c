//! Rolling a change that running pods cannot take on (config, image, resources, announce
//! flags: [`crate::statefulset::pod_hash`]): the StatefulSets use `OnDelete`, and the
//! operator replaces the pods itself, one at a time, only while the cluster is formed and
//! every pod ready: replicas first; a primary only after a `CLUSTER FAILOVER` has made one
//! of its replicas the primary (graceful: no acknowledged write lost), so that it is a
//! replica when its pod goes.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams};
use shardgate_admin_client::Client;
use shardgate_crds::valkey_cluster::ValkeyCluster;
use shardgate_crds::NodeRef;

use crate::context::Context;
use crate::error::Result;
use crate::formation::{FormationError, Formed};
use crate::objects::namespace;
use crate::pods::Pods;

/// Replaces the next pod of `stale` (pods not yet on the current config), or fails a
/// primary over first. Returns what it did; `None` when there was nothing it could do now.
pub async fn step(
    vc: &ValkeyCluster,
    ctx: &Context,
    pods: &Pods,
    formed: &Formed,
    stale: &[NodeRef],
) -> Result<Option<String>> {
    if stale.is_empty() || pods.nodes.values().any(|p| !p.ready || p.deleting) {
        return Ok(None);
    }
    let primary = |n: &NodeRef| formed.nodes.get(n).is_some_and(|s| s.primary);
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace(vc)?);
    if let Some(node) = stale.iter().find(|n| !primary(n)) {
        let Some(pod) = pods.nodes.get(node) else {
            return Ok(None);
        };
        api.delete(&pod.name, &DeleteParams::default()).await?;
        return Ok(Some(format!(
            "restarted pod {} (node {node}, a replica) for the new config",
            pod.name
        )));
    }
    let Some(node) = stale.first() else {
        return Ok(None);
    };
    // A primary: hand its slots to a replica first, if it has one.
    let replica = formed
        .nodes
        .iter()
        .find(|(n, s)| n.shard == node.shard && !s.primary)
        .map(|(n, _)| *n);
    match replica.and_then(|r| pods.nodes.get(&r).and_then(|p| p.addr).map(|a| (r, a))) {
        Some((r, addr)) => {
            let failover = async {
                let mut client = Client::connect(addr, ctx.timeouts).await?;
                client.command(["CLUSTER", "FAILOVER"]).await
            };
            failover.await.map_err(|source| FormationError::Node {
                node: r,
                addr,
                source,
            })?;
            Ok(Some(format!(
                "failed shard {} over to node {r} so that node {node} can restart as a replica",
                node.shard
            )))
        }
        None => {
            let Some(pod) = pods.nodes.get(node) else {
                return Ok(None);
            };
            api.delete(&pod.name, &DeleteParams::default()).await?;
            Ok(Some(format!(
                "restarted pod {} (node {node}, a primary without replicas: its shard is \
                 unavailable until it is back) for the new config",
                pod.name
            )))
        }
    }
}
