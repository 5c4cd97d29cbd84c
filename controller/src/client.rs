//! The operator's two API clients, so that a connection to the API server that falls
//! silent (its node gone without a reset, a load balancer that drops it) stalls nothing
//! for long:
//! - calls (get, apply, the Lease) give up when no byte comes for [`ApiTimeouts::call`],
//!   and the reconcile is retried on another connection;
//! - watches are long polls with no byte for minutes when nothing changes, so they cannot
//!   have that timeout: instead the API server is asked to end each one after
//!   [`ApiTimeouts::watch`], and kube's watcher drops one that runs 5 s past it. The
//!   watches' client reads with a timeout 10 s past that, for the lists and the requests
//!   that open a watch, which the watcher's own check does not cover.
//!
//! kube's own defaults would leave a call with no timeout at all, and a watch silent for
//! 295 s.

use std::time::Duration;

use kube::Client;

/// How long the operator waits for the API server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiTimeouts {
    /// A call with no byte from the API server for this long fails.
    pub call: Duration,
    /// Each watch is renewed this often (as whole seconds, at least 1, at most 290:
    /// [`ApiTimeouts::watch_secs`]).
    pub watch: Duration,
}

impl ApiTimeouts {
    /// `--api-timeout`: calls time out after `call`, and watches are renewed twice as
    /// seldom (they stay open through quiet times).
    pub fn from_call(call: Duration) -> Self {
        ApiTimeouts {
            call,
            watch: call.saturating_mul(2),
        }
    }

    /// The watch timeout in the whole seconds the API server takes: kube's watcher allows
    /// at most 290.
    pub fn watch_secs(&self) -> u32 {
        shardgate_crds::api_watch::watch_secs(self.watch)
    }

    /// The watches' client's read timeout: past the end of any watch.
    pub fn watch_read(&self) -> Duration {
        shardgate_crds::api_watch::read_timeout(self.watch)
    }
}

impl Default for ApiTimeouts {
    fn default() -> Self {
        ApiTimeouts::from_call(Duration::from_secs(30))
    }
}

/// The client for calls: `config` with a read timeout of `timeouts.call`.
pub fn for_calls(mut config: kube::Config, timeouts: ApiTimeouts) -> Result<Client, kube::Error> {
    config.read_timeout = Some(timeouts.call);
    Client::try_from(config)
}

/// The client for watches: `config` with a read timeout 10 s past the time the API server
/// ends a watch in (see the module).
pub fn for_watches(mut config: kube::Config, timeouts: ApiTimeouts) -> Result<Client, kube::Error> {
    config.read_timeout = Some(timeouts.watch_read());
    Client::try_from(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watches_are_renewed_twice_as_seldom_within_what_the_watcher_takes() {
        let secs = |call| ApiTimeouts::from_call(Duration::from_millis(call)).watch_secs();
        assert_eq!(secs(30_000), 60);
        assert_eq!(secs(2_000), 4);
        assert_eq!(secs(100), 1);
        assert_eq!(secs(3_600_000), 290);
        let read = |call| ApiTimeouts::from_call(Duration::from_secs(call)).watch_read();
        assert_eq!(read(30), Duration::from_secs(70));
        assert_eq!(read(3_600), Duration::from_secs(300));
        assert_eq!(ApiTimeouts::default().call, Duration::from_secs(30));
    }
}
