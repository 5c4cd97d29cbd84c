//! One client connection: dial its node, then copy bytes both ways.
//!
//! [`Forwarder::serve`] is the per-port path: a plain `TcpStream` split in place, no
//! wrapping (with `--tls-backend tls`, the node's leg is a TLS session, see
//! [`super::tls_session`]). [`Forwarder::relay`] is the copy itself, generic over the two
//! streams' halves, which the TLS port uses with the client's TLS session and a plain or
//! TLS leg to the node (see [`super::tls_port`]).
//!
//! Both directions run the one copy loop (`copy`): read, let an `Observer` see the
//! bytes and say what goes out, write, repeat. Plain forwarding observes nothing; a
//! rewriting connection's request side notes the commands and its reply side rebuilds the
//! topology replies (see [`crate::rewrite::stream`]).
//!
//! Each direction writes what it read before it reads again, so a slow reader on one side
//! stops reads on the other (back-pressure) and memory per connection is bounded by two
//! buffers. Each side, plain or TLS, holds its buffer only from the read to the end of the
//! write (see [`super::buffers`]): an idle connection holds its sockets and a small state
//! (and a TLS session's own, rustls's).
//! Half-closes are forwarded: a client that shuts its write side still gets the replies in
//! flight.

use std::cell::Cell;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use futures_util::future::Either;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;
use tokio_rustls::client::TlsStream;

use super::buffers::{Buffer, Source};
use super::join::try_join;
use super::keepalive::LateKeepalive;
use super::serve::{Ending, Serve};
use super::sink::Sink;
use super::tls_session::TlsSession;
use super::watch::{watch, Activity, HardStop, Watched};
use crate::dial::{BackendTls, BackendTlsRx, DialError, Dialer};
use crate::metrics::{
    BytesLabels, KindLabels, Metrics, PerThreadCounter, PortLabels, ReasonLabels, RewriteLabels,
};
use crate::model::{Backend, Route};
use crate::resp::pairing::Lost;
use crate::resp::RespError;
use crate::rewrite::addresses::UnknownAddresses;
use crate::rewrite::stream::{
    Limits, ReplySide, RequestSide, Rest, Rewriting, Segment, Shared, Skipped,
};
use crate::rewrite::{AddressMap, Report};
use crate::source::RouteRx;
use crate::throttle::Throttle;

/// Which side an error came from (as pingora tags them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Client,
    Backend,
}

/// Why a connection ended badly.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("backend {backend}: {source}")]
    Dial {
        backend: String,
        #[source]
        source: DialError,
    },
    #[error("{side:?} side: {source}")]
    Io {
        side: Side,
        #[source]
        source: std::io::Error,
    },
    #[error("{side:?} side sent invalid RESP: {source}")]
    Protocol {
        side: Side,
        #[source]
        source: RespError,
    },
    /// Valid RESP that goes past one of the proxy's limits (a topology reply too large to
    /// hold, nesting too deep to follow): not called invalid, nor counted as a protocol
    /// error.
    #[error("{side:?} side sent a frame past the proxy's limits: {source}")]
    Limit {
        side: Side,
        #[source]
        source: RespError,
    },
    /// Replies could no longer be paired with requests: closed after an error line to the
    /// client rather than forwarded by guess.
    #[error("lost track of which reply answers which command: {}", .0.describe())]
    Lost(Lost),
}

impl ForwardError {
    /// A metric label: how the connection ended (`connections_closed_total{reason}`).
    pub fn label(&self) -> &'static str {
        match self {
            ForwardError::Dial { .. } => "backend_unreachable",
            ForwardError::Io {
                side: Side::Backend,
                ..
            } => "backend_error",
            ForwardError::Io {
                side: Side::Client, ..
            } => "client_error",
            ForwardError::Protocol { .. } => "protocol_error",
            ForwardError::Limit { .. } => "limit_exceeded",
            ForwardError::Lost(_) => "pairing_lost",
        }
    }
}

impl Side {
    /// A metric label.
    pub fn label(self) -> &'static str {
        match self {
            Side::Client => "client",
            Side::Backend => "backend",
        }
    }
}

