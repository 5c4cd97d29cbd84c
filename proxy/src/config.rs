//! The proxy's settings (the binary fills them from its command line).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use crate::route::Backend;

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
        }
    }
}
