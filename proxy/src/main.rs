//! `shardgate-proxy`: the binary. Parses the command line, sets up logging, runs the proxy
//! until SIGTERM or SIGINT, then drains.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{ArgGroup, Parser, ValueEnum};
use shardgate_crds::Hostnames;
use shardgate_proxy::config::{TlsConfig, TlsModeConfig};
use shardgate_proxy::route::Backend;
use shardgate_proxy::tls::backend::BackendTlsConfig;
use shardgate_proxy::tls::certs::CertFiles;
use shardgate_proxy::tls::DetectLimits;
use shardgate_proxy::{Proxy, ProxyConfig, SourceConfig};

/// Fronts a Valkey (or Redis) cluster with one TCP port per node, so that clients outside a
/// private network (Kubernetes, a VPC) reach every node through one address.
///
/// Each node gets a listener at basePort + flatIndex, where
/// flatIndex = shard * portsPerShard + node. The route table comes from a YAML file (--routes), reloaded when it changes, or
/// is discovered from a seed node with CLUSTER SHARDS (--seed), refreshed periodically.
///
/// Cluster-aware clients follow the addresses Valkey hands out. Two ways keep them on the
/// proxy:
///   --rewrite: the proxy rewrites MOVED/ASK and CLUSTER SLOTS/SHARDS/NODES (and ROLE,
///     INFO) to its own --advertise-host and ports; the nodes announce nothing special.
///   announce mode: each node announces its listener (Valkey 9):
///     valkey-server ... --cluster-announce-client-ipv4 <proxy ip>
///                       --cluster-announce-client-port <its listener port>
///     then give the routes in a file: discovery would find the proxy's own address.
///
/// Examples:
///   shardgate-proxy --seed 10.0.0.5:6379 --base-port 30000 --rewrite --advertise-host 203.0.113.7
///   shardgate-proxy --routes routes.yaml
///
/// Route file:
///   basePort: 30000
///   shards:
///     - nodes: [10.0.0.1:6379, 10.0.0.2:6379]     # node 0 is port 30000, node 1 30001
///     - nodes: [10.0.0.3:6379, valkey-1-1.valkey:6379]
///
/// TLS port (--tls-port): one port for the whole cluster, routed by the ClientHello's SNI
/// name (--sni-prefix vc --sni-domain example.com):
///   vc-<s>-<n>.example.com  node n of shard s
///   vc-<s>.example.com      shard s's primary
///   vc.example.com          any node that answers
/// An unknown or missing name, or a client that does not speak TLS, is refused before any
/// node is dialled.
///   --tls-mode passthrough: the TLS stream goes to the node untouched (nodes speak TLS).
///   --tls-mode terminate: the proxy terminates TLS (--tls-cert/--tls-key, reloaded on
///     change; --tls-client-ca for mTLS) and talks plain or TLS (--tls-backend) to the
///     node; with --rewrite, TLS clients are handed each node's SNI name on the TLS port.
///   shardgate-proxy --seed 10.0.0.5:6379 --base-port 30000 --rewrite --advertise-host 203.0.113.7 \
///     --tls-port 6380 --sni-prefix vc --sni-domain example.com --tls-cert tls.crt --tls-key tls.key
///
/// Endpoints on --admin-addr: /metrics (Prometheus), /healthz, /readyz, /routes (JSON).
#[derive(Parser, Debug)]
#[command(version, about, long_about, verbatim_doc_comment)]
#[command(group(ArgGroup::new("source").required(true).args(["routes", "seed"])))]
struct Args {
    /// YAML route file; reloaded when its content changes (a bad new version is logged and
    /// the last good table kept).
    #[arg(long, value_name = "FILE", env = "SHARDGATE_ROUTES")]
    routes: Option<PathBuf>,

    /// How often the route file is checked for changes.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = humantime::parse_duration)]
    routes_poll: Duration,

    /// Seed node (host:port) to discover the cluster from; repeat for more.
    #[arg(long, value_name = "HOST:PORT", requires = "base_port")]
    seed: Vec<Backend>,

    /// With --seed: the listener port of shard 0, node 0.
    #[arg(long, value_name = "PORT")]
    base_port: Option<u16>,

    /// With --seed: ports reserved per shard (default: the largest shard's node count at
    /// first discovery). Set it above the node count to leave room for more replicas.
    #[arg(long, value_name = "N")]
    ports_per_shard: Option<u32>,

    /// With --seed: how often to ask the cluster for its topology.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    refresh: Duration,

    /// Address the node listeners bind.
    #[arg(long, value_name = "IP", default_value = "0.0.0.0")]
    listen_ip: IpAddr,

    /// Address of /metrics, /healthz, /readyz and /routes; "off" to serve none.
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:9090", value_parser = parse_admin)]
    admin_addr: AdminAddr,

