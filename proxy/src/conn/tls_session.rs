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
//! `InvalidData` error after rustls's alert is sent, what rustls has to say while reading
//! (a KeyUpdate's answer) is sent at once when the socket takes it and with the next write
//! otherwise, and shutdown sends close_notify before the TCP FIN.

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
    conn: Mutex<Connection>,
}

impl TlsSession {
    /// The session on `tcp`; `early` is what was read from the socket for the handshake
    /// and not yet given to rustls (nothing, in practice: the hello is read whole).
    pub fn new(tcp: TcpStream, conn: impl Into<Connection>, mut early: &[u8]) -> io::Result<Self> {
        let mut conn = conn.into();
        while !early.is_empty() {
            conn.read_tls(&mut early)?;
            conn.process_new_packets()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        }
        let session = TlsSession {
            tcp,
            conn: Mutex::new(conn),
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
    /// never contended; a panic while it was held (none is expected from rustls) leaves
    /// the session as it was, which the next read or write reports on.
    fn lock(&self) -> MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(PoisonError::into_inner)
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

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Writes what rustls has queued until it is all out or the socket is full (`Ok`), without
/// waiting. A full socket costs the wait that follows one failing `send` (see
/// [`SocketWrite`]); replies and requests rarely fill one.
fn push(conn: &mut Connection, tcp: &TcpStream) -> io::Result<()> {
    while conn.wants_write() {
        match conn.write_tls(&mut SocketWrite::Straight(tcp)) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes what rustls has queued, waiting for the socket as it fills.
fn poll_push(conn: &mut Connection, tcp: &TcpStream, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
    while conn.wants_write() {
        match conn.write_tls(&mut SocketWrite::Waiting(tcp)) {
            Ok(0) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => match tcp.poll_write_ready(cx) {
                // An event came since the write: try again.
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            },
            Err(e) => return Poll::Ready(Err(e)),
        }
    }
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
            // Each read spends the task's coop budget, as the plain source's readiness
            // check does: `try_io` spends none, and a sender whose records keep the
            // socket full (empty records, say) must not hold the worker in this loop.
            let coop = std::task::ready!(tokio::task::coop::poll_proceed(cx));
            let tcp = &session.tcp;
            let mut conn = session.lock();
            let mut turns = 0u32;
            loop {
                match readable(&mut conn)? {
                    Some(true) => {
                        coop.made_progress();
                        let buf = slot.get_or_insert_with(|| Buffer::take(size));
                        return Poll::Ready(conn.reader().read(buf));
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
                match conn.read_tls(&mut SocketRead(tcp)) {
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
                if let Err(e) = conn.process_new_packets() {
                    // rustls has queued its alert: the client learns why, if it still reads.
                    let _ = push(&mut conn, tcp);
                    return Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, e)));
                }
                // A KeyUpdate's answer, say: out now if the socket takes it, else with the
                // writer's next flush. A socket that fails this write fails the writer's
                // too, which reports it; the read goes on with what has arrived.
                let _ = push(&mut conn, tcp);
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
        let mut conn = self.session.lock();
        let mut cx = cx;
        loop {
            // rustls encrypts what it takes at once (up to its buffer limit of queued
            // records), then as much as the socket takes goes out.
            let n = conn.writer().write(bytes)?;
            if n > 0 {
                push(&mut conn, tcp)?;
                return Poll::Ready(Ok(n));
            }
            // Its queue is full: wait for the socket to take some.
            let Some(cx) = cx.as_deref_mut() else {
                return Poll::Ready(Err(io::ErrorKind::WouldBlock.into()));
            };
            match poll_push(&mut conn, tcp, cx) {
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
            let mut conn = this.session.lock();
            if !this.closing {
                conn.send_close_notify();
                this.closing = true;
            }
            std::task::ready!(poll_push(&mut conn, tcp, cx))?;
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
    use std::sync::Arc;

    use shardgate_harness::tls::TestPki;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio_rustls::client::TlsStream;
    use tokio_rustls::{TlsAcceptor, TlsConnector};

    use super::*;
    use crate::config::CertFiles;
    use crate::tls::certs::Reloadable;

    const SIZE: usize = 16 * 1024;

    /// Both ends of a TLS session over loopback TCP, each a tokio-rustls stream, handshake
    /// done (the server holds a wildcard certificate of the test PKI, which lives as long as
    /// the test holds it).
    async fn handshaken() -> anyhow::Result<(
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
        let connector = TlsConnector::from(pki.client_config(None));
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

    /// The proxy's session to a node: a request out, a reply of 1 MiB back, then the
    /// node's close_notify as the end of the stream.
    #[tokio::test]
    async fn a_session_to_a_node_carries_both_ways_and_ends_cleanly() -> anyhow::Result<()> {
        let (_pki, mut node, session) = to_a_node().await?;
        let (mut r, mut w) = session.split();
        let sent = w.write_now(b"GET big\r\n")?;
        assert_eq!(sent, 9);
        w.flush().await?;
        let mut request = [0u8; 9];
        node.read_exact(&mut request).await?;
        assert_eq!(&request, b"GET big\r\n");
        let reply: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 253) as u8).collect();
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

    /// Bytes both ways, far more than the sockets and rustls's queue hold: an echo of 4 MiB,
    /// written through `write_now` and the runtime's writes as the copy loop does, comes
    /// back whole and in order.
    #[tokio::test]
    async fn an_echo_larger_than_every_buffer_comes_back_whole() -> anyhow::Result<()> {
        let (_pki, client, session) = pair().await?;
        let sent: Vec<u8> = (0..4 << 20).map(|i: u32| (i % 251) as u8).collect();
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
    }

    /// Records rustls holds because the socket was full go out with the flush, even when
    /// nothing is written after them.
    #[tokio::test]
    async fn a_flush_sends_what_a_full_socket_did_not_take() -> anyhow::Result<()> {
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
        assert!(session.lock().wants_write(), "nothing was left queued");
        let reader = tokio::spawn(async move {
            let mut got = vec![0u8; taken];
            client.read_exact(&mut got).await?;
            anyhow::Ok(got)
        });
        w.flush().await?;
        let got = tokio::time::timeout(std::time::Duration::from_secs(30), reader)
            .await
            .map_err(|_| anyhow::anyhow!("the flushed bytes never came"))???;
        assert!(got.iter().all(|&b| b == b'x') && got.len() == taken);
        Ok(())
    }

    /// A read with nothing to read waits without holding a buffer; the plaintext that
    /// arrives next is read into one.
    #[tokio::test]
    async fn a_waiting_read_holds_no_buffer() -> anyhow::Result<()> {
        let (_pki, mut client, session) = pair().await?;
        let (mut r, _w) = session.split();
        let mut slot = None;
        {
            let mut read = std::pin::pin!(r.read_into(&mut slot, SIZE, None));
            let waker = std::task::Waker::noop();
            let polled = read.as_mut().poll(&mut Context::from_waker(waker));
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
    }

    /// close_notify, then FIN, from the client: the end of the stream. The writer's
    /// shutdown sends close_notify: the client reads a clean end, not an error.
    #[tokio::test]
    async fn close_notify_ends_the_stream_both_ways() -> anyhow::Result<()> {
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
    }

    /// A TCP end without close_notify (as many clients close): `UnexpectedEof`, which the
    /// copy loop takes as the end of the stream.
    #[tokio::test]
    async fn a_tcp_end_without_close_notify_is_unexpected_eof() -> anyhow::Result<()> {
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
    }

    /// A record that does not decrypt: `InvalidData`, and the client is told why (rustls's
    /// alert) before the connection closes.
    #[tokio::test]
    async fn a_corrupt_record_is_an_error_and_an_alert() -> anyhow::Result<()> {
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
    }

    /// A KeyUpdate from the client that asks for one back: the server's answer goes out
    /// from the read side, and traffic goes on both ways under the new keys.
    #[tokio::test]
    async fn traffic_goes_on_after_a_key_update() -> anyhow::Result<()> {
        let (_pki, mut client, session) = pair().await?;
        let (mut r, mut w) = session.split();
        let mut slot = None;
        client.get_mut().1.refresh_traffic_keys()?;
        client.write_all(b"after").await?;
        client.flush().await?;
        assert_eq!(read(&mut r, &mut slot).await?, b"after");
        w.write_all(b"reply").await?;
        w.flush().await?;
        let mut back = [0u8; 5];
        client.read_exact(&mut back).await?;
        assert_eq!(&back, b"reply");
        Ok(())
    }
}
