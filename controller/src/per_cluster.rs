//! What the operator remembers of each cluster from one reconcile to the next: counts
//! (consecutive failures for the retry backoff, looks with nodes behind a renewed Secret)
//! and the warnings of lasting states already published (one per episode of each).
//!
//! Each entry is kept with the cluster's uid: a cluster deleted and made again under the
//! same name starts afresh (its warnings are published again), and the entries of
//! clusters no longer in the controller's cache are dropped ([`Context::forget_gone`]), so
//! an operator that sees clusters come and go for months does not keep them all.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use kube::runtime::reflector::{ObjectRef, Store};
use kube::ResourceExt;
use shardgate_crds::valkey_cluster::ValkeyCluster;

use crate::context::Context;

/// A value per cluster, for the cluster with that name and uid.
pub struct PerCluster<V> {
    map: Mutex<HashMap<ObjectRef<ValkeyCluster>, Entry<V>>>,
}

struct Entry<V> {
    uid: Option<String>,
    value: V,
}

impl<V> Default for PerCluster<V> {
    fn default() -> Self {
        PerCluster {
            map: Mutex::new(HashMap::new()),
        }
    }
}

impl<V: Default> PerCluster<V> {
    /// Runs `f` on `vc`'s value (a fresh one for a cluster not seen, or seen with another
    /// uid); the entry is dropped when `f` leaves it at its default (`empty`).
    fn with<T>(
        &self,
        vc: &ValkeyCluster,
        empty: impl Fn(&V) -> bool,
        f: impl FnOnce(&mut V) -> T,
    ) -> T {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let key = ObjectRef::from_obj(vc);
        let uid = vc.uid();
        let entry = map.entry(key.clone()).or_insert_with(|| Entry {
            uid: uid.clone(),
            value: V::default(),
        });
        if entry.uid != uid {
            *entry = Entry {
                uid,
                value: V::default(),
            };
        }
        let out = f(&mut entry.value);
        if empty(&entry.value) {
            map.remove(&key);
        }
        out
    }

    /// Drops the entries of clusters that `live` does not know under the same uid.
    pub fn retain_live(&self, live: impl Fn(&ObjectRef<ValkeyCluster>) -> Option<String>) {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.retain(|key, entry| live(key).is_some_and(|uid| Some(uid) == entry.uid));
    }

    /// How many clusters have an entry.
    pub fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether no cluster has an entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Counts of things in a row per cluster.
pub type Counts = PerCluster<u32>;

impl Counts {
    /// `vc`'s count as it stands.
    pub fn get(&self, vc: &ValkeyCluster) -> u32 {
        self.with(vc, |n| *n == 0, |n| *n)
    }

    /// `vc`'s count, one more when `again`, else back to 0 (and forgotten).
    pub fn count(&self, vc: &ValkeyCluster, again: bool) -> u32 {
        self.with(
            vc,
            |n| *n == 0,
            |n| {
                *n = if again { n.saturating_add(1) } else { 0 };
                *n
            },
        )
    }
}

/// The warnings of lasting states published per cluster, by reason: one per episode.
pub type Warnings = PerCluster<HashSet<&'static str>>;

impl Warnings {
    /// Whether the warning `reason` is to be published for `vc` now: true when its
    /// condition starts, false while it lasts ([`Warnings::cleared`] re-arms it).
    pub fn first(&self, vc: &ValkeyCluster, reason: &'static str) -> bool {
        self.with(vc, HashSet::is_empty, |set| set.insert(reason))
    }

