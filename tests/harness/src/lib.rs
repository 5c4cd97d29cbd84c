//! The Valkey test harness and the helpers shared by shardgate's tests, benchmarks and demo.
//! Nothing here knows Kubernetes: the control-plane harness, `shardgate-kube-harness`, builds
//! on this crate and takes its Valkey facts (ports, programs, image names) from
//! [`valkey::server`].
//!
//! - [`valkey`]: real Valkey 9 clusters and standalone servers on loopback, one address per
//!   node, as pods have; [`valkey::server`] holds the facts every harness that starts a node
//!   shares (bus port offset, default port, program and image names, the local settings).
//! - [`addr`]: loopback addresses for nodes and free ports, unique across concurrently running
//!   tests.
//! - [`tools`]: finding the external programs (valkey-server, redis-cli, etcd, ...) that
//!   `scripts/setup` installs, with a clear error when one is missing.
//! - [`procs`]: the harness directories and the marker on every process a harness starts;
//!   reaping what a killed test left behind.
//! - [`clients`]: real clients as the end-to-end tests drive them (redis-cli, the redis
//!   crate's cluster client) and keys spread over every slot.
//! - [`routes`]: the proxy's view of a harness cluster: its route file and the announce
//!   settings.
//! - [`proxy_process`]: the `shardgate-proxy` binary run as a child process.
//! - [`http`]: a minimal HTTP GET for the proxy's admin endpoints.
//! - [`tls`]: test certificates made at run time (a CA, `*.<domain>` leaves, an expired one,
//!   client certificates, another CA) and a rustls client that dials 127.0.0.1 with any SNI.
//! - [`stunnel`]: TLS-speaking nodes (stunnel in front of a plain valkey-server).
//! - [`fuzz`]: the seeded RNG and run settings of the time-bounded mutation fuzzers.
//! - [`tcp_table`]: the kernel's table of TCP sockets, for a socket's keepalive timer.
//! - [`stats`]: the median and spread over rounds that the load harnesses report.

pub mod addr;
pub mod clients;
pub mod fuzz;
pub mod http;
pub mod procs;
pub mod proxy_process;
pub mod routes;
pub mod stats;
pub mod stunnel;
pub mod tcp_table;
pub mod tls;
pub mod tools;
pub mod valkey;
