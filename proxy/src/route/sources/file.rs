//! Routes from a YAML file, reloaded when its content changes.
//!
//! # Format
//!
//! ```yaml
//! basePort: 30000        # listener port of shard 0, node 0
//! portsPerShard: 2       # optional; default: the largest shard's node count
//! shards:
//!   - nodes:             # node index = position; port = basePort + shard * portsPerShard + node
//!       - 10.0.0.1:6379                      # short form: host:port (IP or DNS name)
//!       - address: valkey-0-1.valkey:6379    # long form
//!         id: 9be423741f0a3b818f633a9c16a1cf9ef42922d0   # optional Valkey node id
//!         port: 31000                        # optional: a listener port of its own
//!         rewrite: false                     # optional: per listener
//!         tlsAddress: 10.0.0.2:6380          # optional: where the node speaks TLS (TLS port)
//!         primary: true                      # optional: default node 0 of each shard
//! rewrite: true          # optional: topology rewriting for all (default: --rewrite)
//! ```
//!
//! The file is polled rather than watched with inotify: a Kubernetes ConfigMap volume swaps
//! a symlink, which content polling sees and inode watches miss.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use shardgate_crds::{NodeRef, PortLayout};
use tokio_util::sync::CancellationToken;

use crate::route::{Backend, Route, RoutePublisher, RouteSource, Routes};

