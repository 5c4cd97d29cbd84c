//! TLS termination against plain forwarding: requests/s and the proxy's CPU time per request,
//! in one run on one machine, with `redis-benchmark` (Debian's redis-tools, built with TLS) as
//! the load and a real `valkey-server` behind the proxy.
//!
//! ```sh
//! cargo bench -p shardgate-benches --bench tls                 # ~1 min
//! SHARDGATE_BENCH_REQUESTS=400000 cargo bench -p shardgate-benches --bench tls
//! ```
//!
//! The proxy runs in this process on its own tokio runtime, whose worker threads are named
//! `sg-proxy`; its CPU time is the sum of those threads' user and system time
//! (`/proc/self/task/*/stat`), read before and after each case, so neither the load
//! generator nor Valkey is counted. Cases:
//! - `direct`: redis-benchmark straight to Valkey (the limit; no proxy CPU);
//! - `plain`: through a per-port listener;
//! - `tls`: through the TLS port, terminating TLS 1.3 (`--tls --sni vc-0-0.example.test`);
//! - `plain_reconnect` / `tls_reconnect`: a new connection per request (`-k 0`), where the
//!   TLS handshake dominates.
//!
//! Each case runs `PING_MBULK`, `SET` and `GET` with 50 clients, no pipelining. Quote the
//! ratios, not the absolute numbers: the machine is shared.

use std::net::Ipv4Addr;
use std::process::Command;
use std::time::{Duration, Instant};

use shardgate_crds::Hostnames;
use shardgate_harness::addr::free_port;
use shardgate_harness::tls::TestPki;
use shardgate_harness::tools::redis_benchmark;
use shardgate_harness::valkey::Standalone;
use shardgate_proxy::config::BackendTlsConfig;
use shardgate_proxy::config::CertFiles;
use shardgate_proxy::config::DetectLimits;
use shardgate_proxy::config::{TlsConfig, TlsModeConfig};
use shardgate_proxy::{Proxy, ProxyConfig, SourceConfig};

const LO: Ipv4Addr = Ipv4Addr::LOCALHOST;

/// CPU seconds of this process's threads named `sg-proxy*`.
fn proxy_cpu() -> f64 {
    let ticks = 100.0; // USER_HZ on Linux
    let mut total = 0u64;
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ... utime(14) stime(15)
        let Some(open) = stat.find('(') else { continue };
        let Some(close) = stat.rfind(')') else {
            continue;
        };
        if !stat[open + 1..close].starts_with("sg-proxy") {
            continue;
        }
        let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
        let utime: u64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0);
        let stime: u64 = fields.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
        total += utime + stime;
    }
    total as f64 / ticks
}

struct Outcome {
    rps: Vec<(String, f64)>,
    requests: f64,
    cpu: f64,
    wall: f64,
}

fn run(port: u16, extra: &[String], requests: u64, keepalive: bool) -> Outcome {
    let cpu0 = proxy_cpu();
    let t0 = Instant::now();
    let mut cmd = Command::new(redis_benchmark().expect("redis-benchmark (scripts/setup)"));
    cmd.args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(["-c", "50", "-n", &requests.to_string(), "-d", "64"])
        .args(["-t", "ping_mbulk,set,get", "--csv"])
        .args(extra);
    if !keepalive {
        cmd.args(["-k", "0"]);
    }
    let out = cmd.output().expect("running redis-benchmark");
    let wall = t0.elapsed().as_secs_f64();
    let cpu = proxy_cpu() - cpu0;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("\"rps\""),
        "redis-benchmark failed: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rps: Vec<(String, f64)> = text
        .lines()
        .skip(1)
        .filter_map(|l| {
            let cols: Vec<&str> = l.split(',').map(|c| c.trim_matches('"')).collect();
            Some((cols.first()?.to_string(), cols.get(1)?.parse().ok()?))
        })
        .collect();
    let tests = rps.len().max(1) as f64;
    Outcome {
        rps,
        requests: requests as f64 * tests,
        cpu,
        wall,
    }
}

