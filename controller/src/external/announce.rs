//! What a node announces (Valkey 9): its external client port
//! (`--cluster-announce-client-port`, or `--cluster-announce-client-tls-port` under
//! `spec.tls`), its hostname (`--cluster-announce-hostname`, when a domain is set), and an
//! `advertisedHost` that is an IP (`--cluster-announce-client-ipv4`/`-ipv6`: clients get
//! it, while gossip and replication stay on the pod IP of `--cluster-announce-ip`).
//! `cluster-preferred-endpoint-type` is in `valkey.conf` ([`crate::configmap`]).
//!
//! The flags are on the pod's command line, so a change must restart the pod: each node's
//! pods carry a hash of the config and of its flags, and [`crate::rolling`] replaces the pods
//! whose hash differs, one at a time, failover first.

use std::collections::BTreeMap;
use std::net::IpAddr;

use kube::ResourceExt;
use shardgate_admin_client::{Client, Reply, Timeouts};
use shardgate_crds::external_access::ExternalAccess;
use shardgate_crds::valkey_cluster::ValkeyCluster;
use shardgate_crds::NodeRef;

use super::Exposure;
use crate::configmap;
use crate::formation::Announced;
use crate::pods::Pods;

/// The announce flags of `node` (none without external access in announce mode).
pub fn args(
    vc: &ValkeyCluster,
    ea: Option<&ExternalAccess>,
    node: NodeRef,
    exposure: Option<&Exposure>,
) -> Vec<String> {
    let Some(ea) = ea else {
        return Vec::new();
    };
    let mut args = Vec::new();
    if let Some(port) = exposure.and_then(Exposure::external_port) {
        let flag = if vc.spec.tls.is_some() {
            "--cluster-announce-client-tls-port"
        } else {
            "--cluster-announce-client-port"
        };
        args.extend([flag.to_string(), port.to_string()]);
    }
    if let Some(h) = ea.hostnames(&vc.name_any()) {
        args.extend([
            "--cluster-announce-hostname".to_string(),
            shardgate_crds::node_hostname(&h.prefix, node, &h.domain),
        ]);
    }
    // The address clients are to use, when it is an IP the spec gives. (A LoadBalancer's
    // ingress, a Gateway's or a Kubernetes node's address are known later and set at run
    // time, so that their arrival does not restart the pod: see `set_runtime_ips`.)
    match ea
        .advertised_host
        .as_deref()
        .and_then(|h| h.parse::<IpAddr>().ok())
    {
        Some(IpAddr::V4(ip)) => {
            args.extend(["--cluster-announce-client-ipv4".to_string(), ip.to_string()])
        }
        Some(IpAddr::V6(ip)) => {
            args.extend(["--cluster-announce-client-ipv6".to_string(), ip.to_string()])
        }
        None => {}
    }
    args
}

/// The client address `args` announce (for [`crate::formation`], which sees nodes at it in
/// CLUSTER NODES). The TLS port is not shown there: only the plain client port counts.
pub fn announced(args: &[String]) -> Announced {
    let value = |flag: &str| {
        args.windows(2)
            .find(|w| w[0] == flag)
            .map(|w| w[1].as_str())
    };
    Announced {
        ip: value("--cluster-announce-client-ipv4")
            .or_else(|| value("--cluster-announce-client-ipv6"))
            .and_then(|v| v.parse().ok()),
        port: value("--cluster-announce-client-port").and_then(|v| v.parse().ok()),
    }
}

