//! The proxy's view of a harness cluster: the route file and the announce settings that make
//! nodes hand out the proxy's per-node ports (the announce mode of the design).

use shardgate_crds::{NodeRef, PortLayout};
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
/// shard order, for as many nodes as `tls` names.
pub fn routes_yaml_with_tls(
    base_port: u16,
    cluster: &ValkeyCluster,
    tls: &[std::net::SocketAddr],
) -> String {
    let spec = cluster.spec();
    let mut out = format!("basePort: {base_port}\nshards:\n");
    let mut tls = tls.iter();
    for s in 0..spec.shards {
        out.push_str("  - nodes:\n");
        for n in 0..=spec.replicas {
            let node = cluster.node(NodeRef::new(s, n));
            out.push_str(&format!(
                "      - address: {}\n        id: {}\n",
                node.addr(),
                node.node_id
            ));
            if let Some(t) = tls.next() {
                out.push_str(&format!("        tlsAddress: {t}\n"));
            }
        }
    }
    out
}
