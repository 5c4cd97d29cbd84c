//! A connection's copy, watched by the idle timeout and the drain's end, which are polled
//! only when one of them may have fired.
//!
//! `select!` polls every branch on every wake-up: at pipeline 1 that is two wake-ups per
//! request, each polling the idle timer (its waker registered again) and the cancellation
//! (a lock, another registration), and drawing a random number to pick the order. The
//! watchers fire once in a connection's life, if ever. Each keeps the task's waker from its
//! last poll, so it still wakes the task when it fires; on other wake-ups two loads (the
//! hard stop's flag, the timer's elapsed state) show that it did not, and only the copy is
//! polled.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

/// The drain's end: when the drain timeout runs out, every connection still open closes.
/// The token wakes the connections; the flag is what they check on a wake-up, one load
/// where the token's own check takes a lock.
#[derive(Clone, Default)]
pub struct HardStop {
    token: CancellationToken,
    stopped: Arc<AtomicBool>,
}

impl HardStop {
    pub fn stop(&self) {
        // The flag first: a connection woken by the token must find it set.
        self.stopped.store(true, Ordering::Release);
        self.token.cancel();
    }

    fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// The token, for what waits on it as a whole (the admin server).
    pub fn token(&self) -> &CancellationToken {
        &self.token
    }
}

/// When bytes last moved, in milliseconds since the connection started, and how many
/// directions have read their end of stream.
pub struct Activity {
    start: Instant,
    last_ms: AtomicU64,
    ended: AtomicU8,
}

impl Activity {
    pub fn new() -> Self {
        Activity {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
            ended: AtomicU8::new(0),
        }
    }

    /// Notes that one direction read its end of stream: whether the other had already.
    /// Then neither socket has bytes left unread (a close sends a FIN, not a reset).
    pub fn end_of_stream(&self) -> bool {
        self.ended.fetch_add(1, Ordering::Relaxed) > 0
    }

    pub fn touch(&self) {
        // Rounded up: the idle timeout then never counts from before the bytes moved.
        let ms = self.start.elapsed().as_micros().div_ceil(1000) as u64;
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }
}

/// How a watched copy ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Watched<T> {
    /// The copy ended by itself.
    Done(T),
    /// Nothing moved either way for the idle timeout.
    Idle,
    /// The hard stop came.
    Stopped,
}

pin_project! {
    /// `copy` until it ends, unless `stop` comes first or, with an idle timeout, nothing
    /// moves on `clock` for that long. One struct holding the three futures side by side,
    /// as `select!` did: an idle connection's memory is mostly this.
    pub struct Watch<'a, F> {
        #[pin]
        copy: F,
        #[pin]
        timer: Sleep,
        #[pin]
        stopped: WaitForCancellationFuture<'a>,
        stop: &'a HardStop,
        clock: &'a Activity,
        timeout: Option<Duration>,
        first: bool,
    }
}

/// Watches `copy` (see [`Watch`]).
pub fn watch<'a, F: Future>(
    copy: F,
    stop: &'a HardStop,
    clock: &'a Activity,
    idle: Option<Duration>,
) -> Watch<'a, F> {
    // A timeout too large to add to an instant means "never": no timer at all.
    let due = idle.and_then(|t| clock.last().checked_add(t).map(|due| (t, due)));
    Watch {
        copy,
        // Never polled without a timeout, and so never elapsed.
        timer: tokio::time::sleep_until(due.map_or(clock.start, |(_, due)| due)),
        stopped: stop.token.cancelled(),
        stop,
        clock,
        timeout: due.map(|(t, _)| t),
        first: true,
    }
}

