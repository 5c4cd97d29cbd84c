//! The Gateway path end to end, side by side with proxy mode: on the Kubernetes harness (a
//! local control plane whose node agent runs pods as local processes on loopback), one
//! ValkeyCluster whose external access goes through a Gateway's TCPRoutes served by Traefik,
//! one of the same shape behind the operator's shardgate-proxy Deployment, and, as the
//! control, one behind per-shard LoadBalancer Services alone (no data plane but the
//! LoadBalancer that the other two also sit behind), all driven by the same
//! `redis-benchmark --cluster` load from outside (their external endpoints), interleaved over
//! rounds. Writes a markdown report (`docs/performance-gateway.md`).
//!
//! Run it with `scripts/bench-gateway` (which installs the tools and builds the release
//! proxy the proxy pods run).

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::Client;
use redis::AsyncCommands as _;
use shardgate_controller::external::proxy::COMPONENT_PROXY;
use shardgate_crds::names::labels;
use shardgate_crds::valkey_cluster::ValkeyCluster;
use shardgate_harness::stats::spread;
// What a run reported: redis-benchmark's, or the Rust client's in the same terms.
use shardgate_harness::tools::BenchmarkReport as Report;
use shardgate_kube_harness::{ControlPlane, Options};
use shardgate_operator_e2e::external::{
    bootstrap_seeds, external_cluster, gateway_access, port_range, proxy_access,
    topology_names_only, wait_external_ready, TraefikGateway,
};
use shardgate_operator_e2e::{cluster_client, create, eventually, pod_addrs, Operator};

const HELP: &str = "bench-gateway [--rounds N] [--quick] [--out DIR] [--note TEXT]

On a local Kubernetes control plane (the test harness: pods are local processes on loopback
IPs), runs the operator in-process and creates three ValkeyClusters of 3 shards x 1 replica:
`gw`, gateway mode (announce mode, one TCPRoute per node through a Gateway served by
Traefik, itself behind a LoadBalancer); `px`, proxy mode (shardgate-proxy, one replica,
behind a LoadBalancer); and `lb`, the control: announce mode behind per-shard LoadBalancer
Services, with no data plane but the LoadBalancer the other two cross as well. Then drives
all three with the same redis-benchmark --cluster load from outside (50 clients; SET and
GET, pipeline 1 and 16) and one Rust cluster client, interleaved, and writes
docs/performance-gateway.md: requests/s, p50/p99 latency, the data plane's CPU per request
(Traefik's process, the proxy pod's process) and the LoadBalancer relay's, medians over
rounds with their min-max spread.

  --rounds N   rounds of every workload on all three paths (default 3; a multiple of 3
               gives each path the first slot of a workload equally often)
  --quick      1 round of fewer requests: a smoke run
  --out DIR    write performance-gateway.md to DIR instead of docs/
  --note TEXT  a line added to the report's header (e.g. what else the machine was doing)

Needs SHARDGATE_PROXY_BIN (the shardgate-proxy binary the proxy pods run; scripts/bench-gateway
builds the release one), redis-benchmark, Traefik, valkey-server and the Kubernetes binaries
(scripts/setup; . ~/.cache/shardgate/env.sh).";

/// Where the gateway's listeners and the proxy's ports start; each path has its own loopback
/// IP, so the two ranges only need to stay clear of each other for readability.
const GATEWAY_BASE: u16 = 32400;
const PROXY_BASE: u16 = 32500;
const SHARDS: u32 = 3;
const REPLICAS: u32 = 1;
const CLIENTS: u32 = 50;
/// Bytes per value (`redis-benchmark -d`).
const VALUE_SIZE: usize = 16;
/// Keys drawn from this many (`-r`): spread over every slot, as `--cluster` needs.
const KEYSPACE: u64 = 100_000;

struct Args {
    rounds: u32,
    quick: bool,
    out: PathBuf,
    note: Option<String>,
}

fn parse_args() -> Result<Option<Args>> {
    let mut args = Args {
        rounds: 3,
        quick: false,
        out: repo().join("docs"),
        note: None,
    };
    let mut rounds = None;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().with_context(|| format!("{name} needs a value"));
        match a.as_str() {
            "-h" | "--help" => return Ok(None),
            "--quick" => args.quick = true,
            "--rounds" => {
                let v = value("--rounds")?;
                let n: u32 = v.parse().with_context(|| format!("--rounds {v:?}"))?;
                ensure!(n >= 1, "--rounds must be at least 1");
                rounds = Some(n);
            }
            "--out" => args.out = PathBuf::from(value("--out")?),
            "--note" => args.note = Some(value("--note")?),
            other => bail!("unknown argument {other:?}\n\n{HELP}"),
        }
    }
    args.rounds = rounds.unwrap_or(if args.quick { 1 } else { 3 });
    Ok(Some(args))
}

