//! One client connection: dial its node, then copy bytes both ways.
//!
//! [`Forwarder::serve`] is the per-port path: a plain `TcpStream` split in place, no
//! wrapping. [`Forwarder::relay`] is the copy itself, generic over the two streams' halves,
//! which the TLS port uses with TLS streams (see [`crate::tls`]).
//!
//! Each direction has one fixed buffer and writes what it read before it reads again, so a
//! slow reader on one side stops reads on the other (back-pressure) and memory per
//! connection is bounded by two buffers. Half-closes are forwarded: a client that shuts its
//! write side still gets the replies in flight.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::metrics::{BytesLabels, KindLabels, Metrics, PortLabels, ReasonLabels, RewriteLabels};
use crate::resolve::{DialError, Resolver};
use crate::resp::RespError;
use crate::rewrite::stream::{Limits, ReplySide, RequestSide, Segment, Shared};
use crate::rewrite::Report;
use crate::route::{Route, RouteRx};
use tokio::sync::Notify;

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
    pub resolver: Resolver,
    pub metrics: Arc<Metrics>,
    pub connect_timeout: Duration,
    pub idle_timeout: Option<Duration>,
    pub buffer_size: usize,
    /// Cancelled when the drain timeout runs out: every connection still open then closes.
    pub hard_stop: CancellationToken,
    /// The latest table, whose address map rewriting listeners use.
    pub routes: RouteRx,
    pub rewrite_info: bool,
    pub limits: Limits,
    /// Wakes the route source when a reply names an address no route knows.
    pub refresh: Arc<Notify>,
}

impl Forwarder {
    /// Serves one accepted client connection on listener `port` with its route, taken at
    /// accept time. Counts and logs the outcome.
    pub async fn serve(&self, client: TcpStream, port: u16, route: Arc<Route>) {
        let peer = client.peer_addr().ok();
        self.account(
            port,
            peer,
            &route.backend,
            self.forward(client, port, &route),
        )
        .await;
    }

    /// Runs one connection's forwarding (`conn`) on listener `port`, counting it as
    /// accepted and active while it runs, then counts and logs how it ended.
    pub async fn account(
        &self,
        port: u16,
        peer: Option<SocketAddr>,
        backend: &crate::route::Backend,
        conn: impl Future<Output = Result<Closed, ForwardError>>,
    ) {
        let m = &self.metrics.connections;
        m.accepted.get_or_create(&PortLabels { port }).inc();
        let active = m.active.get_or_create(&PortLabels { port }).clone();
        active.inc();
        let outcome = conn.await;
        active.dec();
        let reason = match &outcome {
            Ok(Closed::Eof) => "eof",
            Ok(Closed::Idle) => "idle_timeout",
            Ok(Closed::Drained) => "drain_timeout",
            Err(ForwardError::Dial { source, .. }) => {
                m.backend_errors
                    .get_or_create(&KindLabels {
                        port,
                        kind: source.kind(),
                    })
                    .inc();
                "backend_unreachable"
            }
            Err(ForwardError::Io {
                side: Side::Backend,
                ..
            }) => {
                m.backend_errors
                    .get_or_create(&KindLabels { port, kind: "io" })
                    .inc();
                "backend_error"
            }
            Err(ForwardError::Io {
                side: Side::Client, ..
            }) => "client_error",
            Err(ForwardError::Protocol { side, .. }) => {
                let side = if *side == Side::Client {
                    "client"
                } else {
                    "backend"
                };
                self.metrics
                    .rewrite
                    .protocol_errors
                    .get_or_create(&ReasonLabels { reason: side })
                    .inc();
                "protocol_error"
            }
        };
        m.closed.get_or_create(&ReasonLabels { reason }).inc();
        match outcome {
            Ok(closed) => {
                tracing::debug!(port, ?peer, backend = %backend, ?closed, "connection closed")
            }
            Err(e @ (ForwardError::Dial { .. } | ForwardError::Protocol { .. })) => {
                tracing::warn!(port, ?peer, backend = %backend, "{e}")
            }
            Err(e) => {
                tracing::debug!(port, ?peer, backend = %backend, "connection ended: {e}")
            }
        }
    }

