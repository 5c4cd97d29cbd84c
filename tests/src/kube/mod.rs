//! A real Kubernetes control plane for the tests, with no containers.
//!
//! - [`ControlPlane`]: etcd, kube-apiserver and kube-controller-manager (built by
//!   `scripts/setup-k8s`) on loopback, with a throwaway PKI, an admin token, a kubeconfig
//!   for `kubectl`, the Gateway API experimental CRDs and any YAML the test names.
//! - [`NodeAgent`]: the one node, standing in for the kubelet (pods run as local processes on
//!   their own 127.x IPs), kube-proxy (NodePorts) and a LoadBalancer implementation.
//! - [`Suite`]: one control plane shared by the tests of a test binary, each in its own
//!   namespace, torn down when they are done (also when one fails or panics).
//!
//! Processes of a test process that died are reaped by the next run ([`process`]).

pub mod agent;
mod control_plane;
mod crds;
mod pki;
pub mod process;
mod suite;

pub use agent::{Fault, NodeAgent, NODE_NAME};
pub use control_plane::{gateway_api_crds_dir, yaml_files_in, ControlPlane, Options};
pub use crds::FIELD_MANAGER;
pub use suite::{Suite, TestEnv};
