//! A TLS session driven by the copy loop itself once its handshake is done: a client's on
//! the TLS port (terminated here), or the proxy's own to a node (`--tls-backend tls`).
//!
//! tokio-rustls's stream, split in two by `tokio::io::split`, costs each request a trip
//! through three layers: the split's lock, the stream's `AsyncRead` (which fills rustls
//! through tokio's `poll_read` and hands its plaintext back through `AsyncBufRead`), and
//! its `AsyncWrite`, each with its own readiness checks. Here the two halves share the
//! socket and the rustls session (under one uncontended lock: both directions run in the
//! connection's one task), rustls reads the socket with the plain path's system call
//! ([`read_now`]), and writes go straight out as the plain path's do. The reader also waits
//! without a buffer, as a plain socket's does: the plaintext is copied into one only once
//! rustls has decrypted some.
//!
//! What the stream did, this keeps: a TCP end without close_notify reads as
//! `UnexpectedEof` (an end of stream to the copy loop), a record that fails to decrypt is an
//! `InvalidData` error after rustls's alert is sent, and shutdown sends close_notify
//! before the TCP FIN. A peer's KeyUpdate that asks for one back is answered as rustls
//! answers it under any driver: its answer waits for our next write, which it precedes
//! (RFC 8446, 4.6.3: "prior to sending its next Application Data record").
//!
//! Writes go out as the plain path's do (`forward::send`): straight while the socket takes
//! them, through tokio's readiness once it did not, so that a slow reader costs a failing
//! system call when it falls behind, not two per write.

use std::future::Future;
use std::io::{self, BufRead, Read, Write};
use std::net::Shutdown;
use std::pin::Pin;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};

use rustls::Connection;
use tokio::io::{AsyncWrite, Interest};
use tokio::net::TcpStream;

use super::buffers::{read_now, Buffer, Source};
use super::keepalive::LateKeepalive;
use super::sink::Sink;

/// A TCP socket and the rustls session on it, handshake done: a client's on the TLS port,
/// or the proxy's own to a node (`--tls-backend tls`).
pub struct TlsSession {
    tcp: TcpStream,
    state: Mutex<State>,
}

/// The rustls session and how its records go to the socket.
struct State {
    conn: Connection,
    /// Whether the next write goes straight to the socket: true until a write finds the
    /// socket full, and again after a push that did not wait (`poll_push`).
    straight: bool,
    /// Whether the push under way has waited for the socket.
    waited: bool,
}

impl TlsSession {
    /// The session on `tcp`; `early` is what was read from the socket for the handshake
    /// and not yet given to rustls (nothing, in practice: the hello is read whole, and a
    /// client sends nothing more before the server's handshake, so it cannot hold the 16 KiB
    /// of plaintext past which rustls's `read_tls` would refuse it).
    pub fn new(tcp: TcpStream, conn: impl Into<Connection>, mut early: &[u8]) -> io::Result<Self> {
        let mut conn = conn.into();
        while !early.is_empty() {
            // rustls takes nothing once the peer's close_notify is in: the reader reports
            // that end, and what came after it is dropped.
            if conn.read_tls(&mut early)? == 0 {
                break;
            }
            conn.process_new_packets()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        }
        let session = TlsSession {
            tcp,
            state: Mutex::new(State {
                conn,
                straight: true,
                waited: false,
            }),
        };
        // The handshake's last records (session tickets) if the socket was full then.
        push(&mut session.lock(), &session.tcp)?;
        Ok(session)
    }

    /// The read and write halves, for the two directions of the copy loop.
    pub fn split(&self) -> (TlsReader<'_>, TlsWriter<'_>) {
        (
            TlsReader { session: self },
            TlsWriter {
                session: self,
                closing: false,
            },
        )
    }

    /// The session. Both halves are polled by the connection's one task, so the lock is
    /// never contended (each with a waker of its own, though: the reader never waits for
    /// the socket to be writable, which would take the writer's waker's place); a panic
    /// while it was held (none is expected from rustls) leaves the session as it was, which
    /// the next read or write reports on.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One direction's source: the session's plaintext.
pub struct TlsReader<'a> {
    session: &'a TlsSession,
}

/// The other direction's sink: encrypted into the session, written to its socket.
pub struct TlsWriter<'a> {
    session: &'a TlsSession,
    /// close_notify queued (shutdown began).
    closing: bool,
}

/// The socket as rustls reads it: the plain path's read, which clears tokio's readiness
/// when it finds the socket drained.
struct SocketRead<'a>(&'a TcpStream);

impl Read for SocketRead<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        read_now(self.0, buf)
    }
}

