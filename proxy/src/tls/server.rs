//! One connection on the TLS port.
//!
//! 1. Read the ClientHello ([`detect`](super::detect)) and its SNI name, under the hello
//!    timeout and byte cap.
//! 2. Route the name ([`select`](super::select)). A connection that is not TLS, has no SNI
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
use rustls_pki_types::ServerName as TlsName;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;

use super::backend::BackendTls;
use super::certs::ServerConfigRx;
use super::detect::{detect, DetectError, DetectLimits};
use super::select::{Selected, Selector};
use super::{Alert, NotTls, PrefixedIo};
use crate::forward::{Addresses, Closed, ForwardError, Forwarder};
use crate::metrics::{Metrics, TlsTargetLabels, TlsVersionLabels};
use crate::resolve::DialError;
use crate::route::{Backend, Route, RouteRx};

/// What the TLS port does with a routed connection.
pub enum TlsMode {
    /// Forward the TLS stream untouched to the node's TLS address.
    Passthrough,
    /// Terminate TLS here; `backend`: `None` for a plain backend leg.
    Terminate {
        config: ServerConfigRx,
        backend: Option<BackendTls>,
    },
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
}

impl TlsServer {
    /// Serves one accepted connection. Every outcome is counted and logged here.
    pub async fn serve(&self, mut tcp: TcpStream) {
        let peer = tcp.peer_addr().ok();
        crate::forward::tune(&tcp);
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
                let reason = match &e {
                    DetectError::NotTls(n) => label_of(n),
                    DetectError::Timeout => "timeout",
                    DetectError::TooLarge => "too_large",
                    DetectError::Closed => "closed",
                    DetectError::Io(_) => "io",
                };
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
                let backend = first.tls_backend().clone();
                let conn = self.passthrough(tcp, hello.prefix, &selected);
                self.forwarder
                    .account(self.port, peer, &backend, conn)
                    .await;
            }
            TlsMode::Terminate { config, backend } => {
                let acceptor = TlsAcceptor::from(config.borrow().clone());
                let accept = acceptor.accept(PrefixedIo::new(hello.prefix, tcp));
                let client = match tokio::time::timeout(self.limits.timeout, accept).await {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        // rustls has sent its alert already.
                        self.metrics.tls.refuse("handshake");
                        tracing::info!(port = self.port, ?peer, sni = %name, "TLS handshake failed: {e}");
                        return;
                    }
                    Err(_) => {
                        self.metrics.tls.refuse("timeout");
                        tracing::info!(port = self.port, ?peer, sni = %name, "TLS handshake timed out");
                        return;
                    }
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
                let shown = match backend {
                    Some(_) => first.tls_backend().clone(),
                    None => first.backend.clone(),
                };
                let conn = self.terminate(client, backend.as_ref(), &selected);
                self.forwarder.account(self.port, peer, &shown, conn).await;
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
        tracing::info!(
            port = self.port,
            ?peer,
            reason,
            "TLS port refused a connection: {detail}"
        );
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

    /// Dials the candidates in turn; the first that answers wins.
    async fn dial(
        &self,
        selected: &Selected,
        addr: impl Fn(&Route) -> &Backend,
    ) -> Result<(TcpStream, Arc<Route>), ForwardError> {
        let f = &self.forwarder;
        let mut last = None;
        for route in &selected.candidates {
            let backend = addr(route);
            match f.resolver.dial(backend, f.connect_timeout).await {
                Ok(s) => {
                    crate::forward::tune(&s);
                    return Ok((s, route.clone()));
                }
                Err(source) => {
                    if selected.candidates.len() > 1 {
                        tracing::debug!(%backend, "bootstrap candidate unreachable: {source}");
                    }
                    last = Some(ForwardError::Dial {
                        backend: backend.to_string(),
                        source,
                    });
                }
            }
        }
        Err(last.unwrap_or_else(|| ForwardError::Dial {
            backend: "(none)".into(),
            source: DialError::NoAddress {
                name: "(no candidate)".into(),
            },
        }))
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
                side: crate::forward::Side::Backend,
                source,
            })?;
        let (cr, cw) = client.split();
        let (br, bw) = backend.split();
        self.forwarder.relay(self.port, None, cr, cw, br, bw).await
    }

    async fn terminate(
        &self,
        client: tokio_rustls::server::TlsStream<PrefixedIo<TcpStream>>,
        backend_tls: Option<&BackendTls>,
        selected: &Selected,
    ) -> Result<Closed, ForwardError> {
        let (cr, cw) = tokio::io::split(client);
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
                let name = match &tls.server_name {
                    Some(n) => n.clone(),
                    None => {
                        let names = self.selector.names();
                        let host =
                            shardgate_crds::node_hostname(&names.prefix, route.node, &names.domain);
                        TlsName::try_from(host).map_err(|e| ForwardError::Dial {
                            backend: route.tls_backend().to_string(),
                            source: DialError::Tls {
                                backend: route.tls_backend().to_string(),
                                name: "(invalid)".into(),
                                source: std::io::Error::other(e.to_string()),
                            },
                        })?
                    }
                };
                let shown = name.to_str().into_owned();
                let connect = tls.connector.connect(name, tcp);
                let f = &self.forwarder;
                let backend = match tokio::time::timeout(f.connect_timeout, connect).await {
                    Ok(Ok(s)) => s,
                    Ok(Err(source)) => {
                        return Err(ForwardError::Dial {
                            backend: route.tls_backend().to_string(),
                            source: DialError::Tls {
                                backend: route.tls_backend().to_string(),
                                name: shown,
                                source,
                            },
                        })
                    }
                    Err(_) => {
                        return Err(ForwardError::Dial {
                            backend: route.tls_backend().to_string(),
                            source: DialError::Timeout {
                                backend: route.tls_backend().to_string(),
                                after: f.connect_timeout,
                            },
                        })
                    }
                };
                let rewrite = route.rewrite.then_some(Addresses::Sni);
                let (br, bw) = tokio::io::split(backend);
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

fn label_of(n: &NotTls) -> &'static str {
    match n {
        NotTls::NotHandshake => "not_tls",
        NotTls::NotClientHello => "not_client_hello",
        NotTls::Malformed(_) => "malformed",
    }
}
