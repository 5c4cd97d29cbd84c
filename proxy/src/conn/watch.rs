//! A connection's copy, watched by the idle timeout and the drain's end, which are polled
//! only when one of them may have fired.
//!
//! `select!` polls every branch on every wake-up: at pipeline 1 that is two wake-ups per
//! request, each polling the idle timer (its waker registered again) and the cancellation
//! (a lock, another registration), and drawing a random number to pick the order. The
//! watchers fire once in a connection's life, if ever (the timer also once a second in,
//! when the node's socket gets keepalive: `conn::keepalive`). Each keeps the task's waker
//! from its last poll, so it still wakes the task when it fires; on other wake-ups two
//! loads (the hard stop's flag, the timer's elapsed state) show that it did not, and only
//! the copy is polled.
//!
//! Moving bytes sets a flag, and the idle timer reads the clock only when it looks, an
//! eighth of the timeout apart: reading the clock at every write was 6.5% of pass-through's
//! user-space instructions at pipeline 1 (callgrind). So a quiet connection closes between
//! the timeout and an eighth of it past that (nginx, likewise, moves a timer only when it
//! changes by more than 300 ms).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

use super::keepalive::{LateKeepalive, KEEPALIVE_AFTER};

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

/// Whether bytes moved since the idle timer last looked, how many directions have read
/// their end of stream, and the node socket's keepalive if it is set late.
pub struct Activity {
    moved: AtomicBool,
    ended: AtomicU8,
    pub keepalive: LateKeepalive,
}

impl Activity {
    /// A connection whose sockets have their options already.
    #[cfg(test)]
    pub fn new() -> Self {
        Self::with(LateKeepalive::not_wanted())
    }

    /// A connection whose node socket gets keepalive once it has lasted
    /// [`KEEPALIVE_AFTER`](super::keepalive::KEEPALIVE_AFTER): the watch says when.
    pub fn with(keepalive: LateKeepalive) -> Self {
        Activity {
            moved: AtomicBool::new(false),
            ended: AtomicU8::new(0),
            keepalive,
        }
    }

    /// Notes that one direction read its end of stream: whether the other had already.
    /// Then neither socket has bytes left unread (a close sends a FIN, not a reset).
    pub fn end_of_stream(&self) -> bool {
        self.ended.fetch_add(1, Ordering::Relaxed) > 0
    }

    /// Notes that bytes moved: one store, on every write.
    pub fn touch(&self) {
        self.moved.store(true, Ordering::Relaxed);
    }

    /// Whether bytes moved since the last look.
    fn look(&self) -> bool {
        self.moved.swap(false, Ordering::Relaxed)
    }
}

/// Looks of the idle timer per timeout: how late, at most, past the timeout a quiet
/// connection closes (an eighth of it), against how often a busy one's timer wakes its
/// task (eight times per timeout: every 7.5 minutes at the default hour).
const LOOKS: u32 = 8;

/// The idle timeout of one connection.
struct Idle {
    timeout: Duration,
    every: Duration,
    /// No byte has moved since this instant: when the timer last saw bytes had moved (or
    /// the watch began). The bytes moved at or before it.
    quiet_since: Instant,
}

impl Idle {
    /// The timeout `timeout` from `now`, `None` if twice it is too large to add to an
    /// instant (centuries): then it never runs out, and there is no timer at all.
    fn new(timeout: Duration, now: Instant) -> Option<Idle> {
        now.checked_add(timeout.checked_mul(2)?)?;
        Some(Idle {
            timeout,
            // The timer's resolution: a look now would look again at once.
            every: (timeout / LOOKS).max(Duration::from_millis(1)),
            quiet_since: now,
        })
    }