    /// Open client connections at most; more are closed at once and counted.
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    max_connections: usize,

    /// Close a connection after this long without a byte either way; 0 never.
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = humantime::parse_duration)]
    idle_timeout: Duration,

    /// Resolving and connecting to a node, in all.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = humantime::parse_duration)]
    connect_timeout: Duration,

    /// On SIGTERM: stop accepting, then let open connections go on for this long.
    #[arg(long, value_name = "DURATION", default_value = "25s", value_parser = humantime::parse_duration)]
    drain_timeout: Duration,

    /// Bytes buffered per direction per connection.
    #[arg(long, value_name = "BYTES", default_value_t = 16 * 1024)]
    buffer_size: usize,

    /// Rewrite the topology Valkey hands out (MOVED/ASK, CLUSTER SLOTS/SHARDS/NODES/REPLICAS,
    /// ROLE, INFO replication) so that clients are sent to the proxy's ports. Then the
    /// nodes need announce nothing; a route file can still turn it off per listener.
    #[arg(long)]
    rewrite: bool,

    /// The host (IP or DNS name) external clients reach the proxy at, handed out in
    /// rewritten replies. Default: --listen-ip, when it is not 0.0.0.0.
    #[arg(long, value_name = "HOST")]
    advertise_host: Option<String>,

    /// With --rewrite: leave ROLE and INFO replication as Valkey wrote them.
    #[arg(long)]
    no_rewrite_info: bool,

    /// With --rewrite: the largest topology reply held for rewriting; a larger one closes
    /// the connection.
    #[arg(long, value_name = "BYTES", default_value_t = 64 << 20)]
    max_frame: usize,

    /// The TLS port, routed by SNI name (see above); needs --sni-prefix and --sni-domain.
    #[arg(long, value_name = "PORT", requires_all = ["sni_prefix", "sni_domain"], help_heading = "TLS port (SNI)")]
    tls_port: Option<u16>,

    /// The first label of the SNI names: <prefix>-<s>-<n>.<domain>, <prefix>-<s>.<domain>,
    /// <prefix>.<domain>.
    #[arg(
        long,
        value_name = "PREFIX",
        requires = "tls_port",
        help_heading = "TLS port (SNI)"
    )]
    sni_prefix: Option<String>,

    /// The domain of the SNI names.
    #[arg(
        long,
        value_name = "DOMAIN",
        requires = "tls_port",
        help_heading = "TLS port (SNI)"
    )]
    sni_domain: Option<String>,

    /// passthrough: forward the TLS stream untouched to the node's TLS port;
    /// terminate: the proxy holds the certificate (--tls-cert, --tls-key).
    #[arg(long, value_enum, default_value_t = TlsModeArg::Terminate, help_heading = "TLS port (SNI)")]
    tls_mode: TlsModeArg,

    /// Terminate: the certificate chain (PEM, leaf first), e.g. for *.<domain>; reloaded
    /// when it changes, without dropping connections.
    #[arg(long, value_name = "FILE", help_heading = "TLS port (SNI)")]
    tls_cert: Option<PathBuf>,

    /// Terminate: the certificate's private key (PEM).
    #[arg(long, value_name = "FILE", help_heading = "TLS port (SNI)")]
    tls_key: Option<PathBuf>,

    /// Terminate: require client certificates signed by these CAs (PEM bundle): mTLS.
    #[arg(long, value_name = "FILE", help_heading = "TLS port (SNI)")]
    tls_client_ca: Option<PathBuf>,

    /// Terminate: how often the certificate, key and client CA files are checked for changes.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = humantime::parse_duration, help_heading = "TLS port (SNI)")]
    tls_reload: Duration,

    /// Terminate: the leg to the node, plain TCP or TLS (verified with --tls-backend-ca).
    #[arg(long, value_enum, default_value_t = TlsBackendArg::Plain, help_heading = "TLS port (SNI)")]
    tls_backend: TlsBackendArg,

    /// With --tls-backend tls: the CA bundle (PEM) the nodes' certificates are checked against.
    #[arg(long, value_name = "FILE", help_heading = "TLS port (SNI)")]
    tls_backend_ca: Option<PathBuf>,

    /// With --tls-backend tls: the name checked on every node's certificate (default: each
    /// node's SNI name, <prefix>-<s>-<n>.<domain>).
    #[arg(long, value_name = "NAME", help_heading = "TLS port (SNI)")]
    tls_backend_name: Option<String>,

    /// A client that has not sent its whole ClientHello (or finished the handshake) after
    /// this long is closed.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration, help_heading = "TLS port (SNI)")]
    tls_hello_timeout: Duration,

    /// The largest ClientHello accepted, in bytes.
    #[arg(long, value_name = "BYTES", default_value_t = 16 * 1024, help_heading = "TLS port (SNI)")]
    tls_max_hello: usize,

    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum TlsModeArg {
    Passthrough,
    Terminate,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum TlsBackendArg {
    Plain,
    Tls,
}

/// The TLS port's settings, checked for flags that need each other.
fn tls_config(args: &Args) -> anyhow::Result<Option<TlsConfig>> {
    let Some(port) = args.tls_port else {
        for (set, flag) in [
            (args.tls_cert.is_some(), "--tls-cert"),
            (args.tls_key.is_some(), "--tls-key"),
            (args.tls_client_ca.is_some(), "--tls-client-ca"),
            (args.tls_backend_ca.is_some(), "--tls-backend-ca"),
        ] {
            if set {
                anyhow::bail!("{flag} needs --tls-port");
            }
        }
        return Ok(None);
    };
    let names = Hostnames {
        prefix: args.sni_prefix.clone().unwrap_or_default(),
        domain: args.sni_domain.clone().unwrap_or_default(),
    };
    let mode = match args.tls_mode {
        TlsModeArg::Passthrough => {
            for (set, flag) in [
                (args.tls_cert.is_some(), "--tls-cert"),
                (args.tls_key.is_some(), "--tls-key"),
                (args.tls_client_ca.is_some(), "--tls-client-ca"),
                (args.tls_backend == TlsBackendArg::Tls, "--tls-backend tls"),
            ] {
                if set {
                    anyhow::bail!(
                        "{flag} is for --tls-mode terminate; in passthrough mode the nodes hold the certificates"
                    );
                }
            }
            TlsModeConfig::Passthrough
        }
        TlsModeArg::Terminate => {
            let (Some(cert), Some(key)) = (args.tls_cert.clone(), args.tls_key.clone()) else {
                anyhow::bail!(
                    "--tls-mode terminate needs --tls-cert and --tls-key (or use --tls-mode passthrough)"
                );
            };
            let backend = match args.tls_backend {
                TlsBackendArg::Plain => BackendTlsConfig::Plain,
                TlsBackendArg::Tls => BackendTlsConfig::Tls {
                    ca: args
                        .tls_backend_ca
                        .clone()
                        .context("--tls-backend tls needs --tls-backend-ca")?,
                    server_name: args.tls_backend_name.clone(),
                },
            };
            TlsModeConfig::Terminate {
                files: CertFiles {
                    cert,
                    key,
                    client_ca: args.tls_client_ca.clone(),
                },
                reload: args.tls_reload,
                backend,
            }
        }
    };
    Ok(Some(TlsConfig {
        port,
        names,
        mode,
        detect: DetectLimits {
            timeout: args.tls_hello_timeout,
            max_bytes: args.tls_max_hello.max(512),
        },
    }))
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Copy)]
struct AdminAddr(Option<SocketAddr>);

