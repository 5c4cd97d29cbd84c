//! Seed discovery: the proxy learns a real cluster from one node with CLUSTER SHARDS, gives
//! every node a stable port, and follows failovers, restarts at new addresses, and the loss
//! of its seed.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use shardgate_crds::{NodeRef, PortLayout};
use shardgate_harness::addr::free_port_range;
use shardgate_harness::valkey::{ClusterSpec, Restart, ValkeyCluster};
use shardgate_proxy::model::{Backend, RouteTable};
use shardgate_proxy::{Proxy, ProxyConfig, ProxyHandle, Snapshot, SourceConfig};
use tokio::task::block_in_place;

const LO: Ipv4Addr = Ipv4Addr::LOCALHOST;

/// `CLUSTER MYID` asked through a proxy port: which node is really behind it.
fn myid_through(port: u16) -> String {
    let mut s = TcpStream::connect((LO, port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"*2\r\n$7\r\nCLUSTER\r\n$4\r\nMYID\r\n")
        .unwrap();
    let mut buf = [0u8; 128];
    let mut got = 0;
    // `$40\r\n<id>\r\n` is 47 bytes.
    while got < 47 {
        let n = s.read(&mut buf[got..]).unwrap();
        assert!(n > 0, "port {port} closed the connection");
        got += n;
    }
    String::from_utf8_lossy(&buf[5..45]).into_owned()
}

/// The seed source's errors so far, from `/metrics` (the metric must be there).
fn source_errors(proxy: &ProxyHandle) -> f64 {
    let admin = proxy.admin_addr().expect("the test proxy serves /metrics");
    let (_, body) = shardgate_harness::http::get(admin, "/metrics").unwrap();
    shardgate_harness::http::metric_value(
        &body,
        "shardgate_proxy_route_source_errors_total{source=\"seed\"}",
    )
    .unwrap()
}

/// Waits until the seed source has reported more than `n` errors.
async fn wait_source_errors(proxy: &ProxyHandle, n: f64) -> f64 {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let now = block_in_place(|| source_errors(proxy));
        if now > n {
            return now;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the seed source reported no error past {n}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn wait_table(proxy: &ProxyHandle, what: &str, ok: impl Fn(&RouteTable) -> bool) {
    let mut rx = proxy.routes();
    tokio::time::timeout(Duration::from_secs(20), rx.wait_for(|t| ok(t)))
        .await
        .unwrap_or_else(|_| {
            panic!(
                "route table never showed {what}: {:?}",
                proxy.routes().borrow()
            )
        })
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_discovery_gives_every_node_a_stable_port_and_follows_the_cluster() {
    let cluster = block_in_place(|| ValkeyCluster::start(ClusterSpec::new(3, 1))).unwrap();
    let base = free_port_range(LO, 6);
    let layout = PortLayout::new(u32::from(base), 3, 1, None).unwrap();
    let seed = cluster.node(NodeRef::new(0, 0)).addr();
    let mut config = ProxyConfig::new(SourceConfig::Seed {
        seeds: vec![Backend::ip(seed)],
        base_port: base,
        ports_per_shard: None,
        refresh: Duration::from_millis(200),
    });
    config.listen_ip = LO.into();
    config.admin_addr = Some((LO, 0).into());
    config.connect_timeout = Duration::from_millis(500);
    let proxy = Proxy::start(config).await.unwrap();
    assert!(proxy.wait_ready(Duration::from_secs(10)).await);

    // First discovery: shards by slot, primary first — the harness's own numbering.
    let table = proxy.routes().borrow().clone();
    assert_eq!(table.routes.len(), 6);
    for node in cluster.nodes() {
        let port = layout.port(node.pos).unwrap();
        let route = table
            .route(port)
            .unwrap_or_else(|| panic!("no route for {}", node.pos));
        assert_eq!(route.node, node.pos);
        assert_eq!(route.backend.socket_addr(), Some(node.addr()));
        assert_eq!(route.node_id.as_deref(), Some(node.node_id.as_str()));
        assert_eq!(block_in_place(|| myid_through(port)), node.node_id);
    }

    // A failover swaps roles, not ports: once discovery has seen the new primary (the
    // role flag moved), every node is still on its port.
    let primary = |t: &RouteTable, n: NodeRef| t.route(layout.port(n).unwrap()).unwrap().primary;
    assert!(primary(&table, NodeRef::new(0, 0)) && !primary(&table, NodeRef::new(0, 1)));
    block_in_place(|| cluster.failover(NodeRef::new(0, 1))).unwrap();
    wait_table(&proxy, "the new primary", |t| {
        primary(t, NodeRef::new(0, 1)) && !primary(t, NodeRef::new(0, 0))
    })
    .await;
    let after = proxy.routes().borrow().clone();
    assert!(
        after.version > table.version,
        "the role change made no new table"
    );
    let placement = |t: &RouteTable| -> Vec<(u16, NodeRef, Option<SocketAddr>, Option<String>)> {
        t.routes
            .iter()
            .map(|(p, r)| (*p, r.node, r.backend.socket_addr(), r.node_id.clone()))
            .collect()
    };
    assert_eq!(
        placement(&after),
        placement(&table),
        "a failover renumbered the ports"
    );

    // A node rescheduled at a new address keeps its port; the route follows.
    let moved = NodeRef::new(1, 1);
    block_in_place(|| cluster.restart(moved, Restart::NewAddress)).unwrap();
    let new_addr = cluster.node(moved).addr();
    let port = layout.port(moved).unwrap();
    wait_table(&proxy, "the new address", |t| {
        t.route(port).and_then(|r| r.backend.socket_addr()) == Some(new_addr)
    })
    .await;
    assert_eq!(
        block_in_place(|| myid_through(port)),
        cluster.node(moved).node_id
    );

    // The seed dies: discovery goes on through the nodes it knows.
    cluster.kill(NodeRef::new(0, 0));
    let moved = NodeRef::new(2, 1);
    block_in_place(|| cluster.restart(moved, Restart::NewAddress)).unwrap();
    let new_addr: SocketAddr = cluster.node(moved).addr();
    let port = layout.port(moved).unwrap();
    wait_table(&proxy, "the second new address", |t| {
        t.route(port).and_then(|r| r.backend.socket_addr()) == Some(new_addr)
    })
    .await;
    assert_eq!(proxy.routes().borrow().routes.len(), 6);

    // No node answers any more: the last good table stays, and so does readiness.
    let last = proxy.routes().borrow().clone();
    let errors = block_in_place(|| source_errors(&proxy));
    for node in cluster.nodes() {
        cluster.kill(node.pos);
    }
    // Two failed discoveries after the kills: the source has observably tried and failed.
    let seen = wait_source_errors(&proxy, errors).await;
    wait_source_errors(&proxy, seen).await;
    let now = proxy.routes().borrow().clone();
    assert_eq!((now.version, &now.routes), (last.version, &last.routes));
    assert!(proxy.is_ready());
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_that_announce_the_proxy_are_refused_instead_of_looping() {
    // The announce mode: every node hands out the proxy's own listener ports.
    let base = free_port_range(LO, 1);
    let layout = PortLayout::new(u32::from(base), 1, 0, None).unwrap();
    let spec = ClusterSpec::new(1, 0)
        .with_node_config(shardgate_harness::routes::announce_proxy(LO, layout));
    let cluster = block_in_place(|| ValkeyCluster::start(spec)).unwrap();
    let mut config = ProxyConfig::new(SourceConfig::Seed {
        seeds: vec![Backend::ip(cluster.node(NodeRef::new(0, 0)).addr())],
        base_port: base,
        ports_per_shard: None,
        refresh: Duration::from_millis(100),
    });
    config.listen_ip = LO.into();
    config.admin_addr = Some((LO, 0).into());
    let proxy = Proxy::start(config).await.unwrap();
    // The refusal is counted as the source's error; by then the table would be in force.
    wait_source_errors(&proxy, 0.0).await;
    assert!(
        !proxy.is_ready(),
        "a table that routes the proxy to itself was accepted"
    );
    // What a user sees: /readyz says why.
    let admin = proxy.admin_addr().expect("the test proxy serves /readyz");
    let (code, body) = block_in_place(|| shardgate_harness::http::get(admin, "/readyz")).unwrap();
    assert_eq!(code, 503, "{body}");
    assert!(
        body.contains("no route table loaded yet") && body.contains("route source seed failing"),
        "/readyz: {body}"
    );
    assert!(!proxy.routes().borrow().is_loaded());
    assert!(
        TcpStream::connect((LO, base)).is_err(),
        "a looping listener was bound"
    );
    proxy.shutdown().await;
}

// ------------------------------------------------------------ discovery that cross-checks

/// A lone cluster-enabled `valkey-server` with an empty data directory (a fresh
/// `nodes.conf`) at `ip`, outside any cluster: a node restarted empty, or one about to join.
/// Killed and its directory removed on drop.
struct LoneNode {
    child: std::process::Child,
    dir: std::path::PathBuf,
    addr: SocketAddr,
}

impl LoneNode {
    fn start(ip: Ipv4Addr, port: u16) -> LoneNode {
        // A harness directory on the command line, so that a killed test's node is reaped.
        let dir = shardgate_harness::procs::new_root_dir("lone").unwrap();
        let exe = shardgate_harness::tools::valkey_server().unwrap();
        let mut cmd = std::process::Command::new(exe);
        cmd.args(["--port", &port.to_string()])
            .args([
                "--cluster-enabled",
                "yes",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--cluster-config-file")
            .arg(dir.join("nodes.conf"))
            .arg("--dir")
            .arg(&dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        for (k, v) in shardgate_harness::valkey::server::local_settings(ip) {
            cmd.arg(format!("--{k}")).arg(v);
        }
        let child = cmd.spawn().unwrap();
        let node = LoneNode {
            child,
            dir,
            addr: SocketAddr::from((ip, port)),
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(node.addr).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "{} did not start",
                node.addr
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        node
    }

    fn query(&self, args: &[&str]) -> redis::Value {
        let client = redis::Client::open(format!("redis://{}", self.addr)).unwrap();
        let mut con = client.get_connection().unwrap();
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query(&mut con).unwrap()
    }

    fn id(&self) -> String {
        match self.query(&["CLUSTER", "MYID"]) {
            redis::Value::BulkString(b) => String::from_utf8(b).unwrap(),
            other => panic!("CLUSTER MYID: {other:?}"),
        }
    }
}

impl Drop for LoneNode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Waits until the seed source has finished more than `n` fetches (`n` = 0: the count
/// now, plus one); returns the count.
async fn wait_fetches(proxy: &ProxyHandle, n: f64) -> f64 {
    let sample = "shardgate_proxy_route_source_fetches_total{source=\"seed\"}";
    let n = if n == 0.0 {
        block_in_place(|| metric(proxy, sample)).expect("the fetch counter is shown")
    } else {
        n
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let now = block_in_place(|| metric(proxy, sample)).expect("the fetch counter is shown");
        if now > n {
            return now;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the seed source stopped fetching"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn metric(proxy: &ProxyHandle, sample: &str) -> Option<f64> {
    let admin = proxy.admin_addr().expect("the test proxy serves /metrics");
    let (_, body) = shardgate_harness::http::get(admin, "/metrics").unwrap();
    shardgate_harness::http::metric_value(&body, sample).ok()
}

async fn seed_proxy(
    seeds: Vec<SocketAddr>,
    base: u16,
    ports_per_shard: Option<u32>,
) -> ProxyHandle {
    let mut config = ProxyConfig::new(SourceConfig::Seed {
        seeds: seeds.into_iter().map(Backend::ip).collect(),
        base_port: base,
        ports_per_shard,
        refresh: Duration::from_millis(200),
    });
    config.listen_ip = LO.into();
    config.admin_addr = Some((LO, 0).into());
    config.connect_timeout = Duration::from_millis(500);
    let proxy = Proxy::start(config).await.unwrap();
    assert!(proxy.wait_ready(Duration::from_secs(10)).await);
    proxy
}

/// Which node (by id) each port routes to, and whether the table calls it primary.
fn placement(t: &RouteTable) -> Vec<(u16, Option<String>, bool)> {
    t.routes
        .iter()
        .map(|(p, r)| (*p, r.node_id.clone(), r.primary))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_primary_that_never_heard_a_meet_is_routed() {
    // 1 shard, 0 replicas: the node's own CLUSTER SHARDS has `ip ""` (nobody sent it a
    // MEET); discovery once gave an empty table for it.
    let cluster = block_in_place(|| ValkeyCluster::start(ClusterSpec::new(1, 0))).unwrap();
    let node = cluster.node(NodeRef::new(0, 0));
    let base = free_port_range(LO, 1);
    let proxy = seed_proxy(vec![node.addr()], base, None).await;
    let table = proxy.routes().borrow().clone();
    assert_eq!(
        placement(&table),
        [(base, Some(node.node_id.clone()), true)]
    );
    assert_eq!(
        table.route(base).unwrap().backend.socket_addr(),
        Some(node.addr())
    );
    assert_eq!(table.route(base).unwrap().slots, [(0, 16383)]);
    assert_eq!(block_in_place(|| myid_through(base)), node.node_id);
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarted_empty_does_not_replace_the_table() {
    let cluster = block_in_place(|| ValkeyCluster::start(ClusterSpec::new(3, 1))).unwrap();
    let base = free_port_range(LO, 6);
    let confused = NodeRef::new(1, 1);
    let at = cluster.node(confused).addr();
    // The confused node is the first seed, so it is always asked.
    let seeds = vec![at, cluster.node(NodeRef::new(2, 0)).addr()];
    let proxy = seed_proxy(seeds, base, None).await;
    let before = proxy.routes().borrow().clone();
    assert_eq!(before.routes.len(), 6);

    // It comes back with no nodes.conf: one shard, itself, no slots, cluster_state:fail,
    // unknown to the others, and met into nothing.
    cluster.kill(confused);
    let SocketAddr::V4(v4) = at else {
        unreachable!()
    };
    let lone = block_in_place(|| LoneNode::start(*v4.ip(), at.port()));
    let fresh_id = block_in_place(|| lone.id());
    assert_ne!(fresh_id, cluster.node(confused).node_id);
    let refused = "shardgate_proxy_discovery_views_refused_total{reason=\"no_slots\"}";
    // Discovery has observably asked it, twice, and not used what it said.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while block_in_place(|| metric(&proxy, refused)).unwrap_or(0.0) < 2.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the empty node's view was never refused"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let after = proxy.routes().borrow().clone();
    assert_eq!(after.routes.len(), 6, "{:?}", placement(&after));
    for node in cluster.nodes() {
        let route = after
            .route(
                PortLayout::new(u32::from(base), 3, 1, None)
                    .unwrap()
                    .port(node.pos)
                    .unwrap(),
            )
            .unwrap();
        assert_eq!(
            route.node_id.as_deref(),
            Some(node.node_id.as_str()),
            "{}",
            node.pos
        );
    }
    assert!(
        after
            .routes
            .values()
            .all(|r| r.node_id.as_deref() != Some(fresh_id.as_str())),
        "the empty node got a route"
    );
    assert!(proxy.is_ready());
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_primary_hands_its_shard_name_and_slots_to_the_promoted_replica() {
    use shardgate_proxy::tls::select::Selector;
    let cluster = block_in_place(|| ValkeyCluster::start(ClusterSpec::new(3, 1))).unwrap();
    let base = free_port_range(LO, 6);
    let layout = PortLayout::new(u32::from(base), 3, 1, None).unwrap();
    let seeds = cluster.nodes().iter().map(|n| n.addr()).collect();
    let proxy = seed_proxy(seeds, base, None).await;
    let (old, new) = (NodeRef::new(0, 0), NodeRef::new(0, 1));
    let route_of = |t: &RouteTable, n: NodeRef| t.route(layout.port(n).unwrap()).cloned().unwrap();
    let slots = route_of(&proxy.routes().borrow(), old).slots.clone();
    assert_eq!(slots, [(0, 5460)]);

    // Killed, not stopped: the others mark it failed and its replica takes over by itself.
    cluster.kill(old);
    wait_table(&proxy, "the promoted replica as primary", |t| {
        route_of(t, new).primary && !route_of(t, old).primary
    })
    .await;
    let table = proxy.routes().borrow().clone();
    assert_eq!(
        route_of(&table, new).slots,
        slots,
        "the slots did not follow"
    );
    assert!(route_of(&table, old).slots.is_empty());
    // The killed node keeps its port: the others still list it.
    assert_eq!(
        route_of(&table, old).node_id.as_deref(),
        Some(cluster.node(old).node_id.as_str())
    );

    // The TLS port's shard name goes where the table says.
    let selector = Selector::new(shardgate_crds::Hostnames {
        prefix: "vc".into(),
        domain: "example.test".into(),
    });
    let selected = selector.select(&table, "vc-0.example.test").unwrap();
    assert_eq!(selected.candidates[0].node, new);

    // One primary per shard in /routes, as a user reads it.
    let admin = proxy.admin_addr().unwrap();
    let (_, body) = block_in_place(|| shardgate_harness::http::get(admin, "/routes")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    let mut primaries = std::collections::BTreeMap::<u64, Vec<String>>::new();
    for route in json["routes"].as_object().unwrap().values() {
        if route["primary"] == serde_json::Value::Bool(true) {
            primaries
                .entry(route["node"]["shard"].as_u64().unwrap())
                .or_default()
                .push(route["node_id"].as_str().unwrap().to_string());
        }
    }
    let want: std::collections::BTreeMap<u64, Vec<String>> = [
        (0, vec![cluster.node(new).node_id.clone()]),
        (1, vec![cluster.node(NodeRef::new(1, 0)).node_id.clone()]),
        (2, vec![cluster.node(NodeRef::new(2, 0)).node_id.clone()]),
    ]
    .into();
    assert_eq!(primaries, want, "{body}");
    proxy.shutdown().await;
}

/// 3 shards of a primary and a replica, behind a seed proxy with room for a third node per
/// shard.
async fn three_by_one_with_room() -> (ValkeyCluster, PortLayout, ProxyHandle) {
    let cluster = block_in_place(|| ValkeyCluster::start(ClusterSpec::new(3, 1))).unwrap();
    let base = free_port_range(LO, 9);
    let layout = PortLayout::new(u32::from(base), 3, 2, Some(3)).unwrap();
    let seeds = vec![cluster.node(NodeRef::new(0, 0)).addr()];
    let proxy = seed_proxy(seeds, base, Some(3)).await;
    (cluster, layout, proxy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_node_gets_one_port_once() {
    let (cluster, layout, proxy) = three_by_one_with_room().await;
    // Every table from here on, to see where the new node ever was.
    let seen = record_tables(&proxy);

    let ip = shardgate_harness::addr::node_ip(&[6379, 6379 + 10000]).unwrap();
    let joining = block_in_place(|| LoneNode::start(ip, 6379));
    let id = block_in_place(|| joining.id());
    let primary = cluster.node(NodeRef::new(1, 0));
    // MEET, then a replica of shard 1 once it knows its primary: the steps an operator
    // takes, each visible to discovery for a few refreshes.
    block_in_place(|| primary.query::<()>(&["CLUSTER", "MEET", &ip.to_string(), "6379"])).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let nodes = format!(
            "{:?}",
            block_in_place(|| joining.query(&["CLUSTER", "NODES"]))
        );
        if nodes.contains(&primary.node_id) && !nodes.contains("handshake") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the MEET never completed: {nodes}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Two fetches later discovery has seen it as a shard of its own, with no slots: no port
    // yet.
    let fetches = wait_fetches(&proxy, 0.0).await;
    wait_fetches(&proxy, fetches).await;
    assert!(
        proxy
            .routes()
            .borrow()
            .routes
            .values()
            .all(|r| r.node_id.as_deref() != Some(id.as_str())),
        "a node still joining got a port"
    );
    block_in_place(|| joining.query(&["CLUSTER", "REPLICATE", &primary.node_id]));
    let port = layout.port(NodeRef::new(1, 2)).unwrap();
    wait_table(&proxy, "the new replica", |t| {
        t.route(port).and_then(|r| r.node_id.as_deref()) == Some(id.as_str())
    })
    .await;
    // Synced and online: the last of its changes that discovery sees.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let info = format!(
            "{:?}",
            block_in_place(|| joining.query(&["INFO", "replication"]))
        );
        if info.contains("master_link_status:up") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the replica never synced: {info}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Two more fetches, in which discovery sees it synced.
    let fetches = wait_fetches(&proxy, 0.0).await;
    wait_fetches(&proxy, fetches).await;
    proxy.shutdown().await;
    let tables = recorded(seen).await;
    let (ports_of_new, present) = ports_over(&tables, &id);
    assert_never_moved(&tables, &cluster, &layout, None);
    assert_eq!(
        ports_of_new,
        [port],
        "the joining node was seen at other ports"
    );
    // Once there, it stayed: no flapping.
    let first_seen = present.iter().position(|p| *p).unwrap();
    assert!(present[first_seen..].iter().all(|p| *p), "{present:?}");
}

/// Every table the proxy publishes from now on, until it shuts down ([`recorded`]).
fn record_tables(proxy: &ProxyHandle) -> tokio::task::JoinHandle<Vec<Arc<Snapshot>>> {
    let mut rx = proxy.routes();
    let first = rx.borrow_and_update().clone();
    tokio::spawn(async move {
        let mut tables = vec![first];
        while rx.changed().await.is_ok() {
            tables.push(rx.borrow_and_update().clone());
        }
        tables
    })
}

/// The tables [`record_tables`] saw, checked to be every one.
async fn recorded(seen: tokio::task::JoinHandle<Vec<Arc<Snapshot>>>) -> Vec<Arc<Snapshot>> {
    let tables = seen.await.unwrap();
    let versions: Vec<u64> = tables.iter().map(|t| t.version).collect();
    assert!(
        versions.windows(2).all(|w| w[1] == w[0] + 1),
        "a table was missed, so the test proves nothing: {versions:?}"
    );
    tables
}

/// The ports a node was ever routed at, in the order first seen, and whether each table
/// routed it.
fn ports_over(tables: &[Arc<Snapshot>], id: &str) -> (Vec<u16>, Vec<bool>) {
    let mut ports: Vec<u16> = vec![];
    let mut present = vec![];
    for t in tables {
        let here: Vec<u16> = t
            .routes
            .iter()
            .filter(|(_, r)| r.node_id.as_deref() == Some(id))
            .map(|(p, _)| *p)
            .collect();
        present.push(!here.is_empty());
        for p in here {
            if !ports.contains(&p) {
                ports.push(p);
            }
        }
    }
    (ports, present)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_moved_to_another_shard_changes_port_once() {
    // What a user sees. The views that disagree for a moment (the one chosen still listing
    // the replica in its old shard) seldom show here, gossip being quick on loopback: the
    // unit test in discovery::table replays them.
    let (cluster, layout, proxy) = three_by_one_with_room().await;
    let seen = record_tables(&proxy);
    let moved = cluster.node(NodeRef::new(0, 1));
    let to = cluster.node(NodeRef::new(2, 0));
    block_in_place(|| moved.query::<()>(&["CLUSTER", "REPLICATE", &to.node_id])).unwrap();
    // Shard 2's free index, once the views agree.
    let port = layout.port(NodeRef::new(2, 2)).unwrap();
    wait_table(&proxy, "the moved replica at its new port", |t| {
        t.route(port).and_then(|r| r.node_id.as_deref()) == Some(moved.node_id.as_str())
    })
    .await;
    // Two more fetches, in which stale views would move it back.
    let fetches = wait_fetches(&proxy, 0.0).await;
    wait_fetches(&proxy, fetches).await;
    // Its new port reaches it.
    assert_eq!(block_in_place(|| myid_through(port)), moved.node_id);
    proxy.shutdown().await;
    let tables = recorded(seen).await;
    let (ports, _) = ports_over(&tables, &moved.node_id);
    assert_eq!(
        ports,
        [layout.port(moved.pos).unwrap(), port],
        "the moved replica's ports, in order"
    );
    // In every table, at one port.
    let routed: Vec<usize> = tables
        .iter()
        .map(|t| {
            t.routes
                .values()
                .filter(|r| r.node_id.as_deref() == Some(moved.node_id.as_str()))
                .count()
        })
        .collect();
    assert!(
        routed.iter().all(|n| *n == 1),
        "routed at two ports: {routed:?}"
    );
    // Once at its new port, it stays there.
    let at_new: Vec<bool> = tables
        .iter()
        .map(|t| {
            t.route(port)
                .is_some_and(|r| r.node_id.as_deref() == Some(moved.node_id.as_str()))
        })
        .collect();
    let first = at_new.iter().position(|n| *n).unwrap();
    assert!(
        at_new[first..].iter().all(|n| *n),
        "it moved back: {at_new:?}"
    );
    assert_never_moved(&tables, &cluster, &layout, Some(moved.pos));
}

/// Every node of `cluster` but `except` is in every table, at its own port only.
fn assert_never_moved(
    tables: &[Arc<Snapshot>],
    cluster: &ValkeyCluster,
    layout: &PortLayout,
    except: Option<NodeRef>,
) {
    for node in cluster.nodes().iter().filter(|n| Some(n.pos) != except) {
        let (ports, present) = ports_over(tables, &node.node_id);
        assert_eq!(ports, [layout.port(node.pos).unwrap()], "{}", node.node_id);
        assert!(present.iter().all(|p| *p), "{}: {present:?}", node.node_id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_no_node_confirms_is_kept_and_readyz_says_it_is_stale() {
    let cluster = block_in_place(|| ValkeyCluster::start(ClusterSpec::new(1, 0))).unwrap();
    let node = cluster.node(NodeRef::new(0, 0));
    let base = free_port_range(LO, 1);
    let proxy = seed_proxy(vec![node.addr()], base, None).await;
    let admin = proxy.admin_addr().unwrap();
    let before = proxy.routes().borrow().clone();
    assert_eq!(
        block_in_place(|| metric(&proxy, "shardgate_proxy_route_table_stale")),
        Some(0.0)
    );

    // The only node comes back empty: nobody serves a slot, so nothing confirms the table.
    cluster.kill(NodeRef::new(0, 0));
    let SocketAddr::V4(v4) = node.addr() else {
        unreachable!()
    };
    let _lone = block_in_place(|| LoneNode::start(*v4.ip(), node.addr().port()));
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while block_in_place(|| metric(&proxy, "shardgate_proxy_route_table_stale")) != Some(1.0) {
        assert!(
            std::time::Instant::now() < deadline,
            "the table was never called stale"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, body) = block_in_place(|| shardgate_harness::http::get(admin, "/readyz")).unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("(stale)") && body.contains("serves any slot"),
        "{body}"
    );
    let now = proxy.routes().borrow().clone();
    assert_eq!((now.version, &now.routes), (before.version, &before.routes));
    proxy.shutdown().await;
}
