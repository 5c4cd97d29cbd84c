//! The proxy's Kubernetes route source (`shardgate-proxy --kubernetes <ns>/<cluster>`) in
//! front of a cluster the operator runs: first as a local process whose KUBECONFIG reaches
//! the API server through a relay the test can cut, then as a pod of a `shardgate-proxy`
//! image that reaches it as its ServiceAccount (the node agent's stand-in for in-cluster
//! configuration).
//!
//! The proxy binary is built with its `kubernetes` feature before the control plane starts
//! ([`shardgate_operator_e2e::proxy_binary`]).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, PostParams};
use kube::runtime::watcher::{self, watcher, Event};
use kube::Client;
use redis::AsyncCommands;
use serde_json::json;
use shardgate_admin_client::{Client as Admin, Timeouts};
use shardgate_crds::names::objects;
use shardgate_crds::NodeRef;
use shardgate_harness::clients::spread_keys;
use shardgate_harness::http::metric;
use shardgate_harness::proxy_process::ProxyProcess;
use shardgate_kube_harness::{free_loopback_ip, ApiRelay, Fault, TestEnv};
use shardgate_operator_e2e::external::{cluster, slot_addresses, topology_names_only, views, FORM};
use shardgate_operator_e2e::{
    cluster_client, create, eventually, pod_addrs, proxy_binary, wait_ready, Operator,
};

/// The proxy's first listener port, and ports per shard (a 3 x 1 cluster: 30000..=30005).
const BASE: u16 = 30000;
const PORTS_PER_SHARD: u16 = 2;
const ADMIN_PORT: u16 = 9090;
/// A pod IP change must reach `/routes` in well under a second; on two loaded cores (API
/// server, controller manager, operator, six Valkey nodes and the proxy) this bound only
/// catches a broken path, and the measurement is printed.
const ROUTE_LATENCY_BOUND: Duration = Duration::from_secs(5);
const ERRORS: &str = "shardgate_proxy_route_source_errors_total{source=\"kubernetes\"}";
const UP: &str = "shardgate_proxy_route_source_up{source=\"kubernetes\"}";

fn main() -> ExitCode {
    let Some(suite) = shardgate_operator_e2e::suite_with_crds() else {
        return ExitCode::FAILURE;
    };
    // Before the control plane starts, so that the build counts against no test's time.
    if !std::env::args().any(|a| a == "--list") {
        if let Err(e) = proxy_binary() {
            eprintln!("{e:#}");
            return ExitCode::FAILURE;
        }
    }
    suite
        .timeout(Duration::from_secs(900))
        .test(
            "proxy_kubernetes_source_follows_pods_and_outlives_the_api_server",
            follows_pods,
        )
        .run()
}

/// `GET path` on an admin address, off the runtime's threads (the helper blocks).
async fn http(admin: SocketAddr, path: &str) -> Result<(u16, String)> {
    let path = path.to_string();
    tokio::task::spawn_blocking(move || shardgate_harness::http::get(admin, &path)).await?
}

/// `/routes` as listener port → (backend, node id).
async fn routes(admin: SocketAddr) -> Result<BTreeMap<u16, (String, Option<String>)>> {
    let (_, body) = http(admin, "/routes").await?;
    let table: serde_json::Value = serde_json::from_str(&body).context("/routes JSON")?;
    let mut out = BTreeMap::new();
    for (port, r) in table["routes"].as_object().context("no routes")? {
        out.insert(
            port.parse()?,
            (
                r["backend"].as_str().context("no backend")?.to_string(),
                r["node_id"].as_str().map(str::to_string),
            ),
        );
    }
    Ok(out)
}

fn port_of(node: NodeRef) -> u16 {
    BASE + node.shard.0 as u16 * PORTS_PER_SHARD + node.node.0 as u16
}

