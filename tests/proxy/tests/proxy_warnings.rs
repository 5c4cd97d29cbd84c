//! What a flood of failing connections leaves in the proxy's log: the proxy binary in front of
//! a backend port nobody listens on, and clients that connect again and again. Every
//! connection is counted in `/metrics`; the log says it once per listener port and outcome
//! per 10 s, not once per connection. The same for the TLS port's refusals, once per client
//! address and reason.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use shardgate_harness::addr::free_port;
use shardgate_harness::http;
use shardgate_harness::proxy_process::{proxy_binary, ProxyProcess};
use shardgate_harness::routes::one_node_per_shard;

const LO: Ipv4Addr = Ipv4Addr::LOCALHOST;
const CONNECTIONS: u64 = 50;

/// The proxy binary with a route to `backend` from `base` and `extra` arguments; its admin
/// address.
fn proxy(
    dir: &std::path::Path,
    base: u16,
    backend: SocketAddr,
    extra: &[&str],
) -> (ProxyProcess, SocketAddr) {
    let routes = dir.join("routes.yaml");
    std::fs::write(&routes, one_node_per_shard(base, &[backend])).unwrap();
    let admin = SocketAddr::from((LO, free_port(LO)));
    let mut args: Vec<String> = [
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
    args.extend(extra.iter().map(|s| s.to_string()));
    let bin = proxy_binary().expect("the shardgate-proxy binary (cargo builds it with the tests)");
    let proxy = ProxyProcess::spawn(&bin, &args, Some(admin)).unwrap();
    proxy.wait_ready(Duration::from_secs(20)).unwrap();
    (proxy, admin)
}

/// Waits until `/metrics` counts `sample` at `CONNECTIONS`.
fn counted(admin: SocketAddr, sample: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, body) = http::get(admin, "/metrics").unwrap();
        let counted = http::metric(&body, sample).unwrap_or(0.0);
        if counted == CONNECTIONS as f64 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{sample} is {counted}, not {CONNECTIONS}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Asserts that the log has `needle` once per 10 s period since `start` at most (one,
/// unless this machine took over ten seconds for fifty connections), and at least once.
fn logged_once_per_period(proxy: &ProxyProcess, needle: &str, start: Instant) {
    let periods = 1 + start.elapsed().as_secs() / 10;
    let log = proxy.log();
    let lines = log.lines().filter(|l| l.contains(needle)).count() as u64;
    assert!(
        (1..=periods).contains(&lines),
        "{lines} lines of {needle:?} for {CONNECTIONS} connections in {periods} period(s); log:\n{log}"
    );
}

#[test]
fn a_backend_down_is_counted_for_every_connection_and_logged_once() {
    // A port that was free: nothing listens there.
    let dead = SocketAddr::from((LO, free_port(LO)));
    let base = free_port(LO);
    let dir = std::env::temp_dir().join(format!("shardgate-warnings-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (proxy, admin) = proxy(&dir, base, dead, &[]);

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
    // Every one counted, and logged once per period.
    counted(
        admin,
        "shardgate_proxy_connections_closed_total{reason=\"backend_unreachable\"}",
    );
    logged_once_per_period(&proxy, &format!("connect to {dead}"), start);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The TLS port refusing a client that does not speak TLS, over and over (a scanner, a
/// client pointed at the wrong port in a retry loop): each refusal answered and counted,
/// the log line once per client address and reason per period.
#[test]
fn tls_refusals_are_counted_for_every_connection_and_logged_once() {
    let dead = SocketAddr::from((LO, free_port(LO)));
    let base = free_port(LO);
    let tls_port = free_port(LO).to_string();
    let dir = std::env::temp_dir().join(format!("shardgate-tls-warnings-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tls = [
        "--tls-port",
        &tls_port,
        "--sni-prefix",
        "vc",
        "--sni-domain",
        "example.com",
        "--tls-mode",
        "passthrough",
    ];
    let (proxy, admin) = proxy(&dir, base, dead, &tls);

    let start = Instant::now();
    for i in 0..CONNECTIONS {
        let mut c = TcpStream::connect((LO, tls_port.parse::<u16>().unwrap())).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(b"PING\r\n").unwrap();
        let mut got = Vec::new();
        c.read_to_end(&mut got)
            .unwrap_or_else(|e| panic!("connection {i}: {e}"));
        assert!(
            got.starts_with(b"-ERR this port speaks TLS only"),
            "connection {i}: {:?}",
            String::from_utf8_lossy(&got)
        );
    }
    counted(
        admin,
        "shardgate_proxy_tls_refused_total{reason=\"not_tls\"}",
    );
    logged_once_per_period(&proxy, "TLS port refused a connection", start);
    let _ = std::fs::remove_dir_all(&dir);
}
