//! The PodDisruptionBudget: a voluntary disruption (a node drain) takes one Valkey pod at a
//! time, so that a shard never loses its primary and its replica together.

use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::Api;
use kube::ResourceExt;
use serde_json::json;
use shardgate_crds::names::{labels, objects};
use shardgate_crds::valkey_cluster::ValkeyCluster;

use crate::context::Context;
use crate::error::Result;
use crate::objects::{apply, build, cluster_labels, namespace, owner};

pub async fn apply_budget(vc: &ValkeyCluster, ctx: &Context) -> Result<()> {
    let name = vc.name_any();
    let pdb: PodDisruptionBudget = build(
        "PodDisruptionBudget",
        json!({
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {
                "name": objects::disruption_budget(&name),
                "labels": cluster_labels(vc),
                "ownerReferences": [owner(vc)?],
            },
            "spec": {
                "maxUnavailable": 1,
                "selector": { "matchLabels": {
                    labels::MANAGED_BY: labels::MANAGED_BY_VALUE,
                    labels::INSTANCE: name,
                } },
            },
        }),
    )?;
    apply(&Api::namespaced(ctx.client.clone(), &namespace(vc)?), &pdb).await?;
    Ok(())
}
