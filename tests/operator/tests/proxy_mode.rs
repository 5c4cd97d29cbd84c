//! Proxy mode end to end: the operator runs shardgate-proxy (as pods of the harness's node
//! agent, the workspace's binary) behind one LoadBalancer Service (the harness hands out a
//! loopback ingress IP), and clients outside reach every node through it, while clients at
//! the pod network still see pod IPs.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _, Result};
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use shardgate_admin_client::{Client as Admin, Timeouts};
use shardgate_controller::metrics::ErrorLabels;
use shardgate_crds::names::objects;
use shardgate_crds::valkey_cluster::ValkeyCluster;
use shardgate_crds::NodeRef;
use shardgate_harness::clients::{cli, redis_benchmark_cluster, redis_py_set_get};
use shardgate_kube_harness::{Fault, TestEnv};
use shardgate_operator_e2e::external::{
    bootstrap_seeds, external_cluster, failovers_under_load, only_external_addresses, proxy_access,
    redis_cli_set_get, wait_external_ready, FORM,
};
use shardgate_operator_e2e::{cluster_client, condition, create, eventually, pod_addrs, Operator};

fn main() -> ExitCode {
    let Some(suite) = shardgate_operator_e2e::suite_with_crds() else {
        return ExitCode::FAILURE;
    };
    // The proxy pods run the workspace's binary, with its `kubernetes` feature: built (or
    // found) before the control plane starts.
    if !std::env::args().any(|a| a == "--list") {
        if let Err(e) = shardgate_operator_e2e::proxy_binary() {
            eprintln!("{e:#}");
            return ExitCode::FAILURE;
        }
    }
    suite
        .timeout(Duration::from_secs(600))
        .test(
            "proxy_mode_outside_clients_see_only_the_load_balancer_and_inside_ones_pod_ips",
            outside_and_inside,
        )
        .test(
            "proxy_mode_failovers_and_a_pod_at_a_new_ip_under_load",
            faults,
        )
        .test(
            "proxy_mode_tls_port_routes_by_sni_and_hands_out_sni_names",
            tls_port,
        )
        .test(
            "proxy_mode_nodes_on_tls_serve_plain_and_terminated_clients_outside",
            tls_nodes,
        )
        .test(
            "proxy_mode_shards_3_to_4_under_an_outside_writer_lose_nothing",
            scale_out,
        )
        .test(
            "proxy_mode_off_deletes_every_proxy_object_before_a_proxy_ran_and_past_a_refused_delete",
            mode_off,
        )
        .run()
}