/// Why a route file was refused. The message names the file and the bad field.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("{path}: cannot read: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: invalid route file: {source}")]
    Yaml {
        path: PathBuf,
        source: serde_yaml::Error,
    },
    #[error("{path}: {field}: {message}")]
    Field {
        path: PathBuf,
        field: String,
        message: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RouteFile {
    base_port: u32,
    #[serde(default)]
    ports_per_shard: Option<u32>,
    /// Rewrite topology on every listener of this file (default: the command line's).
    #[serde(default)]
    rewrite: Option<bool>,
    shards: Vec<ShardEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ShardEntry {
    nodes: Vec<NodeEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum NodeEntry {
    Short(String),
    Long(NodeLong),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeLong {
    address: String,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    port: Option<u32>,
    #[serde(default)]
    rewrite: Option<bool>,
    /// Where the node speaks TLS, if elsewhere than `address` (for the TLS port).
    #[serde(default, rename = "tlsAddress")]
    tls_address: Option<String>,
    /// Whether the node is its shard's primary (for the shard's SNI name). The file cannot
    /// know the live role: default node 0 of each shard.
    #[serde(default)]
    primary: Option<bool>,
}

/// Parses and validates a route file's content. `rewrite` is the default for listeners the
/// file says nothing about.
pub fn parse(path: &Path, text: &str, rewrite: bool) -> Result<Routes, FileError> {
    let field = |field: String, message: String| FileError::Field {
        path: path.to_path_buf(),
        field,
        message,
    };
    let file: RouteFile = serde_yaml::from_str(text).map_err(|source| FileError::Yaml {
        path: path.to_path_buf(),
        source,
    })?;
    if file.shards.is_empty() {
        return Err(field(
            "shards".into(),
            "at least one shard is required".into(),
        ));
    }
    let widest = file.shards.iter().map(|s| s.nodes.len()).max().unwrap_or(0);
    if widest == 0 {
        return Err(field(
            "shards[0].nodes".into(),
            "every shard needs at least one node".into(),
        ));
    }
    let layout = PortLayout::new(
        file.base_port,
        file.shards.len() as u32,
        widest as u32 - 1,
        file.ports_per_shard,
    )
    .map_err(|e| {
        let name = match e {
            shardgate_crds::PortError::StrideTooSmall { .. } => "portsPerShard",
            _ => "basePort",
        };
        field(name.into(), e.to_string())
    })?;

    let mut routes = Routes::new();
    let mut owner: BTreeMap<u16, String> = BTreeMap::new();
    for (s, shard) in file.shards.iter().enumerate() {
        if shard.nodes.is_empty() {
            return Err(field(
                format!("shards[{s}].nodes"),
                "every shard needs at least one node".into(),
            ));
        }
        for (n, entry) in shard.nodes.iter().enumerate() {
            let at = format!("shards[{s}].nodes[{n}]");
            let node = NodeRef::new(s as u32, n as u32);
            let (address, id, port, node_rewrite, tls_address, primary) = match entry {
                NodeEntry::Short(a) => (a, None, None, None, None, None),
                NodeEntry::Long(l) => (
                    &l.address,
                    l.id.clone(),
                    l.port,
                    l.rewrite,
                    l.tls_address.as_ref(),
                    l.primary,
                ),
            };
            let tls_backend = match tls_address {
                Some(a) => Some(a.parse::<Backend>().map_err(
                    |e: crate::route::backend::BackendError| {
                        field(format!("{at}.tlsAddress"), e.to_string())
                    },
                )?),
                None => None,
            };
            let backend: Backend =
                address
                    .parse()
                    .map_err(|e: crate::route::backend::BackendError| {
                        field(format!("{at}.address"), e.to_string())
                    })?;
            if let Some(id) = &id {
                if id.len() != 40 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(field(
                        format!("{at}.id"),
                        format!("{id:?} is not a Valkey node id (40 hex digits)"),
                    ));
                }
            }
            let port = match port {
                Some(p) if p == 0 || p > 65535 => {
                    return Err(field(
                        format!("{at}.port"),
                        format!("{p} is not a port (1..=65535)"),
                    ))
                }
                Some(p) => p as u16,
                None => layout
                    .port(node)
                    .map_err(|e| field(at.clone(), e.to_string()))?,
            };
            if let Some(first) = owner.get(&port) {
                return Err(field(
                    format!("{at}.port"),
                    format!("listener port {port} is already used by {first}"),
                ));
            }
            owner.insert(port, at);
            routes.insert(
                port,
                Arc::new(Route {
                    node,
                    backend,
                    node_id: id.map(|i| i.to_ascii_lowercase()),
                    hostname: None,
                    rewrite: node_rewrite.or(file.rewrite).unwrap_or(rewrite),
                    primary: primary.unwrap_or(n == 0),
                    tls_backend,
                    slots: Vec::new(),
                }),
            );
        }
    }
    Ok(routes)
}

/// Reads and parses a route file.
pub fn load(path: &Path, rewrite: bool) -> Result<Routes, FileError> {
    let text = std::fs::read_to_string(path).map_err(|source| FileError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(path, &text, rewrite)
}

/// Polls a route file and publishes each valid new version.
pub struct FileSource {
    path: PathBuf,
    interval: Duration,
    rewrite: bool,
}

impl FileSource {
    pub fn new(path: PathBuf, interval: Duration, rewrite: bool) -> Self {
        FileSource {
            path,
            interval,
            rewrite,
        }
    }
}

impl RouteSource for FileSource {
    fn name(&self) -> &'static str {
        "file"
    }

    async fn run(self, publisher: RoutePublisher, shutdown: CancellationToken) {
        let name = self.name();
        // The content last seen, valid or not, so that a bad file is reported once.
        let mut seen: Option<Vec<u8>> = None;
        loop {
            match tokio::fs::read(&self.path).await {
                Ok(bytes) if seen.as_deref() != Some(&bytes[..]) => {
                    let result = std::str::from_utf8(&bytes)
                        .map_err(|e| FileError::Field {
                            path: self.path.clone(),
                            field: "(file)".into(),
                            message: format!("not UTF-8: {e}"),
                        })
                        .and_then(|text| parse(&self.path, text, self.rewrite));
                    seen = Some(bytes);
                    match result {
                        Ok(routes) => {
                            if let Err(e) = publisher.publish(name, routes) {
                                publisher.report_error(name, &e);
                            }
                        }
                        Err(e) => publisher.report_error(name, &e),
                    }
                }
                Ok(_) => {}
                Err(source) => {
                    // Report a vanished file once, then again when it comes back changed.
                    if seen.is_some() {
                        let e = FileError::Read {
                            path: self.path.clone(),
                            source,
                        };
                        publisher.report_error(name, &e);
                        seen = None;
                    }
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(self.interval) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(text: &str) -> Result<Routes, String> {
        parse(Path::new("routes.yaml"), text, false).map_err(|e| e.to_string())
    }

    #[test]
    fn ports_follow_the_flat_index() {
        let routes = p("basePort: 30000\nshards:\n- nodes: [10.0.0.1:6379, 10.0.0.2:6379]\n- nodes: [10.0.0.3:6379, 'valkey-1-1.valkey:6379']\n").unwrap();
        let ports: Vec<u16> = routes.keys().copied().collect();
        assert_eq!(ports, vec![30000, 30001, 30002, 30003]);
        assert_eq!(routes[&30002].node, NodeRef::new(1, 0));
        assert_eq!(routes[&30003].backend.to_string(), "valkey-1-1.valkey:6379");
    }

    #[test]
    fn ports_per_shard_leaves_gaps() {
        let routes = p("basePort: 30000\nportsPerShard: 3\nshards:\n- nodes: [10.0.0.1:6379]\n- nodes: [10.0.0.3:6379]\n").unwrap();
        assert_eq!(
            routes.keys().copied().collect::<Vec<_>>(),
            vec![30000, 30003]
        );
    }

    #[test]
    fn long_form_with_id_and_port() {
        let routes = p("basePort: 30000\nshards:\n- nodes:\n  - address: 10.0.0.1:6379\n    id: 9BE423741f0a3b818f633a9c16a1cf9ef42922d0\n    port: 31000\n").unwrap();
        let r = &routes[&31000];
        assert_eq!(
            r.node_id.as_deref(),
            Some("9be423741f0a3b818f633a9c16a1cf9ef42922d0")
        );
    }

    #[test]
    fn errors_name_the_bad_field() {
        for (text, want) in [
            ("basePort: 65535\nshards:\n- nodes: [a:1, b:1]\n", "routes.yaml: basePort: the last port, basePort 65535 + shards 1 * stride 2 - 1 = 65536, is past 65535"),
            ("basePort: 70000\nshards:\n- nodes: [a:1]\n", "basePort: basePort must be between 1 and 65535, got 70000"),
            ("basePort: 30000\nshards:\n- nodes: [a:1]\n- nodes: [b]\n", "shards[1].nodes[0].address: \"b\" has no port"),
            ("basePort: 30000\nshards:\n- nodes:\n  - address: a:1\n    port: 70000\n", "shards[0].nodes[0].port: 70000 is not a port"),
            ("basePort: 30000\nshards:\n- nodes: [a:1, b:1]\n- nodes:\n  - address: c:1\n    port: 30001\n", "shards[1].nodes[0].port: listener port 30001 is already used by shards[0].nodes[1]"),
            ("basePort: 30000\nshards:\n- nodes:\n  - address: a:1\n    id: xyz\n", "shards[0].nodes[0].id: \"xyz\" is not a Valkey node id"),
            ("basePort: 30000\nportsPerShard: 1\nshards:\n- nodes: [a:1, b:1]\n", "portsPerShard: portsPerShard (1) must be at least"),
            ("basePort: 30000\nshards: []\n", "shards: at least one shard"),
            ("basePort: 30000\nshards:\n- nodes: []\n", "every shard needs at least one node"),
            ("basePort: 30000\nshard:\n- nodes: [a:1]\n", "unknown field `shard`"),
            ("basePort: [\n", "invalid route file"),
            ("", "invalid route file"),
        ] {
            let err = p(text).unwrap_err();
            assert!(err.contains(want), "for {text:?}\n got: {err}\nwant: {want}");
        }
    }

    #[test]
    fn duplicate_shard_node_mix_is_an_error_not_a_panic() {
        // A node's listener port would collide with the next shard's computed port.
        let err = p("basePort: 30000\nshards:\n- nodes:\n  - address: a:1\n    port: 30001\n- nodes: [b:1]\n").unwrap_err();
        assert!(err.contains("already used by shards[0].nodes[0]"), "{err}");
    }
}
