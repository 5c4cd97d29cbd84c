//! The app: puts the parts together (the route source and its publisher, the listeners,
//! the TLS port, the admin server) and runs the shutdown sequence.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin::{self, AdminState};
use crate::config::{ProxyConfig, SourceConfig, TlsModeConfig};
use crate::conn::listener::PerSource;
use crate::conn::tls_port::TlsMode;
use crate::conn::{Forwarder, HardStop, Listeners, TlsServer};
use crate::dial::{BackendTlsConfig, Dialer, Resolver};
use crate::metrics::Metrics;
use crate::rewrite::addresses::UnknownAddresses;
use crate::source::{
    file, FileSource, PublishError, RoutePublisher, RouteRx, RouteSource, SeedSource,
};
use crate::tls::certs::{self, Reloadable};
use crate::tls::select::Selector;

/// Why the proxy could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Routes(#[from] file::FileError),
    #[error("route table refused: {0}")]
    Publish(#[from] PublishError),
    #[error("admin server: cannot listen on {addr}: {source}")]
    Admin {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("TLS port: {0}")]
    Tls(#[from] crate::tls::certs::CertError),
    #[error("nodes over TLS (--tls-backend tls): {0}")]
    BackendTls(crate::tls::certs::CertError),
    #[error("TLS port: cannot listen on {addr}: {source}")]
    TlsListen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[cfg(feature = "kubernetes")]
    #[error(transparent)]
    Kubernetes(#[from] crate::source::kubernetes::KubeError),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
}

/// The proxy.
pub struct Proxy;

/// A running proxy.
pub struct ProxyHandle {
    admin_addr: Option<SocketAddr>,
    routes: RouteRx,
    ready: Arc<AtomicBool>,
    /// Stops the source, the listeners and the admin server.
    stop: CancellationToken,
    hard_stop: HardStop,
    connections: TaskTracker,
    drain_timeout: Duration,
    tasks: Vec<JoinHandle<()>>,
}

impl Proxy {
    /// Starts the proxy. A route file that does not load, an admin port that cannot be
    /// bound, or no Kubernetes configuration for `--kubernetes`, is an error here; a seed or
    /// an API server that does not answer is not (the proxy keeps asking and is not ready
    /// until one does).
    pub async fn start(config: ProxyConfig) -> Result<ProxyHandle, StartError> {
        let config = config.clamped();
        let mut registry = Registry::default();
        let metrics = Arc::new(Metrics::default().register(&mut registry));
        let (tx, routes) = watch::channel(Arc::default());
        // Rewritten replies hand out this host; the listen IP will do when it is specific.
        let advertise = config
            .advertise_host
            .clone()
            .or_else(|| (!config.listen_ip.is_unspecified()).then(|| config.listen_ip.to_string()));
        let mut publisher = RoutePublisher::new(
            tx,
            config.listen_ip,
            config.admin_addr,
            advertise,
            metrics.clone(),
        );
        if let Some(tls) = &config.tls {
            publisher = publisher.with_sni(tls.names.clone(), tls.port);
        }
        let resolver = Resolver::system();
        let stop = CancellationToken::new();
        let hard_stop = HardStop::default();
        let ready = Arc::new(AtomicBool::new(false));
        let mut tasks = vec![];

        // Bind the admin port first: it is the one a misconfiguration most often collides with.
        let mut admin_addr = None;
        let admin_listener = match config.admin_addr {
            Some(addr) => {
                let l = TcpListener::bind(addr)
                    .await
                    .map_err(|source| StartError::Admin { addr, source })?;
                admin_addr = l.local_addr().ok();
                Some(l)
            }
            None => None,
        };

        // The TLS port: its certificate must load and its port bind, or the proxy does not
        // start (a typo in a path is better found now than at the first client).
        let tls_parts = match &config.tls {
            Some(tls) => {
                let addr = SocketAddr::new(config.listen_ip, tls.port);
                let listener = crate::dial::listen(addr)
                    .map_err(|source| StartError::TlsListen { addr, source })?;
                let mode = match &tls.mode {
                    TlsModeConfig::Passthrough => (TlsMode::Passthrough, None),
                    TlsModeConfig::Terminate { files, reload } => {
                        let (server, contents) = files.load()?;
                        let (cert_tx, cert_rx) = watch::channel(Arc::new(server));
                        let reloader = certs::reload(
                            files.clone(),
                            contents,
                            cert_tx,
                            *reload,
                            metrics.tls.reloads.clone(),
                            stop.clone(),
                        );
                        (TlsMode::Terminate { config: cert_rx }, Some(reloader))
                    }
                };
                Some((listener, tls.clone(), mode))
            }
            None => None,
        };

        // The legs to the nodes over TLS: their files must load too.
        let backend_tls = match &config.backend_tls {
            BackendTlsConfig::Plain => None,
            files => {
                let (built, contents) = files.load().map_err(StartError::BackendTls)?;
                let (tx, rx) = watch::channel(Arc::new(built));
                tasks.push(tokio::spawn(certs::reload(
                    files.clone(),
                    contents,
                    tx,
                    config.backend_tls_reload,
                    metrics.tls.backend_reloads.clone(),
                    stop.clone(),
                )));
                Some(rx)
            }
        };

        match config.source.clone() {
            SourceConfig::File { path, poll } => {
                let routes = file::load(&path, config.rewrite)?;
                publisher.publish("file", routes)?;
                let source = FileSource::new(path, poll, config.rewrite);
                metrics.routes.source_started(source.name());
                tasks.push(tokio::spawn(source.run(publisher.clone(), stop.clone())));
            }
            SourceConfig::Seed {
                seeds,
                base_port,
                ports_per_shard,
                refresh,
            } => {
                let source = SeedSource::new(
                    seeds,
                    base_port,
                    ports_per_shard,
                    refresh,
                    config.connect_timeout,
                    resolver.clone(),
                    config.rewrite,
                    backend_tls.clone(),
                );
                metrics.routes.source_started(source.name());
                tasks.push(tokio::spawn(source.run(publisher.clone(), stop.clone())));
            }
            #[cfg(feature = "kubernetes")]
            SourceConfig::Kubernetes {
                namespace,
                cluster,
                selector,
                base_port,
                ports_per_shard,
                refresh,
                watch,
            } => {
                let source = crate::source::KubernetesSource::connect(
                    namespace,
                    cluster,
                    selector.as_deref(),
                    base_port,
                    ports_per_shard,
                    refresh,
                    watch,
                    config.connect_timeout,
                    resolver.clone(),
                    config.rewrite,
                    backend_tls.clone(),
                )
                .await?;
                metrics.routes.source_started(source.name());
                tasks.push(tokio::spawn(source.run(publisher.clone(), stop.clone())));
            }
            #[cfg(not(feature = "kubernetes"))]
            SourceConfig::Kubernetes { .. } => {
                return Err(crate::config::ConfigError::KubernetesNotBuilt.into())
            }
        }

        let connections = TaskTracker::new();
        let forwarder = Arc::new(Forwarder {
            dialer: Dialer::new(resolver, config.connect_timeout),
            backend_tls,
            metrics: metrics.clone(),
            idle_timeout: config.idle_timeout,
            buffer_size: config.buffer_size,
            hard_stop: hard_stop.clone(),
            routes: routes.clone(),
            rewrite_info: config.rewrite_info,
            limits: config.limits,
            // A route file does not look again on request: its log must not say it will.
            unknown: UnknownAddresses::new(
                (!matches!(config.source, SourceConfig::File { .. }))
                    .then(|| publisher.refresh_requests()),
            ),
            warnings: crate::conn::forward::warnings(),
        });
        let listeners = Arc::new(Listeners {
            listen_ip: config.listen_ip,
            routes: routes.clone(),
            forwarder,
            limit: Arc::new(Semaphore::new(config.max_connections)),
            handshakes: Arc::new(Semaphore::new(config.tls_max_handshakes)),
            per_source: PerSource::new(config.tls_max_handshakes_per_source),
            connections: connections.clone(),
            metrics: metrics.clone(),
            ready: ready.clone(),
            refusals: crate::conn::listener::refusals(),
        });
        if let Some((listener, tls, (mode, reloader))) = tls_parts {
            let server = Arc::new(TlsServer {
                port: tls.port,
                selector: Selector::new(tls.names.clone()),
                mode,
                limits: tls.detect,
                forwarder: listeners.forwarder.clone(),
                routes: routes.clone(),
                metrics: metrics.clone(),
                refusals: listeners.refusals.clone(),
            });
            if let Some(reloader) = reloader {
                tasks.push(tokio::spawn(reloader));
            }
            tasks.push(tokio::spawn(listeners.clone().accept_tls(
                listener,
                server,
                stop.clone(),
            )));
        }
        tasks.push(tokio::spawn(listeners.supervise(stop.clone())));

        if let Some(listener) = admin_listener {
            let state = AdminState {
                registry: Arc::new(registry),
                routes: routes.clone(),
                ready: ready.clone(),
                health: publisher.health(),
            };
            // The admin server outlives the drain, so /metrics and /readyz answer during it.
            tasks.push(tokio::spawn(admin::serve(
                listener,
                state,
                hard_stop.token().clone(),
            )));
        }

        Ok(ProxyHandle {
            admin_addr,
            routes,
            ready,
            stop,
            hard_stop,
            connections,
            drain_timeout: config.drain_timeout,
            tasks,
        })
    }
}

impl ProxyHandle {
    /// The admin server's address (with the port the OS chose, if 0 was asked for).
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    /// The route table in force, and its changes.
    pub fn routes(&self) -> RouteRx {
        self.routes.clone()
    }

    /// Whether a table is loaded and all its ports are bound.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Waits until the proxy is ready, or `timeout`.
    pub async fn wait_ready(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        while !self.is_ready() {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    /// Graceful drain: stop accepting (the listeners close, readiness turns false), let
    /// open connections finish for up to the drain timeout, then close the rest.
    /// Returns how many connections were still open when the timeout ran out.
    pub async fn shutdown(self) -> usize {
        self.ready.store(false, Ordering::Release);
        self.stop.cancel();
        self.connections.close();
        let open = self.connections.len();
        tracing::info!(open, timeout = ?self.drain_timeout, "draining");
        let forced = match tokio::time::timeout(self.drain_timeout, self.connections.wait()).await {
            Ok(()) => 0,
            Err(_) => {
                let left = self.connections.len();
                tracing::warn!(left, "drain timeout: closing the connections still open");
                self.hard_stop.stop();
                self.connections.wait().await;
                left
            }
        };
        self.hard_stop.stop();
        for t in self.tasks {
            let _ = t.await;
        }
        tracing::info!("stopped");
        forced
    }
}
