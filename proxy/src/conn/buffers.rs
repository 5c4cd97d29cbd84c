//! Read buffers held only while bytes are in flight.
//!
//! An idle connection would otherwise hold two full buffers for its whole life: at 10,000
//! idle connections and 16 KiB each, 320 MB for nothing. A plain TCP source waits for its
//! socket to become readable with no buffer, takes one from a per-thread free list to read
//! into, and gives it back once what it read is written. A busy connection takes and gives
//! back a buffer per read, which the free list makes a pop and a push. Its read is the
//! system call itself, with tokio's readiness kept as tokio's own read keeps it
//! ([`read_now`]).
//!
//! A TLS session ([`super::tls_session`]) waits without one too: rustls reads the socket
//! into a buffer of its own, and plaintext is copied into one of these only once decrypted.

use std::cell::RefCell;
use std::future::Future;
use std::io;
use std::ops::{Deref, DerefMut};
use std::task::{Context, Poll};

use tokio::io::Interest;
use tokio::net::tcp;

use super::keepalive::LateKeepalive;

/// Buffers kept per thread for reuse: enough for the connections of one busy worker's
/// wake-up, few enough that a burst does not pin memory for good.
const KEEP_PER_THREAD: usize = 64;

thread_local! {
    static FREE: RefCell<Vec<Box<[u8]>>> = const { RefCell::new(Vec::new()) };
}

/// A read buffer of a fixed size, back on its thread's free list when dropped.
pub struct Buffer(Option<Box<[u8]>>);

impl Buffer {
    /// A buffer of `size` bytes, reused when the free list has one of that size.
    pub fn take(size: usize) -> Buffer {
        let reused = FREE
            .try_with(|free| {
                let mut free = free.borrow_mut();
                // One size per process in practice (the configured buffer size); a buffer of
                // another size is dropped rather than handed out.
                while let Some(b) = free.pop() {
                    if b.len() == size {
                        return Some(b);
                    }
                }
                None
            })
            .ok()
            .flatten();
        Buffer(Some(
            reused.unwrap_or_else(|| vec![0u8; size].into_boxed_slice()),
        ))
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if let Some(b) = self.0.take() {
            // During thread teardown the list is gone: the buffer is simply freed.
            let _ = FREE.try_with(|free| {
                let mut free = free.borrow_mut();
                if free.len() < KEEP_PER_THREAD {
                    free.push(b);
                }
            });
        }
    }
}

impl Deref for Buffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.0.as_deref().unwrap_or_default()
    }
}

impl DerefMut for Buffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.0.as_deref_mut().unwrap_or_default()
    }
}

/// One direction's read side, as the copy loop reads it.
pub trait Source: Send {
    /// Whether `read_into` can set keepalive on the socket (a plain TCP one).
    const SETS_KEEPALIVE: bool = false;

    /// Reads what has arrived into `slot`'s buffer, taking one of `size` bytes once there
    /// is something to read: the byte count, 0 at the end of the stream. With `keepalive`,
    /// sets it on the socket when it comes due (see `conn::keepalive`).
    fn read_into<'a>(
        &'a mut self,
        slot: &'a mut Option<Buffer>,
        size: usize,
        keepalive: Option<&'a LateKeepalive>,
    ) -> impl Future<Output = io::Result<usize>> + Send + 'a;
}

impl Source for tcp::ReadHalf<'_> {
    const SETS_KEEPALIVE: bool = true;

    fn read_into<'a>(
        &'a mut self,
        slot: &'a mut Option<Buffer>,
        size: usize,
        keepalive: Option<&'a LateKeepalive>,
    ) -> impl Future<Output = io::Result<usize>> + Send + 'a {
        // Polled by hand rather than with `readable().await`: that future (a waiter in the
        // socket's list) is larger than the rest of the copy loop, and this one is three
        // pointers.
        std::future::poll_fn(move |cx| {
            if slot.is_none() {
                match self.as_ref().poll_read_ready(cx) {
                    Poll::Ready(r) => r?,
                    Poll::Pending => return waits(self, cx, keepalive),
                }
            }
            loop {
                let buf = slot.get_or_insert_with(|| Buffer::take(size));
                match read_now(self.as_ref(), buf) {
                    Ok(n) => return Poll::Ready(Ok(n)),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Poll::Ready(Err(e)),
                }
                // Readiness was stale, and is cleared: wait, with the waker registered,
                // and without the buffer.
                *slot = None;
                match self.as_ref().poll_read_ready(cx) {
                    Poll::Ready(r) => r?,
                    Poll::Pending => return waits(self, cx, keepalive),
                }
            }
        })
    }
}

