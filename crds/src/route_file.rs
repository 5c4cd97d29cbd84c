//! The proxy's route file: one serde type, read by the proxy and written by the test harness
//! and the operator, so that no two copies of the format can drift.
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
//! [`RouteFile`] is the document as written; [`RouteFile::entries`] validates it and gives
//! one [`RouteEntry`] per node, with errors that name the bad field.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{Backend, NodeRef, PortError, PortLayout};

/// A route file as written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RouteFile {
    /// The listener port of shard 0, node 0.
    pub base_port: u32,
    /// Ports reserved per shard; default: the largest shard's node count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports_per_shard: Option<u32>,
    /// Rewrite topology on every listener of this file (default: the command line's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rewrite: Option<bool>,
    pub shards: Vec<ShardEntry>,
}

/// One shard: its nodes, node index = position.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardEntry {
    pub nodes: Vec<NodeEntry>,
}

/// A node: `host:port` alone, or the long form.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum NodeEntry {
    Short(String),
    Long(NodeSpec),
}

/// A node in the long form.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeSpec {
    /// Where the proxy connects: `host:port`, an IP or a DNS name.
    pub address: String,
    /// The node's Valkey id (`CLUSTER MYID`), used by topology rewriting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// A listener port of its own instead of `basePort + flatIndex`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u32>,
    /// Topology rewriting on this listener.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rewrite: Option<bool>,
    /// Where the node speaks TLS, if elsewhere than `address` (for the TLS port).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_address: Option<String>,
    /// Whether the node is its shard's primary (for the shard's SNI name). A file cannot
    /// know the live role: default node 0 of each shard.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub primary: Option<bool>,
}

impl NodeSpec {
    /// The long form with only an address.
    pub fn new(address: impl Into<String>) -> Self {
        NodeSpec {
            address: address.into(),
            ..NodeSpec::default()
        }
    }
}

/// One validated node of a route file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteEntry {
    /// Its listener port.
    pub port: u16,
    pub node: NodeRef,
    pub backend: Backend,
    /// Lowercase Valkey node id, if given.
    pub id: Option<String>,
    /// The node's `rewrite`, else the file's; `None`: the proxy's default.
    pub rewrite: Option<bool>,
    pub tls_backend: Option<Backend>,
    pub primary: bool,
}

/// Why a route file was refused.
#[derive(Debug, thiserror::Error)]
pub enum RouteFileError {
    #[error("invalid route file: {0}")]
    Yaml(#[from] serde_yaml::Error),
    #[error("{field}: {message}")]
    Field { field: String, message: String },
}

impl RouteFileError {
    fn err(field: impl Into<String>, message: impl Into<String>) -> Self {
        RouteFileError::Field {
            field: field.into(),
            message: message.into(),
        }
    }
}

use RouteFileError as E;

impl RouteFile {
    /// Parses a file's text. Unknown fields are errors (a typo must not pass silently).
    pub fn from_yaml(text: &str) -> Result<Self, RouteFileError> {
        Ok(serde_yaml::from_str(text)?)
    }

    /// The file's text.
    pub fn to_yaml(&self) -> String {
        // Plain data with string keys: serialising it cannot fail.
        serde_yaml::to_string(self).unwrap_or_default()
    }

