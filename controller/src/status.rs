//! Status from what was observed: conditions a user can act on, the phase, ready counts,
//! written with server-side apply. A condition keeps its transition time while its status
//! stays, so that an unchanged cluster writes an unchanged status.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::ResourceExt;
use serde_json::json;
use shardgate_crds::valkey_cluster::{Shape, ValkeyCluster};
use shardgate_crds::NodeRef;

use crate::context::{Context, FIELD_MANAGER};
use crate::error::Result;
use crate::external::gateway::Routing;
use crate::external::External;
use crate::formation::Progress;
use crate::objects::namespace;
use crate::pods::Pods;

/// What the reconcile found, for status.
pub struct Observed<'a> {
    pub progress: &'a Progress,
    pub pods: &'a Pods,
    pub desired_nodes: usize,
    pub shards: u32,
    /// Nodes whose pod is missing or not on the current config.
    pub stale: &'a [NodeRef],
    /// What the stale pods are to restart for, in words (`config`, `image and resources`:
    /// [`crate::statefulset::changed`]).
    pub changes: &'a str,
    /// External access in announce mode: its endpoints (`None`: off, and not reported).
    pub external: Option<&'a External>,
    /// Gateway mode: what the Gateway has (`None`: no gateway, and not reported).
    pub gateway: Option<&'a Routing>,
    /// Nodes the spec no longer has are leaving (`progress` is scale-in's).
    pub scaling_in: bool,
    /// Formation found the cluster whole this time (before a rolling restart's step).
    pub formed_now: bool,
    /// `progress` is a rolling step's (a restart, a failover, or why the roll stops).
    pub rolled: bool,
}

/// A condition as computed, before its transition time is settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Computed {
    pub type_: &'static str,
    pub status: bool,
    pub reason: &'static str,
    pub message: String,
}

/// Whether the cluster had formed before (a lost node is then a degradation, not a delay).
pub fn was_formed(vc: &ValkeyCluster) -> bool {
    condition(vc, "ClusterFormed").is_some_and(|c| c.status == "True")
}

pub fn condition<'a>(vc: &'a ValkeyCluster, type_: &str) -> Option<&'a Condition> {
    vc.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
}

/// The phase and conditions for `o`.
pub fn compute(vc: &ValkeyCluster, o: &Observed<'_>) -> (&'static str, Vec<Computed>) {
    let (phase, mut conditions) = compute_cluster(vc, o);
    if let Some(ext) = o.external {
        // A cluster that has never formed refuses every command (CLUSTERDOWN): its
        // endpoints are not access yet. Once formed, a lost node is Degraded's to report.
        let forming = !matches!(o.progress, Progress::Formed(_)) && !was_formed(vc);
        conditions.push(external_condition(
            ext,
            o.desired_nodes,
            forming,
            vc.spec.tls.is_some(),
        ));
    }
    if let Some(r) = o.gateway {
        conditions.push(gateway_condition(r));
    }
    (phase, conditions)
}

/// GatewayReady: the Gateway has a TCP listener for every route, accepted them all, and
/// has an address.
fn gateway_condition(r: &Routing) -> Computed {
    let ports: Vec<String> = r
        .status
        .expected_listeners
        .iter()
        .map(|l| l.port.to_string())
        .collect();
    if r.problems.is_empty() {
        Computed {
            type_: "GatewayReady",
            status: true,
            reason: "RoutesAccepted",
            message: format!(
                "Gateway {} at {} routes listener ports {} to the nodes",
                r.status.name,
                r.status.address.as_deref().unwrap_or_default(),
                ports.join(",")
            ),
        }
    } else {
        Computed {
            type_: "GatewayReady",
            status: false,
            reason: r.reason,
            message: r.problems.join("; "),
        }
    }
}

