//! The proxy's settings: one typed struct that is the proxy's command line (the binary parses
//! it), carries every default once ([`defaults`]), and renders back into arguments
//! ([`ProxySettings::to_args`]) for whoever starts the proxy: the operator writes them into
//! the proxy Deployment, the tests into a child process.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::str::FromStr;

use clap::{ArgGroup, CommandFactory, FromArgMatches, Parser, ValueEnum};
use serde::Serialize;

use crate::Backend;

/// Every default of the proxy, in one place: the command line shows them and the proxy's
/// internal defaults are taken from them.
pub mod defaults {
    use std::time::Duration;

    pub const ROUTES_POLL: Duration = Duration::from_secs(1);
    pub const REFRESH: Duration = Duration::from_secs(10);
    pub const KUBE_WATCH_TIMEOUT: Duration = Duration::from_secs(60);
    pub const LISTEN_IP: &str = "0.0.0.0";
    pub const ADMIN_ADDR: &str = "0.0.0.0:9090";
    pub const MAX_CONNECTIONS: usize = 10_000;
    pub const IDLE_TIMEOUT: Duration = Duration::from_secs(3600);
    pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
    pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(25);
    pub const BUFFER_SIZE: usize = 16 * 1024;
    /// The smallest buffer the proxy uses, whatever is asked for.
    pub const MIN_BUFFER_SIZE: usize = 512;
    /// The largest buffer that may be asked for: a connection holds up to two while bytes
    /// are in flight, so a few thousand busy connections at this size are already
    /// gigabytes.
    pub const MAX_BUFFER_SIZE: usize = 16 << 20;
    pub const MAX_FRAME: usize = 64 << 20;
    /// A header or simple line longer than this closes a rewriting connection (not a flag).
    pub const MAX_LINE: usize = 64 << 10;
    pub const TLS_RELOAD: Duration = Duration::from_secs(5);
    pub const TLS_HELLO_TIMEOUT: Duration = Duration::from_secs(10);
    pub const TLS_MAX_HELLO: usize = 16 * 1024;
    pub const TLS_MAX_HANDSHAKES: usize = 1024;
    pub const TLS_MAX_HANDSHAKES_PER_SOURCE: usize = 256;
    /// The smallest ClientHello cap the proxy uses, whatever is asked for.
    pub const MIN_TLS_MAX_HELLO: usize = 512;
}

fn human(d: std::time::Duration) -> humantime::Duration {
    d.into()
}

/// Fronts a Valkey (or Redis) cluster with one TCP port per node, so that clients outside a
/// private network (Kubernetes, a VPC) reach every node through one address.
///
/// Each node gets a listener at basePort + flatIndex, where
/// flatIndex = shard * portsPerShard + node. The route table comes from one of:
///   --routes: a YAML file, reloaded when it changes;
///   --seed: discovered from a seed node with CLUSTER SHARDS, refreshed periodically;
///   --kubernetes: the pods of a ValkeyCluster, watched on the Kubernetes API (by the
///     operator's labels and each pod's shard-index and node-index labels); a pod's new IP
///     is routed within a second. The API is reached with $KUBECONFIG, else in-cluster.
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
///   shardgate-proxy --kubernetes valkey/vc --base-port 30000 --ports-per-shard 2 \
///     --rewrite --advertise-host 203.0.113.7
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
///     change; --tls-client-ca for mTLS) and talks to the node as every leg does; with
///     --rewrite, TLS clients are handed each node's SNI name on the TLS port.
///   shardgate-proxy --seed 10.0.0.5:6379 --base-port 30000 --rewrite --advertise-host 203.0.113.7 \
///     --tls-port 6380 --sni-prefix vc --sni-domain example.com --tls-cert tls.crt --tls-key tls.key
///
/// Nodes over TLS (--tls-backend tls): every leg to the nodes is TLS (the node ports', a
/// terminating TLS port's, and discovery's: --seed then names TLS addresses), checked
/// against --tls-backend-ca, showing --tls-backend-cert if given.
///   shardgate-proxy --seed 10.0.0.5:6379 --base-port 30000 --rewrite --advertise-host 203.0.113.7 \
///     --tls-backend tls --tls-backend-ca ca.crt --tls-backend-chain-only \
///     --tls-backend-cert tls.crt --tls-backend-key tls.key
///
/// Endpoints on --admin-addr: /metrics (Prometheus), /healthz, /readyz, /routes (JSON).
///
/// Worker threads: TOKIO_WORKER_THREADS, else one per CPU the process may use (a CPU
/// limit counts). With one, a single thread runs everything.
#[derive(Parser, Debug, Clone, PartialEq, Eq, Serialize)]
#[command(
    name = "shardgate-proxy",
    version,
    about,
    long_about,
    verbatim_doc_comment
)]
#[command(group(ArgGroup::new("source").required(true).args(["routes", "seed", "kubernetes"])))]
#[serde(rename_all = "kebab-case")]
pub struct ProxySettings {
    /// YAML route file; reloaded when its content changes (a bad new version is logged and
    /// the last good table kept).
    #[arg(long, value_name = "FILE", env = "SHARDGATE_ROUTES")]
    pub routes: Option<PathBuf>,