fn main() {
    // `cargo test --benches` runs bench targets without --bench: nothing to measure then.
    if !std::env::args().any(|a| a == "--bench") {
        println!("tls bench: run it with `cargo bench -p shardgate-benches --bench tls`");
        return;
    }
    let requests: u64 = std::env::var("SHARDGATE_BENCH_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let valkey = Standalone::start().expect("valkey-server (scripts/setup)");
    let pki = TestPki::new("example.test").expect("test CA");
    let cert = pki.wildcard("proxy").expect("certificate");
    let routes = pki.dir().join("routes.yaml");
    let base = free_port(LO);
    std::fs::write(
        &routes,
        shardgate_harness::routes::one_node_per_shard(
            base,
            &[format!("127.0.0.1:{}", valkey.port)],
        ),
    )
    .expect("route file");
    let tls_port = free_port(LO);
    let mut config = ProxyConfig::new(SourceConfig::File {
        path: routes,
        poll: Duration::from_secs(5),
    });
    config.listen_ip = LO.into();
    config.admin_addr = None;
    config.tls = Some(TlsConfig {
        port: tls_port,
        names: Hostnames {
            prefix: "vc".into(),
            domain: "example.test".into(),
        },
        mode: TlsModeConfig::Terminate {
            files: CertFiles {
                cert: cert.cert.clone(),
                key: cert.key.clone(),
                client_ca: None,
            },
            reload: Duration::from_secs(5),
            backend: BackendTlsConfig::Plain,
        },
        detect: DetectLimits::default(),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("sg-proxy")
        .enable_all()
        .build()
        .expect("proxy runtime");
    let proxy = runtime
        .block_on(Proxy::start(config))
        .expect("proxy starts");
    assert!(runtime.block_on(proxy.wait_ready(Duration::from_secs(10))));

    let ca = pki.ca.to_string_lossy().to_string();
    let tls_args: Vec<String> = ["--tls", "--sni", "vc-0-0.example.test", "--cacert", &ca]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let reconnect = (requests / 20).max(2000);
    let cases: Vec<(&str, u16, Vec<String>, u64, bool)> = vec![
        ("direct", valkey.port, vec![], requests, true),
        ("plain", base, vec![], requests, true),
        ("tls", tls_port, tls_args.clone(), requests, true),
        ("plain_reconnect", base, vec![], reconnect, false),
        ("tls_reconnect", tls_port, tls_args, reconnect, false),
    ];
    // Warm up both paths.
    run(base, &[], 5000, true);
    println!(
        "proxy: 1 worker thread; redis-benchmark -c 50 -d 64; {requests} requests per test \
         ({reconnect} for the reconnect cases)\n"
    );
    println!(
        "{:<16} {:>12} {:>12} {:>12} {:>16} {:>10}",
        "case", "PING rps", "SET rps", "GET rps", "proxy CPU µs/req", "wall s"
    );
    let mut results = vec![];
    for (name, port, extra, n, keepalive) in cases {
        let o = run(port, &extra, n, keepalive);
        let get = |t: &str| {
            o.rps
                .iter()
                .find(|(k, _)| k.starts_with(t))
                .map_or(0.0, |(_, v)| *v)
        };
        let per_req = o.cpu / o.requests * 1e6;
        println!(
            "{name:<16} {:>12.0} {:>12.0} {:>12.0} {:>16.2} {:>10.1}",
            get("PING"),
            get("SET"),
            get("GET"),
            per_req,
            o.wall
        );
        results.push((name, get("GET"), per_req));
    }
    let find = |n: &str| results.iter().find(|r| r.0 == n).copied();
    if let (Some(d), Some(p), Some(t), Some(pr), Some(tr)) = (
        find("direct"),
        find("plain"),
        find("tls"),
        find("plain_reconnect"),
        find("tls_reconnect"),
    ) {
        println!("\nratios (GET rps; CPU per request):");
        println!("  plain / direct rps          {:.2}", p.1 / d.1);
        println!("  tls / plain rps             {:.2}", t.1 / p.1);
        println!("  tls / plain CPU per request {:.2}", t.2 / p.2);
        println!(
            "  tls_reconnect / plain_reconnect rps          {:.2}",
            tr.1 / pr.1
        );
        println!(
            "  tls_reconnect / plain_reconnect CPU per req  {:.2}",
            tr.2 / pr.2
        );
    }
    runtime.block_on(proxy.shutdown());
}
