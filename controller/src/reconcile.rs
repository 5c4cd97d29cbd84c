//! The reconciler: one function that makes a `ValkeyCluster`'s children and cluster match
//! its spec, the error policy, and the controller that runs them.
//!
//! A reconcile only orchestrates: the children (one file each; the external Services of
//! announce mode before the StatefulSets, whose nodes announce them), then formation and healing
//! ([`crate::formation`]), then rolling config changes ([`crate::rolling`]), then status
//! ([`crate::status`]). Events are published for every change made and every failure.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gateway_api::experimental::gateways::Gateway;
use gateway_api::experimental::tcproutes::TcpRoute;
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use shardgate_crds::names::labels;
use shardgate_crds::names::objects::MAX_CLUSTER_NAME;
use shardgate_crds::valkey_cluster::ValkeyCluster;
use tracing::{info, warn};

use crate::context::Context;
use crate::error::{Error, Result};
use crate::external::gateway::GatewayApi;
use crate::formation::{self, Plan, Progress};
use crate::metrics::{ActionLabels, ErrorLabels};
use crate::status::Observed;
use crate::{configmap, external, pdb, pods, rolling, scale, service, statefulset, status};

/// Reconciles one cluster. Errors are published as Warning events and retried by
/// [`error_policy`].
pub async fn reconcile(vc: Arc<ValkeyCluster>, ctx: Arc<Context>) -> Result<Action> {
    let _measure = ctx.metrics.measure();
    match apply(&vc, &ctx).await {
        Ok(action) => {
            ctx.backoff.count(&vc, false);
            ctx.forget_gone();
            Ok(action)
        }
        Err(e) => {
            publish(
                &ctx,
                &vc,
                EventType::Warning,
                "ReconcileFailed",
                &e.to_string(),
            )
            .await;
            // A spec that cannot be acted on, or a TLS Secret that cannot be read, reads so
            // in status, not as the last state seen.
            let written = match &e {
                Error::Invalid(why) => Some(status::invalid(&vc, &ctx, why).await),
                Error::TlsSecret { .. } => {
                    Some(status::tls_secret_unavailable(&vc, &ctx, &e.to_string()).await)
                }
                _ => None,
            };
            if let Some(Err(write)) = written {
                warn!(cluster = %vc.name_any(), "cannot write the status of {e}: {write}");
            }
            Err(e)
        }
    }
}