/// ExternalAccessReady: true when every node has an external endpoint, one that clients are
/// handed (not a DNS name under `preferredEndpointType: ip`), and the cluster has formed
/// (`forming`: not yet). `tls`: the nodes speak only TLS, which the message says.
fn external_condition(ext: &External, desired_nodes: usize, forming: bool, tls: bool) -> Computed {
    let all = ext.missing.is_empty() && ext.endpoints.len() == desired_nodes;
    if all && forming {
        return Computed {
            type_: "ExternalAccessReady",
            status: false,
            reason: "ClusterForming",
            message: format!(
                "{desired_nodes} nodes have an external endpoint; the cluster is still forming, and refuses commands until it has"
            ),
        };
    }
    if all && !ext.names_not_handed_out.is_empty() {
        return Computed {
            type_: "ExternalAccessReady",
            status: false,
            reason: "HostnamesNotPreferred",
            message: format!(
                "nodes are reached at DNS names ({}), but Valkey hands out names only as hostnames, \
                 so clients would be redirected to the pods' own IPs: set preferredEndpointType: \
                 hostname, with a domain whose per-node names resolve to the nodes' hosts \
                 (serviceAnnotations can ask external-dns for them; the way for a LoadBalancer per \
                 shard), or with an advertisedHost that is the one DNS name every node is reached \
                 at on its own port",
                ext.names_not_handed_out.join(", ")
            ),
        };
    }
    if all {
        Computed {
            type_: "ExternalAccessReady",
            status: true,
            reason: "EndpointsReady",
            message: format!(
                "{} nodes reachable from outside{}; bootstrap: {}",
                ext.endpoints.len(),
                if tls {
                    " over TLS only (with a client certificate of the Secret's CA unless \
                     tls-auth-clients says otherwise)"
                } else {
                    ""
                },
                ext.bootstrap().unwrap_or_default()
            ),
        }
    } else {
        Computed {
            type_: "ExternalAccessReady",
            status: false,
            reason: "EndpointsPending",
            message: format!(
                "{} of {desired_nodes} nodes have an external endpoint; {}",
                ext.endpoints.len(),
                ext.missing.join("; ")
            ),
        }
    }
}

/// The shape the cluster last formed whole with and the one the spec asks for, while the
/// cluster, formed before, is on its way from one to the other: they differ, or nodes
/// are leaving (a scale-out undone before it formed).
fn scaling(vc: &ValkeyCluster, scaling_in: bool) -> Option<(Shape, Shape)> {
    if !was_formed(vc) {
        return None;
    }
    let wanted = vc.spec.shape();
    match vc.status.as_ref().and_then(|s| s.formed) {
        Some(formed) if formed != wanted => Some((formed, wanted)),
        formed if scaling_in => Some((formed.unwrap_or(wanted), wanted)),
        _ => None,
    }
}

/// The nodes of both shapes (a fault, not the scale, if one is not ready).
fn kept_nodes(from: Shape, to: Shape) -> impl Iterator<Item = NodeRef> {
    let shards = u32::try_from(from.shards.min(to.shards)).unwrap_or(0);
    let nodes = u32::try_from(from.replicas.min(to.replicas)).map_or(0, |r| r + 1);
    (0..shards).flat_map(move |s| (0..nodes).map(move |n| NodeRef::new(s, n)))
}

/// `status.formed` after this step: the spec's shape once formed, else the last.
fn formed_shape(vc: &ValkeyCluster, formed_now: bool) -> Option<Shape> {
    if formed_now {
        return Some(vc.spec.shape());
    }
    vc.status.as_ref().and_then(|s| s.formed)
}

/// How many pods still run an old config (pods being replaced included).
fn on_old_config(o: &Observed<'_>) -> usize {
    o.stale
        .iter()
        .filter(|n| o.pods.nodes.contains_key(n))
        .count()
}

/// While a config change rolls through a formed cluster (pods on an old config remain, or
/// the last status said so and the cluster has not settled since): what it is doing. `None`
/// when no roll is under way or something besides it is wrong: more than the one node the
/// roll replaces at a time is down; a node is down that the roll did not take down (a pod
/// on an old config that is not being replaced, a pod that crashed since it started, or
/// one Kubernetes cannot start); or formation waits or acts while no node is down, the
/// roll did nothing, and no pod it replaced is still settling in ([`crate::pods::SETTLING`]).
fn rolling(vc: &ValkeyCluster, o: &Observed<'_>) -> Option<String> {
    let old = on_old_config(o);
    let was_rolling = condition(vc, "Progressing").is_some_and(|c| c.reason == "RollingConfig");
    if !was_formed(vc) || (old == 0 && !was_rolling) {
        return None;
    }
    // Missing pods are on their way back (the StatefulSet recreates them).
    let mut restarting: Vec<NodeRef> = o
        .stale
        .iter()
        .filter(|n| !o.pods.nodes.contains_key(n))
        .copied()
        .collect();
    for (n, p) in &o.pods.nodes {
        if p.deleting {
            restarting.push(*n);
        } else if !p.ready {
            if o.stale.contains(n) || p.restarts > 0 || p.stuck.is_some() {
                return None;
            }
            restarting.push(*n);
        }
    }
    // The last pod the roll replaced, rejoining (met again, re-attached, copying its
    // primary's data).
    let settling = o
        .pods
        .nodes
        .iter()
        .any(|(n, p)| p.young && !o.stale.contains(n));
    let step = match (o.progress, restarting.as_slice()) {
        (Progress::Formed(_), []) if old == 0 => return None,
        (Progress::Formed(_), []) => String::new(),
        (Progress::Formed(_), [n]) => format!("; node {n} restarting"),
        (_, [_, _, ..]) => return None,
        (Progress::Acted(what) | Progress::Retried(what) | Progress::Waiting(what), down)
            if o.rolled || !down.is_empty() || settling =>
        {
            format!("; {what}")
        }
        _ => return None,
    };
    Some(if old > 0 {
        format!(
            "{old} of {} pods to restart with the new {}{step}",
            o.desired_nodes, o.changes
        )
    } else {
        format!("every pod restarted for the change{step}")
    })
}

