//! A connection's copy raced against its watchers (the idle timer, the drain's end), with
//! the watchers polled only when they woke the task.
//!
//! `select!` polls every branch on every wake-up: at pipeline 1 that is two wake-ups per
//! request, each polling the idle timer (its waker registered again) and the cancellation
//! (a lock-free check and another registration), and drawing a random number to pick the
//! order. The watchers fire once in a connection's life, if ever. Here they get a waker of
//! their own that notes it fired before waking the task, so a wake-up from a socket polls
//! the copy alone.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

/// Which side finished first.
pub enum Raced<M, W> {
    Main(M),
    Watch(W),
}

/// The watchers' waker: notes that they fired, then wakes the task that polls them.
struct Fired {
    fired: AtomicBool,
    task: Mutex<Option<Waker>>,
}

impl Wake for Fired {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.fired.store(true, Ordering::Release);
        let task = match self.task.lock() {
            Ok(mut t) => t.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        if let Some(task) = task {
            task.wake();
        }
    }
}

/// Polls `main` until it completes, unless `watch` completes first. `watch` is polled on the
/// first poll and afterwards only once its own waker fired. Both are pinned by the caller,
/// where they live: moved in here, they would be stored twice in the caller's future.
pub struct Race<'a, M, W> {
    main: Pin<&'a mut M>,
    watch: Pin<&'a mut W>,
    fired: Arc<Fired>,
    /// `fired` as a waker, made once.
    waker: Waker,
}

impl<'a, M: Future, W: Future> Race<'a, M, W> {
    pub fn new(main: Pin<&'a mut M>, watch: Pin<&'a mut W>) -> Self {
        let fired = Arc::new(Fired {
            // Set: the first poll registers the watchers.
            fired: AtomicBool::new(true),
            task: Mutex::new(None),
        });
        let waker = Waker::from(fired.clone());
        Race {
            main,
            watch,
            fired,
            waker,
        }
    }
}

impl<M: Future, W: Future> Future for Race<'_, M, W> {
    type Output = Raced<M::Output, W::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if this.fired.fired.swap(false, Ordering::Acquire) {
            // The task's waker first: a watcher that fires while it is polled finds it.
            match this.fired.task.lock() {
                Ok(mut t) => *t = Some(cx.waker().clone()),
                Err(poisoned) => *poisoned.into_inner() = Some(cx.waker().clone()),
            }
            let mut watch_cx = Context::from_waker(&this.waker);
            if let Poll::Ready(w) = this.watch.as_mut().poll(&mut watch_cx) {
                return Poll::Ready(Raced::Watch(w));
            }
        }
        this.main.as_mut().poll(cx).map(Raced::Main)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::pin::pin;
    use std::time::Duration;

    async fn race<M: Future, W: Future>(main: M, watch: W) -> Raced<M::Output, W::Output> {
        Race::new(pin!(main), pin!(watch)).await
    }
    use tokio::sync::oneshot;

    #[tokio::test(start_paused = true)]
    async fn the_watch_wins_when_it_fires_first() {
        let main = std::future::pending::<()>();
        let watch = tokio::time::sleep(Duration::from_secs(5));
        assert!(matches!(race(main, watch).await, Raced::Watch(())));
    }

    #[tokio::test(start_paused = true)]
    async fn the_main_future_wins_when_it_ends_first() {
        let (tx, rx) = oneshot::channel::<u8>();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let _ = tx.send(7);
        });
        let watch = tokio::time::sleep(Duration::from_secs(5));
        assert!(matches!(race(rx, watch).await, Raced::Main(Ok(7))));
    }

    /// The watcher re-arms itself after a wake-up (as the idle timer does when bytes moved
    /// in the meantime): its second registration is honoured too.
    #[tokio::test(start_paused = true)]
    async fn a_watcher_that_waits_again_is_polled_again() {
        let watch = async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            tokio::time::sleep(Duration::from_secs(1)).await;
            "idle"
        };
        let started = tokio::time::Instant::now();
        let r = race(std::future::pending::<()>(), watch).await;
        assert!(matches!(r, Raced::Watch("idle")));
        assert_eq!(started.elapsed(), Duration::from_secs(2));
    }

    /// Wake-ups of the main future do not poll the watcher: a watcher that counts its polls
    /// sees only the first and the one its own waker caused.
    #[tokio::test(start_paused = true)]
    async fn wake_ups_from_the_main_future_leave_the_watch_alone() {
        let polls = std::cell::Cell::new(0u32);
        let mut sleep = Box::pin(tokio::time::sleep(Duration::from_secs(10)));
        let watch = std::future::poll_fn(|cx| {
            polls.set(polls.get() + 1);
            sleep.as_mut().poll(cx)
        });
        let main = async {
            for _ in 0..100 {
                tokio::task::yield_now().await;
            }
            tokio::time::sleep(Duration::from_secs(20)).await;
        };
        assert!(matches!(race(main, watch).await, Raced::Watch(())));
        assert_eq!(polls.get(), 2, "polled at the start and when its timer fired");
    }
}