async fn apply(vc: &ValkeyCluster, ctx: &Context) -> Result<Action> {
    let name = vc.name_any();
    // Being deleted: the garbage collector takes the children (owner references).
    if vc.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    if name.len() > MAX_CLUSTER_NAME {
        return Err(Error::Invalid(format!(
            "metadata.name: {name:?} is longer than {MAX_CLUSTER_NAME} characters (pod labels \
             would pass Kubernetes' 63)"
        )));
    }
    // A cluster made by an operator version that did not act on spec.tls runs plain RESP,
    // and TLS cannot be turned on in place: it stays plain, and is told so once.
    let on_plain;
    let vc = if vc.spec.tls.is_some() && crate::tls::nodes_on_plain(vc, ctx).await? {
        if ctx.warned.first(vc, "TLSNotApplied") {
            let note = "spec.tls was set before this operator version acted on it: the nodes \
                        run plain RESP and stay on it (a node on TLS and one on plain RESP \
                        cannot talk on the cluster bus, so TLS cannot be turned on one pod at \
                        a time), and externalAccess.proxy.clientSecretName is not used; for \
                        TLS, make a new cluster";
            publish(ctx, vc, EventType::Warning, "TLSNotApplied", note).await;
        }
        on_plain = crate::tls::as_plain(vc);
        &on_plain
    } else {
        ctx.warned.cleared(vc, "TLSNotApplied");
        vc
    };
    vc.spec
        .validate()
        .map_err(|e| Error::Invalid(e.to_string()))?;

    // How the operator dials the nodes: over TLS with spec.tls's Secret, which must exist.
    let dial = crate::tls::dial(vc, ctx).await?;
    let enabled = vc.spec.external_access.as_ref().filter(|ea| ea.enabled);
    match enabled.map(|ea| (ea, ea.ignored_fields())) {
        Some((ea, ignored)) if !ignored.is_empty() => {
            if ctx.warned.first(vc, "FieldsIgnored") {
                let note = format!(
                    "{} set but not used in {} mode; they are ignored",
                    ignored.join(", "),
                    ea.mode
                );
                publish(ctx, vc, EventType::Warning, "FieldsIgnored", &note).await;
            }
        }
        _ => ctx.warned.cleared(vc, "FieldsIgnored"),
    }
    let hash = configmap::apply_config(vc, ctx).await?;
    service::apply_headless(vc, ctx).await?;
    // External Services before the StatefulSets: the nodes announce what the API server
    // allocated to them (NodePorts).
    let ea = external::announce_mode(vc);
    let (exposures, removed) = external::services::apply_services(vc, ctx, ea).await?;
    // One event per reconcile: the recorder folds events of one reason into a series that
    // keeps only the first note.
    if !removed.is_empty() {
        let note = format!(
            "deleted external Services {}: no node of the spec uses them",
            removed.join(", ")
        );
        publish(ctx, vc, EventType::Normal, "ExternalServiceRemoved", &note).await;
    }
    // Gateway mode: a TCPRoute per node to those Services (routes no longer needed go).
    let (routing, removed) = external::gateway::apply_routes(vc, ctx, ea, &exposures).await?;
    if !removed.is_empty() {
        let note = format!(
            "deleted TCPRoutes {}: no node of the spec uses them",
            removed.join(", ")
        );
        publish(ctx, vc, EventType::Normal, "TCPRouteRemoved", &note).await;
    }
    match routing
        .as_ref()
        .filter(|r| r.reason == "GatewayAPIUnavailable")
    {
        None => ctx.warned.cleared(vc, "GatewayAPIUnavailable"),
        Some(r) if ctx.warned.first(vc, "GatewayAPIUnavailable") => {
            let note = format!(
                "externalAccess.gateway is set but {}; no TCPRoute is made (install the Gateway \
                 API experimental-channel CRDs and restart the operator)",
                r.problems.join("; ")
            );
            publish(ctx, vc, EventType::Warning, "GatewayAPIUnavailable", &note).await;
        }
        Some(_) => {}
    }
    let nodes: Vec<_> = vc.spec.node_refs().collect();
    // Each node's pods carry the hash of what they run with: config, announce flags, image
    // and resources (a change of any rolls them).
    let mut hashes = BTreeMap::new();
    let mut parts = BTreeMap::new();
    for &node in &nodes {
        let args = external::announce::args(vc, ea, node, exposures.get(&node));
        let node_hash = statefulset::pod_hash(vc, &hash, &args)?;
        let node_parts = statefulset::pod_parts(vc, &hash, &args)?;
        statefulset::apply_node(vc, ctx, node, &node_hash, &node_parts, &args).await?;
        hashes.insert(node, node_hash);
        parts.insert(node, node_parts);
    }
    pdb::apply_budget(vc, ctx).await?;
    // Proxy mode: the proxy in front (removed again when the mode or the block goes).
    let proxied = external::proxy::apply_proxy(vc, ctx).await?;

    let mut pods = pods::observe(vc, ctx).await?;
    for pod in &pods.unlabelled {
        let note = format!(
            "pod {pod} has the cluster's labels but not both {} and {}; it is left out",
            labels::SHARD_INDEX,
            labels::NODE_INDEX
        );
        publish(ctx, vc, EventType::Warning, "MissingIndexLabel", &note).await;
    }
    // Nodes the spec no longer has leave first, one at a time. Rolling waits for them, and
    // so does formation, but for healing the nodes that stay while slots move (below).
    let scaled_in = match scale::remove_extra_nodes(vc, ctx, &dial, &pods).await? {
        scale::ScaleIn::Done => None,
        scale::ScaleIn::Acted(what) => {
            announce(ctx, vc, "scale_in", EventType::Normal, "ScaleIn", &what).await;
            Some(Progress::Acted(what))
        }
        scale::ScaleIn::Retried(what) => {
            let reason = "SlotMigrationRetried";
            announce(ctx, vc, "scale_in", EventType::Warning, reason, &what).await;
            Some(Progress::Retried(what))
        }
        // Slots on their way to the shards that stay: no event per look.
        scale::ScaleIn::Waiting(what) => {
            info!(cluster = %name, "{what}");
            Some(Progress::Waiting(what))
        }
    };
    // While a shard's slots move away, its nodes are members still: healing the others
    // must not forget them.
    let leaving: Vec<SocketAddr> = match &scaled_in {
        Some(Progress::Waiting(_)) => pods
            .nodes
            .iter()
            .filter(|(n, _)| !nodes.contains(n))
            .filter_map(|(_, p)| p.addr)
            .collect(),
        _ => Vec::new(),
    };
    // From here on, only the nodes the spec has.
    pods.nodes.retain(|n, _| nodes.contains(n));
    // Client IPs known only now that the pods run (their Kubernetes nodes' addresses).
    let node_hosts = match ea {
        Some(ea) => {
            let gateway_address = routing.as_ref().and_then(|r| r.status.address.as_deref());
            external::endpoints::node_hosts(ctx, ea, &exposures, &pods, gateway_address).await?
        }
        None => BTreeMap::new(),
    };
    // Only nodes that announce: without announce mode their pods have no announce flags
    // (a change of mode rolls them), and nothing was set at run time to keep or clear.
    if ea.is_some() {
        for what in external::announce::set_runtime_ips(&pods, &node_hosts, &dial).await {
            info!(cluster = %name, "{what}");
            publish(ctx, vc, EventType::Normal, "AnnounceAddress", &what).await;
        }
    }
    let plan = Plan {
        shards: vc.spec.shards as u32,
        replicas: vc.spec.replicas as u32,
        nodes: nodes
            .iter()
            .map(|n| {
                let addr = pods
                    .nodes
                    .get(n)
                    .filter(|p| p.ready && !p.deleting)
                    .and_then(|p| p.addr);
                (*n, addr)
            })
            .collect(),
        // Where the others see each node: what its running pod announces.
        announced: pods
            .nodes
            .iter()
            .map(|(n, p)| {
                let mut a = p.announced;
                if let Some(ip) = node_hosts.get(n).and_then(|h| h.parse().ok()) {
                    a.ip = Some(ip);
                }
                (*n, a)
            })
            .collect(),
        leaving,
        lost_are_gone: scaled_in.is_none(),
        dial: dial.clone(),
    };
    let scaling_in = scaled_in.is_some();
    let mut progress = match scaled_in {
        // Slots moving take a while: the staying nodes are healed meanwhile (a wiped pod
        // met and attached again, say), which may be what the move waits for.
        Some(Progress::Waiting(why)) => match formation::step(&plan).await {
            Ok(healed @ (Progress::Acted(_) | Progress::Retried(_))) => {
                formation_events(ctx, vc, &healed).await;
                healed
            }
            Ok(_) => Progress::Waiting(why),
            // Healing that failed this time does not fail the scale-in's pass (and its
            // status): the next look tries again.
            Err(e) => {
                warn!(cluster = %name, "healing while slots move: {e}");
                Progress::Waiting(why)
            }
        },
        Some(progress) => progress,
        None => {
            let progress = formation::step(&plan).await?;
            formation_events(ctx, vc, &progress).await;
            progress
        }
    };
    // Before a rolling step takes its place: formation found the cluster whole.
    let formed_now = matches!(progress, Progress::Formed(_));
    let stale: Vec<_> = nodes
        .iter()
        .filter(|n| {
            pods.nodes
                .get(n)
                .is_none_or(|p| p.config_hash.as_ref() != hashes.get(*n))
        })
        .copied()
        .collect();
    // What pods are to restart for, in words, for status and events.
    let changes_of = |nodes: &[shardgate_crds::NodeRef]| {
        statefulset::changed(nodes.iter().filter_map(|n| {
            let pod = pods.nodes.get(n)?;
            Some((pod.config_parts.as_deref(), parts.get(n)?.as_str()))
        }))
    };
    let changes = changes_of(&stale);
    // A Secret renewed in place: the nodes read their files again (no restart).
    if let Some(tls) = &vc.spec.tls {
        let current = |n: shardgate_crds::NodeRef| match &progress {
            Progress::Formed(f) => f.nodes.get(&n).is_some_and(|s| s.current_certificate),
            _ => false,
        };
        let reload = crate::tls::reload(&pods, &stale, current, &dial, &tls.secret_name).await;
        for what in &reload.changed {
            info!(cluster = %name, "{what}");
            publish(ctx, vc, EventType::Normal, "CertificateReloaded", what).await;
        }
        let looks = match (reload.behind.is_empty(), reload.unchecked.is_empty()) {
            (false, _) => ctx.reload_behind.count(vc, true),
            (true, true) => ctx.reload_behind.count(vc, false),
            // Nodes not reached this look may still be behind: the count stands.
            (true, false) => ctx.reload_behind.get(vc),
        };
        if looks == 0 {
            ctx.warned.cleared(vc, "CertificateNotReloaded");
        } else if looks >= crate::tls::BEHIND_LOOKS
            && ctx.warned.first(vc, "CertificateNotReloaded")
        {
            let nodes: Vec<String> = reload.behind.iter().map(|n| n.to_string()).collect();
            let note = format!(
                "node(s) {} still present another certificate than Secret {}'s after {looks} \
                 looks: their files are not the Secret's (the kubelet writes a changed Secret \
                 within a minute or two), or Valkey refused them (its log says why)",
                nodes.join(", "),
                tls.secret_name
            );
            publish(ctx, vc, EventType::Warning, "CertificateNotReloaded", &note).await;
        }
    }
    let mut rolled = false;
    if let Progress::Formed(formed) = &progress {
        let step = rolling::step(vc, ctx, &dial, &pods, formed, &stale, changes_of).await?;
        rolled = step.is_some();
        if !matches!(step, Some(rolling::Step::Blocked(_))) {
            ctx.warned.cleared(vc, "RollingBlocked");
        }
        match step {
            Some(rolling::Step::Acted(what)) => {
                let (kind, reason) = (EventType::Normal, "RollingConfig");
                announce(ctx, vc, "rolling", kind, reason, &what).await;
                progress = Progress::Acted(what);
            }
            Some(rolling::Step::Blocked(why)) => {
                if ctx.warned.first(vc, "RollingBlocked") {
                    publish(ctx, vc, EventType::Warning, "RollingBlocked", &why).await;
                }
                progress = Progress::Waiting(why);
            }
            None => {}
        }
    }

    let external = match (ea, &proxied, external::proxy::proxy_mode(vc)) {
        (_, Some(exposed), Some((pea, proxy))) => Some(external::proxy::observe(
            vc, pea, proxy, exposed, &progress,
        )?),
        (Some(ea), _, _) => {
            let mut ext = external::endpoints::observe(vc, ea, &exposures, &node_hosts, &progress)?;
            // Nodes are not reachable through a Gateway that lacks their listeners.
            if let Some(r) = &routing {
                ext.missing.extend(r.problems.iter().cloned());
            }
            Some(ext)
        }
        _ => None,
    };

    let was_ready = status::condition(vc, "Ready").is_some_and(|c| c.status == "True");
    let was_external = status::condition(vc, "ExternalAccessReady").map(|c| c.status == "True");
    let conditions = status::patch(
        vc,
        ctx,
        &Observed {
            progress: &progress,
            pods: &pods,
            desired_nodes: nodes.len(),
            shards: vc.spec.shards as u32,
            stale: &stale,
            changes: &changes,
            external: external.as_ref(),
            gateway: routing.as_ref(),
            scaling_in,
            formed_now,
            rolled,
        },
    )
    .await?;
    if let Some(ready) = conditions.iter().find(|c| c.type_ == "Ready") {
        // Not ready while scaling or rolling a config is what the user asked for: the
        // ScaleIn, Formation and RollingConfig events tell it, not a warning.
        let asked = ["Scaling", "RollingConfig"].contains(&ready.reason);
        if ready.status != was_ready && !asked {
            let (kind, reason) = if ready.status {
                (EventType::Normal, "Ready")
            } else {
                (EventType::Warning, "NotReady")
            };
            publish(ctx, vc, kind, reason, &ready.message).await;
        }
    }
    // What to connect to, once every node has an endpoint; what is missing, when one loses it.
    if let Some(ext) = conditions.iter().find(|c| c.type_ == "ExternalAccessReady") {
        let event = match (was_external, ext.status) {
            (Some(false) | None, true) => Some((EventType::Normal, "ExternalAccessReady")),
            (Some(true), false) => Some((EventType::Warning, "ExternalAccessNotReady")),
            _ => None,
        };
        if let Some((kind, reason)) = event {
            publish(ctx, vc, kind, reason, &ext.message).await;
        }
    }
    Ok(Action::requeue(formation::next_look(&progress)))
}

