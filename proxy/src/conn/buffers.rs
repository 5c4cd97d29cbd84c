//! Read buffers held only while bytes are in flight.
//!
//! An idle connection would otherwise hold two full buffers for its whole life: at 10,000
//! idle connections and 16 KiB each, 320 MB for nothing. A plain TCP source waits for its
//! socket to become readable with no buffer, takes one from a per-thread free list to read
//! into, and gives it back once what it read is written. A busy connection takes and gives
//! back a buffer per read, which the free list makes a pop and a push.
//!
//! TLS streams cannot be waited on without a read (their records are decrypted inside the
//! read), so they keep their buffer ([`Held`]); rustls holds buffers of its own anyway.

use std::cell::RefCell;
use std::future::Future;
use std::io;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt, ReadBuf};
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
    /// Whether the buffer goes back to the free list once what was read is written.
    const RELEASES: bool;

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
    const RELEASES: bool = true;
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
            let buf = slot.get_or_insert_with(|| Buffer::take(size));
            let mut read = ReadBuf::new(buf);
            // poll_read rather than try_read: a read that leaves the buffer part empty
            // shows the socket drained (epoll is edge-triggered) and tokio then clears its
            // readiness, which saves the next read's WouldBlock syscall.
            match Pin::new(&mut *self).poll_read(cx, &mut read) {
                Poll::Ready(r) => Poll::Ready(r.map(|()| read.filled().len())),
                // Readiness was stale; the waker is registered. Wait without the buffer.
                Poll::Pending => {
                    *slot = None;
                    waits(self, cx, keepalive)
                }
            }
        })
    }
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

/// Any other stream (TLS): read as usual, the buffer kept for the connection's life.
pub struct Held<R>(pub R);

impl<R: AsyncRead + Unpin + Send> Source for Held<R> {
    const RELEASES: bool = false;

    async fn read_into(
        &mut self,
        slot: &mut Option<Buffer>,
        size: usize,
        _: Option<&LateKeepalive>,
    ) -> io::Result<usize> {
        let buf = slot.get_or_insert_with(|| Buffer::take(size));
        self.0.read(buf).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(other.len(), 1024, "a buffer of another size is not handed out");
    }

    #[test]
    fn the_free_list_is_bounded() {
        let many: Vec<Buffer> = (0..KEEP_PER_THREAD + 10).map(|_| Buffer::take(64)).collect();
        drop(many);
        let kept = FREE.with(|f| f.borrow().len());
        assert_eq!(kept, KEEP_PER_THREAD);
    }
}
