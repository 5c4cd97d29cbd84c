//! TCP keepalive on a node's socket, set once the connection has lasted a second.
//!
//! Keepalive finds a node that vanished without a FIN (its pod's machine gone, a partition)
//! while a connection to it idles. It takes three socket options (`SO_KEEPALIVE`,
//! `TCP_KEEPIDLE`, `TCP_KEEPINTVL`), three system calls on every dialled socket, and its
//! first probe comes only after 60 idle seconds: a connection that lasts one request (a
//! client that connects, asks and closes) never gets to use it. So a plain node socket gets
//! it once the connection has lasted [`KEEPALIVE_AFTER`]: the watch's timer says when
//! ([`LateKeepalive::come_due`]), and the node's copy direction, which holds the socket, sets
//! it the next time its read waits ([`LateKeepalive::take_due`]), woken for it if it is
//! waiting. The first probe of a vanished node comes at most that second later. (The
//! client's leg has keepalive from the listener at no cost: accepted sockets inherit the
//! listener's options.)
//!
//! With a connection per request, the proxy's CPU per connection was 0.98× (0.96 to 1.00
//! over 6 paired runs); the check costs about 20 user-space instructions per request at
//! pipeline 1 (callgrind: 3,552 to 3,580 per GET, 0.8%).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, PoisonError};
use std::task::Waker;
use std::time::Duration;

/// How long a connection lasts before its node socket gets keepalive.
pub const KEEPALIVE_AFTER: Duration = Duration::from_secs(1);

/// Not wanted, or already set.
const DONE: u8 = 0;
/// Wanted; the reader has not kept its waker yet.
const WANTED: u8 = 1;
/// Wanted; the reader's waker is kept.
const WAITING: u8 = 2;
/// The connection has lasted long enough: the reader sets it when its read next waits.
const DUE: u8 = 3;

/// Keepalive for one connection's node socket, to be set late (see the module's doc).
pub struct LateKeepalive {
    state: AtomicU8,
    /// The node reader's waker, as of its first wait: the copy directions are polled only
    /// when woken (`conn::join`), so coming due must wake this one.
    reader: Mutex<Option<Waker>>,
}

impl LateKeepalive {
    /// Keepalive to be set once the connection has lasted [`KEEPALIVE_AFTER`].
    pub fn wanted() -> Self {
        Self::with(WANTED)
    }

    /// Nothing to set: the socket has keepalive already, or is not a socket.
    pub fn not_wanted() -> Self {
        Self::with(DONE)
    }

    fn with(state: u8) -> Self {
        LateKeepalive {
            state: AtomicU8::new(state),
            reader: Mutex::new(None),
        }
    }

    /// Whether it is still to be set.
    pub fn pending(&self) -> bool {
        self.state.load(Ordering::Relaxed) != DONE
    }

    /// The connection has lasted long enough: the reader is woken to set it.
    pub fn come_due(&self) {
        if !self.pending() {
            return;
        }
        self.state.store(DUE, Ordering::Relaxed);
        let reader = self.reader.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(w) = &*reader {
            w.wake_by_ref();
        }
    }

    /// Called by the node's reader each time its read waits, with its waker: whether to
    /// set keepalive now (true once). One load on the calls that find nothing to do.
    #[inline(always)]
    pub fn take_due(&self, waker: &Waker) -> bool {
        match self.state.load(Ordering::Relaxed) {
            DONE | WAITING => false,
            state => self.advance(state, waker),
        }
    }

    /// The reader's first wait (its waker kept) or its wait once due (true: set it now).
    /// The state is changed only from the one it was read as: `come_due` may have stored
    /// DUE since, and that must not be overwritten.
    #[cold]
    #[inline(never)]
    fn advance(&self, state: u8, waker: &Waker) -> bool {
        let mut reader = self.reader.lock().unwrap_or_else(PoisonError::into_inner);
        let swap = |to| {
            self.state
                .compare_exchange(state, to, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        };
        if state == WANTED {
            if swap(WAITING) {
                *reader = Some(waker.clone());
                return false;
            }
            // Came due meanwhile: set it now.
            drop(reader);
            return self.take_due(waker);
        }
        if swap(DONE) {
            // The waker is not needed any more.
            reader.take();
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;
    use std::task::Wake;

    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn the_reader_is_woken_once_and_sets_it_once() {
        let wakes = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(wakes.clone());
        let k = LateKeepalive::wanted();
        assert!(!k.take_due(&waker), "not due before it comes due");
        assert!(!k.take_due(&waker));
        assert_eq!(wakes.0.load(Ordering::Relaxed), 0);
        k.come_due();
        assert_eq!(
            wakes.0.load(Ordering::Relaxed),
            1,
            "the waiting reader is woken"
        );
        assert!(k.take_due(&waker), "due: set it");
        assert!(!k.take_due(&waker), "set once");
        assert!(!k.pending());
        k.come_due();
        assert_eq!(
            wakes.0.load(Ordering::Relaxed),
            1,
            "nothing more after it is set"
        );
    }

    #[test]
    fn due_before_the_reader_first_polled() {
        let waker = Waker::from(Arc::new(Count(AtomicUsize::new(0))));
        let k = LateKeepalive::wanted();
        k.come_due();
        assert!(k.take_due(&waker));
        assert!(!k.take_due(&waker));
    }

    #[test]
    fn not_wanted_is_never_due() {
        let waker = Waker::from(Arc::new(Count(AtomicUsize::new(0))));
        let k = LateKeepalive::not_wanted();
        assert!(!k.pending());
        k.come_due();
        assert!(!k.take_due(&waker));
    }
}
