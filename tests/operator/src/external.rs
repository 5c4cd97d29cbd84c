//! What the external-access tests share: clusters with an `externalAccess` block, waiting
//! for their external endpoints, the Gateway (Traefik) that gateway mode routes through, and
//! the checks a client outside Kubernetes makes through them (only external addresses in
//! topology replies; writes through failovers).

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};
use gateway_api::experimental::gatewayclasses::GatewayClass;
use gateway_api::experimental::gateways::Gateway;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use redis::AsyncCommands;
use serde_json::json;
use shardgate_admin_client::{Client as Admin, Timeouts};
use shardgate_crds::names::{labels, objects};
use shardgate_crds::valkey_cluster::ValkeyCluster;
use shardgate_crds::NodeRef;
use shardgate_harness::clients::{cli_script, spread_keys};
use shardgate_kube_harness::{
    free_loopback_ip, ControlPlane, Fault, StatusAddress, TestEnv, Traefik, TRAEFIK_CONTROLLER_NAME,
};

use crate::{cluster_client, condition, eventually, pod_addrs, valkey_cluster, wait_ready};

/// `status.bootstrap` of `vc`, as addresses.
pub fn bootstrap_seeds(vc: &ValkeyCluster) -> Result<Vec<SocketAddr>> {
    let bootstrap = vc
        .status
        .as_ref()
        .and_then(|s| s.bootstrap.clone())
        .context("no bootstrap in status")?;
    bootstrap
        .split(',')
        .map(|a| a.parse().with_context(|| format!("bootstrap {bootstrap}")))
        .collect()
}

pub const FORM: Duration = Duration::from_secs(240);

