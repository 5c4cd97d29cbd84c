//! The load-comparison harness: shardgate against Valkey direct, HAProxy `mode tcp`, nginx
//! `stream` and Traefik's TCP router, in one run on one machine, interleaved.
//!
//! ```sh
//! scripts/bench-load                 # 5 rounds, writes docs/performance.{md,png}
//! scripts/bench-load --quick         # 1 round, fewer requests, 2,000 idle connections
//! scripts/bench-load --rounds 3 --threads 1 --out /tmp/perf
//! ```
//!
//! Every data plane is a separate process in front of the same standalone Valkey 9 (and a
//! 3-shard cluster for the cluster workloads), started once and kept for the run; each
//! proxy runs once on one worker thread and once on two. Each round runs every workload
//! against every data plane in turn (the order rotates from round to round), so that drift
//! on a shared machine spreads over all of them; the report gives the median over rounds and
//! the spread (min–max). A data plane's CPU per request is its processes' CPU time (user +
//! system, from their threads' `schedstat`, nginx's workers included) over the workload
//! divided by the requests; its memory per idle connection is the growth of a fresh
//! instance's RSS with N connections open, each answered one PING.
//!
//! shardgate, HAProxy and nginx also terminate TLS on a second listener of the same process
//! (one certificate from a test CA made for the run): the TLS workloads are GETs and idle
//! connections through it, and the TLS target is each round's TLS run over the same data
//! plane's plain one.

mod chart;
mod loadgen;
mod peers;
mod proc_stat;
mod redis_benchmark;
mod report;
mod tls;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use shardgate_harness::valkey::{ClusterSpec, Standalone, ValkeyCluster};

use peers::{Kind, Peer, RouteSpec};
use report::Sample;
use tls::TlsFiles;

/// What `--help` prints (the options `Settings::parse` takes).
const USAGE: &str = "\
The load-comparison harness (run it with scripts/bench-load, which builds the release proxy):
  --quick              1 round, fewer requests, 2,000 idle connections (a smoke run)
  --rounds N           rounds, each every workload on every data plane (default 5)
  --threads 1,2        worker threads per proxy (default 1,2)
  --idle N             idle connections for the memory workload (default 10,000)
  --out DIR            where the report goes (default docs/)
  --note TEXT          a line for the report (e.g. \"busy machine\")
  --peers LIST         data planes: direct,pass,rewrite,haproxy,haproxy-ka,nginx,traefik
  --workloads LIST     workloads by name, e.g. \"GET P1,idle\" or \"TLS GET P1,TLS idle\"";

/// How big a run is.
#[derive(Clone, Debug)]
pub struct Settings {
    pub rounds: usize,
    pub threads: Vec<u8>,
    /// Requests per redis-benchmark run at pipeline 1 (3 B and 1 KiB values).
    pub requests_p1: u64,
    /// At pipeline 16.
    pub requests_p16: u64,
    /// With 64 KiB values.
    pub requests_64k: u64,
    /// One client's GETs for the latency histogram.
    pub requests_latency: u64,
    /// Connections opened for connection churn.
    pub requests_churn: u64,
    /// Requests per redis-benchmark `--cluster` run: more than at P1, since its runs come out
    /// in steps of about 250 ms (short runs read as 80k, 40k or 27k requests/s).
    pub requests_cluster: u64,
    /// Requests of the redirect-following cluster client.
    pub requests_moved: u64,
    /// Idle connections held open for the memory figure.
    pub idle: usize,
    pub out: PathBuf,
    pub note: Option<String>,
    /// The run's harness directory and standalone Valkey, once started.
    pub dir: Option<PathBuf>,
    pub backend: Option<SocketAddr>,
    /// Why fewer idle connections than asked, if so.
    pub idle_note: Option<String>,
    pub quick: bool,
    /// Only these data planes (`--peers`), for a focused run; all when `None`.
    pub peers: Option<Vec<Kind>>,
    /// Only the workloads of these names (`--workloads`, any case); all when `None`.
    pub only: Option<Vec<String>>,
}

impl Settings {
    fn parse(args: &[String]) -> Result<Settings> {
        let quick = args.iter().any(|a| a == "--quick");
        let full = Settings {
            rounds: 5,
            threads: vec![1, 2],
            requests_p1: 50_000,
            requests_p16: 1_500_000,
            requests_64k: 2_000,
            requests_latency: 20_000,
            requests_churn: 20_000,
            requests_cluster: 100_000,
            requests_moved: 10_000,
            idle: 10_000,
            out: default_out(),
            note: None,
            dir: None,
            backend: None,
            idle_note: None,
            quick,
            peers: None,
            only: None,
        };
        // A smoke run: one round, fewer requests, the rest as in a full run.
        let mut s = if quick {
            Settings {
                rounds: 1,
                requests_p1: 10_000,
                requests_p16: 50_000,
                requests_64k: 1_000,
                requests_latency: 5_000,
                requests_churn: 2_000,
                requests_cluster: 20_000,
                requests_moved: 6_000,
                idle: 2_000,
                ..full
            }
        } else {
            full
        };
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let mut value = || it.next().with_context(|| format!("{a} needs a value"));
            match a.as_str() {
                "--bench" | "--quick" => {}
                "--rounds" => s.rounds = value()?.parse().context("--rounds")?,
                "--idle" => s.idle = value()?.parse().context("--idle")?,
                "--out" => s.out = PathBuf::from(value()?),
                "--note" => s.note = Some(value()?.clone()),
                "--threads" => {
                    s.threads = value()?
                        .split(',')
                        .map(|t| t.parse().context("--threads: e.g. 1,2"))
                        .collect::<Result<_>>()?
                }
                "--peers" => {
                    s.peers = Some(
                        value()?
                            .split(',')
                            .map(Kind::parse)
                            .collect::<Result<_>>()?,
                    )
                }
                "--workloads" => {
                    s.only = Some(
                        value()?
                            .split(',')
                            .map(|w| w.trim().to_lowercase())
                            .collect(),
                    )
                }
                other => bail!("unknown argument {other:?}\n\n{USAGE}"),
            }
        }
        if s.rounds == 0 || s.threads.is_empty() {
            bail!("--rounds and --threads must not be empty");
        }
        Ok(s)
    }
}

