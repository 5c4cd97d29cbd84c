//! The proxy reloads as it does under Kubernetes: a pod of the `shardgate-proxy` image whose
//! route file comes from a ConfigMap and whose certificate comes from a Secret, both mounted
//! as volumes that the node agent updates as the kubelet does (the new content in a fresh
//! directory, then the `..data` symlink swapped by rename), behind a LoadBalancer Service. A
//! cluster client writes through the Service while the ConfigMap and the Secret change.
//!
//! The Valkey cluster is the Valkey harness's (local `valkey-server` processes on loopback),
//! not pods: the proxy fronts any cluster it can reach, and what is under test is the
//! reload path, which is the same whoever runs the nodes.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context as _, Result};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use kube::api::{Api, Patch, PatchParams, PostParams};
use redis::AsyncCommands;
use serde_json::json;
use shardgate_crds::NodeRef;
use shardgate_harness::clients::cluster_client_at;
use shardgate_harness::http::metric_value;
use shardgate_harness::tls::{client_config, command, connect, text, TestPki};
use shardgate_harness::valkey::{ClusterSpec, ValkeyCluster};
use shardgate_kube_harness::{Suite, TestEnv};
use shardgate_operator_e2e::{eventually, proxy_binary};
use tokio::sync::watch;

/// Listener ports: shard 0 at 31400 (node 1 at 31401), shard 1 at 31402 (31403).
const BASE: u16 = 31400;
const PORTS_PER_SHARD: u16 = 2;
const TLS_PORT: u16 = 31490;
const ADMIN_PORT: u16 = 9090;
const DOMAIN: &str = "example.test";
/// Long enough for the agent's volume refresh (1 s), the proxy's polls (1 s) and a loaded
/// machine; only a broken reload path reaches it.
const RELOAD: Duration = Duration::from_secs(60);
const FILE_ERRORS: &str = "shardgate_proxy_route_source_errors_total{source=\"file\"}";
const VERSION: &str = "shardgate_proxy_route_table_version";

fn main() -> ExitCode {
    if !std::env::args().any(|a| a == "--list") {
        if let Err(e) = proxy_binary() {
            eprintln!("{e:#}");
            return ExitCode::FAILURE;
        }
    }
    Suite::new()
        .timeout(Duration::from_secs(600))
        .test(
            "proxy_pod_reloads_routes_from_a_configmap_and_its_certificate_from_a_secret_under_traffic",
            reloads,
        )
        .run()
}

/// The route file: every shard's node 0, and its node 1 when `replicas`. An unknown node
/// is left out (the table is what the file says).
fn route_file(cluster: &ValkeyCluster, replicas: bool) -> String {
    let nodes_per_shard = if replicas { 2 } else { 1 };
    let mut out = format!("basePort: {BASE}\nportsPerShard: {PORTS_PER_SHARD}\nshards:\n");
    for s in 0..2u32 {
        let nodes: Vec<String> = (0..nodes_per_shard)
            .map(|n| cluster.node(NodeRef::new(s, n)).addr().to_string())
            .collect();
        out.push_str(&format!("  - nodes: [{}]\n", nodes.join(", ")));
    }
    out
}

/// `GET path` on an admin address, off the runtime's threads (the helper blocks).
async fn http(admin: SocketAddr, path: &str) -> Result<(u16, String)> {
    let path = path.to_string();
    tokio::task::spawn_blocking(move || shardgate_harness::http::get(admin, &path)).await?
}

async fn metrics(admin: SocketAddr) -> Result<String> {
    let (code, body) = http(admin, "/metrics").await?;
    ensure!(code == 200, "/metrics: {code}");
    Ok(body)
}

/// `/routes` as listener port → backend.
async fn routes(admin: SocketAddr) -> Result<BTreeMap<u16, String>> {
    let (_, body) = http(admin, "/routes").await?;
    let table: serde_json::Value = serde_json::from_str(&body).context("/routes JSON")?;
    let mut out = BTreeMap::new();
    for (port, r) in table["routes"].as_object().context("no routes")? {
        let backend = r["backend"].as_str().context("no backend")?;
        out.insert(port.parse()?, backend.to_string());
    }
    Ok(out)
}

fn want_routes(cluster: &ValkeyCluster, replicas: bool) -> BTreeMap<u16, String> {
    let mut want = BTreeMap::new();
    for s in 0..2u16 {
        for n in 0..if replicas { 2u16 } else { 1 } {
            let addr = cluster.node(NodeRef::new(s.into(), n.into())).addr();
            want.insert(BASE + s * PORTS_PER_SHARD + n, addr.to_string());
        }
    }
    want
}

