//! The operator end to end, on a real API server with real valkey-server pods (the
//! Kubernetes harness): what a user would check. Each test has its own namespace and its own
//! operator (in this process, watching that namespace).

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use redis::AsyncCommands;
use serde_json::json;
use shardgate_admin_client::{Client as Admin, Timeouts};
use shardgate_crds::names::{labels, objects};
use shardgate_crds::valkey_cluster::ValkeyCluster;
use shardgate_crds::NodeRef;
use shardgate_harness::clients::spread_keys;
use shardgate_kube_harness::{ApiRelay, Fault, TestEnv};
use shardgate_operator_e2e::external::{
    bootstrap_seeds, cluster, external_cluster, external_services, failovers_under_load,
    only_external_addresses, redis_cli_set_get, slot_addresses, views, wait_external_ready, writer,
    FORM,
};
use shardgate_operator_e2e::tls::{refuses_plain_and_anonymous, topology_over_tls, ClusterTls};
use shardgate_operator_e2e::{
    cluster_client, condition, create, eventually, pod_addrs, reconcile_again, wait_ready, Operator,
};

fn main() -> ExitCode {
    let Some(suite) = shardgate_operator_e2e::suite_with_crds() else {
        return ExitCode::FAILURE;
    };
    suite
        .timeout(Duration::from_secs(600))
        .test(
            "a_3x1_cluster_becomes_ready_serves_every_slot_and_idles_without_writes",
            ready_serves_and_idles,
        )
        .test(
            "a_killed_primary_is_healed_and_the_cluster_is_ready_again",
            killed_primary_heals,
        )
        .test(
            "deleting_the_cluster_collects_every_child",
            delete_collects_children,
        )
        .test(
            "a_pod_at_a_new_ip_and_a_wiped_primary_rejoin_without_help",
            new_ip_and_wiped_primary_rejoin,
        )
        .test(
            "a_config_change_and_a_new_image_roll_pods_one_at_a_time_losing_no_acknowledged_write",
            config_change_rolls,
        )
        .test(
            "only_the_leader_reconciles_and_a_standby_takes_over",
            leader_election,
        )
        .test(
            "a_leader_cut_off_from_the_api_server_steps_down_before_a_standby_takes_over",
            leader_cut_off,
        )
        .test(
            "silent_api_connections_stall_the_operator_for_seconds_not_minutes",
            silent_api_connections,
        )
        .test(
            "a_spec_the_operator_cannot_act_on_reads_failed_until_it_is_fixed",
            invalid_spec,
        )
        .test(
            "shards_3_to_4_and_back_and_replicas_up_and_down_under_writes_lose_nothing",
            scaling,
        )
        .test(
            "shards_4_to_3_with_a_leaving_node_down_goes_on_and_loses_no_key",
            scale_in_past_a_down_node,
        )
        .test(
            "an_idle_cluster_costs_few_reconciles_and_no_writes_over_a_minute",
            idle_minute,
        )
        .test(
            "announce_failover_under_load_and_a_killed_primary_lose_no_acknowledged_write",
            announce_failovers_under_load,
        )
        .test(
            "announce_nodeport_external_clients_know_only_the_bootstrap_addresses",
            announce_nodeport_serves_external_clients,
        )
        .test(
            "announce_services_merge_annotations_idle_change_type_and_go_when_disabled",
            announce_service_pitfalls,
        )
        .test(
            "announce_per_node_services_at_the_node_address_and_scale_in_removes_them",
            announce_per_node_services_at_the_node_address,
        )
        .test(
            "announce_load_balancer_services_announce_their_ingress",
            announce_load_balancer,
        )
        .test(
            "announce_tls_nodes_wait_for_their_secret_then_serve_only_tls_clients_outside",
            announce_tls,
        )
        .test(
            "tls_shards_2_to_3_and_back_move_slots_over_tls_and_lose_no_key",
            tls_scaling,
        )
        .test(
            "announce_hostname_endpoints_per_node_then_one_advertised_name_reach_a_client_that_resolves_them",
            announce_hostnames,
        )
        .run()
}

/// The resourceVersion of every child of `name`.
async fn child_versions(client: &Client, ns: &str, name: &str) -> Result<BTreeMap<String, String>> {
    let sel = ListParams::default().labels(&format!("{}={name}", labels::INSTANCE));
    let mut out = BTreeMap::new();
    versions::<StatefulSet>(client, ns, &sel, &mut out).await?;
    versions::<Service>(client, ns, &sel, &mut out).await?;
    versions::<ConfigMap>(client, ns, &sel, &mut out).await?;
    versions::<PodDisruptionBudget>(client, ns, &sel, &mut out).await?;
    Ok(out)
}

/// Adds `kind/name → resourceVersion` of the `K`s `sel` selects.
async fn versions<K>(
    client: &Client,
    ns: &str,
    sel: &ListParams,
    out: &mut BTreeMap<String, String>,
) -> Result<()>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    for o in Api::<K>::namespaced(client.clone(), ns).list(sel).await? {
        let key = format!("{}/{}", K::kind(&()), o.name_any());
        out.insert(key, o.resource_version().unwrap_or_default());
    }
    Ok(())
}

async fn ready_serves_and_idles(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = env;
    let operator = Operator::start(&client, &ns);
    let started = Instant::now();
    create(&client, &ns, &cluster("vc", 3, 1)?).await?;
    let vc = wait_ready(&client, &ns, "vc", FORM).await?;
    eprintln!("3x1 cluster Ready in {:?}", started.elapsed());
    let status = vc.status.clone().context("status")?;
    ensure!(status.ready_nodes == 6, "{status:?}");
    ensure!(
        status.phase.map(|p| p.to_string()).as_deref() == Some("Ready"),
        "{status:?}"
    );
    let formed = condition(&vc, "ClusterFormed");
    ensure!(
        formed.as_ref().is_some_and(|c| c.0 == "True"),
        "ClusterFormed: {formed:?}"
    );

    // What Valkey says: 16384 slots over 3 primaries, each replica on its shard's primary.
    let addrs = pod_addrs(&client, &ns, "vc").await?;
    ensure!(addrs.len() == 6, "{addrs:?}");
    let views = views(&addrs).await?;
    let mut slots = 0;
    for s in 0..3 {
        let shard: Vec<_> = views.iter().filter(|(n, _)| n.shard.0 == s).collect();
        let primaries: Vec<_> = shard.iter().filter(|(_, l)| l.is_primary()).collect();
        ensure!(primaries.len() == 1, "shard {s}: {shard:?}");
        let primary = &primaries[0].1;
        slots += primary.slot_count();
        for (_, l) in shard.iter().filter(|(_, l)| !l.is_primary()) {
            ensure!(
                l.primary_id.as_deref() == Some(primary.id.as_str()),
                "shard {s}: replica {} follows {:?}, not {}",
                l.id,
                l.primary_id,
                primary.id
            );
        }
    }
    ensure!(slots == 16384, "slots served: {slots}");
    // The human node names read as the resource does.
    for (node, addr) in &addrs {
        let mut c = Admin::connect(*addr, Timeouts::default()).await?;
        let reply = c
            .command(["CONFIG", "GET", "cluster-announce-human-nodename"])
            .await?;
        let text = format!("{reply:?}");
        ensure!(
            text.contains(&objects::node("vc", *node)),
            "node {node}: {text}"
        );
    }

    // A cluster client at the pod addresses: 10,000 SET/GET across every slot.
    let mut conn = cluster_client(addrs.values().copied()).await?;
    let keys = spread_keys(10_000, "op");
    for k in &keys {
        let _: () = conn.set(k, k).await?;
    }
    for k in &keys {
        let v: String = conn.get(k).await?;
        ensure!(&v == k, "{k} read back {v}");
    }

    // Nothing changed: another reconcile writes nothing.
    let before = child_versions(&client, &ns, "vc").await?;
    ensure!(before.len() == 6 + 3, "children: {before:?}");
    let vcs: Api<ValkeyCluster> = Api::namespaced(client.clone(), &ns);
    let status_before = vcs.get("vc").await?.resource_version();
    let runs = operator.finished_reconciles();
    // An annotation is a change the controller sees (a reconcile) that asks for nothing.
    vcs.patch(
        "vc",
        &PatchParams::default(),
        &Patch::Merge(json!({ "metadata": { "annotations": { "test/poke": "1" } } })),
    )
    .await?;
    eventually(
        "a reconcile after the poke",
        Duration::from_secs(60),
        || async {
            let done = operator.finished_reconciles();
            ensure!(done > runs, "finished reconciles {done}");
            Ok(())
        },
    )
    .await?;
    let after = child_versions(&client, &ns, "vc").await?;
    ensure!(
        before == after,
        "children rewritten:\nbefore {before:?}\nafter  {after:?}"
    );
    let vc_after = vcs.get("vc").await?;
    ensure!(
        vc_after.status == vc.status,
        "status rewritten ({status_before:?}):\n{:?}\n{:?}",
        vc.status,
        vc_after.status
    );
    operator.stop().await;
    Ok(())
}

async fn killed_primary_heals(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, cp } = env;
    let operator = Operator::start(&client, &ns);
    create(&client, &ns, &cluster("vc", 3, 1)?).await?;
    wait_ready(&client, &ns, "vc", FORM).await?;
    let addrs = pod_addrs(&client, &ns, "vc").await?;
    let before = views(&addrs).await?;
    let (&victim, line) = before
        .iter()
        .find(|(n, l)| n.shard.0 == 0 && l.is_primary())
        .context("shard 0's primary")?;
    let victim_id = line.id.clone();
    let pod = format!("{}-0", objects::node("vc", victim));
    let killed = Instant::now();
    cp.agent().fault(&ns, &pod, Fault::Stop).await?;

    // Valkey fails over to the replica.
    let replica = NodeRef::new(victim.shard.0, 1 - victim.node.0);
    let replica_addr = addrs[&replica];
    eventually(
        "the replica takes over",
        Duration::from_secs(60),
        || async {
            let mut c = Admin::connect(replica_addr, Timeouts::default()).await?;
            let me = c.cluster_nodes().await?.into_iter().find(|l| l.is_myself());
            ensure!(me.as_ref().is_some_and(|l| l.is_primary()), "{me:?}");
            Ok(())
        },
    )
    .await?;
    let failed_over = killed.elapsed();
    cp.agent().fault(&ns, &pod, Fault::Restart).await?;
    // The old primary is back as a replica of the new one, with its id. (Ready may still be
    // the status from before the kill, so the node's own view is what is waited for.)
    eventually("the old primary follows the new one", FORM, || async {
        let after = views(&pod_addrs(&client, &ns, "vc").await?).await?;
        let back = &after[&victim];
        ensure!(back.id == victim_id, "{back:?}");
        ensure!(
            back.primary_id.as_deref() == Some(after[&replica].id.as_str()),
            "{back:?}"
        );
        Ok(())
    })
    .await?;
    wait_ready(&client, &ns, "vc", FORM).await?;
    let healed = killed.elapsed();
    eprintln!("killed primary: failover after {failed_over:?}, Ready again after {healed:?}");
    operator.stop().await;
    Ok(())
}