fn main() -> Result<()> {
    let Some(args) = parse_args()? else {
        println!("{HELP}");
        return Ok(());
    };
    // The LoadBalancer relay that every path crosses runs in this process: a debug build
    // would make it, not the data planes, what the run measures.
    ensure!(
        !cfg!(debug_assertions),
        "bench-gateway is a release build's job (scripts/bench-gateway runs it so): the \
         harness's LoadBalancer relay, which every measured path crosses, runs in this process"
    );
    let tools = Tools::find()?;
    let started = Instant::now();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("building the Tokio runtime")?;
    let crds = shardgate_kube_harness::yaml_files_in(&repo().join("deploy/crds"))?;
    println!(
        "starting the control plane (etcd, kube-apiserver, kube-controller-manager, node agent)"
    );
    let cp = runtime
        .block_on(ControlPlane::start_with(Options {
            yaml_files: crds,
            ..Default::default()
        }))
        .context("starting the control plane (run scripts/setup first?)")?;
    println!(
        "  up in {:.1?}; kubeconfig {}",
        started.elapsed(),
        cp.kubeconfig().display()
    );
    let result = runtime.block_on(bench(&cp, &args));
    // The operator's task and the clients live on this runtime: stop them before the control
    // plane; its shutdown (the agent's thread, the daemons) blocks, so not on the runtime.
    drop(runtime);
    cp.shutdown();
    let (samples, relay_idle) = result?;
    let text = report(&args, &tools, &samples, relay_idle, started.elapsed())?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let path = args.out.join("performance-gateway.md");
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    println!(
        "wrote {} ({:.0?} in all)",
        path.display(),
        started.elapsed()
    );
    Ok(())
}

/// The workspace's root (the CRDs, docs/).
fn repo() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    root.canonicalize().unwrap_or(root)
}

/// The commit the proxy was built from, and whether `proxy/` differs from it: the release
/// binary is built from the working tree, which may hold changes in progress. Read-only git.
fn source_state() -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(repo())
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match (
        git(&["rev-parse", "--short", "HEAD"]),
        git(&["status", "--porcelain", "--", "proxy"]),
    ) {
        (Some(commit), Some(changes)) if changes.is_empty() => format!("commit {commit}"),
        (Some(commit), Some(_)) => format!("commit {commit} with uncommitted changes in proxy/"),
        _ => "commit unknown".into(),
    }
}

/// The programs the run needs, found before anything starts, and their versions.
struct Tools {
    versions: Vec<(&'static str, String)>,
}

impl Tools {
    fn find() -> Result<Tools> {
        let redis_benchmark = shardgate_harness::tools::redis_benchmark()
            .context("redis-benchmark (Debian's redis-tools; scripts/setup) is needed")?;
        let traefik = shardgate_kube_harness::traefik_binary()?;
        let valkey = shardgate_harness::tools::valkey_server()?;
        // The node agent runs `$SHARDGATE_PROXY_BIN` for the proxy pods; without it, it would
        // take whatever binary lies next to this one (a debug build, perhaps without the
        // `kubernetes` feature, when this one was built otherwise): not what a benchmark
        // should measure.
        let proxy = std::env::var_os("SHARDGATE_PROXY_BIN")
            .map(PathBuf::from)
            .filter(|p| p.is_file())
            .context(
                "SHARDGATE_PROXY_BIN is not set to a file: run scripts/bench-gateway, which \
                 builds the release shardgate-proxy and sets it",
            )?;
        let versions = vec![
            ("Valkey", first_line(&valkey, &["--version"])?),
            ("Traefik", traefik_version(&traefik)?),
            (
                "redis-benchmark",
                first_line(&redis_benchmark, &["--version"])?,
            ),
            (
                "shardgate-proxy",
                format!(
                    "{} ({}; {})",
                    first_line(&proxy, &["--version"])?,
                    proxy.display(),
                    source_state()
                ),
            ),
        ];
        Ok(Tools { versions })
    }
}

fn first_line(program: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {}", program.display()))?;
    ensure!(
        out.status.success(),
        "{} {args:?}: {}",
        program.display(),
        out.status
    );
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap_or_default()
        .trim()
        .to_string())
}

/// `traefik version` prints a block; the `Version:` line is the one that matters.
fn traefik_version(traefik: &Path) -> Result<String> {
    let out = Command::new(traefik)
        .arg("version")
        .output()
        .with_context(|| format!("running {} version", traefik.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix("Version:"))
        .map(|v| format!("traefik {}", v.trim()))
        .unwrap_or_else(|| "traefik (version unknown)".into()))
}

// === the three paths ===

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// The control: announce mode behind per-shard LoadBalancer Services, no data plane of
    /// its own.
    LoadBalancer,
    Gateway,
    Proxy,
}

impl Mode {
    /// In the order of the report's columns.
    const ALL: [Mode; 3] = [Mode::LoadBalancer, Mode::Gateway, Mode::Proxy];

    fn label(self) -> &'static str {
        match self {
            Mode::LoadBalancer => "LoadBalancer only",
            Mode::Gateway => "gateway (Traefik)",
            Mode::Proxy => "proxy (shardgate)",
        }
    }
}

/// One path into a cluster: where a client outside starts, and the data plane's process.
#[derive(Clone, Debug)]
struct Target {
    mode: Mode,
    seed: SocketAddr,
    /// The data plane's process: `None` for the LoadBalancer alone, which has none, or when
    /// it was not found (the report then has no data-plane CPU for that path).
    pid: Option<u32>,
}

