//! Where route tables come from, and how they are swapped in.
//!
//! - [`publisher`]: the [`RoutePublisher`] that validates a table against the proxy's own
//!   sockets, builds its address maps and swaps the [`Snapshot`] that every listener reads
//!   ([`RouteRx`]). This is where the table is swapped.
//! - [`file`](mod@file): routes from a YAML route file (the contracts crate's `RouteFile`), polled.
//! - [`seed`]: routes discovered from seed nodes ([`crate::discovery`]), refreshed.
//! - `kubernetes` (feature `kubernetes`): routes from the pods of a ValkeyCluster, watched
//!   on the Kubernetes API; the nodes asked for their ids as seed discovery asks them.

pub mod file;
#[cfg(feature = "kubernetes")]
pub mod kubernetes;
pub mod publisher;
pub mod seed;

use std::future::Future;

use tokio_util::sync::CancellationToken;

pub use file::FileSource;
#[cfg(feature = "kubernetes")]
pub use kubernetes::KubernetesSource;
pub use publisher::{HealthRx, PublishError, RoutePublisher, RouteRx, Snapshot, SourceHealth};
pub use seed::SeedSource;

/// A producer of route tables (a YAML file, a seed node, the Kubernetes API). It runs until `shutdown` and
/// hands every table it builds to the publisher; errors are reported there too, and never
/// replace the last good table.
pub trait RouteSource: Send + 'static {
    /// A short name for logs and metric labels.
    fn name(&self) -> &'static str;

    fn run(
        self,
        publisher: RoutePublisher,
        shutdown: CancellationToken,
    ) -> impl Future<Output = ()> + Send;
}
