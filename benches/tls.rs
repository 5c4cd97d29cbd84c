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
//!   TLS handshake dominates;
//! - `haproxy_plain` / `haproxy_tls`: HAProxy (`mode tcp`, one thread; Debian's package,
//!   OpenSSL) forwarding, then terminating TLS the same way, its CPU time from
//!   `/proc/<pid>/stat`: what TLS costs a data plane that is not shardgate, on the same
//!   machine with the same load generator (which does its own TLS on the same cores).
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

/// CPU seconds of process `pid` (user and system).
fn process_cpu(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let Some(close) = stat.rfind(')') else {
        return 0.0;
    };
    let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (ticks(11) + ticks(12)) as f64 / 100.0
}

/// HAProxy in front of `backend`, one thread: a plain listener and a TLS one with `pem`
/// (certificate and key). Killed on drop.
struct Haproxy {
    child: std::process::Child,
    plain: u16,
    tls: u16,
}

impl Haproxy {
    fn start(dir: &std::path::Path, backend: u16, pem: &std::path::Path) -> Haproxy {
        let (plain, tls) = (free_port(LO), free_port(LO));
        let cfg = dir.join("haproxy.cfg");
        std::fs::write(
            &cfg,
            format!(
                "global\n  nbthread 1\n  maxconn 1000\n\
                 defaults\n  mode tcp\n  timeout connect 5s\n  timeout client 1h\n  timeout server 1h\n\
                 frontend plain\n  bind 127.0.0.1:{plain}\n  default_backend be\n\
                 frontend tls\n  bind 127.0.0.1:{tls} ssl crt {}\n  default_backend be\n\
                 backend be\n  server valkey 127.0.0.1:{backend}\n",
                pem.display()
            ),
        )
        .expect("haproxy.cfg");
        let haproxy = std::env::var_os("SHARDGATE_HAPROXY").unwrap_or("/usr/sbin/haproxy".into());
        let child = Command::new(&haproxy)
            .arg("-db")
            .arg("-f")
            .arg(&cfg)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{haproxy:?} (scripts/setup installs it): {e}"));
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect((LO, tls)).is_err() {
            assert!(Instant::now() < deadline, "HAProxy did not listen on {tls}");
            std::thread::sleep(Duration::from_millis(50));
        }
        Haproxy { child, plain, tls }
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run(port: u16, extra: &[String], requests: u64, keepalive: bool) -> Outcome {
    run_measuring(port, extra, requests, keepalive, proxy_cpu)
}

fn run_measuring(
    port: u16,
    extra: &[String],
    requests: u64,
    keepalive: bool,
    proxy_cpu: impl Fn() -> f64,
) -> Outcome {
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
    let pem = pki.dir().join("haproxy.pem");
    let mut both = std::fs::read(&cert.cert).expect("certificate file");
    both.extend(std::fs::read(&cert.key).expect("key file"));
    std::fs::write(&pem, both).expect("haproxy.pem");
    let haproxy = Haproxy::start(pki.dir(), valkey.port, &pem);
    let reconnect = (requests / 20).max(2000);
    let p16: Vec<String> = vec!["-P".into(), "16".into()];
    let cases: Vec<(&str, u16, Vec<String>, u64, bool)> = vec![
        ("direct", valkey.port, vec![], requests, true),
        ("plain", base, vec![], requests, true),
        ("tls", tls_port, tls_args.clone(), requests, true),
        ("plain_reconnect", base, vec![], reconnect, false),
        (
            "tls_reconnect",
            tls_port,
            tls_args.clone(),
            reconnect,
            false,
        ),
        ("haproxy_plain", haproxy.plain, vec![], requests, true),
        ("haproxy_tls", haproxy.tls, tls_args.clone(), requests, true),
        // Pipelined: the load generator's own TLS costs less per request, so the proxy's
        // share of the difference shows.
        ("plain_p16", base, p16.clone(), requests * 4, true),
        (
            "tls_p16",
            tls_port,
            [&tls_args[..], &p16].concat(),
            requests * 4,
            true,
        ),
        (
            "haproxy_plain_p16",
            haproxy.plain,
            p16.clone(),
            requests * 4,
            true,
        ),
        (
            "haproxy_tls_p16",
            haproxy.tls,
            [&tls_args[..], &p16].concat(),
            requests * 4,
            true,
        ),
    ];
    let haproxy_pid = haproxy.child.id();
    // Warm up both paths.
    run(base, &[], 5000, true);
    println!(
        "proxy: 1 worker thread; redis-benchmark -c 50 -d 64; {requests} requests per test \
         ({reconnect} for the reconnect cases, 4 times as many at pipeline 16)\n"
    );
    println!(
        "{:<16} {:>12} {:>12} {:>12} {:>16} {:>10}",
        "case", "PING rps", "SET rps", "GET rps", "proxy CPU µs/req", "wall s"
    );
    let mut results = vec![];
    for (name, port, extra, n, keepalive) in cases {
        let o = if name.starts_with("haproxy") {
            run_measuring(port, &extra, n, keepalive, || process_cpu(haproxy_pid))
        } else {
            run(port, &extra, n, keepalive)
        };
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
    if let (Some(hp), Some(ht), Some(p), Some(t)) = (
        find("haproxy_plain"),
        find("haproxy_tls"),
        find("plain"),
        find("tls"),
    ) {
        println!(
            "  haproxy tls / haproxy plain rps          {:.2}",
            ht.1 / hp.1
        );
        println!(
            "  haproxy tls / haproxy plain CPU per req  {:.2}",
            ht.2 / hp.2
        );
        println!(
            "  shardgate tls / haproxy tls rps          {:.2}",
            t.1 / ht.1
        );
        println!(
            "  shardgate tls / haproxy tls CPU per req  {:.2}",
            t.2 / ht.2
        );
        println!(
            "  shardgate plain / haproxy plain rps      {:.2}",
            p.1 / hp.1
        );
    }
    for (what, plain, tls) in [
        ("shardgate", "plain_p16", "tls_p16"),
        ("haproxy", "haproxy_plain_p16", "haproxy_tls_p16"),
    ] {
        if let (Some(p), Some(t)) = (find(plain), find(tls)) {
            println!(
                "  {what} pipeline 16: tls / plain rps {:.2}, CPU per request {:.2}",
                t.1 / p.1,
                t.2 / p.2
            );
        }
    }
    drop(haproxy);
    runtime.block_on(proxy.shutdown());
}