/// The samples, and the node agent's CPU seconds per second while no load ran.
async fn bench(cp: &ControlPlane, args: &Args) -> Result<(Vec<Sample>, f64)> {
    let client = cp.client()?;
    let ns = cp.namespace("bench-gateway").await?;
    let started = Instant::now();
    // Six listeners: one per node (3 shards x 2 nodes), as gateway mode routes them.
    let nodes = u16::try_from(SHARDS * (REPLICAS + 1))?;
    // Behind a LoadBalancer Service, as the proxy is: every path crosses the harness's relay.
    let gateway = TraefikGateway::start_behind_load_balancer(
        cp,
        &client,
        &ns,
        &port_range(GATEWAY_BASE, nodes),
        usize::from(nodes),
        "valkey",
    )
    .await?;
    println!(
        "Traefik up at {} behind the LoadBalancer {} (pid {}); log {}",
        gateway.traefik.ip(),
        gateway.ip(),
        gateway.traefik.pid(),
        gateway.traefik.log_path().display()
    );
    let operator = Operator::start(&client, &ns);
    for (name, access) in [
        ("lb", load_balancer_access()),
        ("gw", gateway_access(GATEWAY_BASE, Some("valkey"))),
        ("px", proxy_access(PROXY_BASE)),
    ] {
        create(&client, &ns, &benchmark_cluster(name, access)?).await?;
    }
    println!(
        "waiting for lb (LoadBalancers), gw (gateway mode) and px (proxy mode) to be Ready from \
         outside"
    );
    let (lb, gw, px) = tokio::try_join!(
        wait_external_ready(&client, &ns, "lb"),
        wait_external_ready(&client, &ns, "gw"),
        wait_external_ready(&client, &ns, "px"),
    )?;
    println!("  all Ready in {:.1?}", started.elapsed());

    let lb_seed = checked_seed(&client, &ns, &lb).await?;
    let gw_seed = checked_seed(&client, &ns, &gw).await?;
    ensure!(
        gw_seed.ip() == gateway.ip(),
        "gw's bootstrap {gw_seed} is not at the Gateway {}",
        gateway.ip()
    );
    let px_seed = checked_seed(&client, &ns, &px).await?;
    let targets = [
        Target {
            mode: Mode::LoadBalancer,
            seed: lb_seed,
            pid: None,
        },
        Target {
            mode: Mode::Gateway,
            seed: gw_seed,
            pid: Some(gateway.traefik.pid()).filter(|&p| cmdline_has(p, "traefik")),
        },
        Target {
            mode: Mode::Proxy,
            seed: px_seed,
            pid: proxy_pid(&client, &ns, "px").await?,
        },
    ];
    for t in &targets {
        println!(
            "  {:<18} seed {}, data plane pid {}",
            t.mode.label(),
            t.seed,
            match (t.mode, t.pid) {
                (Mode::LoadBalancer, _) => "none (the relay alone)".into(),
                (_, Some(p)) => p.to_string(),
                (_, None) => "not found".into(),
            }
        );
    }
    let relay_idle = relay_idle_rate().await?;
    println!(
        "  the node agent's threads use {:.1} ms of CPU per second with no load: taken off \
         each run's relay CPU",
        relay_idle * 1e3
    );
    let samples = run_rounds(&targets, args, relay_idle).await;
    gateway.traefik.check_running()?;
    operator.stop().await;
    Ok((samples?, relay_idle))
}

/// How long the node agent's idle CPU is measured.
const IDLE_WINDOW: Duration = Duration::from_secs(5);

/// The node agent's CPU seconds per second with no load: it lists the Pods and Services
/// every tick and probes the pods, work that a run's relay CPU would otherwise count in
/// proportion to the run's length rather than its requests.
async fn relay_idle_rate() -> Result<f64> {
    let missing = "the node agent's threads (the LoadBalancer relay) are not found in this process";
    let before = relay_cpu_seconds().context(missing)?;
    let started = Instant::now();
    tokio::time::sleep(IDLE_WINDOW).await;
    let after = relay_cpu_seconds().context(missing)?;
    Ok((after - before) / started.elapsed().as_secs_f64())
}

/// `externalAccess` for the control: announce mode, one LoadBalancer Service per shard (the
/// harness hands out an ingress IP for each), every node announcing its Service's ingress.
fn load_balancer_access() -> serde_json::Value {
    serde_json::json!({ "enabled": true, "mode": "announce", "serviceType": "LoadBalancer" })
}

/// A 3 x 1 cluster with `externalAccess` set to `access`, without persistence: a fork for an
/// RDB snapshot or an AOF rewrite in the middle of a run would load two shared cores with
/// work that is neither path's.
fn benchmark_cluster(name: &str, access: serde_json::Value) -> Result<ValkeyCluster> {
    let mut vc = external_cluster(name, SHARDS, REPLICAS, access)?;
    vc.spec.config.insert("appendonly".into(), "no".into());
    vc.spec.config.insert("save".into(), "\"\"".into());
    Ok(vc)
}