/// Reads what `stream` has into `buf`, as tokio's own read does (`WouldBlock` clears the
/// readiness it saw), and so does a read that leaves the buffer part empty: it shows the
/// socket drained (epoll is edge-triggered), which saves the next read's `WouldBlock`
/// system call. The readiness cleared is the one seen before the read, so an event that
/// came during it is kept.
///
/// The read is rustix's `recv`: where rustix calls the kernel itself (Linux on the common
/// architectures) the system call; libc's is a thread cancellation point, wrapped in two
/// calls that switch cancellation on and off (about 30 instructions per read, which this
/// thread never needs). Elsewhere rustix calls libc's, as tokio does.
#[inline(always)]
pub(super) fn read_now(stream: &tokio::net::TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = None;
    let read = stream.try_io(Interest::READABLE, || {
        let n = recv(stream, buf)?;
        got = Some(n);
        if 0 < n && n < buf.len() {
            // Drained: tell try_io to clear the readiness it saw.
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    });
    match (read, got) {
        (_, Some(n)) => Ok(n),
        (r, None) => r,
    }
}

/// rustix's `recv`, on every Unix (unlike `MSG_NOSIGNAL` for `send`, no flag differs).
#[inline(always)]
fn recv(stream: &tokio::net::TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    Ok(rustix::net::recv(stream, buf, rustix::net::RecvFlags::empty())?.0)
}

/// A plain socket's read waits: the time to set keepalive if it came due. Asked only
/// here, where a quiet connection is when its reader is woken for it.
#[inline(always)]
fn waits(
    from: &tcp::ReadHalf<'_>,
    cx: &Context<'_>,
    keepalive: Option<&LateKeepalive>,
) -> Poll<io::Result<usize>> {
    if keepalive.is_some_and(|k| k.take_due(cx.waker())) {
        crate::dial::keep_alive(socket2::SockRef::from(from.as_ref()));
    }
    Poll::Pending
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (client, server)
    }

    /// A plain socket's read: what arrived; a read that filled its buffer leaves the rest
    /// for the next; once the socket is drained a read waits, and the bytes that come next
    /// wake it; then the end of the stream.
    #[tokio::test]
    async fn plain_reads_drain_wait_and_wake() {
        let (mut peer, mut socket) = pair().await;
        let (mut from, _) = socket.split();
        let mut slot = None;
        // Two buffers' worth: each read fills its buffer, which does not show the socket
        // drained, so the read after them finds the readiness stale (its `WouldBlock`
        // path). Loopback delivers the bytes at once; the loop does not count on it.
        peer.write_all(&[7u8; 128]).await.unwrap();
        let mut got = 0;
        while got < 128 {
            let n = from.read_into(&mut slot, 64, None).await.unwrap();
            assert!(n > 0 && n <= 64, "{n}");
            assert!(slot.as_deref().unwrap()[..n].iter().all(|&b| b == 7));
            got += n;
            slot = None;
        }
        assert_eq!(got, 128);
        {
            let read = from.read_into(&mut slot, 64, None);
            // The bytes go out once the read below waits with this task's waker (the
            // writer runs when this task yields).
            let writer = tokio::spawn(async move {
                peer.write_all(b"world").await.unwrap();
                peer
            });
            // The deadline first: a read never woken must not be rescued by being polled
            // at the deadline.
            let woken = tokio::select! {
                biased;
                _ = tokio::time::sleep(std::time::Duration::from_secs(10)) => {
                    panic!("the bytes that came did not wake the read")
                }
                n = read => n.unwrap(),
            };
            assert_eq!(woken, 5);
            peer = writer.await.unwrap();
        }
        assert_eq!(&slot.as_deref().unwrap()[..5], b"world");
        slot = None;
        peer.shutdown().await.unwrap();
        assert_eq!(from.read_into(&mut slot, 64, None).await.unwrap(), 0);
    }

    #[test]
    fn buffers_are_reused_on_their_thread_and_sized_as_asked() {
        let first = Buffer::take(512);
        let addr = first.as_ptr();
        assert_eq!(first.len(), 512);
        drop(first);
        let again = Buffer::take(512);
        assert_eq!(again.as_ptr(), addr, "the freed buffer is handed out again");
        drop(again);
        let other = Buffer::take(1024);
        assert_eq!(
            other.len(),
            1024,
            "a buffer of another size is not handed out"
        );
    }

    #[test]
    fn the_free_list_is_bounded() {
        let many: Vec<Buffer> = (0..KEEP_PER_THREAD + 10)
            .map(|_| Buffer::take(64))
            .collect();
        drop(many);
        let kept = FREE.with(|f| f.borrow().len());
        assert_eq!(kept, KEEP_PER_THREAD);
    }
}