/// How a connection ended without error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closed {
    /// Both sides closed.
    Eof,
    /// No bytes either way for the idle timeout.
    Idle,
    /// The drain timeout ran out during shutdown.
    Drained,
}

impl Closed {
    /// A metric label (`connections_closed_total{reason}`).
    pub fn label(self) -> &'static str {
        match self {
            Closed::Eof => "eof",
            Closed::Idle => "idle_timeout",
            Closed::Drained => "drain_timeout",
        }
    }
}

/// A connection counted as open: its listener port and its `connections_active` gauge.
pub struct Open {
    port: u16,
    active: Gauge,
}

/// Which address map a rewriting connection hands out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Addresses {
    /// The per-port listeners': the advertised host, one port per node.
    Ports,
    /// The TLS port's: one SNI name per node, the TLS port.
    Sni,
}

/// What every connection shares.
pub struct Forwarder {
    pub dialer: Dialer,
    /// The TLS legs to the nodes (`--tls-backend tls`), reloaded when their files change;
    /// `None`: plain TCP.
    pub backend_tls: Option<BackendTlsRx>,
    pub metrics: Arc<Metrics>,
    pub idle_timeout: Option<Duration>,
    pub buffer_size: usize,
    /// Stopped when the drain timeout runs out: every connection still open then closes.
    pub hard_stop: HardStop,
    /// The latest table, whose address map rewriting listeners use.
    pub routes: RouteRx,
    pub rewrite_info: bool,
    pub limits: Limits,
    /// Addresses no route knows: logged (rate-limited), and the route source woken.
    pub unknown: UnknownAddresses,
    /// Warnings of connections that ended badly, one per listener port and outcome per
    /// [`WARNINGS_EVERY`]: a backend down while clients reconnect in a loop must not flood
    /// the log (`connections_closed_total` counts every one).
    pub warnings: Throttle<(u16, &'static str)>,
}

/// See [`Forwarder::warnings`].
pub const WARNINGS_EVERY: Duration = Duration::from_secs(10);

/// The throttle for [`Forwarder::warnings`].
pub fn warnings() -> Throttle<(u16, &'static str)> {
    Throttle::new(WARNINGS_EVERY, 1024)
}

impl Forwarder {
    /// Serves one accepted client connection on listener `port` with its route, taken at
    /// accept time, holding `permit` (of the connection limit) until it ends. Counts and
    /// logs the outcome. `peer` is the address accept gave.
    pub fn serve(
        self: Arc<Self>,
        client: TcpStream,
        peer: SocketAddr,
        port: u16,
        route: Arc<Route>,
        permit: OwnedSemaphorePermit,
    ) -> Serve<impl Future<Output = Result<Closed, ForwardError>> + Send> {
        let open = self.opened(port);
        // Not boxed: the connection is one allocation, and its state is what idle
        // connections cost.
        let forward = self.clone().forward(client, port, route.clone());
        Serve::new(
            forward,
            Ending {
                forwarder: self,
                route,
                peer,
                open,
                permit,
            },
        )
    }

    /// Counts a connection on listener `port` as accepted and active; hand the result to
    /// [`Forwarder::closed`] when it ends.
    pub fn opened(&self, port: u16) -> Open {
        let m = &self.metrics.connections;
        m.accepted.get_or_create(&PortLabels { port }).inc();
        let active = m.active.get_or_create(&PortLabels { port }).clone();
        active.inc();
        Open { port, active }
    }