/// The first bootstrap address of `vc`, once the topology asked through it names only its
/// external endpoints: otherwise redis-benchmark would follow pod addresses (reachable here
/// on loopback) and bypass the data plane being measured.
async fn checked_seed(client: &Client, ns: &str, vc: &ValkeyCluster) -> Result<SocketAddr> {
    let name = kube::ResourceExt::name_any(vc);
    let status = vc.status.clone().context("no status")?;
    let allowed = status
        .external_endpoints
        .iter()
        .map(|e| e.address())
        .collect();
    let pod_ips = pod_addrs(client, ns, &name)
        .await?
        .values()
        .map(|a| a.ip().to_string())
        .collect();
    let seed = *bootstrap_seeds(vc)?
        .first()
        .with_context(|| format!("{name}: empty bootstrap"))?;
    // Gossip may trail Ready by a round (a replica not yet listed by the seed).
    eventually(
        &format!("{name}: the topology seen from outside"),
        Duration::from_secs(60),
        || topology_names_only(seed, &allowed, &pod_ips),
    )
    .await?;
    Ok(seed)
}

/// The process of `cluster`'s one proxy pod: the node agent reports each container's pid in
/// its `containerID` (`shardgate://<pid>`).
async fn proxy_pid(client: &Client, ns: &str, cluster: &str) -> Result<Option<u32>> {
    let sel = format!(
        "{}={cluster},{}={COMPONENT_PROXY}",
        labels::CLUSTER,
        labels::COMPONENT
    );
    let pods = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&sel))
        .await?;
    let pids: Vec<u32> = pods
        .items
        .iter()
        .filter_map(|p| p.status.as_ref()?.container_statuses.as_ref())
        .flatten()
        .filter_map(|c| c.container_id.as_deref()?.strip_prefix("shardgate://"))
        .filter_map(|pid| pid.parse().ok())
        .collect();
    match pids.as_slice() {
        [pid] if cmdline_has(*pid, "shardgate-proxy") => Ok(Some(*pid)),
        other => {
            eprintln!("the proxy pod's process is not found (pids {other:?}): no CPU figures");
            Ok(None)
        }
    }
}

/// Whether `/proc/<pid>/cmdline` names `program` (the pid is the process meant, not a reuse).
fn cmdline_has(pid: u32, program: &str) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| String::from_utf8_lossy(&c).contains(program))
        .unwrap_or(false)
}

/// On-CPU time of all of `pid`'s threads (`/proc/<pid>/task/*/schedstat`, nanoseconds).
fn cpu_seconds(pid: u32) -> Option<f64> {
    threads_cpu_seconds(&format!("/proc/{pid}/task"), |_| true)
}

/// The name of the node agent's runtime threads (`shardgate_kube_harness`'s agent): the
/// LoadBalancer relay runs on them, in this process.
const RELAY_THREADS: &str = "node-agent";

/// On-CPU time of this process's node-agent threads: the LoadBalancer relay's, with the
/// agent's own work (see [`relay_idle_rate`]). `None` if there are none.
fn relay_cpu_seconds() -> Option<f64> {
    threads_cpu_seconds("/proc/self/task", |task| {
        std::fs::read_to_string(task.join("comm")).is_ok_and(|c| c.trim_end() == RELAY_THREADS)
    })
}

/// The summed on-CPU time of the threads under `tasks` that `pick` keeps (`schedstat`,
/// nanoseconds); `None` if none was read.
fn threads_cpu_seconds(tasks: &str, pick: impl Fn(&Path) -> bool) -> Option<f64> {
    let mut ns = 0u64;
    let mut read = 0;
    for task in std::fs::read_dir(tasks).ok()?.flatten() {
        let path = task.path();
        if !pick(&path) {
            continue;
        }
        // A thread may end between the listing and the read: it then counts for nothing.
        let Ok(text) = std::fs::read_to_string(path.join("schedstat")) else {
            continue;
        };
        ns += text.split_whitespace().next()?.parse::<u64>().ok()?;
        read += 1;
    }
    (read > 0).then(|| ns as f64 / 1e9)
}

// === the load ===

#[derive(Clone, Copy, Debug)]
struct Workload {
    name: &'static str,
    load: Load,
}

#[derive(Clone, Copy, Debug)]
enum Load {
    /// `redis-benchmark --cluster -t <test> -P <pipeline>`, [`CLIENTS`] clients.
    Benchmark { test: &'static str, pipeline: u32 },
    /// One Rust cluster client (the `redis` crate, cluster-async) doing SET then GET of each
    /// key, one request at a time: the latency a single caller sees, timed per request.
    ClusterClient,
}

/// SET before GET, so that the GETs find values.
const WORKLOADS: [Workload; 5] = [
    Workload {
        name: "SET P1",
        load: Load::Benchmark {
            test: "set",
            pipeline: 1,
        },
    },
    Workload {
        name: "GET P1",
        load: Load::Benchmark {
            test: "get",
            pipeline: 1,
        },
    },
    Workload {
        name: "SET P16",
        load: Load::Benchmark {
            test: "set",
            pipeline: 16,
        },
    },
    Workload {
        name: "GET P16",
        load: Load::Benchmark {
            test: "get",
            pipeline: 16,
        },
    },
    Workload {
        name: "1 client SET+GET",
        load: Load::ClusterClient,
    },
];

/// Requests per run. `redis-benchmark --cluster` runs a thread per primary, and in that mode
/// it stops only on its 250 ms throughput timer: a run's time comes out up to 0.25 s long
/// (the report says by how much at most), so runs last several seconds each.
fn requests(w: &Workload, quick: bool) -> u64 {
    match (w.load, quick) {
        (Load::Benchmark { pipeline: 1, .. }, false) => 400_000,
        (Load::Benchmark { pipeline: 1, .. }, true) => 100_000,
        (Load::Benchmark { .. }, false) => 4_000_000,
        (Load::Benchmark { .. }, true) => 1_000_000,
        // SETs and GETs together, one at a time.
        (Load::ClusterClient, false) => 20_000,
        (Load::ClusterClient, true) => 6_000,
    }
}

/// The workload named `name`.
fn workload(name: &str) -> Option<&'static Workload> {
    WORKLOADS.iter().find(|w| w.name == name)
}

