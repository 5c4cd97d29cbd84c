//! One connection on the TLS port.
//!
//! 1. Read the ClientHello ([`detect`](crate::tls::detect)) and its SNI name, under the hello
//!    timeout and byte cap, within the handshake budget (apart from the connection limit,
//!    which the connection joins once its handshake is done).
//! 2. Route the name ([`select`](crate::tls::select)). A connection that is not TLS, has no SNI
//!    or names nothing of this cluster is refused: a TLS alert where the client speaks
//!    TLS, a count in `tls_refused_total{reason}`, and no backend connection.
//! 3. Passthrough: dial the node's TLS address, send it the hello as it came, then copy
//!    bytes both ways; the TLS session is the client's and the node's.
//!    Terminate: complete the handshake with rustls (the certificate in force when it
//!    starts), dial the node (plain or TLS), and forward, with topology rewriting to the
//!    nodes' SNI names on this port when the route rewrites.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;

use super::forward::{Addresses, Closed, ForwardError, Forwarder, Side};
use super::listener::{Handshake, Refusals, MAX_CLIENTS_REPLY};
use super::tls_session::TlsSession;
use crate::dial::BackendTls;
use crate::metrics::{Metrics, ReasonLabels, TlsTargetLabels, TlsVersionLabels};
use crate::model::{Backend, Route};
use crate::source::RouteRx;
use crate::tls::certs::ServerConfigRx;
use crate::tls::detect::{detect, DetectError, DetectLimits};
use crate::tls::select::{Selected, Selector};
use crate::tls::{Alert, NotTls, PrefixedIo};

/// What the TLS port does with a routed connection.
pub enum TlsMode {
    /// Forward the TLS stream untouched to the node's TLS address.
    Passthrough,
    /// Terminate TLS here, and dial the node as the forwarder does (plain, or TLS with
    /// `--tls-backend tls`).
    Terminate { config: ServerConfigRx },
}

/// Everything the TLS port's connections share.
pub struct TlsServer {
    pub port: u16,
    pub selector: Selector,
    pub mode: TlsMode,
    pub limits: DetectLimits,
    pub forwarder: Arc<Forwarder>,
    pub routes: RouteRx,
    pub metrics: Arc<Metrics>,
    /// Shared with the listeners (see [`super::listener::refusals`]).
    pub refusals: Arc<Refusals>,
}

