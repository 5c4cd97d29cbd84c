//! The cluster's pods as the operator sees them: each node's pod address, readiness and
//! config hash, read from the pods' index labels.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::ResourceExt;
use shardgate_crds::names::labels;
use shardgate_crds::valkey_cluster::ValkeyCluster;
use shardgate_crds::NodeRef;

use crate::configmap::CLIENT_PORT;
use crate::context::Context;
use crate::error::Result;
use crate::formation::Announced;
use crate::objects::{cluster_selector, namespace};
use crate::statefulset::{CONFIG_HASH, CONFIG_PARTS};

/// One node's pod.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodePod {
    pub name: String,
    /// Where its Valkey listens, once it has an IP.
    pub addr: Option<SocketAddr>,
    pub ready: bool,
    /// The config hash it was started with.
    pub config_hash: Option<String>,
    /// The hash of each part of that hash ([`crate::statefulset::CONFIG_PARTS`]).
    pub config_parts: Option<String>,
    pub deleting: bool,
    /// How often its containers restarted (a pod that crashes is a fault, not a restart
    /// the operator asked for).
    pub restarts: i32,
    /// Why it cannot start, when Kubernetes says it cannot (an image that does not pull, a
    /// pod no node can take, a container that crash-loops).
    pub stuck: Option<String>,
    /// Started within [`SETTLING`]: a pod a roll replaced may still be rejoining its shard.
    pub young: bool,
    /// The Kubernetes node it was scheduled to.
    pub node_name: Option<String>,
    /// The client address its command line announces (announce mode), which CLUSTER NODES
    /// shows instead of its own.
    pub announced: Announced,
}

/// The pods of a cluster.
#[derive(Debug, Clone, Default)]
pub struct Pods {
    pub nodes: BTreeMap<NodeRef, NodePod>,
    /// Pods that carry the cluster's labels but not both index labels: an error each, never
    /// a silent default.
    pub unlabelled: Vec<String>,
}

/// Lists the pods of `vc`.
pub async fn observe(vc: &ValkeyCluster, ctx: &Context) -> Result<Pods> {
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace(vc)?);
    let list = api
        .list(&ListParams::default().labels(&cluster_selector(vc)))
        .await?;
    let mut pods = Pods::default();
    for pod in list {
        let Some(node) = index_of(&pod) else {
            pods.unlabelled.push(pod.name_any());
            continue;
        };
        let status = pod.status.as_ref();
        let addr = status
            .and_then(|s| s.pod_ip.as_deref())
            .and_then(|ip| ip.parse::<IpAddr>().ok())
            .map(|ip| SocketAddr::new(ip, CLIENT_PORT));
        let ready = status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        pods.nodes.insert(
            node,
            NodePod {
                name: pod.name_any(),
                addr,
                ready,
                config_hash: pod.annotations().get(CONFIG_HASH).cloned(),
                config_parts: pod.annotations().get(CONFIG_PARTS).cloned(),
                deleting: pod.metadata.deletion_timestamp.is_some(),
                restarts: status
                    .and_then(|s| s.container_statuses.as_ref())
                    .map_or(0, |c| c.iter().map(|c| c.restart_count).sum()),
                stuck: stuck(&pod),
                young: pod.metadata.creation_timestamp.as_ref().is_some_and(|t| {
                    k8s_openapi::jiff::Timestamp::now().duration_since(t.0)
                        < k8s_openapi::jiff::SignedDuration::from_secs(SETTLING.as_secs() as i64)
                }),
                node_name: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
                announced: pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.containers.first())
                    .and_then(|c| c.command.as_deref())
                    .map(crate::external::announce::announced)
                    .unwrap_or_default(),
            },
        );
    }
    Ok(pods)
}

/// How long after its start a pod counts as settling in (see [`NodePod::young`]).
pub const SETTLING: std::time::Duration = std::time::Duration::from_secs(600);

/// Waiting reasons of a container that will not start by waiting.
const STUCK: &[&str] = &[
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CrashLoopBackOff",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
];

/// Why `pod` cannot start, if Kubernetes says so.
fn stuck(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    let unschedulable = status.conditions.as_ref().and_then(|c| {
        c.iter()
            .find(|c| c.type_ == "PodScheduled" && c.status == "False")
            .filter(|c| c.reason.as_deref() == Some("Unschedulable"))
    });
    if let Some(c) = unschedulable {
        return Some(format!(
            "unschedulable: {}",
            c.message.as_deref().unwrap_or_default()
        ));
    }
    status.container_statuses.as_ref()?.iter().find_map(|c| {
        let waiting = c.state.as_ref()?.waiting.as_ref()?;
        let reason = waiting.reason.as_deref()?;
        STUCK.contains(&reason).then(|| reason.to_string())
    })
}

/// A pod's node, from its index labels.
pub fn index_of(pod: &Pod) -> Option<NodeRef> {
    let l = pod.labels();
    let shard = l.get(labels::SHARD_INDEX)?.parse().ok()?;
    let node = l.get(labels::NODE_INDEX)?.parse().ok()?;
    Some(NodeRef::new(shard, node))
}
