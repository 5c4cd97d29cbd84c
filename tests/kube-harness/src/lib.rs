//! A real Kubernetes control plane for the tests, with no containers. Built on the Valkey
//! harness, `shardgate-harness`: its loopback addresses, program lookup, process marker and
//! the Valkey facts of [`shardgate_harness::valkey::server`] are used here, not written again.
//!
//! - [`ControlPlane`] (`control_plane`): etcd, kube-apiserver and kube-controller-manager
//!   (built by `scripts/setup-k8s`) on loopback, with a kubeconfig for `kubectl`, the Gateway
//!   API experimental CRDs and any YAML the test names.
//! - `pki`: the control plane's throwaway PKI: a CA, the API server's certificate, a
//!   service-account key and an admin token.
//! - `crds`: applying YAML manifests with server-side apply ([`FIELD_MANAGER`]).
//! - [`agent`]: [`NodeAgent`], the one node, standing in for the kubelet (pods run as local
//!   processes on their own 127.x IPs), kube-proxy (NodePorts) and a LoadBalancer
//!   implementation; one file per part (`pods`, `services`, `images`, `env`, `expand`,
//!   `volumes`).
//! - [`Suite`] (`suite`): one control plane shared by the tests of a test binary, each in its
//!   own namespace, torn down when they are done (also when one fails or panics).
//! - [`process`]: the daemons and containers as child processes with their logs; processes
//!   of a test process that died are reaped by the next run.
//! - [`ApiRelay`] (`api_relay`): a relay in front of the API server that can fall silent,
//!   for clients under test.
//! - [`traefik`]: [`Traefik`], a real Gateway API data plane (Traefik's Kubernetes Gateway
//!   provider, built by `scripts/setup-traefik`) on a loopback IP, against the control plane.

pub mod agent;
mod api_relay;
mod control_plane;
mod crds;
mod pki;
pub mod process;
mod suite;
pub mod traefik;

pub use agent::{Fault, NodeAgent, NODE_NAME};
pub use api_relay::ApiRelay;
pub use control_plane::{gateway_api_crds_dir, yaml_files_in, ControlPlane, Options};
pub use crds::FIELD_MANAGER;
pub use suite::{Suite, TestEnv};
pub use traefik::{
    free_loopback_ip, traefik_binary, StatusAddress, Traefik, TRAEFIK_CONTROLLER_NAME,
};