/// The phase and the cluster's own conditions.
fn compute_cluster(vc: &ValkeyCluster, o: &Observed<'_>) -> (&'static str, Vec<Computed>) {
    let formed_before = was_formed(vc);
    let ready_pods = o.pods.nodes.values().filter(|p| p.ready).count();
    let all_ready = ready_pods == o.desired_nodes;
    let c = |type_, status, reason, message: String| Computed {
        type_,
        status,
        reason,
        message,
    };
    let scale = scaling(vc, o.scaling_in);
    // A config change the user asked for, one pod at a time: not Degraded, and not Ready
    // for the spec until every pod runs it (so that waiting for Ready waits for the roll).
    if let Some(message) = rolling(vc, o).filter(|_| scale.is_none()) {
        let conditions = vec![
            c("Ready", false, "RollingConfig", message.clone()),
            c("ClusterFormed", true, "Formed", message.clone()),
            c("Progressing", true, "RollingConfig", message.clone()),
            c("Degraded", false, "RollingConfig", message),
        ];
        return ("Upgrading", conditions);
    }
    match (o.progress, scale) {
        (Progress::Formed(f), _) => {
            let primaries = f.nodes.values().filter(|n| n.primary).count();
            let summary = format!(
                "{} shards, {} nodes; all 16384 slots served; {primaries} primaries with their replicas",
                o.shards,
                f.nodes.len()
            );
            // A roll that waits for a fault to clear is still to do.
            let old = on_old_config(o);
            let progressing = if old > 0 {
                let what = format!("{old} pods to restart with the new {}", o.changes);
                c("Progressing", true, "RollingConfig", what)
            } else {
                c("Progressing", false, "Settled", "nothing to do".into())
            };
            let ready = if all_ready {
                c("Ready", true, "ClusterReady", summary.clone())
            } else {
                c(
                    "Ready",
                    false,
                    "PodsNotReady",
                    format!("{ready_pods} of {} pods ready", o.desired_nodes),
                )
            };
            (
                if all_ready { "Ready" } else { "Degraded" },
                vec![
                    ready,
                    c("ClusterFormed", true, "Formed", summary),
                    progressing,
                    c("Degraded", false, "Healthy", "no node is missing".into()),
                ],
            )
        }
        (
            Progress::Acted(what) | Progress::Retried(what) | Progress::Waiting(what),
            Some((from, to)),
        ) => {
            // A change the user asked for, not a fault: not Degraded (the cluster keeps
            // serving while its slots move), but not Ready for its spec until it has the
            // new shape, so that waiting for Ready waits for the scale. A node of both
            // shapes that is not ready is a fault all the same.
            let message = if from == to {
                format!("scaling to {to}: {what}")
            } else {
                format!("scaling from {from} to {to}: {what}")
            };
            let down: Vec<String> = kept_nodes(from, to)
                .filter(|n| !o.pods.nodes.get(n).is_some_and(|p| p.ready))
                .map(|n| n.to_string())
                .collect();
            if !down.is_empty() {
                let fault = format!("{message}; node(s) {} not ready", down.join(", "));
                let conditions = vec![
                    c("Ready", false, "PodsNotReady", fault.clone()),
                    c("ClusterFormed", true, "Formed", message.clone()),
                    c("Progressing", true, "Scaling", message),
                    c("Degraded", true, "PodsNotReady", fault),
                ];
                return ("Degraded", conditions);
            }
            let conditions = vec![
                c("Ready", false, "Scaling", message.clone()),
                c("ClusterFormed", true, "Formed", message.clone()),
                c("Progressing", true, "Scaling", message.clone()),
                c("Degraded", false, "Scaling", message),
            ];
            ("Scaling", conditions)
        }
        (Progress::Acted(what) | Progress::Retried(what) | Progress::Waiting(what), None) => {
            let acting = !matches!(o.progress, Progress::Waiting(_));
            let (phase, reason) = match (formed_before, acting) {
                (false, _) => ("Forming", "Forming"),
                (true, true) => ("Degraded", "Healing"),
                (true, false) => ("Degraded", "Waiting"),
            };
            let conditions = vec![
                c("Ready", false, reason, what.clone()),
                c(
                    "ClusterFormed",
                    formed_before,
                    if formed_before { "Formed" } else { "Forming" },
                    what.clone(),
                ),
                c("Progressing", true, reason, what.clone()),
                c("Degraded", formed_before, reason, what.clone()),
            ];
            (phase, conditions)
        }
    }
}