/// The socket as rustls writes it. `Straight`: the system call alone, as the plain path's
/// first write to a socket goes (`Sink::write_now`); tokio's readiness is not asked, nor
/// cleared by a `WouldBlock`. `Waiting`: through that readiness, so that a `WouldBlock`
/// clears it and the wait that follows is real.
enum SocketWrite<'a> {
    Straight(&'a TcpStream),
    Waiting(&'a TcpStream),
}

impl Write for SocketWrite<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match *self {
            SocketWrite::Straight(tcp) => super::sink::send(tcp, buf),
            SocketWrite::Waiting(tcp) => {
                tcp.try_io(Interest::WRITABLE, || super::sink::send(tcp, buf))
            }
        }
    }

    /// rustls's queued records, one slice each, in one system call; one record (a small
    /// reply's) goes by `send`, which the kernel takes with less set-up than `sendmsg`.
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        if let [one] = bufs {
            return self.write(one);
        }
        match *self {
            SocketWrite::Straight(tcp) => super::sink::send_vectored(tcp, bufs),
            SocketWrite::Waiting(tcp) => {
                tcp.try_io(Interest::WRITABLE, || super::sink::send_vectored(tcp, bufs))
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Writes what rustls has queued until it is all out or the socket is full (`Ok`), without
/// waiting: straight, or through tokio's readiness while the socket is known to fill (a
/// `WouldBlock` there clears it, so the wait that follows tries no write first).
fn push(state: &mut State, tcp: &TcpStream) -> io::Result<()> {
    while state.conn.wants_write() {
        let mut socket = if state.straight {
            SocketWrite::Straight(tcp)
        } else {
            SocketWrite::Waiting(tcp)
        };
        match state.conn.write_tls(&mut socket) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                state.straight = false;
                return Ok(());
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes what rustls has queued, waiting for the socket as it fills (a flush, a write whose
/// queue is full, shutdown). Writes go straight again once one such push is done without
/// waiting.
fn poll_push(state: &mut State, tcp: &TcpStream, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
    while state.conn.wants_write() {
        match state.conn.write_tls(&mut SocketWrite::Waiting(tcp)) {
            Ok(0) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => match tcp.poll_write_ready(cx) {
                // An event came since the write: try again.
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    state.straight = false;
                    state.waited = true;
                    return Poll::Pending;
                }
            },
            Err(e) => return Poll::Ready(Err(e)),
        }
    }
    state.straight = !std::mem::take(&mut state.waited);
    Poll::Ready(Ok(()))
}

/// What the session has decrypted for the reader: `Some(true)` plaintext, `Some(false)` the
/// end of the stream (close_notify), `None` nothing yet; an error for a TCP end without
/// close_notify (`UnexpectedEof`).
fn readable(conn: &mut Connection) -> io::Result<Option<bool>> {
    match conn.reader().fill_buf() {
        Ok(chunk) => Ok(Some(!chunk.is_empty())),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
        Err(e) => Err(e),
    }
}

/// Socket reads one poll of the reader makes before it yields when they bring no plaintext.
const MAX_TURNS_WITHOUT_PLAINTEXT: u32 = 32;

impl Source for TlsReader<'_> {
    fn read_into<'a>(
        &'a mut self,
        slot: &'a mut Option<Buffer>,
        size: usize,
        _: Option<&'a LateKeepalive>,
    ) -> impl Future<Output = io::Result<usize>> + Send + 'a {
        let session = self.session;
        std::future::poll_fn(move |cx| {
            // The coop budget, as the plain source's readiness check spends it (`try_io`
            // spends none). A sender whose records keep the socket full (empty records,
            // say) is bounded by the turns below: the budget is spent once per poll.
            let coop = std::task::ready!(tokio::task::coop::poll_proceed(cx));
            let tcp = &session.tcp;
            let mut state = session.lock();
            let mut turns = 0u32;
            loop {
                match readable(&mut state.conn)? {
                    Some(true) => {
                        coop.made_progress();
                        let buf = slot.get_or_insert_with(|| Buffer::take(size));
                        return Poll::Ready(state.conn.reader().read(buf));
                    }
                    Some(false) => return Poll::Ready(Ok(0)),
                    None => {}
                }
                // Records that bring no plaintext: give the worker back now and then.
                turns += 1;
                if turns > MAX_TURNS_WITHOUT_PLAINTEXT {
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                match state.conn.read_tls(&mut SocketRead(tcp)) {
                    // A TCP end: the next turn reports it, as close_notify or not.
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        match tcp.poll_read_ready(cx) {
                            Poll::Ready(Ok(())) => continue,
                            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                            Poll::Pending => return Poll::Pending,
                        }
                    }
                    Err(e) => return Poll::Ready(Err(e)),
                }
                if let Err(e) = state.conn.process_new_packets() {
                    // rustls has queued its alert: the client learns why, if it still reads.
                    let _ = push(&mut state, tcp);
                    return Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, e)));
                }
                // What rustls answers at once (a TLS 1.2 peer's renegotiation is refused
                // with a warning, say): out now if the socket takes it, else with the
                // writer's next flush. Nothing is queued, mostly, and this costs a check;
                // a socket that fails this write fails the writer's too, which reports it.
                let _ = push(&mut state, tcp);
            }
        })
    }
}

