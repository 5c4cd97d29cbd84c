//! A node-port connection's future: its forward, then how it ended, counted and logged.
//!
//! Written out rather than an `async` block: a block that awaits a future it captured
//! keeps two slots for it (the capture, then the awaited copy), and this future is most of
//! what an idle connection costs.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use pin_project_lite::pin_project;
use tokio::sync::OwnedSemaphorePermit;

use super::forward::{Closed, ForwardError, Forwarder, Open};
use crate::model::Route;

/// What the end of a connection needs: who counts it, what it was, and its permit (of the
/// connection limit), given back when it ends.
pub struct Ending {
    pub forwarder: Arc<Forwarder>,
    pub route: Arc<Route>,
    pub peer: SocketAddr,
    pub open: Open,
    pub permit: OwnedSemaphorePermit,
}

pin_project! {
    /// `forward` until it ends, then its outcome handed to [`Forwarder::closed`].
    pub struct Serve<F> {
        #[pin]
        forward: F,
        // `None` once ended: the forward is not polled again.
        ending: Option<Ending>,
    }
}

impl<F> Serve<F> {
    pub fn new(forward: F, ending: Ending) -> Self {
        Serve {
            forward,
            ending: Some(ending),
        }
    }
}

impl<F> Future for Serve<F>
where
    F: Future<Output = Result<Closed, ForwardError>>,
{
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.project();
        if this.ending.is_none() {
            return Poll::Ready(());
        }
        let outcome = ready!(this.forward.poll(cx));
        if let Some(end) = this.ending.take() {
            let dialled = end.route.dialled(end.forwarder.backend_tls.is_some());
            end.forwarder
                .closed(end.open, Some(end.peer), dialled, outcome);
            drop(end.permit);
        }
        Poll::Ready(())
    }
}