async fn delete_collects_children(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = env;
    let operator = Operator::start(&client, &ns);
    create(&client, &ns, &cluster("small", 1, 0)?).await?;
    wait_ready(&client, &ns, "small", FORM).await?;
    ensure!(!child_versions(&client, &ns, "small").await?.is_empty());
    Api::<ValkeyCluster>::namespaced(client.clone(), &ns)
        .delete("small", &DeleteParams::foreground())
        .await?;
    eventually(
        "every child collected",
        Duration::from_secs(120),
        || async {
            let left = child_versions(&client, &ns, "small").await?;
            let pods = Api::<Pod>::namespaced(client.clone(), &ns)
                .list(&ListParams::default().labels(&format!("{}=small", labels::INSTANCE)))
                .await?;
            if !left.is_empty() || !pods.items.is_empty() {
                bail!("left: {left:?}, {} pods", pods.items.len());
            }
            Ok(())
        },
    )
    .await?;
    operator.stop().await;
    Ok(())
}

/// Which node the pod `name` (a StatefulSet's pod `<cluster>-<s>-<n>-0`) is, and its id now.
async fn id_of(addr: std::net::SocketAddr) -> Result<String> {
    let mut c = Admin::connect(addr, Timeouts::default()).await?;
    Ok(c.cluster_myid().await?)
}

async fn new_ip_and_wiped_primary_rejoin(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, cp } = env;
    let operator = Operator::start(&client, &ns);
    create(&client, &ns, &cluster("vc", 3, 1)?).await?;
    wait_ready(&client, &ns, "vc", FORM).await?;
    let addrs = pod_addrs(&client, &ns, "vc").await?;
    let before = views(&addrs).await?;

    // A replica comes back at a new IP, with its data: same id, announced at the new address.
    let (&moved, moved_line) = before
        .iter()
        .find(|(n, l)| n.shard.0 == 1 && !l.is_primary())
        .context("a replica of shard 1")?;
    let moved_pod = format!("{}-0", objects::node("vc", moved));
    cp.agent()
        .fault(&ns, &moved_pod, Fault::RestartWithNewIp)
        .await?;
    let new_addr = eventually("a new pod IP", Duration::from_secs(60), || async {
        let a = pod_addrs(&client, &ns, "vc").await?;
        ensure!(a[&moved] != addrs[&moved], "still {}", a[&moved]);
        Ok(a[&moved])
    })
    .await?;
    // Ready may still be the status from before the restart: wait for the node itself.
    let id = eventually("the moved node answers", FORM, || id_of(new_addr)).await?;
    ensure!(id == moved_line.id, "the moved node changed its id");
    let seen_by_others = eventually("every node sees the new address", FORM, || async {
        for (n, a) in pod_addrs(&client, &ns, "vc").await? {
            let mut c = Admin::connect(a, Timeouts::default()).await?;
            let lines = c.cluster_nodes().await?;
            let l = lines
                .iter()
                .find(|l| l.id == moved_line.id)
                .context("moved node unknown")?;
            ensure!(
                l.ip == new_addr.ip().to_string() && l.connected,
                "node {n} sees it at {} ({:?})",
                l.ip,
                l.flags
            );
        }
        Ok(())
    })
    .await;
    seen_by_others?;
    wait_ready(&client, &ns, "vc", FORM).await?;

    // A primary loses its data: its replica takes over, and the empty node comes back with
    // a new id as the new primary's replica; its old id is forgotten everywhere.
    let (&wiped, wiped_line) = before
        .iter()
        .find(|(n, l)| n.shard.0 == 2 && l.is_primary())
        .context("shard 2's primary")?;
    let wiped_pod = format!("{}-0", objects::node("vc", wiped));
    cp.agent().fault(&ns, &wiped_pod, Fault::WipeData).await?;
    let started = Instant::now();
    eventually(
        "a new id on the wiped node",
        Duration::from_secs(60),
        || async {
            let a = pod_addrs(&client, &ns, "vc").await?;
            ensure!(id_of(a[&wiped]).await? != wiped_line.id);
            Ok(())
        },
    )
    .await?;
    // Ready may still be the status from before the wipe (no reconcile has seen it yet), so
    // wait for the state itself: the partner leads, the wiped node follows it, and every
    // node has forgotten the old id.
    let partner = NodeRef::new(wiped.shard.0, 1 - wiped.node.0);
    eventually(
        "the wiped node rejoins as its partner's replica",
        FORM,
        || async {
            let addrs = pod_addrs(&client, &ns, "vc").await?;
            let after = views(&addrs).await?;
            ensure!(after[&partner].is_primary(), "{:?}", after[&partner]);
            ensure!(
                after[&wiped].primary_id.as_deref() == Some(after[&partner].id.as_str()),
                "{:?}",
                after[&wiped]
            );
            for (n, a) in &addrs {
                let mut c = Admin::connect(*a, Timeouts::default()).await?;
                let lines = c.cluster_nodes().await?;
                ensure!(
                    lines.iter().all(|l| l.id != wiped_line.id),
                    "node {n} still knows the wiped node's old id"
                );
                ensure!(lines.len() == 6, "node {n} knows {} nodes", lines.len());
            }
            Ok(())
        },
    )
    .await?;
    eprintln!(
        "wiped primary back as a replica after {:?}",
        started.elapsed()
    );
    wait_ready(&client, &ns, "vc", FORM).await?;
    operator.stop().await;
    Ok(())
}

/// Waits until `done` holds for the pods of "vc" (4 of them), one pod at a time: returns
/// the most pods seen down (not ready, or going) at once.
async fn rolled(
    pod_api: &Api<Pod>,
    what: &str,
    done: impl Fn(&[Pod]) -> Result<()>,
) -> Result<usize> {
    let sel = ListParams::default().labels(&format!("{}=vc", labels::INSTANCE));
    let most_down = std::sync::atomic::AtomicUsize::new(0);
    eventually(what, Duration::from_secs(400), || async {
        let pods = pod_api.list(&sel).await?.items;
        let down = pods
            .iter()
            .filter(|p| {
                let ready = p
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
                !ready || p.metadata.deletion_timestamp.is_some()
            })
            .count()
            + 4usize.saturating_sub(pods.len());
        most_down.fetch_max(down, std::sync::atomic::Ordering::Relaxed);
        ensure!(pods.len() == 4, "{} pods", pods.len());
        done(&pods)
    })
    .await?;
    Ok(most_down.into_inner())
}

async fn config_change_rolls(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = env;
    let operator = Operator::start(&client, &ns);
    create(&client, &ns, &cluster("vc", 2, 1)?).await?;
    wait_ready(&client, &ns, "vc", FORM).await?;
    let addrs = pod_addrs(&client, &ns, "vc").await?;
    let hashes = |pods: &[Pod]| -> BTreeMap<String, String> {
        pods.iter()
            .map(|p| {
                let h = p.annotations().get("shardgate.io/config-hash").cloned();
                (p.name_any(), h.unwrap_or_default())
            })
            .collect()
    };
    let pod_api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let sel = ListParams::default().labels(&format!("{}=vc", labels::INSTANCE));
    let old = hashes(&pod_api.list(&sel).await?.items);
    let (statuses, recorder) = record_statuses(&client, &ns);
    let mark = statuses.lock().unwrap_or_else(|p| p.into_inner()).len();

    // A writer that keeps every acknowledged key and counts its errors.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = writer(
        cluster_client(addrs.values().copied()).await?,
        "roll",
        stop.clone(),
    );

    let vcs = Api::<ValkeyCluster>::namespaced(client.clone(), &ns);
    let patch = |spec: serde_json::Value| {
        let vcs = vcs.clone();
        async move {
            vcs.patch(
                "vc",
                &PatchParams::default(),
                &Patch::Merge(json!({ "spec": spec })),
            )
            .await
        }
    };
    patch(json!({ "config": { "maxmemory-policy": "allkeys-lru" } })).await?;
    // One pod at a time: never two of the cluster's pods down together.
    let most_down = rolled(&pod_api, "every pod on the new config", |pods| {
        let now = hashes(pods);
        ensure!(
            now.values().all(|h| !old.values().any(|o| o == h)),
            "hashes {now:?}"
        );
        Ok(())
    })
    .await?;
    ensure!(most_down <= 1, "{most_down} pods were down at once");
    wait_ready(&client, &ns, "vc", FORM).await?;
    // What the user reads meanwhile: the roll, pod by pod, not a fault.
    let says = [
        "pods to restart with the new config",
        "restarted pod",
        "for the new config",
    ];
    let mark = changed_visibly(&statuses, mark, "Upgrading", "RollingConfig", &says)?;

    // A new Valkey image rolls the pods the same way (the StatefulSets use OnDelete: only
    // the operator replaces pods).
    let image = "valkey/valkey:9.0-rolled";
    patch(json!({ "image": image })).await?;
    let most_down = rolled(&pod_api, "every pod on the new image", |pods| {
        let images: Vec<_> = pods
            .iter()
            .filter_map(|p| p.spec.as_ref()?.containers.first()?.image.clone())
            .collect();
        ensure!(
            images.len() == 4 && images.iter().all(|i| i == image),
            "images {images:?}"
        );
        Ok(())
    })
    .await?;
    ensure!(most_down <= 1, "{most_down} pods were down at once");
    let vc = wait_ready(&client, &ns, "vc", FORM).await?;
    // Said as what it is: the image, not the config.
    let says = [
        "pods to restart with the new image",
        "restarted pod",
        "for the new image",
    ];
    changed_visibly(&statuses, mark, "Upgrading", "RollingConfig", &says)?;
    recorder.abort();

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (acked, errors) = writer.await?;
    ensure!(
        acked.len() > 100,
        "only {} writes acknowledged",
        acked.len()
    );
    // Failovers are graceful: a client may see a few errors while a slot moves, not many.
    ensure!(
        errors <= acked.len() as u32 / 10 + 20,
        "{errors} failed writes for {} acknowledged",
        acked.len()
    );
    let mut conn = cluster_client(pod_addrs(&client, &ns, "vc").await?.values().copied()).await?;
    for key in &acked {
        let v: Option<String> = conn.get(key).await?;
        ensure!(v.is_some(), "acknowledged {key} lost in the rolls");
    }
    eprintln!(
        "rolled 4 pods twice: {} writes acknowledged, {errors} failed, none lost",
        acked.len()
    );
    ensure!(condition(&vc, "Ready").is_some_and(|c| c.0 == "True"));
    operator.stop().await;
    Ok(())
}