/// Logs and counts a failed reconcile, and retries it with exponential backoff (1 s, 2 s,
/// ... up to 5 minutes) per cluster.
pub fn error_policy(vc: Arc<ValkeyCluster>, error: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics
        .failures
        .get_or_create(&ErrorLabels {
            error: error.label(),
        })
        .inc();
    let n = ctx.backoff.count(&vc, true);
    ctx.forget_gone();
    let delay = Duration::from_secs(1u64 << n.min(8)).min(Duration::from_secs(300));
    warn!(cluster = %vc.name_any(), retry_in = ?delay, "reconcile failed: {error}");
    Action::requeue(delay)
}

/// Something the operator did to `vc`: counted by `action`, logged (a Warning as a
/// warning), and published as an event.
async fn announce(
    ctx: &Context,
    vc: &ValkeyCluster,
    action: &'static str,
    kind: EventType,
    reason: &str,
    what: &str,
) {
    ctx.metrics
        .actions
        .get_or_create(&ActionLabels { action })
        .inc();
    if kind == EventType::Warning {
        warn!(cluster = %vc.name_any(), "{what}");
    } else {
        info!(cluster = %vc.name_any(), "{what}");
    }
    publish(ctx, vc, kind, reason, what).await;
}

/// What a formation step did, as an event (a retried migration as a warning).
async fn formation_events(ctx: &Context, vc: &ValkeyCluster, progress: &Progress) {
    match progress {
        Progress::Acted(what) => {
            announce(ctx, vc, "formation", EventType::Normal, "Formation", what).await;
        }
        Progress::Retried(what) => {
            let reason = "SlotMigrationRetried";
            announce(ctx, vc, "formation", EventType::Warning, reason, what).await;
        }
        Progress::Waiting(_) | Progress::Formed(_) => {}
    }
}

