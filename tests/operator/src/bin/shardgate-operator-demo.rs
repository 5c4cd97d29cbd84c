//! The demo of the whole product: a local Kubernetes control plane (the test harness: etcd,
//! kube-apiserver, kube-controller-manager and a node agent that runs pods as local
//! processes on loopback), the ValkeyCluster CRD and the operator (`shardgate-controller`,
//! as a process), a ValkeyCluster in proxy mode (`deploy/samples/valkeycluster-proxy.yaml`),
//! and a cluster client outside Kubernetes that reaches every node through the proxy's one
//! LoadBalancer address.
//!
//! Run it with `scripts/demo` (which installs and builds everything first).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, PostParams};
use kube::ResourceExt;
use redis::AsyncCommands;
use shardgate_crds::valkey_cluster::ValkeyCluster;
use shardgate_harness::valkey::{key_slot, slot_tags};
use shardgate_kube_harness::{ControlPlane, Options};
use shardgate_operator_e2e::{condition, pod_addrs};

const NAMESPACE: &str = "demo";
const SAMPLE: &str = "deploy/samples/valkeycluster-proxy.yaml";

const HELP: &str = "shardgate-operator-demo [--hold]

Starts a local Kubernetes control plane (no containers: pods run as local processes on
loopback IPs), installs the ValkeyCluster CRD, runs the operator, applies
deploy/samples/valkeycluster-proxy.yaml (3 shards x 1 replica, external access through
shardgate-proxy behind one LoadBalancer), waits for it while printing what happens, then
runs a cluster client from outside through the LoadBalancer and stops everything.

  --hold   keep everything up until Enter, with the kubeconfig printed, so that you can
           kubectl get valkeyclusters and connect with redis-cli -c";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{HELP}");
        return Ok(());
    }
    if let Some(other) = args.iter().find(|a| *a != "--hold") {
        bail!("unknown argument {other:?}\n\n{HELP}");
    }
    let hold = !args.is_empty();
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(demo(hold))
}

/// The workspace's root (the demo reads the CRD and the sample from it).
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A binary built next to this one (`cargo build --release` puts them together).
fn sibling(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("current_exe")?;
    let dir = exe.parent().context("the demo's directory")?;
    let path = dir.join(name);
    ensure!(
        path.is_file(),
        "{} not found next to the demo; run scripts/demo (it builds it)",
        path.display()
    );
    Ok(path)
}

async fn demo(hold: bool) -> Result<()> {
    let started = Instant::now();
    println!("== 1. A Kubernetes control plane on loopback (etcd, kube-apiserver, kube-controller-manager,");
    println!("      a node agent that runs pods as local processes), with the ValkeyCluster CRD");
    let crds = shardgate_kube_harness::yaml_files_in(&repo().join("deploy/crds"))?;
    let cp = ControlPlane::start_with(Options {
        yaml_files: crds,
        ..Default::default()
    })
    .await
    .context("starting the control plane (run scripts/setup first?)")?;
    println!(
        "   up in {:.1?}; API server https://{}; kubeconfig {}",
        started.elapsed(),
        cp.api_addr(),
        cp.kubeconfig().display()
    );
    let client = cp.client()?;
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({ "metadata": { "name": NAMESPACE } }))?,
        )
        .await?;

    println!("\n== 2. The operator, shardgate-controller, against that API server");
    let mut operator = Operator::start(&cp)?;
    println!(
        "   pid {}; log {}",
        operator.child.id(),
        operator.log.display()
    );

    println!("\n== 3. kubectl apply -n {NAMESPACE} -f {SAMPLE}");
    let text = std::fs::read_to_string(repo().join(SAMPLE))?;
    let vc: ValkeyCluster = serde_yaml::from_str(&text).context(SAMPLE)?;
    let name = vc.name_any();
    let api: Api<ValkeyCluster> = Api::namespaced(client.clone(), NAMESPACE);
    api.create(&PostParams::default(), &vc).await?;
    let vc = watch_until_ready(&client, &api, &name, &mut operator).await?;
    let status = vc.status.clone().context("status")?;

    println!("\n== 4. status.externalEndpoints: where each node is reached from outside");
    for ep in &status.external_endpoints {
        println!(
            "   shard {} node {}  {:<8}  {}   (Service {})",
            ep.shard,
            ep.node,
            ep.role.map(|r| r.to_string()).unwrap_or_default(),
            ep.address(),
            ep.service
        );
    }
    let bootstrap = status.bootstrap.clone().context("no bootstrap")?;
    println!("   status.bootstrap: {bootstrap}");

    let seeds: Vec<SocketAddr> = bootstrap
        .split(',')
        .map(|a| a.parse().with_context(|| format!("bootstrap {bootstrap}")))
        .collect::<Result<_>>()?;
    let pods = pod_addrs(&client, NAMESPACE, &name).await?;
    client_outside(&seeds, &status.external_endpoints, &pods).await?;

    if hold {
        let kubectl = shardgate_harness::tools::kubectl()?;
        println!("\nEverything is up. Try:");
        println!(
            "   {} --kubeconfig {} -n {NAMESPACE} get valkeyclusters,pods,svc",
            kubectl.display(),
            cp.kubeconfig().display()
        );
        println!(
            "   redis-cli -c -h {} -p {}",
            seeds[0].ip(),
            seeds[0].port()
        );
        println!("(Enter stops the demo)");
        let mut line = String::new();
        std::io::stdin().read_line(&mut line)?;
    }

    println!("\n== 6. Stopping: the operator, then the control plane and every pod");
    operator.stop();
    drop(client);
    tokio::task::spawn_blocking(move || cp.shutdown()).await?;
    println!("   stopped cleanly after {:.0?}", started.elapsed());
    Ok(())
}