    /// Counts and logs how a connection ended.
    pub fn closed(
        &self,
        open: Open,
        peer: Option<SocketAddr>,
        backend: &Backend,
        outcome: Result<Closed, ForwardError>,
    ) {
        let Open { port, active } = open;
        let m = &self.metrics.connections;
        active.dec();
        let backend_error = match &outcome {
            Err(ForwardError::Dial { source, .. }) => Some(source.label()),
            Err(ForwardError::Io {
                side: Side::Backend,
                ..
            }) => Some("io"),
            _ => None,
        };
        if let Some(kind) = backend_error {
            m.backend_errors
                .get_or_create(&KindLabels { port, kind })
                .inc();
        }
        if let Err(ForwardError::Protocol { side, .. }) = &outcome {
            self.metrics
                .rewrite
                .protocol_errors
                .get_or_create(&ReasonLabels {
                    reason: side.label(),
                })
                .inc();
        }
        let reason = match &outcome {
            Ok(closed) => closed.label(),
            Err(e) => e.label(),
        };
        m.closed.get_or_create(&ReasonLabels { reason }).inc();
        match outcome {
            Ok(closed) => {
                tracing::debug!(port, ?peer, backend = %backend, ?closed, "connection closed")
            }
            Err(
                e @ (ForwardError::Dial { .. }
                | ForwardError::Protocol { .. }
                | ForwardError::Limit { .. }
                | ForwardError::Lost(_)),
            ) => {
                if let Some(suppressed) = self.warnings.due(&(port, e.label())) {
                    tracing::warn!(port, ?peer, backend = %backend, suppressed, "{e}")
                }
            }
            Err(e) => {
                tracing::debug!(port, ?peer, backend = %backend, "connection ended: {e}")
            }
        }
    }

    /// The client's connection to its route's node, relayed until it ends (a plain fn
    /// returning an `async move` block, as [`copy`] is).
    #[allow(clippy::manual_async_fn)]
    fn forward(
        self: Arc<Self>,
        mut client: TcpStream,
        port: u16,
        route: Arc<Route>,
    ) -> impl Future<Output = Result<Closed, ForwardError>> + Send {
        async move {
            if let Some(tls) = &self.backend_tls {
                // Boxed whole: a plain connection's state does not grow by the TLS path's.
                let tls = tls.borrow().clone();
                return Box::pin(self.forward_tls(client, port, &route, tls)).await;
            }
            // Awaited in place: the dial's future and the relay's share the connection's
            // storage, one after the other. Boxed, it was an allocation per connection, and
            // the hole it left was where the next allocation (a rewriting connection's state)
            // went, so that the next dial took new memory (+128 bytes per idle rewriting
            // connection in the load harness).
            let mut backend =
                self.dialer
                    .tcp(&route.backend)
                    .await
                    .map_err(|source| ForwardError::Dial {
                        backend: route.backend.to_string(),
                        source,
                    })?;
            // The client socket has its options from the listener (`dial::listen`).
            let (cr, cw) = client.split();
            let (br, bw) = backend.split();
            let rewrite = route.rewrite.then_some(Addresses::Ports);
            self.relay(port, rewrite, cr, cw, br, bw).await
        }
    }

    /// [`Self::forward`] to a node that speaks TLS (`--tls-backend tls`).
    async fn forward_tls(
        &self,
        mut client: TcpStream,
        port: u16,
        route: &Route,
        tls: Arc<BackendTls>,
    ) -> Result<Closed, ForwardError> {
        let backend = self.dial_tls(route, &tls).await?;
        let (tcp, conn) = backend.into_inner();
        let backend = TlsSession::new(tcp, conn, &[]).map_err(|source| ForwardError::Io {
            side: Side::Backend,
            source,
        })?;
        let (cr, cw) = client.split();
        let (br, bw) = backend.split();
        let rewrite = route.rewrite.then_some(Addresses::Ports);
        self.relay(port, rewrite, cr, cw, br, bw).await
    }

    /// A TLS connection to `route`'s node at its TLS address (`tls_backend`, else its
    /// address), its certificate checked as `tls` says.
    pub async fn dial_tls(
        &self,
        route: &Route,
        tls: &BackendTls,
    ) -> Result<TlsStream<TcpStream>, ForwardError> {
        let at = route.tls_backend();
        let dial_error = |source| ForwardError::Dial {
            backend: at.to_string(),
            source,
        };
        let tcp = self.dialer.tcp(at).await.map_err(dial_error)?;
        let name = tls.name_for(route.node, at).map_err(dial_error)?;
        self.dialer
            .tls(tcp, tls, name, at)
            .await
            .map_err(dial_error)
    }

