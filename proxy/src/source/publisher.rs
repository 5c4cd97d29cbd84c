//! The publisher: validates the tables that sources build, numbers them, builds their
//! address maps, and swaps them in as one [`Snapshot`].

use std::net::IpAddr;
use std::ops::Deref;
use std::sync::Arc;

use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use shardgate_crds::Hostnames;

use crate::metrics::Metrics;
use crate::model::{Host, RouteTable, Routes};
use crate::rewrite::AddressMap;

/// What every listener and connection reads: a route table and the address maps rewriting
/// hands out for it, swapped together.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub table: RouteTable,
    /// Internal address → external address, for the rewriters of the per-port listeners.
    pub addresses: Arc<AddressMap>,
    /// The same for the TLS port: each node at its SNI name (empty without a TLS port).
    pub tls_addresses: Arc<AddressMap>,
}

impl Deref for Snapshot {
    type Target = RouteTable;

    fn deref(&self) -> &RouteTable {
        &self.table
    }
}

/// Every listener and connection reads the latest snapshot from here.
pub type RouteRx = watch::Receiver<Arc<Snapshot>>;

/// How the route source is doing, for `/readyz`: a failing source keeps the table in force
/// (the proxy stays ready with it), and says so here until its next success.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SourceHealth {
    /// The source that last reported (empty before any report).
    pub source: &'static str,
    /// Its last error and when its failures began, while it fails.
    pub failing: Option<(String, Instant)>,
}

/// Reads the source's health (the admin server's `/readyz`).
pub type HealthRx = watch::Receiver<SourceHealth>;

/// Why a table was refused by the publisher.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PublishError {
    #[error(
        "port {port} would route to {backend}, which is this proxy's own listener \
         (do the nodes announce the proxy's address? then give the routes in a file)"
    )]
    Loop { port: u16, backend: String },
    #[error("port {0} is the admin (metrics) port of this proxy")]
    AdminPort(u16),
    #[error(
        "port {0} rewrites topology but the proxy has no advertised host \
         (--advertise-host: the address external clients reach it at)"
    )]
    NoAdvertisedHost(u16),
}

/// Validates tables against the proxy's own sockets, numbers them and swaps them in.
#[derive(Clone)]
pub struct RoutePublisher {
    tx: Arc<watch::Sender<Arc<Snapshot>>>,
    listen_ip: IpAddr,
    admin: Option<std::net::SocketAddr>,
    /// The host external clients dial, for the address map of rewriting listeners.
    advertise: Option<String>,
    metrics: Arc<Metrics>,
    refresh: Arc<Notify>,
    /// The SNI names and the TLS port, for the TLS port's address map.
    sni: Option<(Hostnames, u16)>,
    health: Arc<watch::Sender<SourceHealth>>,
}

impl RoutePublisher {
    pub fn new(
        tx: watch::Sender<Arc<Snapshot>>,
        listen_ip: IpAddr,
        admin: Option<std::net::SocketAddr>,
        advertise: Option<String>,
        metrics: Arc<Metrics>,
    ) -> Self {
        RoutePublisher {
            tx: Arc::new(tx),
            listen_ip,
            admin,
            advertise,
            metrics,
            refresh: Arc::new(Notify::new()),
            sni: None,
            health: Arc::new(watch::Sender::new(SourceHealth::default())),
        }
    }

    /// The source's health, as [`RoutePublisher::report_error`] and
    /// [`RoutePublisher::report_ok`] set it.
    pub fn health(&self) -> HealthRx {
        self.health.subscribe()
    }

    /// Also builds the TLS port's address map (every node at its SNI name on `tls_port`),
    /// and refuses routes to the TLS port itself.
    pub fn with_sni(mut self, names: Hostnames, tls_port: u16) -> Self {
        self.sni = Some((names, tls_port));
        self
    }

    /// Signalled when a rewriter met an address the table does not know; sources that can
    /// refresh early (seed discovery) wait on it.
    pub fn refresh_requests(&self) -> Arc<Notify> {
        self.refresh.clone()
    }