fn default_out() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs")
}

/// What a workload sends.
#[derive(Clone, Debug)]
enum Load {
    Benchmark(redis_benchmark::Run),
    Latency,
    Churn,
    /// Idle connections, over TLS to the data plane's TLS listener with `tls`.
    Idle {
        tls: bool,
    },
    Moved,
}

#[derive(Clone, Debug)]
pub struct Workload {
    pub name: String,
    load: Load,
    /// Against the cluster's data planes (else the standalone's).
    pub cluster: bool,
}

impl Workload {
    /// Idle connections: the memory figure, not requests.
    pub fn is_idle(&self) -> bool {
        matches!(self.load, Load::Idle { .. })
    }
}

fn workloads(s: &Settings) -> Vec<Workload> {
    let run = |name: &str, test, requests, pipeline, value_size, cluster, tls| Workload {
        name: name.to_string(),
        load: Load::Benchmark(redis_benchmark::Run {
            test,
            clients: 50,
            requests,
            pipeline,
            value_size,
            cluster,
            tls,
        }),
        cluster,
    };
    let bench = |name: &str, test, requests, pipeline, value_size, cluster| {
        run(name, test, requests, pipeline, value_size, cluster, false)
    };
    let own = |name: &str, load, cluster| Workload {
        name: name.to_string(),
        load,
        cluster,
    };
    // SET before GET of the same size: every data plane's GET then reads that value.
    let all = vec![
        bench("SET P1", "set", s.requests_p1, 1, 3, false),
        bench("GET P1", "get", s.requests_p1, 1, 3, false),
        bench("SET P16", "set", s.requests_p16, 16, 3, false),
        bench("GET P16", "get", s.requests_p16, 16, 3, false),
        // TLS terminated by the data plane: the same GETs as GET P1 and GET P16, before any
        // SET of a larger value.
        run("TLS GET P1", "get", s.requests_p1, 1, 3, false, true),
        run("TLS GET P16", "get", s.requests_p16, 16, 3, false, true),
        bench("SET 1 KiB", "set", s.requests_p1, 1, 1024, false),
        bench("GET 1 KiB", "get", s.requests_p1, 1, 1024, false),
        bench("SET 64 KiB", "set", s.requests_64k, 1, 65536, false),
        bench("GET 64 KiB", "get", s.requests_64k, 1, 65536, false),
        own("GET 1 client", Load::Latency, false),
        own("GET churn", Load::Churn, false),
        own("idle", Load::Idle { tls: false }, false),
        own("TLS idle", Load::Idle { tls: true }, false),
        bench("cluster SET", "set", s.requests_cluster, 1, 3, true),
        bench("cluster GET", "get", s.requests_cluster, 1, 3, true),
        own("cluster MOVED GET", Load::Moved, true),
    ];
    match &s.only {
        None => all,
        Some(only) => all
            .into_iter()
            .filter(|w| only.contains(&w.name.to_lowercase()))
            .collect(),
    }
}

