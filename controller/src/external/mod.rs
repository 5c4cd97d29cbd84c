//! External access in announce mode (`spec.externalAccess`, `mode: announce`): Valkey itself
//! hands out the external endpoints, reached through Services or a Gateway.
//!
//! - [`services`]: the per-shard (or per-node) Services, the NodePorts and LoadBalancer
//!   ingress read back from them, and the removal of Services no longer needed.
//! - [`gateway`]: with `gateway` set, one TCPRoute per node on the user's Gateway, and what
//!   the Gateway lacks.
//! - [`proxy`]: proxy mode, `shardgate-proxy` in front of the cluster (its Deployment,
//!   Service, PDB, ServiceAccount and Role) and the endpoints it gives.
//! - [`announce`]: the flags each node announces its endpoint with, and the per-node hash
//!   that rolls a node whose flags change.
//! - [`endpoints`]: `status.externalEndpoints` and `status.bootstrap`: each node's host (the
//!   `advertisedHost`, the LoadBalancer's ingress, or its Kubernetes node's address) and port.

pub mod announce;
pub mod endpoints;
pub mod gateway;
pub mod proxy;
pub mod services;

use shardgate_crds::external_access::{ExternalAccess, ExternalAccessMode};
use shardgate_crds::valkey_cluster::ValkeyCluster;

pub use endpoints::External;
pub use services::{Exposure, Exposures};

/// The `externalAccess` block when it is enabled in announce mode (what this module acts
/// on); `None` renders the cluster exactly as without the block.
pub fn announce_mode(vc: &ValkeyCluster) -> Option<&ExternalAccess> {
    vc.spec
        .external_access()
        .filter(|ea| ea.mode == ExternalAccessMode::Announce)
}