/// How long a redis-benchmark run waits, at most, past its last reply: its throughput
/// timer's period, on which a `--cluster` (threaded) run stops.
const BENCHMARK_TICK: Duration = Duration::from_millis(250);

/// Before the first round, each path gets this many SETs, not measured: connections,
/// buffers and the proxy's and Traefik's first allocations, and keys for the GETs.
const WARM_UP: u64 = 20_000;

/// One redis-benchmark run on one path.
#[derive(Clone, Debug)]
struct Sample {
    workload: &'static str,
    mode: Mode,
    round: u32,
    requests: u64,
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    /// The data plane's CPU seconds over the run.
    cpu_s: Option<f64>,
    /// The LoadBalancer relay's CPU seconds over the run.
    relay_cpu_s: Option<f64>,
}

async fn run_rounds(targets: &[Target; 3], args: &Args, relay_idle: f64) -> Result<Vec<Sample>> {
    for t in targets {
        let seed = t.seed;
        tokio::task::spawn_blocking(move || redis_benchmark(seed, "set", 1, WARM_UP))
            .await
            .context("the warm-up task")??;
    }
    let mut samples = Vec::new();
    for round in 0..args.rounds {
        for (i, w) in WORKLOADS.iter().enumerate() {
            // Rotate which path goes first, so none always runs on a warmer machine.
            let first = (round as usize + i) % targets.len();
            for t in targets[first..].iter().chain(&targets[..first]) {
                let s = measure(t, w, requests(w, args.quick), round, relay_idle).await?;
                println!(
                    "  round {}/{} {:<16} {:<18} {:>9.0} req/s  p50 {:.3} ms  p99 {:.3} ms{}{}",
                    round + 1,
                    args.rounds,
                    s.workload,
                    s.mode.label(),
                    s.rps,
                    s.p50_ms,
                    s.p99_ms,
                    cpu_us(&s).map_or(String::new(), |c| format!("  data plane {c:.2} us/req")),
                    relay_us(&s).map_or(String::new(), |c| format!("  relay {c:.2} us/req"))
                );
                samples.push(s);
            }
        }
    }
    Ok(samples)
}

/// One run; its relay CPU less the node agent's idle rate over the run's length.
async fn measure(
    t: &Target,
    w: &Workload,
    requests: u64,
    round: u32,
    relay_idle: f64,
) -> Result<Sample> {
    let seed = t.seed;
    // Connected before the clock starts: the run measures requests, not a handshake.
    let conn = match w.load {
        Load::ClusterClient => Some(cluster_client([seed]).await?),
        Load::Benchmark { .. } => None,
    };
    let before = t.pid.and_then(cpu_seconds);
    let relay_before = relay_cpu_seconds();
    let started = Instant::now();
    let r = match (w.load, conn) {
        (Load::Benchmark { test, pipeline }, _) => {
            tokio::task::spawn_blocking(move || redis_benchmark(seed, test, pipeline, requests))
                .await
                .context("the benchmark task")??
        }
        (Load::ClusterClient, Some(conn)) => one_client(conn, requests).await?,
        (Load::ClusterClient, None) => bail!("no cluster connection"),
    };
    let after = t.pid.and_then(cpu_seconds);
    let relay_after = relay_cpu_seconds();
    let idle = relay_idle * started.elapsed().as_secs_f64();
    Ok(Sample {
        workload: w.name,
        mode: t.mode,
        round,
        requests,
        rps: r.rps,
        p50_ms: r.p50_ms,
        p99_ms: r.p99_ms,
        cpu_s: before.zip(after).map(|(b, a)| a - b),
        relay_cpu_s: relay_before.zip(relay_after).map(|(b, a)| a - b - idle),
    })
}

/// `redis-benchmark --cluster` from `seed` (it asks the seed for the topology and connects to
/// every primary at the address handed out: the external one).
fn redis_benchmark(seed: SocketAddr, test: &str, pipeline: u32, requests: u64) -> Result<Report> {
    let bin = shardgate_harness::tools::redis_benchmark()?;
    let what = format!("redis-benchmark -t {test} -P {pipeline} against {seed}");
    let out = Command::new(&bin)
        .args(["-h", &seed.ip().to_string(), "-p", &seed.port().to_string()])
        .args(["-c", &CLIENTS.to_string(), "-n", &requests.to_string()])
        .args(["-P", &pipeline.to_string(), "-d", &VALUE_SIZE.to_string()])
        .args([
            "-t",
            test,
            "--csv",
            "--cluster",
            "-r",
            &KEYSPACE.to_string(),
        ])
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.success(),
        "{what} failed ({}): {text}\n{stderr}",
        out.status
    );
    shardgate_harness::tools::parse_benchmark_csv(&text)
        .with_context(|| format!("{what}: no result in\n{text}\n{stderr}"))
}

