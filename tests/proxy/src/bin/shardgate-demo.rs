//! The demo: a local 3-shard × 1-replica Valkey cluster on loopback, `shardgate-proxy` in
//! front of it (one port per node), and a real cluster client (the redis crate's async
//! cluster client) whose cross-shard requests all go through the proxy. Stops cleanly.
//!
//! Run it with `scripts/demo` (which installs valkey-server and builds the binaries).

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use redis::AsyncCommands;
use shardgate_crds::{NodeRef, PortLayout};
use shardgate_harness::addr::{free_port, free_port_range};
use shardgate_harness::http::{get, metric};
use shardgate_harness::proxy_process::{proxy_binary, ProxyProcess};
use shardgate_harness::routes::{announce_proxy, routes_yaml};
use shardgate_harness::valkey::{key_slot, slot_tags, ClusterSpec, ValkeyCluster};

const PROXY_IP: Ipv4Addr = Ipv4Addr::LOCALHOST;
const SHARDS: u32 = 3;
const REPLICAS: u32 = 1;

fn main() -> Result<()> {
    let hold = std::env::args().any(|a| a == "--hold");
    if std::env::args().any(|a| a == "--help" || a == "-h") {
        println!("shardgate-demo [--hold]\n\nStarts a 3x1 Valkey cluster on loopback with shardgate-proxy in front, runs a\ncluster client through it, and stops. --hold keeps everything up until Enter.");
        return Ok(());
    }
    let base = free_port_range(PROXY_IP, (SHARDS * (REPLICAS + 1)) as u16);
    let layout = PortLayout::new(u32::from(base), SHARDS, REPLICAS, None)?;
    println!("== 1. A {SHARDS}-shard x {REPLICAS}-replica Valkey cluster, each node on its own loopback IP");
    println!("   (each node announces the proxy: cluster-announce-client-ipv4 {PROXY_IP}, cluster-announce-client-port basePort+flatIndex)");
    let cluster = ValkeyCluster::start(
        ClusterSpec::new(SHARDS, REPLICAS).with_node_config(announce_proxy(PROXY_IP, layout)),
    )
    .context("starting the Valkey cluster (run scripts/setup first?)")?;
    for node in cluster.nodes() {
        println!(
            "   node {}  {:<18} id {}…  -> proxy port {}",
            node.pos,
            node.addr().to_string(),
            &node.node_id[..8],
            layout.port(node.pos)?
        );
    }

    println!(
        "\n== 2. shardgate-proxy with a route file, listening on {PROXY_IP}:{base}..={}",
        layout.last_port()
    );
    let routes = cluster.root_dir().join("routes.yaml");
    std::fs::write(&routes, routes_yaml(base, &cluster))?;
    let admin = SocketAddr::from((PROXY_IP, free_port(PROXY_IP)));
    let args: Vec<String> = [
        "--routes",
        &routes.display().to_string(),
        "--listen-ip",
        &PROXY_IP.to_string(),
        "--admin-addr",
        &admin.to_string(),
        "--drain-timeout",
        "5s",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut proxy = ProxyProcess::spawn(&proxy_binary()?, &args, Some(admin))?;
    proxy.wait_ready(Duration::from_secs(10))?;
    println!(
        "   {}",
        std::fs::read_to_string(&routes)?.replace('\n', "\n   ")
    );
    println!("   metrics: http://{admin}/metrics   routes: http://{admin}/routes");

    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(client(&cluster, layout))?;

    let (_, m) = get(admin, "/metrics")?;
    println!("\n== 4. Connections the proxy forwarded, per node port");
    for node in cluster.nodes() {
        let port = layout.port(node.pos)?;
        let n = metric(
            &m,
            &format!("shardgate_proxy_connections_accepted_total{{port=\"{port}\"}}"),
        )
        .unwrap_or(0.0);
        println!("   port {port} (node {}): {n} connections", node.pos);
    }

    if hold {
        println!("\nEverything is up. Try: redis-cli -c -h {PROXY_IP} -p {base}   (Enter stops the demo)");
        let mut line = String::new();
        std::io::stdin().read_line(&mut line)?;
    }

    println!("\n== 5. Stopping: SIGTERM to the proxy (graceful drain), then the cluster");
    proxy.signal("TERM")?;
    let status = proxy.wait_exit(Duration::from_secs(15))?;
    ensure!(
        status.success(),
        "the proxy exited with {status}; log:\n{}",
        proxy.log()
    );
    drop(cluster);
    println!("   stopped cleanly");
    Ok(())
}

async fn client(cluster: &ValkeyCluster, layout: PortLayout) -> Result<()> {
    let entry = format!("redis://{PROXY_IP}:{}", layout.base_port());
    println!("\n== 3. A cluster client that knows only {entry}");
    let client = redis::cluster::ClusterClientBuilder::new(vec![entry]).build()?;
    let mut conn = client
        .get_async_connection()
        .await
        .context("cluster client")?;
    let slots: Vec<(u16, u16, Vec<redis::Value>)> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async::<Vec<redis::Value>>(&mut conn)
        .await?
        .into_iter()
        .filter_map(|v| match v {
            redis::Value::Array(items) if items.len() >= 3 => {
                let n = |v: &redis::Value| match v {
                    redis::Value::Int(i) => *i as u16,
                    _ => 0,
                };
                Some((n(&items[0]), n(&items[1]), items[2..].to_vec()))
            }
            _ => None,
        })
        .collect();
    println!("   CLUSTER SLOTS as the client sees it (only proxy addresses):");
    for (from, to, nodes) in &slots {
        let addrs: Vec<String> = nodes
            .iter()
            .filter_map(|n| match n {
                redis::Value::Array(f) if f.len() >= 2 => match (&f[0], &f[1]) {
                    (redis::Value::BulkString(ip), redis::Value::Int(port)) => {
                        Some(format!("{}:{port}", String::from_utf8_lossy(ip)))
                    }
                    _ => None,
                },
                _ => None,
            })
            .collect();
        println!("     slots {from:>5}-{to:<5} -> {}", addrs.join(", "));
    }
    let tags = slot_tags();
    // What a cluster client does under the hood: shard 0 redirects to the owner's proxy port.
    let far = format!(
        "{}:demo",
        tags[usize::from(*cluster.spec().initial_slots(SHARDS - 1).start())]
    );
    let mut plain = redis::Client::open(format!("redis://{PROXY_IP}:{}", layout.base_port()))?
        .get_multiplexed_async_connection()
        .await?;
    let redirect = redis::cmd("GET")
        .arg(&far)
        .query_async::<Option<String>>(&mut plain)
        .await;
    match redirect {
        Err(e) => println!(
            "   GET {far} on the entry port answers: -{} {}",
            e.code().unwrap_or("?"),
            e.detail().unwrap_or("")
        ),
        Ok(v) => anyhow::bail!("expected a MOVED for {far}, got {v:?}"),
    }
    for shard in 0..SHARDS {
        let slot = *cluster.spec().initial_slots(shard).start() + 7;
        let key = format!("{}:demo", tags[usize::from(slot)]);
        let value = format!("hello from shard {shard}");
        let _: () = conn.set(&key, &value).await?;
        let back: String = conn.get(&key).await?;
        ensure!(back == value, "read back {back:?}, wrote {value:?}");
        let owner = cluster.slot_owner(key_slot(key.as_bytes()))?;
        println!(
            "   SET/GET {key:<16} slot {slot:>5} -> proxy port {} -> node {} ({}): {back:?}",
            layout.port(NodeRef::new(owner.shard.0, owner.node.0))?,
            owner,
            cluster.node(owner).addr()
        );
    }
    Ok(())
}