    /// Copies client → backend and backend → client until both are done, the connection
    /// idles out or the drain ends. With `rewrite`, the replies' topology is rewritten to
    /// that address map. The caller closes both sockets when it returns: a plain writer
    /// whose stream ended both ways is left to that close ([`Sink::CLOSE_ENDS_STREAM`]).
    pub async fn relay<CR, CW, BR, BW>(
        &self,
        port: u16,
        rewrite: Option<Addresses>,
        cr: CR,
        cw: CW,
        br: BR,
        bw: BW,
    ) -> Result<Closed, ForwardError>
    where
        CR: Source,
        CW: Sink,
        BR: Source,
        BW: Sink,
    {
        let m = &self.metrics.connections;
        let up = m
            .bytes
            .get_or_create(&BytesLabels {
                port,
                direction: "to_backend",
            })
            .clone();
        let down = m
            .bytes
            .get_or_create(&BytesLabels {
                port,
                direction: "to_client",
            })
            .clone();
        // A plain node socket was dialled without keepalive (see `conn::keepalive`).
        let clock = Activity::with(if BR::SETS_KEEPALIVE {
            LateKeepalive::wanted()
        } else {
            LateKeepalive::not_wanted()
        });
        // Boxed: it is large, and a plain connection's future should not be sized for it
        // (idle connections are counted in thousands). Made here, in the one async layer
        // below `forward`, so that the copy loops' future is built by plain calls: each
        // async layer keeps its own copy of the arguments it hands on.
        let mut state =
            rewrite.map(|a| (a, Box::new(Rewriting::new(self.rewrite_info, self.limits))));
        let rewriting = state.as_mut().map(|(a, s)| (*a, &mut **s));
        let copy = self.both(rewriting, cr, cw, br, bw, &up, &down, &clock);
        match watch(copy, &self.hard_stop, &clock, self.idle_timeout).await {
            Watched::Done(r) => r.map(|()| Closed::Eof),
            Watched::Idle => Ok(Closed::Idle),
            Watched::Stopped => Ok(Closed::Drained),
        }
    }
}

impl Forwarder {
    /// Both copy loops, plain or rewriting (with `rewriting`'s address map and state).
    ///
    /// Plain fns, not async ones, down to the copy loops: the future is the two loops
    /// joined, and nothing else.
    #[allow(clippy::too_many_arguments)]
    fn both<'a, CR, CW, BR, BW>(
        &'a self,
        rewriting: Option<(Addresses, &'a mut Rewriting)>,
        cr: CR,
        cw: CW,
        br: BR,
        bw: BW,
        up: &'a PerThreadCounter,
        down: &'a PerThreadCounter,
        clock: &'a Activity,
    ) -> impl Future<Output = Result<(), ForwardError>> + Send + 'a
    where
        CR: Source + 'a,
        CW: Sink + 'a,
        BR: Source + 'a,
        BW: Sink + 'a,
    {
        let size = self.buffer_size;
        match rewriting {
            // Not boxed (a box is one more cache line per read): its state is, by `relay`,
            // so that a plain connection's future is not sized for it.
            Some((addresses, state)) => {
                Either::Left(self.rewriting(addresses, state, cr, cw, br, bw, up, down, clock))
            }
            None => Either::Right(try_join(
                copy(cr, bw, size, Plain, up, clock, Side::Client),
                copy(br, cw, size, Plain, down, clock, Side::Backend),
            )),
        }
    }

    /// Both copy loops of a rewriting connection: its requests noted, its replies'
    /// topology rewritten to `addresses`, in `state`.
    #[allow(clippy::too_many_arguments)]
    fn rewriting<'a, CR, CW, BR, BW>(
        &'a self,
        addresses: Addresses,
        state: &'a mut Rewriting,
        cr: CR,
        cw: CW,
        br: BR,
        bw: BW,
        up: &'a PerThreadCounter,
        down: &'a PerThreadCounter,
        clock: &'a Activity,
    ) -> impl Future<Output = Result<(), ForwardError>> + Send + 'a
    where
        CR: Source + 'a,
        CW: Sink + 'a,
        BR: Source + 'a,
        BW: Sink + 'a,
    {
        let Rewriting {
            shared,
            requests,
            replies,
        } = state;
        let shared = &*shared;
        let rejected = (self.metrics.rewrite.protocol_errors)
            .get_or_create(&ReasonLabels { reason: "client" })
            .clone();
        let size = self.buffer_size;
        let mut routes = self.routes.clone();
        let map = Forwarder::addresses(&mut routes, addresses);
        // The observers hold their state by reference, so that the copy loops stay as
        // small as plain ones.
        try_join(
            copy(
                cr,
                bw,
                size,
                Requests {
                    side: requests,
                    shared,
                    rejected,
                    ended: false,
                },
                up,
                clock,
                Side::Client,
            ),
            copy(
                br,
                cw,
                size,
                Replies {
                    side: replies,
                    shared,
                    forwarder: self,
                    map,
                    routes,
                    addresses,
                    out: Vec::new(),
                },
                down,
                clock,
                Side::Backend,
            ),
        )
    }