async fn outside_and_inside(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = &env;
    let operator = Operator::start(client, ns);
    let started = Instant::now();
    let base = 32500u16;
    create(
        client,
        ns,
        &external_cluster("vc", 3, 1, proxy_access(base))?,
    )
    .await?;
    let vc = wait_external_ready(client, ns, "vc").await?;
    eprintln!(
        "3x1 cluster behind the proxy Ready in {:?}",
        started.elapsed()
    );
    let status = vc.status.clone().context("status")?;

    // The proxy's objects, as a user would look at them.
    let name = "vc-proxy";
    let svc = Api::<Service>::namespaced(client.clone(), ns)
        .get(name)
        .await?;
    let spec = svc.spec.clone().unwrap_or_default();
    ensure!(spec.type_.as_deref() == Some("LoadBalancer"), "{spec:?}");
    let ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .and_then(|i| i.first())
        .and_then(|i| i.ip.clone())
        .context("no ingress")?;
    let deployment = Api::<Deployment>::namespaced(client.clone(), ns)
        .get(name)
        .await?;
    let ready = deployment.status.as_ref().and_then(|s| s.ready_replicas);
    ensure!(
        ready == Some(1),
        "proxy Deployment ready replicas {ready:?}"
    );

    // status: every node at the ingress, at basePort + flatIndex.
    ensure!(status.external_endpoints.len() == 6, "{status:?}");
    for ep in &status.external_endpoints {
        let flat = ep.shard * 2 + ep.node;
        ensure!(
            ep.host == ingress && ep.port == i32::from(base) + flat && ep.service == name,
            "{ep:?}"
        );
    }
    let seeds = bootstrap_seeds(&vc)?;

    // From outside: the Rust cluster client (10,000 SET/GET, and SLOTS/NODES/SHARDS name only
    // the load balancer), redis-cli -c, redis-benchmark --cluster and redis-py.
    only_external_addresses(client, ns, "vc", &status, 10_000).await?;
    let seed = seeds[0];
    tokio::task::spawn_blocking(move || redis_cli_set_get(seed, 10_000)).await??;
    tokio::task::spawn_blocking(move || redis_benchmark_cluster(seed, 10_000)).await??;
    let learned = tokio::task::spawn_blocking(move || redis_py_set_get(seed, 10_000)).await??;
    let external: BTreeSet<String> = status
        .external_endpoints
        .iter()
        .map(|e| e.address())
        .collect();
    ensure!(
        learned.iter().cloned().collect::<BTreeSet<_>>() == external,
        "redis-py learned {learned:?}, not {external:?}"
    );
    // RESP3 too: CLUSTER SHARDS and CLUSTER SLOTS asked with redis-cli -3 through the proxy
    // name the load balancer, never a pod.
    let pods = pod_addrs(client, ns, "vc").await?;
    for what in ["SHARDS", "SLOTS"] {
        let (host, port) = (seed.ip().to_string(), seed.port().to_string());
        let text = tokio::task::spawn_blocking(move || {
            cli(&["-3", "-h", &host, "-p", &port, "CLUSTER", what])
        })
        .await??;
        // Whole words (redis-cli prints one field per line): an address, not a prefix of
        // another.
        let words: BTreeSet<&str> = text.split_whitespace().collect();
        ensure!(
            words.contains(ingress.as_str()),
            "RESP3 CLUSTER {what}: {text}"
        );
        for addr in pods.values() {
            let ip = addr.ip().to_string();
            ensure!(
                !words.contains(ip.as_str()),
                "RESP3 CLUSTER {what} names the pod {addr}: {text}"
            );
        }
    }

    // From inside (a client at the pod network): the same cluster hands out pod IPs.
    let inside = *pods.values().next().context("no pod")?;
    let mut admin = Admin::connect(inside, Timeouts::default()).await?;
    let pod_ips: BTreeSet<String> = pods.values().map(|a| a.ip().to_string()).collect();
    for line in admin.cluster_nodes().await? {
        ensure!(
            pod_ips.contains(&line.ip),
            "inside, CLUSTER NODES names {}",
            line.ip
        );
    }
    let mut inner = cluster_client(pods.values().copied()).await?;
    for k in shardgate_harness::clients::spread_keys(100, "in") {
        let _: () = redis::AsyncCommands::set(&mut inner, &k, &k).await?;
    }
    operator.stop().await;
    Ok(())
}

/// Through the proxy: a manual failover and a killed primary under load, then a pod at a
/// new IP; the client outside keeps working.
async fn faults(env: TestEnv) -> Result<()> {
    let operator = Operator::start(&env.client, &env.ns);
    let base = 32600u16;
    create(
        &env.client,
        &env.ns,
        &external_cluster("vc", 3, 1, proxy_access(base))?,
    )
    .await?;
    let vc = wait_external_ready(&env.client, &env.ns, "vc").await?;
    let seeds = bootstrap_seeds(&vc)?;
    failovers_under_load(&env, &seeds, "proxy").await?;

    // A replica's pod comes back at a new IP: the proxy's route source follows it, and a
    // client outside reads every key again.
    let before = pod_addrs(&env.client, &env.ns, "vc").await?;
    let moved = NodeRef::new(0, 1);
    let pod = format!("{}-0", objects::node("vc", moved));
    let mut conn = cluster_client(seeds.iter().copied()).await?;
    let keys = shardgate_harness::clients::spread_keys(300, "ip");
    for k in &keys {
        let _: () = redis::AsyncCommands::set(&mut conn, k, k).await?;
    }
    env.cp
        .agent()
        .fault(&env.ns, &pod, Fault::RestartWithNewIp)
        .await?;
    let at = eventually("a new pod IP", Duration::from_secs(60), || async {
        let a = pod_addrs(&env.client, &env.ns, "vc").await?;
        ensure!(a[&moved] != before[&moved], "still {}", a[&moved]);
        Ok(a[&moved])
    })
    .await?;
    // The node answers through its proxy port (flat index 1), at its new pod.
    let through: SocketAddr = SocketAddr::new(seeds[0].ip(), base + 1);
    eventually("the moved node through the proxy", FORM, || async {
        let mut c = Admin::connect(through, Timeouts::default()).await?;
        let info = c.command(["CLIENT", "INFO"]).await?;
        let text = format!("{info:?}");
        ensure!(text.contains(&format!("laddr={at}")), "{text}");
        Ok(())
    })
    .await?;
    for k in &keys {
        let v: String = redis::AsyncCommands::get(&mut conn, k).await?;
        ensure!(&v == k, "{k} read back {v}");
    }
    operator.stop().await;
    Ok(())
}