/// Every route names its pod's address and its node's id.
async fn routes_match(
    admin: SocketAddr,
    pods: &BTreeMap<NodeRef, SocketAddr>,
    ids: &BTreeMap<NodeRef, String>,
) -> Result<()> {
    let got = routes(admin).await?;
    let want: BTreeMap<u16, (String, Option<String>)> = pods
        .iter()
        .map(|(n, a)| (port_of(*n), (a.to_string(), ids.get(n).cloned())))
        .collect();
    ensure!(got == want, "/routes {got:?}, want {want:?}");
    Ok(())
}

/// The listener addresses of the proxy at `ip`.
fn proxy_addrs(ip: IpAddr, pods: &BTreeMap<NodeRef, SocketAddr>) -> BTreeSet<String> {
    pods.keys()
        .map(|n| SocketAddr::new(ip, port_of(*n)).to_string())
        .collect()
}

/// [`topology_names_only`] once CLUSTER SLOTS asked at `seed` names every node again (a
/// node that just restarted is left out for a moment); an address that is not the proxy's
/// fails at once, in any of the replies before.
async fn settled_topology_names_only(
    seed: SocketAddr,
    allowed: &BTreeSet<String>,
    pod_ips: &BTreeSet<String>,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut direct = redis::Client::open(format!("redis://{seed}"))?
            .get_multiplexed_async_connection()
            .await?;
        let slots: redis::Value = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut direct)
            .await?;
        let named = slot_addresses(&slots)?;
        for a in &named {
            ensure!(
                allowed.contains(a),
                "CLUSTER SLOTS names {a}: not the proxy's"
            );
        }
        if named.len() >= allowed.len() {
            return topology_names_only(seed, allowed, pod_ips).await;
        }
        if Instant::now() > deadline {
            bail!("CLUSTER SLOTS still names only {named:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// SET then GET of `n` keys over every slot through `conn`.
async fn set_get(
    conn: &mut redis::cluster_async::ClusterConnection,
    n: usize,
    tag: &str,
) -> Result<()> {
    let keys = spread_keys(n, tag);
    for k in &keys {
        let _: () = conn.set(k, k).await.with_context(|| format!("SET {k}"))?;
    }
    for k in &keys {
        let v: String = conn.get(k).await.with_context(|| format!("GET {k}"))?;
        ensure!(&v == k, "{k} read back {v}");
    }
    Ok(())
}

/// The pod's IP in the API, as a watch shows it: the instant its IP is no longer `old`.
/// `listed` is sent once the watch has its first list (so that the fault comes after).
async fn new_ip_seen(
    client: Client,
    ns: String,
    pod: String,
    old: IpAddr,
    listed: tokio::sync::oneshot::Sender<()>,
) -> Result<(Instant, IpAddr)> {
    let api: Api<Pod> = Api::namespaced(client, &ns);
    let config = watcher::Config::default().fields(&format!("metadata.name={pod}"));
    let mut stream = std::pin::pin!(watcher(api, config));
    let mut listed = Some(listed);
    while let Some(event) = stream.next().await {
        let pod = match event? {
            Event::InitDone => {
                if let Some(tx) = listed.take() {
                    let _ = tx.send(());
                }
                continue;
            }
            Event::Apply(p) | Event::InitApply(p) => p,
            _ => continue,
        };
        let ip = pod
            .status
            .and_then(|s| s.pod_ip)
            .and_then(|ip| ip.parse().ok());
        if let Some(ip) = ip.filter(|ip| *ip != old) {
            return Ok((Instant::now(), ip));
        }
    }
    bail!("the watch of pod {pod} ended")
}

/// Polls `/routes` until `port` routes to `want`; the instant it did.
fn route_seen(admin: SocketAddr, port: u16, want: String, timeout: Duration) -> Result<Instant> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok((200, body)) = shardgate_harness::http::get(admin, "/routes") {
            let table: serde_json::Value = serde_json::from_str(&body)?;
            if table["routes"][port.to_string()]["backend"].as_str() == Some(want.as_str()) {
                return Ok(Instant::now());
            }
        }
        if Instant::now() > deadline {
            bail!("/routes: port {port} not routed to {want} within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Moves the pod of `node` to a new IP and measures how long after the API shows the new
/// IP the proxy's `/routes` does, which must be within `bound`; returns the node's new
/// address.
async fn move_and_measure(
    env: &TestEnv,
    admin: SocketAddr,
    node: NodeRef,
    old: SocketAddr,
    what: &str,
    bound: Duration,
) -> Result<SocketAddr> {
    let pod = format!("{}-0", objects::node("vc", node));
    let (listed_tx, listed_rx) = tokio::sync::oneshot::channel();
    let seen = tokio::spawn(new_ip_seen(
        env.client.clone(),
        env.ns.clone(),
        pod.clone(),
        old.ip(),
        listed_tx,
    ));
    listed_rx.await.context("the pod watch stopped")?;
    let faulted = Instant::now();
    env.cp
        .agent()
        .fault(&env.ns, &pod, Fault::RestartWithNewIp)
        .await?;
    let (in_api, ip) = tokio::time::timeout(Duration::from_secs(60), seen)
        .await
        .context("no new IP in the API within 60 s")???;
    let new = SocketAddr::new(ip, old.port());
    let want = new.to_string();
    let port = port_of(node);
    let in_routes = tokio::task::spawn_blocking(move || {
        route_seen(admin, port, want, bound + Duration::from_secs(30))
    })
    .await??;
    let latency = in_routes.saturating_duration_since(in_api);
    eprintln!(
        "{what}: pod {pod} {old} -> {new}: in the API {:?} after the fault, in /routes {latency:?} \
         later{}",
        in_api - faulted,
        if in_routes < in_api {
            " (the proxy's watch saw it before the test's)"
        } else {
            ""
        }
    );
    ensure!(
        latency < bound,
        "{what}: the new IP reached /routes {latency:?} after the API showed it"
    );
    Ok(new)
}

async fn follows_pods(env: TestEnv) -> Result<()> {
    let operator = Operator::start(&env.client, &env.ns);
    create(&env.client, &env.ns, &cluster("vc", 3, 1)?).await?;
    wait_ready(&env.client, &env.ns, "vc", FORM).await?;

    // The API server behind a relay, cut from the start: the proxy is not ready before its
    // first table.
    let relay = ApiRelay::start(env.cp.api_addr()).await?;
    relay.cut();
    let kubeconfig: PathBuf = env.cp.root().join(format!("{}-proxy.kubeconfig", env.ns));
    let text = std::fs::read_to_string(env.cp.kubeconfig())?;
    let api = format!("https://{}", env.cp.api_addr());
    ensure!(
        text.contains(&api),
        "the harness's kubeconfig names no {api}"
    );
    std::fs::write(
        &kubeconfig,
        text.replace(&api, &format!("https://{}", relay.addr())),
    )?;
    let mut ports: Vec<u16> = (BASE..BASE + 3 * PORTS_PER_SHARD).collect();
    ports.push(ADMIN_PORT);
    let ip = free_loopback_ip(&ports)?;
    let admin = SocketAddr::new(ip, ADMIN_PORT);
    let args: Vec<String> = [
        "--kubernetes",
        &format!("{}/vc", env.ns),
        "--base-port",
        &BASE.to_string(),
        "--ports-per-shard",
        &PORTS_PER_SHARD.to_string(),
        "--rewrite",
        "--advertise-host",
        &ip.to_string(),
        "--listen-ip",
        &ip.to_string(),
        "--admin-addr",
        &admin.to_string(),
        "--kube-watch-timeout",
        "4s",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let proxy = ProxyProcess::spawn_with_env(
        &proxy_binary()?,
        &args,
        &[("KUBECONFIG", kubeconfig.as_os_str())],
        Some(admin),
    )?;
    let result = async {
        through_the_proxy(&env, &relay, ip, admin).await?;
        as_a_pod(&env).await
    }
    .await;
    if result.is_err() {
        eprintln!("--- proxy log:\n{}", proxy.log());
    }
    drop(proxy);
    operator.stop().await;
    result
}

async fn through_the_proxy(
    env: &TestEnv,
    relay: &ApiRelay,
    ip: IpAddr,
    admin: SocketAddr,
) -> Result<()> {
    let (code, body) = eventually("/readyz saying why", Duration::from_secs(60), || async {
        let (code, body) = http(admin, "/readyz").await?;
        ensure!(body.contains("failing"), "{code} {body}");
        Ok((code, body))
    })
    .await?;
    ensure!(
        code == 503
            && body.contains("no route table loaded yet")
            && body.contains("route source kubernetes failing"),
        "before the first table: {code} {body}"
    );
    let restored = Instant::now();
    relay.restore();
    eventually("/readyz ready", Duration::from_secs(60), || async {
        let (code, body) = http(admin, "/readyz").await?;
        ensure!(code == 200 && body == "ready\n", "{code} {body}");
        Ok(())
    })
    .await?;
    eprintln!(
        "first table {:?} after the API server came back",
        restored.elapsed()
    );

    // Every node at its port, with its id (asked of the nodes beside the watch).
    let pods = pod_addrs(&env.client, &env.ns, "vc").await?;
    ensure!(pods.len() == 6, "pods: {pods:?}");
    let lines = views(&pods).await?;
    let ids: BTreeMap<NodeRef, String> = lines.iter().map(|(n, l)| (*n, l.id.clone())).collect();
    eventually(
        "/routes with every node and id",
        Duration::from_secs(30),
        || routes_match(admin, &pods, &ids),
    )
    .await?;

    // A cluster client that knows only the proxy's first port, and topology naming only
    // the proxy.
    let allowed = proxy_addrs(ip, &pods);
    let pod_ips = |pods: &BTreeMap<NodeRef, SocketAddr>| -> BTreeSet<String> {
        pods.values().map(|a| a.ip().to_string()).collect()
    };
    let first = SocketAddr::new(ip, BASE);
    let started = Instant::now();
    let mut conn = cluster_client([first]).await?;
    set_get(&mut conn, 10_000, "k8s").await?;
    eprintln!(
        "10,000 SET and GET through the proxy in {:.1?}",
        started.elapsed()
    );
    topology_names_only(first, &allowed, &pod_ips(&pods)).await?;

    // A replica's pod moves; a connection to another node stays open across the swap.
    let (&moved, _) = lines
        .iter()
        .find(|(n, l)| n.shard.0 == 1 && !l.is_primary())
        .context("shard 1's replica")?;
    let other = NodeRef::new(0, 0);
    let mut held = Admin::connect(SocketAddr::new(ip, port_of(other)), Timeouts::default()).await?;
    let held_id = held.command(["CLIENT", "ID"]).await?;
    let new_addr = move_and_measure(
        env,
        admin,
        moved,
        pods[&moved],
        "pod IP change",
        ROUTE_LATENCY_BOUND,
    )
    .await?;
    let mut moved_pods = pods.clone();
    moved_pods.insert(moved, new_addr);
    // The node keeps its id (its nodes.conf came along), and the proxy learns it there.
    eventually("/routes after the move", Duration::from_secs(30), || {
        routes_match(admin, &moved_pods, &ids)
    })
    .await?;
    ensure!(
        held.command(["CLIENT", "ID"]).await? == held_id,
        "the connection to node {other} was not kept across the table swap"
    );
    set_get(&mut conn, 1_000, "moved").await?;
    // Other nodes may still name the moved node at its old address: the id maps it.
    let old_and_new: BTreeSet<String> = pod_ips(&pods)
        .union(&pod_ips(&moved_pods))
        .cloned()
        .collect();
    settled_topology_names_only(first, &allowed, &old_and_new).await?;

    // The API server cut: the last table stays, ready, with the failure shown and counted.
    let metrics = || async {
        let (_, m) = http(admin, "/metrics").await?;
        Ok::<_, anyhow::Error>((metric(&m, ERRORS).unwrap_or(0.0), metric(&m, UP)))
    };
    let (errors_before, up) = metrics().await?;
    ensure!(up == Some(1.0), "{UP} {up:?} before the cut");
    let cut = Instant::now();
    relay.cut();
    let detail = eventually(
        "/readyz saying the source fails",
        Duration::from_secs(60),
        || async {
            let (code, body) = http(admin, "/readyz").await?;
            ensure!(code == 200, "{code} {body}");
            ensure!(body.contains("route source kubernetes failing"), "{body}");
            Ok(body)
        },
    )
    .await?;
    eprintln!(
        "API server cut; /readyz after {:?}: {}",
        cut.elapsed(),
        detail.trim()
    );
    let (errors, up) = metrics().await?;
    ensure!(
        errors > errors_before,
        "{ERRORS} {errors} (was {errors_before})"
    );
    ensure!(up == Some(0.0), "{UP} {up:?} while cut");
    set_get(&mut conn, 1_000, "cut").await?;
    topology_names_only(first, &allowed, &pod_ips(&moved_pods)).await?;
    routes_match(admin, &moved_pods, &ids).await?;
    let cut_for = cut.elapsed();

    let restored = Instant::now();
    relay.restore();
    eventually(
        "/readyz without the failure",
        Duration::from_secs(60),
        || async {
            let (code, body) = http(admin, "/readyz").await?;
            ensure!(code == 200 && body == "ready\n", "{code} {body}");
            Ok(())
        },
    )
    .await?;
    let (errors_after, up) = metrics().await?;
    eprintln!(
        "API server back after a {cut_for:.1?} cut; the source recovered {:.1?} later, \
         {} watch errors counted",
        restored.elapsed(),
        errors_after - errors_before
    );
    ensure!(up == Some(1.0), "{UP} {up:?} after the cut");
    // One error per relist attempt, the attempts backing off (250 ms doubling to 10 s).
    ensure!(
        errors_after - errors_before <= 15.0,
        "{} errors for a {cut_for:?} cut",
        errors_after - errors_before
    );

    // Watching again: another pod moves, and the proxy follows.
    let (&moved2, _) = lines
        .iter()
        .find(|(n, l)| n.shard.0 == 2 && !l.is_primary())
        .context("shard 2's replica")?;
    let new2 = move_and_measure(
        env,
        admin,
        moved2,
        pods[&moved2],
        "pod IP change after the cut",
        ROUTE_LATENCY_BOUND,
    )
    .await?;
    moved_pods.insert(moved2, new2);
    eventually(
        "/routes after the second move",
        Duration::from_secs(30),
        || routes_match(admin, &moved_pods, &ids),
    )
    .await?;
    set_get(&mut conn, 1_000, "after").await?;
    let (errors_end, _) = metrics().await?;
    ensure!(
        errors_end == errors_after,
        "errors counted after the recovery: {errors_end} (was {errors_after})"
    );
    wait_ready(&env.client, &env.ns, "vc", FORM).await?;

    // The proxy's connections to the API server fall silent (new ones get through): its
    // watch, renewed every 4 s (--kube-watch-timeout), is dropped 5 s past that, and the
    // next move reaches /routes (kube's default would wait out the silent watch for 295 s).
    let (&moved3, _) = lines
        .iter()
        .find(|(n, l)| n.shard.0 == 0 && !l.is_primary())
        .context("shard 0's replica")?;
    let swallowed = relay.swallowed();
    relay.silence_open_connections();
    let new3 = move_and_measure(
        env,
        admin,
        moved3,
        pods[&moved3],
        "pod IP change once the API connections fell silent",
        Duration::from_secs(20),
    )
    .await?;
    ensure!(
        relay.swallowed() > swallowed,
        "nothing met the silence: the proxy's watch was not on the silenced connections"
    );
    moved_pods.insert(moved3, new3);
    eventually(
        "/routes after the move past the silence",
        Duration::from_secs(30),
        || routes_match(admin, &moved_pods, &ids),
    )
    .await?;
    wait_ready(&env.client, &env.ns, "vc", FORM).await?;
    Ok(())
}

/// The same proxy as a pod of a `shardgate-proxy` image with a ServiceAccount allowed to
/// watch pods: the node agent runs the binary with a kubeconfig of the pod's mapped token
/// and CA, where a real pod would use in-cluster configuration.
async fn as_a_pod(env: &TestEnv) -> Result<()> {
    let ns = &env.ns;
    let client = &env.client;
    let post = PostParams::default();
    let sa: ServiceAccount = serde_json::from_value(json!({
        "metadata": { "name": "shardgate-proxy" },
    }))?;
    Api::<ServiceAccount>::namespaced(client.clone(), ns)
        .create(&post, &sa)
        .await?;
    let role: Role = serde_json::from_value(json!({
        "metadata": { "name": "shardgate-proxy" },
        "rules": [{ "apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"] }],
    }))?;
    Api::<Role>::namespaced(client.clone(), ns)
        .create(&post, &role)
        .await?;
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": { "name": "shardgate-proxy" },
        "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "shardgate-proxy" },
        "subjects": [{ "kind": "ServiceAccount", "name": "shardgate-proxy", "namespace": ns }],
    }))?;
    Api::<RoleBinding>::namespaced(client.clone(), ns)
        .create(&post, &binding)
        .await?;
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "proxy" },
        "spec": {
            "serviceAccountName": "shardgate-proxy",
            "containers": [{
                "name": "proxy",
                "image": "ghcr.io/example/shardgate-proxy:test",
                "args": [
                    "--kubernetes", format!("{ns}/vc"),
                    "--base-port", BASE.to_string(),
                    "--ports-per-shard", PORTS_PER_SHARD.to_string(),
                    "--rewrite",
                ],
            }],
        },
    }))?;
    let pods_api = Api::<Pod>::namespaced(client.clone(), ns);
    pods_api.create(&post, &pod).await?;
    let ip: IpAddr = eventually("the proxy pod's IP", Duration::from_secs(60), || async {
        let p = pods_api.get("proxy").await?;
        let ip = p.status.and_then(|s| s.pod_ip).context("no IP yet")?;
        Ok(ip.parse()?)
    })
    .await?;
    let admin = SocketAddr::new(ip, ADMIN_PORT);
    let result = async {
        eventually("the proxy pod ready", Duration::from_secs(60), || async {
            let (code, body) = http(admin, "/readyz").await?;
            ensure!(code == 200 && body == "ready\n", "{code} {body}");
            Ok(())
        })
        .await?;
        let dir = env.cp.agent().pod_dir(ns, "proxy").await?;
        ensure!(
            dir.join("proxy.kubeconfig").is_file(),
            "no kubeconfig in {}",
            dir.display()
        );
        let pods = pod_addrs(client, ns, "vc").await?;
        let ids: BTreeMap<NodeRef, String> = views(&pods)
            .await?
            .into_iter()
            .map(|(n, l)| (n, l.id))
            .collect();
        eventually("the proxy pod's /routes", Duration::from_secs(30), || {
            routes_match(admin, &pods, &ids)
        })
        .await?;
        let first = SocketAddr::new(ip, BASE);
        let mut conn = cluster_client([first]).await?;
        set_get(&mut conn, 1_000, "pod").await?;
        let allowed = proxy_addrs(ip, &pods);
        let pod_ips = pods.values().map(|a| a.ip().to_string()).collect();
        topology_names_only(first, &allowed, &pod_ips).await
    }
    .await;
    if result.is_err() {
        if let Ok(dir) = env.cp.agent().pod_dir(ns, "proxy").await {
            let log = std::fs::read_to_string(dir.join("proxy.log")).unwrap_or_default();
            eprintln!("--- proxy pod log:\n{log}");
        }
    }
    result
}