    /// How often the route file is checked for changes.
    #[arg(long, value_name = "DURATION", default_value_t = human(defaults::ROUTES_POLL))]
    #[serde(serialize_with = "display")]
    pub routes_poll: humantime::Duration,

    /// Seed node (host:port) to discover the cluster from; repeat for more.
    #[arg(long, value_name = "HOST:PORT", requires = "base_port")]
    pub seed: Vec<Backend>,

    /// Watch the pods of the ValkeyCluster CLUSTER in NAMESPACE: the pods with the
    /// operator's labels (app.kubernetes.io/managed-by=shardgate,
    /// app.kubernetes.io/instance=CLUSTER). A pod labelled shardgate.io/shard-index s and
    /// shardgate.io/node-index n, with an IP and not being deleted, is node (s, n) at its
    /// IP (port 6379, or its container port named vk-<s>-<n>); its listener is
    /// basePort + s * portsPerShard + n. Needs get, list and watch on pods.
    #[arg(
        long,
        value_name = "NAMESPACE/CLUSTER",
        requires = "base_port",
        value_parser = parse_kubernetes
    )]
    pub kubernetes: Option<String>,

    /// With --kubernetes: a label selector ANDed with the cluster's (e.g.
    /// "topology.kubernetes.io/zone=a"), to front only some of its pods.
    #[arg(long, value_name = "SELECTOR", requires = "kubernetes")]
    pub kube_selector: Option<String>,

    /// With --kubernetes: the API server ends the pod watch this often (at most 290s) and it
    /// is opened again. One that falls silent (the API server's node gone without a reset)
    /// is dropped 5s past it, and a list 10s past it.
    #[arg(long, value_name = "DURATION", default_value_t = human(defaults::KUBE_WATCH_TIMEOUT))]
    #[serde(serialize_with = "display")]
    pub kube_watch_timeout: humantime::Duration,

    /// With --seed or --kubernetes: the listener port of shard 0, node 0.
    #[arg(long, value_name = "PORT")]
    pub base_port: Option<u16>,

    /// With --seed or --kubernetes: ports reserved per shard (default: the largest shard's
    /// node count at the first discovery, or the first table of pods). Set it above the node
    /// count to leave room for more replicas.
    #[arg(long, value_name = "N")]
    pub ports_per_shard: Option<u32>,

    /// With --seed: how often to ask the cluster for its topology; with --kubernetes: how
    /// often the nodes are asked again for their ids and roles (the pods are watched).
    #[arg(long, value_name = "DURATION", default_value_t = human(defaults::REFRESH))]
    #[serde(serialize_with = "display")]
    pub refresh: humantime::Duration,

    /// Address the node listeners bind.
    #[arg(long, value_name = "IP", default_value = defaults::LISTEN_IP)]
    pub listen_ip: IpAddr,

    /// Address of /metrics, /healthz, /readyz and /routes; "off" to serve none.
    #[arg(long, value_name = "ADDR", default_value = defaults::ADMIN_ADDR)]
    #[serde(serialize_with = "display")]
    pub admin_addr: AdminAddr,

    /// Open client connections at most; more are closed at once and counted.
    #[arg(long, value_name = "N", default_value_t = defaults::MAX_CONNECTIONS)]
    pub max_connections: usize,

    /// Close a connection after this long without a byte either way (looked at every eighth
    /// of it, at least every millisecond, so up to that much later); 0 never.
    #[arg(long, value_name = "DURATION", default_value_t = human(defaults::IDLE_TIMEOUT))]
    #[serde(serialize_with = "display")]
    pub idle_timeout: humantime::Duration,

    /// Resolving and connecting to a node, in all.
    #[arg(long, value_name = "DURATION", default_value_t = human(defaults::CONNECT_TIMEOUT))]
    #[serde(serialize_with = "display")]
    pub connect_timeout: humantime::Duration,

    /// On SIGTERM: stop accepting, then let open connections go on for this long.
    #[arg(long, value_name = "DURATION", default_value_t = human(defaults::DRAIN_TIMEOUT))]
    #[serde(serialize_with = "display")]
    pub drain_timeout: humantime::Duration,

    /// Bytes buffered per direction per connection while bytes are in flight (at least 512,
    /// at most 16 MiB).
    #[arg(long, value_name = "BYTES", default_value_t = defaults::BUFFER_SIZE, value_parser = parse_buffer_size)]
    pub buffer_size: usize,

    /// Rewrite the topology Valkey hands out (MOVED/ASK, CLUSTER SLOTS/SHARDS/NODES/REPLICAS,
    /// ROLE, INFO replication) so that clients are sent to the proxy's ports. Then the
    /// nodes need announce nothing; a route file can still turn it off per listener.
    #[arg(long)]
    pub rewrite: bool,

    /// The host (IP or DNS name) external clients reach the proxy at, handed out in
    /// rewritten replies. Default: --listen-ip, when it is not 0.0.0.0.
    #[arg(long, value_name = "HOST")]
    pub advertise_host: Option<String>,

    /// With --rewrite: leave ROLE and INFO replication as Valkey wrote them.
    #[arg(long)]
    pub no_rewrite_info: bool,

    /// With --rewrite: the largest topology reply held for rewriting; a larger one closes
    /// the connection.
    #[arg(long, value_name = "BYTES", default_value_t = defaults::MAX_FRAME)]
    pub max_frame: usize,

    /// The TLS port, routed by SNI name (see above); needs --sni-prefix and --sni-domain.
    #[arg(long, value_name = "PORT", requires_all = ["sni_prefix", "sni_domain"], help_heading = "TLS port (SNI)")]
    pub tls_port: Option<u16>,

    /// The first label of the SNI names: <prefix>-<s>-<n>.<domain>, <prefix>-<s>.<domain>,
    /// <prefix>.<domain>.
    #[arg(
        long,
        value_name = "PREFIX",
        requires = "tls_port",
        help_heading = "TLS port (SNI)"
    )]
    pub sni_prefix: Option<String>,

    /// The domain of the SNI names.
    #[arg(
        long,
        value_name = "DOMAIN",
        requires = "tls_port",
        help_heading = "TLS port (SNI)"
    )]
    pub sni_domain: Option<String>,

    /// passthrough: forward the TLS stream untouched to the node's TLS port;
    /// terminate: the proxy holds the certificate (--tls-cert, --tls-key).
    #[arg(long, value_enum, default_value_t = TlsMode::Terminate, help_heading = "TLS port (SNI)")]
    pub tls_mode: TlsMode,

    /// Terminate: the certificate chain (PEM, leaf first), e.g. for *.<domain>; reloaded
    /// when it changes, without dropping connections.
    #[arg(long, value_name = "FILE", help_heading = "TLS port (SNI)")]
    pub tls_cert: Option<PathBuf>,

    /// Terminate: the certificate's private key (PEM).
    #[arg(long, value_name = "FILE", help_heading = "TLS port (SNI)")]
    pub tls_key: Option<PathBuf>,

    /// Terminate: require client certificates signed by these CAs (PEM bundle): mTLS.
    #[arg(long, value_name = "FILE", help_heading = "TLS port (SNI)")]
    pub tls_client_ca: Option<PathBuf>,

    /// How often the TLS files (terminate's certificate, key and client CA; the
    /// --tls-backend-* files) are checked for changes.
    #[arg(long, value_name = "DURATION", default_value_t = human(defaults::TLS_RELOAD), help_heading = "TLS port (SNI)")]
    #[serde(serialize_with = "display")]
    pub tls_reload: humantime::Duration,

    /// The legs to the nodes, from the node ports and from a terminating TLS port: plain
    /// TCP, or TLS (for nodes that speak TLS; verified with --tls-backend-ca). Over TLS the
    /// proxy dials each node's TLS address (a route's tlsAddress, else its address), and the
    /// nodes are asked for the topology over TLS too. A passthrough TLS port is not
    /// affected: the client's own TLS goes to the node.
    #[arg(long, value_enum, default_value_t = TlsBackend::Plain, help_heading = "Nodes over TLS")]
    pub tls_backend: TlsBackend,

    /// With --tls-backend tls: the CA bundle (PEM) the nodes' certificates are checked against.
    #[arg(long, value_name = "FILE", help_heading = "Nodes over TLS")]
    pub tls_backend_ca: Option<PathBuf>,

    /// With --tls-backend tls: the name checked on every node's certificate, discovery's
    /// connections included (default: each node's SNI name, <prefix>-<s>-<n>.<domain>,
    /// which needs --tls-port; discovery, which dials addresses before it knows the node
    /// there, then checks the chain only).
    #[arg(
        long,
        value_name = "NAME",
        conflicts_with = "tls_backend_chain_only",
        help_heading = "Nodes over TLS"
    )]
    pub tls_backend_name: Option<String>,

    /// With --tls-backend tls: check only that each node's certificate leads to
    /// --tls-backend-ca, not the name on it. For nodes dialled at addresses no certificate
    /// names, such as pod IPs (Valkey's nodes check each other so on the cluster bus).
    #[arg(long, help_heading = "Nodes over TLS")]
    pub tls_backend_chain_only: bool,

    /// With --tls-backend tls: the client certificate chain (PEM, leaf first) shown to
    /// nodes that ask for one (Valkey does by default: tls-auth-clients yes).
    #[arg(
        long,
        value_name = "FILE",
        requires = "tls_backend_key",
        help_heading = "Nodes over TLS"
    )]
    pub tls_backend_cert: Option<PathBuf>,

    /// With --tls-backend tls: the client certificate's private key (PEM).
    #[arg(
        long,
        value_name = "FILE",
        requires = "tls_backend_cert",
        help_heading = "Nodes over TLS"
    )]
    pub tls_backend_key: Option<PathBuf>,

    /// A client that has not sent its whole ClientHello (or finished the handshake) after
    /// this long is closed.
    #[arg(long, value_name = "DURATION", default_value_t = human(defaults::TLS_HELLO_TIMEOUT), help_heading = "TLS port (SNI)")]
    #[serde(serialize_with = "display")]
    pub tls_hello_timeout: humantime::Duration,

    /// The largest ClientHello accepted, in bytes (at least 512).
    #[arg(long, value_name = "BYTES", default_value_t = defaults::TLS_MAX_HELLO, help_heading = "TLS port (SNI)")]
    pub tls_max_hello: usize,

    /// TLS port connections still in their hello or handshake, at most (their own budget,
    /// apart from --max-connections, so that slow hellos cannot lock out the node ports);
    /// more are closed at once and counted.
    #[arg(long, value_name = "N", default_value_t = defaults::TLS_MAX_HANDSHAKES, help_heading = "TLS port (SNI)")]
    pub tls_max_handshakes: usize,

    /// Of those, from one client IP address at most; 0 for no limit per address.
    #[arg(long, value_name = "N", default_value_t = defaults::TLS_MAX_HANDSHAKES_PER_SOURCE, help_heading = "TLS port (SNI)")]
    pub tls_max_handshakes_per_source: usize,

    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// `--tls-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TlsMode {
    Passthrough,
    Terminate,
}

