//! The facts about a Valkey node that every harness starting one relies on: this crate's
//! clusters and standalone servers, and the node agent of `shardgate-kube-harness`, which runs
//! the pods of Valkey images. Each is written here once and imported there.

use std::net::Ipv4Addr;

/// The client port a node listens on unless told otherwise.
pub const DEFAULT_PORT: u16 = 6379;

/// The cluster bus is on the client port + 10000 (Valkey's default, `cluster-port 0`).
pub const BUS_PORT_OFFSET: u16 = 10000;

/// The cluster bus port of a node whose client port is `port`; `None` past 65535.
pub fn bus_port(port: u16) -> Option<u16> {
    port.checked_add(BUS_PORT_OFFSET)
}

/// The server program the harnesses run (found by [`crate::tools::valkey_server`]).
pub const SERVER_PROGRAM: &str = "valkey-server";

/// The names a command may give the server: `valkey-server` answers to `redis-server` too.
pub const SERVER_COMMANDS: &[&str] = &[SERVER_PROGRAM, "redis-server"];

/// The names a command may give the command-line client (the harnesses run `redis-cli`,
/// found by [`crate::tools::redis_cli`], for both).
pub const CLI_COMMANDS: &[&str] = &["valkey-cli", "redis-cli"];

/// The repository name of a container image, without registry, path, tag or digest:
/// `registry:5000/org/valkey:9.0@sha256:...` -> `valkey`.
pub fn image_name(image: &str) -> &str {
    let repo = image.split('@').next().unwrap_or(image);
    let last = repo.rsplit('/').next().unwrap_or(repo);
    last.split(':').next().unwrap_or(last)
}

/// Whether a container image is a Valkey server, run as [`SERVER_PROGRAM`]: its repository
/// name (see [`image_name`]) contains `valkey` or `redis` (`valkey/valkey`,
/// `bitnami/redis-cluster`, ...).
pub fn is_server_image(image: &str) -> bool {
    let name = image_name(image);
    name.contains("valkey") || name.contains("redis")
}

/// The settings every `valkey-server` that a harness starts gets (as `--name value` flags or
/// config lines; where they go among the others is the caller's choice):
/// - `bind`: it listens on its own address `ip` only, as in its own network namespace;
/// - `bind-source-addr`: it also connects from `ip` (without it, nodes reach each other from
///   127.0.0.1 and the cluster handshake hangs);
/// - `set-proc-title no`: its command line stays as given, so that the harness marker on it
///   stays visible to the stray check and the reaper (see [`crate::procs`]).
pub fn local_settings(ip: Ipv4Addr) -> [(&'static str, String); 3] {
    [
        ("bind", ip.to_string()),
        ("bind-source-addr", ip.to_string()),
        ("set-proc-title", "no".to_string()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_names_and_kinds() {
        assert_eq!(
            image_name("registry:5000/org/valkey:9.0@sha256:abc"),
            "valkey"
        );
        assert_eq!(image_name("valkey/valkey"), "valkey");
        assert_eq!(image_name("bitnami/redis-cluster:7.2"), "redis-cluster");
        assert!(is_server_image("valkey/valkey:9.0"));
        assert!(is_server_image("docker.io/bitnami/redis-cluster:7.2"));
        // Only the repository name counts, not the registry or organisation.
        assert!(!is_server_image("ghcr.io/valkey-io/shardgate-proxy:0.1"));
        assert!(!is_server_image("nginx:1.27"));
    }

    #[test]
    fn bus_ports() {
        assert_eq!(bus_port(DEFAULT_PORT), Some(16379));
        assert_eq!(bus_port(u16::MAX - BUS_PORT_OFFSET), Some(u16::MAX));
        assert_eq!(bus_port(u16::MAX - BUS_PORT_OFFSET + 1), None);
    }
}