impl<F: Future> Future for Watch<'_, F> {
    type Output = Watched<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        // The copy first: bytes that came as the timer fired count as activity.
        if let Poll::Ready(done) = this.copy.poll(cx) {
            return Poll::Ready(Watched::Done(done));
        }
        if *this.first || this.stop.is_stopped() || this.timer.is_elapsed() {
            // A timer polled without coop budget is not armed: try again on the next poll.
            *this.first = !tokio::task::coop::has_budget_remaining();
            if this.stopped.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Watched::Stopped);
            }
            if let Some(timeout) = *this.timeout {
                while this.timer.as_mut().poll(cx).is_ready() {
                    match this.clock.last().checked_add(timeout) {
                        Some(due) if due > Instant::now() => this.timer.as_mut().reset(due),
                        _ => return Poll::Ready(Watched::Idle),
                    }
                }
            }
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDLE: Duration = Duration::from_secs(5);

    /// `watch` with the idle timeout, given an hour (of paused time) to end.
    async fn run<F: Future>(copy: F, stop: &HardStop, clock: &Activity) -> Watched<F::Output> {
        let w = watch(copy, stop, clock, Some(IDLE));
        tokio::time::timeout(Duration::from_secs(3600), w)
            .await
            .expect("neither the copy nor a watcher ended it within an hour")
    }

    /// Stops `stop` after `secs` of (paused) time.
    fn stop_after(stop: &HardStop, secs: u64) {
        let stopper = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(secs)).await;
            stopper.stop();
        });
    }

    #[tokio::test(start_paused = true)]
    async fn a_quiet_copy_idles_out_at_the_timeout() {
        let (stop, clock) = (HardStop::default(), Activity::new());
        let started = Instant::now();
        let r = run(std::future::pending::<()>(), &stop, &clock).await;
        assert_eq!(r, Watched::Idle);
        assert_eq!(started.elapsed(), IDLE);
    }

    /// Bytes that move push the timeout back: it counts from the last of them.
    #[tokio::test(start_paused = true)]
    async fn activity_pushes_the_idle_timeout_back() {
        let (stop, clock) = (HardStop::default(), Activity::new());
        let started = Instant::now();
        let copy = async {
            for _ in 0..3 {
                tokio::time::sleep(Duration::from_secs(3)).await;
                clock.touch();
            }
            std::future::pending::<()>().await
        };
        assert_eq!(run(copy, &stop, &clock).await, Watched::Idle);
        assert_eq!(started.elapsed(), Duration::from_secs(9) + IDLE);
    }

    #[tokio::test(start_paused = true)]
    async fn the_copy_ending_first_wins() {
        let (stop, clock) = (HardStop::default(), Activity::new());
        let copy = async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            7
        };
        assert_eq!(run(copy, &stop, &clock).await, Watched::Done(7));
    }

    #[tokio::test(start_paused = true)]
    async fn the_hard_stop_ends_a_busy_copy_at_once() {
        let (stop, clock) = (HardStop::default(), Activity::new());
        stop_after(&stop, 2);
        let started = Instant::now();
        // Busy: wakes itself every 100 ms and moves bytes.
        let copy = async {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                clock.touch();
            }
        };
        let r: Watched<()> = run(copy, &stop, &clock).await;
        assert_eq!(r, Watched::Stopped);
        assert_eq!(started.elapsed(), Duration::from_secs(2));
        // Already stopped: the first poll says so.
        let r = run(std::future::pending::<()>(), &stop, &Activity::new()).await;
        assert_eq!(r, Watched::Stopped);
    }

    /// A quiet copy is ended by the hard stop's own wake-up, not by a later one.
    #[tokio::test(start_paused = true)]
    async fn the_hard_stop_ends_a_quiet_copy_at_once() {
        let (stop, clock) = (HardStop::default(), Activity::new());
        stop_after(&stop, 2);
        let started = Instant::now();
        let r = run(std::future::pending::<()>(), &stop, &clock).await;
        assert_eq!(r, Watched::Stopped);
        assert_eq!(started.elapsed(), Duration::from_secs(2));
    }

    /// No timeout: only the copy or the hard stop ends it.
    #[tokio::test(start_paused = true)]
    async fn without_a_timeout_nothing_idles_out() {
        let (stop, clock) = (HardStop::default(), Activity::new());
        let copy = async {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            "done"
        };
        let r = watch(copy, &stop, &clock, None).await;
        assert_eq!(r, Watched::Done("done"));
    }
}
