//! The per-port proxy in front of a real Valkey 9 cluster whose nodes announce the proxy's
//! address (`cluster-announce-client-ipv4` + `cluster-announce-client-port`), with real
//! clients that nobody here wrote: redis-cli and the redis crate's cluster client.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use shardgate_crds::{NodeRef, PortLayout};
use shardgate_harness::addr::free_port_range;
use shardgate_harness::clients::{cli, cluster_client, spread_keys};
use shardgate_harness::http::{get, metric_value};
use shardgate_harness::routes::{announce_proxy, routes_yaml};
use shardgate_harness::valkey::{hash_tag_for_slot, key_slot, ClusterSpec, Restart, ValkeyCluster};
use shardgate_proxy::{Proxy, ProxyConfig, ProxyHandle, SourceConfig};
use tokio::task::block_in_place;

const PROXY_IP: Ipv4Addr = Ipv4Addr::LOCALHOST;

struct Fixture {
    cluster: Arc<ValkeyCluster>,
    proxy: ProxyHandle,
    layout: PortLayout,
    routes: PathBuf,
    admin: SocketAddr,
}

impl Fixture {
    /// A cluster announcing the proxy, and the proxy with a route file for it.
    async fn start(shards: u32, replicas: u32) -> Fixture {
        let base = free_port_range(PROXY_IP, (shards * (replicas + 1)) as u16);
        let layout = PortLayout::new(u32::from(base), shards, replicas, None).unwrap();
        let spec =
            ClusterSpec::new(shards, replicas).with_node_config(announce_proxy(PROXY_IP, layout));
        let cluster = Arc::new(block_in_place(|| ValkeyCluster::start(spec)).unwrap());
        let routes = cluster.root_dir().join("routes.yaml");
        std::fs::write(&routes, routes_yaml(base, &cluster)).unwrap();
        let mut config = ProxyConfig::new(SourceConfig::File {
            path: routes.clone(),
            poll: Duration::from_millis(50),
        });
        config.listen_ip = PROXY_IP.into();
        config.admin_addr = Some(SocketAddr::from((PROXY_IP, 0)));
        let proxy = Proxy::start(config).await.unwrap();
        assert!(
            proxy.wait_ready(Duration::from_secs(10)).await,
            "proxy not ready"
        );
        let admin = proxy.admin_addr().unwrap();
        Fixture {
            cluster,
            proxy,
            layout,
            routes,
            admin,
        }
    }

    fn port(&self, node: NodeRef) -> u16 {
        self.layout.port(node).unwrap()
    }

    fn metrics(&self) -> String {
        get(self.admin, "/metrics").unwrap().1
    }