/// Publishes an event about `vc`; a failure to publish is logged, not fatal.
async fn publish(ctx: &Context, vc: &ValkeyCluster, type_: EventType, reason: &str, note: &str) {
    let event = Event {
        type_,
        reason: reason.into(),
        // Events hold at most 1 kB of note.
        note: Some(note.chars().take(1000).collect()),
        action: reason.into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &vc.object_ref(&())).await {
        warn!(cluster = %vc.name_any(), "cannot publish event {reason}: {e}");
    }
}

/// Which clusters the operator watches.
#[derive(Debug, Clone, Default)]
pub struct Scope {
    /// One namespace, or every namespace.
    pub namespace: Option<String>,
}

impl Scope {
    fn api<K>(&self, client: &Client) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as Resource>::DynamicType: Default,
    {
        match &self.namespace {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        }
    }
}

/// Runs the controller until `shutdown` resolves. Gateway API is looked for first, once: a
/// failure to ask is an error (the operator restarts), its absence is not.
pub async fn run(
    ctx: Arc<Context>,
    scope: Scope,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) -> Result<()> {
    let client = ctx.client.clone();
    let gateway_api = external::gateway::discover(&client).await?;
    match &gateway_api {
        GatewayApi::Served => info!("Gateway API TCPRoute served: gateway mode available"),
        GatewayApi::Missing(why) => warn!("gateway mode unavailable: {why}"),
    }
    let mut ctx = Context {
        gateway_api: gateway_api.clone(),
        ..(*ctx).clone()
    };
    // Renewed often enough that one fallen silent is found (crate::client).
    let watch_config = watcher::Config::default().timeout(ctx.api_timeouts.watch_secs());
    let managed = watch_config.clone().labels(&format!(
        "{}={}",
        labels::MANAGED_BY,
        labels::MANAGED_BY_VALUE
    ));
    let client = ctx.watch_client.clone();
    let mut controller = Controller::new(scope.api::<ValkeyCluster>(&client), watch_config.clone())
        .owns(scope.api::<StatefulSet>(&client), managed.clone())
        .owns(scope.api::<ConfigMap>(&client), managed.clone())
        .owns(scope.api::<Service>(&client), managed.clone())
        // Proxy mode: the proxy's ready pods are in status.
        .owns(scope.api::<Deployment>(&client), managed.clone())
        // Pods belong to the StatefulSets; their readiness and IPs matter to formation.
        .watches(scope.api::<Pod>(&client), managed.clone(), |pod: Pod| {
            let ns = pod.namespace()?;
            let cluster = pod.labels().get(labels::INSTANCE)?.clone();
            Some(ObjectRef::<ValkeyCluster>::new(&cluster).within(&ns))
        });
    if gateway_api.served() {
        // A route's acceptance, and a Gateway's listeners and address, are in status.
        let clusters = controller.store();
        controller = controller
            .owns(scope.api::<TcpRoute>(&client), managed)
            .watches(
                scope.api::<Gateway>(&client),
                watch_config,
                move |gw: Gateway| {
                    let ns = gw.namespace();
                    let name = gw.name_any();
                    clusters
                        .state()
                        .into_iter()
                        .filter(|vc| {
                            ResourceExt::namespace(vc.as_ref()) == ns
                                && vc
                                    .spec
                                    .external_access()
                                    .and_then(|ea| ea.gateway.as_ref())
                                    .is_some_and(|g| g.gateway_ref.name == name)
                        })
                        .map(|vc| ObjectRef::from_obj(&*vc))
                        .collect::<Vec<_>>()
                },
            );
    }
    ctx.clusters = Some(controller.store());
    controller
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, Arc::new(ctx))
        .for_each(|result| async move {
            match result {
                Ok((obj, _)) => tracing::debug!(cluster = %obj.name, "reconciled"),
                Err(e) => tracing::debug!("controller: {e}"),
            }
        })
        .await;
    Ok(())
}
