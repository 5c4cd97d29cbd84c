//! The shardgate operator: runs `ValkeyCluster` resources.
//!
//! - [`reconcile`]: the reconciler, the error policy and the controller that runs them.
//! - Children, one file per kind, each applied with server-side apply under one field
//!   manager: [`configmap`] (`valkey.conf` and its hash), [`service`] (the headless
//!   Service), [`statefulset`] (one per node), [`pdb`].
//! - [`external`]: external access in announce mode: the per-shard (or per-node) Services,
//!   the announce flags, `status.externalEndpoints` and `status.bootstrap`.
//! - [`tls`]: `spec.tls`: the Secret in the pods, valkey.conf on TLS, and how the operator
//!   dials such nodes.
//! - [`pods`]: each node's pod (address, readiness, config hash) from the index labels.
//! - [`formation`]: forming and healing the cluster over RESP (MEET, FORGET, ADDSLOTSRANGE,
//!   REPLICATE), one step per reconcile.
//! - [`rolling`]: config, image and resources changes, one pod at a time, replicas first,
//!   failover first.
//! - [`scale`]: removing the nodes a smaller `replicas` no longer has (failover first).
//! - [`status`]: conditions, phase and counts, written with server-side apply.
//! - [`leader`]: leader election on a Lease.
//! - [`client`]: the API clients, for calls (with a read timeout) and for watches.
//! - [`context`], [`error`], [`metrics`], [`objects`] (labels, owner references, apply),
//!   [`http`] (`/metrics`, `/healthz`, `/readyz`), [`per_cluster`] (what is remembered of
//!   each cluster between reconciles).
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

pub mod client;
pub mod configmap;
pub mod context;
pub mod error;
pub mod external;
pub mod formation;
pub mod http;
pub mod leader;
pub mod metrics;
pub mod objects;
pub mod pdb;
pub mod per_cluster;
pub mod pods;
pub mod reconcile;
pub mod rolling;
pub mod scale;
pub mod service;
pub mod statefulset;
pub mod status;
pub mod tls;

pub use context::Context;
pub use error::{Error, Result};
pub use reconcile::{run, Scope};