impl TlsWriter<'_> {
    fn poll_write_inner(
        &mut self,
        cx: Option<&mut Context<'_>>,
        bytes: &[u8],
    ) -> Poll<io::Result<usize>> {
        let tcp = &self.session.tcp;
        let mut state = self.session.lock();
        let mut cx = cx;
        loop {
            // rustls encrypts what it takes at once (up to its buffer limit of queued
            // records), then as much as the socket takes goes out.
            let n = state.conn.writer().write(bytes)?;
            if n > 0 {
                push(&mut state, tcp)?;
                return Poll::Ready(Ok(n));
            }
            // Its queue is full: wait for the socket to take some.
            let Some(cx) = cx.as_deref_mut() else {
                return Poll::Ready(Err(io::ErrorKind::WouldBlock.into()));
            };
            match poll_push(&mut state, tcp, cx) {
                Poll::Ready(Ok(())) => {}
                other => return other.map(|r| r.map(|()| 0)),
            }
        }
    }
}

impl AsyncWrite for TlsWriter<'_> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bytes: &[u8],
    ) -> Poll<io::Result<usize>> {
        if bytes.is_empty() {
            return Poll::Ready(Ok(0));
        }
        self.get_mut().poll_write_inner(Some(cx), bytes)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let tcp = &self.session.tcp;
        poll_push(&mut self.session.lock(), tcp, cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let tcp = &this.session.tcp;
        {
            let mut state = this.session.lock();
            if !this.closing {
                state.conn.send_close_notify();
                this.closing = true;
            }
            std::task::ready!(poll_push(&mut state, tcp, cx))?;
        }
        match socket2::SockRef::from(tcp).shutdown(Shutdown::Write) {
            Err(e) if e.kind() != io::ErrorKind::NotConnected => Poll::Ready(Err(e)),
            _ => Poll::Ready(Ok(())),
        }
    }
}