/// A spec the operator cannot act on (one the API server's checks let through, such as a
/// `config` key it writes itself in other letters): phase Failed, and Ready false with
/// reason `InvalidSpec` and why, for the spec's generation. The other conditions and
/// fields stay as they were (a merge patch), since nothing was looked at.
pub async fn invalid(vc: &ValkeyCluster, ctx: &Context, why: &str) -> Result<()> {
    cannot_act(vc, ctx, "Failed", "InvalidSpec", why).await
}

/// `spec.tls`'s Secret cannot be read (missing, or without its keys): the operator cannot
/// talk to the nodes. Ready false with reason `TLSSecretUnavailable`; phase Pending for a
/// cluster never formed, Degraded for one that was (its nodes may serve on, unwatched).
pub async fn tls_secret_unavailable(vc: &ValkeyCluster, ctx: &Context, why: &str) -> Result<()> {
    let formed = vc.status.as_ref().is_some_and(|s| s.formed.is_some());
    let phase = if formed { "Degraded" } else { "Pending" };
    cannot_act(vc, ctx, phase, "TLSSecretUnavailable", why).await
}

/// Status when the reconcile stopped before looking at the cluster: `phase`, and Ready
/// false with `reason` and why, for the spec's generation. The other conditions and fields
/// stay as they were (a merge patch), since nothing was looked at.
async fn cannot_act(
    vc: &ValkeyCluster,
    ctx: &Context,
    phase: &str,
    reason: &str,
    why: &str,
) -> Result<()> {
    let now = Time(Timestamp::now());
    let mut conditions: Vec<Condition> = vc
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    let ready = Condition {
        type_: "Ready".into(),
        status: "False".into(),
        reason: reason.into(),
        message: why.into(),
        observed_generation: vc.metadata.generation,
        last_transition_time: condition(vc, "Ready")
            .filter(|c| c.status == "False")
            .map_or(now, |c| c.last_transition_time.clone()),
    };
    match conditions.iter_mut().find(|c| c.type_ == "Ready") {
        Some(c) => *c = ready,
        None => conditions.push(ready),
    }
    let status = json!({
        "status": {
            "observedGeneration": vc.metadata.generation,
            "phase": phase,
            "conditions": conditions,
        },
    });
    let api: Api<ValkeyCluster> = Api::namespaced(ctx.client.clone(), &namespace(vc)?);
    api.patch_status(
        &vc.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&status),
    )
    .await?;
    Ok(())
}