/// Metrics, for a new operator's context.
fn operator_metrics() -> std::sync::Arc<shardgate_controller::metrics::Metrics> {
    std::sync::Arc::new(
        shardgate_controller::metrics::Metrics::default()
            .register(&mut prometheus_client::registry::Registry::default()),
    )
}

/// An operator replica `id` contending for the Lease of `ns` (as the binary runs with
/// --leader-election) with `client`: its metrics, and its run, which tells how it ended
/// and when.
fn contender(
    client: &Client,
    ns: &str,
    id: &str,
    lease: Duration,
) -> (
    std::sync::Arc<shardgate_controller::metrics::Metrics>,
    tokio::task::JoinHandle<(shardgate_controller::leader::Ended, std::time::SystemTime)>,
) {
    use shardgate_controller::leader::{run_as_leader, LeaderElection};
    let metrics = operator_metrics();
    let ctx = std::sync::Arc::new(shardgate_controller::Context::new(
        client.clone(),
        metrics.clone(),
        Some(id.into()),
    ));
    let election = std::sync::Arc::new(LeaderElection::new(
        client.clone(),
        ns,
        "shardgate-operator",
        id,
        lease,
    ));
    let scope = shardgate_controller::Scope {
        namespace: Some(ns.into()),
    };
    let task = tokio::spawn(async move {
        let ended = run_as_leader(election, ctx, scope, std::future::pending()).await;
        (ended, std::time::SystemTime::now())
    });
    (metrics, task)
}

/// Waits until the replica with `metrics` leads.
async fn leads(
    metrics: &shardgate_controller::metrics::Metrics,
    who: &str,
    within: Duration,
) -> Result<()> {
    eventually(&format!("{who} leads"), within, || async {
        ensure!(metrics.leader.get() == 1);
        Ok(())
    })
    .await
}

async fn leader_election(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = env;
    let lease = Duration::from_secs(3);
    let start = |id: &str| contender(&client, &ns, id, lease);
    let (first, first_task) = start("first");
    leads(&first, "the first replica", Duration::from_secs(30)).await?;
    let (second, second_task) = start("second");
    create(&client, &ns, &cluster("vc", 1, 0)?).await?;
    wait_ready(&client, &ns, "vc", FORM).await?;
    ensure!(first.reconciles.get() > 0, "the leader did not reconcile");
    ensure!(
        second.reconciles.get() == 0 && second.leader.get() == 0,
        "the standby reconciled"
    );
    // The leader dies without giving the lease up; the standby takes over once it expires.
    first_task.abort();
    let killed = Instant::now();
    leads(&second, "the standby", Duration::from_secs(60)).await?;
    // It reconciles: a change is acted on. Here a config change of a cluster with no replica
    // and no persistence, which the roll must not restart (its only copy of the data lives
    // in the pod): status says so, and the pod stays.
    let pod_api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let uids = || async {
        let sel = ListParams::default().labels(&format!("{}=vc", labels::INSTANCE));
        let pods = pod_api.list(&sel).await?.items;
        Ok::<_, anyhow::Error>(pods.into_iter().map(|p| p.uid()).collect::<Vec<_>>())
    };
    let before = uids().await?;
    let vcs = Api::<ValkeyCluster>::namespaced(client.clone(), &ns);
    vcs.patch(
        "vc",
        &PatchParams::default(),
        &Patch::Merge(json!({ "spec": { "config": { "maxmemory-policy": "allkeys-lru" } } })),
    )
    .await?;
    let vc = eventually("the roll stopped before the only copy", FORM, || async {
        let vc = vcs.get("vc").await?;
        let progressing = condition(&vc, "Progressing");
        ensure!(
            vc.status.as_ref().and_then(|s| s.observed_generation) == vc.metadata.generation
                && progressing
                    .as_ref()
                    .is_some_and(|(s, reason, message)| s == "True"
                        && reason == "RollingConfig"
                        && message.contains("only copy")),
            "Progressing: {progressing:?}"
        );
        Ok(vc)
    })
    .await?;
    ensure!(
        second.reconciles.get() > 0,
        "the new leader did not reconcile"
    );
    let phase = vc
        .status
        .as_ref()
        .and_then(|s| s.phase)
        .map(|p| p.to_string());
    ensure!(phase.as_deref() == Some("Upgrading"), "phase {phase:?}");
    // A few more looks (one every 3 s while it waits), and still the same pod.
    let reconciles = second.reconciles.get();
    eventually("more reconciles", Duration::from_secs(60), || async {
        ensure!(second.reconciles.get() >= reconciles + 3);
        Ok(())
    })
    .await?;
    ensure!(uids().await? == before, "the only copy's pod was restarted");
    eprintln!(
        "standby took over {:?} after the leader died",
        killed.elapsed()
    );
    second_task.abort();
    Ok(())
}

/// The leader's connections to the API server fall silent, new ones too (its node cut off
/// without a reset). Its client is the binary's, whose calls time out after 30 s: the
/// leader steps down by its renew deadline all the same (a hung renewal does not hold it),
/// its reconcile stuck on a call dropped rather than waited for, and before the standby
/// takes the lease over, by the Lease's own acquireTime.
async fn leader_cut_off(env: TestEnv) -> Result<()> {
    use shardgate_controller::client::{for_calls, ApiTimeouts};
    use shardgate_controller::leader::Ended;
    let TestEnv { client, ns, cp } = env;
    let relay = ApiRelay::start(cp.api_addr()).await?;
    let cut_off = for_calls(relay.kube_config(&cp)?, ApiTimeouts::default())?;
    // Its deadline 8 s after a renewal, which comes every 4 s: at least 4 s after the cut.
    let lease = Duration::from_secs(12);
    let (first, first_task) = contender(&cut_off, &ns, "first", lease);
    leads(&first, "the first replica", Duration::from_secs(30)).await?;
    let (second, second_task) = contender(&client, &ns, "second", lease);
    // A cluster whose pod never starts, looked at every 3 s while it waits: at the step-down,
    // at least 4 s after the cut, a reconcile is stuck on a call (30 s), one that was going
    // at the cut or began since.
    let mut vc = cluster("vc", 1, 0)?;
    vc.spec.image = "registry.invalid/no-such-image:9.1".into();
    create(&client, &ns, &vc).await?;
    eventually(
        "the leader looks again",
        Duration::from_secs(30),
        || async {
            ensure!(first.reconciles.get() >= 2);
            Ok(())
        },
    )
    .await?;
    relay.go_silent();
    let cut = Instant::now();
    let (ended, stepped_down) = tokio::time::timeout(Duration::from_secs(20), first_task)
        .await
        .context("the leader cut off from the API server still leads after 20 s")??;
    ensure!(
        ended == Ended::LostLease,
        "the cut-off leader's run ended {ended:?}"
    );
    ensure!(
        first.leader.get() == 0,
        "the cut-off leader still says it leads"
    );
    // By the deadline (8 s after the last renewal, which came before the cut), not once
    // the stuck reconcile's call gives up.
    let took = cut.elapsed();
    eprintln!("the cut-off leader stepped down {took:?} after the cut");
    ensure!(
        took < Duration::from_secs(10),
        "the cut-off leader stepped down {took:?} after the cut, past its deadline"
    );
    leads(&second, "the standby", Duration::from_secs(60)).await?;
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), &ns);
    let spec = leases
        .get("shardgate-operator")
        .await?
        .spec
        .context("a Lease without spec")?;
    ensure!(
        spec.holder_identity.as_deref() == Some("second"),
        "held by {:?}",
        spec.holder_identity
    );
    let taken = spec.acquire_time.context("a Lease without acquireTime")?.0;
    let down = k8s_openapi::jiff::Timestamp::try_from(stepped_down)?;
    ensure!(
        down < taken,
        "the cut-off leader stepped down at {down}, after the standby took the lease at {taken}"
    );
    eprintln!("the standby took the lease {} after", taken - down);
    second_task.abort();
    Ok(())
}