/// `proxy.tls` (terminate): one TLS port on the LoadBalancer, routed by SNI name, the
/// certificate from a Secret; a TLS client is handed the nodes' SNI names.
async fn tls_port(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = &env;
    let domain = "example.test";
    let pki = shardgate_harness::tls::TestPki::new(domain)?;
    let cert = pki.wildcard("proxy")?;
    tls_secret(client, ns, "vc-tls", &cert).await?;
    let operator = Operator::start(client, ns);
    let (base, tls) = (32700u16, 32790u16);
    let external = json!({
        "enabled": true,
        "mode": "proxy",
        "domain": domain,
        "proxy": {
            "replicas": 1,
            "basePort": base,
            "tls": { "port": tls, "secretName": "vc-tls", "mode": "terminate" },
        },
    });
    create(client, ns, &external_cluster("vc", 2, 1, external)?).await?;
    let vc = wait_external_ready(client, ns, "vc").await?;
    let status = vc.status.clone().context("status")?;
    for ep in &status.external_endpoints {
        let want = format!("vc-{}-{}.{domain}", ep.shard, ep.node);
        ensure!(ep.hostname.as_deref() == Some(want.as_str()), "{ep:?}");
    }
    let ingress = status.external_endpoints[0].host.clone();
    let pods = pod_addrs(client, ns, "vc").await?;
    let ca = pki.ca.display().to_string();
    let tls_cli =
        |sni: String, args: Vec<String>| redis_cli_sni(ca.clone(), ingress.clone(), tls, sni, args);
    // The SNI name picks the node: its own id answers.
    let node = NodeRef::new(1, 0);
    let mut admin = Admin::connect(pods[&node], Timeouts::default()).await?;
    let id = admin.cluster_myid().await?;
    let got = tls_cli(
        format!("vc-1-0.{domain}"),
        vec!["CLUSTER".into(), "MYID".into()],
    )
    .await?;
    ensure!(
        got == id,
        "CLUSTER MYID over SNI vc-1-0: {got}, node 1-0 is {id}"
    );
    // Topology over TLS names the SNI names at the TLS port, never a pod.
    let slots = tls_cli(
        format!("vc-0-0.{domain}"),
        vec!["CLUSTER".into(), "SLOTS".into()],
    )
    .await?;
    for n in ["vc-0-0", "vc-1-0"] {
        ensure!(
            slots.contains(&format!("{n}.{domain}")),
            "CLUSTER SLOTS over TLS: {slots}"
        );
    }
    ensure!(
        slots.contains(&tls.to_string()),
        "CLUSTER SLOTS over TLS: {slots}"
    );
    for a in pods.values() {
        ensure!(
            !slots.contains(&format!("{}\n", a.ip())),
            "names the pod {a}: {slots}"
        );
    }
    sni_redirect(&ca, &ingress, tls, domain, "tls").await?;

    // The certificate rotated in its Secret (another CA's): the proxy presents it without
    // restarting (the mounted files change; the proxy reloads them).
    let proxy_pods = || async {
        let pods = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), ns)
            .list(&kube::api::ListParams::default().labels("shardgate.io/component=proxy"))
            .await?;
        Ok::<Vec<(String, i32)>, anyhow::Error>(
            pods.items
                .iter()
                .map(|p| {
                    let restarts = p
                        .status
                        .as_ref()
                        .and_then(|s| s.container_statuses.as_ref())
                        .map(|c| c.iter().map(|c| c.restart_count).sum())
                        .unwrap_or(0);
                    (kube::ResourceExt::name_any(p), restarts)
                })
                .collect(),
        )
    };
    let before = proxy_pods().await?;
    let pki2 = shardgate_harness::tls::TestPki::new(domain)?;
    let cert2 = pki2.wildcard("proxy2")?;
    Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client.clone(), ns)
        .patch(
            "vc-tls",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({
                "stringData": { "tls.crt": cert2.cert_pem, "tls.key": cert2.key_pem },
            })),
        )
        .await?;
    let ca2 = pki2.ca.display().to_string();
    let host = ingress.clone();
    let rotated = Instant::now();
    eventually("the rotated certificate served", FORM, || {
        let (ca2, host) = (ca2.clone(), host.clone());
        async move {
            let sni = format!("vc-1-0.{domain}");
            let port = tls.to_string();
            let out = tokio::task::spawn_blocking(move || {
                cli(&[
                    "--tls", "--sni", &sni, "--cacert", &ca2, "-h", &host, "-p", &port, "CLUSTER",
                    "MYID",
                ])
            })
            .await??;
            ensure!(!out.is_empty(), "no answer");
            Ok(())
        }
    })
    .await?;
    eprintln!(
        "rotated certificate served {:?} after the Secret changed",
        rotated.elapsed()
    );
    ensure!(
        proxy_pods().await? == before,
        "the proxy pods restarted: {before:?}"
    );
    operator.stop().await;
    Ok(())
}