/// The client IPs known only once a pod runs (the address of the Kubernetes node its NodePort
/// is reached at, when no `advertisedHost` is given): they cannot be on the command line,
/// so they are set at run time (`CONFIG SET cluster-announce-client-ipv4`), and checked on
/// every reconcile (a restarted pod has lost it). Host names are not set (the hostname is
/// announced from `domain`). Returns what it changed.
pub async fn set_runtime_ips(
    pods: &Pods,
    hosts: &BTreeMap<NodeRef, String>,
    timeouts: Timeouts,
) -> Vec<String> {
    let mut changed = Vec::new();
    for (node, host) in hosts {
        let Ok(ip) = host.parse::<IpAddr>() else {
            continue;
        };
        let Some(addr) = pods
            .nodes
            .get(node)
            .filter(|p| p.ready && !p.deleting)
            .and_then(|p| p.addr)
        else {
            continue;
        };
        let key = match ip {
            IpAddr::V4(_) => "cluster-announce-client-ipv4",
            IpAddr::V6(_) => "cluster-announce-client-ipv6",
        };
        let wanted = ip.to_string();
        let set = async {
            let mut c = Client::connect(addr, timeouts).await?;
            let now = c.command(["CONFIG", "GET", key]).await?;
            let current = match &now {
                Reply::Array(kv) => match kv.get(1) {
                    Some(Reply::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
                    _ => String::new(),
                },
                _ => String::new(),
            };
            if current == wanted {
                return Ok(false);
            }
            c.command(["CONFIG", "SET", key, wanted.as_str()]).await?;
            Ok::<_, shardgate_admin_client::Error>(true)
        };
        match set.await {
            Ok(true) => changed.push(format!("node {node} announces client address {ip}")),
            Ok(false) => {}
            // The pod is not answering: formation waits for it, and this is tried again.
            Err(e) => tracing::debug!("node {node} at {addr}: {e}"),
        }
    }
    changed
}

/// The hash a node's pod runs with: the config's, or, with announce flags, a hash of both
/// (a node without flags keeps the config's hash, so that clusters without external access
/// are not rolled by this).
pub fn node_hash(config_hash: &str, args: &[String]) -> String {
    if args.is_empty() {
        config_hash.to_string()
    } else {
        configmap::hash(&format!("{config_hash}\n{}", args.join("\n")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardgate_crds::external_access::ServiceType;

    fn exposure(t: ServiceType) -> Exposure {
        Exposure {
            service: "vc-shard-0".into(),
            service_type: t,
            port: 6380,
            node_port: Some(31001),
            ingress: Some("127.0.9.9".into()),
            gateway_port: None,
        }
    }

    #[test]
    fn flags_per_node() {
        let vc = ValkeyCluster::test("vc");
        let node = NodeRef::new(1, 1);
        assert!(args(&vc, None, node, None).is_empty());
        let mut ea = ExternalAccess::announce().domain("example.com");
        ea.advertised_host = Some("10.0.0.7".into());
        let e = exposure(ServiceType::NodePort);
        assert_eq!(
            args(&vc, Some(&ea), node, Some(&e)),
            [
                "--cluster-announce-client-port",
                "31001",
                "--cluster-announce-hostname",
                "vc-1-1.example.com",
                "--cluster-announce-client-ipv4",
                "10.0.0.7"
            ]
        );
        // A LoadBalancer: its port (the ingress IP comes at run time, without a restart);
        // TLS: the TLS port.
        let tls = ValkeyCluster::test("vc").tls("certs");
        let lb = exposure(ServiceType::LoadBalancer);
        assert_eq!(
            args(&tls, Some(&ExternalAccess::announce()), node, Some(&lb)),
            ["--cluster-announce-client-tls-port", "6380"]
        );
        // A host name is not an IP: only the port.
        ea.advertised_host = Some("valkey.example.com".into());
        ea.domain = None;
        assert_eq!(args(&vc, Some(&ea), node, Some(&e)).len(), 2);
        let shown = announced(&args(&vc, Some(&ea), node, Some(&e)));
        assert_eq!(
            shown,
            Announced {
                ip: None,
                port: Some(31001)
            }
        );
        let pod: std::net::SocketAddr = "127.1.0.5:6379".parse().unwrap();
        assert_eq!(shown.shown(pod).to_string(), "127.1.0.5:31001");
    }

    #[test]
    fn hash_covers_the_flags() {
        assert_eq!(node_hash("abc", &[]), "abc");
        let a = node_hash("abc", &["--x".into(), "1".into()]);
        let b = node_hash("abc", &["--x".into(), "2".into()]);
        assert_ne!(a, b);
        assert_ne!(a, "abc");
        assert_eq!(a.len(), 16);
    }
}