/// The operator's connections to the API server fall silent (new ones get through): with
/// `--api-timeout 2s`, a cluster made after that is acted on within seconds, the silent
/// watch dropped and the silent calls given up, where kube's defaults would wait out a
/// watch for 295 s and a call for ever.
async fn silent_api_connections(env: TestEnv) -> Result<()> {
    use shardgate_controller::client::{for_calls, for_watches, ApiTimeouts};
    let TestEnv { client, ns, cp } = env;
    let relay = ApiRelay::start(cp.api_addr()).await?;
    let config = relay.kube_config(&cp)?;
    let timeouts = ApiTimeouts::from_call(Duration::from_secs(2));

    // Each of the operator's two clients, one connection each, then silent: a call gives up
    // after 2 s, a list on the watches' client 10 s past the 4 s a watch lasts.
    let clients = [
        ("calls", for_calls(config.clone(), timeouts)?, 2),
        ("watches", for_watches(config.clone(), timeouts)?, 14),
    ];
    // A client's read timeout runs on its connection from the connection's last read,
    // which is within these lists, not from the next call: the lower bound counts from here.
    let warm = Instant::now();
    for (_, client, _) in &clients {
        Api::<ConfigMap>::namespaced(client.clone(), &ns)
            .list(&ListParams::default())
            .await?;
    }
    relay.silence_open_connections();
    let (accepted, swallowed) = (relay.accepted(), relay.swallowed());
    let list = |(what, client, secs): &(&str, Client, u64)| {
        let (what, client, bound) = (what.to_string(), client.clone(), Duration::from_secs(*secs));
        let ns = ns.clone();
        async move {
            let at = Instant::now();
            let listed = tokio::time::timeout(
                bound + Duration::from_secs(10),
                Api::<ConfigMap>::namespaced(client, &ns).list(&ListParams::default()),
            )
            .await;
            let (took, since_warm) = (at.elapsed(), warm.elapsed());
            // The timer's millisecond may end a little early.
            ensure!(
                matches!(listed, Ok(Err(_))) && since_warm >= bound.mul_f64(0.95),
                "a list on the {what} client over a silent connection: {listed:?} after \
                 {took:?} ({since_warm:?} since the connection's last reads began), not an \
                 error after {bound:?}"
            );
            Ok(())
        }
    };
    let (calls, watches) = tokio::join!(list(&clients[0]), list(&clients[1]));
    calls?;
    watches?;
    ensure!(
        relay.accepted() == accepted && relay.swallowed() > swallowed,
        "the lists did not go out on the silent connections"
    );

    let mut ctx = shardgate_controller::Context::new(
        for_calls(config.clone(), timeouts)?,
        operator_metrics(),
        Some("relayed".into()),
    );
    ctx.watch_client = for_watches(config.clone(), timeouts)?;
    ctx.api_timeouts = timeouts;
    let scope = shardgate_controller::Scope {
        namespace: Some(ns.clone()),
    };
    let operator = tokio::spawn(shardgate_controller::run(
        std::sync::Arc::new(ctx),
        scope,
        std::future::pending(),
    ));
    let children = |name: &'static str| {
        let (client, ns) = (client.clone(), ns.clone());
        move || {
            let (client, ns) = (client.clone(), ns.clone());
            async move {
                let made = child_versions(&client, &ns, name).await?;
                ensure!(made.len() >= 3, "children of {name}: {made:?}");
                Ok(())
            }
        }
    };
    create(&client, &ns, &cluster("before", 1, 0)?).await?;
    eventually(
        "the operator makes a cluster's children through the relay",
        Duration::from_secs(60),
        children("before"),
    )
    .await?;
    relay.silence_open_connections();
    let swallowed = relay.swallowed();
    let at = Instant::now();
    create(&client, &ns, &cluster("after", 1, 0)?).await?;
    eventually(
        "the operator makes the children of a cluster made once its connections fell silent",
        Duration::from_secs(60),
        children("after"),
    )
    .await?;
    let took = at.elapsed();
    ensure!(
        relay.swallowed() > swallowed,
        "nothing met the silence: the operator's connections did not fall silent"
    );
    eprintln!("a cluster made after the connections fell silent was acted on in {took:?}");
    // The watch, renewed every 4 s, is dropped 5 s past that; calls give up after 2 s.
    ensure!(
        took < Duration::from_secs(30),
        "acted on only after {took:?}"
    );
    operator.abort();
    Ok(())
}

/// A `config` key the operator writes itself, in capitals: the API server's check (exact
/// names) lets it through, the operator cannot act on it. Status says so (phase Failed,
/// Ready false with reason InvalidSpec naming the key) rather than keep the last state;
/// once the key goes, the cluster forms.
async fn invalid_spec(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = env;
    let operator = Operator::start(&client, &ns);
    let mut vc = cluster("vc", 1, 0)?;
    vc.spec.config.insert("PORT".into(), "7000".into());
    create(&client, &ns, &vc).await?;
    let vcs = Api::<ValkeyCluster>::namespaced(client.clone(), &ns);
    eventually("status Failed: InvalidSpec", FORM, || async {
        let vc = vcs.get("vc").await?;
        let phase = vc
            .status
            .as_ref()
            .and_then(|s| s.phase)
            .map(|p| p.to_string());
        let ready = condition(&vc, "Ready");
        ensure!(
            phase.as_deref() == Some("Failed")
                && ready
                    .as_ref()
                    .is_some_and(|(s, reason, message)| s == "False"
                        && reason == "InvalidSpec"
                        && message.contains("spec.config.PORT")),
            "phase {phase:?}, Ready {ready:?}"
        );
        Ok(())
    })
    .await?;
    set_spec(&client, &ns, json!({ "config": { "PORT": null } })).await?;
    wait_ready(&client, &ns, "vc", FORM).await?;
    operator.stop().await;
    Ok(())
}

/// The slots each primary serves, by every node's own view, smallest first.
async fn slots_per_primary(addrs: &BTreeMap<NodeRef, std::net::SocketAddr>) -> Result<Vec<u32>> {
    let mut counts: Vec<u32> = views(addrs)
        .await?
        .values()
        .filter(|l| l.is_primary())
        .map(|l| l.slot_count())
        .collect();
    counts.sort();
    Ok(counts)
}

/// Every node knows exactly the nodes at `addrs`: none left over to forget.
async fn know_only_each_other(addrs: &BTreeMap<NodeRef, std::net::SocketAddr>) -> Result<()> {
    for a in addrs.values() {
        let mut c = Admin::connect(*a, Timeouts::default()).await?;
        let n = c.cluster_nodes().await?.len();
        ensure!(n == addrs.len(), "{a} knows {n} nodes, not {}", addrs.len());
    }
    Ok(())
}

/// "vc" is Ready with `n` ready nodes and `n` StatefulSets (none left behind).
async fn ready_with_statefulsets(client: &Client, ns: &str, n: usize) -> Result<()> {
    let vc = wait_ready(client, ns, "vc", FORM).await?;
    let sts = Api::<StatefulSet>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&format!("{}=vc", labels::INSTANCE)))
        .await?;
    ensure!(sts.items.len() == n, "{} StatefulSets", sts.items.len());
    ensure!(vc
        .status
        .as_ref()
        .is_some_and(|s| s.ready_nodes == n as i32));
    Ok(())
}

/// "vc" is down to 3 shards: the slots where a 3-shard cluster starts them, 6 nodes that
/// know only each other, Ready, and no StatefulSet left behind.
async fn back_to_three_shards(client: &Client, ns: &str) -> Result<()> {
    eventually(
        "3 shards of 5461, 5462 and 5461 slots, 6 nodes that know only each other",
        FORM,
        || async {
            let addrs = pod_addrs(client, ns, "vc").await?;
            ensure!(addrs.len() == 6, "{} pods", addrs.len());
            let counts = slots_per_primary(&addrs).await?;
            ensure!(counts == [5461, 5461, 5462], "slots per primary {counts:?}");
            know_only_each_other(&addrs).await
        },
    )
    .await?;
    ready_with_statefulsets(client, ns, 6).await
}

async fn set_spec(client: &Client, ns: &str, spec: serde_json::Value) -> Result<()> {
    Api::<ValkeyCluster>::namespaced(client.clone(), ns)
        .patch(
            "vc",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": spec })),
        )
        .await?;
    Ok(())
}

/// Every status "vc" is written with, from a watch: (phase, Ready, Progressing, Degraded),
/// each condition as `status/reason`, and Progressing's message.
type Statuses = std::sync::Arc<std::sync::Mutex<Vec<[String; 5]>>>;

fn record_statuses(client: &Client, ns: &str) -> (Statuses, tokio::task::JoinHandle<()>) {
    use futures_util::StreamExt;
    use kube::runtime::watcher::{self, watcher, Event};
    let seen = Statuses::default();
    let api: Api<ValkeyCluster> = Api::namespaced(client.clone(), ns);
    let config = watcher::Config::default().fields("metadata.name=vc");
    let log = seen.clone();
    let task = tokio::spawn(async move {
        let mut stream = std::pin::pin!(watcher(api, config));
        while let Some(event) = stream.next().await {
            let (Ok(Event::Apply(vc)) | Ok(Event::InitApply(vc))) = event else {
                continue;
            };
            let cond = |t| condition(&vc, t).map(|(s, r, _)| format!("{s}/{r}"));
            let phase = vc
                .status
                .as_ref()
                .and_then(|s| s.phase)
                .map(|p| p.to_string());
            let progressing = condition(&vc, "Progressing").map(|c| c.2);
            let row = [
                phase,
                cond("Ready"),
                cond("Progressing"),
                cond("Degraded"),
                progressing,
            ]
            .map(Option::unwrap_or_default);
            log.lock().unwrap_or_else(|p| p.into_inner()).push(row);
        }
    });
    (seen, task)
}

/// The statuses written since `from` (an index into the log) show a change the user asked
/// for: phase `phase` with Progressing true for `reason` and a message that has every one of
/// `says`, and never a fault (Degraded, healing, waiting, pods not ready): what a user
/// changing a healthy cluster should read. Returns the new end of the log.
fn changed_visibly(
    seen: &Statuses,
    from: usize,
    phase: &str,
    reason: &str,
    says: &[&str],
) -> Result<usize> {
    let log = seen.lock().unwrap_or_else(|p| p.into_inner());
    let rows = &log[from..];
    let progressing = format!("True/{reason}");
    ensure!(
        rows.iter()
            .any(|r| r[0] == phase && r[2] == progressing && says.iter().all(|w| r[4].contains(w))),
        "no status said {phase} with {says:?}: {rows:#?}"
    );
    for r in rows {
        ensure!(
            !r[3].starts_with("True")
                && !["False/Healing", "False/Waiting", "False/PodsNotReady"]
                    .contains(&r[1].as_str()),
            "a status during the change reads as a fault: {r:?}"
        );
    }
    Ok(log.len())
}

/// A scale, as [`changed_visibly`] reads it: phase Scaling, with the step `what`.
fn scaled_visibly(seen: &Statuses, from: usize, what: &str) -> Result<usize> {
    changed_visibly(seen, from, "Scaling", "Scaling", &[what, "scaling from"])
}