/// A `shards` x `replicas` cluster with a short node timeout (failovers in seconds).
pub fn cluster(name: &str, shards: u32, replicas: u32) -> Result<ValkeyCluster> {
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
pub async fn views(
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

/// A writer that keeps every acknowledged key and counts its errors, until `stop`.
pub fn writer(
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

/// A `shards` x `replicas` cluster (as [`cluster`]) with `externalAccess` set to `external`.
pub fn external_cluster(
    name: &str,
    shards: u32,
    replicas: u32,
    external: serde_json::Value,
) -> Result<ValkeyCluster> {
    let mut vc = cluster(name, shards, replicas)?;
    vc.spec.external_access = Some(serde_json::from_value(external)?);
    Ok(vc)
}

/// Waits until `name` is Ready and ExternalAccessReady for its current generation.
pub async fn wait_external_ready(client: &Client, ns: &str, name: &str) -> Result<ValkeyCluster> {
    let api = Api::<ValkeyCluster>::namespaced(client.clone(), ns);
    eventually(
        &format!("ValkeyCluster {name} Ready and ExternalAccessReady"),
        FORM,
        || async {
            let vc = api.get(name).await?;
            let observed = vc.status.as_ref().and_then(|s| s.observed_generation);
            ensure!(
                observed == vc.metadata.generation,
                "observed generation {observed:?} of {:?}",
                vc.metadata.generation
            );
            for c in ["Ready", "ExternalAccessReady"] {
                let got = condition(&vc, c);
                ensure!(got.as_ref().is_some_and(|c| c.0 == "True"), "{c}: {got:?}");
            }
            // Settled: every pod runs with what it is to announce.
            let progressing = condition(&vc, "Progressing");
            ensure!(
                progressing.as_ref().is_some_and(|c| c.0 == "False"),
                "Progressing: {progressing:?}"
            );
            Ok(vc)
        },
    )
    .await
}

/// A Gateway `gw` of a GatewayClass of its own (`traefik-<ns>`, Traefik's controller), with
/// a TCP listener named `<prefix>-<k>` on each of its ports, and Traefik serving them on a
/// fresh loopback IP.
pub struct TraefikGateway {
    pub traefik: Traefik,
    /// Where clients reach the Gateway: Traefik's IP, or its LoadBalancer Service's ingress.
    address: IpAddr,
    api: Api<Gateway>,
}

/// The LoadBalancer Service in front of Traefik, with
/// [`TraefikGateway::start_behind_load_balancer`].
const TRAEFIK_SERVICE: &str = "traefik";

impl TraefikGateway {
    /// Starts Traefik on an entry point per `ports` (watching `ns` only: other Gateways on
    /// the control plane are not this Traefik's) and declares a listener on the first
    /// `declared` of them. Clients reach Traefik directly, at its own IP.
    pub async fn start(
        cp: &ControlPlane,
        client: &Client,
        ns: &str,
        ports: &[u16],
        declared: usize,
        prefix: &str,
    ) -> Result<TraefikGateway> {
        let ip = free_loopback_ip(ports)?;
        let traefik = Traefik::start_in(cp, &[ns], ip, &entry_points(ports)).await?;
        Self::declare_gateway(client, ns, traefik, ip, &ports[..declared], prefix).await
    }

    /// As [`TraefikGateway::start`], with Traefik behind a LoadBalancer Service (`traefik`,
    /// a port per entry point, its EndpointSlice pointing at Traefik's IP), as it is
    /// deployed in a cluster: the Gateway's address is the Service's ingress, and clients
    /// go through the harness's LoadBalancer relay, as they do to a proxy-mode cluster's
    /// proxy.
    pub async fn start_behind_load_balancer(
        cp: &ControlPlane,
        client: &Client,
        ns: &str,
        ports: &[u16],
        declared: usize,
        prefix: &str,
    ) -> Result<TraefikGateway> {
        let entry_points = entry_points(ports);
        let service_ports: Vec<_> = entry_points
            .iter()
            .map(|(name, port)| json!({ "name": name, "port": port, "targetPort": port, "protocol": "TCP" }))
            .collect();
        // No selector: Traefik is not a pod, so its EndpointSlice is written here.
        let services: Api<Service> = Api::namespaced(client.clone(), ns);
        services
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "apiVersion": "v1", "kind": "Service",
                    "metadata": { "name": TRAEFIK_SERVICE },
                    "spec": { "type": "LoadBalancer", "ports": service_ports },
                }))?,
            )
            .await
            .with_context(|| format!("creating Service {TRAEFIK_SERVICE}"))?;
        let ingress = eventually(
            "Traefik's LoadBalancer Service has an ingress IP",
            Duration::from_secs(60),
            || async {
                let svc = services.get(TRAEFIK_SERVICE).await?;
                let ip = svc
                    .status
                    .and_then(|s| s.load_balancer)
                    .and_then(|lb| lb.ingress)
                    .and_then(|i| i.into_iter().next())
                    .and_then(|i| i.ip);
                ip.and_then(|ip| ip.parse::<IpAddr>().ok())
                    .context("no ingress IP in its status yet")
            },
        )
        .await?;
        // Not the ingress: the allocator, shared with the node agent, never hands out an IP
        // twice.
        let ip = free_loopback_ip(ports)?;
        let slice_ports: Vec<_> = entry_points
            .iter()
            .map(|(name, port)| json!({ "name": name, "port": port, "protocol": "TCP" }))
            .collect();
        Api::<EndpointSlice>::namespaced(client.clone(), ns)
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                    "metadata": {
                        "name": format!("{TRAEFIK_SERVICE}-1"),
                        "labels": { "kubernetes.io/service-name": TRAEFIK_SERVICE },
                    },
                    "addressType": "IPv4",
                    "endpoints": [{ "addresses": [ip.to_string()], "conditions": { "ready": true } }],
                    "ports": slice_ports,
                }))?,
            )
            .await
            .context("creating Traefik's EndpointSlice")?;
        let status = StatusAddress::Service {
            namespace: ns.to_string(),
            name: TRAEFIK_SERVICE.to_string(),
        };
        let traefik = Traefik::start_with(cp, &[ns], ip, &entry_points, &status).await?;
        Self::declare_gateway(client, ns, traefik, ingress, &ports[..declared], prefix).await
    }

    /// The GatewayClass and the Gateway, with a listener on each of `ports`.
    async fn declare_gateway(
        client: &Client,
        ns: &str,
        traefik: Traefik,
        address: IpAddr,
        ports: &[u16],
        prefix: &str,
    ) -> Result<TraefikGateway> {
        let class = format!("traefik-{ns}");
        Api::<GatewayClass>::all(client.clone())
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
                    "metadata": { "name": class },
                    "spec": { "controllerName": TRAEFIK_CONTROLLER_NAME },
                }))?,
            )
            .await
            .with_context(|| format!("creating GatewayClass {class}"))?;
        let api: Api<Gateway> = Api::namespaced(client.clone(), ns);
        api.create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
                "metadata": { "name": "gw" },
                "spec": {
                    "gatewayClassName": class,
                    "listeners": gateway_listeners(ports, prefix),
                },
            }))?,
        )
        .await
        .context("creating Gateway gw")?;
        Ok(TraefikGateway {
            traefik,
            address,
            api,
        })
    }

    /// Where clients reach the Gateway (its status address).
    pub fn ip(&self) -> IpAddr {
        self.address
    }

    /// Declares a listener on each of `ports` (the user adding what status asks for).
    pub async fn declare(&self, ports: &[u16], prefix: &str) -> Result<()> {
        self.api
            .patch(
                "gw",
                &PatchParams::default(),
                &Patch::Merge(json!({ "spec": { "listeners": gateway_listeners(ports, prefix) } })),
            )
            .await?;
        Ok(())
    }
}

