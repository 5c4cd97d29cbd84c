//! Prometheus metrics of the operator, registering themselves (as controller-rs does).

use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub error: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabels {
    pub action: &'static str,
}

/// Reconciles: how many, how long, how many failed and why, and what they did to clusters.
pub struct Metrics {
    pub reconciles: Counter,
    pub failures: Family<ErrorLabels, Counter>,
    pub duration: Histogram,
    /// Formation actions taken (`meet`, `forget`, `addslots`, `replicate`, ...).
    pub actions: Family<ActionLabels, Counter>,
    /// 1 while this process holds the leader lease (or runs without election).
    pub leader: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            reconciles: Counter::default(),
            failures: Family::default(),
            duration: Histogram::new([0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]),
            actions: Family::default(),
            leader: Gauge::default(),
        }
    }
}

impl Metrics {
    pub fn register(self, registry: &mut Registry) -> Self {
        let r = registry.sub_registry_with_prefix("shardgate_operator");
        r.register("reconciles", "Reconciles run", self.reconciles.clone());
        r.register(
            "reconcile_errors",
            "Reconciles that failed, by error",
            self.failures.clone(),
        );
        r.register(
            "reconcile_duration_seconds",
            "How long reconciles took",
            self.duration.clone(),
        );
        r.register(
            "formation_actions",
            "Changes made to Valkey clusters, by kind",
            self.actions.clone(),
        );
        r.register(
            "leader",
            "1 while this process is the leader",
            self.leader.clone(),
        );
        self
    }

    /// Counts a reconcile and records its duration when the returned guard drops.
    pub fn measure(&self) -> Measure<'_> {
        self.reconciles.inc();
        Measure {
            metrics: self,
            start: Instant::now(),
        }
    }
}

/// Records a reconcile's duration when dropped.
pub struct Measure<'a> {
    metrics: &'a Metrics,
    start: Instant,
}

impl Drop for Measure<'_> {
    fn drop(&mut self) {
        self.metrics
            .duration
            .observe(self.start.elapsed().as_secs_f64());
    }
}