/// Nodes that speak only TLS (`spec.tls`) behind the proxy: it dials them over TLS, checking
/// their chain against the cluster's CA (their certificate names no pod IP) and showing a
/// client certificate of its own (`proxy.clientSecretName`: the nodes ask for one, and the
/// nodes' key stays out of the proxy's pods), and clients outside reach every node through
/// the node ports in plain and through the TLS port, terminated, with the topology
/// rewritten on both.
async fn tls_nodes(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = &env;
    let tls = shardgate_operator_e2e::tls::ClusterTls::new()?;
    tls.create_secret(client, ns, "vc-tls").await?;
    // The TLS port's certificate: the SNI names under the cluster's domain.
    let domain = "vc.test";
    let sni_cert = tls.pki.wildcard("proxy")?;
    tls_secret(client, ns, "vc-sni", &sni_cert).await?;
    let operator = Operator::start(client, ns);
    let (base, sni_port) = (32900u16, 32990u16);
    let external = json!({
        "enabled": true,
        "mode": "proxy",
        "domain": domain,
        "proxy": {
            "replicas": 1,
            "basePort": base,
            "tls": { "port": sni_port, "secretName": "vc-sni", "mode": "terminate" },
            "clientSecretName": "vc-proxy-client",
        },
    });
    let mut vc = external_cluster("vc", 2, 1, external)?;
    vc.spec.tls = serde_json::from_value(json!({ "secretName": "vc-tls" }))?;
    create(client, ns, &vc).await?;
    // The proxy's own client certificate (of the cluster's CA) is not there yet: status
    // says so, rather than only that no proxy pod is ready.
    let api = Api::<ValkeyCluster>::namespaced(client.clone(), ns);
    let not_ready_because = |what: &'static str| {
        let api = api.clone();
        eventually(what, FORM, move || {
            let api = api.clone();
            async move {
                let vc = api.get("vc").await?;
                let ready = condition(&vc, "ExternalAccessReady");
                ensure!(
                    ready
                        .as_ref()
                        .is_some_and(|(s, _, m)| s == "False" && m.contains(what)),
                    "ExternalAccessReady: {ready:?}"
                );
                Ok(())
            }
        })
    };
    not_ready_because("proxy.clientSecretName: Secret vc-proxy-client not found").await?;
    // A certificate of another CA: the nodes would refuse it, and status says so.
    let stranger = shardgate_operator_e2e::tls::ClusterTls::new()?.app;
    tls_secret(client, ns, "vc-proxy-client", &stranger).await?;
    not_ready_because(
        "Secret vc-proxy-client has a tls.crt the nodes would refuse: not a client \
         certificate of Secret vc-tls's ca.crt",
    )
    .await?;
    tls_secret(client, ns, "vc-proxy-client", &tls.app).await?;
    let vc = wait_external_ready(client, ns, "vc").await?;
    let status = vc.status.clone().context("status")?;
    let ingress = status.external_endpoints[0].host.clone();
    // A proxy pod may have started with the refused certificate: its legs work once it
    // has read the new one (a Secret renewed in place). From then on, no leg fails.
    let seed = bootstrap_seeds(&vc)?[0];
    eventually("a TLS leg through the proxy", FORM, || async {
        Admin::connect(seed, Timeouts::default())
            .await?
            .cluster_myid()
            .await?;
        Ok(())
    })
    .await?;
    let (failed_before, _) = backend_tls_errors(client, ns).await?;

    // The node ports, in plain: a cluster client writes and reads over every slot, and the
    // topology (SLOTS, NODES, SHARDS: a TLS-only node's `tls-port` becomes the listener's
    // `port`) names only the load balancer.
    only_external_addresses(client, ns, "vc", &status, 2_000).await?;
    tokio::task::spawn_blocking(move || redis_cli_set_get(seed, 2_000)).await??;

    // The nodes refuse plain RESP: the proxy's legs are TLS.
    let pods = pod_addrs(client, ns, "vc").await?;
    let node = NodeRef::new(1, 0);
    ensure!(
        Admin::connect(pods[&node], Timeouts::default())
            .await?
            .cluster_myid()
            .await
            .is_err(),
        "node {node} answered plain RESP"
    );
    let id = Admin::dial(pods[&node], &tls.dial()?)
        .await?
        .cluster_myid()
        .await?;

    // The TLS port: the SNI name picks the node, and redirects name SNI names.
    let ca = tls.pki.ca.display().to_string();
    let tls_cli = |sni: String, args: Vec<String>| {
        redis_cli_sni(ca.clone(), ingress.clone(), sni_port, sni, args)
    };
    let got = tls_cli(
        format!("vc-1-0.{domain}"),
        vec!["CLUSTER".into(), "MYID".into()],
    )
    .await?;
    ensure!(
        got == id,
        "CLUSTER MYID over SNI vc-1-0: {got}, node 1-0 is {id}"
    );
    sni_redirect(&ca, &ingress, sni_port, domain, "tls-nodes").await?;
    // No TLS leg failed on the way (the proxy's metrics, at its pod).
    let (failed, metrics) = backend_tls_errors(client, ns).await?;
    ensure!(
        failed == failed_before,
        "TLS legs failed: {failed_before} before, {failed} after"
    );
    ensure!(
        metrics.contains("shardgate_proxy_bytes_total"),
        "not the proxy's metrics: {metrics}"
    );
    operator.stop().await;
    Ok(())
}

