//! Listeners: one accept loop per port, and the supervisor that keeps the set of bound
//! ports equal to the route table's.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::forward::Forwarder;
use super::tls_port::TlsServer;
use crate::metrics::{Metrics, ReasonLabels};
use crate::source::RouteRx;
use crate::throttle::Throttle;

/// What every listener shares.
pub struct Listeners {
    pub listen_ip: IpAddr,
    pub routes: RouteRx,
    pub forwarder: Arc<Forwarder>,
    /// One permit per open connection: the connection limit.
    pub limit: Arc<Semaphore>,
    /// One permit per TLS port connection still in its hello or handshake: a budget apart
    /// from `limit`, so that slow hellos cannot lock out the node ports.
    pub handshakes: Arc<Semaphore>,
    /// The handshake budget per client IP address.
    pub per_source: Arc<PerSource>,
    /// Every connection task, so that shutdown can wait for them.
    pub connections: TaskTracker,
    pub metrics: Arc<Metrics>,
    /// True while every port of a loaded table is bound.
    pub ready: Arc<AtomicBool>,
    /// The warnings of refused connections (the metric counts each one).
    pub refusals: Arc<Refusals>,
}

/// Warnings of refused connections, one per key per [`REFUSALS_EVERY`]: the reason, and
/// for a per-address budget the client address (so that each abusive source is named).
pub type Refusals = Throttle<(&'static str, Option<IpAddr>)>;

/// One warning per refusal key per this long, which says how many were left out: a flood
/// of connections past a limit must not become a flood of log lines.
pub const REFUSALS_EVERY: Duration = Duration::from_secs(10);

/// A throttle for the warnings of refused connections.
pub fn refusals() -> Arc<Refusals> {
    Arc::new(Throttle::new(REFUSALS_EVERY, 1024))
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
                match crate::dial::listen(SocketAddr::new(self.listen_ip, port)) {
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
        while let Some((socket, peer, permit)) = self
            .accept(&listener, port, &stop, Budget::Connections)
            .await
        {
            let Some(route) = self.routes.borrow().route(port).cloned() else {
                self.reject("no_route");
                continue;
            };
            // The connection's own future, with nothing around it: a wrapping async block
            // would hold the socket, route and permit a second time (an idle connection's
            // memory is that future).
            let serve = self
                .forwarder
                .clone()
                .serve(socket, peer, port, route, permit);
            self.connections.spawn(serve);
        }
        // The port refuses connections from here on; the gauge says so (a drain can be
        // watched closing its ports on /metrics).
        drop(listener);
        self.metrics.routes.listeners.dec();
    }

    /// The TLS port's accept loop: the same drain as the node ports; each connection is
    /// routed by its SNI name in its own task. Until its handshake is done a connection
    /// holds a permit of the handshake budget, then one of the connection limit.
    pub async fn accept_tls(
        self: Arc<Self>,
        listener: TcpListener,
        tls: Arc<TlsServer>,
        stop: CancellationToken,
    ) {
        let port = tls.port;
        tracing::info!(port, "TLS port listening (routed by SNI)");
        while let Some((socket, peer, permit)) = self
            .accept(&listener, port, &stop, Budget::Handshakes)
            .await
        {
            let source = peer.ip();
            let Some(slot) = self.per_source.take(source) else {
                self.reject("source_handshake_limit");
                self.metrics.tls.refuse("source_handshake_limit");
                if let Some(suppressed) =
                    self.refusals.due(&("source_handshake_limit", Some(source)))
                {
                    tracing::warn!(
                        port,
                        %source,
                        suppressed,
                        "TLS handshake budget of this client address used up; closing"
                    );
                }
                continue;
            };
            let handshake = Handshake {
                _permit: permit,
                _slot: slot,
            };
            // Spawned as it is, as a node port's connection is (a wrapping block would
            // hold its arguments a second time).
            let serve = tls
                .clone()
                .serve(socket, peer, handshake, self.limit.clone());
            self.connections.spawn(serve);
        }
    }

    /// The next connection within `budget`, with its permit; `None` once `stop` is
    /// cancelled. Connections past it are refused at once and counted; accept errors (out
    /// of file descriptors and the like) back off instead of spinning.
    async fn accept(
        &self,
        listener: &TcpListener,
        port: u16,
        stop: &CancellationToken,
        budget: Budget,
    ) -> Option<(TcpStream, SocketAddr, OwnedSemaphorePermit)> {
        let mut backoff = Duration::from_millis(5);
        let permits = match budget {
            Budget::Connections => &self.limit,
            Budget::Handshakes => &self.handshakes,
        };
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
            match permits.clone().try_acquire_owned() {
                Ok(permit) => return Some((socket, peer, permit)),
                Err(_) => match budget {
                    Budget::Connections => {
                        self.reject("connection_limit");
                        // What Valkey itself says at maxclients. A fresh socket's send
                        // buffer takes the line at once; if not, the close alone says it.
                        let _ = socket.try_write(MAX_CLIENTS_REPLY);
                        if let Some(suppressed) = self.refusals.due(&("connection_limit", None)) {
                            tracing::warn!(port, %peer, suppressed, "connection limit reached; closing");
                        }
                    }
                    Budget::Handshakes => {
                        // Nothing is sent: the client's first bytes are not read, and a TLS
                        // client could not read a RESP line anyway.
                        self.reject("handshake_limit");
                        self.metrics.tls.refuse("handshake_limit");
                        if let Some(suppressed) = self.refusals.due(&("handshake_limit", None)) {
                            tracing::warn!(port, %peer, suppressed, "TLS handshake budget used up; closing");
                        }
                    }
                },
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

/// Which permits a listener's connections take when accepted.
#[derive(Debug, Clone, Copy)]
enum Budget {
    /// The connection limit (`--max-connections`): the node ports.
    Connections,
    /// The handshake budget (`--tls-max-handshakes`): the TLS port, until the handshake is
    /// done.
    Handshakes,
}

/// The error line a client past the connection limit gets before the close: Valkey's own
/// at `maxclients`.
pub const MAX_CLIENTS_REPLY: &[u8] = b"-ERR max number of clients reached\r\n";

/// What a TLS port connection holds until its handshake is done: a permit of the handshake
/// budget and its client address's slot.
pub struct Handshake {
    _permit: OwnedSemaphorePermit,
    _slot: SourceSlot,
}

/// Handshakes in progress per client IP address, within a limit.
#[derive(Debug)]
pub struct PerSource {
    /// At most this many per address; 0: no limit.
    max: usize,
    counts: Mutex<HashMap<IpAddr, usize>>,
}

impl PerSource {
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(PerSource {
            max,
            counts: Mutex::new(HashMap::new()),
        })
    }

    /// A slot for one more handshake from `ip`, or `None` if it has `max` already.
    fn take(self: &Arc<Self>, ip: IpAddr) -> Option<SourceSlot> {
        if self.max > 0 {
            let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
            let n = counts.entry(ip).or_insert(0);
            if *n >= self.max {
                return None;
            }
            *n += 1;
        }
        Some(SourceSlot {
            owner: self.clone(),
            ip,
        })
    }
}

/// One handshake's place in its address's count; given back on drop.
pub struct SourceSlot {
    owner: Arc<PerSource>,
    ip: IpAddr,
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        if self.owner.max == 0 {
            return;
        }
        let mut counts = self.owner.counts.lock().unwrap_or_else(|e| e.into_inner());
        // Entries go when they reach 0, so that the map holds only addresses in a handshake.
        if let Some(n) = counts.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.ip);
            }
        }
    }
}