/// The key of the one-client and churn workloads, set once to a 3-byte value.
const LATENCY_KEY: &str = "load:latency";

/// `w` through `peer`; `None` for a TLS workload through a data plane without TLS here, or
/// an idle one through direct.
fn measure(
    w: &Workload,
    peer: &Peer,
    s: &Settings,
    tls: &TlsFiles,
    round: usize,
) -> Result<Option<Sample>> {
    let cpu0 = peer.proc.map(|p| p.cpu_seconds());
    let mut sample = Sample::new(&w.name, peer, round);
    let requests = match &w.load {
        Load::Benchmark(run) => {
            let addr = if run.tls { peer.tls } else { Some(peer.addr) };
            let Some(addr) = addr else {
                return Ok(None);
            };
            let r = redis_benchmark::run(addr, run, Some(tls))?;
            sample.rps = Some(r.rps);
            sample.p50_us = Some(r.p50_ms * 1000.0);
            sample.p99_us = Some(r.p99_ms * 1000.0);
            run.requests
        }
        Load::Latency => bail!("the one-client workload runs side by side (measure_side_by_side)"),
        Load::Churn => {
            let o = loadgen::churn(peer.addr, LATENCY_KEY, s.requests_churn, 4)?;
            sample.rps = Some(o.rps());
            o.requests
        }
        Load::Moved => {
            let (o, redirects) = loadgen::moved(&peer.entries, s.requests_moved, 8)?;
            // Round robin over 3 shards: about two thirds of the keys start on the wrong one.
            if redirects < o.requests / 3 {
                bail!(
                    "{}: only {redirects} MOVED in {} requests",
                    peer.name(),
                    o.requests
                );
            }
            sample.rps = Some(o.rps());
            o.requests
        }
        Load::Idle { tls: over_tls } => {
            if *over_tls && peer.tls.is_none() {
                return Ok(None);
            }
            // A fresh process each round: memory that an allocator kept from an earlier
            // round would hide the growth. One without TLS for the plain count.
            let Some(fresh) = fresh_peer(peer, s, over_tls.then_some(tls))? else {
                return Ok(None);
            };
            let Some(proc) = fresh.proc else {
                return Ok(None);
            };
            let (addr, client) = match (*over_tls, fresh.tls) {
                (false, _) => (fresh.addr, None),
                (true, Some(addr)) => (addr, Some(tls)),
                (true, None) => bail!("{} started without its TLS listener", fresh.name()),
            };
            let before = proc.rss_bytes();
            let after = loadgen::with_idle(addr, s.idle, client, || proc.rss_bytes())?;
            sample.idle_bytes = Some((after as f64 - before as f64) / s.idle as f64);
            return Ok(Some(sample));
        }
    };
    if let (Some(p), Some(c0)) = (peer.proc, cpu0) {
        sample.cpu_us = Some((p.cpu_seconds() - c0) / requests as f64 * 1e6);
    }
    Ok(Some(sample))
}

/// The one-client workload: every data plane at once, a request to each in turn
/// ([`loadgen::latency_side_by_side`]); a data plane's CPU per request is its CPU over the
/// whole run (it idles while the others answer) over its own requests.
fn measure_side_by_side(
    w: &Workload,
    peers: &[Peer],
    s: &Settings,
    round: usize,
) -> Result<Vec<Sample>> {
    let cpu0: Vec<Option<f64>> = peers
        .iter()
        .map(|p| p.proc.map(|p| p.cpu_seconds()))
        .collect();
    let addrs: Vec<SocketAddr> = peers.iter().map(|p| p.addr).collect();
    let outcomes = loadgen::latency_side_by_side(&addrs, LATENCY_KEY, s.requests_latency)?;
    Ok(peers
        .iter()
        .zip(outcomes)
        .zip(cpu0)
        .map(|((peer, o), c0)| {
            let mut sample = Sample::new(&w.name, peer, round);
            sample.rps = Some(o.rps());
            sample.p50_us = o.p50_us;
            sample.p99_us = o.p99_us;
            if let (Some(p), Some(c0)) = (peer.proc, c0) {
                sample.cpu_us = Some((p.cpu_seconds() - c0) / o.requests as f64 * 1e6);
            }
            sample
        })
        .collect())
}