/// The proxy pod's failed TLS legs to nodes (a refusal shows as `tls`, or `io` when TLS
/// 1.3 reports it on the first read), and its metrics.
async fn backend_tls_errors(client: &kube::Client, ns: &str) -> Result<(f64, String)> {
    let proxy_pods = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), ns)
        .list(&kube::api::ListParams::default().labels("shardgate.io/component=proxy"))
        .await?;
    let ip: std::net::IpAddr = proxy_pods
        .items
        .first()
        .and_then(|p| p.status.as_ref()?.pod_ip.as_ref()?.parse().ok())
        .context("no proxy pod IP")?;
    let metrics = tokio::task::spawn_blocking(move || {
        shardgate_harness::http::get(SocketAddr::new(ip, 9090), "/metrics")
    })
    .await??
    .1;
    let failed = metrics
        .lines()
        .filter(|l| {
            l.starts_with("shardgate_proxy_backend_errors_total")
                && (l.contains("kind=\"tls\"") || l.contains("kind=\"io\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    Ok((failed, metrics))
}

/// A `kubernetes.io/tls` Secret `name` with `pair`'s certificate and key.
async fn tls_secret(
    client: &kube::Client,
    ns: &str,
    name: &str,
    pair: &shardgate_harness::tls::CertPair,
) -> Result<()> {
    // Applied: made, or its keys replaced (as a renewal does).
    Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client.clone(), ns)
        .patch(
            name,
            &kube::api::PatchParams::apply("e2e").force(),
            &kube::api::Patch::Apply(json!({
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": { "name": name },
                "type": "kubernetes.io/tls",
                "stringData": { "tls.crt": pair.cert_pem, "tls.key": pair.key_pem },
            })),
        )
        .await?;
    Ok(())
}

/// `redis-cli --tls --sni <sni>` at `host:port`, trusting the CA file `ca`.
async fn redis_cli_sni(
    ca: String,
    host: String,
    port: u16,
    sni: String,
    args: Vec<String>,
) -> Result<String> {
    tokio::task::spawn_blocking(move || {
        let port = port.to_string();
        let mut all = vec![
            "--tls", "--sni", &sni, "--cacert", &ca, "-h", &host, "-p", &port,
        ];
        all.extend(args.iter().map(String::as_str));
        cli(&all)
    })
    .await?
}

/// A key of shard 1 asked at shard 0's SNI name (a 2-shard cluster) is redirected to a shard
/// 1 name on the TLS port.
async fn sni_redirect(ca: &str, host: &str, port: u16, domain: &str, tag: &str) -> Result<()> {
    let key = shardgate_harness::clients::spread_keys(4, tag)
        .into_iter()
        .find(|k| shardgate_harness::valkey::key_slot(k.as_bytes()) > 8192)
        .context("a key of shard 1")?;
    let (ca, host, sni) = (ca.to_string(), host.to_string(), format!("vc-0-0.{domain}"));
    let moved = redis_cli_sni(ca, host, port, sni, vec!["GET".into(), key.clone()]).await?;
    ensure!(
        moved.contains("MOVED")
            && moved.contains("vc-1-")
            && moved.contains(&format!(".{domain}:{port}")),
        "GET {key} at vc-0-0: {moved}"
    );
    Ok(())
}

/// Shards 3 -> 4 while a client outside writes through the proxy: the new shard's nodes get
/// their ports on the Service and in the proxy's table (no proxy pod restarts), the client
/// follows the migrated slots, and no acknowledged write is lost.
async fn scale_out(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = &env;
    let operator = Operator::start(client, ns);
    let base = 32800u16;
    create(
        client,
        ns,
        &external_cluster("vc", 3, 1, proxy_access(base))?,
    )
    .await?;
    let vc = wait_external_ready(client, ns, "vc").await?;
    let seeds = bootstrap_seeds(&vc)?;
    let proxy_pods = |client: kube::Client, ns: String| async move {
        let pods = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client, &ns)
            .list(&kube::api::ListParams::default().labels("shardgate.io/component=proxy"))
            .await?;
        Ok::<BTreeSet<String>, anyhow::Error>(
            pods.items.iter().map(kube::ResourceExt::name_any).collect(),
        )
    };
    let proxies = proxy_pods(client.clone(), ns.clone()).await?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writes = shardgate_operator_e2e::external::writer(
        cluster_client(seeds.iter().copied()).await?,
        "scale",
        stop.clone(),
    );
    let started = Instant::now();
    Api::<shardgate_crds::ValkeyCluster>::namespaced(client.clone(), ns)
        .patch(
            "vc",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({ "spec": { "shards": 4 } })),
        )
        .await?;
    let vc = eventually("4 shards reachable through the proxy", FORM, || async {
        let vc = wait_external_ready(client, ns, "vc").await?;
        let status = vc.status.clone().context("status")?;
        ensure!(
            status.external_endpoints.len() == 8,
            "{} endpoints",
            status.external_endpoints.len()
        );
        let mut admin = Admin::connect(seeds[0], Timeouts::default()).await?;
        let primaries: Vec<u32> = admin
            .cluster_nodes()
            .await?
            .iter()
            .filter(|l| l.is_primary())
            .map(|l| l.slot_count())
            .collect();
        ensure!(
            primaries == [4096; 4],
            "slots per primary through the proxy: {primaries:?}"
        );
        Ok(vc)
    })
    .await?;
    eprintln!("shards 3 -> 4 behind the proxy in {:?}", started.elapsed());
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
    let mut conn = cluster_client(seeds.iter().copied()).await?;
    for key in &acked {
        let v: Option<String> = redis::AsyncCommands::get(&mut conn, key).await?;
        ensure!(v.is_some(), "acknowledged {key} lost while scaling");
    }
    let status = vc.status.clone().context("status")?;
    only_external_addresses(client, ns, "vc", &status, 1_000).await?;
    // The proxy pods that served the writes are the ones serving the new shard.
    ensure!(
        proxy_pods(client.clone(), ns.clone()).await? == proxies,
        "the proxy pods changed"
    );
    eprintln!(
        "proxy scale-out: {} writes acknowledged, {errors} failed, none lost",
        acked.len()
    );
    operator.stop().await;
    Ok(())
}