    /// The address map a rewriting connection hands out now (the latest table's), marked
    /// seen in `routes`.
    fn addresses(routes: &mut RouteRx, addresses: Addresses) -> Arc<AddressMap> {
        let snapshot = routes.borrow_and_update();
        match addresses {
            Addresses::Ports => snapshot.addresses.clone(),
            Addresses::Sni => snapshot.tls_addresses.clone(),
        }
    }

    /// Counts what one read's rewriting did, and wakes the route source when a reply named
    /// an address no route knows.
    fn record(&self, report: &Report) {
        let m = &self.metrics.rewrite;
        // One counter update per kind per read, not per reply.
        let mut kinds = report.kinds.iter().peekable();
        while let Some(kind) = kinds.next() {
            let mut n = 1;
            while kinds.next_if(|k| *k == kind).is_some() {
                n += 1;
            }
            m.replies.get_or_create(&RewriteLabels { kind }).inc_by(n);
        }
        for &reason in &report.skipped {
            m.skipped.get_or_create(&ReasonLabels { reason }).inc();
        }
        if !report.skipped.is_empty() {
            tracing::debug!(skipped = ?report.skipped, "replies paired with a topology command but not of its shape; forwarded unchanged");
        }
        if report.refresh && report.unknown.is_empty() {
            self.unknown.refresh();
        }
        if !report.unknown.is_empty() {
            m.unknown_addresses.inc_by(report.unknown.len() as u64);
            self.unknown.report(&report.unknown);
        }
    }
}

/// What one direction of the copy loop does with the bytes it read: look at them, and say
/// which bytes go out.
trait Observer: Send {
    /// What to wait for before the loop may read again (back-pressure), if anything:
    /// nothing by default. An `Option` rather than a future that is at once ready, so that
    /// the read that need not wait (all but a few) polls no future (callgrind: 38 user-space
    /// instructions per request at pipeline 1).
    fn wait(&self) -> Option<impl Future<Output = ()> + Send> {
        None::<std::future::Ready<()>>
    }

    /// The bytes to write for `input`, the bytes just read.
    fn observe<'a>(&'a mut self, input: &'a [u8]) -> Result<&'a [u8], RespError>;

    /// Whether the stream ended with the last bytes observed: nothing more is read, and the
    /// other side is shut once they are written.
    fn ended(&self) -> bool {
        false
    }

    /// The bytes last observed have been written.
    fn written(&mut self) {}

    /// Whether the pairing was lost with the last bytes observed (which end with an error
    /// line): the connection is closed once they are written.
    fn lost(&self) -> Option<Lost> {
        None
    }
}

/// Plain forwarding: every byte goes out as it came.
struct Plain;

impl Observer for Plain {
    #[inline]
    fn observe<'a>(&'a mut self, input: &'a [u8]) -> Result<&'a [u8], RespError> {
        Ok(input)
    }
}

/// Client → backend on a rewriting listener: the commands are noted, the bytes go on
/// unchanged.
struct Requests<'s> {
    side: &'s mut RequestSide,
    shared: &'s Shared,
    /// `protocol_errors_total{reason="client"}`.
    rejected: Counter,
    ended: bool,
}

