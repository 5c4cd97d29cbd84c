//! What a flood of failing connections leaves in the proxy's log: the proxy binary in front of
//! a backend port nobody listens on, and clients that connect again and again. Every
//! connection is counted in `/metrics`; the log says it once per listener port and outcome
//! per 10 s, not once per connection.

use std::io::Read;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use shardgate_harness::addr::free_port;
use shardgate_harness::http;
use shardgate_harness::proxy_process::{proxy_binary, ProxyProcess};
use shardgate_harness::routes::one_node_per_shard;

const LO: Ipv4Addr = Ipv4Addr::LOCALHOST;
const CONNECTIONS: u64 = 50;

#[test]
fn a_backend_down_is_counted_for_every_connection_and_logged_once() {
    // A port that was free: nothing listens there.
    let dead = SocketAddr::from((LO, free_port(LO)));
    let base = free_port(LO);
    let dir = std::env::temp_dir().join(format!("shardgate-warnings-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let routes = dir.join("routes.yaml");
    std::fs::write(&routes, one_node_per_shard(base, &[dead])).unwrap();
    let admin = SocketAddr::from((LO, free_port(LO)));
    let args: Vec<String> = [
        "--routes",
        &routes.to_string_lossy(),
        "--listen-ip",
        "127.0.0.1",
        "--admin-addr",
        &admin.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let bin = proxy_binary().expect("the shardgate-proxy binary (cargo builds it with the tests)");
    let proxy = ProxyProcess::spawn(&bin, &args, Some(admin)).unwrap();
    proxy.wait_ready(Duration::from_secs(20)).unwrap();

    let start = Instant::now();
    for i in 0..CONNECTIONS {
        let mut c = TcpStream::connect((LO, base)).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        // The proxy closes a connection whose backend it cannot reach, with nothing sent.
        let mut buf = [0u8; 64];
        match c.read(&mut buf) {
            Ok(0) => {}
            Ok(n) => panic!("connection {i}: {n} bytes from a proxy with no backend"),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            Err(e) => panic!("connection {i}: {e}"),
        }
    }

    // Every one counted...
    let sample = "shardgate_proxy_connections_closed_total{reason=\"backend_unreachable\"}";
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, body) = http::get(admin, "/metrics").unwrap();
        let counted = http::metric(&body, sample).unwrap_or(0.0);
        if counted == CONNECTIONS as f64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{sample} is {counted}, not {CONNECTIONS}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // ...and logged once per 10 s period the connections took (one, unless this machine
    // took over ten seconds for fifty refused dials).
    let periods = 1 + start.elapsed().as_secs() / 10;
    let log = proxy.log();
    let lines = log
        .lines()
        .filter(|l| l.contains(&format!("connect to {dead}")))
        .count() as u64;
    assert!(
        (1..=periods).contains(&lines),
        "{lines} warnings for {CONNECTIONS} refused dials in {periods} period(s); log:\n{log}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