async fn scaling(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = env;
    let operator = Operator::start(&client, &ns);
    create(&client, &ns, &cluster("vc", 3, 1)?).await?;
    wait_ready(&client, &ns, "vc", FORM).await?;
    let (statuses, recorder) = record_statuses(&client, &ns);
    let mark = statuses.lock().unwrap_or_else(|p| p.into_inner()).len();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let conn = cluster_client(pod_addrs(&client, &ns, "vc").await?.values().copied()).await?;
    let writes = writer(conn, "scale", stop.clone());

    // Shards 3 -> 4: the slots are shared out again, 4096 each, as valkey-cli would.
    let started = Instant::now();
    set_spec(&client, &ns, json!({ "shards": 4 })).await?;
    eventually("4 shards of 4096 slots", FORM, || async {
        let addrs = pod_addrs(&client, &ns, "vc").await?;
        ensure!(addrs.len() == 8, "{} pods", addrs.len());
        let counts = slots_per_primary(&addrs).await?;
        ensure!(
            counts == [4096, 4096, 4096, 4096],
            "slots per primary {counts:?}"
        );
        Ok(())
    })
    .await?;
    wait_ready(&client, &ns, "vc", FORM).await?;
    eprintln!("shards 3 -> 4 rebalanced in {:?}", started.elapsed());
    let mark = scaled_visibly(&statuses, mark, "to 4 shards, 1 replica each")?;

    // Replicas 1 -> 2 -> 1.
    set_spec(&client, &ns, json!({ "replicas": 2 })).await?;
    eventually("12 nodes", FORM, || async {
        ensure!(pod_addrs(&client, &ns, "vc").await?.len() == 12);
        Ok(())
    })
    .await?;
    wait_ready(&client, &ns, "vc", FORM).await?;
    let mark = scaled_visibly(&statuses, mark, "to 4 shards, 2 replicas each")?;
    set_spec(&client, &ns, json!({ "replicas": 1 })).await?;
    eventually(
        "back to 8 nodes that know only each other",
        FORM,
        || async {
            let addrs = pod_addrs(&client, &ns, "vc").await?;
            ensure!(addrs.len() == 8, "{} pods", addrs.len());
            know_only_each_other(&addrs).await
        },
    )
    .await?;
    ready_with_statefulsets(&client, &ns, 8).await?;
    let mark = scaled_visibly(&statuses, mark, "replicas went down")?;

    // Shards 4 -> 3: shard 3's slots move to the shards that stay (keys with them), then
    // its nodes go, and the slots end where a 3-shard cluster starts them.
    let started = Instant::now();
    set_spec(&client, &ns, json!({ "shards": 3 })).await?;
    back_to_three_shards(&client, &ns).await?;
    eprintln!("shards 4 -> 3 in {:?}", started.elapsed());
    // Scaling in: the migration's own steps are in the status too, not only in events.
    scaled_visibly(&statuses, mark, "shard 3 goes")?;
    recorder.abort();

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (acked, errors) = writes.await?;
    ensure!(
        acked.len() > 100,
        "only {} writes acknowledged",
        acked.len()
    );
    ensure!(
        errors <= acked.len() as u32 / 10 + 20,
        "{errors} failed writes for {} acknowledged",
        acked.len()
    );
    let mut conn = cluster_client(pod_addrs(&client, &ns, "vc").await?.values().copied()).await?;
    for key in &acked {
        let v: Option<String> = conn.get(key).await?;
        ensure!(v.is_some(), "acknowledged {key} lost while scaling");
    }
    eprintln!(
        "scaling: {} writes acknowledged, {errors} failed, none lost",
        acked.len()
    );
    operator.stop().await;
    Ok(())
}

/// A node of the shard that goes is down (a replica whose process is gone) when the spec
/// asks for fewer shards: the slots move from its primary, and the shard goes all the same,
/// since every answering node's view has every slot served by a node that answers. Nothing
/// written before is lost.
async fn scale_in_past_a_down_node(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, cp } = env;
    let operator = Operator::start(&client, &ns);
    create(&client, &ns, &cluster("vc", 4, 1)?).await?;
    wait_ready(&client, &ns, "vc", FORM).await?;
    let addrs = pod_addrs(&client, &ns, "vc").await?;
    let mut conn = cluster_client(addrs.values().copied()).await?;
    let keys = spread_keys(2_000, "down");
    for k in &keys {
        let _: () = conn.set(k, k).await?;
    }
    let (down, _) = views(&addrs)
        .await?
        .into_iter()
        .find(|(n, l)| n.shard.0 == 3 && !l.is_primary())
        .context("shard 3's replica")?;
    let pod = format!("{}-0", objects::node("vc", down));
    cp.agent().fault(&ns, &pod, Fault::Stop).await?;

    set_spec(&client, &ns, json!({ "shards": 3 })).await?;
    back_to_three_shards(&client, &ns).await?;
    let mut conn = cluster_client(pod_addrs(&client, &ns, "vc").await?.values().copied()).await?;
    for k in &keys {
        let v: Option<String> = conn.get(k).await?;
        ensure!(v.as_deref() == Some(k.as_str()), "{k} read back {v:?}");
    }
    operator.stop().await;
    Ok(())
}

async fn idle_minute(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = env;
    let operator = Operator::start(&client, &ns);
    create(&client, &ns, &cluster("vc", 1, 1)?).await?;
    wait_ready(&client, &ns, "vc", FORM).await?;
    // Settled: the status the last reconcile wrote is the one a new one writes.
    let vcs: Api<ValkeyCluster> = Api::namespaced(client.clone(), &ns);
    let runs = operator.finished_reconciles();
    eventually(
        "a reconcile after Ready",
        Duration::from_secs(60),
        || async {
            ensure!(operator.finished_reconciles() > runs);
            Ok(())
        },
    )
    .await?;
    let children = child_versions(&client, &ns, "vc").await?;
    let version = vcs.get("vc").await?.resource_version();
    let runs = operator.finished_reconciles();
    // The minute itself is what is measured, not a state waited for.
    tokio::time::sleep(Duration::from_secs(60)).await;
    let idle_runs = operator.finished_reconciles() - runs;
    eprintln!("idle minute: {idle_runs} reconciles");
    // One requeue every 30 s, and nothing else to react to: a hot loop would show hundreds.
    ensure!(idle_runs <= 4, "{idle_runs} reconciles in an idle minute");
    ensure!(
        child_versions(&client, &ns, "vc").await? == children,
        "children rewritten"
    );
    ensure!(
        vcs.get("vc").await?.resource_version() == version,
        "the ValkeyCluster (status) was rewritten"
    );
    operator.stop().await;
    Ok(())
}

// --- external access, announce mode ------------------------------------------------------

async fn announce_nodeport_serves_external_clients(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, cp } = env;
    let node_ip = cp.agent().node_ip().to_string();
    let operator = Operator::start(&client, &ns);
    let started = Instant::now();
    let external = json!({ "enabled": true, "mode": "announce", "advertisedHost": node_ip });
    create(&client, &ns, &external_cluster("vc", 3, 1, external)?).await?;
    let vc = wait_external_ready(&client, &ns, "vc").await?;
    eprintln!(
        "3x1 cluster with NodePorts Ready in {:?}",
        started.elapsed()
    );
    let status = vc.status.clone().context("status")?;

    // The NodePorts, read from the Services themselves: one Service per shard, a port per node.
    let services = external_services(&client, &ns, "vc").await?;
    ensure!(services.len() == 3, "Services {:?}", services.keys());
    let mut node_ports = BTreeMap::new();
    for s in 0..3u32 {
        let name = objects::shard_service("vc", shardgate_crds::ShardIndex(s));
        let spec = services
            .get(&name)
            .and_then(|svc| svc.spec.clone())
            .with_context(|| format!("Service {name}"))?;
        ensure!(
            spec.type_.as_deref() == Some("NodePort"),
            "{name}: {spec:?}"
        );
        for p in spec.ports.iter().flatten() {
            let n: u32 = p
                .name
                .as_deref()
                .and_then(|n| n.strip_prefix("vk-n"))
                .context("port name")?
                .parse()?;
            let target = NodeRef::new(s, n);
            ensure!(
                p.target_port
                    == Some(
                        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(
                            objects::container_port(target)
                        )
                    ),
                "{name}: {p:?}"
            );
            node_ports.insert((s as i32, n as i32), p.node_port.context("no nodePort")?);
        }
    }
    ensure!(node_ports.len() == 6, "{node_ports:?}");
    let endpoints = &status.external_endpoints;
    ensure!(endpoints.len() == 6, "{endpoints:?}");
    for ep in endpoints {
        ensure!(ep.host == node_ip, "{ep:?}");
        ensure!(
            node_ports.get(&(ep.shard, ep.node)) == Some(&ep.port),
            "{ep:?} vs the Services' {node_ports:?}"
        );
        ensure!(
            ep.service == objects::shard_service("vc", shardgate_crds::ShardIndex(ep.shard as u32)),
            "{ep:?}"
        );
    }
    let primaries = endpoints
        .iter()
        .filter(|e| e.role == Some(shardgate_crds::valkey_cluster::NodeRole::Primary))
        .count();
    ensure!(primaries == 3, "roles: {endpoints:?}");
    let external_addrs: std::collections::BTreeSet<String> =
        endpoints.iter().map(|e| e.address()).collect();
    let bootstrap = status.bootstrap.clone().context("no bootstrap")?;
    let seeds: Vec<std::net::SocketAddr> = bootstrap
        .split(',')
        .map(|a| a.parse().with_context(|| format!("bootstrap {bootstrap}")))
        .collect::<Result<_>>()?;
    ensure!(
        seeds
            .iter()
            .map(|a| a.to_string())
            .collect::<std::collections::BTreeSet<_>>()
            == external_addrs,
        "bootstrap {bootstrap} vs endpoints {external_addrs:?}"
    );

    // An event says what to connect to.
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), &ns);
    eventually(
        "an ExternalAccessReady event",
        Duration::from_secs(30),
        || async {
            let found = events
                .list(&ListParams::default())
                .await?
                .items
                .into_iter()
                .any(|e| {
                    e.reason.as_deref() == Some("ExternalAccessReady")
                        && e.note
                            .as_deref()
                            .is_some_and(|n| n.contains(&seeds[0].to_string()))
                });
            ensure!(found, "no ExternalAccessReady event naming {}", seeds[0]);
            Ok(())
        },
    )
    .await?;

    // A cluster client that knows only the bootstrap addresses: 10,000 SET/GET; CLUSTER
    // SLOTS seen through a NodePort names only external addresses.
    only_external_addresses(&client, &ns, "vc", &status, 10_000).await?;

    // redis-cli -c through one NodePort: 10,000 SET/GET over every slot, following MOVED.
    let seed = seeds[0];
    tokio::task::spawn_blocking(move || redis_cli_set_get(seed, 10_000)).await??;
    operator.stop().await;
    Ok(())
}