/// What the writer did: keys acknowledged (with their values) and writes that failed after
/// the client's own retries.
#[derive(Default)]
struct Written {
    acked: Vec<(String, u64)>,
    errors: Vec<String>,
}

/// SETs distinct keys through `seed` until `stop`; `acked` counts acknowledgements as they
/// come, so the test can wait for writes after each reload.
async fn writer(
    seed: SocketAddr,
    acked: Arc<AtomicU64>,
    mut stop: watch::Receiver<bool>,
) -> Result<Written> {
    let mut conn = cluster_client_at([seed]).await?;
    let mut out = Written::default();
    for i in 0u64.. {
        if *stop.borrow_and_update() {
            break;
        }
        let key = format!("reload:{i}");
        match conn.set::<_, _, ()>(&key, i).await {
            Ok(()) => {
                out.acked.push((key, i));
                acked.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => out.errors.push(format!("SET {key}: {e}")),
        }
    }
    Ok(out)
}

/// Waits until the writer has `more` acknowledgements past what it had on entry: writes go
/// on after whatever just happened.
async fn writes_go_on(acked: &AtomicU64, more: u64, after: &str) -> Result<()> {
    let from = acked.load(Ordering::Relaxed);
    eventually(
        &format!("{more} acknowledged writes after {after}"),
        RELOAD,
        || async {
            let now = acked.load(Ordering::Relaxed);
            ensure!(now >= from + more, "{} since", now - from);
            Ok(())
        },
    )
    .await
}

async fn reloads(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, cp } = &env;
    let cluster = Arc::new(
        tokio::task::spawn_blocking(|| ValkeyCluster::start(ClusterSpec::new(2, 1))).await??,
    );
    let post = PostParams::default();
    let pki = TestPki::new(DOMAIN)?;
    let first = pki.wildcard("first")?;
    let cms = Api::<ConfigMap>::namespaced(client.clone(), ns);
    cms.create(
        &post,
        &serde_json::from_value(json!({
            "metadata": { "name": "routes" },
            "data": { "routes.yaml": route_file(&cluster, false) },
        }))?,
    )
    .await?;
    let secrets = Api::<Secret>::namespaced(client.clone(), ns);
    secrets
        .create(
            &post,
            &serde_json::from_value(json!({
                "metadata": { "name": "proxy-tls" },
                "type": "kubernetes.io/tls",
                "stringData": { "tls.crt": first.cert_pem, "tls.key": first.key_pem },
            }))?,
        )
        .await?;

    // The Service first: its ingress IP is what the proxy hands out.
    let mut ports: Vec<serde_json::Value> = (0..2 * PORTS_PER_SHARD)
        .map(|i| json!({ "name": format!("node-{i}"), "port": BASE + i, "targetPort": BASE + i }))
        .collect();
    ports.push(json!({ "name": "tls", "port": TLS_PORT, "targetPort": TLS_PORT }));
    let services = Api::<Service>::namespaced(client.clone(), ns);
    services
        .create(
            &post,
            &serde_json::from_value(json!({
                "metadata": { "name": "proxy" },
                "spec": { "type": "LoadBalancer", "selector": { "app": "proxy" }, "ports": ports },
            }))?,
        )
        .await?;
    let ingress: IpAddr = eventually("the Service's ingress IP", RELOAD, || async {
        let svc = services.get("proxy").await?;
        let ip = svc
            .status
            .and_then(|s| s.load_balancer)
            .and_then(|lb| lb.ingress)
            .and_then(|i| i.into_iter().next())
            .and_then(|i| i.ip)
            .context("no ingress IP yet")?;
        Ok(ip.parse()?)
    })
    .await?;
    ensure!(ingress.is_loopback(), "ingress IP {ingress}");

    let container_ports: Vec<serde_json::Value> = (BASE..BASE + 2 * PORTS_PER_SHARD)
        .chain([TLS_PORT, ADMIN_PORT])
        .map(|p| json!({ "containerPort": p }))
        .collect();
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "proxy", "labels": { "app": "proxy" } },
        "spec": {
            "containers": [{
                "name": "proxy",
                "image": "ghcr.io/example/shardgate-proxy:test",
                "args": [
                    "--routes", "/etc/shardgate/routes/routes.yaml",
                    "--routes-poll", "500ms",
                    "--rewrite", "--advertise-host", ingress.to_string(),
                    "--tls-port", TLS_PORT.to_string(),
                    "--sni-prefix", "vc", "--sni-domain", DOMAIN,
                    "--tls-cert", "/etc/shardgate/tls/tls.crt",
                    "--tls-key", "/etc/shardgate/tls/tls.key",
                    "--tls-reload", "500ms",
                ],
                "ports": container_ports,
                "readinessProbe": { "httpGet": { "path": "/readyz", "port": ADMIN_PORT } },
                "volumeMounts": [
                    { "name": "routes", "mountPath": "/etc/shardgate/routes" },
                    { "name": "tls", "mountPath": "/etc/shardgate/tls" },
                ],
            }],
            "volumes": [
                { "name": "routes", "configMap": { "name": "routes" } },
                { "name": "tls", "secret": { "secretName": "proxy-tls" } },
            ],
        },
    }))?;
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    pods.create(&post, &pod).await?;
    let pod_ip: IpAddr = eventually("the proxy pod's IP", RELOAD, || async {
        let p = pods.get("proxy").await?;
        let ip = p.status.and_then(|s| s.pod_ip).context("no IP yet")?;
        Ok(ip.parse()?)
    })
    .await?;
    let admin = SocketAddr::new(pod_ip, ADMIN_PORT);

    let result = under_traffic(&env, &cluster, &pki, ingress, admin).await;
    if result.is_err() {
        if let Ok(dir) = cp.agent().pod_dir(ns, "proxy").await {
            let log = std::fs::read_to_string(dir.join("proxy.log")).unwrap_or_default();
            eprintln!("--- proxy pod log:\n{log}");
        }
    }
    result
}

