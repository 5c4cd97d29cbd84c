//! One client connection: dial its node, then copy bytes both ways.
//!
//! Each direction has one fixed buffer and writes what it read before it reads again, so a
//! slow reader on one side stops reads on the other (back-pressure) and memory per
//! connection is bounded by two buffers. Half-closes are forwarded: a client that shuts its
//! write side still gets the replies in flight.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::metrics::{BytesLabels, KindLabels, Metrics, PortLabels, ReasonLabels};
use crate::resolve::{DialError, Resolver};
use crate::route::Route;

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

/// What every connection shares.
pub struct Forwarder {
    pub resolver: Resolver,
    pub metrics: Arc<Metrics>,
    pub connect_timeout: Duration,
    pub idle_timeout: Option<Duration>,
    pub buffer_size: usize,
    /// Cancelled when the drain timeout runs out: every connection still open then closes.
    pub hard_stop: CancellationToken,
}

impl Forwarder {
    /// Serves one accepted client connection on listener `port` with its route, taken at
    /// accept time. Counts and logs the outcome.
    pub async fn serve(&self, client: TcpStream, port: u16, route: Arc<Route>) {
        let m = &self.metrics.connections;
        m.accepted.get_or_create(&PortLabels { port }).inc();
        let active = m.active.get_or_create(&PortLabels { port }).clone();
        active.inc();
        let peer = client.peer_addr().ok();
        let outcome = self.forward(client, port, &route).await;
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
        };
        m.closed.get_or_create(&ReasonLabels { reason }).inc();
        match outcome {
            Ok(closed) => {
                tracing::debug!(port, ?peer, backend = %route.backend, ?closed, "connection closed")
            }
            Err(e @ ForwardError::Dial { .. }) => tracing::warn!(port, ?peer, "{e}"),
            Err(e) => {
                tracing::debug!(port, ?peer, backend = %route.backend, "connection ended: {e}")
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
        // Small requests and replies must not wait for Nagle.
        let _ = client.set_nodelay(true);
        let _ = backend.set_nodelay(true);

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
        let (cr, cw) = client.split();
        let (br, bw) = backend.split();
        let copy = async {
            tokio::try_join!(
                pump(
                    cr,
                    bw,
                    self.buffer_size,
                    &up,
                    &clock,
                    Side::Client,
                    Side::Backend
                ),
                pump(
                    br,
                    cw,
                    self.buffer_size,
                    &down,
                    &clock,
                    Side::Backend,
                    Side::Client
                ),
            )
        };
        tokio::select! {
            r = copy => r.map(|_| Closed::Eof),
            _ = idle(&clock, self.idle_timeout) => Ok(Closed::Idle),
            _ = self.hard_stop.cancelled() => Ok(Closed::Drained),
        }
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
        let n = from
            .read(&mut buf)
            .await
            .map_err(|source| ForwardError::Io {
                side: from_side,
                source,
            })?;
        if n == 0 {
            // The peer may already be gone; that is not this connection's error.
            let _ = to.shutdown().await;
            return Ok(());
        }
        to.write_all(&buf[..n])
            .await
            .map_err(|source| ForwardError::Io {
                side: to_side,
                source,
            })?;
        bytes.inc_by(n as u64);
        clock.touch();
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
        let deadline = clock.last() + timeout;
        tokio::time::sleep_until(deadline).await;
        if clock.last() + timeout <= Instant::now() {
            return;
        }
    }
}
