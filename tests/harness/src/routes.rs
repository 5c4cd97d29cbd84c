//! The proxy's view of a harness cluster: the route file and the announce settings that make
//! nodes hand out the proxy's per-node ports (the announce mode of the design).

use shardgate_crds::{NodeEntry, NodeRef, NodeSpec, PortLayout, RouteFile, ShardEntry};
use std::net::Ipv4Addr;

use crate::valkey::ValkeyCluster;

/// Node settings that make every node announce `proxy_ip` and its listener port
/// `basePort + flatIndex` to clients (Valkey 9's `cluster-announce-client-port`).
pub fn announce_proxy(
    proxy_ip: Ipv4Addr,
    layout: PortLayout,
) -> impl Fn(NodeRef) -> Vec<(String, String)> + Send + Sync + 'static {
    move |node: NodeRef| {
        let port = layout
            .port(node)
            .unwrap_or_else(|e| panic!("node {node} outside the proxy's port layout: {e}"));
        vec![
            ("cluster-announce-client-ipv4".into(), proxy_ip.to_string()),
            ("cluster-announce-client-port".into(), port.to_string()),
        ]
    }
}

/// A route file for `cluster` behind listeners from `base_port`, with each node's address
/// as it is now and its Valkey node id.
pub fn routes_yaml(base_port: u16, cluster: &ValkeyCluster) -> String {
    routes_yaml_with_tls(base_port, cluster, &[])
}

/// The same, with the address where each node speaks TLS (`tlsAddress`), node by node in
/// shard order, for as many nodes as `tls` names. Written with the contracts crate's
/// [`RouteFile`], the type the proxy reads.
pub fn routes_yaml_with_tls(
    base_port: u16,
    cluster: &ValkeyCluster,
    tls: &[std::net::SocketAddr],
) -> String {
    let spec = cluster.spec();
    let mut tls = tls.iter();
    let shards = (0..spec.shards)
        .map(|s| ShardEntry {
            nodes: (0..=spec.replicas)
                .map(|n| {
                    let node = cluster.node(NodeRef::new(s, n));
                    NodeEntry::Long(NodeSpec {
                        id: Some(node.node_id.clone()),
                        tls_address: tls.next().map(|t| t.to_string()),
                        ..NodeSpec::new(node.addr().to_string())
                    })
                })
                .collect(),
        })
        .collect();
    RouteFile {
        base_port: u32::from(base_port),
        ports_per_shard: None,
        rewrite: None,
        shards,
    }
    .to_yaml()
}

/// A route file of one node per shard: shard `s` is `backends[s]` (`host:port`), at
/// `base_port + s`. Written with [`RouteFile`], the type the proxy reads.
pub fn one_node_per_shard(base_port: u16, backends: &[impl ToString]) -> String {
    RouteFile {
        base_port: u32::from(base_port),
        ports_per_shard: None,
        rewrite: None,
        shards: backends
            .iter()
            .map(|b| ShardEntry {
                nodes: vec![NodeEntry::Short(b.to_string())],
            })
            .collect(),
    }
    .to_yaml()
}