/// `--tls-backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TlsBackend {
    Plain,
    Tls,
}

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// `--admin-addr`: an address, or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdminAddr(pub Option<SocketAddr>);

impl FromStr for AdminAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "off" {
            return Ok(AdminAddr(None));
        }
        s.parse()
            .map(|a| AdminAddr(Some(a)))
            .map_err(|e| format!("{s:?}: {e} (expected ip:port or \"off\")"))
    }
}

impl fmt::Display for AdminAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(a) => a.fmt(f),
            None => f.write_str("off"),
        }
    }
}

fn display<T: fmt::Display, S: serde::Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

/// `--kubernetes`: `NAMESPACE/CLUSTER`, both parts non-empty.
pub fn namespace_and_cluster(value: &str) -> Result<(&str, &str), String> {
    match value.split_once('/') {
        Some((ns, cluster)) if !ns.is_empty() && !cluster.is_empty() && !cluster.contains('/') => {
            Ok((ns, cluster))
        }
        _ => Err(format!(
            "{value:?}: expected NAMESPACE/CLUSTER (the ValkeyCluster's namespace and name)"
        )),
    }
}

fn parse_buffer_size(value: &str) -> Result<usize, String> {
    let bytes: usize = value
        .parse()
        .map_err(|e| format!("{value:?} is not a number of bytes: {e}"))?;
    if bytes > defaults::MAX_BUFFER_SIZE {
        return Err(format!(
            "{bytes} bytes is more than the most a buffer may hold, {} (16 MiB): each \
             connection holds up to two while bytes are in flight",
            defaults::MAX_BUFFER_SIZE
        ));
    }
    Ok(bytes)
}

