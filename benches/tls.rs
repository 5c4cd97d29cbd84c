//! TLS termination against plain forwarding: requests/s and CPU time per request, in one run
//! on one machine, with `redis-benchmark` (Debian's redis-tools, built with TLS) as the load
//! and a real `valkey-server` behind the proxy.
//!
//! ```sh
//! cargo bench -p shardgate-benches --bench tls                 # ~2-3 min
//! SHARDGATE_BENCH_REQUESTS=400000 SHARDGATE_BENCH_ROUNDS=7 cargo bench -p shardgate-benches --bench tls
//! ```
//!
//! The proxy runs in this process on its own tokio runtime, whose worker threads are named
//! `sg-proxy`; its CPU time is the sum of those threads' user and system time
//! (`/proc/self/task/*/stat`), read before and after each case, so neither the load
//! generator nor Valkey is counted. Those two are measured apart: redis-benchmark's CPU time
//! is this process's waited-for children's (`cutime` and `cstime` in `/proc/self/stat`),
//! Valkey's its process's. On two cores shared by all three, the requests/s a case reaches
//! follow the CPU the whole machine spends per request, not the data plane's alone: the
//! report shows both. Cases:
//! - `direct`: redis-benchmark straight to Valkey (the limit; no data-plane CPU);
//! - `plain`: through a per-port listener;
//! - `tls`: through the TLS port, terminating TLS 1.3 (`--tls --sni vc-0-0.example.test`);
//! - `plain_reconnect` / `tls_reconnect`: a new connection per request (`-k 0`), where the
//!   TLS handshake dominates;
//! - `haproxy_plain` / `haproxy_tls`: HAProxy (`mode tcp`, one thread; Debian's package,
//!   OpenSSL) forwarding, then terminating TLS the same way, its CPU time from
//!   `/proc/<pid>/stat`: what TLS costs a data plane that is not shardgate, on the same
//!   machine with the same load generator;
//! - the same at pipeline 16 (`_p16`), where the load generator's TLS costs less per request.
//!
//! Each case runs `GET` with 50 clients and 64-byte values; every case runs once per round,
//! in an order that rotates from round to round, and the report gives medians over rounds
//! with their spread. Quote the ratios, not the absolute numbers: the machine is shared.

use std::net::Ipv4Addr;
use std::process::Command;
use std::time::{Duration, Instant};

use shardgate_crds::Hostnames;
use shardgate_harness::addr::free_port;
use shardgate_harness::stats::{spread, Stat};
use shardgate_harness::tls::TestPki;
use shardgate_harness::tools::{redis_benchmark, redis_cli};
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

/// CPU seconds of process `pid` (user and system).
fn process_cpu(pid: u32) -> f64 {
    stat_seconds(&format!("/proc/{pid}/stat"), [11, 12])
}

/// CPU seconds of this process's children that have been waited for (`cutime` and
/// `cstime`): a redis-benchmark run's, read before and after it.
fn children_cpu() -> f64 {
    stat_seconds("/proc/self/stat", [13, 14])
}

/// The sum of the clock-tick fields at `at` (counted from the state, the field after the
/// command's name) of a `stat` file, in seconds. A process gone is the bench's failure, not
/// a zero.
fn stat_seconds(path: &str, at: [usize; 2]) -> f64 {
    let stat = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let close = stat
        .rfind(')')
        .unwrap_or_else(|| panic!("{path}: no command name"));
    let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    at.iter().map(|&i| ticks(i)).sum::<u64>() as f64 / 100.0
}

/// One case's run: its GET requests/s and, per request, the CPU microseconds of the data
/// plane, of the load generator and of Valkey.
#[derive(Clone, Copy, Debug)]
struct Outcome {
    rps: f64,
    data_plane_us: f64,
    client_us: f64,
    valkey_us: f64,
    /// Cores busy on average over the run (all three processes' CPU over the wall time).
    cores: f64,
}

impl Outcome {
    /// What the whole machine spends per request.
    fn machine_us(&self) -> f64 {
        self.data_plane_us + self.client_us + self.valkey_us
    }
}

/// Whose CPU time a case reads as the data plane's.
#[derive(Clone, Copy)]
enum DataPlane {
    /// The proxy's threads in this process (none counted for `direct`).
    Proxy,
    Haproxy(u32),
    None,
}