/// The upstream review's pitfalls, on the real API server.
async fn announce_service_pitfalls(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, cp } = env;
    let node_ip = cp.agent().node_ip().to_string();
    let operator = Operator::start(&client, &ns);
    let external = json!({
        "enabled": true,
        "advertisedHost": node_ip,
        "externalTrafficPolicy": "Local",
        "serviceAnnotations": {
            "example.com/owner": "{cluster}-{shard}",
            "example.com/dropped": "soon",
        },
    });
    create(&client, &ns, &external_cluster("vc", 1, 1, external)?).await?;
    wait_external_ready(&client, &ns, "vc").await?;
    let svc_name = objects::shard_service("vc", shardgate_crds::ShardIndex(0));
    let services: Api<Service> = Api::namespaced(client.clone(), &ns);
    let svc = services.get(&svc_name).await?;
    let spec = svc.spec.clone().context("spec")?;
    ensure!(
        spec.external_traffic_policy.as_deref() == Some("Local"),
        "{spec:?}"
    );
    ensure!(
        spec.ports.as_ref().is_some_and(|p| p.len() == 2),
        "{spec:?}"
    );

    // Annotations of another field manager survive; a key removed from the spec goes.
    services
        .patch(
            &svc_name,
            &PatchParams {
                field_manager: Some("another-controller".into()),
                ..Default::default()
            },
            &Patch::Merge(json!({ "metadata": { "annotations": { "other.io/keep": "yes" } } })),
        )
        .await?;
    set_spec(
        &client,
        &ns,
        json!({ "externalAccess": { "serviceAnnotations": { "example.com/dropped": null } } }),
    )
    .await?;
    eventually("annotations merged", Duration::from_secs(60), || async {
        let a = services.get(&svc_name).await?.annotations().clone();
        ensure!(
            a.get("example.com/owner").map(String::as_str) == Some("vc-0")
                && a.get("other.io/keep").map(String::as_str) == Some("yes")
                && !a.contains_key("example.com/dropped"),
            "annotations {a:?}"
        );
        Ok(())
    })
    .await?;
    wait_external_ready(&client, &ns, "vc").await?;

    // A reconcile with nothing changed leaves every Service (and child) as it is.
    let before = child_versions(&client, &ns, "vc").await?;
    let runs = operator.finished_reconciles();
    Api::<ValkeyCluster>::namespaced(client.clone(), &ns)
        .patch(
            "vc",
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "annotations": { "test/poke": "1" } } })),
        )
        .await?;
    eventually(
        "a reconcile after the poke",
        Duration::from_secs(60),
        || async {
            ensure!(operator.finished_reconciles() > runs);
            Ok(())
        },
    )
    .await?;
    let after = child_versions(&client, &ns, "vc").await?;
    ensure!(
        before == after,
        "children rewritten:\nbefore {before:?}\nafter  {after:?}"
    );

    // A pod with the cluster's labels but no index labels: a Warning event, no Service port.
    let stray: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "stray",
            "labels": {
                labels::MANAGED_BY: labels::MANAGED_BY_VALUE,
                labels::INSTANCE: "vc",
                labels::CLUSTER: "vc",
            },
        },
        "spec": { "containers": [{ "name": "valkey", "image": "valkey/valkey:9.0" }] },
    }))?;
    let pod_api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    pod_api.create(&Default::default(), &stray).await?;
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), &ns);
    eventually(
        "a MissingIndexLabel event",
        Duration::from_secs(60),
        || async {
            let found = events
                .list(&ListParams::default())
                .await?
                .items
                .into_iter()
                .any(|e| {
                    e.reason.as_deref() == Some("MissingIndexLabel")
                        && e.type_.as_deref() == Some("Warning")
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("vc")
                        && e.note.as_deref().is_some_and(|n| n.contains("stray"))
                });
            ensure!(found, "no MissingIndexLabel event");
            Ok(())
        },
    )
    .await?;
    let svcs = external_services(&client, &ns, "vc").await?;
    let ports: usize = svcs
        .values()
        .map(|s| {
            s.spec
                .as_ref()
                .and_then(|s| s.ports.as_ref())
                .map_or(0, Vec::len)
        })
        .sum();
    ensure!(
        svcs.len() == 1 && ports == 2,
        "the stray pod got a port: {svcs:?}"
    );
    pod_api.delete("stray", &DeleteParams::default()).await?;

    // NodePort -> ClusterIP: accepted in place (the same Service), the NodePorts and the
    // traffic policy go.
    let uid = services.get(&svc_name).await?.uid();
    let started = Instant::now();
    set_spec(
        &client,
        &ns,
        json!({ "externalAccess": { "serviceType": "ClusterIP" } }),
    )
    .await?;
    eventually("a ClusterIP Service", Duration::from_secs(60), || async {
        let spec = services.get(&svc_name).await?.spec.context("spec")?;
        ensure!(
            spec.type_.as_deref() == Some("ClusterIP")
                && spec.external_traffic_policy.is_none()
                && spec.ports.iter().flatten().all(|p| p.node_port.is_none()),
            "{spec:?}"
        );
        Ok(())
    })
    .await?;
    ensure!(
        services.get(&svc_name).await?.uid() == uid,
        "the Service was made again, not updated"
    );
    let vc = wait_external_ready(&client, &ns, "vc").await?;
    let eps = vc.status.map(|s| s.external_endpoints).unwrap_or_default();
    ensure!(
        eps.len() == 2
            && eps
                .iter()
                .all(|e| e.host == node_ip && e.port >= 6379 && e.port < 6381),
        "ClusterIP endpoints {eps:?}"
    );
    eprintln!(
        "NodePort -> ClusterIP, pods rolled: {:?}",
        started.elapsed()
    );

    // And back: NodePorts again, with the policy.
    set_spec(
        &client,
        &ns,
        json!({ "externalAccess": { "serviceType": "NodePort" } }),
    )
    .await?;
    eventually("a NodePort Service", Duration::from_secs(60), || async {
        let spec = services.get(&svc_name).await?.spec.context("spec")?;
        ensure!(
            spec.type_.as_deref() == Some("NodePort")
                && spec.external_traffic_policy.as_deref() == Some("Local")
                && spec.ports.iter().flatten().all(|p| p.node_port.is_some()),
            "{spec:?}"
        );
        Ok(())
    })
    .await?;
    let vc = wait_external_ready(&client, &ns, "vc").await?;
    let eps = vc.status.map(|s| s.external_endpoints).unwrap_or_default();
    ensure!(
        eps.len() == 2 && eps.iter().all(|e| e.port >= 30000),
        "NodePort endpoints {eps:?}"
    );
    // Cross-shard traffic at the new NodePorts.
    let mut conn = cluster_client(
        eps.iter()
            .map(|e| e.address().parse())
            .collect::<Result<Vec<std::net::SocketAddr>, _>>()?,
    )
    .await?;
    for k in spread_keys(100, "back") {
        let _: () = conn.set(&k, &k).await?;
        let v: String = conn.get(&k).await?;
        ensure!(v == k);
    }

    // Off: the Services go, and so do the endpoints and the condition.
    set_spec(
        &client,
        &ns,
        json!({ "externalAccess": { "enabled": false } }),
    )
    .await?;
    eventually("external access removed", FORM, || async {
        let left = external_services(&client, &ns, "vc").await?;
        let vc = Api::<ValkeyCluster>::namespaced(client.clone(), &ns)
            .get("vc")
            .await?;
        let status = vc.status.clone().unwrap_or_default();
        ensure!(
            left.is_empty()
                && status.external_endpoints.is_empty()
                && status.bootstrap.is_none()
                && condition(&vc, "ExternalAccessReady").is_none(),
            "left: {:?}, {status:?}",
            left.keys()
        );
        Ok(())
    })
    .await?;
    wait_ready(&client, &ns, "vc", FORM).await?;
    operator.stop().await;
    Ok(())
}

/// One Service per node, no advertisedHost: the NodePorts are reached at the Kubernetes node's
/// InternalIP (read from the Node, announced at run time); scale-in removes the Services of the
/// nodes that go.
async fn announce_per_node_services_at_the_node_address(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, cp } = env;
    let node_ip = cp.agent().node_ip().to_string();
    let operator = Operator::start(&client, &ns);
    let external = json!({
        "enabled": true,
        "serviceLayout": "node",
        "nodeAddressType": "InternalIP",
        "domain": "valkey.example.test",
    });
    create(&client, &ns, &external_cluster("vc", 2, 1, external)?).await?;
    let vc = wait_external_ready(&client, &ns, "vc").await?;
    let status = vc.status.clone().context("status")?;
    let services = external_services(&client, &ns, "vc").await?;
    let names: Vec<&String> = services.keys().collect();
    ensure!(
        names == ["vc-node-0-0", "vc-node-0-1", "vc-node-1-0", "vc-node-1-1"],
        "Services {names:?}"
    );
    for ep in &status.external_endpoints {
        let node = NodeRef::new(ep.shard as u32, ep.node as u32);
        let svc = &services[&objects::node_service("vc", node)];
        let port = svc
            .spec
            .as_ref()
            .and_then(|s| s.ports.as_ref())
            .and_then(|p| p.first())
            .and_then(|p| p.node_port);
        ensure!(
            ep.host == node_ip
                && Some(ep.port) == port
                && ep.hostname.as_deref()
                    == Some(format!("vc-{node}.valkey.example.test").as_str()),
            "{ep:?} vs {svc:?}"
        );
    }
    ensure!(status.external_endpoints.len() == 4, "{status:?}");
    only_external_addresses(&client, &ns, "vc", &status, 1_000).await?;

    // Replicas 1 -> 0: the replicas' Services go.
    set_spec(&client, &ns, json!({ "replicas": 0 })).await?;
    eventually("the replicas' Services gone", FORM, || async {
        let left = external_services(&client, &ns, "vc").await?;
        let names: Vec<&String> = left.keys().collect();
        ensure!(
            names == ["vc-node-0-0", "vc-node-1-0"],
            "Services {names:?}"
        );
        Ok(())
    })
    .await?;
    let vc = wait_external_ready(&client, &ns, "vc").await?;
    let status = vc.status.context("status")?;
    ensure!(status.external_endpoints.len() == 2, "{status:?}");
    only_external_addresses(&client, &ns, "vc", &status, 1_000).await?;
    operator.stop().await;
    Ok(())
}