async fn under_traffic(
    env: &TestEnv,
    cluster: &Arc<ValkeyCluster>,
    pki: &TestPki,
    ingress: IpAddr,
    admin: SocketAddr,
) -> Result<()> {
    let TestEnv { client, ns, .. } = env;
    eventually("the proxy pod ready", RELOAD, || async {
        let (code, body) = http(admin, "/readyz").await?;
        ensure!(code == 200 && body == "ready\n", "{code} {body}");
        Ok(())
    })
    .await?;
    ensure!(
        routes(admin).await? == want_routes(cluster, false),
        "/routes before any reload: {:?}",
        routes(admin).await?
    );
    let seed = SocketAddr::new(ingress, BASE);
    // Through the Service once the kube-controller-manager has published the ready pod.
    eventually("PING through the LoadBalancer", RELOAD, || async {
        let mut c = redis::Client::open(format!("redis://{seed}"))?
            .get_multiplexed_async_connection()
            .await?;
        let pong: String = redis::cmd("PING").query_async(&mut c).await?;
        ensure!(pong == "PONG");
        Ok(())
    })
    .await?;
    // A connection opened before the reloads: a route reload keeps connections in flight.
    let mut held = redis::Client::open(format!("redis://{seed}"))?
        .get_multiplexed_async_connection()
        .await?;
    let trust_first = client_config(&[&pki.ca_pem], None, None);
    let sni = format!("vc-1-0.{DOMAIN}");
    let tls_addr = SocketAddr::new(ingress, TLS_PORT);
    let mut held_tls = eventually("TLS through the LoadBalancer", RELOAD, || {
        connect(tls_addr, &sni, trust_first.clone())
    })
    .await?;

    let acked = Arc::new(AtomicU64::new(0));
    let (stop, stopped) = watch::channel(false);
    let writer = tokio::spawn(writer(seed, acked.clone(), stopped));
    writes_go_on(&acked, 100, "the start").await?;

    // 1. A route file that does not parse: counted, and the table in force is kept.
    let body = metrics(admin).await?;
    let (errors0, version0) = (
        metric_value(&body, FILE_ERRORS)?,
        metric_value(&body, VERSION)?,
    );
    let cms = Api::<ConfigMap>::namespaced(client.clone(), ns);
    let set_routes = |text: String| {
        let cms = cms.clone();
        async move {
            cms.patch(
                "routes",
                &PatchParams::default(),
                &Patch::Merge(json!({ "data": { "routes.yaml": text } })),
            )
            .await
        }
    };
    set_routes("basePort: [\n".into()).await?;
    eventually("the bad route file counted", RELOAD, || async {
        let errors = metric_value(&metrics(admin).await?, FILE_ERRORS)?;
        ensure!(errors > errors0, "{FILE_ERRORS} still {errors}");
        Ok(())
    })
    .await?;
    let body = metrics(admin).await?;
    ensure!(
        metric_value(&body, VERSION)? == version0,
        "the route table changed on a bad file"
    );
    ensure!(
        routes(admin).await? == want_routes(cluster, false),
        "/routes after the bad file: {:?}",
        routes(admin).await?
    );
    writes_go_on(&acked, 50, "the bad route file").await?;

    // 2. The replicas added to the file: their listeners serve them, end to end through the
    //    Service.
    set_routes(route_file(cluster, true)).await?;
    let want = want_routes(cluster, true);
    eventually("the new routes in /routes", RELOAD, || async {
        let got = routes(admin).await?;
        ensure!(got == want, "/routes {got:?}");
        Ok(())
    })
    .await?;
    ensure!(
        metric_value(&metrics(admin).await?, VERSION)? > version0,
        "/routes changed but {VERSION} did not"
    );
    let replica = NodeRef::new(1, 1);
    let replica_id: String = {
        let c = cluster.clone();
        tokio::task::spawn_blocking(move || c.node(replica).query(&["CLUSTER", "MYID"])).await??
    };
    let replica_port = BASE + PORTS_PER_SHARD + 1;
    eventually("the new listener through the Service", RELOAD, || async {
        let mut c = redis::Client::open(format!("redis://{ingress}:{replica_port}"))?
            .get_multiplexed_async_connection()
            .await?;
        let id: String = redis::cmd("CLUSTER")
            .arg("MYID")
            .query_async(&mut c)
            .await?;
        ensure!(id == replica_id, "port {replica_port} answers as {id}");
        Ok(())
    })
    .await?;
    writes_go_on(&acked, 50, "the new routes").await?;

    // 3. The certificate rotated in its Secret, to another CA's: new handshakes get it, the
    //    TLS connection opened before goes on.
    let pki2 = TestPki::new(DOMAIN)?;
    let second = pki2.wildcard("second")?;
    let second_der = second.cert_der()?;
    Api::<Secret>::namespaced(client.clone(), ns)
        .patch(
            "proxy-tls",
            &PatchParams::default(),
            &Patch::Merge(json!({
                "stringData": { "tls.crt": second.cert_pem, "tls.key": second.key_pem },
            })),
        )
        .await?;
    let trust_second = client_config(&[&pki2.ca_pem], None, None);
    eventually("the new certificate served", RELOAD, || async {
        let tls = connect(tls_addr, &sni, trust_second.clone()).await?;
        let served = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .context("no certificate")?;
        ensure!(*served == second_der, "still the first certificate");
        Ok(())
    })
    .await?;
    let mut tls = connect(tls_addr, &sni, trust_second).await?;
    let id = text(&command(&mut tls, &["CLUSTER", "MYID"]).await?);
    let primary_id: String = {
        let c = cluster.clone();
        tokio::task::spawn_blocking(move || c.node(NodeRef::new(1, 0)).query(&["CLUSTER", "MYID"]))
            .await??
    };
    ensure!(
        id == primary_id,
        "SNI vc-1-0 over the new certificate answers as {id}"
    );
    ensure!(
        text(&command(&mut held_tls, &["PING"]).await?) == "PONG",
        "the TLS connection from before the rotation"
    );
    writes_go_on(&acked, 50, "the certificate rotation").await?;

    stop.send_replace(true);
    let written = writer.await??;
    let pong: String = redis::cmd("PING").query_async(&mut held).await?;
    ensure!(
        pong == "PONG",
        "the connection from before the reloads: {pong}"
    );
    // Nothing in a reload touches a listener whose route stays: no write may fail.
    ensure!(
        written.errors.is_empty(),
        "{} of {} writes failed across the reloads: {:?}",
        written.errors.len(),
        written.acked.len() + written.errors.len(),
        &written.errors[..written.errors.len().min(5)]
    );
    let mut check = cluster_client_at([seed]).await?;
    let mut lost = Vec::new();
    for (key, value) in &written.acked {
        let got: Option<u64> = check.get(key).await?;
        if got != Some(*value) {
            lost.push(format!("{key}: {got:?}"));
        }
    }
    ensure!(
        lost.is_empty(),
        "{} of {} acknowledged writes lost: {:?}",
        lost.len(),
        written.acked.len(),
        &lost[..lost.len().min(5)]
    );
    eprintln!(
        "{} writes acknowledged across a bad route file, new routes and a certificate rotation",
        written.acked.len()
    );
    Ok(())
}
