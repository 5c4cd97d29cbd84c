//! A counter that the copy loops of many threads add to without sharing a cache line.
//!
//! Every read adds its byte count to `bytes_total`. With one atomic per label set, the
//! worker threads bounce its cache line between them on each add; here each thread adds
//! to a slot of its own and a scrape sums the slots, so the count stays exact.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};

/// Slots per counter: the threads beyond this many share slots (still exact, just shared).
const SLOTS: usize = 8;

/// A slot on a cache line of its own (128 bytes: adjacent-line prefetch pairs lines).
#[derive(Debug, Default)]
#[repr(align(128))]
struct Slot(AtomicU64);

/// The next thread's slot.
static NEXT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static MINE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % SLOTS;
}

/// A monotonic counter, cloned as cheaply as `Counter` (an `Arc`), exposed as a counter.
#[derive(Debug, Clone, Default)]
pub struct PerThreadCounter(Arc<[Slot; SLOTS]>);

impl PerThreadCounter {
    #[inline]
    pub fn inc_by(&self, v: u64) {
        // During thread teardown the slot index is gone: slot 0 counts it.
        let i = MINE.try_with(|i| *i).unwrap_or(0);
        self.0[i].0.fetch_add(v, Ordering::Relaxed);
    }

    /// The sum of every thread's adds.
    pub fn get(&self) -> u64 {
        self.0
            .iter()
            .fold(0u64, |sum, s| sum.wrapping_add(s.0.load(Ordering::Relaxed)))
    }
}

impl TypedMetric for PerThreadCounter {
    const TYPE: MetricType = MetricType::Counter;
}

impl EncodeMetric for PerThreadCounter {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        encoder.encode_counter::<NoLabelSet, _, u64>(&self.get(), None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::registry::Registry;

    #[test]
    fn adds_from_many_threads_sum_exactly_and_encode_as_a_counter() {
        let c = PerThreadCounter::default();
        std::thread::scope(|s| {
            for _ in 0..(SLOTS + 3) {
                let c = c.clone();
                s.spawn(move || {
                    for _ in 0..1000 {
                        c.inc_by(3);
                    }
                });
            }
        });
        assert_eq!(c.get(), 3 * 1000 * (SLOTS as u64 + 3));

        let mut registry = Registry::default();
        let family = Family::<Vec<(String, String)>, PerThreadCounter>::default();
        registry.register("bytes", "Bytes", family.clone());
        family
            .get_or_create(&vec![("port".into(), "1".into())])
            .inc_by(42);
        let mut out = String::new();
        encode(&mut out, &registry).unwrap();
        assert!(out.contains("# TYPE bytes counter"), "{out}");
        assert!(out.contains("bytes_total{port=\"1\"} 42"), "{out}");
    }
}