/// A new instance of a standalone data plane like `peer`, its files in `<run dir>/idle/`
/// (apart from the long-lived one's, whose route file it must not overwrite), terminating
/// TLS too with `tls`; none for direct.
fn fresh_peer(peer: &Peer, s: &Settings, tls: Option<&TlsFiles>) -> Result<Option<Peer>> {
    let (Some(dir), Some(backend)) = (&s.dir, s.backend) else {
        bail!("the run's directory and backend are not set");
    };
    let dir = dir.join("idle");
    std::fs::create_dir_all(&dir)?;
    let t = peer.threads;
    Ok(Some(match peer.kind {
        Kind::Direct => return Ok(None),
        Kind::Pass => Peer::shardgate(&dir, RouteSpec::Standalone(backend), false, t, tls)?,
        Kind::Rewrite => Peer::shardgate(&dir, RouteSpec::Standalone(backend), true, t, tls)?,
        Kind::Haproxy => Peer::haproxy(&dir, backend, t, s.idle + 200, false, tls)?,
        Kind::HaproxyKeepalive => Peer::haproxy(&dir, backend, t, s.idle + 200, true, tls)?,
        Kind::Nginx => Peer::nginx(&dir, backend, t, s.idle + 50, tls)?,
        Kind::Traefik => Peer::traefik(&dir, backend, t)?,
    }))
}