/// `spec.tls` with NodePorts: the cluster waits, with a Warning that says why, until its
/// Secret exists; then its nodes form over TLS (bus and replication) and speak only TLS to
/// clients, which are handed the external NodePorts as TLS ports. Real clients outside: redis-cli
/// with `--tls -c`, following MOVED, and a TLS admin client reading the topology; a plain
/// client and one without a certificate are refused. A Secret renewed in place reaches every
/// node without a restart; another Secret rolls every pod onto it, losing no key.
async fn announce_tls(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, cp } = env;
    let node_ip = cp.agent().node_ip().to_string();
    let operator = Operator::start(&client, &ns);
    let external = json!({ "enabled": true, "mode": "announce", "advertisedHost": node_ip });
    let mut vc = external_cluster("vc", 3, 1, external)?;
    vc.spec.tls = serde_json::from_value(json!({ "secretName": "vc-tls" }))?;
    create(&client, &ns, &vc).await?;

    // No Secret yet: a failed reconcile that names it, and nothing made.
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), &ns);
    eventually("a warning naming the missing Secret", FORM, || async {
        let found = events
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .any(|e| {
                e.reason.as_deref() == Some("ReconcileFailed")
                    && e.note.as_deref().is_some_and(|n| {
                        n.contains("spec.tls: Secret vc-tls not found in namespace")
                    })
            });
        ensure!(found, "no ReconcileFailed event about Secret vc-tls");
        // And status says so, for `kubectl get` and `kubectl wait`.
        let vc = Api::<ValkeyCluster>::namespaced(client.clone(), &ns)
            .get("vc")
            .await?;
        let phase = vc.status.as_ref().and_then(|s| s.phase);
        let ready = condition(&vc, "Ready");
        ensure!(
            phase.map(|p| p.as_str()) == Some("Pending")
                && ready.as_ref().is_some_and(|(s, r, m)| s == "False"
                    && r == "TLSSecretUnavailable"
                    && m.contains("Secret vc-tls not found")),
            "phase {phase:?}, Ready {ready:?}"
        );
        Ok(())
    })
    .await?;
    let sets = Api::<StatefulSet>::namespaced(client.clone(), &ns)
        .list(&ListParams::default())
        .await?;
    ensure!(
        sets.items.is_empty(),
        "made without its Secret: {:?}",
        sets.items
    );

    let tls = ClusterTls::new()?;
    tls.create_secret(&client, &ns, "vc-tls").await?;
    let vc = wait_external_ready(&client, &ns, "vc").await?;
    let status = vc.status.clone().context("status")?;
    let seeds = bootstrap_seeds(&vc)?;
    let external_addrs: std::collections::BTreeSet<String> = status
        .external_endpoints
        .iter()
        .map(|e| e.address())
        .collect();
    ensure!(external_addrs.len() == 6, "{external_addrs:?}");
    let ready = condition(&vc, "ExternalAccessReady");
    ensure!(
        ready
            .as_ref()
            .is_some_and(|(_, _, m)| m.contains("reachable from outside over TLS only")),
        "ExternalAccessReady: {ready:?}"
    );

    // The topology, asked over TLS through a NodePort, names only external addresses, as
    // TLS ports. Ready says every node is in place; the seed's view may be a gossip round
    // behind.
    let dial = tls.dial()?;
    eventually(
        "the topology seen from outside over TLS",
        Duration::from_secs(30),
        || topology_over_tls(seeds[0], &dial, &external_addrs),
    )
    .await?;
    // redis-cli over TLS through one NodePort: 2,000 SET/GET over every slot, following
    // the cluster's MOVED replies to the other NodePorts.
    let seed = seeds[0];
    tls.redis_cli_set_get(seed, 2_000).await?;
    refuses_plain_and_anonymous(seed, &tls.pki).await?;

    // The Secret renewed in place (as cert-manager renews it): every node presents the new
    // certificate within a look or two of the operator, and no pod restarted for it.
    let uids = |pods: Vec<Pod>| {
        pods.into_iter()
            .map(|p| (p.name_any(), p.uid().unwrap_or_default()))
            .collect::<BTreeMap<_, _>>()
    };
    let pods = Api::<Pod>::namespaced(client.clone(), &ns);
    let before = uids(pods.list(&ListParams::default()).await?.items);
    let renewed = tls.pki.node_cert("renewed", &["*.vc.test".to_string()])?;
    tls.renew_secret(&client, &ns, "vc-tls", &renewed).await?;
    let want = renewed.cert_der()?.to_vec();
    eventually(
        "every node presenting the renewed certificate",
        Duration::from_secs(120),
        || async {
            for ep in &external_addrs {
                let c = Admin::dial(ep.parse()?, &dial).await?;
                ensure!(
                    c.peer_certificate() == Some(want.as_slice()),
                    "{ep} presents another certificate"
                );
            }
            Ok(())
        },
    )
    .await?;
    let after = uids(pods.list(&ListParams::default()).await?.items);
    ensure!(before == after, "pods restarted: {before:?} -> {after:?}");
    let reloaded = events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("CertificateReloaded"))
        .count();
    ensure!(reloaded > 0, "no CertificateReloaded event");

    // With every node on the Secret's certificate, a look dials each node once (formation's
    // connection shows the certificate), not a second time to check it. The node also
    // counts ours and its readiness probe's (the harness probes every half second).
    let ep: std::net::SocketAddr = external_addrs.first().context("an endpoint")?.parse()?;
    let accepted = || async {
        let mut c = Admin::dial(ep, &dial).await?;
        let reply = c.command(["INFO", "stats"]).await?;
        let text = match &reply {
            shardgate_admin_client::Reply::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
            other => bail!("INFO stats: {other:?}"),
        };
        text.lines()
            .find_map(|l| l.strip_prefix("total_connections_received:"))
            .context("total_connections_received")?
            .trim()
            .parse::<u64>()
            .context("total_connections_received")
    };
    let vcs = Api::<ValkeyCluster>::namespaced(client.clone(), &ns);
    // Formed, so that every look reaches the nodes' certificates.
    wait_ready(&client, &ns, "vc", FORM).await?;
    let started = Instant::now();
    let (looks_before, conns_before) = (operator.finished_reconciles(), accepted().await?);
    for i in 0..12 {
        reconcile_again(&vcs, &operator, "vc", 100 + i).await?;
    }
    let looks = operator.finished_reconciles() - looks_before;
    let conns = accepted().await?.saturating_sub(conns_before + 1);
    let probes = started.elapsed().as_millis() as u64 / 500 + 2;
    // One look may be under way at either end.
    ensure!(
        looks >= 12 && conns <= looks + 1 + probes,
        "{conns} connections to {ep} over {looks} looks of the operator and {probes} probes"
    );

    // Another Secret (same CA): every pod restarts onto it, one at a time with a failover
    // before each primary (all over TLS), and the keys written before are all there.
    let second = tls.pki.node_cert("second", &["*.vc.test".to_string()])?;
    tls.create_secret_with(&client, &ns, "vc-tls-2", &second)
        .await?;
    let patch = json!({ "spec": { "tls": { "secretName": "vc-tls-2" } } });
    Api::<ValkeyCluster>::namespaced(client.clone(), &ns)
        .patch("vc", &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    eventually("every pod replaced", Duration::from_secs(400), || async {
        let now = uids(pods.list(&ListParams::default()).await?.items);
        let kept: Vec<_> = now
            .iter()
            .filter(|(n, u)| after.get(*n) == Some(u))
            .collect();
        ensure!(
            now.len() == 6 && kept.is_empty(),
            "not replaced yet: {kept:?}"
        );
        Ok(())
    })
    .await?;
    wait_external_ready(&client, &ns, "vc").await?;
    let want = second.cert_der()?.to_vec();
    for ep in &external_addrs {
        let c = Admin::dial(ep.parse()?, &dial).await?;
        ensure!(
            c.peer_certificate() == Some(want.as_slice()),
            "{ep} presents another certificate than vc-tls-2's"
        );
    }
    tls.redis_cli_read_back(seed, 2_000).await?;
    operator.stop().await;
    Ok(())
}

/// `spec.tls` while shards scale out and in: slots move between nodes that speak only TLS
/// (Valkey's atomic slot migration over TLS replication links), and every key written
/// before is read back after each step through redis-cli over TLS.
async fn tls_scaling(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = env;
    let operator = Operator::start(&client, &ns);
    let tls = ClusterTls::new()?;
    tls.create_secret(&client, &ns, "vc-tls").await?;
    let mut vc = cluster("vc", 2, 1)?;
    vc.spec.tls = serde_json::from_value(json!({ "secretName": "vc-tls" }))?;
    create(&client, &ns, &vc).await?;
    wait_ready(&client, &ns, "vc", FORM).await?;
    let dial = tls.dial()?;
    // A node's own view of how many slots each primary serves, asked over TLS.
    let slots = |seed: std::net::SocketAddr| {
        let dial = dial.clone();
        async move {
            let mut c = Admin::dial(seed, &dial).await?;
            let mut counts: Vec<u32> = c
                .cluster_nodes()
                .await?
                .iter()
                .filter(|l| l.is_primary() && !l.slots.is_empty())
                .map(|l| l.slot_count())
                .collect();
            counts.sort();
            Ok::<_, anyhow::Error>(counts)
        }
    };
    let seed = *pod_addrs(&client, &ns, "vc")
        .await?
        .values()
        .next()
        .context("a pod")?;
    tls.redis_cli_set_get(seed, 1_000).await?;

    for (shards, want) in [(3, vec![5461, 5461, 5462]), (2, vec![8192, 8192])] {
        set_spec(&client, &ns, json!({ "shards": shards })).await?;
        eventually(
            &format!("{shards} shards over TLS serving {want:?} slots"),
            FORM,
            || async {
                let vc = wait_ready(&client, &ns, "vc", FORM).await?;
                let formed = vc.status.as_ref().and_then(|s| s.formed);
                ensure!(
                    formed.as_ref().is_some_and(|f| f.shards == shards),
                    "formed {formed:?}"
                );
                let addrs = pod_addrs(&client, &ns, "vc").await?;
                ensure!(addrs.len() == 2 * shards as usize, "{} pods", addrs.len());
                for a in addrs.values() {
                    let counts = slots(*a).await?;
                    ensure!(counts == want, "{a} sees {counts:?}");
                }
                Ok(())
            },
        )
        .await?;
        let seed = *pod_addrs(&client, &ns, "vc")
            .await?
            .values()
            .next()
            .context("a pod")?;
        tls.redis_cli_read_back(seed, 1_000).await?;
    }
    operator.stop().await;
    Ok(())
}

