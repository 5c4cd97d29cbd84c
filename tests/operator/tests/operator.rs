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
use shardgate_kube_harness::{Fault, TestEnv};
use shardgate_operator_e2e::{
    cluster_client, condition, create, eventually, pod_addrs, valkey_cluster, wait_ready, Operator,
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
            "a_config_change_rolls_pods_one_at_a_time_losing_no_acknowledged_write",
            config_change_rolls,
        )
        .test(
            "only_the_leader_reconciles_and_a_standby_takes_over",
            leader_election,
        )
        .test(
            "shards_3_to_4_and_replicas_up_and_down_under_writes_lose_nothing",
            scaling,
        )
        .test(
            "an_idle_cluster_costs_few_reconciles_and_no_writes_over_a_minute",
            idle_minute,
        )
        .run()
}

const FORM: Duration = Duration::from_secs(240);

/// A `shards` x `replicas` cluster with a short node timeout (failovers in seconds).
fn cluster(name: &str, shards: u32, replicas: u32) -> Result<ValkeyCluster> {
    valkey_cluster(json!({
        "apiVersion": "shardgate.io/v1alpha1",
        "kind": "ValkeyCluster",
        "metadata": { "name": name },
        "spec": {
            "shards": shards,
            "replicas": replicas,
            "image": "valkey/valkey:9.0",
            "config": { "cluster-node-timeout": "2000", "maxmemory": "32mb" },
        },
    }))
}

/// Every node's view through the admin client: (shard, node) → (id, primary id, slots).
async fn views(
    addrs: &BTreeMap<NodeRef, std::net::SocketAddr>,
) -> Result<BTreeMap<NodeRef, shardgate_admin_client::NodeLine>> {
    let mut out = BTreeMap::new();
    for (node, addr) in addrs {
        let mut c = Admin::connect(*addr, Timeouts::default()).await?;
        let me = c
            .cluster_nodes()
            .await?
            .into_iter()
            .find(|l| l.is_myself())
            .context("no myself line")?;
        out.insert(*node, me);
    }
    Ok(out)
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
    let vc = wait_ready(&client, &ns, "vc", FORM).await?;
    let healed = killed.elapsed();
    eprintln!("killed primary: failover after {failed_over:?}, Ready again after {healed:?}");
    // The old primary is back as a replica of the new one, with its id.
    let after = views(&pod_addrs(&client, &ns, "vc").await?).await?;
    let back = &after[&victim];
    ensure!(back.id == victim_id, "{back:?}");
    ensure!(
        back.primary_id.as_deref() == Some(after[&replica].id.as_str()),
        "{back:?}"
    );
    ensure!(condition(&vc, "Ready").is_some_and(|c| c.0 == "True"));
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
    wait_ready(&client, &ns, "vc", FORM).await?;
    ensure!(
        id_of(new_addr).await? == moved_line.id,
        "the moved node changed its id"
    );
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
    wait_ready(&client, &ns, "vc", FORM).await?;
    eprintln!(
        "wiped primary back as a replica after {:?}",
        started.elapsed()
    );
    let addrs = pod_addrs(&client, &ns, "vc").await?;
    let after = views(&addrs).await?;
    let partner = NodeRef::new(wiped.shard.0, 1 - wiped.node.0);
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
    operator.stop().await;
    Ok(())
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

    // A writer that keeps every acknowledged key and counts its errors.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        let mut conn = cluster_client(addrs.values().copied()).await?;
        tokio::spawn(async move {
            let (mut acked, mut errors) = (Vec::new(), 0u32);
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let key = format!("roll:{i}");
                match conn.set::<_, _, ()>(&key, i).await {
                    Ok(()) => acked.push(key),
                    Err(_) => errors += 1,
                }
                i += 1;
            }
            (acked, errors)
        })
    };

    Api::<ValkeyCluster>::namespaced(client.clone(), &ns)
        .patch(
            "vc",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "config": { "maxmemory-policy": "allkeys-lru" } } })),
        )
        .await?;
    // One pod at a time: never two of the cluster's pods down together.
    let most_down = std::sync::atomic::AtomicUsize::new(0);
    eventually(
        "every pod on the new config",
        Duration::from_secs(400),
        || async {
            let pods = pod_api.list(&sel).await?.items;
            let down = pods
                .iter()
                .filter(|p| {
                    let ready = p
                        .status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|c| {
                            c.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                        });
                    !ready || p.metadata.deletion_timestamp.is_some()
                })
                .count()
                + 4usize.saturating_sub(pods.len());
            most_down.fetch_max(down, std::sync::atomic::Ordering::Relaxed);
            let now = hashes(&pods);
            ensure!(
                now.len() == 4 && now.values().all(|h| !old.values().any(|o| o == h)),
                "hashes {now:?}"
            );
            Ok(())
        },
    )
    .await?;
    let vc = wait_ready(&client, &ns, "vc", FORM).await?;
    let most_down = most_down.into_inner();
    ensure!(most_down <= 1, "{most_down} pods were down at once");
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
        ensure!(v.is_some(), "acknowledged {key} lost in the roll");
    }
    eprintln!(
        "rolled 4 pods: {} writes acknowledged, {errors} failed, none lost",
        acked.len()
    );
    ensure!(condition(&vc, "Ready").is_some_and(|c| c.0 == "True"));
    operator.stop().await;
    Ok(())
}

