//! The rewriting proxy in front of a real Valkey 9 cluster whose nodes announce their
//! internal addresses only (no announce flags): redis-cli, redis-benchmark --cluster, the
//! redis crate's cluster client and redis-py's RedisCluster all work through it, also while
//! a slot migrates (ASK) and while a primary fails over (MOVED to the new primary).

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use redis::AsyncCommands;
use shardgate_crds::{NodeRef, PortLayout};
use shardgate_harness::addr::free_port_range;
use shardgate_harness::clients::{cli, cluster_client, spread_keys};
use shardgate_harness::http::{get, metric};
use shardgate_harness::tools::{python_with_redis, redis_benchmark, redis_cli};
use shardgate_harness::valkey::{key_slot, slot_tags, ClusterSpec, ValkeyCluster};
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

    fn port(&self, n: NodeRef) -> u16 {
        self.layout.port(n).unwrap()
    }

    fn metric(&self, sample: &str) -> f64 {
        metric(&get(self.admin, "/metrics").unwrap().1, sample).unwrap_or(0.0)
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

/// Writes rounds of values to `keys` until stopped; returns the last acknowledged value of each.
async fn writer(
    mut conn: redis::cluster_async::ClusterConnection,
    keys: Vec<String>,
    stop: Arc<AtomicBool>,
) -> BTreeMap<String, u64> {
    let mut acked = BTreeMap::new();
    let mut round = 0u64;
    while !stop.load(Ordering::Relaxed) {
        round += 1;
        for k in &keys {
            if conn.set::<_, _, ()>(k, round).await.is_ok() {
                acked.insert(k.clone(), round);
            } else {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    acked
}

async fn assert_nothing_lost(
    conn: &mut redis::cluster_async::ClusterConnection,
    acked: &BTreeMap<String, u64>,
) {
    let mut lost = vec![];
    for (k, v) in acked {
        let got: Option<u64> = conn.get(k).await.unwrap();
        if got.unwrap_or(0) < *v {
            lost.push((k.clone(), *v, got));
        }
    }
    assert!(lost.is_empty(), "acknowledged writes lost: {lost:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_migration_and_failover_during_traffic_lose_no_acknowledged_write() {
    let f = Fixture::start().await;
    let conn = cluster_client(f.port(NodeRef::new(0, 0))).await.unwrap();
    // Keys in one slot of shard 0, which moves to shard 1 while they are written.
    let slot = *f.cluster.spec().initial_slots(0u32).start() + 17;
    let tag = &slot_tags()[usize::from(slot)];
    let hot: Vec<String> = (0..200).map(|i| format!("{tag}:hot:{i}")).collect();
    let spread = spread_keys(300, "spread");
    let stop = Arc::new(AtomicBool::new(false));
    let w1 = tokio::spawn(writer(conn.clone(), hot.clone(), stop.clone()));
    let w2 = tokio::spawn(writer(conn.clone(), spread.clone(), stop.clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;

    // ASK: the slot migrates key by key under traffic.
    let cluster = f.cluster.clone();
    let hot_keys = hot.clone();
    tokio::task::spawn_blocking(move || {
        let m = cluster.begin_slot_migration(slot, 1u32)?;
        for chunk in hot_keys.chunks(20) {
            let keys: Vec<&[u8]> = chunk.iter().map(|k| k.as_bytes()).collect();
            cluster.migrate_keys(&m, &keys)?;
            std::thread::sleep(Duration::from_millis(50));
        }
        cluster.finish_slot_migration(&m)
    })
    .await
    .unwrap()
    .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        block_in_place(|| f.cluster.slot_owner(slot))
            .unwrap()
            .shard
            .0,
        1
    );

    // MOVED to the new primary: shard 2's replica takes over, gracefully.
    let cluster = f.cluster.clone();
    tokio::task::spawn_blocking(move || cluster.failover(NodeRef::new(2, 1)))
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(800)).await;

    stop.store(true, Ordering::Relaxed);
    let (hot_acked, spread_acked) = (w1.await.unwrap(), w2.await.unwrap());
    assert_eq!(hot_acked.len(), hot.len());
    assert_eq!(spread_acked.len(), spread.len());
    let mut check = cluster_client(f.port(NodeRef::new(1, 1))).await.unwrap();
    assert_nothing_lost(&mut check, &hot_acked).await;
    assert_nothing_lost(&mut check, &spread_acked).await;

    assert!(
        f.metric("shardgate_proxy_rewritten_replies_total{kind=\"ask\"}") >= 1.0,
        "no ASK went through the proxy"
    );
    assert!(
        f.metric("shardgate_proxy_rewritten_replies_total{kind=\"moved\"}") >= 1.0,
        "no MOVED went through the proxy"
    );
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
    assert_eq!(
        f.metric("shardgate_proxy_protocol_errors_total{reason=\"backend\"}"),
        1.0
    );
    f.proxy.shutdown().await;
}

/// One command over a fresh connection (after `HELLO 3` if `resp3`); the reply's raw bytes.
fn raw(addr: SocketAddr, resp3: bool, args: &[&str]) -> Vec<u8> {
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
    if resp3 {
        s.write_all(&encode(&["HELLO", "3"])).unwrap();
    }
    s.write_all(&encode(args)).unwrap();
    // `frame` is where the frame in progress starts; `pos` where the scanner resumes.
    let (mut buf, mut scanner, mut frame, mut pos) = (vec![], Scanner::default(), 0, 0);
    let mut chunk = [0u8; 16384];
    while frames.len() < 1 + usize::from(resp3) {
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
    frames.pop().unwrap()
}

/// Volatile fields out (ping/pong times, replication offsets), order made canonical.
fn normalize(cmd: &str, reply: &[u8]) -> String {
    use shardgate_proxy::resp::frame::{encode, parse, Frame};
    let text = String::from_utf8_lossy(reply).to_string();
    match cmd {
        "NODES" => {
            let body = text.split_once("\r\n").unwrap().1;
            let body = body.strip_prefix("txt:").unwrap_or(body);
            let mut lines: Vec<String> = body
                .trim_end_matches("\r\n")
                .lines()
                .map(|l| {
                    let mut f: Vec<&str> = l.split(' ').collect();
                    if f.len() > 5 {
                        f[4] = "0";
                        f[5] = "0";
                    }
                    f.join(" ")
                })
                .collect();
            lines.sort();
            lines.join("\n")
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewritten_replies_equal_what_valkey_itself_announces() {
    // Ground truth: the same cluster, asked to announce the proxy's addresses itself
    // (cluster-announce-client-ipv4 + cluster-announce-client-port), must say exactly what
    // the rewriting proxy said on its behalf.
    let f = Fixture::start().await;
    let entry = SocketAddr::from((LO, f.port(NodeRef::new(0, 0))));
    let direct = f.cluster.node(NodeRef::new(0, 0)).addr();
    let cases = [
        ("SLOTS", false),
        ("SLOTS", true),
        ("SHARDS", false),
        ("SHARDS", true),
        ("NODES", false),
        ("NODES", true),
    ];
    // Replicas still syncing are left out of CLUSTER SLOTS: start from a settled view.
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while block_in_place(|| {
        let slots = raw(direct, false, &["CLUSTER", "SLOTS"]);
        f.cluster
            .nodes()
            .iter()
            .any(|n| !String::from_utf8_lossy(&slots).contains(&n.node_id))
    }) {
        assert!(
            std::time::Instant::now() < deadline,
            "CLUSTER SLOTS never listed every node"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rewritten: Vec<String> = block_in_place(|| {
        cases
            .iter()
            .map(|(c, r3)| normalize(c, &raw(entry, *r3, &["CLUSTER", c])))
            .collect()
    });
    // Without rewriting, the same node says something else: its internal addresses.
    for ((c, r3), r) in cases.iter().zip(&rewritten) {
        let plain = block_in_place(|| normalize(c, &raw(direct, *r3, &["CLUSTER", c])));
        assert_ne!(&plain, r, "CLUSTER {c}: the proxy changed nothing");
        assert!(
            r.contains("127.0.0.1") && plain.contains(&direct.ip().to_string()),
            "{r}\n{plain}"
        );
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
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let slots =
                String::from_utf8_lossy(&raw(direct, false, &["CLUSTER", "NODES"])).to_string();
            if cluster
                .nodes()
                .iter()
                .all(|n| !slots.contains(&format!("{}:", n.ip())))
            {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "announcements never spread: {slots}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        for ((c, r3), want) in cases.iter().zip(&rewritten) {
            // The view settles over gossip (a node may briefly miss from it): the truth must
            // reach what the proxy said, soon.
            let deadline = std::time::Instant::now() + Duration::from_secs(15);
            loop {
                let truth = normalize(c, &raw(direct, *r3, &["CLUSTER", c]));
                if &truth == want {
                    break;
                }
                let protocol = if *r3 { 3 } else { 2 };
                if std::time::Instant::now() > deadline {
                    assert_eq!(
                        &truth, want,
                        "CLUSTER {c} (RESP{protocol}) differs from Valkey's own"
                    );
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    });
}
