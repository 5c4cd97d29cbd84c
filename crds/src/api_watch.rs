//! How a client that watches the API server keeps a watch from going silent for long (the
//! operator's watches and the proxy's Kubernetes route source): the API server is asked to
//! end each watch after a while, and kube's watcher drops one that runs 5 s past that; the
//! client reads with a timeout 10 s past it too, for the lists and the requests that open
//! a watch, which the watcher's own check does not cover.

use std::time::Duration;

/// `watch` as the whole seconds the API server takes: kube's watcher allows 1 to 290.
pub fn watch_secs(watch: Duration) -> u32 {
    u32::try_from(watch.as_secs())
        .unwrap_or(u32::MAX)
        .clamp(1, 290)
}

/// The read timeout of a client that only lists and watches: past the end of any watch of
/// `watch`.
pub fn read_timeout(watch: Duration) -> Duration {
    Duration::from_secs(u64::from(watch_secs(watch)) + 10)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_seconds_within_what_the_watcher_takes_and_reads_past_them() {
        let secs = |ms| watch_secs(Duration::from_millis(ms));
        assert_eq!(secs(60_000), 60);
        assert_eq!(secs(4_500), 4);
        assert_eq!(secs(100), 1);
        assert_eq!(secs(3_600_000), 290);
        assert_eq!(
            read_timeout(Duration::from_secs(60)),
            Duration::from_secs(70)
        );
        assert_eq!(
            read_timeout(Duration::from_secs(3_600)),
            Duration::from_secs(300)
        );
    }
}
