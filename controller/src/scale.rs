//! Scaling in: the nodes a smaller `replicas` no longer has. A node that is its shard's
//! primary hands its role to a remaining replica first (`CLUSTER FAILOVER`); then its
//! StatefulSet is deleted, and formation forgets it once its pod is gone. Fewer `shards` is
//! refused for now: their slots would have to move first.

use k8s_openapi::api::apps::v1::StatefulSet;
use kube::api::{Api, DeleteParams, ListParams};
use kube::ResourceExt;
use shardgate_admin_client::Client;
use shardgate_crds::names::labels;
use shardgate_crds::valkey_cluster::ValkeyCluster;
use shardgate_crds::NodeRef;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::formation::FormationError;
use crate::objects::{cluster_selector, namespace};
use crate::pods::Pods;

/// Removes one node the spec no longer has, or fails it over first. Returns what it did.
pub async fn remove_extra_nodes(
    vc: &ValkeyCluster,
    ctx: &Context,
    pods: &Pods,
) -> Result<Option<String>> {
    let api: Api<StatefulSet> = Api::namespaced(ctx.client.clone(), &namespace(vc)?);
    let desired: Vec<NodeRef> = vc.spec.node_refs().collect();
    let shards = vc.spec.shards.max(0) as u32;
    for sts in api
        .list(&ListParams::default().labels(&cluster_selector(vc)))
        .await?
    {
        let l = sts.labels();
        let (Some(s), Some(n)) = (l.get(labels::SHARD_INDEX), l.get(labels::NODE_INDEX)) else {
            continue;
        };
        let (Ok(s), Ok(n)) = (s.parse(), n.parse()) else {
            continue;
        };
        let node = NodeRef::new(s, n);
        if desired.contains(&node) || sts.metadata.deletion_timestamp.is_some() {
            continue;
        }
        if s >= shards {
            return Err(Error::Invalid(format!(
                "spec.shards: going down to {shards} would drop shard {s} and its slots; \
                 scaling shards in is not supported (set shards back)"
            )));
        }
        // A primary hands over to a remaining node of its shard first.
        if let Some(addr) = pods.nodes.get(&node).and_then(|p| p.addr) {
            let primary = async {
                let mut c = Client::connect(addr, ctx.timeouts).await?;
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
                    return Ok(None);
                };
                let failover = async {
                    let mut c = Client::connect(heir_addr, ctx.timeouts).await?;
                    c.command(["CLUSTER", "FAILOVER"]).await
                };
                failover.await.map_err(|source| FormationError::Node {
                    node: heir,
                    addr: heir_addr,
                    source,
                })?;
                return Ok(Some(format!(
                    "failed shard {s} over to node {heir} before removing node {node}"
                )));
            }
        }
        api.delete(&sts.name_any(), &DeleteParams::default())
            .await?;
        return Ok(Some(format!(
            "removed node {node} (StatefulSet {}): replicas went down",
            sts.name_any()
        )));
    }
    Ok(None)
}