/// Whether `vc-proxy` of kind `K` exists.
async fn exists<K>(client: &kube::Client, ns: &str) -> Result<bool>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned,
{
    Ok(Api::<K>::namespaced(client.clone(), ns)
        .get_opt("vc-proxy")
        .await?
        .is_some())
}

/// Which of the proxy's objects (all named `vc-proxy`) exist, by kind.
async fn proxy_objects(client: &kube::Client, ns: &str) -> Result<Vec<&'static str>> {
    use k8s_openapi::api::core::v1::ServiceAccount;
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    let kinds = [
        ("Deployment", exists::<Deployment>(client, ns).await?),
        ("Service", exists::<Service>(client, ns).await?),
        (
            "PodDisruptionBudget",
            exists::<PodDisruptionBudget>(client, ns).await?,
        ),
        (
            "ServiceAccount",
            exists::<ServiceAccount>(client, ns).await?,
        ),
        ("Role", exists::<Role>(client, ns).await?),
        ("RoleBinding", exists::<RoleBinding>(client, ns).await?),
    ];
    Ok(kinds
        .into_iter()
        .filter(|(_, found)| *found)
        .map(|(kind, _)| kind)
        .collect())
}

/// Turning proxy mode off deletes the proxy's objects: once when the proxy never ran (a
/// NodePort Service without `advertisedHost`: no address to hand out, so no Deployment),
/// and once after it ran behind a LoadBalancer, with the API server refusing one delete for
/// a while: the retry, once the refusal is lifted, still deletes everything.
async fn mode_off(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = &env;
    let operator = Operator::start(client, ns);
    let vcs = Api::<ValkeyCluster>::namespaced(client.clone(), ns);
    let set_external = |external: serde_json::Value| {
        let vcs = vcs.clone();
        async move {
            let patch = json!({ "spec": { "externalAccess": external } });
            vcs.patch("vc", &PatchParams::default(), &Patch::Merge(patch))
                .await
        }
    };
    // In the NodePort range's static band (30000 to 30085 for the default range), which the
    // API server leaves to explicit requests: the LoadBalancer Services of the other tests
    // get their NodePorts from the rest, and one of them could take a port above it first.
    let base = 30040;
    let mut no_address = proxy_access(base);
    no_address["proxy"]["serviceType"] = json!("NodePort");
    create(client, ns, &external_cluster("vc", 1, 0, no_address)?).await?;
    let without_deployment = [
        "Service",
        "PodDisruptionBudget",
        "ServiceAccount",
        "Role",
        "RoleBinding",
    ];
    eventually("the proxy's objects but its Deployment", FORM, || async {
        let found = proxy_objects(client, ns).await?;
        ensure!(found == without_deployment, "{found:?}");
        Ok(())
    })
    .await?;
    // Its NodePorts are the ports clients are handed: basePort + flatIndex.
    let svc = Api::<Service>::namespaced(client.clone(), ns)
        .get("vc-proxy")
        .await?;
    let ports: Vec<(i32, Option<i32>)> = svc
        .spec
        .and_then(|s| s.ports)
        .unwrap_or_default()
        .iter()
        .map(|p| (p.port, p.node_port))
        .collect();
    ensure!(
        ports == [(i32::from(base), Some(i32::from(base)))],
        "{ports:?}"
    );
    set_external(json!(null)).await?;
    let gone = || async {
        eventually("every proxy object gone", FORM, || async {
            let found = proxy_objects(client, ns).await?;
            ensure!(found.is_empty(), "{found:?}");
            Ok(())
        })
        .await
    };
    gone().await?;

    set_external(proxy_access(base)).await?;
    wait_external_ready(client, ns, "vc").await?;
    let found = proxy_objects(client, ns).await?;
    ensure!(found.len() == 6, "{found:?}");

    // The PodDisruptionBudget's delete refused: the removal stops partway, and the Service,
    // which marks the objects as the operator's, must outlive it for the retry to finish.
    let refusal = RefusedDelete::start(client, ns).await?;
    let refused = async {
        let errors = || {
            operator
                .metrics
                .failures
                .get_or_create(&ErrorLabels { error: "kube" })
                .get()
        };
        let before = errors();
        set_external(json!(null)).await?;
        eventually("a removal stopped by the refused delete", FORM, || async {
            let found = proxy_objects(client, ns).await?;
            ensure!(errors() > before, "no failed reconcile yet; {found:?}");
            ensure!(!found.contains(&"Deployment"), "{found:?}");
            Ok(found)
        })
        .await
    }
    .await;
    refusal.stop().await?;
    let found = refused?;
    ensure!(
        found.contains(&"Service") && found.contains(&"PodDisruptionBudget"),
        "the Service went before the refused PodDisruptionBudget: {found:?}"
    );
    gone().await?;
    operator.stop().await;
    Ok(())
}

