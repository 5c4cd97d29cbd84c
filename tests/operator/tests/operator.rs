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
use shardgate_kube_harness::{yaml_files_in, Fault, Options, Suite, TestEnv};
use shardgate_operator_e2e::{
    cluster_client, condition, create, eventually, pod_addrs, valkey_cluster, wait_ready, Operator,
};

fn main() -> ExitCode {
    let crds = match yaml_files_in(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/crds"),
    ) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("deploy/crds: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    Suite::new()
        .options(Options {
            yaml_files: crds,
            ..Options::default()
        })
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
    for s in Api::<StatefulSet>::namespaced(client.clone(), ns)
        .list(&sel)
        .await?
    {
        out.insert(
            format!("statefulset/{}", s.name_any()),
            s.resource_version().unwrap_or_default(),
        );
    }
    for s in Api::<Service>::namespaced(client.clone(), ns)
        .list(&sel)
        .await?
    {
        out.insert(
            format!("service/{}", s.name_any()),
            s.resource_version().unwrap_or_default(),
        );
    }
    for s in Api::<ConfigMap>::namespaced(client.clone(), ns)
        .list(&sel)
        .await?
    {
        out.insert(
            format!("configmap/{}", s.name_any()),
            s.resource_version().unwrap_or_default(),
        );
    }
    for s in Api::<PodDisruptionBudget>::namespaced(client.clone(), ns)
        .list(&sel)
        .await?
    {
        out.insert(
            format!("pdb/{}", s.name_any()),
            s.resource_version().unwrap_or_default(),
        );
    }
    Ok(out)
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
    for t in ["ClusterFormed"] {
        let c = condition(&vc, t);
        ensure!(c.as_ref().is_some_and(|c| c.0 == "True"), "{t}: {c:?}");
    }

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
