//! The contracts shared by the shardgate operator, the proxy and the tests.
//!
//! - [`ports`]: node identity (shard index, node index), flat indices and external ports.
//! - [`names`]: hostnames (per shard, per node, bootstrap) and the labels on every object.
//! - [`backend`]: a node's address as the proxy dials it (IP or DNS name, and a port).
//! - [`route_file`]: the proxy's route file, one serde type for its reader and its writers.
//! - [`settings`]: the proxy's settings: its command line, its defaults, and the arguments
//!   that start it.
//! - [`api_watch`]: how the operator and the proxy keep a watch on the API server from
//!   going silent for long.
//! - [`valkey_cluster`] (feature `resource`): the `ValkeyCluster` custom resource, its
//!   defaults and its validation (CEL in the CRD, the same rules in Rust), and the CRD YAML
//!   (`crdgen`).
//! - [`external_access`] (feature `resource`): its `spec.externalAccess` block.
//! - [`validation`] (feature `resource`): the resource's rules, as CEL in the CRD and in Rust.
//!
//! The feature `resource` brings in kube and k8s-openapi; the proxy does without it. The
//! feature `test-util` adds fixtures: `ValkeyCluster::test("vc").shards(3).replicas(1)`.
//!
//! Everything that turns a (shard, node) pair into a number or a name, and every format
//! that one half writes and the other reads, lives here, so that the operator, the proxy and
//! the tests can never disagree about it.
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

pub mod api_watch;
pub mod backend;
pub mod names;
pub mod ports;
pub mod route_file;
pub mod settings;

#[cfg(feature = "resource")]
#[macro_use]
mod string_enum;
#[cfg(feature = "resource")]
pub mod external_access;
#[cfg(all(feature = "resource", any(test, feature = "test-util")))]
mod fixtures;
#[cfg(feature = "resource")]
pub mod validation;
#[cfg(feature = "resource")]
pub mod valkey_cluster;

pub use backend::{Backend, BackendError, Host};
pub use names::{bootstrap_hostname, node_hostname, shard_hostname, HostnameTarget, Hostnames};
pub use ports::{NodeIndex, NodeRef, PortError, PortLayout, ShardIndex};
pub use route_file::{NodeEntry, NodeSpec, RouteEntry, RouteFile, RouteFileError, ShardEntry};
pub use settings::ProxySettings;
#[cfg(feature = "resource")]
pub use string_enum::UnknownValue;
#[cfg(feature = "resource")]
pub use validation::SpecError;
#[cfg(feature = "resource")]
pub use valkey_cluster::{ValkeyCluster, ValkeyClusterSpec, ValkeyClusterStatus};
