//! Dialling nodes: the one way every path (node ports, the TLS port, discovery) reaches a
//! backend.
//!
//! - [`resolve`]: backends by DNS name, resolved at connect time (TTLs honoured).
//! - [`tls`]: the TLS client of the legs to nodes that speak TLS (`--tls-backend tls`).
//! - here: [`Dialer`] (resolve, connect under one timeout; then TLS if asked),
//!   [`connect`] and [`listen`] with the sockets' options, and [`DialError`] with its metric
//!   label.

pub mod resolve;
pub mod tls;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

pub use resolve::Resolver;
pub use tls::{BackendTls, BackendTlsConfig, BackendTlsRx};

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

    /// A TCP connection to `backend`, TCP_NODELAY set (see [`connect`]).
    pub async fn tcp(&self, backend: &Backend) -> Result<TcpStream, DialError> {
        self.resolver.dial(backend, self.connect_timeout).await
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
        // The TLS session's reader does not set keepalive once due (`conn::keepalive`): now.
        keep_alive(socket2::SockRef::from(&tcp));
        match tokio::time::timeout(self.connect_timeout, tls.connector().connect(name, tcp)).await {
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

/// A connection to `addr` with TCP_NODELAY, set before the connect. Keepalive is left to
/// its user: a plain node connection gets it once it has lasted a second
/// (`conn::keepalive`), a TLS one when its handshake starts ([`Dialer::tls`]).
///
/// On loopback, and often on a fast network, the handshake is done by the time the
/// non-blocking `connect` returns. That is checked at once (`getpeername`, which takes the
/// place of tokio's `SO_ERROR` read, so the same number of system calls), and such a
/// connection goes on without waiting for the event loop to report it writable: one
/// wake-up fewer per backend connection. Otherwise it waits for writability, as tokio's own
/// connect does, and then reads both the error and the peer address (one system call more
/// than tokio's).
pub async fn connect(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = nonblocking_socket(addr)?;
    no_delay(socket2::SockRef::from(&socket));
    match socket.connect(&addr.into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    let connected = socket.peer_addr().is_ok();
    let stream = TcpStream::from_std(socket.into())?;
    if !connected {
        established(&stream).await?;
    }
    Ok(stream)
}

/// A non-blocking TCP socket for `addr`'s family: made so in the `socket` call itself on
/// Linux, with a separate `fcntl` elsewhere.
fn nonblocking_socket(addr: SocketAddr) -> std::io::Result<socket2::Socket> {
    let domain = socket2::Domain::for_address(addr);
    let tcp = Some(socket2::Protocol::TCP);
    #[cfg(target_os = "linux")]
    let socket = socket2::Socket::new(domain, socket2::Type::STREAM.nonblocking(), tcp)?;
    #[cfg(not(target_os = "linux"))]
    let socket = {
        let s = socket2::Socket::new(domain, socket2::Type::STREAM, tcp)?;
        s.set_nonblocking(true)?;
        s
    };
    Ok(socket)
}

/// Waits until `stream`'s connect has ended: `Ok` once it is established, its error if it
/// failed. Writability is only a hint (mio's advice): a connect is done when the peer
/// address can be read.
async fn established(stream: &TcpStream) -> std::io::Result<()> {
    loop {
        stream.writable().await?;
        if let Some(e) = stream.take_error()? {
            return Err(e);
        }
        match stream.peer_addr() {
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotConnected => {
                // Not yet: forget the readiness seen, and wait for the next.
                let _ = stream.try_io(tokio::io::Interest::WRITABLE, || {
                    Err::<(), _>(std::io::ErrorKind::WouldBlock.into())
                });
            }
            Err(e) => return Err(e),
        }
    }
}

/// A listener on `addr` with the client leg's options (TCP_NODELAY and keepalive), set
/// before it listens: Linux copies them to every socket it accepts, which then needs no
/// setsockopt of its own (four system calls fewer per client connection), and no
/// connection is accepted without them.
pub fn listen(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    // As tokio's own bind: a restarted proxy takes its ports back at once.
    socket.set_reuse_address(true)?;
    no_delay(socket2::SockRef::from(&socket));
    keep_alive(socket2::SockRef::from(&socket));
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    // tokio's backlog.
    socket.listen(1024)?;
    tokio::net::TcpListener::from_std(socket.into())
}

/// Small requests and replies must not wait for Nagle: on both legs, from the start.
fn no_delay(socket: socket2::SockRef<'_>) {
    let _ = socket.set_tcp_nodelay(true);
}

/// TCP keepalive, 60 s then every 10 s: it finds peers that vanished without a FIN before
/// the idle timeout would (or ever, with the idle timeout off). Three system calls; a node
/// connection gets it late (`conn::keepalive`).
pub fn keep_alive(socket: socket2::SockRef<'_>) {
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(60))
        .with_interval(Duration::from_secs(10));
    let _ = socket.set_tcp_keepalive(&keepalive);
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// What `listen` relies on: a socket accepted from a tuned listener has the options
    /// without a setsockopt of its own.
    #[tokio::test]
    async fn accepted_sockets_inherit_the_listeners_options() {
        let listener = listen("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let _client = TcpStream::connect(addr).await.unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        assert_tuned(&accepted);
    }

    /// The options of both legs: TCP_NODELAY, keepalive after 60 s, then every 10 s.
    fn assert_tuned(stream: &TcpStream) {
        let s = socket2::SockRef::from(stream);
        assert!(s.tcp_nodelay().unwrap());
        assert!(s.keepalive().unwrap());
        assert_eq!(s.tcp_keepalive_time().unwrap(), Duration::from_secs(60));
        assert_eq!(s.tcp_keepalive_interval().unwrap(), Duration::from_secs(10));
    }

    /// `connect`'s own option, and its fast path: on loopback the handshake is done when
    /// the connect call returns. Keepalive is not set (its user sets it, late or at the
    /// TLS handshake); `keep_alive` sets the listener's.
    #[tokio::test]
    async fn connect_sets_no_delay_and_leaves_keepalive_to_its_user() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stream = connect(addr).await.unwrap();
        assert_eq!(stream.peer_addr().unwrap(), addr);
        let s = socket2::SockRef::from(&stream);
        assert!(s.tcp_nodelay().unwrap());
        assert!(!s.keepalive().unwrap());
        keep_alive(socket2::SockRef::from(&stream));
        assert_tuned(&stream);
    }

    /// The slow path: a listener whose accept queue is full drops the SYN, so the connect
    /// is still under way when the call returns; it ends established once the queue has
    /// room and the SYN is sent again (about a second later).
    #[tokio::test]
    async fn a_connect_under_way_ends_established() {
        let socket =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        socket
            .bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
            .unwrap();
        // Backlog 0: one connection fills the queue.
        socket.listen(0).unwrap();
        let addr = socket.local_addr().unwrap().as_socket().unwrap();
        let _first = std::net::TcpStream::connect(addr).unwrap();
        let pending = tokio::spawn(connect(addr));
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(
            !pending.is_finished(),
            "the SYN was dropped, so the connect cannot be done"
        );
        let (_accepted, _) = socket.accept().unwrap();
        let stream = tokio::time::timeout(Duration::from_secs(30), pending)
            .await
            .expect("connected once the queue had room")
            .unwrap()
            .unwrap();
        assert_eq!(stream.peer_addr().unwrap(), addr);
    }

    /// A port nobody listens on: refused, as an error (not a stream that fails later).
    #[tokio::test]
    async fn a_refused_connect_is_an_error() {
        let addr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let e = connect(addr).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
    }
}
