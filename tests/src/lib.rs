//! Harnesses for shardgate's tests, benchmarks and demo.
//!
//! - [`valkey`]: real Valkey 9 clusters on loopback, one address per node, as pods have.
//! - [`tools`]: finding the external programs (valkey-server, redis-cli, ...) that
//!   `scripts/setup` installs, with a clear error when one is missing.
//! - [`addr`]: loopback addresses for nodes, unique across concurrently running tests.
//! - [`tls`]: test certificates made at run time (a CA, `*.<domain>` leaves, an expired one,
//!   client certificates, another CA) and a rustls client that dials 127.0.0.1 with any SNI.
//! - [`stunnel`]: TLS-speaking nodes (stunnel in front of valkey-server, built without TLS).
//! - [`kube`]: a real Kubernetes control plane (etcd, kube-apiserver,
//!   kube-controller-manager) and a node agent that runs pods as local processes.

pub mod addr;
pub mod clients;
pub mod fuzz;
pub mod http;
pub mod kube;
pub mod procs;
pub mod proxy_process;
pub mod routes;
pub mod stunnel;
pub mod tls;
pub mod tools;
pub mod valkey;