/// `requests` / 2 keys over every slot, each SET and then each GET (checked), one request at
/// a time; every request timed on its own.
async fn one_client(
    mut conn: redis::cluster_async::ClusterConnection,
    requests: u64,
) -> Result<Report> {
    let keys = shardgate_harness::clients::spread_keys(usize::try_from(requests / 2)?, "bench");
    let value = "v".repeat(VALUE_SIZE);
    let mut latencies = Vec::with_capacity(keys.len() * 2);
    let started = Instant::now();
    for k in &keys {
        let t = Instant::now();
        let () = conn
            .set(k, &value)
            .await
            .with_context(|| format!("SET {k}"))?;
        latencies.push(t.elapsed());
    }
    for k in &keys {
        let t = Instant::now();
        let v: String = conn.get(k).await.with_context(|| format!("GET {k}"))?;
        latencies.push(t.elapsed());
        ensure!(v == value, "GET {k}: {v:?}");
    }
    let elapsed = started.elapsed().as_secs_f64();
    ensure!(!latencies.is_empty(), "no requests");
    latencies.sort();
    // The nearest-rank percentile.
    let ms = |q: f64| {
        let i = ((latencies.len() as f64 * q).ceil() as usize).clamp(1, latencies.len()) - 1;
        latencies[i].as_secs_f64() * 1e3
    };
    Ok(Report {
        rps: latencies.len() as f64 / elapsed,
        p50_ms: ms(0.50),
        p99_ms: ms(0.99),
    })
}

// === the report ===

/// A table row: the workload, then its cells.
fn row(md: &mut String, workload: &str, cells: [String; 6]) -> std::fmt::Result {
    writeln!(md, "| {workload} | {} |", cells.join(" | "))
}

/// The data plane's CPU over a run, in µs per request.
fn cpu_us(s: &Sample) -> Option<f64> {
    s.cpu_s.map(|c| c / s.requests as f64 * 1e6)
}

/// The relay's CPU over a run, in µs per request.
fn relay_us(s: &Sample) -> Option<f64> {
    s.relay_cpu_s.map(|c| c / s.requests as f64 * 1e6)
}

/// `median (min–max)`, the median alone for one round, `–` for none.
fn show(values: &[f64], digits: usize) -> String {
    match spread(values.to_vec()) {
        None => "–".into(),
        Some(s) if values.len() == 1 => format!("{:.digits$}", s.median),
        Some(s) => format!(
            "{:.digits$} ({:.digits$}–{:.digits$})",
            s.median, s.min, s.max
        ),
    }
}