/// Traefik's entry points: `vk<k>` on each of `ports`.
fn entry_points(ports: &[u16]) -> Vec<(String, u16)> {
    ports
        .iter()
        .enumerate()
        .map(|(i, &p)| (format!("vk{i}"), p))
        .collect()
}

fn gateway_listeners(ports: &[u16], prefix: &str) -> Vec<serde_json::Value> {
    ports
        .iter()
        .enumerate()
        .map(|(i, port)| {
            json!({
                "name": format!("{prefix}-{i}"), "port": port, "protocol": "TCP",
                "allowedRoutes": { "kinds": [{ "kind": "TCPRoute" }] },
            })
        })
        .collect()
}

/// `n` listener ports from `base`.
pub fn port_range(base: u16, n: u16) -> Vec<u16> {
    (base..base + n).collect()
}

/// `externalAccess` in gateway mode: announce mode, routed through the Gateway `gw` (its
/// listener `section` if given) from `base_port` on.
pub fn gateway_access(base_port: u16, section: Option<&str>) -> serde_json::Value {
    let mut gateway_ref = json!({ "name": "gw" });
    if let Some(s) = section {
        gateway_ref["sectionName"] = json!(s);
    }
    json!({
        "enabled": true,
        "mode": "announce",
        "gateway": { "gatewayRef": gateway_ref, "basePort": base_port },
    })
}

/// `externalAccess` in proxy mode: one shardgate-proxy replica behind a LoadBalancer, the
/// nodes from `base_port` on.
pub fn proxy_access(base_port: u16) -> serde_json::Value {
    json!({
        "enabled": true,
        "mode": "proxy",
        "proxy": { "replicas": 1, "basePort": base_port },
    })
}

/// The external Services of `cluster`, by name.
pub async fn external_services(
    client: &Client,
    ns: &str,
    cluster: &str,
) -> Result<BTreeMap<String, Service>> {
    let sel = format!(
        "{}={cluster},{}={}",
        labels::INSTANCE,
        labels::COMPONENT,
        labels::COMPONENT_EXTERNAL
    );
    let list = Api::<Service>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&sel))
        .await?;
    Ok(list.into_iter().map(|s| (s.name_any(), s)).collect())
}

/// Every `host:port` a CLUSTER SLOTS reply names.
pub fn slot_addresses(reply: &redis::Value) -> Result<Vec<String>> {
    let text = |v: &redis::Value| -> Option<String> {
        match v {
            redis::Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
            redis::Value::SimpleString(s) => Some(s.clone()),
            _ => None,
        }
    };
    let redis::Value::Array(ranges) = reply else {
        bail!("CLUSTER SLOTS: {reply:?}");
    };
    let mut out = Vec::new();
    for range in ranges {
        let redis::Value::Array(items) = range else {
            bail!("a slot range: {range:?}");
        };
        for node in items.iter().skip(2) {
            let redis::Value::Array(fields) = node else {
                bail!("a node entry: {node:?}");
            };
            let host = fields.first().and_then(text).context("no host")?;
            let port = match fields.get(1) {
                Some(redis::Value::Int(p)) => *p,
                other => bail!("port {other:?}"),
            };
            out.push(format!("{host}:{port}"));
        }
    }
    Ok(out)
}

/// A cluster client seeded with `status.bootstrap` (cluster `name`'s) only does `keys`
/// SET/GET, and CLUSTER SLOTS asked through the first bootstrap address names only
/// `status.externalEndpoints` (no address of one of `name`'s pods).
pub async fn only_external_addresses(
    client: &Client,
    ns: &str,
    name: &str,
    status: &shardgate_crds::ValkeyClusterStatus,
    keys: usize,
) -> Result<()> {
    let external_addrs: std::collections::BTreeSet<String> = status
        .external_endpoints
        .iter()
        .map(|e| e.address())
        .collect();
    let bootstrap = status.bootstrap.clone().context("no bootstrap")?;
    let seeds: Vec<std::net::SocketAddr> = bootstrap
        .split(',')
        .map(|a| a.parse().with_context(|| format!("bootstrap {bootstrap}")))
        .collect::<Result<_>>()?;
    let mut conn = cluster_client(seeds.iter().copied()).await?;
    let keys = spread_keys(keys, "ext");
    for k in &keys {
        let _: () = conn.set(k, k).await?;
    }
    for k in &keys {
        let v: String = conn.get(k).await?;
        ensure!(&v == k, "{k} read back {v}");
    }
    let pods = pod_addrs(client, ns, name).await?;
    let pod_ips: std::collections::BTreeSet<String> =
        pods.values().map(|a| a.ip().to_string()).collect();
    // Ready says every node is in place; the seed's view of the others may still be a
    // gossip round behind (a replica not yet listed): wait for the whole view, which must
    // then name only external addresses.
    eventually(
        "the topology seen from outside",
        Duration::from_secs(30),
        || topology_names_only(seeds[0], &external_addrs, &pod_ips),
    )
    .await
}

