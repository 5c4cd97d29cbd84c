//! Node identity and the external port of every node.
//!
//! A node is addressed by its shard index `s` (0..shards) and its node index `n`
//! (0..=replicas; 0 is the *initial* primary only, the live role always comes from Valkey).
//! Its flat index is `s * stride + n`, where the stride is `replicas + 1` unless
//! `portsPerShard` fixes it, and its external port is `basePort + flatIndex`.

use std::fmt;
use std::str::FromStr;

/// The highest TCP port.
pub const MAX_PORT: u32 = 65535;

/// The client port Valkey listens on in the operator's pods (their container port
/// `vk-<s>-<n>`): where the proxy's Kubernetes source dials a pod.
pub const CLIENT_PORT: u16 = 6379;

/// Why a port layout or a node position is not valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PortError {
    #[error("basePort must be between 1 and 65535, got {0}")]
    BasePort(u32),
    #[error("shards must be at least 1")]
    NoShards,
    #[error("portsPerShard ({ports_per_shard}) must be at least replicas + 1 ({needed})")]
    StrideTooSmall { ports_per_shard: u32, needed: u32 },
    #[error(
        "the last port, basePort {base_port} + shards {shards} * stride {stride} - 1 = {last}, \
         is past 65535"
    )]
    PastMaxPort {
        base_port: u32,
        shards: u32,
        stride: u32,
        last: u64,
    },
    #[error("shard index {shard} is out of range (the cluster has {shards} shards)")]
    ShardOutOfRange { shard: u32, shards: u32 },
    #[error("node index {node} is out of range (a shard has {stride} ports)")]
    NodeOutOfRange { node: u32, stride: u32 },
    #[error("{0:?} is not a {1}")]
    Parse(String, &'static str),
}

macro_rules! index_newtype {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        #[derive(serde::Serialize, serde::Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub u32);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl FromStr for $name {
            type Err = PortError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                s.parse().map($name).map_err(|_| PortError::Parse(s.to_string(), $what))
            }
        }

        impl From<u32> for $name {
            fn from(v: u32) -> Self {
                $name(v)
            }
        }
    };
}

index_newtype!(
    /// A shard's index, 0..shards.
    ShardIndex,
    "shard index"
);
index_newtype!(
    /// A node's index inside its shard, 0..=replicas (0 is the initial primary only).
    NodeIndex,
    "node index"
);

/// A node's place in the cluster: (shard index, node index).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct NodeRef {
    pub shard: ShardIndex,
    pub node: NodeIndex,
}

impl NodeRef {
    pub fn new(shard: u32, node: u32) -> Self {
        NodeRef {
            shard: ShardIndex(shard),
            node: NodeIndex(node),
        }
    }
}

impl fmt::Display for NodeRef {
    /// `<s>-<n>`, the suffix used in node names and hostnames.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.shard, self.node)
    }
}

/// The upstream formula: `s * stride + n`.
pub fn flat_index(id: NodeRef, stride: u32) -> u64 {
    u64::from(id.shard.0) * u64::from(stride) + u64::from(id.node.0)
}

/// How a cluster's nodes map onto external ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortLayout {
    base_port: u16,
    shards: u32,
    stride: u32,
}

impl PortLayout {
    /// Validates a layout: `basePort + shards * stride - 1 <= 65535`, with
    /// `stride = portsPerShard` if given (it must be at least `replicas + 1`), else `replicas + 1`.
    pub fn new(
        base_port: u32,
        shards: u32,
        replicas: u32,
        ports_per_shard: Option<u32>,
    ) -> Result<Self, PortError> {
        if base_port == 0 || base_port > MAX_PORT {
            return Err(PortError::BasePort(base_port));
        }
        if shards == 0 {
            return Err(PortError::NoShards);
        }
        let needed = replicas.saturating_add(1);
        let stride = match ports_per_shard {
            Some(p) if p < needed => {
                return Err(PortError::StrideTooSmall {
                    ports_per_shard: p,
                    needed,
                })
            }
            Some(p) => p,
            None => needed,
        };
        let last = u64::from(base_port) + u64::from(shards) * u64::from(stride) - 1;
        if last > u64::from(MAX_PORT) {
            return Err(PortError::PastMaxPort {
                base_port,
                shards,
                stride,
                last,
            });
        }
        Ok(PortLayout {
            base_port: base_port as u16,
            shards,
            stride,
        })
    }

    pub fn base_port(&self) -> u16 {
        self.base_port
    }

    pub fn shards(&self) -> u32 {
        self.shards
    }

    /// Ports per shard.
    pub fn stride(&self) -> u32 {
        self.stride
    }

