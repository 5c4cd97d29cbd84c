//! `shardgate-controller`: the operator binary. Parses the command line, sets up logging,
//! metrics and (optionally) leader election, then runs the controller until SIGTERM/SIGINT
//! or until it loses the lease.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, ValueEnum};
use prometheus_client::registry::Registry;
use shardgate_controller::client::ApiTimeouts;
use shardgate_controller::leader::{run_as_leader, Ended, LeaderElection};
use shardgate_controller::metrics::Metrics;
use shardgate_controller::{run, Context, Scope};

/// The shardgate operator: runs ValkeyCluster resources (group shardgate.io, v1alpha1).
///
/// For each ValkeyCluster it makes one StatefulSet per Valkey node, a headless Service, a
/// ConfigMap with valkey.conf and a PodDisruptionBudget; forms the cluster over RESP (MEET,
/// ADDSLOTSRANGE, REPLICATE), heals it (FORGET of lost nodes, re-MEET, re-REPLICATE), rolls
/// config changes one pod at a time with a failover before each primary, and reports
/// conditions, phase and ready counts in status.
///
/// Run it in-cluster (it uses the pod's service account) or with a kubeconfig
/// (KUBECONFIG or ~/.kube/config). It needs network access to the Valkey pods' IPs.
///
/// Examples:
///   shardgate-controller                                  # every namespace
///   shardgate-controller --namespace valkey               # one namespace
///   shardgate-controller --leader-election --lease-namespace shardgate-system
///
/// Endpoints on --metrics-addr: /metrics (Prometheus), /healthz, /readyz.
#[derive(Parser, Debug)]
#[command(version, about, long_about, verbatim_doc_comment)]
struct Args {
    /// Watch only this namespace (default: every namespace).
    #[arg(long, value_name = "NAMESPACE", env = "SHARDGATE_NAMESPACE")]
    namespace: Option<String>,

    /// Run only while holding a Lease, so that several replicas can run (one leads).
    #[arg(long)]
    leader_election: bool,

    /// With --leader-election: the Lease's namespace (default: --namespace, else the
    /// pod's own namespace from POD_NAMESPACE).
    #[arg(long, value_name = "NAMESPACE", env = "POD_NAMESPACE")]
    lease_namespace: Option<String>,

    /// With --leader-election: the Lease's name.
    #[arg(long, value_name = "NAME", default_value = "shardgate-operator")]
    lease_name: String,

    /// With --leader-election: how long a lease holds without renewal.
    #[arg(long, value_name = "DURATION", default_value = "15s", value_parser = humantime::parse_duration)]
    lease_duration: Duration,

    /// This replica's name in the Lease and in events (default: POD_NAME, else the
    /// host name and process id).
    #[arg(long, value_name = "ID", env = "POD_NAME")]
    identity: Option<String>,

    /// A call to the API server that gets no byte back for this long fails and is retried
    /// (on another connection: one that fell silent is not waited on). Watches are renewed
    /// every twice this long (at most 290s): one that falls silent is dropped 5s after that,
    /// and a list or a request opening a watch gives up 10s after that.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = non_zero_duration)]
    api_timeout: Duration,

    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,

    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,

    /// The shardgate-proxy image run in front of clusters in proxy mode
    /// (`externalAccess.mode: proxy`), unless a cluster sets `proxy.image`.
    #[arg(long, value_name = "IMAGE", env = "SHARDGATE_PROXY_IMAGE", default_value = shardgate_controller::context::DEFAULT_PROXY_IMAGE)]
    proxy_image: String,
}

/// A duration above zero (a zero read timeout would fail every call).
fn non_zero_duration(s: &str) -> Result<Duration, String> {
    match humantime::parse_duration(s) {
        Ok(d) if d.is_zero() => Err("must be more than 0".into()),
        Ok(d) => Ok(d),
        Err(e) => Err(e.to_string()),
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn terminated() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => std::future::pending().await,
    }
}

fn identity(args: &Args) -> String {
    args.identity.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "shardgate-operator".into());
        format!("{host}-{}", std::process::id())
    })
}

async fn main_async(args: Args) -> anyhow::Result<bool> {
    let config = kube::Config::infer()
        .await
        .context("no Kubernetes configuration (in-cluster service account or kubeconfig)")?;
    let url = config.cluster_url.clone();
    let timeouts = ApiTimeouts::from_call(args.api_timeout);
    let client = shardgate_controller::client::for_calls(config.clone(), timeouts)
        .with_context(|| format!("a client for the API server at {url}"))?;
    let watch_client = shardgate_controller::client::for_watches(config, timeouts)
        .with_context(|| format!("a client for the API server at {url}"))?;
    let mut registry = Registry::default();
    let metrics = Arc::new(Metrics::default().register(&mut registry));
    let http = tokio::spawn(shardgate_controller::http::serve(
        args.metrics_addr,
        Arc::new(registry),
    ));
    let id = identity(&args);
    let mut ctx = Context::new(client.clone(), metrics.clone(), Some(id.clone()));
    ctx.watch_client = watch_client;
    ctx.api_timeouts = timeouts;
    ctx.proxy_image = args.proxy_image.clone();
    let ctx = Arc::new(ctx);
    let scope = Scope {
        namespace: args.namespace.clone(),
    };
    tracing::info!(
        namespace = args.namespace.as_deref().unwrap_or("(all)"),
        metrics = %args.metrics_addr,
        "shardgate operator starting"
    );

    if !args.leader_election {
        metrics.leader.set(1);
        tokio::select! {
            r = run(ctx, scope, terminated()) => r.context("the controller stopped")?,
            r = http => return Err(anyhow::anyhow!("metrics server on {} stopped: {r:?}", args.metrics_addr)),
        }
        return Ok(true);
    }
    let lease_ns = args
        .lease_namespace
        .clone()
        .or_else(|| args.namespace.clone())
        .context("--leader-election needs --lease-namespace (or --namespace, or POD_NAMESPACE)")?;
    let election = Arc::new(LeaderElection::new(
        client,
        &lease_ns,
        &args.lease_name,
        &id,
        args.lease_duration,
    ));
    let ended = run_as_leader(election, ctx, scope, terminated()).await;
    Ok(ended == Ended::Shutdown)
}

fn main() -> ExitCode {
    let args = Args::parse();
    init_logging(args.log_format);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("shardgate-controller: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(main_async(args)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!(
                "shardgate-controller: lost the leader lease; exiting so that a restart stands by"
            );
            ExitCode::FAILURE
        }
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("shardgate-controller: {e:#}");
            ExitCode::FAILURE
        }
    }
}