impl Observer for Requests<'_> {
    /// Back-pressure on a client that pipelines far ahead of the replies.
    fn wait(&self) -> Option<impl Future<Output = ()> + Send> {
        self.side.wait(self.shared)
    }

    fn observe<'a>(&'a mut self, input: &'a [u8]) -> Result<&'a [u8], RespError> {
        match self.side.observe(input, self.shared) {
            // Bad input that Valkey rejects at the same command, with a protocol error of
            // its own after which it runs nothing: forwarded, so that the client gets that
            // error line as a direct connection does; no more is read.
            Err(e) if crate::resp::request::valkey_rejects(&e) => {
                tracing::debug!("client sent invalid RESP, left to Valkey to answer: {e}");
                self.rejected.inc();
                self.ended = true;
                Ok(input)
            }
            r => r.map(|()| input),
        }
    }

    fn ended(&self) -> bool {
        self.ended
    }
}

/// Backend → client on a rewriting listener: topology replies are rebuilt with the latest
/// table's addresses; everything else goes on as it came.
struct Replies<'s> {
    side: &'s mut ReplySide,
    shared: &'s Shared,
    forwarder: &'s Forwarder,
    /// The table's address map, taken again when `routes` has changed, looked at on a read
    /// that is more than replies to plain commands (the only reads that use it): a lock on
    /// the shared table per read would be a cache line every thread writes.
    map: Arc<AddressMap>,
    routes: RouteRx,
    addresses: Addresses,
    /// Where several segments are gathered, so that one read makes one write (a copy is
    /// cheaper than a syscall per rewritten reply); given back once written.
    out: Vec<u8>,
}

thread_local! {
    /// The segments of the read being observed: per thread rather than per connection, as
    /// they never outlive one `observe`.
    static SEGMENTS: Cell<Vec<Segment>> = const { Cell::new(Vec::new()) };
}

impl Observer for Replies<'_> {
    fn lost(&self) -> Option<Lost> {
        self.side.lost()
    }

    fn observe<'a>(&'a mut self, input: &'a [u8]) -> Result<&'a [u8], RespError> {
        match self.side.skip_plain_replies(input, self.shared) {
            // Replies to plain commands only: no segments, nothing to count.
            Skipped::All => Ok(input),
            Skipped::Rest(rest) => self.observe_rest(input, rest),
        }
    }

    fn written(&mut self) {
        // A rewritten topology reply can be large (a NODES reply of a big cluster): not
        // kept for the connection's life.
        if self.out.capacity() > 0 {
            self.out = Vec::new();
        }
    }
}

impl Replies<'_> {
    /// The read past its replies to plain commands. Out of line: the common read returns
    /// above without setting up this one's state.
    #[inline(never)]
    fn observe_rest<'a>(
        &'a mut self,
        input: &'a [u8],
        rest: Rest<'_>,
    ) -> Result<&'a [u8], RespError> {
        // A closed channel (shutdown) keeps the map in hand.
        if self.routes.has_changed().unwrap_or(false) {
            self.map = Forwarder::addresses(&mut self.routes, self.addresses);
        }
        let map = &self.map;
        let mut report = Report::default();
        // During thread teardown the scratch is gone: a fresh vector does.
        let mut segments = SEGMENTS.try_with(Cell::take).unwrap_or_default();
        segments.clear();
        let processed =
            self.side
                .process_rest(input, rest, self.shared, map, &mut segments, &mut report);
        self.forwarder.record(&report);
        // What goes out, told before the segments go back to their thread.
        let one = match (&processed, segments.as_slice()) {
            (Err(_), _) | (_, []) => Some(0..0),
            (_, [Segment::Input(r)]) => Some(r.clone()),
            (_, many) => {
                self.out.clear();
                for seg in many {
                    self.out.extend_from_slice(segment(input, seg));
                }
                None
            }
        };
        segments.clear();
        let _ = SEGMENTS.try_with(|s| s.set(segments));
        processed?;
        Ok(match one {
            Some(range) => &input[range],
            None => &self.out,
        })
    }
}