impl TlsServer {
    /// Serves one accepted connection, which holds `handshake` (its place in the handshake
    /// budget and in its address's) until its hello is routed (passthrough) or its handshake done (terminate),
    /// and then one of `limit`, the connection limit. Every outcome is counted and logged
    /// here.
    /// `peer` is the address accept gave; the socket has its options from the listener.
    pub async fn serve(
        self: Arc<Self>,
        mut tcp: TcpStream,
        peer: SocketAddr,
        handshake: Handshake,
        limit: Arc<Semaphore>,
    ) {
        let peer = Some(peer);
        let hello = match detect(&mut tcp, self.limits).await {
            Ok(h) => h,
            Err(e) => {
                let alert = match &e {
                    DetectError::NotTls(NotTls::Malformed(_) | NotTls::NotClientHello) => {
                        Some(Reply::Alert(Alert::DecodeError))
                    }
                    DetectError::TooLarge => Some(Reply::Alert(Alert::HandshakeFailure)),
                    // Not TLS: a TLS alert would mean nothing to it, but a RESP client
                    // shows an error line.
                    DetectError::NotTls(NotTls::NotHandshake) => Some(Reply::Resp(NOT_TLS_REPLY)),
                    // Timed out, closed or broken: nobody is listening.
                    _ => None,
                };
                let reason = e.label();
                let detail = e.detail(&self.limits);
                return self.refuse(tcp, peer, reason, alert, &detail).await;
            }
        };
        let Some(name) = hello.sni else {
            return self
                .refuse(
                    tcp,
                    peer,
                    "no_sni",
                    Some(Reply::Alert(Alert::MissingExtension)),
                    "ClientHello without SNI (this port routes by server name)",
                )
                .await;
        };
        let table = self.routes.borrow().clone();
        let selected = match self.selector.select(&table, &name) {
            Ok(s) => s,
            Err(e) => {
                let detail = e.to_string();
                return self
                    .refuse(
                        tcp,
                        peer,
                        e.label(),
                        Some(Reply::Alert(Alert::UnrecognizedName)),
                        &detail,
                    )
                    .await;
            }
        };
        self.metrics
            .tls
            .routed
            .get_or_create(&TlsTargetLabels {
                target: selected.target,
            })
            .inc();
        let first = selected.candidates[0].clone();
        match &self.mode {
            TlsMode::Passthrough => {
                drop(handshake);
                // Nothing to say past the limit: the client waits for a ServerHello only
                // the node can send.
                let Some(_permit) = self.connection_permit(&limit, peer) else {
                    return;
                };
                let backend = first.tls_backend().clone();
                let open = self.forwarder.opened(self.port);
                let outcome = self.passthrough(tcp, hello.prefix, &selected).await;
                self.forwarder.closed(open, peer, &backend, outcome);
            }
            TlsMode::Terminate { config } => {
                let shown = first.dialled(self.forwarder.backend_tls.is_some()).clone();
                // Made in a block of its own and lent to `terminate`: the stream it is made
                // from, and the session itself, are then not kept twice for the
                // connection's life (an idle TLS connection's memory is this future).
                let (session, _permit) = {
                    let acceptor = TlsAcceptor::from(config.borrow().clone());
                    let accept = acceptor.accept(PrefixedIo::new(hello.prefix, tcp));
                    let client = match tokio::time::timeout(self.limits.timeout, accept).await {
                        Ok(Ok(s)) => s,
                        Ok(Err(e)) => {
                            // rustls has sent its alert already.
                            self.metrics.tls.refuse("handshake");
                            if let Some(suppressed) = self.refusal_due("handshake", peer) {
                                tracing::info!(port = self.port, ?peer, sni = %name, suppressed, "TLS handshake failed: {e}");
                            }
                            return;
                        }
                        Err(_) => {
                            self.metrics.tls.refuse("timeout");
                            if let Some(suppressed) = self.refusal_due("timeout", peer) {
                                tracing::info!(port = self.port, ?peer, sni = %name, suppressed, "TLS handshake timed out");
                            }
                            return;
                        }
                    };
                    drop(handshake);
                    let Some(permit) = self.connection_permit(&limit, peer) else {
                        // The session is up: the client reads RESP now, so it gets Valkey's
                        // line.
                        let mut client = client;
                        let send = async {
                            client.write_all(MAX_CLIENTS_REPLY).await?;
                            client.shutdown().await
                        };
                        let _ = tokio::time::timeout(Duration::from_secs(1), send).await;
                        return;
                    };
                    let version = match client.get_ref().1.protocol_version() {
                        Some(rustls::ProtocolVersion::TLSv1_3) => "TLSv1_3",
                        Some(rustls::ProtocolVersion::TLSv1_2) => "TLSv1_2",
                        _ => "other",
                    };
                    self.metrics
                        .tls
                        .handshakes
                        .get_or_create(&TlsVersionLabels { version })
                        .inc();
                    let (io, conn) = client.into_inner();
                    let (early, tcp) = io.into_parts();
                    match TlsSession::new(tcp, conn, &early) {
                        Ok(session) => (session, permit),
                        Err(source) => {
                            let open = self.forwarder.opened(self.port);
                            let e = ForwardError::Io {
                                side: Side::Client,
                                source,
                            };
                            self.forwarder.closed(open, peer, &shown, Err(e));
                            return;
                        }
                    }
                };
                // The TLS legs' settings in force once the handshake is done.
                let backend = self
                    .forwarder
                    .backend_tls
                    .as_ref()
                    .map(|t| t.borrow().clone());
                let open = self.forwarder.opened(self.port);
                let outcome = self
                    .terminate(&session, backend.as_deref(), &selected)
                    .await;
                self.forwarder.closed(open, peer, &shown, outcome);
            }
        }
    }

    /// Whether a refusal of `peer` for `reason` is logged now: once per reason and client
    /// address per period, so that a scanner or a client misconfigured in a loop cannot
    /// flood the log, while each client's first refusal is still there to read. The
    /// metrics count every one.
    fn refusal_due(&self, reason: &'static str, peer: Option<SocketAddr>) -> Option<u64> {
        self.refusals.due(&(reason, peer.map(|p| p.ip())))
    }

