//! A connection's two directions joined, each polled only when it was woken.
//!
//! `tokio::try_join!` polls every unfinished branch on every wake-up of the task. A
//! connection wakes twice per request at pipeline 1 (the request comes, then the reply),
//! and each time the direction that was not woken asked its socket again for nothing: its
//! readiness read, its waiters' lock taken, its waker compared. Here each direction is
//! polled with a waker of its own, which marks it woken before it wakes the task, and a
//! wake-up polls only the marked directions (as `FuturesUnordered` does for any number of
//! futures). A wake-up by anything else (the idle timer, the drain's end) polls neither.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Wake, Waker};

use pin_project_lite::pin_project;

/// One direction's mark, and the task to wake after setting it.
struct Mark {
    woken: AtomicBool,
    /// The task's waker, as of its last poll. A lock rather than an `AtomicWaker`, whose
    /// wake takes the waker out and makes the next poll register it again: here it stays,
    /// and a poll by the same task (every poll, in practice) does not touch it.
    task: Mutex<Option<Waker>>,
}

impl Wake for Mark {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // Marked first: the task, once woken, must find the mark.
        self.woken.store(true, Ordering::Release);
        let task = self.task.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(task) = &*task {
            task.wake_by_ref();
        }
    }
}

/// One direction's mark and the waker it is polled with (made once: the same waker on
/// every poll, so what it waits on keeps it without cloning it again).
struct Branch {
    mark: Arc<Mark>,
    waker: Waker,
}

impl Branch {
    fn new() -> Self {
        // Marked: the first poll polls both.
        let mark = Arc::new(Mark {
            woken: AtomicBool::new(true),
            task: Mutex::new(None),
        });
        Branch {
            waker: Waker::from(mark.clone()),
            mark,
        }
    }

    /// Whether this direction was woken since it was last polled; unmarks it.
    fn take(&self) -> bool {
        // A load first: the mark is usually clear for one of the two, and a load is
        // cheaper than a swap.
        self.mark.woken.load(Ordering::Relaxed) && self.mark.woken.swap(false, Ordering::Acquire)
    }

    /// Keeps the task's waker for the wakes to come.
    fn register(&self, task: &Waker) {
        let mut kept = self
            .mark
            .task
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match &*kept {
            Some(k) if k.will_wake(task) => {}
            _ => *kept = Some(task.clone()),
        }
    }
}

pin_project! {
    /// Both futures until both are done or one fails (see the module's doc).
    pub struct TryJoin<A, B> {
        #[pin]
        a: A,
        #[pin]
        b: B,
        branches: [Branch; 2],
        done: [bool; 2],
        b_first: bool,
        // The task's waker the branches keep, to skip their locks when it is the same.
        task: Option<Waker>,
    }
}

/// Runs `a` and `b` to completion, or until one of them fails: that error, the other
/// dropped (as `tokio::try_join!`).
pub fn try_join<A, B, E>(a: A, b: B) -> TryJoin<A, B>
where
    A: Future<Output = Result<(), E>>,
    B: Future<Output = Result<(), E>>,
{
    TryJoin {
        a,
        b,
        branches: [Branch::new(), Branch::new()],
        done: [false; 2],
        b_first: false,
        task: None,
    }
}

/// Polls one branch if it was woken and has not ended: the error it ended with, if any.
/// Inlined: out of line it is a call per branch per wake-up, the copy loop inside it.
#[inline(always)]
fn step<F, E>(f: Pin<&mut F>, branch: &Branch, done: &mut bool) -> Option<E>
where
    F: Future<Output = Result<(), E>>,
{
    if *done || !branch.take() {
        return None;
    }
    match f.poll(&mut Context::from_waker(&branch.waker)) {
        Poll::Ready(Ok(())) => {
            *done = true;
            None
        }
        Poll::Ready(Err(e)) => Some(e),
        Poll::Pending => None,
    }
}

