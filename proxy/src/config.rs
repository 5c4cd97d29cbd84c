//! The proxy's settings (the binary fills them from its command line).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use shardgate_crds::Hostnames;

use crate::route::Backend;
use crate::tls::backend::BackendTlsConfig;
use crate::tls::certs::CertFiles;
use crate::tls::DetectLimits;

/// The TLS port: one port for every node, routed by SNI name.
#[derive(Debug, Clone)]
pub struct TlsConfig {
    pub port: u16,
    /// The names routed: `<prefix>-<s>-<n>.<domain>`, `<prefix>-<s>.<domain>`,
    /// `<prefix>.<domain>`.
    pub names: Hostnames,
    pub mode: TlsModeConfig,
    /// The ClientHello's timeout and byte cap.
    pub detect: DetectLimits,
}

/// Passthrough or termination.
#[derive(Debug, Clone)]
pub enum TlsModeConfig {
    /// The TLS stream goes to the node untouched; the nodes speak TLS.
    Passthrough,
    /// The proxy terminates TLS with `files`, polled for changes every `reload`.
    Terminate {
        files: CertFiles,
        reload: Duration,
        backend: BackendTlsConfig,
    },
}

/// Where the route table comes from.
#[derive(Debug, Clone)]
pub enum SourceConfig {
    /// A YAML route file, polled for changes.
    File { path: PathBuf, poll: Duration },
    /// Seed nodes asked for `CLUSTER SHARDS`.
    Seed {
        seeds: Vec<Backend>,
        base_port: u16,
        ports_per_shard: Option<u32>,
        refresh: Duration,
    },
}

/// Everything the proxy needs to run.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    pub source: SourceConfig,
    /// The address every node listener binds.
    pub listen_ip: IpAddr,
    /// `/metrics`, `/healthz`, `/readyz`, `/routes`; `None` to serve none.
    pub admin_addr: Option<SocketAddr>,
    /// Open client connections at most; more are closed at once and counted.
    pub max_connections: usize,
    /// A connection with no bytes either way for this long is closed; `None`: never.
    pub idle_timeout: Option<Duration>,
    /// Resolving and connecting to a backend, in all.
    pub connect_timeout: Duration,
    /// On shutdown, how long connections in flight may go on before they are closed.
    pub drain_timeout: Duration,
    /// Bytes buffered per direction per connection (the back-pressure bound).
    pub buffer_size: usize,
    /// Rewrite topology on listeners whose source does not say otherwise.
    pub rewrite: bool,
    /// The host (IP or DNS name) external clients reach the proxy at: the address that
    /// rewritten replies hand out. Needed by rewriting listeners.
    pub advertise_host: Option<String>,
    /// Also rewrite ROLE and INFO replication (on by default with rewriting).
    pub rewrite_info: bool,
    /// Limits of rewriting connections.
    pub limits: crate::rewrite::stream::Limits,
    /// The TLS port, if any.
    pub tls: Option<TlsConfig>,
}

impl ProxyConfig {
    /// Defaults for everything but the source.
    pub fn new(source: SourceConfig) -> Self {
        ProxyConfig {
            source,
            listen_ip: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            admin_addr: Some(SocketAddr::from((Ipv4Addr::UNSPECIFIED, 9090))),
            max_connections: 10_000,
            idle_timeout: Some(Duration::from_secs(3600)),
            connect_timeout: Duration::from_secs(5),
            drain_timeout: Duration::from_secs(25),
            buffer_size: 16 * 1024,
            rewrite: false,
            advertise_host: None,
            rewrite_info: true,
            limits: crate::rewrite::stream::Limits::default(),
            tls: None,
        }
    }
}
