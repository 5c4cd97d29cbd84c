//! The write side of the copy loop: what a plain TCP half (or a TLS session's writer, see
//! `super::tls_session`) can do that tokio's `AsyncWrite` does not say.
//!
//! Both save work on connections that last one request (a client that connects, sends a
//! command, reads the reply and closes): a trip through the event loop before the first
//! write to a node, and a `shutdown` before a `close` that sends the same FIN. The
//! straight write also spares every later write the runtime's readiness check (see
//! `forward::send`, which goes back to the runtime's writes while a socket is full), and
//! on Linux it is the system call itself, without libc's cancellation-point wrapper.

use std::io;

use tokio::io::AsyncWrite;
use tokio::net::tcp;

/// A writer the copy loop hands bytes to.
pub trait Sink: AsyncWrite + Unpin + Send {
    /// Whether dropping the writer's socket ends the stream as `shutdown` would: true of a
    /// plain TCP socket whose received bytes were all read (close then sends a FIN, not a
    /// reset); false of TLS, whose shutdown also says close_notify.
    const CLOSE_ENDS_STREAM: bool;

    /// Writes what the socket takes now, without waiting for the runtime to have seen it
    /// writable; `WouldBlock` when it takes nothing, or cannot be written this way. A TLS
    /// writer returns what rustls took: what of it the socket did not take goes out with
    /// the flush that follows.
    fn write_now(&mut self, _bytes: &[u8]) -> io::Result<usize> {
        Err(io::ErrorKind::WouldBlock.into())
    }
}

/// `send` on `stream` with no SIGPIPE on a closed peer (`MSG_NOSIGNAL`): EPIPE comes back as
/// an error, as with tokio's own writes. Where rustix calls the kernel itself (Linux on the
/// common architectures) this is the system call; libc's `send` is a thread cancellation
/// point, wrapped in two calls that switch cancellation on and off (about 30 instructions
/// per write, which this thread never needs).
#[cfg(all(unix, not(target_vendor = "apple")))]
pub(super) fn send(stream: &tokio::net::TcpStream, bytes: &[u8]) -> io::Result<usize> {
    Ok(rustix::net::send(
        stream,
        bytes,
        rustix::net::SendFlags::NOSIGNAL,
    )?)
}

/// Apple systems have no `MSG_NOSIGNAL`; their sockets are made with `SO_NOSIGPIPE` (socket2
/// and mio set it, and accepted sockets inherit it).
#[cfg(not(all(unix, not(target_vendor = "apple"))))]
pub(super) fn send(stream: &tokio::net::TcpStream, bytes: &[u8]) -> io::Result<usize> {
    socket2::SockRef::from(stream).send(bytes)
}

/// [`send`] of several slices in one system call (`sendmsg`): rustls's queued records, one
/// slice each, go out together.
#[cfg(all(unix, not(target_vendor = "apple")))]
pub(super) fn send_vectored(
    stream: &tokio::net::TcpStream,
    bufs: &[io::IoSlice<'_>],
) -> io::Result<usize> {
    Ok(rustix::net::sendmsg(
        stream,
        bufs,
        &mut rustix::net::SendAncillaryBuffer::default(),
        rustix::net::SendFlags::NOSIGNAL,
    )?)
}

#[cfg(not(all(unix, not(target_vendor = "apple"))))]
pub(super) fn send_vectored(
    stream: &tokio::net::TcpStream,
    bufs: &[io::IoSlice<'_>],
) -> io::Result<usize> {
    socket2::SockRef::from(stream).send_vectored(bufs)
}

impl Sink for tcp::WriteHalf<'_> {
    const CLOSE_ENDS_STREAM: bool = true;

    /// tokio marks a socket writable only after epoll says so, except sockets it accepted
    /// itself: a dialled node's socket, connected before tokio saw it (`dial::connect`),
    /// would wait one trip through the event loop for its first write. Sent straight, that
    /// write goes out at once. tokio's readiness is left as it was; it learns the socket's
    /// state from epoll as before, and a write it tries on stale readiness just finds
    /// `WouldBlock` and waits.
    fn write_now(&mut self, bytes: &[u8]) -> io::Result<usize> {
        send(self.as_ref(), bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;
    use tokio::net::{TcpListener, TcpStream};

    /// A socket tokio did not accept, written at once: the bytes reach the peer.
    #[tokio::test]
    async fn write_now_sends_on_a_dialled_socket() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut dialled = crate::dial::connect(addr).await.unwrap();
        let (mut accepted, _) = listener.accept().await.unwrap();
        let (_, mut w) = dialled.split();
        assert_eq!(w.write_now(b"PING\r\n").unwrap(), 6);
        let mut got = [0u8; 6];
        accepted.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"PING\r\n");
    }

    /// A peer that is gone gives an error, not a signal that would end the process.
    #[tokio::test]
    async fn write_now_to_a_closed_peer_is_an_error() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut dialled = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        // A reset, not a FIN: the next write fails at once.
        socket2::SockRef::from(&accepted)
            .set_linger(Some(std::time::Duration::ZERO))
            .unwrap();
        drop(accepted);
        let (_, mut w) = dialled.split();
        let mut errors = 0;
        // The reset may land after the first write; the second then fails.
        for _ in 0..100 {
            match w.write_now(b"PING\r\n") {
                Ok(_) => tokio::task::yield_now().await,
                Err(e) => {
                    assert_ne!(e.kind(), io::ErrorKind::WouldBlock, "{e}");
                    errors += 1;
                    break;
                }
            }
        }
        assert_eq!(errors, 1, "no write failed after the peer reset");
    }
}