/// Writes all of `bytes` and flushes: a TLS stream may hold written bytes in its buffer
/// when the socket was full, and nothing else would push them out (a no-op on TCP).
///
/// With `direct`, what the socket takes at once is written straight ([`Sink::write_now`]):
/// the runtime's write would first check the readiness it keeps, the same work again. The
/// runtime learns nothing from a straight write, though: it still takes the socket for
/// writable when that write left it full, and its own next write would fail once before
/// it waits. So once a straight write is not taken whole, writes go through the runtime
/// (whose short write marks the socket full, and whose wait then costs no failing call)
/// until one is taken without waiting: a slow reader costs one failing call when it falls
/// behind, not one per write.
async fn send<W: Sink>(to: &mut W, bytes: &[u8], direct: &mut bool) -> std::io::Result<()> {
    let mut done = 0;
    if *direct {
        match to.write_now(bytes) {
            Ok(n) => done = n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    if done < bytes.len() {
        *direct = !write_through(to, &bytes[done..]).await?;
    }
    to.flush().await
}

/// Writes all of `bytes` through the runtime: whether it had to wait for the socket.
async fn write_through<W: Sink>(to: &mut W, mut bytes: &[u8]) -> std::io::Result<bool> {
    let mut waited = false;
    std::future::poll_fn(|cx| {
        while !bytes.is_empty() {
            match Pin::new(&mut *to).poll_write(cx, bytes) {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()))
                }
                Poll::Ready(Ok(n)) => bytes = &bytes[n..],
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    waited = true;
                    return Poll::Pending;
                }
            }
        }
        Poll::Ready(Ok(waited))
    })
    .await
}

fn segment<'a>(buf: &'a [u8], seg: &'a Segment) -> &'a [u8] {
    match seg {
        Segment::Input(r) => &buf[r.clone()],
        Segment::Owned(v) => v.as_slice(),
    }
}

/// The copy loop of one direction: reads from `from` (the `side` of the connection), lets
/// `observer` say what goes out, writes it to `to`, until EOF; then half-closes `to`.
///
/// A plain fn returning an `async move` block rather than an `async fn`: an async fn's
/// arguments are stored twice in its future (as arguments, then as the body's bindings),
/// and this future is most of what an idle connection costs.
#[allow(clippy::manual_async_fn)]
fn copy<'a, R, W, O>(
    mut from: R,
    mut to: W,
    buffer_size: usize,
    mut observer: O,
    bytes: &'a PerThreadCounter,
    clock: &'a Activity,
    side: Side,
) -> impl Future<Output = Result<(), ForwardError>> + Send + 'a
where
    R: Source + 'a,
    W: Sink + 'a,
    O: Observer + 'a,
{
    async move {
        let other = match side {
            Side::Client => Side::Backend,
            Side::Backend => Side::Client,
        };
        let mut slot: Option<Buffer> = None;
        // Writes go straight to the socket while it takes them whole (see `send`).
        let mut direct = true;
        // The node's socket gets keepalive from here, once the watch says it is due.
        let keepalive = (R::SETS_KEEPALIVE && side == Side::Backend).then_some(&clock.keepalive);
        loop {
            if let Some(wait) = observer.wait() {
                wait.await;
            }
            let n = eof_ok(from.read_into(&mut slot, buffer_size, keepalive).await)
                .map_err(|source| ForwardError::Io { side, source })?;
            if n == 0 {
                // When the other direction has read its end too, the connection's sockets
                // are closed next, and a plain socket's close sends the FIN that shutdown
                // would: one system call fewer per connection.
                if !(clock.end_of_stream() && W::CLOSE_ENDS_STREAM) {
                    // The peer may already be gone; that is not this connection's error.
                    let _ = to.shutdown().await;
                }
                return Ok(());
            }
            let Some(buf) = &slot else {
                // A source reports bytes only into its buffer; nothing to forward otherwise.
                continue;
            };
            let out = observer.observe(&buf[..n]).map_err(|source| {
                if source.is_limit() {
                    ForwardError::Limit { side, source }
                } else {
                    ForwardError::Protocol { side, source }
                }
            })?;
            if !out.is_empty() {
                if let Err(source) = send(&mut to, out, &mut direct).await {
                    if side == Side::Client {
                        // The backend closed its end (QUIT, a protocol error): what it sent
                        // before is still forwarded by the other direction, as a direct client
                        // would still read it.
                        return Ok(());
                    }
                    return Err(ForwardError::Io {
                        side: other,
                        source,
                    });
                }
            }
            bytes.inc_by(out.len() as u64);
            observer.written();
            clock.touch();
            // Back to the free list: an idle connection holds no buffer.
            slot = None;
            if let Some(lost) = observer.lost() {
                let _ = to.shutdown().await;
                return Err(ForwardError::Lost(lost));
            }
            if observer.ended() {
                let _ = to.shutdown().await;
                return Ok(());
            }
        }
    }
}