fn parse_kubernetes(value: &str) -> Result<String, String> {
    namespace_and_cluster(value).map(|_| value.to_string())
}

impl Default for ProxySettings {
    /// Every flag at its default, and no source (set `routes`, `seed` or `kubernetes` before
    /// use).
    fn default() -> Self {
        let command = Self::command().mut_group("source", |g| g.required(false));
        let parsed = command
            .try_get_matches_from(["shardgate-proxy"])
            .map_err(|e| e.to_string())
            .and_then(|m| Self::from_arg_matches(&m).map_err(|e| e.to_string()));
        match parsed {
            Ok(settings) => settings,
            // The defaults are literals of this file; the unit tests parse them.
            Err(e) => unreachable!("the proxy's default settings do not parse: {e}"),
        }
    }
}

impl ProxySettings {
    /// Routes from a file, every other setting at its default.
    pub fn with_routes(path: impl Into<PathBuf>) -> Self {
        ProxySettings {
            routes: Some(path.into()),
            ..Self::default()
        }
    }

    /// Discovery from seed nodes, every other setting at its default.
    pub fn with_seeds(seeds: Vec<Backend>, base_port: u16) -> Self {
        ProxySettings {
            seed: seeds,
            base_port: Some(base_port),
            ..Self::default()
        }
    }