/// CLUSTER SLOTS, CLUSTER NODES and CLUSTER SHARDS asked at `seed` name only addresses of
/// `allowed` (`host:port`; CLUSTER NODES names each of them once) and no address at one of
/// `pod_ips`.
pub async fn topology_names_only(
    seed: SocketAddr,
    allowed: &std::collections::BTreeSet<String>,
    pod_ips: &std::collections::BTreeSet<String>,
) -> Result<()> {
    let mut direct = redis::Client::open(format!("redis://{seed}"))?
        .get_multiplexed_async_connection()
        .await?;
    let slots: redis::Value = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(&mut direct)
        .await?;
    let named = slot_addresses(&slots)?;
    ensure!(
        named.len() >= allowed.len(),
        "CLUSTER SLOTS names {named:?}"
    );
    for a in &named {
        ensure!(
            allowed.contains(a),
            "CLUSTER SLOTS names {a}: not external ({allowed:?})"
        );
        ensure!(
            !pod_ips.iter().any(|ip| a.starts_with(&format!("{ip}:"))),
            "CLUSTER SLOTS names the pod address {a}"
        );
    }
    // CLUSTER NODES and CLUSTER SHARDS, asked the same way, name the same addresses.
    let mut admin = Admin::connect(seed, Timeouts::default()).await?;
    let lines = admin.cluster_nodes().await?;
    ensure!(lines.len() == allowed.len(), "CLUSTER NODES: {lines:?}");
    for l in &lines {
        let a = format!("{}:{}", l.ip, l.port);
        ensure!(
            allowed.contains(&a),
            "CLUSTER NODES names {a}: not external ({allowed:?})"
        );
    }
    for shard in admin.cluster_shards().await? {
        for n in &shard.nodes {
            let a = format!("{}:{}", n.ip, n.port.unwrap_or(0));
            ensure!(
                allowed.contains(&a),
                "CLUSTER SHARDS names {a}: not external ({allowed:?})"
            );
        }
    }
    Ok(())
}