    /// The proxy's metrics, for what a source counts itself.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The table in force.
    pub fn current(&self) -> Arc<Snapshot> {
        self.tx.borrow().clone()
    }

    /// Swaps in `routes` if they differ from the table in force and pass validation.
    /// Returns whether the table changed.
    pub fn publish(&self, source: &'static str, routes: Routes) -> Result<bool, PublishError> {
        self.validate(&routes)?;
        let mut changed = false;
        self.tx.send_if_modified(|cur| {
            if cur.is_loaded() && cur.routes == routes {
                return false;
            }
            let version = cur.version + 1;
            let addresses = AddressMap::new(self.advertise.as_deref().unwrap_or_default(), &routes);
            let tls_addresses = match &self.sni {
                Some((names, port)) => AddressMap::sni(names, *port, &routes),
                None => AddressMap::default(),
            };
            *cur = Arc::new(Snapshot {
                table: RouteTable {
                    version,
                    source,
                    routes: routes.clone(),
                },
                addresses: Arc::new(addresses),
                tls_addresses: Arc::new(tls_addresses),
            });
            changed = true;
            true
        });
        if changed {
            let t = self.current();
            self.metrics.routes.version.set(t.version as i64);
            self.metrics.routes.updates.inc();
            tracing::info!(
                source,
                version = t.version,
                routes = t.routes.len(),
                "route table updated"
            );
        }
        Ok(changed)
    }

    /// Logs and counts a source's failure; the table in force stays, and `/readyz` says the
    /// source is failing until [`RoutePublisher::report_ok`].
    pub fn report_error(&self, source: &'static str, error: &dyn std::error::Error) {
        self.metrics.routes.source_error(source);
        self.metrics.routes.source_up(source, false);
        let message = error.to_string();
        self.health.send_modify(|h| {
            let since = h.failing.as_ref().map_or_else(Instant::now, |(_, t)| *t);
            h.source = source;
            h.failing = Some((message, since));
        });
        let version = self.tx.borrow().version;
        // The table in force is no longer confirmed by the source.
        self.metrics.routes.stale.set(i64::from(version > 0));
        tracing::error!(
            source,
            keeping_version = version,
            "route source error: {error}"
        );
    }

    /// A source's fetch succeeded (whether or not its table changed): clears a failure.
    pub fn report_ok(&self, source: &'static str) {
        self.metrics.routes.source_up(source, true);
        self.metrics.routes.stale.set(0);
        let mut recovered = None;
        self.health.send_if_modified(|h| {
            let changed = h.source != source || h.failing.is_some();
            recovered = h.failing.take().map(|(_, since)| since.elapsed());
            h.source = source;
            changed
        });
        if let Some(after) = recovered {
            tracing::info!(source, failing_for = ?after, "route source recovered");
        }
    }

    /// Refuses routes that would make the proxy connect to itself.
    fn validate(&self, routes: &Routes) -> Result<(), PublishError> {
        let own_ip = |ip: IpAddr| {
            ip == self.listen_ip
                || ip.is_unspecified()
                || (self.listen_ip.is_unspecified() && ip.is_loopback())
        };
        for (&port, route) in routes {
            if route.rewrite && self.advertise.is_none() {
                return Err(PublishError::NoAdvertisedHost(port));
            }
            if let Some(admin) = self.admin {
                if admin.port() == port
                    && (admin.ip() == self.listen_ip
                        || admin.ip().is_unspecified()
                        || self.listen_ip.is_unspecified())
                {
                    return Err(PublishError::AdminPort(port));
                }
            }
            let tls_port = self.sni.as_ref().map(|(_, p)| *p);
            for backend in [Some(&route.backend), route.tls_backend.as_ref()]
                .into_iter()
                .flatten()
            {
                if let Host::Ip(ip) = backend.host {
                    if own_ip(ip)
                        && (routes.contains_key(&backend.port) || tls_port == Some(backend.port))
                    {
                        return Err(PublishError::Loop {
                            port,
                            backend: backend.to_string(),
                        });
                    }
                }
            }
        }
        Ok(())
    }
}