    /// When the timer next looks, seen from `now`: at the end of the timeout if that comes
    /// first. `None` once nothing has moved for the whole timeout.
    fn next_look(&self, now: Instant) -> Option<Instant> {
        // Cannot overflow unless the connection stayed busy for longer than a timeout that
        // `new` found twice too short to overflow.
        let due = self.quiet_since.checked_add(self.timeout)?;
        (due > now).then(|| {
            now.checked_add(self.every)
                .map_or(due, |look| look.min(due))
        })
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
        idle: Option<Idle>,
        // When the node socket's keepalive comes due, until it has.
        keepalive_at: Option<Instant>,
        // Whether the timer is set for a look or for the keepalive.
        timed: bool,
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
    let now = Instant::now();
    let idle = idle.and_then(|t| Idle::new(t, now));
    let keepalive_at = clock
        .keepalive
        .pending()
        .then(|| now.checked_add(KEEPALIVE_AFTER))
        .flatten();
    let next = earliest(idle.as_ref().and_then(|i| i.next_look(now)), keepalive_at);
    Watch {
        copy,
        // Without a next, never polled, and so never elapsed.
        timer: tokio::time::sleep_until(next.unwrap_or(now)),
        stopped: stop.token.cancelled(),
        stop,
        clock,
        idle,
        keepalive_at,
        timed: next.is_some(),
        first: true,
    }
}

/// The earlier of two optional instants.
fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
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
        if *this.first || this.stop.is_stopped() || (*this.timed && this.timer.is_elapsed()) {
            if this.stopped.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Watched::Stopped);
            }
            while *this.timed && this.timer.as_mut().poll(cx).is_ready() {
                let now = Instant::now();
                if this.keepalive_at.is_some_and(|at| at <= now) {
                    *this.keepalive_at = None;
                    this.clock.keepalive.come_due();
                }
                let look = match this.idle {
                    Some(idle) => {
                        if this.clock.look() {
                            idle.quiet_since = now;
                        }
                        match idle.next_look(now) {
                            Some(at) => Some(at),
                            None => return Poll::Ready(Watched::Idle),
                        }
                    }
                    None => None,
                };
                match earliest(look, *this.keepalive_at) {
                    Some(at) => this.timer.as_mut().reset(at),
                    // Without an idle timeout, nothing more to time once keepalive is set.
                    None => *this.timed = false,
                }
            }
            // A timer polled without coop budget is not armed: try again on the next poll
            // (which the runtime makes soon, having refused the budget). Asked after the
            // timer's polls, which take budget too.
            *this.first = !tokio::task::coop::has_budget_remaining();
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

    /// Bytes that move push the timeout back: it counts from the last of them, never less,
    /// and at most an eighth of it more (the timer looks an eighth apart).
    #[tokio::test(start_paused = true)]
    async fn activity_pushes_the_idle_timeout_back() {
        // Last moves at every phase of the timer's looks (625 ms apart), and on one (3 x
        // 3,125 ms: the copy, polled first, moves bytes as the timer fires).
        let gaps = (0..=16u64).map(|step| 3000 + 77 * step).chain([3125]);
        // With the node socket's keepalive to time as well (a second in), and without.
        for (gap, late) in gaps
            .map(Duration::from_millis)
            .flat_map(|gap| [(gap, false), (gap, true)])
        {
            let clock = match late {
                true => Activity::with(LateKeepalive::wanted()),
                false => Activity::new(),
            };
            let stop = HardStop::default();
            let started = Instant::now();
            let copy = async {
                for _ in 0..3 {
                    tokio::time::sleep(gap).await;
                    clock.touch();
                }
                std::future::pending::<()>().await
            };
            assert_eq!(run(copy, &stop, &clock).await, Watched::Idle);
            let quiet = started.elapsed() - 3 * gap;
            assert!(
                quiet >= IDLE && quiet <= IDLE + IDLE / 8,
                "closed {quiet:?} after the last bytes moved, timeout {IDLE:?}, keepalive \
                 timed {late}"
            );
        }
    }

    /// Timeouts at the edges: below eight timer ticks the timer still looks once a tick (a
    /// quiet copy closes at the timeout, not sooner, at most a millisecond later); one too
    /// large to add to an instant twice means no timer.
    #[tokio::test(start_paused = true)]
    async fn tiny_and_huge_timeouts() {
        for ms in [1, 4, 7] {
            let (stop, clock) = (HardStop::default(), Activity::new());
            let timeout = Duration::from_millis(ms);
            let started = Instant::now();
            let w = watch(std::future::pending::<()>(), &stop, &clock, Some(timeout));
            assert_eq!(w.await, Watched::Idle);
            let took = started.elapsed();
            assert!(
                took >= timeout && took <= timeout + Duration::from_millis(1),
                "a {timeout:?} timeout closed after {took:?}"
            );
        }
        assert!(Idle::new(Duration::MAX, Instant::now()).is_none());
        assert!(Idle::new(Duration::from_secs(u64::MAX / 4), Instant::now()).is_none());
        let (stop, clock) = (HardStop::default(), Activity::new());
        let copy = async {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            "done"
        };
        let r = watch(copy, &stop, &clock, Some(Duration::MAX)).await;
        assert_eq!(r, Watched::Done("done"));
    }

    /// A copy that moves bytes more often than the timeout never idles out, however its
    /// moves fall between the timer's looks.
    #[tokio::test(start_paused = true)]
    async fn a_copy_busy_within_the_timeout_stays_open() {
        for gap_ms in [100, 624, 625, 626, 4_375, 4_999] {
            let (stop, clock) = (HardStop::default(), Activity::new());
            let copy = async {
                for _ in 0..40 {
                    tokio::time::sleep(Duration::from_millis(gap_ms)).await;
                    clock.touch();
                }
                "done"
            };
            let r = run(copy, &stop, &clock).await;
            assert_eq!(r, Watched::Done("done"), "bytes moved every {gap_ms} ms");
        }
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

    /// A copy that never ends, standing in for a node's reader: counts its polls and notes
    /// when it was told to set keepalive.
    async fn keepalive_seen(
        idle: Option<Duration>,
        stop: &HardStop,
    ) -> (Watched<()>, Option<Duration>, usize) {
        let clock = Activity::with(LateKeepalive::wanted());
        let started = Instant::now();
        let (mut due_at, mut polls) = (None, 0);
        let copy = std::future::poll_fn(|cx| {
            polls += 1;
            if clock.keepalive.take_due(cx.waker()) {
                assert!(due_at.is_none(), "told twice");
                due_at = Some(started.elapsed());
            }
            Poll::<()>::Pending
        });
        let r = tokio::time::timeout(Duration::from_secs(3600), watch(copy, stop, &clock, idle))
            .await
            .expect("neither the copy nor a watcher ended it within an hour");
        (r, due_at, polls)
    }

    /// The node's reader is woken to set keepalive a second in, once, with or without an
    /// idle timeout; without one, nothing more is timed after it (a minute of paused time
    /// costs no poll but the drain's).
    #[tokio::test(start_paused = true)]
    async fn keepalive_comes_due_a_second_in_and_the_reader_is_woken_for_it() {
        let stop = HardStop::default();
        let (r, due_at, _) = keepalive_seen(Some(IDLE), &stop).await;
        assert_eq!(r, Watched::Idle);
        assert_eq!(due_at, Some(KEEPALIVE_AFTER));

        let stop = HardStop::default();
        stop_after(&stop, 60);
        let (r, due_at, polls) = keepalive_seen(None, &stop).await;
        assert_eq!(r, Watched::Stopped);
        assert_eq!(due_at, Some(KEEPALIVE_AFTER));
        // The first poll, the one woken by the timer, the reader's own wake, the drain's.
        assert!(polls <= 4, "{polls} polls in a minute");
    }

    /// A copy that spends the task's coop budget: on the first poll all of it (the timer
    /// cannot be armed then, and is on a later poll), then all but one unit, which each
    /// look takes (the timer, reset, is refused in the same poll; the look's own poll kept
    /// the waker). The quiet connection idles out on time, with the keepalive timed and
    /// without. It stays open for good if the timer is not tried again after a refusal.
    #[tokio::test(start_paused = true)]
    async fn a_copy_that_spends_the_budget_does_not_lose_the_timer() {
        for late in [false, true] {
            let clock = match late {
                true => Activity::with(LateKeepalive::wanted()),
                false => Activity::new(),
            };
            let stop = HardStop::default();
            let started = Instant::now();
            // Units of budget the copy finds on each poll, counted on its first (which it
            // spends whole).
            let mut units: Option<usize> = None;
            let copy = std::future::poll_fn(|cx| {
                let spend = |cx: &mut Context<'_>| {
                    let unit =
                        std::pin::pin!(tokio::task::coop::cooperative(std::future::ready(())));
                    unit.poll(cx).is_ready()
                };
                match units {
                    None => units = Some((0..).take_while(|_| spend(cx)).count()),
                    Some(n) => {
                        for _ in 1..n {
                            assert!(spend(cx), "fewer than {n} units");
                        }
                        assert!(tokio::task::coop::has_budget_remaining());
                    }
                }
                Poll::<()>::Pending
            });
            assert_eq!(
                run(copy, &stop, &clock).await,
                Watched::Idle,
                "keepalive timed {late}"
            );
            let quiet = started.elapsed();
            assert!(
                quiet >= IDLE && quiet <= IDLE + IDLE / 8,
                "closed after {quiet:?}"
            );
        }
    }

    /// A connection whose sockets have keepalive already has no keepalive timer: without an
    /// idle timeout, no timer at all.
    #[tokio::test(start_paused = true)]
    async fn without_late_keepalive_or_timeout_nothing_is_timed() {
        let (stop, clock) = (HardStop::default(), Activity::new());
        stop_after(&stop, 60);
        let mut polls = 0;
        let copy = std::future::poll_fn(|_| {
            polls += 1;
            Poll::<()>::Pending
        });
        let r = watch(copy, &stop, &clock, None).await;
        assert_eq!(r, Watched::Stopped);
        assert_eq!(polls, 2, "the first poll and the drain's");
    }
}
