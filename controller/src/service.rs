//! The headless Service: DNS names for the pods, ready or not (a node must be reachable to
//! join the cluster before it is ready).

use k8s_openapi::api::core::v1::Service;
use kube::api::Api;
use kube::ResourceExt;
use serde_json::json;
use shardgate_crds::names::{labels, objects};
use shardgate_crds::valkey_cluster::ValkeyCluster;

use crate::configmap::{BUS_PORT, CLIENT_PORT};
use crate::context::Context;
use crate::error::Result;
use crate::objects::{apply, build, cluster_labels, namespace, owner};

pub async fn apply_headless(vc: &ValkeyCluster, ctx: &Context) -> Result<()> {
    let name = vc.name_any();
    let svc: Service = build(
        "headless Service",
        json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": objects::headless_service(&name),
                "labels": cluster_labels(vc),
                "ownerReferences": [owner(vc)?],
            },
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": true,
                "selector": {
                    labels::MANAGED_BY: labels::MANAGED_BY_VALUE,
                    labels::INSTANCE: name,
                },
                "ports": [
                    // By number: in announce mode the container's client port has a per-node name.
                    { "name": "client", "port": CLIENT_PORT, "targetPort": CLIENT_PORT, "protocol": "TCP" },
                    { "name": "bus", "port": BUS_PORT, "targetPort": "bus", "protocol": "TCP" },
                ],
            },
        }),
    )?;
    apply(&Api::namespaced(ctx.client.clone(), &namespace(vc)?), &svc).await?;
    Ok(())
}