impl DataPlane {
    fn cpu(self) -> f64 {
        match self {
            DataPlane::Proxy => proxy_cpu(),
            DataPlane::Haproxy(pid) => process_cpu(pid),
            DataPlane::None => 0.0,
        }
    }
}

fn run(
    port: u16,
    extra: &[String],
    requests: u64,
    keepalive: bool,
    data_plane: DataPlane,
    valkey_pid: u32,
) -> Outcome {
    let (dp0, client0, valkey0) = (data_plane.cpu(), children_cpu(), process_cpu(valkey_pid));
    let t0 = Instant::now();
    let mut cmd = Command::new(redis_benchmark().expect("redis-benchmark (scripts/setup)"));
    cmd.args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(["-c", "50", "-n", &requests.to_string(), "-d", "64"])
        .args(["-t", "get", "--csv"])
        .args(extra);
    if !keepalive {
        cmd.args(["-k", "0"]);
    }
    let out = cmd.output().expect("running redis-benchmark");
    let wall = t0.elapsed().as_secs_f64();
    let (dp, client, valkey) = (
        data_plane.cpu() - dp0,
        children_cpu() - client0,
        process_cpu(valkey_pid) - valkey0,
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let rps = shardgate_harness::tools::parse_benchmark_csv(&text)
        .ok()
        .map(|r| r.rps);
    assert!(
        out.status.success() && rps.is_some(),
        "redis-benchmark failed: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let per_req = |s: f64| s / requests as f64 * 1e6;
    Outcome {
        rps: rps.unwrap_or_default(),
        data_plane_us: per_req(dp),
        client_us: per_req(client),
        valkey_us: per_req(valkey),
        cores: (dp + client + valkey) / wall,
    }
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

fn main() {
    // `cargo test --benches` runs bench targets without --bench: nothing to measure then.
    if !std::env::args().any(|a| a == "--bench") {
        println!("tls bench: run it with `cargo bench -p shardgate-benches --bench tls`");
        return;
    }
    let env_number = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n| n > 0)
            .unwrap_or(default)
    };
    let requests = env_number("SHARDGATE_BENCH_REQUESTS", 200_000);
    let rounds = env_number("SHARDGATE_BENCH_ROUNDS", 5);
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
    let valkey_pid = valkey.pid();
    let data_plane = |name: &str| match name {
        "direct" => DataPlane::None,
        n if n.starts_with("haproxy") => DataPlane::Haproxy(haproxy_pid),
        _ => DataPlane::Proxy,
    };
    // The key every GET reads (redis-benchmark's `key:__rand_int__` without `-r`), so that
    // each reply carries a 64-byte value rather than a nil.
    let set = Command::new(redis_benchmark().expect("redis-benchmark (scripts/setup)"))
        .args(["-h", "127.0.0.1", "-p", &valkey.port.to_string()])
        .args(["-c", "1", "-n", "1", "-d", "64", "-t", "set", "-q"])
        .output()
        .expect("running redis-benchmark");
    assert!(set.status.success(), "setting the key the GETs read");
    let value = Command::new(redis_cli().expect("redis-cli (scripts/setup)"))
        .args(["-p", &valkey.port.to_string(), "STRLEN", "key:__rand_int__"])
        .output()
        .expect("running redis-cli");
    assert_eq!(
        String::from_utf8_lossy(&value.stdout).trim(),
        "64",
        "the key the GETs read holds 64 bytes"
    );
    // Warm up both paths.
    run(base, &[], 5000, true, DataPlane::Proxy, valkey_pid);
    run(haproxy.plain, &[], 5000, true, DataPlane::None, valkey_pid);
    println!(
        "proxy: 1 worker thread; redis-benchmark -t get -c 50 -d 64; {requests} requests per \
         case ({reconnect} for the reconnect cases, 4 times as many at pipeline 16); {rounds} \
         rounds, the cases' order rotating and reversing\n"
    );
    println!(
        "{:<6} {:<18} {:>9} {:>11} {:>10} {:>10} {:>11} {:>6}",
        "round", "case", "GET rps", "data plane", "client", "Valkey", "machine", "cores"
    );
    let mut outcomes: Vec<Vec<Outcome>> = vec![Vec::new(); cases.len()];
    for round in 0..rounds as usize {
        // Each round starts one case later, and every other round runs backwards: a drift
        // within a round does not always favour the case listed first of a pair.
        let first = round % cases.len();
        let mut order: Vec<usize> = (first..cases.len()).chain(0..first).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let (name, port, extra, n, keepalive) = &cases[i];
            let o = run(*port, extra, *n, *keepalive, data_plane(name), valkey_pid);
            println!(
                "{:<6} {name:<18} {:>9.0} {:>11.2} {:>10.2} {:>10.2} {:>11.2} {:>6.2}",
                round + 1,
                o.rps,
                o.data_plane_us,
                o.client_us,
                o.valkey_us,
                o.machine_us(),
                o.cores
            );
            outcomes[i].push(o);
        }
    }

    // Medians over rounds, by case.
    let median = |i: usize, f: fn(&Outcome) -> f64| {
        spread(outcomes[i].iter().map(f).collect()).expect("every case ran at least one round")
    };
    println!(
        "\nmedians (min-max) over {rounds} rounds; CPU in µs per request\n{:<18} {:>26} {:>20} \
         {:>20} {:>20} {:>20}",
        "case", "GET rps", "data plane", "client", "Valkey", "machine"
    );
    let show = |s: Stat, digits: usize| {
        format!(
            "{:.digits$} ({:.digits$}-{:.digits$})",
            s.median, s.min, s.max
        )
    };
    for (i, (name, ..)) in cases.iter().enumerate() {
        println!(
            "{name:<18} {:>26} {:>20} {:>20} {:>20} {:>20}",
            show(median(i, |o| o.rps), 0),
            show(median(i, |o| o.data_plane_us), 2),
            show(median(i, |o| o.client_us), 2),
            show(median(i, |o| o.valkey_us), 2),
            show(median(i, |o| o.machine_us()), 2),
        );
    }

    // TLS against plain, from the medians: requests/s, the data plane's CPU per request, the
    // machine's, and the requests/s that the machine's CPU alone would predict when the
    // cores are the limit (plain's machine CPU over TLS's).
    let index = |n: &str| cases.iter().position(|c| c.0 == n);
    println!(
        "\n{:<36} {:>8} {:>16} {:>13} {:>19} {:>13}",
        "TLS against plain (medians)",
        "rps",
        "data plane CPU",
        "machine CPU",
        "rps the CPU predicts",
        "cores busy"
    );
    for (what, plain, tls) in [
        ("shardgate", "plain", "tls"),
        ("HAProxy", "haproxy_plain", "haproxy_tls"),
        ("shardgate, pipeline 16", "plain_p16", "tls_p16"),
        (
            "HAProxy, pipeline 16",
            "haproxy_plain_p16",
            "haproxy_tls_p16",
        ),
        (
            "shardgate, a connection per request",
            "plain_reconnect",
            "tls_reconnect",
        ),
    ] {
        let (Some(p), Some(t)) = (index(plain), index(tls)) else {
            continue;
        };
        let ratio = |f: fn(&Outcome) -> f64| median(t, f).median / median(p, f).median;
        // The prediction holds as far as both keep the cores as busy.
        println!(
            "{what:<36} {:>8.2} {:>16.2} {:>13.2} {:>19.2} {:>6.2}/{:<6.2}",
            ratio(|o| o.rps),
            ratio(|o| o.data_plane_us),
            ratio(|o| o.machine_us()),
            1.0 / ratio(|o| o.machine_us()),
            median(p, |o| o.cores).median,
            median(t, |o| o.cores).median,
        );
    }
    if let (Some(t), Some(ht), Some(p), Some(hp), Some(d)) = (
        index("tls"),
        index("haproxy_tls"),
        index("plain"),
        index("haproxy_plain"),
        index("direct"),
    ) {
        let against =
            |a: usize, b: usize, f: fn(&Outcome) -> f64| median(a, f).median / median(b, f).median;
        println!(
            "\nshardgate against HAProxy: plain {:.2}x the requests/s at {:.2}x the CPU per \
             request, TLS {:.2}x at {:.2}x; plain / direct requests/s {:.2}",
            against(p, hp, |o| o.rps),
            against(p, hp, |o| o.data_plane_us),
            against(t, ht, |o| o.rps),
            against(t, ht, |o| o.data_plane_us),
            against(p, d, |o| o.rps),
        );
    }
    drop(haproxy);
    runtime.block_on(proxy.shutdown());
}