    async fn forward(
        &self,
        mut client: TcpStream,
        port: u16,
        route: &Route,
    ) -> Result<Closed, ForwardError> {
        let mut backend = self
            .resolver
            .dial(&route.backend, self.connect_timeout)
            .await
            .map_err(|source| ForwardError::Dial {
                backend: route.backend.to_string(),
                source,
            })?;
        tune(&client);
        tune(&backend);
        let (cr, cw) = client.split();
        let (br, bw) = backend.split();
        let rewrite = route.rewrite.then_some(Addresses::Ports);
        self.relay(port, rewrite, cr, cw, br, bw).await
    }

    /// Copies client → backend and backend → client until both are done, the connection
    /// idles out or the drain ends. With `rewrite`, the replies' topology is rewritten to
    /// that address map.
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
        CR: AsyncRead + Unpin,
        CW: AsyncWrite + Unpin,
        BR: AsyncRead + Unpin,
        BW: AsyncWrite + Unpin,
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
        let clock = Activity::new();
        let copy = async {
            if let Some(addresses) = rewrite {
                let shared = Shared::new(self.rewrite_info);
                tokio::try_join!(
                    self.requests(cr, bw, &shared, &up, &clock),
                    self.replies(br, cw, addresses, &shared, &down, &clock),
                )
                .map(|_| ())
            } else {
                let (c2b, b2c) = (Side::Client, Side::Backend);
                tokio::try_join!(
                    pump(cr, bw, self.buffer_size, &up, &clock, c2b, b2c),
                    pump(br, cw, self.buffer_size, &down, &clock, b2c, c2b),
                )
                .map(|_| ())
            }
        };
        tokio::select! {
            r = copy => r.map(|_| Closed::Eof),
            _ = idle(&clock, self.idle_timeout) => Ok(Closed::Idle),
            _ = self.hard_stop.cancelled() => Ok(Closed::Drained),
        }
    }
}

impl Forwarder {
    /// Client → backend on a rewriting listener: the commands are noted, the bytes go on
    /// unchanged.
    async fn requests<R, W>(
        &self,
        mut from: R,
        mut to: W,
        shared: &Shared,
        bytes: &Counter,
        clock: &Activity,
    ) -> Result<(), ForwardError>
    where
        R: AsyncRead + Unpin,
        W: AsyncWrite + Unpin,
    {
        let mut side = RequestSide::new(self.limits);
        let mut buf = vec![0u8; self.buffer_size];
        loop {
            // Back-pressure on a client that pipelines far ahead of the replies.
            shared.room_for_requests().await;
            let n = eof_ok(from.read(&mut buf).await).map_err(|source| ForwardError::Io {
                side: Side::Client,
                source,
            })?;
            if n == 0 {
                let _ = to.shutdown().await;
                return Ok(());
            }
            side.observe(&buf[..n], shared)
                .map_err(|source| ForwardError::Protocol {
                    side: Side::Client,
                    source,
                })?;
            send(&mut to, &buf[..n])
                .await
                .map_err(|source| ForwardError::Io {
                    side: Side::Backend,
                    source,
                })?;
            bytes.inc_by(n as u64);
            clock.touch();
        }
    }