/// Writes through a cluster client seeded with `seeds` while shard 1 fails over by hand
/// (`CLUSTER FAILOVER`) and shard 2's primary is killed (stopped, then restarted): bounds the
/// failed writes, the killed primary's stall and its unreplicated tail, and requires the
/// graceful failover to lose nothing. `label` names the path in the printed report.
pub async fn failovers_under_load(env: &TestEnv, seeds: &[SocketAddr], label: &str) -> Result<()> {
    let TestEnv { client, ns, cp } = env;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writes = writer(
        cluster_client(seeds.iter().copied()).await?,
        "fo",
        stop.clone(),
    );
    let addrs = pod_addrs(client, ns, "vc").await?;
    let role = |addr: std::net::SocketAddr| async move {
        let mut c = Admin::connect(addr, Timeouts::default()).await?;
        let me = c.cluster_nodes().await?.into_iter().find(|l| l.is_myself());
        Ok::<bool, anyhow::Error>(me.is_some_and(|l| l.is_primary()))
    };

    // A manual failover of shard 1 to its replica, as an administrator runs it.
    let before = views(&addrs).await?;
    let (&replica, _) = before
        .iter()
        .find(|(n, l)| n.shard.0 == 1 && !l.is_primary())
        .context("shard 1's replica")?;
    let mut admin = Admin::connect(addrs[&replica], Timeouts::default()).await?;
    admin.command(["CLUSTER", "FAILOVER"]).await?;
    eventually("the manual failover", Duration::from_secs(60), || async {
        ensure!(
            role(addrs[&replica]).await?,
            "node {replica} is not primary yet"
        );
        Ok(())
    })
    .await?;

    // A killed primary (shard 2): its replica takes over after the node timeout (2 s).
    let (&victim, _) = before
        .iter()
        .find(|(n, l)| n.shard.0 == 2 && l.is_primary())
        .context("shard 2's primary")?;
    let heir = NodeRef::new(2, 1 - victim.node.0);
    let pod = format!("{}-0", objects::node("vc", victim));
    let killed = Instant::now();
    cp.agent().fault(ns, &pod, Fault::Stop).await?;
    eventually(
        "the killed primary's replica takes over",
        Duration::from_secs(60),
        || async {
            ensure!(role(addrs[&heir]).await?, "node {heir} is not primary yet");
            Ok(())
        },
    )
    .await?;
    let stall = killed.elapsed();
    ensure!(
        stall < Duration::from_secs(20),
        "shard 2 had no primary for {stall:?}"
    );
    cp.agent().fault(ns, &pod, Fault::Restart).await?;
    wait_ready(client, ns, "vc", FORM).await?;

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (acked, errors) = writes.await?;
    ensure!(
        acked.len() > 100,
        "only {} writes acknowledged",
        acked.len()
    );
    ensure!(
        errors <= acked.len() as u32 / 10 + 50,
        "{errors} failed writes for {} acknowledged",
        acked.len()
    );
    // A killed primary may lose its unreplicated tail (asynchronous replication); count it.
    let mut conn = cluster_client(seeds.iter().copied()).await?;
    let mut lost = Vec::new();
    for key in &acked {
        let v: Option<String> = conn.get(key).await?;
        if v.is_none() {
            lost.push(key.clone());
        }
    }
    eprintln!(
        "{label} failovers: {} writes acknowledged, {errors} failed, {} lost (the killed \
         primary's unreplicated tail), shard 2 without a primary for {stall:?}",
        acked.len(),
        lost.len()
    );
    ensure!(lost.len() <= 20, "acknowledged writes lost: {lost:?}");
    // The manual failover is graceful: nothing of shard 1 (slots 5461-10922) is lost.
    let graceful: Vec<&String> = lost
        .iter()
        .filter(|k| (5461..=10922).contains(&shardgate_harness::valkey::key_slot(k.as_bytes())))
        .collect();
    ensure!(graceful.is_empty(), "the manual failover lost {graceful:?}");
    Ok(())
}

/// `redis-cli -c` started at `seed` only, with a script of `n` SETs to keys spread over
/// every slot and then their `n` GETs on stdin: every SET answered OK, every GET its value
/// (the redirects it follows are the cluster's own MOVED replies).
pub fn redis_cli_set_get(seed: SocketAddr, n: usize) -> Result<()> {
    redis_cli_set_get_with(seed, n, &[])
}

/// [`redis_cli_set_get`] with more redis-cli arguments (`--tls --cacert ...`).
pub fn redis_cli_set_get_with(seed: SocketAddr, n: usize, extra: &[&str]) -> Result<()> {
    let keys = spread_keys(n, "cli");
    let mut script: Vec<String> = keys.iter().map(|k| format!("SET {k} {k}")).collect();
    script.extend(keys.iter().map(|k| format!("GET {k}")));
    let replies = cli_replies(seed, extra, &script)?;
    for (i, k) in keys.iter().enumerate() {
        ensure!(replies[i] == "OK", "SET {k}: {}", replies[i]);
        ensure!(replies[n + i] == *k, "GET {k}: {}", replies[n + i]);
    }
    Ok(())
}

/// `redis-cli -c` (with `extra` arguments) GETs the `n` keys [`redis_cli_set_get`] wrote,
/// at `seed`: each must read back its value.
pub fn redis_cli_read_back(seed: SocketAddr, n: usize, extra: &[&str]) -> Result<()> {
    let keys = spread_keys(n, "cli");
    let gets: Vec<String> = keys.iter().map(|k| format!("GET {k}")).collect();
    let values = cli_replies(seed, extra, &gets)?;
    for (k, v) in keys.iter().zip(values) {
        ensure!(*k == v, "GET {k}: {v}");
    }
    Ok(())
}

/// `redis-cli -c` at `seed` (with `extra` arguments) runs `script`: a reply per command.
fn cli_replies(seed: SocketAddr, extra: &[&str], script: &[String]) -> Result<Vec<String>> {
    let (host, port) = (seed.ip().to_string(), seed.port().to_string());
    let mut args = vec!["-c", "-h", &host, "-p", &port];
    args.extend_from_slice(extra);
    // Redirect notices, if this redis-cli prints them, are not replies.
    let replies: Vec<String> = cli_script(&args, script)?
        .into_iter()
        .filter(|l| !l.starts_with("-> Redirected"))
        .collect();
    ensure!(
        replies.len() == script.len(),
        "{} replies to {} commands; first: {:?}",
        replies.len(),
        script.len(),
        replies.first()
    );
    Ok(replies)
}