    /// The pods of the ValkeyCluster `cluster` in `namespace`, every other setting at its
    /// default.
    pub fn with_kubernetes(namespace: &str, cluster: &str, base_port: u16) -> Self {
        ProxySettings {
            kubernetes: Some(format!("{namespace}/{cluster}")),
            base_port: Some(base_port),
            ..Self::default()
        }
    }

    /// The command-line arguments (without the program name) that parse back into these
    /// settings. Only settings that differ from their defaults are written, so that a
    /// Deployment's arguments read as what was chosen. Every field is rendered by its
    /// serde name, which is its flag's name: a new field cannot be forgotten here.
    pub fn to_args(&self) -> Vec<String> {
        let (Ok(serde_json::Value::Object(this)), Ok(serde_json::Value::Object(default))) = (
            serde_json::to_value(self),
            serde_json::to_value(Self::default()),
        ) else {
            unreachable!("settings serialise to a JSON object");
        };
        let mut args = Vec::new();
        for (name, value) in this {
            if default.get(&name) == Some(&value) {
                continue;
            }
            let flag = format!("--{name}");
            match value {
                serde_json::Value::Null | serde_json::Value::Bool(false) => {}
                serde_json::Value::Bool(true) => args.push(flag),
                serde_json::Value::Array(items) => {
                    for item in items {
                        args.push(flag.clone());
                        args.push(scalar(&item));
                    }
                }
                other => {
                    args.push(flag);
                    args.push(scalar(&other));
                }
            }
        }
        args
    }
}

