//! The rewriting proxy in front of a real Valkey 9 cluster whose nodes announce their
//! internal addresses only (no announce flags): redis-cli, redis-benchmark --cluster, the
//! redis crate's cluster client and redis-py's RedisCluster all work through it, also while
//! a slot migrates (ASK) and while a primary fails over or is killed (MOVED to the new
//! primary). What the proxy says on the nodes' behalf is checked against Valkey announcing
//! the proxy's addresses itself, also with every reply cut across the proxy's reads.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use shardgate_crds::settings::defaults::MIN_BUFFER_SIZE;
use shardgate_crds::{NodeRef, PortLayout};
use shardgate_harness::addr::free_port_range;
use shardgate_harness::clients::{cli, cluster_client, spread_keys};
use shardgate_harness::http::{get, metric_value, unlisted_label_sets};
use shardgate_harness::routes::{announce_proxy, routes_yaml};
use shardgate_harness::tools::{python_with_redis, redis_benchmark, redis_cli};
use shardgate_harness::valkey::{key_slot, slot_tags, ClusterSpec, ValkeyCluster, SLOTS};
use shardgate_proxy::model::Backend;
use shardgate_proxy::{Proxy, ProxyConfig, ProxyHandle, SourceConfig};
use tokio::task::block_in_place;

const LO: Ipv4Addr = Ipv4Addr::LOCALHOST;

struct Fixture {
    cluster: Arc<ValkeyCluster>,
    proxy: ProxyHandle,
    layout: PortLayout,
    admin: SocketAddr,
}

impl Fixture {
    async fn start() -> Fixture {
        Fixture::start_with(|_| {}).await
    }

    async fn start_with(tune: impl FnOnce(&mut ProxyConfig)) -> Fixture {
        let cluster =
            Arc::new(block_in_place(|| ValkeyCluster::start(ClusterSpec::new(3, 1))).unwrap());
        let base = free_port_range(LO, 6);
        let layout = PortLayout::new(u32::from(base), 3, 1, None).unwrap();
        let mut config = ProxyConfig::new(SourceConfig::Seed {
            seeds: vec![Backend::ip(cluster.node(NodeRef::new(0, 0)).addr())],
            base_port: base,
            ports_per_shard: None,
            refresh: Duration::from_secs(2),
        });
        config.listen_ip = LO.into();
        config.admin_addr = Some(SocketAddr::from((LO, 0)));
        config.rewrite = true;
        config.advertise_host = Some("127.0.0.1".into());
        config.drain_timeout = Duration::from_millis(200);
        tune(&mut config);
        let proxy = Proxy::start(config).await.unwrap();
        assert!(proxy.wait_ready(Duration::from_secs(10)).await);
        let admin = proxy.admin_addr().unwrap();
        Fixture {
            cluster,
            proxy,
            layout,
            admin,
        }
    }

    /// Announce mode instead: the nodes announce the proxy's addresses themselves, the proxy
    /// forwards without rewriting, routes from a file.
    async fn start_announcing() -> Fixture {
        let base = free_port_range(LO, 6);
        let layout = PortLayout::new(u32::from(base), 3, 1, None).unwrap();
        let spec = ClusterSpec::new(3, 1).with_node_config(announce_proxy(LO, layout));
        let cluster = Arc::new(block_in_place(|| ValkeyCluster::start(spec)).unwrap());
        let routes = cluster.root_dir().join("routes.yaml");
        std::fs::write(&routes, routes_yaml(base, &cluster)).unwrap();
        let mut config = ProxyConfig::new(SourceConfig::File {
            path: routes,
            poll: Duration::from_millis(50),
        });
        config.listen_ip = LO.into();
        config.admin_addr = Some(SocketAddr::from((LO, 0)));
        config.rewrite = false;
        config.drain_timeout = Duration::from_millis(200);
        let proxy = Proxy::start(config).await.unwrap();
        assert!(proxy.wait_ready(Duration::from_secs(10)).await);
        let admin = proxy.admin_addr().unwrap();
        Fixture {
            cluster,
            proxy,
            layout,
            admin,
        }
    }

    fn port(&self, n: NodeRef) -> u16 {
        self.layout.port(n).unwrap()
    }

    fn metric(&self, sample: &str) -> f64 {
        metric_value(&get(self.admin, "/metrics").unwrap().1, sample).unwrap()
    }