/// The operator as a process, logging to a file.
struct Operator {
    child: Child,
    log: PathBuf,
}

impl Operator {
    fn start(cp: &ControlPlane) -> Result<Operator> {
        let log = cp.root().join("shardgate-controller.log");
        let file = std::fs::File::create(&log)?;
        let metrics = SocketAddr::from((
            [127, 0, 0, 1],
            shardgate_harness::addr::free_port([127, 0, 0, 1].into()),
        ));
        let child = Command::new(sibling("shardgate-controller")?)
            .args([
                "--metrics-addr",
                &metrics.to_string(),
                "--log-format",
                "text",
            ])
            .env("KUBECONFIG", cp.kubeconfig())
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .context("starting shardgate-controller")?;
        Ok(Operator { child, log })
    }

    /// Fails with the log's tail if the operator has exited.
    fn check(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            bail!(
                "the operator exited ({status}):\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        Ok(())
    }

    fn stop(&mut self) {
        // SIGTERM: the operator stops its controller and exits.
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Prints the operator's events and the cluster's phase as they change, until it is Ready
/// and reachable from outside.
async fn watch_until_ready(
    client: &kube::Client,
    api: &Api<ValkeyCluster>,
    name: &str,
    operator: &mut Operator,
) -> Result<ValkeyCluster> {
    let events: Api<Event> = Api::namespaced(client.clone(), NAMESPACE);
    let started = Instant::now();
    let mut seen = BTreeSet::new();
    let mut last = String::new();
    loop {
        operator.check()?;
        ensure!(
            started.elapsed() < Duration::from_secs(300),
            "not Ready within 5 minutes; the operator's log: {}",
            operator.log.display()
        );
        let mut list = events.list(&ListParams::default()).await?.items;
        list.sort_by_key(|e| e.metadata.creation_timestamp.clone());
        for e in list {
            let uid = e.metadata.uid.clone().unwrap_or_default();
            if seen.insert(uid) {
                println!(
                    "   [{:>5.1}s] {:<8} {:<22} {}",
                    started.elapsed().as_secs_f64(),
                    e.type_.as_deref().unwrap_or(""),
                    e.reason.as_deref().unwrap_or(""),
                    e.note.as_deref().unwrap_or("")
                );
            }
        }
        let vc = api.get(name).await?;
        let phase = vc
            .status
            .as_ref()
            .and_then(|s| s.phase.map(|p| p.to_string()))
            .unwrap_or_else(|| "Pending".into());
        let ready = vc
            .status
            .as_ref()
            .and_then(|s| s.ready.clone())
            .unwrap_or_default();
        let now = format!("phase {phase}, {ready} nodes ready");
        if now != last {
            println!("   [{:>5.1}s] {now}", started.elapsed().as_secs_f64());
            last = now;
        }
        let up = |c: &str| condition(&vc, c).is_some_and(|c| c.0 == "True");
        let current =
            vc.status.as_ref().and_then(|s| s.observed_generation) == vc.metadata.generation;
        if current && up("Ready") && up("ExternalAccessReady") {
            println!(
                "   [{:>5.1}s] Ready, and reachable from outside",
                started.elapsed().as_secs_f64()
            );
            return Ok(vc);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A cluster client that knows only the bootstrap addresses: the topology it is handed, and
/// where each request went.
async fn client_outside(
    seeds: &[SocketAddr],
    endpoints: &[shardgate_crds::valkey_cluster::ExternalEndpoint],
    pods: &BTreeMap<shardgate_crds::NodeRef, SocketAddr>,
) -> Result<()> {
    println!(
        "\n== 5. A cluster client outside Kubernetes that knows only {}",
        seeds[0]
    );
    let urls: Vec<String> = seeds.iter().map(|a| format!("redis://{a}")).collect();
    let mut conn = redis::cluster::ClusterClientBuilder::new(urls)
        .build()?
        .get_async_connection()
        .await
        .context("cluster client")?;
    let slots: Vec<redis::Value> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(&mut conn)
        .await?;
    println!(
        "   CLUSTER SLOTS as the client sees it (rewritten by the proxy: only the LoadBalancer):"
    );
    for range in &slots {
        let redis::Value::Array(items) = range else {
            continue;
        };
        let int = |v: Option<&redis::Value>| match v {
            Some(redis::Value::Int(i)) => *i,
            _ => -1,
        };
        let addrs: Vec<String> = items
            .iter()
            .skip(2)
            .filter_map(|n| match n {
                redis::Value::Array(f) => match (f.first(), f.get(1)) {
                    (Some(redis::Value::BulkString(ip)), Some(redis::Value::Int(port))) => {
                        Some(format!("{}:{port}", String::from_utf8_lossy(ip)))
                    }
                    _ => None,
                },
                _ => None,
            })
            .collect();
        println!(
            "     slots {:>5}-{:<5} -> {}",
            int(items.first()),
            int(items.get(1)),
            addrs.join(", ")
        );
    }
    // Which node an external address stands for (status.externalEndpoints), and its pod.
    let by_addr: BTreeMap<String, &shardgate_crds::valkey_cluster::ExternalEndpoint> =
        endpoints.iter().map(|e| (e.address(), e)).collect();
    let owner = |slot: u16| -> Option<String> {
        slots.iter().find_map(|range| {
            let redis::Value::Array(items) = range else {
                return None;
            };
            let (Some(redis::Value::Int(a)), Some(redis::Value::Int(b))) =
                (items.first(), items.get(1))
            else {
                return None;
            };
            if !(*a..=*b).contains(&i64::from(slot)) {
                return None;
            }
            match items.get(2) {
                Some(redis::Value::Array(f)) => match (f.first(), f.get(1)) {
                    (Some(redis::Value::BulkString(ip)), Some(redis::Value::Int(port))) => {
                        Some(format!("{}:{port}", String::from_utf8_lossy(ip)))
                    }
                    _ => None,
                },
                _ => None,
            }
        })
    };
    let tags = slot_tags();
    println!("   SET and GET one key per shard:");
    for slot in [100u16, 6000, 12000] {
        let key = format!("{}:demo", tags[usize::from(slot)]);
        let value = format!("written through the LoadBalancer, slot {slot}");
        let _: () = conn.set(&key, &value).await?;
        let back: String = conn.get(&key).await?;
        ensure!(back == value, "read back {back:?}, wrote {value:?}");
        let slot = key_slot(key.as_bytes());
        let via = owner(slot).unwrap_or_else(|| "?".into());
        let node = by_addr
            .get(&via)
            .map(|e| shardgate_crds::NodeRef::new(e.shard as u32, e.node as u32));
        let pod = node
            .and_then(|n| pods.get(&n))
            .map(|a| a.to_string())
            .unwrap_or_default();
        println!(
            "     {key:<14} slot {slot:>5} -> {via} (proxy) -> node {} at pod {pod}",
            node.map(|n| n.to_string()).unwrap_or_else(|| "?".into())
        );
    }
    let keys = shardgate_harness::clients::spread_keys(3000, "demo");
    for k in &keys {
        let _: () = conn.set(k, k).await?;
    }
    for k in &keys {
        let v: String = conn.get(k).await?;
        ensure!(&v == k, "{k} read back {v}");
    }
    println!("   and 3,000 more keys over every slot, all read back");
    Ok(())
}