/// Enough descriptors for the idle connections: ours, and (inherited) the data planes' and
/// Valkey's. A proxy holds two per connection, so the idle count is cut to what the hard
/// limit allows when it cannot be raised (no CAP_SYS_RESOURCE); the report says so.
fn raise_nofile(settings: &mut Settings) -> Result<()> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let want = settings.idle as u64 * 2 + 1_500;
    let cur = getrlimit(Resource::Nofile);
    let raised = setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(want.max(cur.current.unwrap_or(0))),
            maximum: Some(want.max(cur.maximum.unwrap_or(0))),
        },
    );
    if raised.is_err() {
        // As far as the hard limit goes.
        setrlimit(
            Resource::Nofile,
            Rlimit {
                current: cur.maximum,
                maximum: cur.maximum,
            },
        )
        .context("raising RLIMIT_NOFILE to its hard limit")?;
    }
    let now = getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX);
    if now < want {
        let fits = (now.saturating_sub(1_500) / 2) as usize;
        if fits < 100 {
            bail!("RLIMIT_NOFILE is {now}: too low for the idle-connection workload");
        }
        eprintln!(
            "load: RLIMIT_NOFILE cannot go past {now} here: {fits} idle connections instead of {}",
            settings.idle
        );
        settings.idle_note = Some(format!(
            "{fits} rather than {}: a proxy holds two descriptors per connection and \
             RLIMIT_NOFILE's hard limit here is {now} (no CAP_SYS_RESOURCE to raise it)",
            settings.idle
        ));
        settings.idle = fits;
    }
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return Ok(());
    }
    // `cargo test --benches` runs bench targets without --bench: nothing to measure then.
    if !args.iter().any(|a| a == "--bench") {
        println!("load bench: run it with scripts/bench-load (see its --help)");
        return Ok(());
    }
    let mut settings = Settings::parse(&args)?;
    raise_nofile(&mut settings)?;
    let started = Instant::now();
    let date = report::utc_now();
    eprintln!("load: {settings:?}");

    let dir = shardgate_harness::procs::new_root_dir("load")?;
    let valkey = Standalone::start()?;
    let backend = SocketAddr::from((Ipv4Addr::LOCALHOST, valkey.port));
    // Every data plane's idle connections end at this Valkey, one data plane at a time; the
    // headroom covers the previous data plane's connections still being closed.
    let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    let maxclients = (settings.idle as u64 * 2 + 1_000)
        .min(nofile.saturating_sub(32))
        .to_string();
    {
        let mut admin = loadgen::Conn::open(backend)?;
        for cmd in [
            &[&b"CONFIG"[..], b"SET", b"maxclients", maxclients.as_bytes()][..],
            &[b"SET", LATENCY_KEY.as_bytes(), b"abc"],
        ] {
            if let loadgen::Reply::Error(e) = admin.call(cmd)? {
                bail!("setting up the standalone Valkey: -{e}");
            }
        }
    }
    settings.dir = Some(dir.clone());
    settings.backend = Some(backend);
    let cluster = ValkeyCluster::start(ClusterSpec::new(3, 0))?;
    for node in cluster.nodes() {
        node.query::<String>(&["CONFIG", "SET", "maxclients", &maxclients])?;
    }
    let cluster_nodes: Vec<SocketAddr> = cluster.nodes().iter().map(|n| n.addr()).collect();

    let tls = TlsFiles::new().context("the TLS workloads' certificate")?;
    let wanted = |k: Kind| settings.peers.as_ref().is_none_or(|p| p.contains(&k));
    let mut standalone = Vec::new();
    let mut clustered = Vec::new();
    if wanted(Kind::Direct) {
        standalone.push(Peer::direct(backend, vec![]));
        clustered.push(Peer::direct(cluster_nodes[0], cluster_nodes.clone()));
    }
    for &t in &settings.threads {
        if wanted(Kind::Pass) {
            let spec = RouteSpec::Standalone(backend);
            standalone.push(Peer::shardgate(&dir, spec, false, t, Some(&tls))?);
        }
        if wanted(Kind::Rewrite) {
            let spec = RouteSpec::Standalone(backend);
            standalone.push(Peer::shardgate(&dir, spec, true, t, Some(&tls))?);
            clustered.push(Peer::shardgate(
                &dir,
                RouteSpec::Cluster(&cluster),
                true,
                t,
                None,
            )?);
        }
        if wanted(Kind::Haproxy) {
            let conns = settings.idle + 200;
            standalone.push(Peer::haproxy(&dir, backend, t, conns, false, Some(&tls))?);
        }
        if wanted(Kind::HaproxyKeepalive) {
            let conns = settings.idle + 200;
            standalone.push(Peer::haproxy(&dir, backend, t, conns, true, Some(&tls))?);
        }
        if wanted(Kind::Nginx) {
            let conns = settings.idle + 50;
            standalone.push(Peer::nginx(&dir, backend, t, conns, Some(&tls))?);
        }
        if wanted(Kind::Traefik) {
            standalone.push(Peer::traefik(&dir, backend, t)?);
        }
    }
    eprintln!(
        "load: {} data planes up in {:.1}s",
        standalone.len() + clustered.len(),
        started.elapsed().as_secs_f64()
    );
    // Warm every path (connections, allocator, JIT-free but cache-cold code) once.
    let warm = redis_benchmark::Run {
        test: "get",
        clients: 50,
        requests: 5_000,
        pipeline: 1,
        value_size: 3,
        cluster: false,
        tls: false,
    };
    let warm_tls = redis_benchmark::Run {
        tls: true,
        ..warm.clone()
    };
    for peer in &standalone {
        redis_benchmark::run(peer.addr, &warm, None)?;
        if let Some(addr) = peer.tls {
            redis_benchmark::run(addr, &warm_tls, Some(&tls))?;
        }
    }

    let loads = workloads(&settings);
    let mut samples: Vec<Sample> = Vec::new();
    for round in 0..settings.rounds {
        let t = Instant::now();
        for w in &loads {
            let peers = if w.cluster { &clustered } else { &standalone };
            if matches!(w.load, Load::Latency) {
                for s in measure_side_by_side(w, peers, &settings, round)
                    .with_context(|| format!("{} through every data plane", w.name))?
                {
                    eprintln!(
                        "  round {round} {:<18} {:<26} {}",
                        w.name,
                        s.peer,
                        s.brief()
                    );
                    samples.push(s);
                }
                continue;
            }
            // Rotate the order each round: no data plane always runs first after a change.
            let n = peers.len();
            for i in 0..n {
                let peer = &peers[(i + round) % n];
                let s = measure(w, peer, &settings, &tls, round)
                    .with_context(|| format!("{} through {}", w.name, peer.name()))?;
                if let Some(s) = s {
                    eprintln!(
                        "  round {round} {:<18} {:<26} {}",
                        w.name,
                        peer.name(),
                        s.brief()
                    );
                    samples.push(s);
                }
            }
        }
        eprintln!(
            "load: round {} of {} in {:.0}s",
            round + 1,
            settings.rounds,
            t.elapsed().as_secs_f64()
        );
    }

    let env = report::Environment::collect(&settings, &date, started.elapsed());
    std::fs::create_dir_all(&settings.out)?;
    if let Ok(out) = settings.out.canonicalize() {
        settings.out = out;
    }
    let md = report::markdown(&env, &settings, &loads, &samples);
    let md_path = settings.out.join("performance.md");
    std::fs::write(&md_path, md).with_context(|| format!("writing {}", md_path.display()))?;
    let png_path = settings.out.join("performance.png");
    chart::draw(&png_path, &settings, &loads, &samples, &env)?;
    std::fs::write(settings.out.join("performance.csv"), report::csv(&samples))?;
    println!(
        "load: wrote {} and {} ({:.0}s)",
        md_path.display(),
        png_path.display(),
        started.elapsed().as_secs_f64()
    );
    drop(standalone);
    drop(clustered);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