    /// No reply may hand out a node's own address.
    fn assert_no_internal_address(&self, text: &str) {
        for node in self.cluster.nodes() {
            assert!(
                !text.contains(&node.ip().to_string()),
                "internal {} in {text}",
                node.ip()
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cli_and_redis_benchmark_cluster_through_the_rewriting_proxy() {
    let f = Fixture::start().await;
    let entry = f.port(NodeRef::new(0, 0)).to_string();
    let slot = *f.cluster.spec().initial_slots(2u32).start();
    let key = format!("{}k", slot_tags()[usize::from(slot)]);

    // The nodes hand out their own addresses; the proxy hands out its ports.
    let moved = cli(&["-h", "127.0.0.1", "-p", &entry, "GET", &key]).unwrap();
    assert_eq!(
        moved,
        format!("MOVED {slot} 127.0.0.1:{}", f.port(NodeRef::new(2, 0)))
    );
    for cmd in [
        &["CLUSTER", "SLOTS"][..],
        &["CLUSTER", "SHARDS"],
        &["CLUSTER", "NODES"],
        &["ROLE"],
        &["INFO", "replication"],
    ] {
        let mut args = vec!["-h", "127.0.0.1", "-p", &entry];
        args.extend_from_slice(cmd);
        let text = cli(&args).unwrap();
        f.assert_no_internal_address(&text);
        assert!(
            cmd[0] == "ROLE" || cmd[0] == "INFO" || text.contains("127.0.0.1"),
            "{cmd:?}: {text}"
        );
    }
    // And with RESP3.
    let text = cli(&["-3", "-h", "127.0.0.1", "-p", &entry, "CLUSTER", "SHARDS"]).unwrap();
    f.assert_no_internal_address(&text);

    assert_eq!(
        cli(&["-c", "-h", "127.0.0.1", "-p", &entry, "SET", &key, "v"]).unwrap(),
        "OK"
    );
    assert_eq!(
        cli(&["-c", "-h", "127.0.0.1", "-p", &entry, "GET", &key]).unwrap(),
        "v"
    );

    // redis-benchmark --cluster learns the primaries from CLUSTER NODES.
    let out = block_in_place(|| {
        Command::new(redis_benchmark().unwrap())
            .args([
                "--cluster",
                "-h",
                "127.0.0.1",
                "-p",
                &entry,
                "-n",
                "30000",
                "-c",
                "10",
                "-t",
                "set,get",
                "-r",
                "100000",
                "-q",
            ])
            .output()
            .unwrap()
    });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("SET:") && text.contains("GET:"), "{text}");
    assert!(!text.to_lowercase().contains("error"), "{text}");
    for s in 0..3 {
        let port = f.port(NodeRef::new(s, 0));
        let sent = f.metric(&format!(
            "shardgate_proxy_bytes_total{{port=\"{port}\",direction=\"to_backend\"}}"
        ));
        assert!(
            sent > 100_000.0,
            "redis-benchmark sent only {sent} bytes to shard {s} through {port}"
        );
    }
    assert!(f.metric("shardgate_proxy_rewritten_replies_total{kind=\"cluster_nodes\"}") >= 1.0);
    // The families a check for 0 may not see are listed by hand; they follow the proxy.
    let unlisted = unlisted_label_sets(&get(f.admin, "/metrics").unwrap().1);
    assert!(
        unlisted.is_empty(),
        "not in PROXY_LABELLED_FAMILIES: {unlisted:?}"
    );
    assert_eq!(
        f.metric("shardgate_proxy_rewrite_unknown_addresses_total"),
        0.0
    );
    f.proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_cluster_client_does_10000_cross_shard_set_get() {
    let f = Fixture::start().await;
    let conn = cluster_client(f.port(NodeRef::new(1, 0))).await.unwrap();
    let keys = spread_keys(10_000, "rust");
    let mut tasks = vec![];
    for chunk in keys.chunks(500) {
        let (chunk, mut c) = (chunk.to_vec(), conn.clone());
        tasks.push(tokio::spawn(async move {
            for k in &chunk {
                let _: () = c.set(k, format!("v-{k}")).await.unwrap();
            }
            for k in &chunk {
                assert_eq!(c.get::<_, String>(k).await.unwrap(), format!("v-{k}"));
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    for k in keys.iter().step_by(101) {
        let owner = block_in_place(|| f.cluster.slot_owner(key_slot(k.as_bytes()))).unwrap();
        assert_eq!(
            f.cluster.node(owner).query::<String>(&["GET", k]).unwrap(),
            format!("v-{k}")
        );
    }
    assert!(f.metric("shardgate_proxy_rewritten_replies_total{kind=\"cluster_slots\"}") >= 1.0);
    f.proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_py_cluster_client_does_10000_cross_shard_set_get() {
    let f = Fixture::start().await;
    let script = r#"
import sys
from redis.cluster import RedisCluster
rc = RedisCluster(host="127.0.0.1", port=int(sys.argv[1]), socket_timeout=5)
nodes = sorted(f"{n.host}:{n.port}" for n in rc.get_nodes())
print("nodes", " ".join(nodes))
keys = [f"py:{{{i % 997}}}:{i}" for i in range(10000)]
for k in keys:
    assert rc.set(k, k[::-1])
bad = [k for k in keys if rc.get(k) != k[::-1].encode()]
print("ok", len(keys) - len(bad))
sys.exit(1 if bad else 0)
"#;
    let entry = f.port(NodeRef::new(2, 1)).to_string();
    let out = block_in_place(|| {
        Command::new(python_with_redis().unwrap())
            .args(["-c", script, &entry])
            .output()
            .unwrap()
    });
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("ok 10000"), "{stdout}");
    // redis-py knows exactly the proxy's six ports.
    let mut want: Vec<String> = f
        .cluster
        .nodes()
        .iter()
        .map(|n| format!("127.0.0.1:{}", f.port(n.pos)))
        .collect();
    want.sort();
    let nodes_line = stdout.lines().find(|l| l.starts_with("nodes ")).unwrap();
    assert_eq!(nodes_line, format!("nodes {}", want.join(" ")));
    f.proxy.shutdown().await;
}

/// What the writers saw. The test moves `phase` on before and after each fault; a write
/// counts for the phase that was current when it was sent, so an acknowledgement in a phase
/// begun after a fault settled proves that writes go through after that fault.
#[derive(Default)]
struct Ledger {
    phase: AtomicU32,
    /// SETs sent, per phase.
    sent: Mutex<BTreeMap<u32, u64>>,
    /// Per key: the last acknowledged value and the phase its SET was sent in.
    acked: Mutex<BTreeMap<String, (u64, u32)>>,
    /// Every SET the client gave up on (after its own retries): its phase and the error.
    errors: Mutex<Vec<(u32, String)>>,
    /// The names of the phases after the first (the warm-up).
    names: Mutex<Vec<&'static str>>,
}

impl Ledger {
    /// Starts the next phase; writes sent from now on count for it. Returns its number.
    fn begin(&self, name: &'static str) -> u32 {
        let mut names = self.names.lock().unwrap();
        names.push(name);
        self.phase.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// What the writers sent and what failed, phase by phase.
    fn print(&self) {
        let names = self.names.lock().unwrap();
        let sent = self.sent.lock().unwrap();
        for (phase, name) in std::iter::once(&"warm-up").chain(names.iter()).enumerate() {
            let phase = phase as u32;
            println!(
                "phase {phase} ({name}): {} SETs, {} errors",
                sent.get(&phase).copied().unwrap_or(0),
                self.errors_in(phase)
            );
        }
        for (phase, e) in self.errors.lock().unwrap().iter() {
            println!("phase {phase}: {e}");
        }
    }

    fn errors_in(&self, phase: u32) -> usize {
        let errors = self.errors.lock().unwrap();
        errors.iter().filter(|(p, _)| *p == phase).count()
    }

    /// Waits until every key of `keys` has a SET acknowledged that was sent in `phase` or
    /// later, i.e. after whatever preceded the start of `phase`.
    async fn wait_acked_since(&self, phase: u32, keys: &[String], what: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let missing: Vec<String> = {
                let acked = self.acked.lock().unwrap();
                keys.iter()
                    .filter(|k| acked.get(*k).is_none_or(|&(_, p)| p < phase))
                    .cloned()
                    .collect()
            };
            if missing.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: {} of {} keys have no write acknowledged since phase {phase}, \
                 e.g. {:?}; the client's errors: {:?}",
                missing.len(),
                keys.len(),
                &missing[..missing.len().min(5)],
                self.errors.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Writes rounds of values to `keys` until stopped, recording every outcome in `ledger`.
async fn writer(
    mut conn: redis::cluster_async::ClusterConnection,
    keys: Vec<String>,
    ledger: Arc<Ledger>,
    stop: Arc<AtomicBool>,
) {
    let mut round = 0u64;
    while !stop.load(Ordering::Relaxed) {
        round += 1;
        for k in &keys {
            let phase = ledger.phase.load(Ordering::SeqCst);
            *ledger.sent.lock().unwrap().entry(phase).or_default() += 1;
            match conn.set::<_, _, ()>(k, round).await {
                Ok(()) => {
                    ledger
                        .acked
                        .lock()
                        .unwrap()
                        .insert(k.clone(), (round, phase));
                }
                Err(e) => {
                    ledger
                        .errors
                        .lock()
                        .unwrap()
                        .push((phase, format!("SET {k}: {e}")));
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }
}

async fn assert_nothing_lost(
    conn: &mut redis::cluster_async::ClusterConnection,
    acked: &BTreeMap<String, (u64, u32)>,
) {
    let mut lost = vec![];
    for (k, (v, _)) in acked {
        let got: Option<u64> = conn.get(k).await.unwrap();
        if got.unwrap_or(0) < *v {
            lost.push((k.clone(), *v, got));
        }
    }
    assert!(lost.is_empty(), "acknowledged writes lost: {lost:?}");
}

/// The shard that owns each slot, in the harness's view of the cluster (the first running
/// node's CLUSTER NODES), indexed by slot.
fn slot_shards(cluster: &ValkeyCluster) -> Vec<u32> {
    let asked = cluster.nodes().iter().find(|n| n.is_running()).unwrap().pos;
    let ids = cluster.ids();
    let mut shards = vec![u32::MAX; usize::from(SLOTS)];
    for line in cluster.view(asked).unwrap() {
        if !line.is_primary() {
            continue;
        }
        for &(lo, hi) in &line.slots {
            for slot in lo..=hi {
                shards[usize::from(slot)] = ids[&line.id].shard.0;
            }
        }
    }
    assert!(shards.iter().all(|&s| s != u32::MAX), "slots without owner");
    shards
}

/// How many of `keys` each shard owns (in the harness's view): a check that `keys` reach
/// every shard, so that "every key acknowledged" means "every shard took writes".
fn keys_per_shard(cluster: &ValkeyCluster, keys: &[String]) -> BTreeMap<u32, usize> {
    let shards = slot_shards(cluster);
    let mut per = BTreeMap::new();
    for k in keys {
        *per.entry(shards[usize::from(key_slot(k.as_bytes()))])
            .or_default() += 1;
    }
    assert_eq!(
        per.len(),
        cluster.spec().shards as usize,
        "the keys miss a shard: {per:?}"
    );
    per
}

/// SETs that may fail around a killed primary: the one each writer has in flight when the
/// primary dies (it times out: nobody can say whether it was applied, so the client does
/// not retry it), and one more each while its successor takes over (the client's retries
/// cover most of that time). Seen: 0 or 2.
const KILL_ERRORS: usize = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_migration_and_failover_during_traffic_lose_no_acknowledged_write() {
    faults_under_traffic(Fixture::start().await, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announce_mode_slot_migration_and_failover_during_traffic_lose_no_acknowledged_write() {
    faults_under_traffic(Fixture::start_announcing().await, true).await;
}

/// A slot migration (half done, then whole), a graceful failover and a killed primary with
/// a forced failover, under two writers; `announce`: the nodes announce the proxy's
/// addresses themselves (else the proxy rewrites what they say).
async fn faults_under_traffic(f: Fixture, announce: bool) {
    let proxy_at = |n: NodeRef| SocketAddr::from((LO, f.port(n)));
    // What a raw connection through the proxy's port for `via` gets for `GET key`.
    let reply = |via: NodeRef, key: &str| -> String {
        String::from_utf8_lossy(&block_in_place(|| raw(proxy_at(via), false, &["GET", key])))
            .into_owned()
    };
    // Keys in one slot of shard 0, which moves to shard 1 while they are written.
    let slot = *f.cluster.spec().initial_slots(0u32).start() + 17;
    let tag = &slot_tags()[usize::from(slot)];
    let hot: Vec<String> = (0..200).map(|i| format!("{tag}:hot:{i}")).collect();
    let spread = spread_keys(300, "spread");
    let all: Vec<String> = hot.iter().chain(&spread).cloned().collect();
    let ledger = Arc::new(Ledger::default());
    let stop = Arc::new(AtomicBool::new(false));
    // A client per writer: the redis crate sends ASKING as a request of its own on a
    // multiplexed connection, so a request of another task sharing that connection can
    // take the ASKING flag and the SET bounces between ASK and MOVED until the client's
    // retries run out. That is the client's race, not the proxy's.
    let entry = f.port(NodeRef::new(0, 0));
    let w1 = tokio::spawn(writer(
        cluster_client(entry).await.unwrap(),
        hot.clone(),
        ledger.clone(),
        stop.clone(),
    ));
    let w2 = tokio::spawn(writer(
        cluster_client(entry).await.unwrap(),
        spread.clone(),
        ledger.clone(),
        stop.clone(),
    ));
    // Phase 0: every key written once, so every key exists before the faults.
    ledger.wait_acked_since(0, &all, "before any fault").await;

    // ASK: half of the slot's keys move to shard 1.
    let m = block_in_place(|| f.cluster.begin_slot_migration(slot, 1u32)).unwrap();
    assert_eq!((m.from, m.to), (NodeRef::new(0, 0), NodeRef::new(1, 0)));
    let (moved, stay) = hot.split_at(hot.len() / 2);
    let keys: Vec<&[u8]> = moved.iter().map(|k| k.as_bytes()).collect();
    block_in_place(|| f.cluster.migrate_keys(&m, &keys)).unwrap();
    // A moved key: the source sends the client to the destination's port, ...
    assert_eq!(
        reply(m.from, &moved[0]),
        format!("-ASK {slot} 127.0.0.1:{}\r\n", f.port(m.to))
    );
    // ... the node itself to the destination's own address (or, announcing, the proxy's), ...
    let own = if announce {
        proxy_at(m.to)
    } else {
        f.cluster.node(m.to).addr()
    };
    assert_eq!(
        String::from_utf8_lossy(&block_in_place(|| raw(
            f.cluster.node(m.from).addr(),
            false,
            &["GET", &moved[0]]
        ))),
        format!("-ASK {slot} {own}\r\n")
    );
    // ... and the destination (without ASKING) back to the owner's port.
    assert_eq!(
        reply(m.to, &moved[0]),
        format!("-MOVED {slot} 127.0.0.1:{}\r\n", f.port(m.from))
    );
    // A key not moved yet is still served by the source.
    let value = reply(m.from, &stay[0]);
    assert!(value.starts_with('$'), "{value}");
    let half = ledger.begin("half migrated");
    ledger
        .wait_acked_since(half, &hot, "slot half migrated (ASK)")
        .await;

    // The rest moves key by key under traffic, then the slot is the destination's.
    let cluster = f.cluster.clone();
    let rest: Vec<String> = stay.to_vec();
    tokio::task::spawn_blocking(move || {
        for chunk in rest.chunks(20) {
            let keys: Vec<&[u8]> = chunk.iter().map(|k| k.as_bytes()).collect();
            cluster.migrate_keys(&m, &keys)?;
        }
        cluster.finish_slot_migration(&m)
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(
        block_in_place(|| f.cluster.slot_owner(slot)).unwrap(),
        NodeRef::new(1, 0)
    );
    assert_eq!(
        reply(NodeRef::new(0, 0), &hot[0]),
        format!("-MOVED {slot} 127.0.0.1:{}\r\n", f.port(NodeRef::new(1, 0)))
    );
    let migrated = ledger.begin("migrated");
    ledger
        .wait_acked_since(migrated, &all, "slot migrated")
        .await;

    // MOVED to the new primary: shard 2's replica takes over, gracefully.
    ledger.begin("failing over");
    block_in_place(|| f.cluster.failover(NodeRef::new(2, 1))).unwrap();
    let primary = block_in_place(|| f.cluster.primary_of(2u32)).unwrap();
    assert_eq!(primary, NodeRef::new(2, 1));
    let key2 = spread
        .iter()
        .find(|k| {
            f.cluster
                .spec()
                .initial_slots(2u32)
                .contains(&key_slot(k.as_bytes()))
        })
        .unwrap();
    let slot2 = key_slot(key2.as_bytes());
    let want = format!("-MOVED {slot2} 127.0.0.1:{}\r\n", f.port(primary));
    assert_eq!(
        reply(NodeRef::new(2, 0), key2),
        want,
        "from the old primary"
    );
    assert_eq!(reply(NodeRef::new(0, 0), key2), want, "from another shard");
    let failed_over = ledger.begin("failed over");
    ledger
        .wait_acked_since(failed_over, &all, "graceful failover")
        .await;
    let per_shard = block_in_place(|| keys_per_shard(&f.cluster, &all));

    // Shard 1's primary (which now holds the hot slot) is killed, once its replica has every
    // write it acknowledged, and the replica is forced over (and only forced: it may not
    // take over on its own, so the forced failover is the one the test waits for).
    let killing = ledger.begin("killing");
    block_in_place(|| {
        f.cluster
            .config_set(NodeRef::new(1, 1), "cluster-replica-no-failover", "yes")?;
        f.cluster
            .pause_writes_until_replicated(NodeRef::new(1, 0), Duration::from_secs(20))?;
        f.cluster.kill(NodeRef::new(1, 0));
        f.cluster.failover(NodeRef::new(1, 1))
    })
    .unwrap();
    assert_eq!(
        block_in_place(|| f.cluster.primary_of(1u32)).unwrap(),
        NodeRef::new(1, 1)
    );
    assert_eq!(
        reply(NodeRef::new(0, 0), &hot[0]),
        format!("-MOVED {slot} 127.0.0.1:{}\r\n", f.port(NodeRef::new(1, 1)))
    );
    let after_kill = ledger.begin("after kill");
    ledger
        .wait_acked_since(after_kill, &all, "killed primary, forced failover")
        .await;

    stop.store(true, Ordering::Relaxed);
    w1.await.unwrap();
    w2.await.unwrap();
    println!("{} mode:", if announce { "announce" } else { "rewrite" });
    ledger.print();
    println!("keys per shard: {per_shard:?}");
    // The client retries MOVED, ASK and a paused primary itself: no SET fails, except while
    // a killed primary has no successor yet, and then only a few.
    let errors = ledger.errors.lock().unwrap().clone();
    assert!(
        errors.iter().all(|(p, _)| *p == killing),
        "errors outside the kill: {errors:?}"
    );
    assert!(
        errors.len() <= KILL_ERRORS,
        "{} errors (at most {KILL_ERRORS}): {errors:?}",
        errors.len()
    );

    let acked = ledger.acked.lock().unwrap().clone();
    let mut check = cluster_client(f.port(NodeRef::new(0, 0))).await.unwrap();
    assert_nothing_lost(&mut check, &acked).await;
    assert_eq!(
        f.metric("shardgate_proxy_rewrite_unknown_addresses_total"),
        0.0
    );
    f.proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_address_is_forwarded_whole_counted_and_triggers_a_refresh() {
    // Discovery every minute only: what follows must come from the refresh on demand.
    let f = Fixture::start_with(|c| {
        if let SourceConfig::Seed { refresh, .. } = &mut c.source {
            *refresh = Duration::from_secs(60);
        }
    })
    .await;
    let primary = f.port(NodeRef::new(1, 0)).to_string();
    // Shard 1's replica is rescheduled at a new address the proxy has not seen.
    let moved = NodeRef::new(1, 1);
    block_in_place(|| {
        f.cluster
            .restart(moved, shardgate_harness::valkey::Restart::NewAddress)
    })
    .unwrap();
    let new_ip = f.cluster.node(moved).ip().to_string();
    // The primary names its replica in INFO replication; wait until it does at the new address.
    let direct = f.cluster.node(NodeRef::new(1, 0)).addr();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !cli(&["-h", &direct.ip().to_string(), "INFO", "replication"])
        .unwrap()
        .contains(&new_ip)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the primary never saw its replica's new address"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let version = f.proxy.routes().borrow().version;

    let first = cli(&["-h", "127.0.0.1", "-p", &primary, "INFO", "replication"]).unwrap();
    let line = first
        .lines()
        .find(|l| l.starts_with("slave0:"))
        .unwrap()
        .to_string();
    assert!(
        line.contains(&format!("ip={new_ip},port=6379")),
        "not forwarded whole: {line}"
    );
    assert!(f.metric("shardgate_proxy_rewrite_unknown_addresses_total") >= 1.0);

    let mut rx = f.proxy.routes();
    tokio::time::timeout(
        Duration::from_secs(10),
        rx.wait_for(|t| t.version > version),
    )
    .await
    .expect("no refresh after an unknown address")
    .unwrap();
    let second = cli(&["-h", "127.0.0.1", "-p", &primary, "INFO", "replication"]).unwrap();
    let line = second
        .lines()
        .find(|l| l.starts_with("slave0:"))
        .unwrap()
        .to_string();
    assert!(
        line.contains(&format!("ip=127.0.0.1,port={}", f.port(moved))),
        "{line}"
    );
    f.proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topology_reply_past_the_frame_limit_closes_the_connection_with_an_error() {
    let f = Fixture::start_with(|c| c.limits.max_frame = 256).await;
    let entry = f.port(NodeRef::new(0, 0)).to_string();
    // A small reply still passes; CLUSTER NODES for six nodes is about 700 bytes.
    assert_eq!(
        cli(&["-h", "127.0.0.1", "-p", &entry, "PING"]).unwrap(),
        "PONG"
    );
    let out = Command::new(redis_cli().unwrap())
        .args(["-h", "127.0.0.1", "-p", &entry, "CLUSTER", "NODES"])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    f.assert_no_internal_address(&text);
    assert!(
        !text.contains("connected"),
        "the oversized reply went through: {text}"
    );
    // Valid RESP, merely past a limit: not counted as a protocol error.
    assert_eq!(
        f.metric("shardgate_proxy_connections_closed_total{reason=\"limit_exceeded\"}"),
        1.0
    );
    assert_eq!(
        f.metric("shardgate_proxy_protocol_errors_total{reason=\"backend\"}"),
        0.0
    );
    f.proxy.shutdown().await;
}

/// One command over a fresh connection (after `HELLO 3` if `resp3`); the reply's raw bytes.
fn raw(addr: SocketAddr, resp3: bool, args: &[&str]) -> Vec<u8> {
    raw_padded(addr, resp3, 0, args)
}

/// As [`raw`], with `ECHO <pad bytes>` pipelined before the command when `pad > 0`: both
/// replies leave the node in one write, so a proxy reading `n` bytes at a time cuts the
/// command's reply `n - len(ECHO reply)` bytes in.
fn raw_padded(addr: SocketAddr, resp3: bool, pad: usize, args: &[&str]) -> Vec<u8> {
    use shardgate_proxy::resp::{Scan, Scanner};
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let encode = |args: &[&str]| {
        let mut out = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            out.extend_from_slice(format!("${}\r\n{a}\r\n", a.len()).as_bytes());
        }
        out
    };
    let mut frames = vec![];
    let mut request = vec![];
    if resp3 {
        request.extend(encode(&["HELLO", "3"]));
    }
    let padding = "x".repeat(pad);
    if pad > 0 {
        request.extend(encode(&["ECHO", &padding]));
    }
    request.extend(encode(args));
    s.write_all(&request).unwrap();
    // `frame` is where the frame in progress starts; `pos` where the scanner resumes.
    let (mut buf, mut scanner, mut frame, mut pos) = (vec![], Scanner::default(), 0, 0);
    let mut chunk = [0u8; 16384];
    while frames.len() < 1 + usize::from(resp3) + usize::from(pad > 0) {
        let n = s.read(&mut chunk).unwrap();
        assert!(n > 0, "closed before the reply");
        buf.extend_from_slice(&chunk[..n]);
        while pos < buf.len() {
            match scanner.scan(&buf, pos).unwrap() {
                Scan::Complete { end } => {
                    frames.push(buf[frame..end].to_vec());
                    (frame, pos) = (end, end);
                }
                Scan::Incomplete => pos = buf.len(),
            }
        }
    }
    if pad > 0 {
        let echo = &frames[frames.len() - 2];
        assert_eq!(echo, &format!("${pad}\r\n{padding}\r\n").into_bytes());
    }
    frames.pop().unwrap()
}

/// The `ECHO` padding that makes a proxy reading `buffer` bytes at a time cut the next reply
/// `at` bytes in (the ECHO reply is `$<pad>\r\n<pad bytes>\r\n`).
/// Where no ECHO reply has that length (`$9` to `$10` adds a digit), the cut is a byte later.
fn pad_to_cut(buffer: usize, at: usize) -> usize {
    let echo_len = |p: usize| 1 + p.to_string().len() + 2 + p + 2;
    let echo = buffer - at;
    (1..echo)
        .find(|&p| echo_len(p) == echo)
        .or_else(|| (1..echo).find(|&p| echo_len(p) == echo - 1))
        .unwrap_or_else(|| panic!("no ECHO reply is {echo} bytes long"))
}

/// The leaves of a frame in order: strings as they are, integers as `:<digits>`.
fn leaves(f: &shardgate_proxy::resp::frame::Frame<'_>, out: &mut Vec<String>) {
    use shardgate_proxy::resp::frame::Frame;
    match f {
        Frame::Array(_, items) => items.iter().for_each(|i| leaves(i, out)),
        Frame::Map(pairs) => pairs.iter().for_each(|(k, v)| {
            leaves(k, out);
            leaves(v, out);
        }),
        Frame::Int(digits) => out.push(format!(":{}", String::from_utf8_lossy(digits))),
        other => out.push(String::from_utf8_lossy(other.as_bytes().unwrap_or(b"?")).into_owned()),
    }
}

/// Volatile fields out (ping/pong times, replication offsets, lag), order made canonical.
fn normalize(cmd: &str, reply: &[u8]) -> String {
    use shardgate_proxy::resp::frame::{encode, parse, Frame};
    let text = String::from_utf8_lossy(reply).to_string();
    // A CLUSTER NODES line with its ping and pong times zeroed.
    let node_line = |l: &str| {
        let mut f: Vec<&str> = l.split(' ').collect();
        if f.len() > 5 {
            f[4] = "0";
            f[5] = "0";
        }
        f.join(" ")
    };
    match cmd {
        "NODES" => {
            let body = text.split_once("\r\n").unwrap().1;
            let body = body.strip_prefix("txt:").unwrap_or(body);
            let mut lines: Vec<String> = body
                .trim_end_matches("\r\n")
                .lines()
                .map(node_line)
                .collect();
            lines.sort();
            lines.join("\n")
        }
        "REPLICAS" => {
            let (f, _) = parse(reply).unwrap();
            let mut lines = vec![];
            leaves(&f, &mut lines);
            let mut lines: Vec<String> = lines.iter().map(|l| node_line(l.trim_end())).collect();
            lines.sort();
            lines.join("\n")
        }
        "ROLE" => {
            // `master <offset> [[ip port offset] ...]` or `slave ip port state offset`.
            let (f, _) = parse(reply).unwrap();
            let mut words = vec![];
            leaves(&f, &mut words);
            if words[0] == "master" {
                words[1] = ":0".into();
                for w in words.iter_mut().skip(4).step_by(3) {
                    *w = "0".into();
                }
            } else if let Some(offset) = words.get_mut(4) {
                *offset = ":0".into();
            }
            words.join(" ")
        }
        "INFO" => {
            let body = text.split_once("\r\n").unwrap().1;
            let body = body.strip_prefix("txt:").unwrap_or(body);
            body.trim_end_matches("\r\n")
                .lines()
                .filter(|l| {
                    let key = l.split(':').next().unwrap_or_default();
                    !(key.contains("offset")
                        || key.starts_with("repl_backlog")
                        || key.starts_with("master_last_io")
                        || key.starts_with("master_replid"))
                })
                .map(|l| {
                    if l.starts_with("slave") {
                        l.split(',')
                            .map(|kv| match kv.split_once('=') {
                                Some(("offset" | "lag", _)) => {
                                    kv.split('=').next().unwrap().to_string() + "=0"
                                }
                                _ => kv.to_string(),
                            })
                            .collect::<Vec<_>>()
                            .join(",")
                    } else {
                        l.to_string()
                    }
                })
                .collect::<Vec<_>>()
                .join("\n")
        }
        "SHARDS" => {
            let (mut f, _) = parse(reply).unwrap();
            fn zero_offsets(f: &mut Frame<'_>) {
                match f {
                    Frame::Array(_, items) => {
                        for i in 0..items.len() {
                            if i + 1 < items.len()
                                && items[i].as_bytes() == Some(b"replication-offset")
                            {
                                items[i + 1] = Frame::Int(b"0"[..].into());
                            }
                            zero_offsets(&mut items[i]);
                        }
                    }
                    Frame::Map(pairs) => {
                        for (k, v) in pairs.iter_mut() {
                            if k.as_bytes() == Some(b"replication-offset") {
                                *v = Frame::Int(b"0"[..].into());
                            }
                            zero_offsets(v);
                        }
                    }
                    _ => {}
                }
            }
            zero_offsets(&mut f);
            let Frame::Array(_, shards) = f else {
                panic!("not an array")
            };
            let mut each: Vec<String> = shards
                .iter()
                .map(|s| {
                    let mut out = vec![];
                    encode(s, &mut out);
                    String::from_utf8_lossy(&out).into_owned()
                })
                .collect();
            each.sort();
            each.join("")
        }
        _ => text,
    }
}

/// One reply the oracle test compares: `args` sent through the proxy's port for `node` and
/// straight to the node; `kind` picks the normalization.
struct Case {
    kind: &'static str,
    node: NodeRef,
    args: Vec<String>,
    resp3: bool,
}

impl Case {
    fn new(kind: &'static str, node: NodeRef, args: &[&str], resp3: bool) -> Case {
        Case {
            kind,
            node,
            args: args.iter().map(|a| a.to_string()).collect(),
            resp3,
        }
    }

    fn args(&self) -> Vec<&str> {
        self.args.iter().map(String::as_str).collect()
    }

    fn name(&self) -> String {
        format!(
            "{} at node {} (RESP{})",
            self.args.join(" "),
            self.node,
            if self.resp3 { 3 } else { 2 }
        )
    }

    /// Answered by Valkey itself once it announces the proxy's addresses; ROLE and INFO
    /// name replication peers, which the cluster's client announcements do not cover.
    fn valkey_announces(&self) -> bool {
        !matches!(self.kind, "ROLE" | "INFO")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewritten_replies_equal_what_valkey_itself_announces() {
    replies_equal_what_valkey_announces(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewritten_replies_split_across_reads_equal_what_valkey_itself_announces() {
    // The smallest read buffer the proxy uses: every topology reply is longer, and each
    // shorter one is cut at its start, middle and end by an ECHO pipelined before it.
    replies_equal_what_valkey_announces(Some(MIN_BUFFER_SIZE)).await;
}

/// Ground truth: the same cluster, asked to announce the proxy's addresses itself
/// (cluster-announce-client-ipv4 + cluster-announce-client-port), must say exactly what the
/// rewriting proxy said on its behalf. For ROLE and INFO replication, which Valkey cannot
/// be made to announce that way, the truth is the node's own reply with each peer's address
/// replaced by hand: `127.0.0.1` and the port the layout gives that node.
async fn replies_equal_what_valkey_announces(buffer_size: Option<usize>) {
    let f = Fixture::start_with(|c| {
        if let Some(size) = buffer_size {
            c.buffer_size = size;
        }
    })
    .await;
    let (p0, r0) = (NodeRef::new(0, 0), NodeRef::new(0, 1));
    // A key of shard 2 asked at shard 0 (MOVED); a slot of shard 0 half moved to shard 1,
    // with its one key already there (ASK), for the whole test.
    let moved_key = format!(
        "{}:k",
        slot_tags()[usize::from(*f.cluster.spec().initial_slots(2u32).start() + 5)]
    );
    let ask_slot = *f.cluster.spec().initial_slots(0u32).start() + 9;
    let ask_key = format!("{}:k", slot_tags()[usize::from(ask_slot)]);
    block_in_place(|| {
        f.cluster.node(p0).query::<()>(&["SET", &ask_key, "v"])?;
        let m = f.cluster.begin_slot_migration(ask_slot, 1u32)?;
        f.cluster.migrate_keys(&m, &[ask_key.as_bytes()])
    })
    .unwrap();
    let p0_id = f.cluster.node(p0).node_id.clone();
    let mut cases = vec![];
    for r3 in [false, true] {
        for c in ["SLOTS", "SHARDS", "NODES"] {
            cases.push(Case::new(c, p0, &["CLUSTER", c], r3));
        }
        cases.push(Case::new(
            "REPLICAS",
            p0,
            &["CLUSTER", "REPLICAS", &p0_id],
            r3,
        ));
        cases.push(Case::new("MOVED", p0, &["GET", &moved_key], r3));
        cases.push(Case::new("ASK", p0, &["GET", &ask_key], r3));
        for n in [p0, r0] {
            cases.push(Case::new("ROLE", n, &["ROLE"], r3));
            cases.push(Case::new("INFO", n, &["INFO", "replication"], r3));
        }
    }
    let direct = |n: NodeRef| f.cluster.node(n).addr();
    let proxied = |n: NodeRef| SocketAddr::from((LO, f.port(n)));
    // Replicas still syncing are left out of CLUSTER SLOTS: start from a settled view.
    let deadline = Instant::now() + Duration::from_secs(15);
    while block_in_place(|| {
        let slots = raw(direct(p0), false, &["CLUSTER", "SLOTS"]);
        f.cluster
            .nodes()
            .iter()
            .any(|n| !String::from_utf8_lossy(&slots).contains(&n.node_id))
    }) {
        assert!(
            Instant::now() < deadline,
            "CLUSTER SLOTS never listed every node"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Each reply through the proxy: once whole, and with a small buffer cut at its start,
    // middle and end (RESP2; the pipelined HELLO of RESP3 moves the cut).
    let mut rewritten = vec![];
    let mut cuts = 0;
    for case in &cases {
        let whole = block_in_place(|| raw(proxied(case.node), case.resp3, &case.args()));
        let want = normalize(case.kind, &whole);
        if let (Some(size), false) = (buffer_size, case.resp3) {
            if whole.len() < size {
                for at in [1, whole.len() / 2, whole.len() - 1] {
                    let pad = pad_to_cut(size, at);
                    let got =
                        block_in_place(|| raw_padded(proxied(case.node), false, pad, &case.args()));
                    assert_eq!(
                        normalize(case.kind, &got),
                        want,
                        "{}: cut {at} bytes in",
                        case.name()
                    );
                    cuts += 1;
                }
            }
        }
        rewritten.push(want);
    }
    if buffer_size.is_some() {
        println!("{cuts} replies cut across reads");
        assert!(cuts >= 12, "only {cuts} cuts");
    }
    // Without rewriting, the same node says something else: its internal addresses.
    let internal = |n: NodeRef| f.cluster.node(n).ip().to_string();
    for (case, r) in cases.iter().zip(&rewritten) {
        let plain = block_in_place(|| {
            normalize(case.kind, &raw(direct(case.node), case.resp3, &case.args()))
        });
        assert_ne!(&plain, r, "{}: the proxy changed nothing", case.name());
        assert!(
            r.contains("127.0.0.1")
                && f.cluster
                    .nodes()
                    .iter()
                    .all(|n| !r.contains(&n.ip().to_string())),
            "{}: {r}",
            case.name()
        );
        if !case.valkey_announces() {
            // The node's own reply, each peer's address replaced by hand.
            let mut truth = plain.clone();
            for n in f.cluster.nodes() {
                let port = f.port(n.pos);
                let ip = internal(n.pos);
                truth = truth
                    // ROLE: a primary's replicas (port as a string), a replica's primary.
                    .replace(&format!(" {ip} 6379 "), &format!(" 127.0.0.1 {port} "))
                    .replace(&format!(" {ip} :6379 "), &format!(" 127.0.0.1 :{port} "))
                    // INFO replication.
                    .replace(
                        &format!("ip={ip},port=6379,"),
                        &format!("ip=127.0.0.1,port={port},"),
                    )
                    .replace(&format!("master_host:{ip}\n"), "master_host:127.0.0.1\n");
                if plain.contains(&format!("master_host:{ip}\n")) {
                    truth = truth.replace("master_port:6379\n", &format!("master_port:{port}\n"));
                }
            }
            assert_eq!(r, &truth, "{}", case.name());
        }
    }
    let Fixture {
        cluster,
        proxy,
        layout,
        ..
    } = f;
    proxy.shutdown().await;

    block_in_place(|| {
        for node in cluster.nodes() {
            let port = layout.port(node.pos).unwrap().to_string();
            cluster
                .config_set(node.pos, "cluster-announce-client-ipv4", "127.0.0.1")
                .unwrap();
            cluster
                .config_set(node.pos, "cluster-announce-client-port", &port)
                .unwrap();
        }
        // Announcements take a few seconds to reach every node.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let nodes = String::from_utf8_lossy(&raw(
                cluster.node(p0).addr(),
                false,
                &["CLUSTER", "NODES"],
            ))
            .to_string();
            if cluster
                .nodes()
                .iter()
                .all(|n| !nodes.contains(&format!("{}:", n.ip())))
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "announcements never spread: {nodes}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        for (case, want) in cases.iter().zip(&rewritten) {
            if !case.valkey_announces() {
                continue;
            }
            // The view settles over gossip (a node may briefly miss from it): the truth must
            // reach what the proxy said, soon.
            let deadline = Instant::now() + Duration::from_secs(15);
            loop {
                let truth = normalize(
                    case.kind,
                    &raw(cluster.node(case.node).addr(), case.resp3, &case.args()),
                );
                if &truth == want {
                    break;
                }
                if Instant::now() > deadline {
                    assert_eq!(&truth, want, "{} differs from Valkey's own", case.name());
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    });
}
