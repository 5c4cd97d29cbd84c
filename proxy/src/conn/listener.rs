//! Listeners: one accept loop per port, and the supervisor that keeps the set of bound
//! ports equal to the route table's.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::forward::Forwarder;
use super::tls_port::TlsServer;
use crate::metrics::{Metrics, ReasonLabels};
use crate::source::RouteRx;

/// What every listener shares.
pub struct Listeners {
    pub listen_ip: IpAddr,
    pub routes: RouteRx,
    pub forwarder: Arc<Forwarder>,
    /// One permit per open connection: the connection limit.
    pub limit: Arc<Semaphore>,
    /// Every connection task, so that shutdown can wait for them.
    pub connections: TaskTracker,
    pub metrics: Arc<Metrics>,
    /// True while every port of a loaded table is bound.
    pub ready: Arc<AtomicBool>,
}

impl Listeners {
    /// Binds and unbinds listeners as the route table changes, until `shutdown`. Ports that
    /// fail to bind are retried every second. Removing a port stops its accept loop only:
    /// its connections go on with the route they were accepted with.
    pub async fn supervise(self: Arc<Self>, shutdown: CancellationToken) {
        let mut routes = self.routes.clone();
        let mut bound: HashMap<u16, CancellationToken> = HashMap::new();
        let mut retry = tokio::time::interval(Duration::from_secs(1));
        retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let table = routes.borrow_and_update().clone();
            bound.retain(|port, stop| {
                let keep = table.route(*port).is_some();
                if !keep {
                    tracing::info!(port, "listener removed");
                    stop.cancel();
                }
                keep
            });
            let mut missing = 0;
            for port in table.ports() {
                if bound.contains_key(&port) {
                    continue;
                }
                match TcpListener::bind(SocketAddr::new(self.listen_ip, port)).await {
                    Ok(listener) => {
                        let stop = shutdown.child_token();
                        bound.insert(port, stop.clone());
                        // Down again when the accept loop has dropped the socket.
                        self.metrics.routes.listeners.inc();
                        tracing::info!(port, backend = ?table.route(port).map(|r| r.backend.to_string()), "listening");
                        tokio::spawn(self.clone().accept_loop(listener, port, stop));
                    }
                    Err(e) => {
                        missing += 1;
                        self.metrics.routes.listener_errors.inc();
                        tracing::error!(port, ip = %self.listen_ip, "cannot listen: {e}");
                    }
                }
            }
            self.ready
                .store(table.is_loaded() && missing == 0, Ordering::Release);
            tokio::select! {
                _ = shutdown.cancelled() => break,
                changed = routes.changed() => if changed.is_err() { break },
                _ = retry.tick(), if missing > 0 => {}
            }
        }
        self.ready.store(false, Ordering::Release);
        for stop in bound.values() {
            stop.cancel();
        }
    }

    async fn accept_loop(
        self: Arc<Self>,
        listener: TcpListener,
        port: u16,
        stop: CancellationToken,
    ) {
        while let Some((socket, permit)) = self.accept(&listener, port, &stop).await {
            let Some(route) = self.routes.borrow().route(port).cloned() else {
                self.reject("no_route");
                continue;
            };
            let forwarder = self.forwarder.clone();
            self.connections.spawn(async move {
                forwarder.serve(socket, port, route).await;
                drop(permit);
            });
        }
        // The port refuses connections from here on; the gauge says so (a drain can be
        // watched closing its ports on /metrics).
        drop(listener);
        self.metrics.routes.listeners.dec();
    }

    /// The TLS port's accept loop: the same connection limit and drain as the node ports;
    /// each connection is routed by its SNI name in its own task.
    pub async fn accept_tls(
        self: Arc<Self>,
        listener: TcpListener,
        tls: Arc<TlsServer>,
        stop: CancellationToken,
    ) {
        let port = tls.port;
        tracing::info!(port, "TLS port listening (routed by SNI)");
        while let Some((socket, permit)) = self.accept(&listener, port, &stop).await {
            let tls = tls.clone();
            self.connections.spawn(async move {
                tls.serve(socket).await;
                drop(permit);
            });
        }
    }

    /// The next connection within the connection limit, with its permit; `None` once `stop`
    /// is cancelled. Connections past the limit are closed at once and counted; accept
    /// errors (out of file descriptors and the like) back off instead of spinning.
    async fn accept(
        &self,
        listener: &TcpListener,
        port: u16,
        stop: &CancellationToken,
    ) -> Option<(TcpStream, OwnedSemaphorePermit)> {
        let mut backoff = Duration::from_millis(5);
        loop {
            let accepted = tokio::select! {
                _ = stop.cancelled() => return None,
                a = listener.accept() => a,
            };
            let (socket, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    self.metrics.routes.listener_errors.inc();
                    tracing::error!(port, "accept failed: {e}; retrying in {backoff:?}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    continue;
                }
            };
            match self.limit.clone().try_acquire_owned() {
                Ok(permit) => return Some((socket, permit)),
                Err(_) => {
                    self.reject("connection_limit");
                    tracing::warn!(port, %peer, "connection limit reached; closing");
                }
            }
        }
    }

    fn reject(&self, reason: &'static str) {
        self.metrics
            .connections
            .rejected
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }
}