    /// The last port of the range.
    pub fn last_port(&self) -> u16 {
        // Checked in `new`.
        (u32::from(self.base_port) + self.shards * self.stride - 1) as u16
    }

    /// The node's flat index, `s * stride + n`.
    pub fn flat_index(&self, id: NodeRef) -> Result<u32, PortError> {
        if id.shard.0 >= self.shards {
            return Err(PortError::ShardOutOfRange {
                shard: id.shard.0,
                shards: self.shards,
            });
        }
        if id.node.0 >= self.stride {
            return Err(PortError::NodeOutOfRange {
                node: id.node.0,
                stride: self.stride,
            });
        }
        // In range by construction: at most shards * stride - 1.
        Ok(flat_index(id, self.stride) as u32)
    }

    /// The node's external port, `basePort + flatIndex`.
    pub fn port(&self, id: NodeRef) -> Result<u16, PortError> {
        let flat = self.flat_index(id)?;
        Ok((u32::from(self.base_port) + flat) as u16)
    }

    /// The node a port belongs to, if it is inside the range.
    pub fn node_of(&self, port: u16) -> Option<NodeRef> {
        let flat = u32::from(port).checked_sub(u32::from(self.base_port))?;
        let id = NodeRef::new(flat / self.stride, flat % self.stride);
        (id.shard.0 < self.shards).then_some(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn upstream_formula() {
        let l = PortLayout::new(30000, 3, 1, None).unwrap();
        assert_eq!(l.stride(), 2);
        assert_eq!(l.port(NodeRef::new(0, 0)).unwrap(), 30000);
        assert_eq!(l.port(NodeRef::new(0, 1)).unwrap(), 30001);
        assert_eq!(l.port(NodeRef::new(2, 1)).unwrap(), 30005);
        assert_eq!(l.last_port(), 30005);
    }

    #[test]
    fn ports_per_shard_keeps_ports_stable_while_replicas_scale() {
        let one = PortLayout::new(30000, 3, 1, Some(4)).unwrap();
        let three = PortLayout::new(30000, 3, 3, Some(4)).unwrap();
        assert_eq!(
            one.port(NodeRef::new(2, 1)).unwrap(),
            three.port(NodeRef::new(2, 1)).unwrap()
        );
        assert_eq!(
            PortLayout::new(30000, 3, 4, Some(4)),
            Err(PortError::StrideTooSmall {
                ports_per_shard: 4,
                needed: 5
            })
        );
    }

    #[test]
    fn range_past_65535_is_rejected() {
        assert!(PortLayout::new(65530, 3, 1, None).is_ok()); // 65530..=65535
        let err = PortLayout::new(65531, 3, 1, None).unwrap_err();
        assert!(matches!(err, PortError::PastMaxPort { last: 65536, .. }));
        assert!(err.to_string().contains("past 65535"), "{err}");
        assert_eq!(
            PortLayout::new(70000, 1, 0, None),
            Err(PortError::BasePort(70000))
        );
        assert_eq!(PortLayout::new(0, 1, 0, None), Err(PortError::BasePort(0)));
        // Huge counts must not overflow into a small number.
        assert!(PortLayout::new(1, u32::MAX, u32::MAX - 1, None).is_err());
    }

    #[test]
    fn out_of_range_nodes() {
        let l = PortLayout::new(30000, 2, 1, None).unwrap();
        assert!(l.port(NodeRef::new(2, 0)).is_err());
        assert!(l.port(NodeRef::new(0, 2)).is_err());
        assert_eq!(l.node_of(29999), None);
        assert_eq!(l.node_of(30004), None);
    }

    #[test]
    fn newtypes_parse_and_print() {
        assert_eq!("7".parse::<ShardIndex>().unwrap(), ShardIndex(7));
        assert!("x".parse::<NodeIndex>().is_err());
        assert_eq!(NodeRef::new(1, 2).to_string(), "1-2");
    }

    proptest! {
        #[test]
        fn port_and_node_of_are_inverse(base in 1u32..65536, shards in 1u32..300, replicas in 0u32..6, extra in 0u32..3) {
            if let Ok(l) = PortLayout::new(base, shards, replicas, Some(replicas + 1 + extra)) {
                for s in 0..shards.min(20) {
                    for n in 0..l.stride() {
                        let id = NodeRef::new(s, n);
                        let port = l.port(id).unwrap();
                        prop_assert!(port >= l.base_port() && port <= l.last_port());
                        prop_assert_eq!(l.node_of(port), Some(id));
                    }
                }
            }
        }
    }
}
