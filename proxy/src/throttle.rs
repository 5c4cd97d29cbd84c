//! Log lines that a flood would repeat: a connection refused at a limit, an address no route
//! knows. One line per key per period, which says how many were left out since the last
//! (`suppressed` in the line).
//! The metrics count every one; the log only has to say that it is happening.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// At most one line per key per `every`.
#[derive(Debug)]
pub struct Throttle<K> {
    every: Duration,
    /// Past this many keys, those whose period is over are forgotten (at each call until
    /// the map is back under it), so that distinct keys met over time (bogus addresses in
    /// replies, say) do not pile up. Keys met within one period are all kept.
    remembered: usize,
    /// Key → when its last line was logged, and how many were left out since.
    last: Mutex<HashMap<K, (Instant, u64)>>,
}

impl<K: Hash + Eq + Clone> Throttle<K> {
    pub fn new(every: Duration, remembered: usize) -> Self {
        Throttle {
            every,
            remembered,
            last: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a line for `key` is due now: `Some(n)`, with the `n` left out since the
    /// last one, or `None`: leave this one out.
    pub fn due(&self, key: &K) -> Option<u64> {
        self.due_at(key, Instant::now())
    }

    pub(crate) fn due_at(&self, key: &K, now: Instant) -> Option<u64> {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if last.len() > self.remembered {
            last.retain(|_, (at, _)| now.duration_since(*at) < self.every);
        }
        match last.get_mut(key) {
            Some((at, left_out)) if now.duration_since(*at) < self.every => {
                *left_out += 1;
                None
            }
            Some((at, left_out)) => {
                *at = now;
                Some(std::mem::take(left_out))
            }
            None => {
                last.insert(key.clone(), (now, 0));
                Some(0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_key_per_period_with_the_count_left_out() {
        let t = Throttle::new(Duration::from_secs(10), 8);
        let now = Instant::now();
        assert_eq!(t.due_at(&"a", now), Some(0));
        assert_eq!(t.due_at(&"a", now + Duration::from_secs(1)), None);
        assert_eq!(t.due_at(&"a", now + Duration::from_secs(9)), None);
        // Another key is its own.
        assert_eq!(t.due_at(&"b", now + Duration::from_secs(9)), Some(0));
        // The period is over: a line, which says two were left out.
        assert_eq!(t.due_at(&"a", now + Duration::from_secs(10)), Some(2));
        assert_eq!(t.due_at(&"a", now + Duration::from_secs(11)), None);
        assert_eq!(t.due_at(&"a", now + Duration::from_secs(25)), Some(1));
    }

    #[test]
    fn past_the_keys_it_remembers_it_forgets_those_whose_period_is_over() {
        let t = Throttle::new(Duration::from_secs(10), 2);
        let now = Instant::now();
        for k in 0..3 {
            assert_eq!(t.due_at(&k, now), Some(0));
        }
        // Within the period nothing is forgotten, however many keys.
        assert_eq!(t.due_at(&0, now + Duration::from_secs(1)), None);
        assert_eq!(t.due_at(&3, now + Duration::from_secs(11)), Some(0));
        assert_eq!(t.last.lock().unwrap().len(), 1, "the three old keys went");
    }
}
