//! Dialling nodes: the one way every path (node ports, the TLS port, discovery) reaches a
//! backend.
//!
//! - [`resolve`]: backends by DNS name, resolved at connect time (TTLs honoured).
//! - [`tls`]: the TLS client of a TLS port's backend leg (`--tls-backend tls`).
//! - here: [`Dialer`] (resolve, connect under one timeout, socket options; then TLS if
//!   asked) and [`DialError`] with its metric label.

pub mod resolve;
pub mod tls;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

pub use resolve::Resolver;
pub use tls::{BackendTls, BackendTlsConfig};

use crate::model::{Backend, Route};

/// Why a backend could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    #[error("cannot resolve {name}: {message}")]
    Resolve { name: String, message: String },
    #[error("{name} resolves to no address")]
    NoAddress { name: String },
    #[error("connect to {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("connect to {backend}: timed out after {after:?}")]
    Timeout { backend: String, after: Duration },
    #[error("TLS handshake with {backend} as {name:?}: {source}")]
    Tls {
        backend: String,
        name: String,
        source: std::io::Error,
    },
}

impl DialError {
    /// A metric label.
    pub fn label(&self) -> &'static str {
        match self {
            DialError::Resolve { .. } | DialError::NoAddress { .. } => "resolve",
            DialError::Connect { .. } => "connect",
            DialError::Timeout { .. } => "timeout",
            DialError::Tls { .. } => "tls",
        }
    }
}

/// Resolves, connects and tunes connections to nodes. Cheap to clone.
#[derive(Clone)]
pub struct Dialer {
    pub resolver: Resolver,
    /// Resolving and connecting, in all; the TLS handshake gets as long again.
    pub connect_timeout: Duration,
}

impl Dialer {
    pub fn new(resolver: Resolver, connect_timeout: Duration) -> Self {
        Dialer {
            resolver,
            connect_timeout,
        }
    }

    /// A tuned TCP connection to `backend`.
    pub async fn tcp(&self, backend: &Backend) -> Result<TcpStream, DialError> {
        let stream = self.resolver.dial(backend, self.connect_timeout).await?;
        tune(&stream);
        Ok(stream)
    }

    /// Dials `candidates` in turn at `addr(route)`; the first that answers wins.
    pub async fn first(
        &self,
        candidates: &[Arc<Route>],
        addr: impl Fn(&Route) -> &Backend,
    ) -> Result<(TcpStream, Arc<Route>), DialError> {
        let mut last = None;
        for route in candidates {
            let backend = addr(route);
            match self.tcp(backend).await {
                Ok(s) => return Ok((s, route.clone())),
                Err(e) => {
                    if candidates.len() > 1 {
                        tracing::debug!(%backend, "candidate unreachable: {e}");
                    }
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| DialError::NoAddress {
            name: "(no candidate)".into(),
        }))
    }

    /// TLS over `tcp` to `backend`, checking the certificate for `name`, within the
    /// connect timeout.
    pub async fn tls(
        &self,
        tcp: TcpStream,
        tls: &BackendTls,
        name: ServerName<'static>,
        backend: &Backend,
    ) -> Result<TlsStream<TcpStream>, DialError> {
        let shown = name.to_str().into_owned();
        match tokio::time::timeout(self.connect_timeout, tls.connector.connect(name, tcp)).await {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(source)) => Err(DialError::Tls {
                backend: backend.to_string(),
                name: shown,
                source,
            }),
            Err(_) => Err(DialError::Timeout {
                backend: backend.to_string(),
                after: self.connect_timeout,
            }),
        }
    }
}

/// Socket options for both legs: small requests and replies must not wait for Nagle, and
/// keepalive finds peers that vanished without a FIN before the idle timeout would (or
/// ever, with the idle timeout off).
pub fn tune(stream: &TcpStream) {
    tune_socket(socket2::SockRef::from(stream));
}

/// A listener on `addr` with [`tune`]'s options, set before it listens: Linux copies them
/// to every socket it accepts, which then needs no setsockopt of its own (four system calls
/// fewer per client connection), and no connection is accepted without them.
pub fn listen(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    // As tokio's own bind: a restarted proxy takes its ports back at once.
    socket.set_reuse_address(true)?;
    tune_socket(socket2::SockRef::from(&socket));
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    // tokio's backlog.
    socket.listen(1024)?;
    tokio::net::TcpListener::from_std(socket.into())
}

fn tune_socket(socket: socket2::SockRef<'_>) {
    let _ = socket.set_tcp_nodelay(true);
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(60))
        .with_interval(Duration::from_secs(10));
    let _ = socket.set_tcp_keepalive(&keepalive);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `listen` relies on: a socket accepted from a tuned listener has the options
    /// without a setsockopt of its own.
    #[tokio::test]
    async fn accepted_sockets_inherit_the_listeners_options() {
        let listener = listen("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let _client = TcpStream::connect(addr).await.unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        let s = socket2::SockRef::from(&accepted);
        assert!(s.tcp_nodelay().unwrap());
        assert!(s.keepalive().unwrap());
        assert_eq!(s.tcp_keepalive_time().unwrap(), Duration::from_secs(60));
        assert_eq!(s.tcp_keepalive_interval().unwrap(), Duration::from_secs(10));
    }
}