fn parse_admin(s: &str) -> Result<AdminAddr, String> {
    if s == "off" {
        return Ok(AdminAddr(None));
    }
    s.parse()
        .map(|a| AdminAddr(Some(a)))
        .map_err(|e| format!("{s:?}: {e} (expected ip:port or \"off\")"))
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

async fn terminated() -> anyhow::Result<&'static str> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    Ok(tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    })
}

async fn run(args: Args) -> anyhow::Result<()> {
    let tls = tls_config(&args)?;
    let source = match (args.routes, args.base_port) {
        (Some(path), _) => SourceConfig::File {
            path,
            poll: args.routes_poll,
        },
        (None, Some(base_port)) => SourceConfig::Seed {
            seeds: args.seed,
            base_port,
            ports_per_shard: args.ports_per_shard,
            refresh: args.refresh,
        },
        (None, None) => anyhow::bail!("--seed needs --base-port"),
    };
    let mut config = ProxyConfig::new(source);
    config.listen_ip = args.listen_ip;
    config.admin_addr = args.admin_addr.0;
    config.max_connections = args.max_connections;
    config.idle_timeout = (!args.idle_timeout.is_zero()).then_some(args.idle_timeout);
    config.connect_timeout = args.connect_timeout;
    config.drain_timeout = args.drain_timeout;
    config.buffer_size = args.buffer_size;
    config.rewrite = args.rewrite;
    config.advertise_host = args.advertise_host;
    config.rewrite_info = !args.no_rewrite_info;
    config.limits.max_frame = args.max_frame;
    config.tls = tls;

    let proxy = Proxy::start(config)
        .await
        .context("shardgate-proxy cannot start")?;
    if let Some(addr) = proxy.admin_addr() {
        tracing::info!(%addr, "admin endpoints: /metrics /healthz /readyz /routes");
    }
    let signal = terminated().await?;
    tracing::info!(signal, "shutting down");
    proxy.shutdown().await;
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    init_logging(args.log_format);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("shardgate-proxy: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("shardgate-proxy: {e:#}");
            ExitCode::FAILURE
        }
    }
}