/// A read's result with `UnexpectedEof` taken as an end of stream: what rustls reports when a
/// TLS peer closes TCP without a close_notify, as many clients do. For this relay it is an
/// end like any other (RESP frames delimit themselves; the bytes that came are forwarded).
fn eof_ok(read: std::io::Result<usize>) -> std::io::Result<usize> {
    match read {
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(0),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Context;

    use tokio::io::{AsyncReadExt, AsyncWrite};
    use tokio::net::{tcp, TcpListener};
    use tokio::sync::watch;

    use super::*;

    /// A real socket's write half that counts the straight writes it did not take whole,
    /// and tells when a write through the runtime waits.
    struct Counting<'a> {
        inner: tcp::WriteHalf<'a>,
        refused: &'a AtomicUsize,
        /// Whether a write through the runtime is waiting for the socket.
        waiting: &'a watch::Sender<bool>,
    }

    impl AsyncWrite for Counting<'_> {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let r = Pin::new(&mut self.inner).poll_write(cx, buf);
            self.waiting
                .send_if_modified(|w| std::mem::replace(w, r.is_pending()) != *w);
            r
        }
        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.inner).poll_flush(cx)
        }
        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.inner).poll_shutdown(cx)
        }
    }

    impl Sink for Counting<'_> {
        const CLOSE_ENDS_STREAM: bool = true;
        fn write_now(&mut self, bytes: &[u8]) -> io::Result<usize> {
            let r = self.inner.write_now(bytes);
            if !matches!(r, Ok(n) if n == bytes.len()) {
                self.refused.fetch_add(1, Ordering::Relaxed);
            }
            r
        }
    }

    /// A reader that takes a little each time the writer waits keeps the socket full: the
    /// straight write fails once, when the writer falls behind, not on every write (each
    /// such failure is a system call for nothing). Every byte arrives, in order.
    #[tokio::test]
    async fn a_slow_reader_costs_one_refused_straight_write_not_one_per_write() {
        const WRITES: usize = 40;
        const SIZE: usize = 64 * 1024;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        // Small buffers, so that one write fills the connection.
        socket2::SockRef::from(&listener)
            .set_recv_buffer_size(16 * 1024)
            .unwrap();
        let mut writer = crate::dial::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        socket2::SockRef::from(&writer)
            .set_send_buffer_size(16 * 1024)
            .unwrap();
        let (mut reader, _) = listener.accept().await.unwrap();
        let (refused, (waiting, mut writer_waits)) = (AtomicUsize::new(0), watch::channel(false));
        let (_, w) = writer.split();
        let mut to = Counting {
            inner: w,
            refused: &refused,
            waiting: &waiting,
        };
        let write = async {
            let mut direct = true;
            for i in 0..WRITES {
                let bytes = vec![i as u8; SIZE];
                send(&mut to, &bytes, &mut direct).await.unwrap();
            }
            to.shutdown().await.unwrap();
            // Nothing waits from here: the reader reads on to the end.
            waiting.send_replace(true);
        };
        let read = async {
            let mut got = Vec::with_capacity(WRITES * SIZE);
            let mut chunk = vec![0u8; 8 * 1024];
            loop {
                // A little at a time, only while the writer waits: the socket stays full.
                writer_waits.wait_for(|w| *w).await.unwrap();
                let n = reader.read(&mut chunk).await.unwrap();
                if n == 0 {
                    return got;
                }
                got.extend_from_slice(&chunk[..n]);
            }
        };
        let ((), got) =
            tokio::time::timeout(Duration::from_secs(60), async { tokio::join!(write, read) })
                .await
                .expect("the copy did not finish within a minute");
        let expected: Vec<u8> = (0..WRITES).flat_map(|i| vec![i as u8; SIZE]).collect();
        assert!(got == expected, "bytes lost, duplicated or out of order");
        let refused = refused.load(Ordering::Relaxed);
        assert!(
            refused <= 2,
            "{refused} of {WRITES} straight writes were refused: each is a failed system call"
        );
    }
}