    /// Validates the file and gives its nodes in file order: every address parses, ids are
    /// Valkey ids, ports fit the layout and no two nodes share one.
    pub fn entries(&self) -> Result<Vec<RouteEntry>, RouteFileError> {
        if self.shards.is_empty() {
            return Err(E::err("shards", "at least one shard is required"));
        }
        let widest = self.shards.iter().map(|s| s.nodes.len()).max().unwrap_or(0);
        if widest == 0 {
            return Err(E::err(
                "shards[0].nodes",
                "every shard needs at least one node",
            ));
        }
        let layout = PortLayout::new(
            self.base_port,
            self.shards.len() as u32,
            widest as u32 - 1,
            self.ports_per_shard,
        )
        .map_err(|e| {
            let name = match e {
                PortError::StrideTooSmall { .. } => "portsPerShard",
                _ => "basePort",
            };
            E::err(name, e.to_string())
        })?;

        let mut entries = Vec::new();
        let mut owner: BTreeMap<u16, String> = BTreeMap::new();
        for (s, shard) in self.shards.iter().enumerate() {
            if shard.nodes.is_empty() {
                return Err(E::err(
                    format!("shards[{s}].nodes"),
                    "every shard needs at least one node",
                ));
            }
            for (n, entry) in shard.nodes.iter().enumerate() {
                let at = format!("shards[{s}].nodes[{n}]");
                let node = NodeRef::new(s as u32, n as u32);
                let short;
                let spec = match entry {
                    NodeEntry::Short(a) => {
                        short = NodeSpec::new(a.clone());
                        &short
                    }
                    NodeEntry::Long(l) => l,
                };
                let backend: Backend = spec.address.parse().map_err(|e: crate::BackendError| {
                    E::err(format!("{at}.address"), e.to_string())
                })?;
                let tls_backend = match &spec.tls_address {
                    Some(a) => Some(
                        a.parse::<Backend>()
                            .map_err(|e| E::err(format!("{at}.tlsAddress"), e.to_string()))?,
                    ),
                    None => None,
                };
                if let Some(id) = &spec.id {
                    if id.len() != 40 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
                        return Err(E::err(
                            format!("{at}.id"),
                            format!("{id:?} is not a Valkey node id (40 hex digits)"),
                        ));
                    }
                }
                let port = match spec.port {
                    Some(p) if p == 0 || p > 65535 => {
                        return Err(E::err(
                            format!("{at}.port"),
                            format!("{p} is not a port (1..=65535)"),
                        ))
                    }
                    Some(p) => p as u16,
                    None => layout
                        .port(node)
                        .map_err(|e| E::err(at.clone(), e.to_string()))?,
                };
                if let Some(first) = owner.get(&port) {
                    return Err(E::err(
                        format!("{at}.port"),
                        format!("listener port {port} is already used by {first}"),
                    ));
                }
                owner.insert(port, at);
                entries.push(RouteEntry {
                    port,
                    node,
                    backend,
                    id: spec.id.as_ref().map(|i| i.to_ascii_lowercase()),
                    rewrite: spec.rewrite.or(self.rewrite),
                    tls_backend,
                    primary: spec.primary.unwrap_or(n == 0),
                });
            }
        }
        Ok(entries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(text: &str) -> Result<Vec<RouteEntry>, String> {
        RouteFile::from_yaml(text)
            .and_then(|f| f.entries())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn ports_follow_the_flat_index() {
        let e = entries("basePort: 30000\nshards:\n- nodes: [10.0.0.1:6379, 10.0.0.2:6379]\n- nodes: [10.0.0.3:6379, 'valkey-1-1.valkey:6379']\n").unwrap();
        let ports: Vec<u16> = e.iter().map(|e| e.port).collect();
        assert_eq!(ports, vec![30000, 30001, 30002, 30003]);
        assert_eq!(e[2].node, NodeRef::new(1, 0));
        assert_eq!(e[3].backend.to_string(), "valkey-1-1.valkey:6379");
        assert_eq!(
            e.iter().map(|e| e.primary).collect::<Vec<_>>(),
            [true, false, true, false]
        );
    }

    #[test]
    fn ports_per_shard_leaves_gaps() {
        let e = entries("basePort: 30000\nportsPerShard: 3\nshards:\n- nodes: [10.0.0.1:6379]\n- nodes: [10.0.0.3:6379]\n").unwrap();
        assert_eq!(e.iter().map(|e| e.port).collect::<Vec<_>>(), [30000, 30003]);
    }

    #[test]
    fn long_form_with_id_port_and_rewrite() {
        let e = entries("basePort: 30000\nrewrite: true\nshards:\n- nodes:\n  - address: 10.0.0.1:6379\n    id: 9BE423741f0a3b818f633a9c16a1cf9ef42922d0\n    port: 31000\n  - address: 10.0.0.2:6379\n    rewrite: false\n    primary: true\n").unwrap();
        assert_eq!(e[0].port, 31000);
        assert_eq!(
            e[0].id.as_deref(),
            Some("9be423741f0a3b818f633a9c16a1cf9ef42922d0")
        );
        assert_eq!((e[0].rewrite, e[1].rewrite), (Some(true), Some(false)));
        assert!(e[1].primary);
    }

    #[test]
    fn errors_name_the_bad_field() {
        for (text, want) in [
            ("basePort: 65535\nshards:\n- nodes: [a:1, b:1]\n", "basePort: the last port, basePort 65535 + shards 1 * stride 2 - 1 = 65536, is past 65535"),
            ("basePort: 70000\nshards:\n- nodes: [a:1]\n", "basePort: basePort must be between 1 and 65535, got 70000"),
            ("basePort: 30000\nshards:\n- nodes: [a:1]\n- nodes: [b]\n", "shards[1].nodes[0].address: \"b\" has no port"),
            ("basePort: 30000\nshards:\n- nodes:\n  - address: a:1\n    tlsAddress: a\n", "shards[0].nodes[0].tlsAddress: \"a\" has no port"),
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
            let err = entries(text).unwrap_err();
            assert!(err.contains(want), "for {text:?}\n got: {err}\nwant: {want}");
        }
    }

    #[test]
    fn a_node_port_colliding_with_a_computed_one_is_an_error() {
        let err = entries("basePort: 30000\nshards:\n- nodes:\n  - address: a:1\n    port: 30001\n- nodes: [b:1]\n").unwrap_err();
        assert!(err.contains("already used by shards[0].nodes[0]"), "{err}");
    }

    #[test]
    fn written_files_read_back_the_same() {
        let file = RouteFile {
            base_port: 30000,
            ports_per_shard: Some(3),
            rewrite: Some(true),
            shards: vec![
                ShardEntry {
                    nodes: vec![
                        NodeEntry::Short("10.0.0.1:6379".into()),
                        NodeEntry::Long(NodeSpec {
                            id: Some("9be423741f0a3b818f633a9c16a1cf9ef42922d0".into()),
                            port: Some(31000),
                            rewrite: Some(false),
                            tls_address: Some("10.0.0.2:6380".into()),
                            primary: Some(true),
                            ..NodeSpec::new("valkey-0-1.valkey:6379")
                        }),
                    ],
                },
                ShardEntry {
                    nodes: vec![NodeEntry::Long(NodeSpec::new("[::1]:6379"))],
                },
            ],
        };
        let text = file.to_yaml();
        // The writer spells the fields as the format does (checked against literals, not
        // against the reader).
        for field in [
            "basePort: 30000",
            "portsPerShard: 3",
            "tlsAddress: 10.0.0.2:6380",
        ] {
            assert!(text.contains(field), "{field} missing in\n{text}");
        }
        let back = RouteFile::from_yaml(&text).unwrap();
        assert_eq!(back, file);
        assert_eq!(back.entries().unwrap(), file.entries().unwrap());
    }

    #[test]
    fn the_deploy_sample_is_a_valid_route_file() {
        let text = include_str!("../../deploy/proxy/routes.yaml");
        let e = entries(text).unwrap();
        assert_eq!(e.len(), 6);
        assert_eq!(e[5].port, 30005);
    }
}
