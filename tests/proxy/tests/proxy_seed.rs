//! Seed discovery: the proxy learns a real cluster from one node with CLUSTER SHARDS, gives
//! every node a stable port, and follows failovers, restarts at new addresses, and the loss
//! of its seed.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::Duration;

use shardgate_crds::{NodeRef, PortLayout};
use shardgate_harness::addr::free_port_range;
use shardgate_harness::valkey::{ClusterSpec, Restart, ValkeyCluster};
use shardgate_proxy::model::{Backend, RouteTable};
use shardgate_proxy::{Proxy, ProxyConfig, ProxyHandle, SourceConfig};
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
    assert!(!proxy.routes().borrow().is_loaded());
    assert!(
        TcpStream::connect((LO, base)).is_err(),
        "a looping listener was bound"
    );
    proxy.shutdown().await;
}