    fn accepted(&self, port: u16) -> f64 {
        metric_value(
            &self.metrics(),
            &format!("shardgate_proxy_connections_accepted_total{{port=\"{port}\"}}"),
        )
        .unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cli_follows_a_cross_shard_moved_back_through_the_proxy() {
    let f = Fixture::start(3, 1).await;
    let entry = f.port(NodeRef::new(0, 0)).to_string();
    // A key of shard 2: shard 0 answers MOVED with shard 2's proxy port.
    let slot = *f.cluster.spec().initial_slots(2u32).start();
    let key = format!("{}k", hash_tag_for_slot(slot));
    let owner_port = f.port(NodeRef::new(2, 0));

    let moved = cli(&["-h", "127.0.0.1", "-p", &entry, "GET", &key]).unwrap();
    assert_eq!(moved, format!("MOVED {slot} 127.0.0.1:{owner_port}"));

    let before = f.accepted(owner_port);
    assert_eq!(
        cli(&[
            "-c",
            "-h",
            "127.0.0.1",
            "-p",
            &entry,
            "SET",
            &key,
            "through-the-proxy"
        ])
        .unwrap(),
        "OK"
    );
    assert_eq!(
        cli(&["-c", "-h", "127.0.0.1", "-p", &entry, "GET", &key]).unwrap(),
        "through-the-proxy"
    );
    assert!(
        f.accepted(owner_port) >= before + 2.0,
        "the redirect did not come back through the proxy"
    );
    // And the value really is on shard 2's primary.
    let value: String = f
        .cluster
        .node(NodeRef::new(2, 0))
        .query(&["GET", &key])
        .unwrap();
    assert_eq!(value, "through-the-proxy");
    f.proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_cluster_client_does_10000_set_get_over_all_slots_through_the_proxy() {
    let f = Fixture::start(3, 1).await;
    let conn = cluster_client(f.port(NodeRef::new(1, 1))).await.unwrap();

    // The client sees only the proxy's addresses.
    let slots: redis::Value = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    let text = format!("{slots:?}");
    for node in f.cluster.nodes() {
        assert!(
            !text.contains(&node.ip().to_string()),
            "internal address {} handed out: {text}",
            node.ip()
        );
    }

    let keys = spread_keys(10_000, "");
    let slots_hit: std::collections::BTreeSet<u16> =
        keys.iter().map(|k| key_slot(k.as_bytes())).collect();
    assert_eq!(slots_hit.len(), 10_000);
    let mut tasks = vec![];
    for chunk in keys.chunks(500) {
        let chunk = chunk.to_vec();
        let mut c = conn.clone();
        tasks.push(tokio::spawn(async move {
            for k in &chunk {
                let _: () = c.set(k, format!("v-{k}")).await.unwrap();
            }
            for k in &chunk {
                let v: String = c.get(k).await.unwrap();
                assert_eq!(v, format!("v-{k}"));
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    // Every key is on the node that owns its slot, read directly.
    for k in keys.iter().step_by(97) {
        let owner = block_in_place(|| f.cluster.slot_owner(key_slot(k.as_bytes()))).unwrap();
        let v: String = f.cluster.node(owner).query(&["GET", k]).unwrap();
        assert_eq!(v, format!("v-{k}"));
    }
    // Each primary was reached through its own listener.
    for s in 0..3 {
        let port = f.port(NodeRef::new(s, 0));
        assert!(f.accepted(port) >= 1.0, "no connection through port {port}");
    }
    let m = f.metrics();
    let sent = metric_value(
        &m,
        &format!(
            "shardgate_proxy_bytes_total{{port=\"{}\",direction=\"to_backend\"}}",
            f.port(NodeRef::new(2, 0))
        ),
    )
    .unwrap();
    assert!(
        sent > 10_000.0,
        "shard 2 got only {sent} bytes through the proxy"
    );
    f.proxy.shutdown().await;
}

/// Failed writes per shard of the key (the shards' slots never move in these tests).
struct ShardErrors {
    spec: ClusterSpec,
    counts: Vec<AtomicU64>,
}

impl ShardErrors {
    fn new(spec: &ClusterSpec) -> Arc<ShardErrors> {
        Arc::new(ShardErrors {
            spec: spec.clone(),
            counts: (0..spec.shards).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    fn count(&self, key: &str) {
        let slot = key_slot(key.as_bytes());
        let shard = (0..self.spec.shards)
            .position(|s| self.spec.initial_slots(s).contains(&slot))
            .unwrap_or(0);
        self.counts[shard].fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> Vec<u64> {
        self.counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }
}

/// Writes and reads keys in a loop until told to stop; returns the acknowledged writes.
async fn traffic(
    mut conn: redis::cluster_async::ClusterConnection,
    stop: Arc<AtomicBool>,
    errors: Arc<ShardErrors>,
    oks: Arc<AtomicU64>,
) -> BTreeMap<String, String> {
    let keys = spread_keys(300, "");
    let mut acked = BTreeMap::new();
    let mut round = 0u64;
    while !stop.load(Ordering::Relaxed) {
        round += 1;
        for k in &keys {
            let v = format!("{round}");
            match conn.set::<_, _, ()>(k, &v).await {
                Ok(()) => {
                    acked.insert(k.clone(), v);
                    oks.fetch_add(1, Ordering::Relaxed);
                }
                Err(_) => {
                    errors.count(k);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }
    acked
}

/// Waits until the writer has had `n` writes acknowledged in all.
async fn wait_for_writes(oks: &AtomicU64, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while oks.load(Ordering::Relaxed) < n {
        assert!(
            Instant::now() < deadline,
            "only {} of {n} writes acknowledged",
            oks.load(Ordering::Relaxed)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `n` consecutive round trips through the client succeed.
async fn recovers(
    conn: &mut redis::cluster_async::ClusterConnection,
    within: Duration,
) -> Duration {
    let start = Instant::now();
    let mut ok = 0;
    let keys: Vec<String> = spread_keys(64, "")
        .into_iter()
        .map(|k| format!("{k}:probe"))
        .collect();
    while ok < keys.len() {
        assert!(
            start.elapsed() < within,
            "client did not recover within {within:?}"
        );
        let k = &keys[ok];
        match conn.set::<_, _, ()>(k, "after").await {
            Ok(()) => ok += 1,
            Err(_) => {
                ok = 0;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    start.elapsed()
}

/// What the test proves: the proxy (never restarted) carries a cluster client through a
/// primary's death and failover, its return as a replica, and a primary that comes back at a
/// new address (the route file follows), without losing an acknowledged write. Writes fail
/// only for keys of the shard that has no reachable primary: none before the faults, none of
/// another shard during each fault, none once the client has recovered. Each fault is
/// waited for (failover, rejoin, reload), never timed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarted_during_traffic_the_client_recovers_without_restarting_the_proxy() {
    let f = Fixture::start(3, 1).await;
    let conn = cluster_client(f.port(NodeRef::new(0, 0))).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let errors = ShardErrors::new(f.cluster.spec());
    let oks = Arc::new(AtomicU64::new(0));
    let load = tokio::spawn(traffic(
        conn.clone(),
        stop.clone(),
        errors.clone(),
        oks.clone(),
    ));
    // A whole round of writes before any fault, none failed.
    wait_for_writes(&oks, 300).await;
    let before = errors.snapshot();
    assert_eq!(
        before,
        [0, 0, 0],
        "failed writes per shard before any fault"
    );

    // Same address: shard 1's primary dies; its replica takes over (waited for: the test
    // proves the proxy carries the client through a failover, not a race with it), then
    // the old primary comes back and rejoins as a replica.
    let faults = Instant::now();
    let victim = NodeRef::new(1, 0);
    f.cluster.kill(victim);
    let cluster = f.cluster.clone();
    tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        while cluster.primary_of(1).ok() != Some(NodeRef::new(1, 1)) {
            assert!(Instant::now() < deadline, "shard 1 never failed over");
            std::thread::sleep(Duration::from_millis(50));
        }
        cluster.restart(victim, Restart::SameAddress).unwrap();
        while cluster.node(victim).role().ok().as_deref() != Some("slave") {
            assert!(Instant::now() < deadline, "the old primary never rejoined");
            std::thread::sleep(Duration::from_millis(50));
        }
    })
    .await
    .unwrap();
    let mut probe = conn.clone();
    recovers(&mut probe, Duration::from_secs(30)).await;
    // A whole round lets a write that was retrying when the probe recovered finish.
    let done = oks.load(Ordering::Relaxed);
    wait_for_writes(&oks, done + 300).await;
    let first = errors.snapshot();
    let first_fault = faults.elapsed();

    // New address, as a rescheduled pod: the route file follows, the proxy reloads.
    let faults = Instant::now();
    let moved = NodeRef::new(2, 0);
    let cluster = f.cluster.clone();
    tokio::task::spawn_blocking(move || cluster.restart(moved, Restart::NewAddress))
        .await
        .unwrap()
        .unwrap();
    let version = f.proxy.routes().borrow().version;
    let base = f.layout.base_port();
    std::fs::write(&f.routes, routes_yaml(base, &f.cluster)).unwrap();
    let mut rx = f.proxy.routes();
    tokio::time::timeout(
        Duration::from_secs(10),
        rx.wait_for(|t| t.version > version),
    )
    .await
    .expect("route file not reloaded")
    .unwrap();
    let new_ip = f.cluster.node(moved).addr();
    assert_eq!(
        f.proxy
            .routes()
            .borrow()
            .route(f.port(moved))
            .unwrap()
            .backend
            .socket_addr(),
        Some(new_ip)
    );
    recovers(&mut probe, Duration::from_secs(30)).await;
    // A whole round lets a write that was retrying when the probe recovered finish.
    let done = oks.load(Ordering::Relaxed);
    wait_for_writes(&oks, done + 300).await;
    let second_fault = faults.elapsed();
    let second = errors.snapshot();

    // Another whole round after both faults: no write fails any more.
    let done = oks.load(Ordering::Relaxed);
    wait_for_writes(&oks, done + 300).await;
    let after = errors.snapshot();

    stop.store(true, Ordering::Relaxed);
    let acked = load.await.unwrap();
    assert_eq!(acked.len(), 300, "some key was never written");
    // Every key reads back through the proxy with its last acknowledged value or a later one.
    let mut lost = vec![];
    for (k, v) in &acked {
        let got: Option<String> = probe.get(k).await.unwrap();
        let got_round = got
            .as_deref()
            .and_then(|g| g.parse::<u64>().ok())
            .unwrap_or(0);
        if got_round < v.parse::<u64>().unwrap() {
            lost.push((k.clone(), v.clone(), got));
        }
    }
    assert!(lost.is_empty(), "acknowledged writes lost: {lost:?}");
    let written = oks.load(Ordering::Relaxed);
    eprintln!(
        "writes: {written} acknowledged; failed per shard: {first:?} after shard 1's failover \
         ({first_fault:?}), {second:?} after shard 2's move ({second_fault:?}), {after:?} at \
         the end"
    );
    // Shard 1's primary died: only shard 1's keys may fail.
    assert_eq!(
        (first[0], first[2]),
        (0, 0),
        "writes to shards 0 and 2 failed while shard 1 failed over: {first:?}"
    );
    // Shard 2's primary moved: only shard 2's keys may fail.
    assert_eq!(
        (second[0], second[1]),
        (first[0], first[1]),
        "writes to shards 0 and 1 failed while shard 2 moved: {second:?} (was {first:?})"
    );
    assert_eq!(after, second, "writes failed after the client recovered");
    f.proxy.shutdown().await;
}