fn report(
    args: &Args,
    tools: &Tools,
    samples: &[Sample],
    relay_idle: f64,
    took: Duration,
) -> Result<String> {
    let date = k8s_openapi::jiff::Timestamp::now().strftime("%Y-%m-%d %H:%M UTC");
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let load = std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into());

    let mut md = String::new();
    writeln!(
        md,
        "# Gateway mode (Traefik TCPRoutes) vs proxy mode (shardgate), over LoadBalancers alone\n"
    )?;
    writeln!(
        md,
        "Generated by `scripts/bench-gateway{}` on {date} (the harness's part took \
         {:.0?}). {cores} cores; load \
         average {load} when the report was written. **The machine is shared** (other builds \
         and benchmarks may have run at the same time): compare the columns of a row, \
         measured interleaved, rather than absolute numbers.\n",
        if args.quick { " --quick" } else { "" },
        took
    )?;
    if let Some(note) = &args.note {
        writeln!(md, "Note: {note}\n")?;
    }
    let versions: Vec<String> = tools
        .versions
        .iter()
        .map(|(what, v)| format!("{what}: `{v}`"))
        .collect();
    writeln!(md, "Versions: {}.\n", versions.join("; "))?;
    writeln!(
        md,
        "Setup: the Kubernetes harness (etcd, kube-apiserver, kube-controller-manager, a node \
         agent running pods as local processes on loopback IPs) and the operator. Three \
         ValkeyClusters of {SHARDS} shards x {REPLICAS} replica (no persistence): `gw` in \
         gateway mode (announce mode, one TCPRoute per node on a Gateway served by Traefik, \
         `GOMAXPROCS=2`, behind a LoadBalancer Service); `px` in proxy mode (one \
         shardgate-proxy pod, release build, behind a LoadBalancer address, rewriting \
         topology replies; Tokio's default runtime, one worker per core); and `lb`, the \
         control, in announce mode behind one LoadBalancer Service per shard, each node \
         announcing its Service's ingress. Before measuring, the topology asked through each \
         path is checked to name only its external addresses, so the client cannot bypass \
         the path.\n"
    )?;
    writeln!(
        md,
        "**Every path crosses the same relay.** The harness's LoadBalancer is a user-space \
         relay on the node agent's threads in this process (built with `--release`). \
         Traefik is deployed as in a cluster, behind a LoadBalancer Service of its own whose \
         ingress its Gateway hands out (`statusAddress.service`), as the proxy is behind its \
         Service. So `lb` is client → relay → Valkey, gateway mode client → relay → Traefik \
         → Valkey, and proxy mode client → relay → shardgate → Valkey: what a data plane \
         costs is its row against `lb`'s. A real LoadBalancer (cloud, MetalLB, IPVS) does \
         the relay's hop in the kernel or the network; here it takes two reads and two \
         writes per round trip on every path and a share of the two cores, so absolute \
         requests/s and latency are lower than a cluster's would be. The relay's CPU is \
         measured apart (the node agent's threads), as a check that it does the same work \
         for each path. For the data planes alone, one hop each in front of the same Valkey, \
         see [performance.md](performance.md) (shardgate against Traefik's TCP router).\n"
    )?;
    writeln!(
        md,
        "Load: `redis-benchmark --cluster -c {CLIENTS} -d {VALUE_SIZE} -r {KEYSPACE}` from the \
         external bootstrap address, {} round(s), the paths interleaved (the first path \
         rotates), after {WARM_UP} SETs on each path not measured; {} requests per run at \
         pipeline 1 and {} at pipeline 16. `1 client SET+GET`: one Rust cluster client (the \
         `redis` crate's cluster-async connection, its own overhead in every column) seeded \
         with the same address, {} requests, SET then GET of keys over every slot, one at a \
         time, each timed (its req/s is requests over the run's time). Cells are the median \
         over rounds with the min–max spread; a ratio is of the medians.\n",
        args.rounds,
        requests(&WORKLOADS[0], args.quick),
        requests(&WORKLOADS[2], args.quick),
        requests(&WORKLOADS[4], args.quick),
    )?;
    // The shortest redis-benchmark run, and what its stop on the timer may have cost it.
    let shortest = samples
        .iter()
        .filter(|s| {
            matches!(
                workload(s.workload).map(|w| w.load),
                Some(Load::Benchmark { .. })
            )
        })
        .map(|s| s.requests as f64 / s.rps)
        .filter(|t| t.is_finite())
        .min_by(f64::total_cmp);
    if let Some(t) = shortest {
        let tick = BENCHMARK_TICK.as_secs_f64();
        writeln!(
            md,
            "redis-benchmark in `--cluster` mode runs a thread per primary and stops only on \
             its {:.0} ms throughput timer, so each run's time is overstated by up to {tick:.2} \
             s and its requests/s understated: the shortest run here took {t:.1} s, so by \
             {:.1}% at most (a draw per run, relatively largest on the fastest path's \
             runs).\n",
            tick * 1e3,
            tick / t * 100.0,
        )?;
    }

    let of = |w: &str, m: Mode, f: fn(&Sample) -> Option<f64>| -> Option<Vec<f64>> {
        samples
            .iter()
            .filter(|s| s.workload == w && s.mode == m)
            .map(f)
            .collect::<Option<Vec<f64>>>()
            .filter(|v| !v.is_empty())
    };
    let cell = |v: &Option<Vec<f64>>, digits: usize| show(v.as_deref().unwrap_or_default(), digits);
    let median = |v: &Option<Vec<f64>>| spread(v.clone()?).map(|s| s.median);
    let ratio =
        |top: &Option<Vec<f64>>, bottom: &Option<Vec<f64>>| match (median(top), median(bottom)) {
            (Some(t), Some(b)) if b > 0.0 => format!("{:.2}", t / b),
            _ => "–".into(),
        };
    for w in &WORKLOADS {
        for m in Mode::ALL {
            ensure!(
                of(w.name, m, |s| Some(s.rps)).is_some(),
                "no samples of {} on {}",
                w.name,
                m.label()
            );
        }
    }

    writeln!(md, "## Requests/s\n")?;
    writeln!(
        md,
        "| workload | LoadBalancer only | gateway | proxy | proxy / gateway | gateway / \
         LoadBalancer only | proxy / LoadBalancer only |"
    )?;
    writeln!(md, "|---|---:|---:|---:|---:|---:|---:|")?;
    for w in &WORKLOADS {
        let [l, g, p] = Mode::ALL.map(|m| of(w.name, m, |s| Some(s.rps)));
        row(
            &mut md,
            w.name,
            [
                cell(&l, 0),
                cell(&g, 0),
                cell(&p, 0),
                ratio(&p, &g),
                ratio(&g, &l),
                ratio(&p, &l),
            ],
        )?;
    }

    writeln!(md, "\n## Latency (ms)\n")?;
    writeln!(
        md,
        "| workload | LoadBalancer only p50 | gateway p50 | proxy p50 | LoadBalancer only p99 \
         | gateway p99 | proxy p99 |"
    )?;
    writeln!(md, "|---|---:|---:|---:|---:|---:|---:|")?;
    for w in &WORKLOADS {
        let [l50, g50, p50] = Mode::ALL.map(|m| of(w.name, m, |s| Some(s.p50_ms)));
        let [l99, g99, p99] = Mode::ALL.map(|m| of(w.name, m, |s| Some(s.p99_ms)));
        row(
            &mut md,
            w.name,
            [
                cell(&l50, 3),
                cell(&g50, 3),
                cell(&p50, 3),
                cell(&l99, 3),
                cell(&g99, 3),
                cell(&p99, 3),
            ],
        )?;
    }

    writeln!(md, "\n## CPU per request (µs)\n")?;
    writeln!(
        md,
        "Data plane: on-CPU time of the Traefik process and of the proxy pod's process \
         (`/proc/<pid>/task/*/schedstat`) over the run, divided by its requests (`–`: the \
         process was not found). Relay: the same for the node agent's threads in this \
         process, which carry every path's LoadBalancer hop, less the agent's own work \
         (listing Pods and Services every tick, probing the pods: {:.1} ms of CPU per \
         second, measured over {:.0?} with no load before the first round) for the run's \
         length.\n",
        relay_idle * 1e3,
        IDLE_WINDOW
    )?;
    writeln!(
        md,
        "| workload | gateway data plane | proxy data plane | proxy / gateway | relay, \
         LoadBalancer only | relay, gateway | relay, proxy |"
    )?;
    writeln!(md, "|---|---:|---:|---:|---:|---:|---:|")?;
    for w in &WORKLOADS {
        let (g, p) = (
            of(w.name, Mode::Gateway, cpu_us),
            of(w.name, Mode::Proxy, cpu_us),
        );
        let [rl, rg, rp] = Mode::ALL.map(|m| of(w.name, m, relay_us));
        row(
            &mut md,
            w.name,
            [
                cell(&g, 2),
                cell(&p, 2),
                ratio(&p, &g),
                cell(&rl, 2),
                cell(&rg, 2),
                cell(&rp, 2),
            ],
        )?;
    }

    writeln!(md, "\n## Every run\n")?;
    writeln!(
        md,
        "| round | workload | path | requests | req/s | p50 ms | p99 ms | data-plane CPU s | \
         relay CPU s |"
    )?;
    writeln!(md, "|---:|---|---|---:|---:|---:|---:|---:|---:|")?;
    let secs = |c: Option<f64>| c.map_or("–".into(), |c| format!("{c:.2}"));
    for s in samples {
        writeln!(
            md,
            "| {} | {} | {} | {} | {:.0} | {:.3} | {:.3} | {} | {} |",
            s.round + 1,
            s.workload,
            s.mode.label(),
            s.requests,
            s.rps,
            s.p50_ms,
            s.p99_ms,
            secs(s.cpu_s),
            secs(s.relay_cpu_s),
        )?;
    }
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells() {
        assert_eq!(show(&[2.0], 1), "2.0");
        assert_eq!(show(&[1.0, 3.0, 2.0], 0), "2 (1–3)");
        assert_eq!(show(&[], 0), "–");
    }

    /// One round of every workload on every path, with hand-picked figures: the tables show
    /// them and their ratios, and a path without a data plane has no data-plane CPU.
    #[test]
    fn the_report_compares_each_path_with_the_others() {
        let figures = |mode| match mode {
            Mode::LoadBalancer => (100.0, 1.0, None),
            Mode::Gateway => (50.0, 2.0, Some(0.5)),
            Mode::Proxy => (60.0, 1.5, Some(0.3)),
        };
        let samples: Vec<Sample> = WORKLOADS
            .iter()
            .flat_map(|w| Mode::ALL.map(|mode| (w, mode)))
            .map(|(w, mode)| {
                let (rps, p50_ms, cpu_s) = figures(mode);
                Sample {
                    workload: w.name,
                    mode,
                    round: 0,
                    requests: 100_000,
                    rps,
                    p50_ms,
                    p99_ms: p50_ms * 2.0,
                    cpu_s,
                    relay_cpu_s: Some(0.2),
                }
            })
            .collect();
        let args = Args {
            rounds: 1,
            quick: false,
            out: PathBuf::new(),
            note: None,
        };
        let tools = Tools { versions: vec![] };
        let md = report(&args, &tools, &samples, 0.002, Duration::from_secs(1)).expect("a report");
        // Requests/s: the three paths, proxy / gateway, gateway / LB, proxy / LB.
        assert!(
            md.contains("| SET P1 | 100 | 50 | 60 | 1.20 | 0.50 | 0.60 |"),
            "{md}"
        );
        assert!(
            md.contains("| GET P16 | 1.000 | 2.000 | 1.500 | 2.000 | 4.000 | 3.000 |"),
            "{md}"
        );
        // CPU µs per request: 0.5 s and 0.3 s over 100,000 requests; the relay's 0.2 s.
        assert!(
            md.contains("| 1 client SET+GET | 5.00 | 3.00 | 0.60 | 2.00 | 2.00 | 2.00 |"),
            "{md}"
        );
        assert!(
            md.contains(
                "| 1 | SET P1 | LoadBalancer only | 100000 | 100 | 1.000 | 2.000 | – | 0.20 |"
            ),
            "{md}"
        );
        // The node agent's idle rate taken off the relay's figures, as stated.
        assert!(md.contains("2.0 ms of CPU per second"), "{md}");
        // The timer's bound, from the shortest redis-benchmark run (100,000 at 100 req/s).
        assert!(
            md.contains("the shortest run here took 1000.0 s, so by 0.0% at most"),
            "{md}"
        );
        // A path with no sample of a workload is an error, not an empty cell.
        let some: Vec<Sample> = samples
            .iter()
            .filter(|s| s.mode != Mode::Proxy)
            .cloned()
            .collect();
        assert!(report(&args, &tools, &some, 0.002, Duration::from_secs(1)).is_err());
    }
}