/// A ValidatingAdmissionPolicy (and its binding) that refuses every DELETE of the
/// PodDisruptionBudget `vc-proxy` in one namespace: an API server that says no, which no
/// other fault gives.
struct RefusedDelete {
    policies: Api<ValidatingAdmissionPolicy>,
    bindings: Api<ValidatingAdmissionPolicyBinding>,
    name: String,
}

impl RefusedDelete {
    /// Installs the policy and returns once the API server refuses a dry-run delete.
    async fn start(client: &kube::Client, ns: &str) -> Result<RefusedDelete> {
        let name = format!("refuse-delete-{ns}");
        let policy: ValidatingAdmissionPolicy = serde_json::from_value(json!({
            "metadata": { "name": name },
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "namespaceSelector": {
                        "matchLabels": { "kubernetes.io/metadata.name": ns }
                    },
                    "resourceRules": [{
                        "apiGroups": ["policy"],
                        "apiVersions": ["v1"],
                        "resources": ["poddisruptionbudgets"],
                        "resourceNames": ["vc-proxy"],
                        "operations": ["DELETE"]
                    }]
                },
                "validations": [{ "expression": "false", "message": "refused by the test" }]
            }
        }))?;
        let binding: ValidatingAdmissionPolicyBinding = serde_json::from_value(json!({
            "metadata": { "name": name },
            "spec": { "policyName": name, "validationActions": ["Deny"] }
        }))?;
        let refusal = RefusedDelete {
            policies: Api::all(client.clone()),
            bindings: Api::all(client.clone()),
            name,
        };
        let post = PostParams::default();
        refusal.policies.create(&post, &policy).await?;
        refusal.bindings.create(&post, &binding).await?;
        // The API server loads policies asynchronously: wait until it applies this one.
        let budgets = Api::<PodDisruptionBudget>::namespaced(client.clone(), ns);
        let dry_run = DeleteParams {
            dry_run: true,
            ..DeleteParams::default()
        };
        eventually("the API server refusing the delete", FORM, || async {
            match budgets.delete("vc-proxy", &dry_run).await {
                Err(kube::Error::Api(e)) if e.message.contains("refused by the test") => Ok(()),
                other => anyhow::bail!("a dry-run delete: {other:?}"),
            }
        })
        .await?;
        Ok(refusal)
    }

    /// Lifts the refusal.
    async fn stop(self) -> Result<()> {
        let params = DeleteParams::default();
        self.bindings.delete(&self.name, &params).await?;
        self.policies.delete(&self.name, &params).await?;
        Ok(())
    }
}