fn scalar(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;
    use std::time::Duration;

    #[test]
    fn defaults_are_the_documented_ones() {
        let d = ProxySettings::default();
        assert_eq!(*d.routes_poll, Duration::from_secs(1));
        assert_eq!(*d.idle_timeout, Duration::from_secs(3600));
        assert_eq!(d.admin_addr.0, Some("0.0.0.0:9090".parse().unwrap()));
        assert_eq!(d.listen_ip, IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        assert_eq!(d.buffer_size, 16384);
        let most = ProxySettings::try_parse_from([
            "shardgate-proxy",
            "--routes",
            "r",
            "--buffer-size",
            "16777216",
        ]);
        assert_eq!(most.map(|s| s.buffer_size).ok(), Some(16 << 20));
        assert_eq!(d.tls_mode, TlsMode::Terminate);
        assert!(!d.rewrite && d.routes.is_none() && d.seed.is_empty());
        assert!(d.to_args().is_empty(), "{:?}", d.to_args());
    }

    #[test]
    fn the_command_line_needs_a_source() {
        let err = ProxySettings::try_parse_from(["shardgate-proxy"]).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("--routes") && text.contains("--seed") && text.contains("--kubernetes"),
            "{text}"
        );
    }

    #[test]
    fn rendered_arguments_parse_back_to_the_same_settings() {
        let every = ProxySettings {
            routes: None,
            routes_poll: Duration::from_millis(1500).into(),
            seed: vec![
                "10.0.0.5:6379".parse().unwrap(),
                "valkey-0-0.valkey:6379".parse().unwrap(),
            ],
            // One source at a time: the Kubernetes one is rendered below.
            kubernetes: None,
            kube_selector: None,
            kube_watch_timeout: Duration::from_secs(61).into(),
            base_port: Some(30000),
            ports_per_shard: Some(4),
            refresh: Duration::from_secs(3).into(),
            listen_ip: "127.0.0.1".parse().unwrap(),
            admin_addr: AdminAddr(None),
            max_connections: 7,
            idle_timeout: Duration::ZERO.into(),
            connect_timeout: Duration::from_millis(250).into(),
            drain_timeout: Duration::from_secs(61).into(),
            buffer_size: 4096,
            rewrite: true,
            advertise_host: Some("lb.example.com".into()),
            no_rewrite_info: true,
            max_frame: 1 << 20,
            tls_port: Some(6380),
            sni_prefix: Some("vc".into()),
            sni_domain: Some("example.com".into()),
            tls_mode: TlsMode::Passthrough,
            tls_cert: Some("/etc/tls/tls.crt".into()),
            tls_key: Some("/etc/tls/tls.key".into()),
            tls_client_ca: Some("/etc/tls/ca.crt".into()),
            tls_reload: Duration::from_secs(30).into(),
            tls_backend: TlsBackend::Tls,
            tls_backend_ca: Some("/etc/tls/backend-ca.crt".into()),
            tls_backend_name: Some("valkey.internal".into()),
            tls_backend_chain_only: false,
            tls_backend_cert: Some("/etc/backend-tls/tls.crt".into()),
            tls_backend_key: Some("/etc/backend-tls/tls.key".into()),
            tls_hello_timeout: Duration::from_secs(2).into(),
            tls_max_hello: 2048,
            tls_max_handshakes: 64,
            tls_max_handshakes_per_source: 8,
            log_format: LogFormat::Json,
        };
        let args = every.to_args();
        // Spelled as a user types them (literals, not derived from the renderer).
        for want in [
            "--seed",
            "valkey-0-0.valkey:6379",
            "--routes-poll",
            "1s 500ms",
            "--admin-addr",
            "off",
            "--idle-timeout",
            "0s",
            "--rewrite",
            "--tls-mode",
            "passthrough",
            "--log-format",
            "json",
        ] {
            assert!(args.iter().any(|a| a == want), "{want} missing in {args:?}");
        }
        let back = ProxySettings::try_parse_from(
            std::iter::once("shardgate-proxy".to_string()).chain(args.clone()),
        )
        .unwrap_or_else(|e| panic!("{args:?} do not parse: {e}"));
        assert_eq!(back, every);

        let file = ProxySettings::with_routes("/etc/shardgate/routes.yaml");
        assert_eq!(file.to_args(), ["--routes", "/etc/shardgate/routes.yaml"]);
    }

    #[test]
    fn the_kubernetes_source_renders_and_parses_back() {
        let kube = ProxySettings {
            kube_selector: Some("topology.kubernetes.io/zone=a,tier!=canary".into()),
            kube_watch_timeout: Duration::from_secs(20).into(),
            ports_per_shard: Some(2),
            rewrite: true,
            advertise_host: Some("203.0.113.7".into()),
            ..ProxySettings::with_kubernetes("valkey", "vc", 31000)
        };
        let args = kube.to_args();
        // Flags in their names' order (the renderer's JSON object is sorted).
        assert_eq!(
            args,
            [
                "--advertise-host",
                "203.0.113.7",
                "--base-port",
                "31000",
                "--kube-selector",
                "topology.kubernetes.io/zone=a,tier!=canary",
                "--kube-watch-timeout",
                "20s",
                "--kubernetes",
                "valkey/vc",
                "--ports-per-shard",
                "2",
                "--rewrite",
            ]
        );
        let back = ProxySettings::try_parse_from(
            std::iter::once("shardgate-proxy".to_string()).chain(args.clone()),
        )
        .unwrap_or_else(|e| panic!("{args:?} do not parse: {e}"));
        assert_eq!(back, kube);
        assert_eq!(namespace_and_cluster("valkey/vc"), Ok(("valkey", "vc")));
    }

    #[test]
    fn the_kubernetes_source_is_one_of_three() {
        let parse = |args: &[&str]| {
            ProxySettings::try_parse_from(
                std::iter::once("shardgate-proxy").chain(args.iter().copied()),
            )
            .map_err(|e| e.to_string())
        };
        for (args, want) in [
            (&["--kubernetes", "ns/vc"][..], "--base-port"),
            (
                &["--kubernetes", "ns/vc", "--base-port", "1", "--routes", "r"][..],
                "cannot be used with",
            ),
            (
                &[
                    "--kubernetes",
                    "ns/vc",
                    "--base-port",
                    "1",
                    "--seed",
                    "10.0.0.1:6379",
                ][..],
                "cannot be used with",
            ),
            (
                &["--kubernetes", "vc", "--base-port", "1"][..],
                "NAMESPACE/CLUSTER",
            ),
            (
                &["--kubernetes", "ns/", "--base-port", "1"][..],
                "NAMESPACE/CLUSTER",
            ),
            (
                &["--kubernetes", "a/b/c", "--base-port", "1"][..],
                "NAMESPACE/CLUSTER",
            ),
            (
                &["--routes", "r", "--kube-selector", "a=b"][..],
                "--kubernetes",
            ),
        ] {
            let err = parse(args).unwrap_err();
            assert!(err.contains(want), "{args:?}: {err}");
        }
        let ok = parse(&["--kubernetes", "ns/vc", "--base-port", "30000"]).unwrap();
        assert_eq!(ok.kubernetes.as_deref(), Some("ns/vc"));
    }

    #[test]
    fn bad_values_are_refused_with_the_flag_named() {
        for (args, want) in [
            (
                &["--routes", "r", "--admin-addr", "nowhere"][..],
                "--admin-addr",
            ),
            (
                &["--routes", "r", "--idle-timeout", "soon"][..],
                "--idle-timeout",
            ),
            (&["--seed", "10.0.0.1"][..], "has no port"),
            (
                &["--routes", "r", "--buffer-size", "16777217"][..],
                "more than the most a buffer may hold, 16777216 (16 MiB)",
            ),
            (
                &["--routes", "r", "--buffer-size", "16k"][..],
                "\"16k\" is not a number of bytes",
            ),
        ] {
            let err = ProxySettings::try_parse_from(
                std::iter::once("shardgate-proxy").chain(args.iter().copied()),
            )
            .unwrap_err()
            .to_string();
            assert!(err.contains(want), "{args:?}: {err}");
        }
    }
}