    /// `reason`'s condition is over for `vc`: the next time it starts, it is warned of again.
    pub fn cleared(&self, vc: &ValkeyCluster, reason: &'static str) {
        self.with(vc, HashSet::is_empty, |set| set.remove(reason));
    }
}

impl Context {
    /// Drops what is remembered of clusters no longer in the controller's cache (deleted,
    /// or deleted and made again: another uid).
    pub fn forget_gone(&self) {
        let Some(clusters) = &self.clusters else {
            return;
        };
        let live = |key: &ObjectRef<ValkeyCluster>| live_uid(clusters, key);
        self.backoff.retain_live(live);
        self.reload_behind.retain_live(live);
        self.warned.retain_live(live);
    }
}

fn live_uid(clusters: &Store<ValkeyCluster>, key: &ObjectRef<ValkeyCluster>) -> Option<String> {
    clusters.get(key).and_then(|vc| vc.uid())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(name: &str, uid: &str) -> ValkeyCluster {
        let mut vc = ValkeyCluster::test(name);
        vc.metadata.uid = Some(uid.into());
        vc
    }

    /// Counts go up one look at a time, per cluster, and back to 0 at a look without.
    #[test]
    fn looks_in_a_row_are_counted_per_cluster() {
        let counts = Counts::default();
        let (a, b) = (cluster("a", "1"), cluster("b", "2"));
        assert_eq!(counts.count(&a, true), 1);
        assert_eq!(counts.count(&a, true), 2);
        assert_eq!(counts.count(&b, true), 1);
        assert_eq!(counts.count(&a, false), 0);
        assert_eq!(counts.count(&a, true), 1);
        assert_eq!(counts.count(&b, true), 2);
        assert_eq!((counts.get(&a), counts.get(&b)), (1, 2), "as they stand");
        counts.count(&a, false);
        counts.count(&b, false);
        assert_eq!(counts.get(&a), 0);
        assert!(counts.is_empty(), "forgotten at 0");
    }

    /// A warning is published when its condition starts, not again while it lasts, and
    /// again once it cleared and came back; per cluster and per reason.
    #[test]
    fn a_warning_is_published_when_its_condition_starts() {
        let warned = Warnings::default();
        let (a, b) = (cluster("a", "1"), cluster("b", "2"));
        assert!(warned.first(&a, "RollingBlocked"));
        assert!(!warned.first(&a, "RollingBlocked"), "not while it lasts");
        assert!(warned.first(&a, "FieldsIgnored"), "another reason");
        assert!(warned.first(&b, "RollingBlocked"), "another cluster");
        warned.cleared(&a, "RollingBlocked");
        assert!(
            !warned.first(&a, "FieldsIgnored"),
            "the other reason still lasts"
        );
        assert!(warned.first(&a, "RollingBlocked"), "blocked again");
        warned.cleared(&a, "RollingBlocked");
        warned.cleared(&a, "FieldsIgnored");
        warned.cleared(&b, "RollingBlocked");
        warned.cleared(&b, "NeverWarned");
        assert!(
            warned.is_empty(),
            "nothing kept for conditions that are over"
        );
    }

    /// A cluster deleted and made again under its name (another uid) is warned again, and
    /// its old count does not carry over.
    #[test]
    fn a_cluster_made_again_under_its_name_starts_afresh() {
        let (warned, counts) = (Warnings::default(), Counts::default());
        let (old, new) = (cluster("vc", "1"), cluster("vc", "2"));
        assert!(warned.first(&old, "GatewayAPIUnavailable"));
        assert_eq!(counts.count(&old, true), 1);
        assert_eq!(counts.count(&old, true), 2);
        assert!(warned.first(&new, "GatewayAPIUnavailable"));
        assert_eq!(counts.count(&new, true), 1);
        assert_eq!(
            (warned.len(), counts.len()),
            (1, 1),
            "the old uid's entry replaced"
        );
    }

    /// Entries are kept only for clusters known under the same uid.
    #[test]
    fn entries_of_clusters_gone_are_dropped() {
        let warned = Warnings::default();
        let (kept, deleted, remade) = (cluster("a", "1"), cluster("b", "2"), cluster("c", "3"));
        for vc in [&kept, &deleted, &remade] {
            assert!(warned.first(vc, "RollingBlocked"));
        }
        // What the controller's cache holds: a as it was, c made again (uid 4), b gone.
        let live = |key: &ObjectRef<ValkeyCluster>| match key.name.as_str() {
            "a" => Some("1".to_string()),
            "c" => Some("4".to_string()),
            _ => None,
        };
        warned.retain_live(live);
        assert_eq!(warned.len(), 1);
        assert!(!warned.first(&kept, "RollingBlocked"), "a's entry kept");
        assert!(
            warned.first(&deleted, "RollingBlocked"),
            "b's entry dropped"
        );
    }
}