    /// A permit of the connection limit, or `None` (counted and logged) at the limit.
    fn connection_permit(
        &self,
        limit: &Arc<Semaphore>,
        peer: Option<SocketAddr>,
    ) -> Option<OwnedSemaphorePermit> {
        match limit.clone().try_acquire_owned() {
            Ok(p) => Some(p),
            Err(_) => {
                self.metrics
                    .connections
                    .rejected
                    .get_or_create(&ReasonLabels {
                        reason: "connection_limit",
                    })
                    .inc();
                if let Some(suppressed) = self.refusals.due(&("connection_limit", None)) {
                    tracing::warn!(
                        port = self.port,
                        ?peer,
                        suppressed,
                        "connection limit reached; closing"
                    );
                }
                None
            }
        }
    }

    /// Refuses a connection before any backend is dialled.
    async fn refuse(
        &self,
        mut tcp: TcpStream,
        peer: Option<SocketAddr>,
        reason: &'static str,
        reply: Option<Reply>,
        detail: &str,
    ) {
        self.metrics.tls.refuse(reason);
        if let Some(suppressed) = self.refusal_due(reason, peer) {
            tracing::info!(
                port = self.port,
                ?peer,
                reason,
                suppressed,
                "TLS port refused a connection: {detail}"
            );
        }
        if let Some(reply) = reply {
            let send = async {
                match reply {
                    Reply::Alert(a) => tcp.write_all(&a.record()).await?,
                    Reply::Resp(line) => tcp.write_all(line).await?,
                }
                tcp.shutdown().await
            };
            let _ = tokio::time::timeout(Duration::from_secs(1), send).await;
        }
    }

    /// Dials the candidates in turn at `addr(route)`; the first that answers wins.
    async fn dial(
        &self,
        selected: &Selected,
        addr: impl Fn(&Route) -> &Backend,
    ) -> Result<(TcpStream, Arc<Route>), ForwardError> {
        self.forwarder
            .dialer
            .first(&selected.candidates, &addr)
            .await
            .map_err(|source| ForwardError::Dial {
                backend: selected
                    .candidates
                    .first()
                    .map_or_else(|| "(none)".into(), |r| addr(r).to_string()),
                source,
            })
    }

    async fn passthrough(
        &self,
        mut client: TcpStream,
        hello: BytesMut,
        selected: &Selected,
    ) -> Result<Closed, ForwardError> {
        let (mut backend, _) = self.dial(selected, Route::tls_backend).await?;
        backend
            .write_all(&hello)
            .await
            .map_err(|source| ForwardError::Io {
                side: Side::Backend,
                source,
            })?;
        let (cr, cw) = client.split();
        let (br, bw) = backend.split();
        self.forwarder.relay(self.port, None, cr, cw, br, bw).await
    }

    /// The client's `session`, forwarded to the selected node.
    async fn terminate(
        &self,
        session: &TlsSession,
        backend_tls: Option<&BackendTls>,
        selected: &Selected,
    ) -> Result<Closed, ForwardError> {
        let (cr, cw) = session.split();
        match backend_tls {
            None => {
                let (mut backend, route) = self.dial(selected, |r| &r.backend).await?;
                let rewrite = route.rewrite.then_some(Addresses::Sni);
                let (br, bw) = backend.split();
                self.forwarder
                    .relay(self.port, rewrite, cr, cw, br, bw)
                    .await
            }
            Some(tls) => {
                let (tcp, route) = self.dial(selected, Route::tls_backend).await?;
                let at = route.tls_backend();
                let dialer = &self.forwarder.dialer;
                let dial_error = |source| ForwardError::Dial {
                    backend: at.to_string(),
                    source,
                };
                let name = tls.name_for(route.node, at).map_err(dial_error)?;
                let backend = dialer.tls(tcp, tls, name, at).await.map_err(dial_error)?;
                let (tcp, conn) = backend.into_inner();
                let backend =
                    TlsSession::new(tcp, conn, &[]).map_err(|source| ForwardError::Io {
                        side: Side::Backend,
                        source,
                    })?;
                let rewrite = route.rewrite.then_some(Addresses::Sni);
                let (br, bw) = backend.split();
                self.forwarder
                    .relay(self.port, rewrite, cr, cw, br, bw)
                    .await
            }
        }
    }
}

/// What a refused client is told.
enum Reply {
    Alert(Alert),
    Resp(&'static [u8]),
}

/// The error line a client that speaks RESP in plain text gets.
const NOT_TLS_REPLY: &[u8] =
    b"-ERR this port speaks TLS only: connect with TLS and a server name (SNI)\r\n";