/// LoadBalancer Services (the harness hands out loopback ingress IPs): each node announces its
/// shard's ingress IP and its Service port, once the ingress is there.
async fn announce_load_balancer(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = env;
    let operator = Operator::start(&client, &ns);
    let started = Instant::now();
    let external = json!({ "enabled": true, "serviceType": "LoadBalancer" });
    create(&client, &ns, &external_cluster("vc", 2, 1, external)?).await?;
    let vc = wait_external_ready(&client, &ns, "vc").await?;
    eprintln!(
        "2x1 cluster behind LoadBalancers settled in {:?}",
        started.elapsed()
    );
    let status = vc.status.context("status")?;
    let services = external_services(&client, &ns, "vc").await?;
    for ep in &status.external_endpoints {
        let svc = &services[&ep.service];
        let ingress = svc
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|lb| lb.ingress.as_ref())
            .and_then(|i| i.first())
            .and_then(|i| i.ip.clone());
        ensure!(
            Some(&ep.host) == ingress.as_ref() && ep.port == 6379 + ep.node,
            "{ep:?} vs {svc:?}"
        );
    }
    ensure!(status.external_endpoints.len() == 4, "{status:?}");
    only_external_addresses(&client, &ns, "vc", &status, 1_000).await?;
    operator.stop().await;
    Ok(())
}

/// Announce mode under load, seen from outside: a manual failover loses no acknowledged
/// write, and a killed primary's shard serves writes again within the node timeout plus a
/// few seconds.
async fn announce_failovers_under_load(env: TestEnv) -> Result<()> {
    let operator = Operator::start(&env.client, &env.ns);
    let external = json!({
        "enabled": true,
        "mode": "announce",
        "advertisedHost": env.cp.agent().node_ip().to_string(),
    });
    create(
        &env.client,
        &env.ns,
        &external_cluster("vc", 3, 1, external)?,
    )
    .await?;
    let vc = wait_external_ready(&env.client, &env.ns, "vc").await?;
    failovers_under_load(&env, &bootstrap_seeds(&vc)?, "announce").await?;
    operator.stop().await;
    Ok(())
}

/// Resolves the names `status.externalEndpoints` gives, as a client's own resolver (or DNS
/// published by external-dns) would; counts the names it was asked for.
#[derive(Clone)]
struct StatusResolver {
    names: std::sync::Arc<BTreeMap<String, std::net::IpAddr>>,
    asked: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl redis::io::AsyncDNSResolver for StatusResolver {
    fn resolve<'a, 'b: 'a>(
        &'a self,
        host: &'b str,
        port: u16,
    ) -> redis::RedisFuture<'a, Box<dyn Iterator<Item = std::net::SocketAddr> + Send + 'a>> {
        Box::pin(async move {
            let ip = match host.parse::<std::net::IpAddr>() {
                Ok(ip) => ip,
                Err(_) => {
                    let ip =
                        self.names.get(host).copied().ok_or_else(|| {
                            std::io::Error::other(format!("{host} is not in status"))
                        })?;
                    self.asked
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    ip
                }
            };
            let it: Box<dyn Iterator<Item = std::net::SocketAddr> + Send> =
                Box::new(std::iter::once(std::net::SocketAddr::new(ip, port)));
            Ok(it)
        })
    }
}

/// `preferredEndpointType: hostname`: topology replies and redirects name each node by its
/// hostname (`<cluster>-<s>-<n>.<domain>`) and external port; a cluster client whose
/// resolver knows only those names does 10,000 SET/GET. Then the domain goes and
/// `advertisedHost` becomes a DNS name: every node announces that one name, at its own
/// port, and a client that resolves only it does the same.
async fn announce_hostnames(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, cp } = env;
    let node_ip = std::net::IpAddr::from(cp.agent().node_ip());
    let operator = Operator::start(&client, &ns);
    let domain = "valkey.example.test";
    let external = json!({
        "enabled": true,
        "advertisedHost": node_ip.to_string(),
        "domain": domain,
        "preferredEndpointType": "hostname",
    });
    create(&client, &ns, &external_cluster("vc", 2, 1, external)?).await?;
    let vc = wait_external_ready(&client, &ns, "vc").await?;
    handed_out_by_name(&vc, node_ip, |node| format!("vc-{node}.{domain}"), 10_000).await?;

    // One name for every node: the pods roll to announce it (each keeps a hostname
    // throughout, so no client is handed a `?` in between).
    let name = "valkey.example.test";
    set_spec(
        &client,
        &ns,
        json!({ "externalAccess": { "domain": null, "advertisedHost": name } }),
    )
    .await?;
    let vc = eventually(
        "status naming every node by the advertisedHost",
        Duration::from_secs(420),
        || async {
            let vc = wait_external_ready(&client, &ns, "vc").await?;
            let eps = &vc.status.as_ref().context("status")?.external_endpoints;
            ensure!(
                eps.len() == 4
                    && eps
                        .iter()
                        .all(|e| e.host == name && e.hostname.as_deref() == Some(name)),
                "{eps:?}"
            );
            Ok(vc)
        },
    )
    .await?;
    handed_out_by_name(&vc, node_ip, |_| name.to_string(), 2_000).await?;
    operator.stop().await;
    Ok(())
}

/// What a client outside is handed, with hostnames on: CLUSTER SLOTS and MOVED name each
/// node by `want(node)` and the external port `status` gives it (waiting, while pods roll,
/// for every node to be named so); then a cluster client whose resolver knows only those
/// names (each at `node_ip`) does `keys` SET/GET.
async fn handed_out_by_name(
    vc: &ValkeyCluster,
    node_ip: std::net::IpAddr,
    want: impl Fn(NodeRef) -> String,
    keys: usize,
) -> Result<()> {
    let status = vc.status.clone().context("status")?;
    ensure!(status.external_endpoints.len() == 4, "{status:?}");
    // hostname:port of every node, from status.
    let mut expected = std::collections::BTreeSet::new();
    for ep in &status.external_endpoints {
        let node = NodeRef::new(ep.shard as u32, ep.node as u32);
        let name = want(node);
        ensure!(ep.hostname.as_deref() == Some(name.as_str()), "{ep:?}");
        expected.insert(format!("{name}:{}", ep.port));
    }
    // Where the names lead (bootstrap lists them by name once advertisedHost is one).
    let seeds: Vec<std::net::SocketAddr> = status
        .external_endpoints
        .iter()
        .map(|ep| std::net::SocketAddr::new(node_ip, ep.port as u16))
        .collect();

    // CLUSTER SLOTS names every node by hostname, at its external port; MOVED does too.
    // The seed's view may be a gossip round (or a rolling pod) behind Ready: wait until it
    // names every node so.
    eventually(
        "CLUSTER SLOTS naming every node by hostname",
        Duration::from_secs(120),
        || async {
            let mut direct = redis::Client::open(format!("redis://{}", seeds[0]))?
                .get_multiplexed_async_connection()
                .await?;
            let slots: redis::Value = redis::cmd("CLUSTER")
                .arg("SLOTS")
                .query_async(&mut direct)
                .await?;
            let named: std::collections::BTreeSet<String> =
                slot_addresses(&slots)?.into_iter().collect();
            ensure!(
                named == expected,
                "CLUSTER SLOTS names {named:?}, not every node's hostname and port ({expected:?})"
            );
            Ok(())
        },
    )
    .await?;
    let mut raw = Admin::connect(seeds[0], Timeouts::default()).await?;
    let mut moved = Vec::new();
    for k in spread_keys(8, "mv") {
        match raw.command(["GET", k.as_str()]).await {
            Ok(_) => {}
            Err(e) => moved.push(
                e.server_message()
                    .context("not an error reply")?
                    .to_string(),
            ),
        }
    }
    ensure!(!moved.is_empty(), "no key of another shard was redirected");
    for e in &moved {
        let target = e.split_whitespace().nth(2).context("MOVED target")?;
        ensure!(
            e.starts_with("MOVED ") && expected.contains(target),
            "{e}: not a node's hostname and port ({expected:?})"
        );
    }

    // A client that resolves the names itself.
    let names = expected
        .iter()
        .filter_map(|a| a.rsplit_once(':'))
        .map(|(host, _)| (host.to_string(), node_ip))
        .collect();
    let resolver = StatusResolver {
        names: std::sync::Arc::new(names),
        asked: Default::default(),
    };
    let urls: Vec<String> = seeds.iter().map(|a| format!("redis://{a}")).collect();
    let mut conn = redis::cluster::ClusterClientBuilder::new(urls)
        .async_dns_resolver(resolver.clone())
        .retries(30)
        .connection_timeout(Duration::from_secs(2))
        .response_timeout(Duration::from_secs(2))
        .build()?
        .get_async_connection()
        .await?;
    let keys = spread_keys(keys, "host");
    for k in &keys {
        let _: () = conn.set(k, k).await?;
    }
    for k in &keys {
        let v: String = conn.get(k).await?;
        ensure!(&v == k, "{k} read back {v}");
    }
    let asked = resolver.asked.load(std::sync::atomic::Ordering::Relaxed);
    ensure!(asked > 0, "the client never resolved a node's hostname");
    Ok(())
}