    /// Backend → client on a rewriting listener: topology replies are rebuilt with the
    /// latest table's addresses; everything else goes on as it came.
    async fn replies<R, W>(
        &self,
        mut from: R,
        mut to: W,
        addresses: Addresses,
        shared: &Shared,
        bytes: &Counter,
        clock: &Activity,
    ) -> Result<(), ForwardError>
    where
        R: AsyncRead + Unpin,
        W: AsyncWrite + Unpin,
    {
        let mut side = ReplySide::new(self.limits);
        let mut buf = vec![0u8; self.buffer_size];
        let mut segments = Vec::new();
        let mut out = Vec::new();
        let m = &self.metrics.rewrite;
        loop {
            let n = eof_ok(from.read(&mut buf).await).map_err(|source| ForwardError::Io {
                side: Side::Backend,
                source,
            })?;
            if n == 0 {
                let _ = to.shutdown().await;
                return Ok(());
            }
            let map = match addresses {
                Addresses::Ports => self.routes.borrow().addresses.clone(),
                Addresses::Sni => self.routes.borrow().tls_addresses.clone(),
            };
            let mut report = Report::default();
            segments.clear();
            side.process(&buf[..n], shared, &map, &mut segments, &mut report)
                .map_err(|source| ForwardError::Protocol {
                    side: Side::Backend,
                    source,
                })?;
            // One write per read: a single segment goes as it is, several are gathered
            // first (a copy is cheaper than a syscall per rewritten reply).
            let sent = match segments.as_slice() {
                [] => 0,
                [one] => {
                    let b = segment(&buf, one);
                    send(&mut to, b).await.map_err(|source| ForwardError::Io {
                        side: Side::Client,
                        source,
                    })?;
                    b.len()
                }
                many => {
                    out.clear();
                    for seg in many {
                        out.extend_from_slice(segment(&buf, seg));
                    }
                    send(&mut to, &out)
                        .await
                        .map_err(|source| ForwardError::Io {
                            side: Side::Client,
                            source,
                        })?;
                    out.len()
                }
            };
            // One counter update per kind per read, not per reply.
            let mut kinds = report.kinds.iter().peekable();
            while let Some(kind) = kinds.next() {
                let mut n = 1;
                while kinds.next_if(|k| *k == kind).is_some() {
                    n += 1;
                }
                m.replies.get_or_create(&RewriteLabels { kind }).inc_by(n);
            }
            if report.refresh && report.unknown.is_empty() {
                self.refresh.notify_one();
            }
            if !report.unknown.is_empty() {
                m.unknown_addresses.inc_by(report.unknown.len() as u64);
                tracing::warn!(unknown = ?report.unknown, "reply names addresses no route knows; forwarded unchanged, refresh requested");
                self.refresh.notify_one();
            }
            bytes.inc_by(sent as u64);
            clock.touch();
        }
    }
}

/// Socket options for both legs: small requests and replies must not wait for Nagle, and
/// keepalive finds peers that vanished without a FIN before the idle timeout would (or
/// ever, with the idle timeout off).
pub(crate) fn tune(stream: &TcpStream) {
    let _ = stream.set_nodelay(true);
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(60))
        .with_interval(Duration::from_secs(10));
    let _ = socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive);
}

/// Writes all of `bytes` and flushes: a TLS stream may hold written bytes in its buffer
/// when the socket was full, and nothing else would push them out (a no-op on TCP).
async fn send<W: AsyncWrite + Unpin>(to: &mut W, bytes: &[u8]) -> std::io::Result<()> {
    to.write_all(bytes).await?;
    to.flush().await
}

fn segment<'a>(buf: &'a [u8], seg: &'a Segment) -> &'a [u8] {
    match seg {
        Segment::Input(r) => &buf[r.clone()],
        Segment::Owned(v) => v.as_slice(),
    }
}

/// Copies `from` to `to` until EOF, then half-closes `to`.
async fn pump<R, W>(
    mut from: R,
    mut to: W,
    buffer_size: usize,
    bytes: &Counter,
    clock: &Activity,
    from_side: Side,
    to_side: Side,
) -> Result<(), ForwardError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; buffer_size];
    loop {
        let n = eof_ok(from.read(&mut buf).await).map_err(|source| ForwardError::Io {
            side: from_side,
            source,
        })?;
        if n == 0 {
            // The peer may already be gone; that is not this connection's error.
            let _ = to.shutdown().await;
            return Ok(());
        }
        send(&mut to, &buf[..n])
            .await
            .map_err(|source| ForwardError::Io {
                side: to_side,
                source,
            })?;
        bytes.inc_by(n as u64);
        clock.touch();
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

/// When bytes last moved, in milliseconds since the connection started.
struct Activity {
    start: Instant,
    last_ms: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Activity {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }

    fn touch(&self) {
        let ms = self.start.elapsed().as_millis() as u64;
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }
}

/// Resolves when nothing moved for `timeout`; never if `None`.
async fn idle(clock: &Activity, timeout: Option<Duration>) {
    let Some(timeout) = timeout else {
        return std::future::pending().await;
    };
    loop {
        // A timeout too large to add to an instant means "never".
        let Some(deadline) = clock.last().checked_add(timeout) else {
            return std::future::pending().await;
        };
        tokio::time::sleep_until(deadline).await;
        if clock
            .last()
            .checked_add(timeout)
            .is_some_and(|d| d <= Instant::now())
        {
            return;
        }
    }
}
