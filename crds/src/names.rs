//! Hostnames and labels.

use crate::ports::{NodeRef, ShardIndex};

/// Label keys on every object the operator makes.
pub mod labels {
    pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
    pub const MANAGED_BY_VALUE: &str = "shardgate";
    pub const INSTANCE: &str = "app.kubernetes.io/instance";
    pub const CLUSTER: &str = "shardgate.io/cluster";
    pub const SHARD_INDEX: &str = "shardgate.io/shard-index";
    pub const NODE_INDEX: &str = "shardgate.io/node-index";
    /// On the objects of one part of a cluster that is not its core (e.g. the external
    /// Services: `external`), so that they can be listed apart.
    pub const COMPONENT: &str = "shardgate.io/component";
    /// [`COMPONENT`] of the Services external access makes.
    pub const COMPONENT_EXTERNAL: &str = "external";

    /// The label selector of everything the operator makes for `cluster`: its pods among
    /// them (what the proxy's Kubernetes source watches).
    pub fn cluster_selector(cluster: &str) -> String {
        format!("{MANAGED_BY}={MANAGED_BY_VALUE},{INSTANCE}={cluster}")
    }
}

/// The names of the objects the operator makes for a cluster, and the node names Valkey
/// announces (`cluster-announce-human-nodename`): one helper each, so that the operator, the
/// tests and `kubectl get` agree.
pub mod objects {
    use crate::ports::NodeRef;

    /// One node's StatefulSet, and its human node name: `<cluster>-<s>-<n>`.
    pub fn node(cluster: &str, node: NodeRef) -> String {
        format!("{cluster}-{node}")
    }

    /// The TCPRoute of one node (gateway mode): named as the node, `<cluster>-<s>-<n>`.
    pub fn tcp_route(cluster: &str, id: NodeRef) -> String {
        node(cluster, id)
    }

    /// The headless Service that gives the pods their DNS names.
    pub fn headless_service(cluster: &str) -> String {
        format!("{cluster}-nodes")
    }

    /// The ConfigMap holding `valkey.conf`.
    pub fn config_map(cluster: &str) -> String {
        format!("{cluster}-config")
    }

    /// The external Service of shard `s` (`serviceLayout: shard`): one port per node.
    pub fn shard_service(cluster: &str, shard: crate::ports::ShardIndex) -> String {
        format!("{cluster}-shard-{shard}")
    }

    /// The external Service of one node (`serviceLayout: node`): `<cluster>-node-<s>-<n>`.
    pub fn node_service(cluster: &str, node: NodeRef) -> String {
        format!("{cluster}-node-{node}")
    }

    /// The name of a node's port in its shard's external Service: `vk-n<n>`.
    pub fn service_port(node: NodeRef) -> String {
        format!("vk-n{}", node.node)
    }

    /// The node-unique name of the client port in a node's container, which the external
    /// Services target: `vk-<s>-<n>` (an IANA service name: at most 15 characters, which
    /// holds up to 16384 shards and 999999 nodes a shard; it does not change when
    /// `replicas` does, unlike a flat index).
    pub fn container_port(node: NodeRef) -> String {
        format!("vk-{node}")
    }

    /// The PodDisruptionBudget of all the cluster's pods.
    pub fn disruption_budget(cluster: &str) -> String {
        cluster.to_string()
    }

    /// The longest cluster name whose objects and pods stay within Kubernetes' limits: a
    /// StatefulSet's pods carry a `controller-revision-hash` label of the name plus 11
    /// characters, and labels hold 63 (so 52 for the StatefulSet, less `-<s>-<n>`).
    pub const MAX_CLUSTER_NAME: usize = 40;
}

/// `<prefix>-<s>.<domain>`: a shard's name.
pub fn shard_hostname(prefix: &str, shard: ShardIndex, domain: &str) -> String {
    format!("{prefix}-{shard}.{domain}")
}

/// `<prefix>-<s>-<n>.<domain>`: a node's name (one TLS port, one SNI name per node).
pub fn node_hostname(prefix: &str, id: NodeRef, domain: &str) -> String {
    format!("{prefix}-{id}.{domain}")
}

/// `<prefix>.<domain>`: the bootstrap name that reaches any healthy node.
pub fn bootstrap_hostname(prefix: &str, domain: &str) -> String {
    format!("{prefix}.{domain}")
}

/// The hostnames of one cluster, for the matching in the other direction (an SNI name back
/// to a node or shard).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hostnames {
    pub prefix: String,
    pub domain: String,
}

/// What a hostname names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostnameTarget {
    Bootstrap,
    Shard(ShardIndex),
    Node(NodeRef),
}

impl Hostnames {
    /// Parses `name` (case-insensitive, as DNS is) back into what it names, or `None` if it is
    /// not one of this cluster's names.
    pub fn target(&self, name: &str) -> Option<HostnameTarget> {
        let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
        let host = name.strip_suffix(&format!(".{}", self.domain.to_ascii_lowercase()))?;
        let prefix = self.prefix.to_ascii_lowercase();
        if host == prefix {
            return Some(HostnameTarget::Bootstrap);
        }
        let rest = host.strip_prefix(&prefix)?.strip_prefix('-')?;
        let mut parts = rest.split('-');
        let shard = parse_index(parts.next()?)?;
        match (parts.next(), parts.next()) {
            (None, _) => Some(HostnameTarget::Shard(ShardIndex(shard))),
            (Some(n), None) => Some(HostnameTarget::Node(NodeRef::new(shard, parse_index(n)?))),
            _ => None,
        }
    }
}

/// A decimal index without sign or leading zeros, so that each name has one spelling.
fn parse_index(s: &str) -> Option<u32> {
    if s.is_empty() || (s.len() > 1 && s.starts_with('0')) || !s.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    s.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(
            shard_hostname("vc", ShardIndex(2), "example.com"),
            "vc-2.example.com"
        );
        assert_eq!(
            node_hostname("vc", NodeRef::new(2, 1), "example.com"),
            "vc-2-1.example.com"
        );
        assert_eq!(bootstrap_hostname("vc", "example.com"), "vc.example.com");
        let id = NodeRef::new(2, 1);
        assert_eq!(objects::shard_service("vc", ShardIndex(2)), "vc-shard-2");
        assert_eq!(objects::node_service("vc", id), "vc-node-2-1");
        assert_eq!(objects::service_port(id), "vk-n1");
        assert_eq!(objects::container_port(id), "vk-2-1");
        assert!(objects::container_port(NodeRef::new(16383, 999_999)).len() <= 15);
    }

    #[test]
    fn names_parse_back() {
        let h = Hostnames {
            prefix: "vc".into(),
            domain: "example.com".into(),
        };
        assert_eq!(h.target("vc.example.com"), Some(HostnameTarget::Bootstrap));
        assert_eq!(
            h.target("VC-3.Example.com."),
            Some(HostnameTarget::Shard(ShardIndex(3)))
        );
        assert_eq!(
            h.target("vc-3-1.example.com"),
            Some(HostnameTarget::Node(NodeRef::new(3, 1)))
        );
        for bad in [
            "vc-03.example.com",
            "vc-3-1-1.example.com",
            "vc-x.example.com",
            "vc-.example.com",
            "vc-3.example.org",
            "other-3.example.com",
            "vc-3example.com",
            "example.com",
            "",
        ] {
            assert_eq!(h.target(bad), None, "{bad}");
        }
        for s in 0..5 {
            for n in 0..3 {
                let id = NodeRef::new(s, n);
                assert_eq!(
                    h.target(&node_hostname("vc", id, "example.com")),
                    Some(HostnameTarget::Node(id))
                );
            }
        }
    }
}