impl<A, B, E> Future for TryJoin<A, B>
where
    A: Future<Output = Result<(), E>>,
    B: Future<Output = Result<(), E>>,
{
    type Output = Result<(), E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        // Kept before the marks are read: a wake after the read then finds the task.
        if !this.task.as_ref().is_some_and(|t| t.will_wake(cx.waker())) {
            for branch in this.branches.iter() {
                branch.register(cx.waker());
            }
            *this.task = Some(cx.waker().clone());
        }
        // Each goes first every other poll (as `try_join!` rotates): a direction that spends
        // the task's whole coop budget (a client uploading faster than a poll drains) must
        // not keep the other from its turn, which would hold the replies back.
        let b_first = std::mem::replace(this.b_first, !*this.b_first);
        let [ba, bb] = &*this.branches;
        let [done_a, done_b] = this.done;
        let failed = if b_first {
            step(this.b.as_mut(), bb, done_b).or_else(|| step(this.a.as_mut(), ba, done_a))
        } else {
            step(this.a.as_mut(), ba, done_a).or_else(|| step(this.b.as_mut(), bb, done_b))
        };
        if let Some(e) = failed {
            return Poll::Ready(Err(e));
        }
        if *done_a && *done_b {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// A task's waker that counts its wakes.
    #[derive(Default)]
    struct Task(AtomicUsize);

    impl Wake for Task {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref()
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    impl Task {
        fn woken(&self) -> usize {
            self.0.load(Ordering::Relaxed)
        }
    }

    /// A branch that counts its polls, keeps the waker it was polled with, and ends with
    /// what `outcome` holds once it holds something.
    #[derive(Default)]
    struct Probe {
        polls: AtomicUsize,
        waker: Mutex<Option<Waker>>,
        outcome: Mutex<Option<Result<(), &'static str>>>,
        /// Woken by this branch's poll: another branch's waker.
        wakes: Mutex<Option<Waker>>,
    }

    impl Probe {
        fn polls(&self) -> usize {
            self.polls.load(Ordering::Relaxed)
        }

        fn wake(&self) {
            let waker = self.waker.lock().unwrap().clone();
            waker.expect("never polled").wake();
        }

        fn end(&self, outcome: Result<(), &'static str>) {
            *self.outcome.lock().unwrap() = Some(outcome);
        }

        async fn run(&self) -> Result<(), &'static str> {
            std::future::poll_fn(|cx| {
                self.polls.fetch_add(1, Ordering::Relaxed);
                *self.waker.lock().unwrap() = Some(cx.waker().clone());
                if let Some(w) = self.wakes.lock().unwrap().take() {
                    w.wake();
                }
                match self.outcome.lock().unwrap().take() {
                    Some(outcome) => Poll::Ready(outcome),
                    None => Poll::Pending,
                }
            })
            .await
        }
    }

    fn poll<F: Future>(f: Pin<&mut F>, task: &Arc<Task>) -> Poll<F::Output> {
        f.poll(&mut Context::from_waker(&Waker::from(task.clone())))
    }

    #[test]
    fn a_wake_polls_only_the_branch_woken() {
        let (a, b) = (Probe::default(), Probe::default());
        let task = Arc::new(Task::default());
        let mut join = std::pin::pin!(try_join(a.run(), b.run()));
        assert!(poll(join.as_mut(), &task).is_pending());
        assert_eq!((a.polls(), b.polls()), (1, 1), "the first poll polls both");

        a.wake();
        assert_eq!(task.woken(), 1, "a branch's wake wakes the task");
        assert!(poll(join.as_mut(), &task).is_pending());
        assert_eq!((a.polls(), b.polls()), (2, 1));

        b.wake();
        assert!(poll(join.as_mut(), &task).is_pending());
        assert_eq!((a.polls(), b.polls()), (2, 2));

        // Woken by something else (a timer beside the join): neither is polled.
        assert!(poll(join.as_mut(), &task).is_pending());
        assert_eq!((a.polls(), b.polls()), (2, 2));

        // Both woken before the task runs: both polled, once each.
        a.wake();
        b.wake();
        assert!(poll(join.as_mut(), &task).is_pending());
        assert_eq!((a.polls(), b.polls()), (3, 3));
        assert_eq!(task.woken(), 4);
    }

    /// The branch polled second wakes the one polled first, whose turn has passed: that one
    /// is polled on the task's next poll, which the wake asked for. (The second poll puts
    /// `b` first, the third `a`.)
    #[test]
    fn a_wake_during_a_poll_is_not_lost() {
        let (a, b) = (Probe::default(), Probe::default());
        let task = Arc::new(Task::default());
        let mut join = std::pin::pin!(try_join(a.run(), b.run()));
        assert!(poll(join.as_mut(), &task).is_pending());
        *a.wakes.lock().unwrap() = b.waker.lock().unwrap().clone();
        a.wake();
        assert!(poll(join.as_mut(), &task).is_pending());
        assert_eq!((a.polls(), b.polls()), (2, 1));
        assert_eq!(task.woken(), 2, "a's wake, then b's from within a's poll");
        assert!(poll(join.as_mut(), &task).is_pending());
        assert_eq!((a.polls(), b.polls()), (2, 2));
    }

    /// Both woken on every poll (each wakes itself, as a branch out of coop budget does):
    /// each goes first every other poll, so neither holds the other back.
    #[test]
    fn the_branches_take_turns_going_first() {
        let order = Mutex::new(Vec::new());
        let branch = |name: &'static str| {
            let order = &order;
            std::future::poll_fn(move |cx| {
                order.lock().unwrap().push(name);
                cx.waker().wake_by_ref();
                Poll::<Result<(), ()>>::Pending
            })
        };
        let task = Arc::new(Task::default());
        let mut join = std::pin::pin!(try_join(branch("a"), branch("b")));
        for _ in 0..4 {
            assert!(poll(join.as_mut(), &task).is_pending());
        }
        let order = order.into_inner().unwrap();
        assert_eq!(order, ["a", "b", "b", "a", "a", "b", "b", "a"]);
    }

    /// A join moved to another task (another waker) wakes that task, not the first.
    #[test]
    fn wakes_go_to_the_task_that_polled_last() {
        let (a, b) = (Probe::default(), Probe::default());
        let (first, second) = (Arc::new(Task::default()), Arc::new(Task::default()));
        let mut join = std::pin::pin!(try_join(a.run(), b.run()));
        assert!(poll(join.as_mut(), &first).is_pending());
        assert!(poll(join.as_mut(), &second).is_pending());
        b.wake();
        assert_eq!((first.woken(), second.woken()), (0, 1));
    }

    #[test]
    fn ends_when_both_have_ended_or_one_failed() {
        let (a, b) = (Probe::default(), Probe::default());
        let task = Arc::new(Task::default());
        let mut join = std::pin::pin!(try_join(a.run(), b.run()));
        assert!(poll(join.as_mut(), &task).is_pending());
        a.end(Ok(()));
        a.wake();
        assert!(poll(join.as_mut(), &task).is_pending(), "b still runs");
        b.end(Ok(()));
        b.wake();
        assert_eq!(poll(join.as_mut(), &task), Poll::Ready(Ok(())));
        assert_eq!(
            (a.polls(), b.polls()),
            (2, 2),
            "an ended branch is not polled again"
        );

        for failing in [0, 1] {
            let (a, b) = (Probe::default(), Probe::default());
            let mut join = std::pin::pin!(try_join(a.run(), b.run()));
            assert!(poll(join.as_mut(), &task).is_pending());
            let probe = [&a, &b][failing];
            probe.end(Err("reset"));
            probe.wake();
            assert_eq!(poll(join.as_mut(), &task), Poll::Ready(Err("reset")));
        }
    }

    /// A task's waker that unparks the thread polling it, and counts its wakes.
    struct Unpark {
        thread: std::thread::Thread,
        wakes: AtomicUsize,
    }

    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref()
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.wakes.fetch_add(1, Ordering::SeqCst);
            self.thread.unpark();
        }
    }

    /// Woken from another thread once both branches wait: the task is woken, and the join
    /// ends as the branches do. Polled by hand, only after a wake, so that nothing else (a
    /// timer) can stand in for a lost one.
    #[test]
    fn woken_from_another_thread() {
        for _ in 0..100 {
            let (tx_a, rx_a) = tokio::sync::oneshot::channel::<()>();
            let (tx_b, rx_b) = tokio::sync::oneshot::channel::<()>();
            let (go, waiting) = std::sync::mpsc::channel::<()>();
            let sender = std::thread::spawn(move || {
                waiting.recv().unwrap();
                tx_b.send(()).unwrap();
                tx_a.send(()).unwrap();
            });
            let task = Arc::new(Unpark {
                thread: std::thread::current(),
                wakes: AtomicUsize::new(0),
            });
            let waker = Waker::from(task.clone());
            let mut cx = Context::from_waker(&waker);
            let mut joined = std::pin::pin!(try_join(
                async { rx_a.await.map_err(|_| "a dropped") },
                async { rx_b.await.map_err(|_| "b dropped") },
            ));
            assert!(joined.as_mut().poll(&mut cx).is_pending());
            go.send(()).unwrap();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            let mut seen = 0;
            let r = loop {
                while task.wakes.load(Ordering::SeqCst) == seen {
                    let left = deadline.saturating_duration_since(std::time::Instant::now());
                    assert!(!left.is_zero(), "a wake from the other thread was lost");
                    std::thread::park_timeout(left);
                }
                seen = task.wakes.load(Ordering::SeqCst);
                if let Poll::Ready(r) = joined.as_mut().poll(&mut cx) {
                    break r;
                }
            };
            assert_eq!(r, Ok(()));
            sender.join().unwrap();
        }
    }
}