async fn leader_election(env: TestEnv) -> Result<()> {
    use shardgate_controller::leader::{run_as_leader, LeaderElection};
    let TestEnv { client, ns, .. } = env;
    let lease = Duration::from_secs(3);
    let start = |id: &str| {
        let metrics = std::sync::Arc::new(
            shardgate_controller::metrics::Metrics::default()
                .register(&mut prometheus_client::registry::Registry::default()),
        );
        let ctx = std::sync::Arc::new(shardgate_controller::Context::new(
            client.clone(),
            metrics.clone(),
            Some(id.into()),
        ));
        let election = std::sync::Arc::new(LeaderElection::new(
            client.clone(),
            &ns,
            "shardgate-operator",
            id,
            lease,
        ));
        let scope = shardgate_controller::Scope {
            namespace: Some(ns.clone()),
        };
        let task = tokio::spawn(run_as_leader(election, ctx, scope, std::future::pending()));
        (metrics, task)
    };
    let (first, first_task) = start("first");
    eventually(
        "the first replica leads",
        Duration::from_secs(30),
        || async {
            ensure!(first.leader.get() == 1);
            Ok(())
        },
    )
    .await?;
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
    eventually("the standby leads", Duration::from_secs(60), || async {
        ensure!(second.leader.get() == 1);
        Ok(())
    })
    .await?;
    // It reconciles: a change is acted on.
    Api::<ValkeyCluster>::namespaced(client.clone(), &ns)
        .patch(
            "vc",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "config": { "maxmemory-policy": "allkeys-lru" } } })),
        )
        .await?;
    wait_ready(&client, &ns, "vc", FORM).await?;
    ensure!(
        second.reconciles.get() > 0,
        "the new leader did not reconcile"
    );
    eprintln!(
        "standby took over {:?} after the leader died",
        killed.elapsed()
    );
    second_task.abort();
    Ok(())
}

/// A writer that keeps every acknowledged key and counts its errors, until `stop`.
fn writer(
    mut conn: redis::cluster_async::ClusterConnection,
    prefix: &'static str,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<(Vec<String>, u32)> {
    tokio::spawn(async move {
        let (mut acked, mut errors) = (Vec::new(), 0u32);
        let mut i = 0u64;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let key = format!("{prefix}:{i}");
            match conn.set::<_, _, ()>(&key, i).await {
                Ok(()) => acked.push(key),
                Err(_) => errors += 1,
            }
            i += 1;
        }
        (acked, errors)
    })
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

async fn scaling(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = env;
    let operator = Operator::start(&client, &ns);
    create(&client, &ns, &cluster("vc", 3, 1)?).await?;
    wait_ready(&client, &ns, "vc", FORM).await?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let conn = cluster_client(pod_addrs(&client, &ns, "vc").await?.values().copied()).await?;
    let writes = writer(conn, "scale", stop.clone());

    // Shards 3 -> 4: the slots are shared out again, 4096 each, as valkey-cli would.
    let started = Instant::now();
    set_spec(&client, &ns, json!({ "shards": 4 })).await?;
    eventually("4 shards of 4096 slots", FORM, || async {
        let addrs = pod_addrs(&client, &ns, "vc").await?;
        ensure!(addrs.len() == 8, "{} pods", addrs.len());
        let v = views(&addrs).await?;
        let mut counts: Vec<u32> = v
            .values()
            .filter(|l| l.is_primary())
            .map(|l| l.slot_count())
            .collect();
        counts.sort();
        ensure!(
            counts == [4096, 4096, 4096, 4096],
            "slots per primary {counts:?}"
        );
        Ok(())
    })
    .await?;
    wait_ready(&client, &ns, "vc", FORM).await?;
    eprintln!("shards 3 -> 4 rebalanced in {:?}", started.elapsed());

    // Replicas 1 -> 2 -> 1.
    set_spec(&client, &ns, json!({ "replicas": 2 })).await?;
    eventually("12 nodes", FORM, || async {
        ensure!(pod_addrs(&client, &ns, "vc").await?.len() == 12);
        Ok(())
    })
    .await?;
    wait_ready(&client, &ns, "vc", FORM).await?;
    set_spec(&client, &ns, json!({ "replicas": 1 })).await?;
    eventually(
        "back to 8 nodes that know only each other",
        FORM,
        || async {
            let addrs = pod_addrs(&client, &ns, "vc").await?;
            ensure!(addrs.len() == 8, "{} pods", addrs.len());
            for a in addrs.values() {
                let mut c = Admin::connect(*a, Timeouts::default()).await?;
                let n = c.cluster_nodes().await?.len();
                ensure!(n == 8, "{a} knows {n} nodes");
            }
            Ok(())
        },
    )
    .await?;
    let vc = wait_ready(&client, &ns, "vc", FORM).await?;
    let sts = Api::<StatefulSet>::namespaced(client.clone(), &ns)
        .list(&ListParams::default().labels(&format!("{}=vc", labels::INSTANCE)))
        .await?;
    ensure!(sts.items.len() == 8, "{} StatefulSets", sts.items.len());
    ensure!(vc.status.as_ref().is_some_and(|s| s.ready_nodes == 8));

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