impl Sink for TlsWriter<'_> {
    /// close_notify first.
    const CLOSE_ENDS_STREAM: bool = false;

    /// Encrypts what rustls takes and writes what the socket takes, without a trip through
    /// the runtime; what the socket did not take goes with the flush that follows.
    fn write_now(&mut self, bytes: &[u8]) -> io::Result<usize> {
        match self.poll_write_inner(None, bytes) {
            Poll::Ready(Ok(0)) => Err(io::ErrorKind::WouldBlock.into()),
            Poll::Ready(r) => r,
            Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Wake, Waker};
    use std::time::Duration;

    use anyhow::Context as _;
    use rustls::crypto::cipher::{OutboundChunks, OutboundPlainMessage};
    use rustls::{ClientConfig, ContentType, ProtocolVersion};
    use shardgate_harness::tls::TestPki;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio_rustls::client::TlsStream;
    use tokio_rustls::{TlsAcceptor, TlsConnector};

    use super::*;
    use crate::config::CertFiles;
    use crate::tls::certs::Reloadable;

    const SIZE: usize = 16 * 1024;

    /// Runs a test's body with a bound: a session that stops moving fails the test, not
    /// the whole run.
    async fn bounded(body: impl Future<Output = anyhow::Result<()>>) -> anyhow::Result<()> {
        tokio::time::timeout(Duration::from_secs(60), body)
            .await
            .map_err(|_| anyhow::anyhow!("the test did not end within 60 s"))?
    }

    /// Both ends of a TLS session over loopback TCP, each a tokio-rustls stream, handshake
    /// done (the server holds a wildcard certificate of the test PKI, which lives as long as
    /// the test holds it). `client` is the client's configuration (the PKI's by default).
    async fn handshaken_with(
        client: impl FnOnce(&TestPki) -> Arc<ClientConfig>,
    ) -> anyhow::Result<(
        TestPki,
        TlsStream<TcpStream>,
        tokio_rustls::server::TlsStream<TcpStream>,
    )> {
        let pki = TestPki::new("example.test")?;
        let cert = pki.wildcard("server")?;
        let files = CertFiles {
            cert: cert.cert.clone(),
            key: cert.key.clone(),
            client_ca: None,
        };
        let (config, _) = files.load()?;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let at = listener.local_addr()?;
        let connector = TlsConnector::from(client(&pki));
        let name = rustls_pki_types::ServerName::try_from("vc-0-0.example.test")?;
        let client = async {
            let tcp = TcpStream::connect(at).await?;
            anyhow::Ok(connector.connect(name, tcp).await?)
        };
        let server = async {
            let (tcp, _) = listener.accept().await?;
            anyhow::Ok(TlsAcceptor::from(Arc::new(config)).accept(tcp).await?)
        };
        let (client, server) = tokio::try_join!(client, server)?;
        Ok((pki, client, server))
    }

    async fn handshaken() -> anyhow::Result<(
        TestPki,
        TlsStream<TcpStream>,
        tokio_rustls::server::TlsStream<TcpStream>,
    )> {
        handshaken_with(|pki| pki.client_config(None)).await
    }

    /// A rustls client and the server side of its session as the TLS port drives it.
    async fn pair() -> anyhow::Result<(TestPki, TlsStream<TcpStream>, TlsSession)> {
        let (pki, client, server) = handshaken().await?;
        let (tcp, conn) = server.into_inner();
        Ok((pki, client, TlsSession::new(tcp, conn, &[])?))
    }

    /// The other way round: a rustls server (a node) and the proxy's session to it.
    async fn to_a_node() -> anyhow::Result<(
        TestPki,
        tokio_rustls::server::TlsStream<TcpStream>,
        TlsSession,
    )> {
        let (pki, client, server) = handshaken().await?;
        let (tcp, conn) = client.into_inner();
        Ok((pki, server, TlsSession::new(tcp, conn, &[])?))
    }

    /// One read of the session's plaintext, as the copy loop reads it.
    async fn read(reader: &mut TlsReader<'_>, slot: &mut Option<Buffer>) -> io::Result<Vec<u8>> {
        let n = reader.read_into(slot, SIZE, None).await?;
        Ok(slot.as_deref().map_or_else(Vec::new, |b| b[..n].to_vec()))
    }

    /// Every read until the end of the stream, each into a buffer of its own as the copy
    /// loop gives back its buffer after each.
    async fn read_to_end(reader: &mut TlsReader<'_>) -> io::Result<Vec<u8>> {
        let mut all = Vec::new();
        loop {
            let bytes = read(reader, &mut None).await?;
            if bytes.is_empty() {
                return Ok(all);
            }
            all.extend(bytes);
        }
    }

    /// `n` bytes of a pattern that shows a lost, doubled or reordered stretch.
    fn pattern(n: usize, modulo: u32) -> Vec<u8> {
        (0..n as u32).map(|i| (i % modulo) as u8).collect()
    }

    /// The proxy's session to a node: a request out, a reply of 1 MiB back, then the
    /// node's close_notify as the end of the stream.
    #[tokio::test]
    async fn a_session_to_a_node_carries_both_ways_and_ends_cleanly() -> anyhow::Result<()> {
        bounded(async {
            let (_pki, mut node, session) = to_a_node().await?;
            let (mut r, mut w) = session.split();
            let sent = w.write_now(b"GET big\r\n")?;
            assert_eq!(sent, 9);
            w.flush().await?;
            let mut request = [0u8; 9];
            node.read_exact(&mut request).await?;
            assert_eq!(&request, b"GET big\r\n");
            let reply = pattern(1 << 20, 253);
            let answer = reply.clone();
            let node = tokio::spawn(async move {
                node.write_all(&answer).await?;
                node.shutdown().await?;
                anyhow::Ok(node)
            });
            let got = read_to_end(&mut r).await?;
            assert!(got == reply, "{} bytes back of {}", got.len(), reply.len());
            drop(node.await??);
            Ok(())
        })
        .await
    }

    /// Bytes both ways, far more than the sockets and rustls's queue hold: an echo of 4 MiB,
    /// written through `write_now` and the runtime's writes as the copy loop does, comes
    /// back whole and in order.
    #[tokio::test]
    async fn an_echo_larger_than_every_buffer_comes_back_whole() -> anyhow::Result<()> {
        bounded(async {
            let (_pki, client, session) = pair().await?;
            let sent = pattern(4 << 20, 251);
            let (mut client_r, mut client_w) = tokio::io::split(client);
            let to_send = sent.clone();
            let writer = tokio::spawn(async move {
                client_w.write_all(&to_send).await?;
                client_w.flush().await?;
                anyhow::Ok(client_w)
            });
            let reader = tokio::spawn(async move {
                let mut back = vec![0u8; 4 << 20];
                client_r.read_exact(&mut back).await?;
                anyhow::Ok(back)
            });
            let (mut r, mut w) = session.split();
            let mut slot = None;
            let mut echoed = 0;
            while echoed < sent.len() {
                let bytes = read(&mut r, &mut slot).await?;
                assert!(!bytes.is_empty(), "the stream ended after {echoed} bytes");
                // Half straight, half through the runtime, as `forward::send` may do.
                let straight = match w.write_now(&bytes[..bytes.len() / 2]) {
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
                    Err(e) => return Err(e.into()),
                };
                w.write_all(&bytes[straight..]).await?;
                w.flush().await?;
                echoed += bytes.len();
                slot = None;
            }
            assert_eq!(reader.await??, sent);
            drop(writer.await??);
            Ok(())
        })
        .await
    }

    /// Both halves polled by one task, as the copy loop's two directions are: 4 MiB in and
    /// 4 MiB out at once, each far more than the sockets hold, so each half waits on the
    /// socket while the other moves. Neither stalls the other, and both streams arrive whole.
    #[tokio::test]
    async fn both_halves_move_at_once_in_one_task() -> anyhow::Result<()> {
        bounded(async {
            let (_pki, client, session) = pair().await?;
            let inbound = pattern(4 << 20, 251);
            let outbound = pattern(4 << 20, 241);
            let (mut client_r, mut client_w) = tokio::io::split(client);
            let to_send = inbound.clone();
            let client_writes = tokio::spawn(async move {
                client_w.write_all(&to_send).await?;
                client_w.shutdown().await?;
                anyhow::Ok(client_w)
            });
            let client_reads = tokio::spawn(async move {
                let mut back = Vec::new();
                client_r.read_to_end(&mut back).await?;
                anyhow::Ok(back)
            });
            let (mut r, mut w) = session.split();
            let reads = read_to_end(&mut r);
            let writes = async {
                for chunk in outbound.chunks(SIZE) {
                    match w.write_now(chunk) {
                        Ok(n) => w.write_all(&chunk[n..]).await?,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            w.write_all(chunk).await?
                        }
                        Err(e) => return Err(e),
                    }
                    w.flush().await?;
                }
                w.shutdown().await
            };
            let (got, ()) = tokio::try_join!(reads, writes)?;
            assert!(
                got == inbound,
                "{} bytes in of {}",
                got.len(),
                inbound.len()
            );
            let back = client_reads.await??;
            assert!(
                back == outbound,
                "{} bytes out of {}",
                back.len(),
                outbound.len()
            );
            drop(client_writes.await??);
            Ok(())
        })
        .await
    }

    /// Records rustls holds because the socket was full go out with the flush, even when
    /// nothing is written after them.
    #[tokio::test]
    async fn a_flush_sends_what_a_full_socket_did_not_take() -> anyhow::Result<()> {
        bounded(async {
            let (_pki, mut client, session) = pair().await?;
            let (_r, mut w) = session.split();
            // The client reads nothing yet: write straight until rustls takes no more (its
            // queue is full, so the socket is).
            let chunk = [b'x'; SIZE];
            let mut taken = 0;
            loop {
                match w.write_now(&chunk) {
                    Ok(n) => taken += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(e.into()),
                }
            }
            assert!(session.lock().conn.wants_write(), "nothing was left queued");
            assert!(
                !session.lock().straight,
                "a write that found the socket full left writes going straight"
            );
            let reader = tokio::spawn(async move {
                let mut got = vec![0u8; taken];
                client.read_exact(&mut got).await?;
                anyhow::Ok(got)
            });
            w.flush().await?;
            let got = reader.await??;
            assert!(got.iter().all(|&b| b == b'x') && got.len() == taken);
            Ok(())
        })
        .await
    }

    /// A read with nothing to read waits without holding a buffer; the plaintext that
    /// arrives next is read into one.
    #[tokio::test]
    async fn a_waiting_read_holds_no_buffer() -> anyhow::Result<()> {
        bounded(async {
            let (_pki, mut client, session) = pair().await?;
            let (mut r, _w) = session.split();
            let mut slot = None;
            {
                let mut read = std::pin::pin!(r.read_into(&mut slot, SIZE, None));
                let polled = read.as_mut().poll(&mut Context::from_waker(Waker::noop()));
                assert!(
                    polled.is_pending(),
                    "nothing was sent, yet the read returned"
                );
            }
            assert!(slot.is_none(), "the waiting read took a buffer");
            client.write_all(b"PING\r\n").await?;
            client.flush().await?;
            assert_eq!(read(&mut r, &mut slot).await?, b"PING\r\n");
            Ok(())
        })
        .await
    }

    /// close_notify, then FIN, from the client: the end of the stream. The writer's
    /// shutdown sends close_notify: the client reads a clean end, not an error.
    #[tokio::test]
    async fn close_notify_ends_the_stream_both_ways() -> anyhow::Result<()> {
        bounded(async {
            let (_pki, mut client, session) = pair().await?;
            let (mut r, mut w) = session.split();
            client.write_all(b"last").await?;
            client.shutdown().await?;
            assert_eq!(read_to_end(&mut r).await?, b"last");
            w.write_all(b"reply").await?;
            w.shutdown().await?;
            let mut back = Vec::new();
            client.read_to_end(&mut back).await?;
            // read_to_end: an end without close_notify would have been an error.
            assert_eq!(back, b"reply");
            Ok(())
        })
        .await
    }

    /// Records read with the handshake that end in close_notify and go on after it: the
    /// session is made (the bytes after the end are dropped, not looped on) and its reader
    /// reports the end.
    #[tokio::test]
    async fn early_bytes_past_close_notify_are_an_end() -> anyhow::Result<()> {
        bounded(async {
            let (_pki, client, server) = handshaken().await?;
            let (mut client_tcp, mut client_conn) = client.into_inner();
            client_conn.writer().write_all(b"early")?;
            client_conn.send_close_notify();
            let mut early = Vec::new();
            while client_conn.wants_write() {
                client_conn.write_tls(&mut early)?;
            }
            // Bytes after the end, as a broken client might send: more than one of rustls's
            // reads takes, so that some are left once it has seen close_notify.
            early.extend(std::iter::repeat_n(b'x', 64 << 10));
            let (tcp, conn) = server.into_inner();
            // On a thread of its own: a loop over the early bytes never yields, and the
            // test's bound must still fire.
            let (made, session) = tokio::sync::oneshot::channel();
            std::thread::spawn(move || {
                let _ = made.send(TlsSession::new(tcp, conn, &early).map(Box::new));
            });
            let session = session.await?.context("making the session")?;
            let (mut r, _w) = session.split();
            assert_eq!(read_to_end(&mut r).await?, b"early");
            client_tcp.shutdown().await?;
            Ok(())
        })
        .await
    }

    /// A TCP end without close_notify (as many clients close): `UnexpectedEof`, which the
    /// copy loop takes as the end of the stream.
    #[tokio::test]
    async fn a_tcp_end_without_close_notify_is_unexpected_eof() -> anyhow::Result<()> {
        bounded(async {
            let (_pki, mut client, session) = pair().await?;
            let (mut r, _w) = session.split();
            let mut slot = None;
            client.write_all(b"GET k\r\n").await?;
            client.flush().await?;
            client.get_mut().0.shutdown().await?;
            assert_eq!(read(&mut r, &mut slot).await?, b"GET k\r\n");
            let end = read(&mut r, &mut slot).await.map(|b| b.len());
            assert_eq!(end.map_err(|e| e.kind()), Err(io::ErrorKind::UnexpectedEof));
            Ok(())
        })
        .await
    }

    /// A record that does not decrypt: `InvalidData`, and the client is told why (rustls's
    /// alert) before the connection closes.
    #[tokio::test]
    async fn a_corrupt_record_is_an_error_and_an_alert() -> anyhow::Result<()> {
        bounded(async {
            let (_pki, mut client, session) = pair().await?;
            let (mut r, _w) = session.split();
            let mut slot = None;
            // An application-data record of 32 bytes that no key produced.
            let mut record = vec![0x17, 0x03, 0x03, 0x00, 0x20];
            record.extend([0x5a; 32]);
            client.get_mut().0.write_all(&record).await?;
            let err = read(&mut r, &mut slot)
                .await
                .expect_err("a forged record was accepted");
            assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
            let mut back = Vec::new();
            let told = client
                .read_to_end(&mut back)
                .await
                .expect_err("no alert came");
            assert!(told.to_string().contains("BadRecordMac"), "{told}");
            Ok(())
        })
        .await
    }

    /// What the client's socket brings until `want` bytes of plaintext are in: the number
    /// of TLS records it came in (counted from the records' own headers), and the
    /// plaintext, decrypted by the client's rustls session.
    async fn records_until(
        client: &mut TlsStream<TcpStream>,
        want: usize,
    ) -> anyhow::Result<(usize, Vec<u8>)> {
        let (tcp, conn) = client.get_mut();
        let (mut raw, mut records, mut plain) = (Vec::new(), 0, Vec::new());
        while plain.len() < want {
            let mut chunk = [0u8; 4096];
            let n = tcp.read(&mut chunk).await?;
            anyhow::ensure!(n > 0, "the server closed after {} bytes", plain.len());
            raw.extend_from_slice(&chunk[..n]);
            // Whole records only: a header is 5 bytes, its length the last two.
            while raw.len() >= 5 {
                let len = 5 + usize::from(u16::from_be_bytes([raw[3], raw[4]]));
                if raw.len() < len {
                    break;
                }
                let record: Vec<u8> = raw.drain(..len).collect();
                records += 1;
                conn.read_tls(&mut record.as_slice())?;
                conn.process_new_packets()?;
                let _ = conn.reader().read_to_end(&mut plain);
            }
        }
        Ok((records, plain))
    }

    /// A KeyUpdate from the client that asks for one back: the server's answer is a record
    /// of its own just before its next data (a reply without one is a single record), and
    /// traffic goes on both ways under the new keys.
    #[tokio::test]
    async fn a_key_update_is_answered_before_the_next_reply() -> anyhow::Result<()> {
        bounded(async {
            let (_pki, mut client, session) = pair().await?;
            let (mut r, mut w) = session.split();
            let mut slot = None;
            // The session tickets, read with the first reply; the client's own buffer is
            // then empty, and what comes next is read off its socket.
            w.write_all(b"warm").await?;
            w.flush().await?;
            let mut warm = [0u8; 4];
            client.read_exact(&mut warm).await?;
            assert_eq!(&warm, b"warm");
            w.write_all(b"one").await?;
            w.flush().await?;
            assert_eq!(records_until(&mut client, 3).await?, (1, b"one".to_vec()));

            client.get_mut().1.refresh_traffic_keys()?;
            client.write_all(b"after").await?;
            client.flush().await?;
            assert_eq!(read(&mut r, &mut slot).await?, b"after");
            w.write_all(b"reply").await?;
            w.flush().await?;
            assert_eq!(records_until(&mut client, 5).await?, (2, b"reply".to_vec()));

            w.write_all(b"more").await?;
            w.flush().await?;
            assert_eq!(records_until(&mut client, 4).await?, (1, b"more".to_vec()));
            client.write_all(b"again").await?;
            client.flush().await?;
            assert_eq!(read(&mut r, &mut slot).await?, b"again");
            Ok(())
        })
        .await
    }

    /// Counts the wakes that come while a poll is under way: a future's own yield.
    struct Yields {
        during_poll: AtomicBool,
        inner: Waker,
    }

    impl Wake for Yields {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }

        fn wake_by_ref(self: &Arc<Self>) {
            self.during_poll.store(true, Ordering::SeqCst);
            self.inner.wake_by_ref();
        }
    }

    /// The client's first application traffic secret, as rustls logs it.
    #[derive(Debug, Default)]
    struct TrafficSecret(Mutex<Option<Vec<u8>>>);

    impl rustls::KeyLog for TrafficSecret {
        fn log(&self, label: &str, _: &[u8], secret: &[u8]) {
            if label == "CLIENT_TRAFFIC_SECRET_0" {
                *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(secret.to_vec());
            }
        }
    }

    /// RFC 8446's HKDF-Expand-Label of `secret` (a traffic secret) with an empty context.
    fn expand_label(
        suite: &rustls::Tls13CipherSuite,
        secret: &[u8],
        label: &[u8],
        len: usize,
    ) -> anyhow::Result<Vec<u8>> {
        let expander = suite
            .hkdf_provider
            .expander_for_okm(&rustls::crypto::tls13::OkmBlock::new(secret));
        let length = u16::try_from(len)?.to_be_bytes();
        let label_len = [u8::try_from(6 + label.len())?];
        let mut out = vec![0u8; len];
        expander
            .expand_slice(&[&length, &label_len, b"tls13 ", label, &[0]], &mut out)
            .map_err(|_| anyhow::anyhow!("HKDF refused {len} bytes"))?;
        Ok(out)
    }

    /// The records of a client that sends no plaintext for as long as it likes, within
    /// every limit rustls sets: 31 empty application-data records (rustls refuses a 33rd
    /// in a row), then a KeyUpdate that asks for nothing (a record with content, which
    /// starts the count again; the empty records reset rustls's count of KeyUpdates), and
    /// so on under the new keys. `generations` such rounds, then "PING\r\n".
    fn records_without_plaintext(
        suite: &rustls::Tls13CipherSuite,
        secret: &[u8],
        generations: usize,
    ) -> anyhow::Result<Vec<u8>> {
        let key_len = suite.aead_alg.key_len();
        // rustls takes a key from outside only as 32 bytes.
        anyhow::ensure!(
            key_len == 32,
            "{:?} has {key_len}-byte keys",
            suite.common.suite
        );
        let keys = |secret: &[u8]| -> anyhow::Result<_> {
            let key: [u8; 32] = expand_label(suite, secret, b"key", 32)?
                .try_into()
                .map_err(|_| anyhow::anyhow!("a key of the wrong length"))?;
            let iv: [u8; 12] = expand_label(suite, secret, b"iv", 12)?
                .try_into()
                .map_err(|_| anyhow::anyhow!("an IV of the wrong length"))?;
            Ok(suite.aead_alg.encrypter(key.into(), iv.into()))
        };
        let record = |encrypter: &mut Box<dyn rustls::crypto::cipher::MessageEncrypter>,
                      seq: u64,
                      typ: ContentType,
                      payload: &[u8]| {
            let message = OutboundPlainMessage {
                typ,
                version: ProtocolVersion::TLSv1_2,
                payload: OutboundChunks::Single(payload),
            };
            encrypter.encrypt(message, seq).map(|m| m.encode())
        };
        // key_update (24), 1 byte long, update_not_requested (0).
        const KEY_UPDATE: [u8; 5] = [24, 0, 0, 1, 0];
        let hash_len = suite.common.hash_provider.output_len();
        let mut secret = secret.to_vec();
        let mut encrypter = keys(&secret)?;
        let mut out = Vec::new();
        for _ in 0..generations {
            for seq in 0..31 {
                out.extend(record(
                    &mut encrypter,
                    seq,
                    ContentType::ApplicationData,
                    &[],
                )?);
            }
            out.extend(record(
                &mut encrypter,
                31,
                ContentType::Handshake,
                &KEY_UPDATE,
            )?);
            secret = expand_label(suite, &secret, b"traffic upd", hash_len)?;
            encrypter = keys(&secret)?;
        }
        out.extend(record(
            &mut encrypter,
            0,
            ContentType::ApplicationData,
            b"PING\r\n",
        )?);
        Ok(out)
    }

    /// A client whose records bring no plaintext and keep the socket full (see
    /// [`records_without_plaintext`]; rustls sends no such records, so they are made here
    /// with the client's traffic secret): the reader gives the worker back now and then
    /// instead of reading them all in one poll, and the plaintext after them arrives whole.
    #[tokio::test(flavor = "current_thread")]
    async fn a_flood_of_records_without_plaintext_does_not_hold_the_worker() -> anyhow::Result<()> {
        bounded(async {
            let secret = Arc::new(TrafficSecret::default());
            let log = secret.clone();
            let (_pki, client, server) = handshaken_with(|pki| {
                let mut config = (*pki.client_config(None)).clone();
                config.key_log = log;
                Arc::new(config)
            })
            .await?;
            let (tcp, conn) = server.into_inner();
            let session = TlsSession::new(tcp, conn, &[])?;
            let (client_tcp, client_conn) = client.into_inner();
            let Some(rustls::SupportedCipherSuite::Tls13(suite)) =
                client_conn.negotiated_cipher_suite()
            else {
                anyhow::bail!("the handshake did not end in TLS 1.3");
            };
            let secret = secret
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
                .context("rustls logged no client traffic secret")?;
            // About 8 MiB, far more than the reader's 32 reads of at most 18 KiB each take.
            let generations = 12_000;
            let flood = records_without_plaintext(suite, &secret, generations)?;
            let sender = {
                let tcp = client_tcp.into_std()?;
                tcp.set_nonblocking(false)?;
                std::thread::spawn(move || {
                    let mut tcp = tcp;
                    std::io::Write::write_all(&mut tcp, &flood)?;
                    anyhow::Ok(tcp)
                })
            };

            let (mut r, _w) = session.split();
            let mut slot = None;
            let (yields, polls) = (AtomicUsize::new(0), AtomicUsize::new(0));
            let mut read = Box::pin(r.read_into(&mut slot, SIZE, None));
            let n = std::future::poll_fn(|cx| {
                let waker = Arc::new(Yields {
                    during_poll: AtomicBool::new(false),
                    inner: cx.waker().clone(),
                });
                polls.fetch_add(1, Ordering::Relaxed);
                let polled = read
                    .as_mut()
                    .poll(&mut Context::from_waker(&Waker::from(waker.clone())));
                if polled.is_pending() && waker.during_poll.load(Ordering::SeqCst) {
                    yields.fetch_add(1, Ordering::Relaxed);
                }
                polled
            })
            .await?;
            drop(read);
            let got = slot.as_deref().map(|b| b[..n].to_vec());
            assert_eq!(got.as_deref(), Some(&b"PING\r\n"[..]));
            let (yields, polls) = (yields.into_inner(), polls.into_inner());
            assert!(
                yields > 0,
                "{generations} rounds of records were read in {polls} polls, none of which yielded"
            );
            sender
                .join()
                .map_err(|_| anyhow::anyhow!("the sender panicked"))?
                .context("sending the records")?;
            Ok(())
        })
        .await
    }
}