/// Writes the status for `o`. Returns the computed conditions (for events).
pub async fn patch(vc: &ValkeyCluster, ctx: &Context, o: &Observed<'_>) -> Result<Vec<Computed>> {
    let (phase, computed) = compute(vc, o);
    let now = Time(Timestamp::now());
    let conditions: Vec<Condition> = computed
        .iter()
        .map(|c| {
            let status = if c.status { "True" } else { "False" };
            let previous = condition(vc, c.type_).filter(|p| p.status == status);
            Condition {
                type_: c.type_.into(),
                status: status.into(),
                reason: c.reason.into(),
                message: c.message.clone(),
                observed_generation: vc.metadata.generation,
                last_transition_time: previous
                    .map(|p| p.last_transition_time.clone())
                    .unwrap_or_else(|| now.clone()),
            }
        })
        .collect();
    let ready_nodes = o.pods.nodes.values().filter(|p| p.ready).count();
    let ready_shards = (0..o.shards)
        .filter(|s| {
            let nodes: Vec<_> = o
                .pods
                .nodes
                .iter()
                .filter(|(n, _)| n.shard.0 == *s)
                .collect();
            !nodes.is_empty() && nodes.iter().all(|(_, p)| p.ready)
        })
        .count();
    let mut status = json!({
        "apiVersion": "shardgate.io/v1alpha1",
        "kind": "ValkeyCluster",
        "status": {
            "observedGeneration": vc.metadata.generation,
            "phase": phase,
            "conditions": conditions,
            "readyNodes": ready_nodes,
            "readyShards": ready_shards,
            "ready": format!("{ready_nodes}/{}", o.desired_nodes),
        },
    });
    // Only with external access: unset, the fields are no longer applied and go.
    if let Some(ext) = o.external {
        if !ext.endpoints.is_empty() {
            status["status"]["externalEndpoints"] = json!(ext.endpoints);
        }
        if let Some(b) = ext.bootstrap() {
            status["status"]["bootstrap"] = json!(b);
        }
    }
    if let Some(r) = o.gateway {
        status["status"]["gateway"] = json!(r.status);
    }
    // Applied on every write, or it would go.
    if let Some(formed) = formed_shape(vc, o.formed_now) {
        status["status"]["formed"] = json!(formed);
    }
    let api: Api<ValkeyCluster> = Api::namespaced(ctx.client.clone(), &namespace(vc)?);
    api.patch_status(
        &vc.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&status),
    )
    .await?;
    Ok(computed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardgate_crds::valkey_cluster::{ExternalEndpoint, NodeRole};

    fn endpoint(node: i32, role: NodeRole) -> ExternalEndpoint {
        ExternalEndpoint {
            shard: 0,
            node,
            service: "vc-shard-0".into(),
            host: "10.0.0.1".into(),
            port: 30000 + node,
            hostname: None,
            role: Some(role),
        }
    }

    #[test]
    fn external_access_ready_when_every_node_has_an_endpoint() {
        let mut ext = External {
            endpoints: vec![endpoint(0, NodeRole::Replica)],
            missing: vec!["node 0-1: Service vc-shard-0 has no NodePort yet".into()],
            names_not_handed_out: vec![],
        };
        let c = external_condition(&ext, 2, false, false);
        assert!(!c.status);
        assert_eq!(c.reason, "EndpointsPending");
        assert!(c.message.contains("1 of 2 nodes") && c.message.contains("0-1"));
        // While forming, what is missing is still what it says.
        assert_eq!(
            external_condition(&ext, 2, true, false).reason,
            "EndpointsPending"
        );
        ext.endpoints.push(endpoint(1, NodeRole::Primary));
        ext.missing.clear();
        // Every endpoint, but no cluster yet: clients from outside would be refused.
        let c = external_condition(&ext, 2, true, false);
        assert!(!c.status);
        assert_eq!(c.reason, "ClusterForming");
        let c = external_condition(&ext, 2, false, false);
        assert!(c.status);
        assert!(
            c.message
                .ends_with("bootstrap: 10.0.0.1:30001,10.0.0.1:30000"),
            "{}",
            c.message
        );
        // Nodes on TLS: the message says how to connect.
        let c = external_condition(&ext, 2, false, true);
        assert!(
            c.message.contains("reachable from outside over TLS only"),
            "{}",
            c.message
        );
    }

    /// Every node has an endpoint, but some are DNS names that Valkey would not hand out:
    /// not ready, and the message says how to have them handed out.
    #[test]
    fn names_not_handed_out_are_not_access() {
        let ext = External {
            endpoints: vec![endpoint(0, NodeRole::Primary)],
            missing: vec![],
            names_not_handed_out: vec!["node 0-0: lb-1.elb.example.com".into()],
        };
        let c = external_condition(&ext, 1, false, false);
        assert!(!c.status);
        assert_eq!(c.reason, "HostnamesNotPreferred");
        assert!(
            c.message.contains("lb-1.elb.example.com")
                && c.message.contains("preferredEndpointType: hostname"),
            "{}",
            c.message
        );
        // While forming, forming is what it says.
        assert_eq!(
            external_condition(&ext, 1, true, false).reason,
            "ClusterForming"
        );
    }

    /// Through `compute`: all endpoints while the cluster forms is not access yet; once it
    /// has formed, a later wait (a lost node) does not take access away.
    #[test]
    fn external_access_waits_for_the_first_formation() {
        use shardgate_crds::valkey_cluster::ValkeyClusterStatus;
        let ext = External {
            endpoints: vec![endpoint(0, NodeRole::Primary)],
            missing: vec![],
            names_not_handed_out: vec![],
        };
        let pods = Pods {
            nodes: Default::default(),
            unlabelled: vec![],
        };
        let external = |vc: &ValkeyCluster, progress: Progress| {
            let o = Observed {
                progress: &progress,
                pods: &pods,
                desired_nodes: 1,
                shards: 1,
                stale: &[],
                changes: "config",
                external: Some(&ext),
                gateway: None,
                scaling_in: false,
                formed_now: false,
                rolled: false,
            };
            let (_, conditions) = compute(vc, &o);
            let c = conditions
                .into_iter()
                .find(|c| c.type_ == "ExternalAccessReady")
                .expect("the condition, with external access on");
            (c.status, c.reason)
        };
        let mut vc = ValkeyCluster::test("vc");
        let waiting = || Progress::Waiting("meeting the nodes".into());
        assert_eq!(external(&vc, waiting()), (false, "ClusterForming"));
        assert_eq!(
            external(&vc, Progress::Formed(Default::default())),
            (true, "EndpointsReady")
        );
        vc.status = Some(ValkeyClusterStatus {
            conditions: vec![Condition {
                type_: "ClusterFormed".into(),
                status: "True".into(),
                reason: "Formed".into(),
                message: String::new(),
                observed_generation: None,
                last_transition_time: Time(Timestamp::now()),
            }],
            ..Default::default()
        });
        assert_eq!(external(&vc, waiting()), (true, "EndpointsReady"));
    }

    /// The status and reason of the computed condition `type_`.
    fn find(conditions: &[Computed], type_: &str) -> Option<(bool, &'static str)> {
        conditions
            .iter()
            .find(|c| c.type_ == type_)
            .map(|c| (c.status, c.reason))
    }

    /// A condition as the API server holds it.
    fn held(type_: &str, status: &str) -> Condition {
        Condition {
            type_: type_.into(),
            status: status.into(),
            reason: "Earlier".into(),
            message: String::new(),
            observed_generation: None,
            last_transition_time: Time(Timestamp::now()),
        }
    }

    /// A spec that asks for another shape than the cluster formed with: Scaling, not
    /// Degraded nor Ready (yet); the same step on a cluster of its spec's shape is healing,
    /// unless nodes are leaving it (a scale-out undone). A node of both shapes that is not
    /// ready is a fault while scaling too. Once formed again, the new shape is the formed
    /// one.
    #[test]
    fn a_new_shape_is_scaling_not_degradation() {
        use crate::pods::NodePod;
        use shardgate_crds::valkey_cluster::ValkeyClusterStatus;
        // Every node of 3 shards x 1 replica ready, but `down`.
        let pods = |down: Option<NodeRef>| Pods {
            nodes: (0..3)
                .flat_map(|s| (0..2).map(move |n| NodeRef::new(s, n)))
                .map(|n| {
                    let pod = NodePod {
                        ready: Some(n) != down,
                        ..NodePod::default()
                    };
                    (n, pod)
                })
                .collect(),
            unlabelled: vec![],
        };
        let formed_as = |shards| {
            ValkeyCluster::test("vc")
                .shards(3)
                .replicas(1)
                .with_status(ValkeyClusterStatus {
                    conditions: vec![held("ClusterFormed", "True"), held("Ready", "True")],
                    formed: Some(Shape {
                        shards,
                        replicas: 1,
                    }),
                    ..Default::default()
                })
        };
        let compute_for = |vc: &ValkeyCluster, progress: &Progress, scaling_in, pods: &Pods| {
            let o = Observed {
                progress,
                pods,
                desired_nodes: 6,
                shards: 3,
                stale: &[],
                changes: "config",
                external: None,
                gateway: None,
                scaling_in,
                formed_now: false,
                rolled: false,
            };
            let (phase, conditions) = compute(vc, &o);
            let find = |t| find(&conditions, t);
            (
                phase,
                find("Ready"),
                find("Progressing"),
                find("Degraded"),
                conditions[0].message.clone(),
            )
        };
        let all_up = pods(None);
        let moving = Progress::Waiting("shard 3 goes; its slots are moving".into());
        let (phase, ready, progressing, degraded, message) =
            compute_for(&formed_as(4), &moving, true, &all_up);
        let scaling = Some((true, "Scaling"));
        assert_eq!(
            (phase, ready, progressing, degraded),
            (
                "Scaling",
                Some((false, "Scaling")),
                scaling,
                Some((false, "Scaling"))
            )
        );
        assert_eq!(
            message,
            "scaling from 4 shards, 1 replica each to 3 shards, 1 replica each: \
             shard 3 goes; its slots are moving"
        );
        // A node that stays is down meanwhile: a fault, said as one.
        let one_down = pods(Some(NodeRef::new(1, 1)));
        let (phase, ready, progressing, degraded, message) =
            compute_for(&formed_as(4), &moving, true, &one_down);
        let not_ready = |status| Some((status, "PodsNotReady"));
        assert_eq!(
            (phase, ready, progressing, degraded),
            ("Degraded", not_ready(false), scaling, not_ready(true))
        );
        assert!(message.ends_with("node(s) 1-1 not ready"), "{message}");
        // A node only the new shape has (shard 3 of a scale-out) is the scale's to start.
        let growing = ValkeyCluster::test("vc")
            .shards(4)
            .replicas(1)
            .with_status(formed_as(3).status.clone().unwrap_or_default());
        let (phase, ..) = compute_for(&growing, &moving, false, &all_up);
        assert_eq!(phase, "Scaling");
        // The spec's own shape: a step is healing...
        let healing = Progress::Acted("forgot node 1234abcd".into());
        let (phase, ready, _, degraded, _) = compute_for(&formed_as(3), &healing, false, &all_up);
        assert_eq!(phase, "Degraded");
        assert_eq!(ready, Some((false, "Healing")));
        assert_eq!(degraded, Some((true, "Healing")));
        // ... unless nodes leave it (a scale-out undone before it formed).
        let (phase, _, _, degraded, message) = compute_for(&formed_as(3), &moving, true, &all_up);
        assert_eq!((phase, degraded), ("Scaling", Some((false, "Scaling"))));
        assert!(
            message.starts_with("scaling to 3 shards, 1 replica each: "),
            "{message}"
        );
        // What status keeps: the last formed shape until the cluster forms at the spec's.
        let to_three = |shards| {
            Some(Shape {
                shards,
                replicas: 1,
            })
        };
        assert_eq!(formed_shape(&formed_as(4), false), to_three(4));
        assert_eq!(formed_shape(&formed_as(4), true), to_three(3));
        assert_eq!(formed_shape(&ValkeyCluster::test("vc"), false), None);
    }

    /// A config change rolling through a formed cluster: Upgrading, with Ready false (so
    /// that waiting for Ready waits for the roll) and Degraded false, while the one node
    /// down is the one the roll replaces, also after the last old pod went. A node down
    /// that the roll did not take down, or two at once, is a fault; once every pod runs
    /// the new config and is ready, the cluster is Ready.
    #[test]
    fn a_config_roll_is_upgrading_not_degradation() {
        use crate::pods::NodePod;
        use shardgate_crds::valkey_cluster::ValkeyClusterStatus;
        let nodes: Vec<NodeRef> = (0..2)
            .flat_map(|s| (0..2).map(move |n| NodeRef::new(s, n)))
            .collect();
        let n01 = NodeRef::new(0, 1);
        let n10 = NodeRef::new(1, 0);
        let ready = NodePod {
            ready: true,
            ..NodePod::default()
        };
        let all_ready = || -> Pods {
            Pods {
                nodes: nodes.iter().map(|n| (*n, ready.clone())).collect(),
                unlabelled: vec![],
            }
        };
        let with = |changes: &[(NodeRef, NodePod)]| {
            let mut pods = all_ready();
            for (n, p) in changes {
                pods.nodes.insert(*n, p.clone());
            }
            pods
        };
        let down = NodePod::default();
        let deleting = NodePod {
            deleting: true,
            ..ready.clone()
        };
        let crashed = NodePod {
            restarts: 2,
            ..NodePod::default()
        };
        // Formed and ready; `rolling`: the last status said a roll was under way.
        let vc = |rolling: bool| {
            let mut progressing = held("Progressing", "True");
            if rolling {
                progressing.reason = "RollingConfig".into();
            }
            ValkeyCluster::test("vc")
                .shards(2)
                .replicas(1)
                .with_status(ValkeyClusterStatus {
                    conditions: vec![
                        held("ClusterFormed", "True"),
                        held("Ready", "True"),
                        progressing,
                    ],
                    ..Default::default()
                })
        };
        let compute_with = |vc: &ValkeyCluster,
                            progress: Progress,
                            pods: Pods,
                            stale: &[NodeRef],
                            rolled: bool| {
            let o = Observed {
                progress: &progress,
                pods: &pods,
                desired_nodes: 4,
                shards: 2,
                stale,
                changes: "config",
                external: None,
                gateway: None,
                scaling_in: false,
                formed_now: false,
                rolled,
            };
            let (phase, conditions) = compute(vc, &o);
            let find = |t| find(&conditions, t);
            let upgrading = (
                Some((false, "RollingConfig")),
                Some((true, "RollingConfig")),
                Some((false, "RollingConfig")),
            );
            let read = (find("Ready"), find("Progressing"), find("Degraded"));
            if phase == "Upgrading" {
                assert_eq!(read, upgrading, "Upgrading says so in every condition");
            }
            (phase, read.0, conditions[0].message.clone())
        };
        // Progress from formation (not the roll's own step).
        let compute_for =
            |vc: &ValkeyCluster, progress: Progress, pods: Pods, stale: &[NodeRef]| {
                compute_with(vc, progress, pods, stale, false)
            };
        let formed = || Progress::Formed(Default::default());
        let waiting = || Progress::Waiting("node 0-1 has no address yet".into());
        let old_but_01 = [NodeRef::new(0, 0), n10, NodeRef::new(1, 1)];

        // The change is seen: every pod to restart, none down yet.
        let (phase, _, message) = compute_for(&vc(false), formed(), all_ready(), &nodes);
        assert_eq!(phase, "Upgrading");
        assert_eq!(message, "4 of 4 pods to restart with the new config");
        // The roll's own step.
        let restarted = Progress::Acted("restarted pod vc-shard-0-1 (node 0-1, a replica)".into());
        let (phase, _, message) = compute_with(&vc(true), restarted, all_ready(), &nodes, true);
        assert_eq!(phase, "Upgrading");
        assert!(message.ends_with("; restarted pod vc-shard-0-1 (node 0-1, a replica)"));
        // The replaced pod going, gone, and back on the new config but not ready yet.
        let going = with(&[(n01, deleting.clone())]);
        assert_eq!(
            compute_for(&vc(true), waiting(), going, &nodes).0,
            "Upgrading"
        );
        let mut gone = all_ready();
        gone.nodes.remove(&n01);
        assert_eq!(
            compute_for(&vc(true), waiting(), gone, &nodes).0,
            "Upgrading"
        );
        let starting = with(&[(n01, down.clone())]);
        let (phase, _, message) = compute_for(&vc(true), waiting(), starting, &old_but_01);
        assert_eq!(phase, "Upgrading");
        assert_eq!(
            message,
            "3 of 4 pods to restart with the new config; node 0-1 has no address yet"
        );
        // After the last old pod went: still the roll's until the cluster settles...
        let last = with(&[(n10, down.clone())]);
        let (phase, _, message) = compute_for(&vc(true), formed(), last.clone(), &[]);
        assert_eq!(phase, "Upgrading");
        assert_eq!(
            message,
            "every pod restarted for the change; node 1-0 restarting"
        );
        // ... and then Ready.
        let (phase, ready, _) = compute_for(&vc(true), formed(), all_ready(), &[]);
        assert_eq!((phase, ready), ("Ready", Some((true, "ClusterReady"))));

        // Faults, said as such: a pod on the old config that nobody replaces is down...
        let old_down = with(&[(n01, down.clone())]);
        let (phase, ready, _) = compute_for(&vc(true), waiting(), old_down, &nodes);
        assert_eq!((phase, ready), ("Degraded", Some((false, "Waiting"))));
        // ... the new pod crashes...
        let crashing = with(&[(n01, crashed)]);
        let (phase, ..) = compute_for(&vc(true), waiting(), crashing, &old_but_01);
        assert_eq!(phase, "Degraded");
        // ... two nodes down at once...
        let two = with(&[(n01, deleting), (n10, down.clone())]);
        let (phase, ..) = compute_for(&vc(true), waiting(), two, &nodes);
        assert_eq!(phase, "Degraded");
        // ... a new pod Kubernetes cannot start (a bad image tag)...
        let pulling = NodePod {
            stuck: Some("ImagePullBackOff".into()),
            ..NodePod::default()
        };
        let bad_image = with(&[(n01, pulling)]);
        let (phase, ..) = compute_for(&vc(true), waiting(), bad_image, &old_but_01);
        assert_eq!(phase, "Degraded");
        // ... formation waiting with every pod up, after the roll, once no replaced pod is
        // settling in any more (a replica that never syncs, say), and not while one is.
        let copying = || Progress::Waiting("node 0-1 is still copying its primary's data".into());
        let (phase, ready, _) = compute_for(&vc(true), copying(), all_ready(), &[]);
        assert_eq!((phase, ready), ("Degraded", Some((false, "Waiting"))));
        let settling = with(&[(
            n01,
            NodePod {
                young: true,
                ready: true,
                ..NodePod::default()
            },
        )]);
        let (phase, ..) = compute_for(&vc(true), copying(), settling, &[]);
        assert_eq!(phase, "Upgrading");
        // ... and without a roll, a node down is what it was (a killed pod, say).
        let (phase, ready, _) = compute_for(&vc(false), waiting(), last.clone(), &[]);
        assert_eq!((phase, ready), ("Degraded", Some((false, "Waiting"))));
        let (phase, ready, _) = compute_for(&vc(false), formed(), last, &[]);
        assert_eq!((phase, ready), ("Degraded", Some((false, "PodsNotReady"))));
    }
}
