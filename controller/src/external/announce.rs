//! What a node announces (Valkey 9): its external client port
//! (`--cluster-announce-client-port`, or `--cluster-announce-client-tls-port` for nodes on
//! TLS, whose client port speaks only TLS), its hostname (`--cluster-announce-hostname`: its own
//! name under `domain`, else an `advertisedHost` that is a DNS name), and an
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
use shardgate_admin_client::{Client, Dial, Reply};
use shardgate_crds::external_access::ExternalAccess;
use shardgate_crds::valkey_cluster::ValkeyCluster;
use shardgate_crds::NodeRef;

use super::Exposure;
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
        // One port speaks to clients, TLS or plain: announce it as what it is (Valkey hands
        // a TLS client the TLS port, and a plain one the plain port).
        let flag = if vc.spec.tls.is_some() {
            TLS_PORT_FLAG
        } else {
            PORT_FLAG
        };
        args.extend([flag.to_string(), port.to_string()]);
    }
    if let Some(hostname) = hostname(vc, ea, node) {
        args.extend(["--cluster-announce-hostname".to_string(), hostname]);
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

/// The hostname `node` announces: its own name under `domain`; else, an `advertisedHost`
/// that is a DNS name, the same for every node (they differ by port). Clients are handed it
/// with `preferredEndpointType: hostname`, and it is the hostname CLUSTER SLOTS, SHARDS and
/// NODES show either way.
pub fn hostname(vc: &ValkeyCluster, ea: &ExternalAccess, node: NodeRef) -> Option<String> {
    match ea.hostnames(&vc.name_any()) {
        Some(h) => Some(shardgate_crds::node_hostname(&h.prefix, node, &h.domain)),
        None => ea.advertised_name().map(str::to_string),
    }
}

/// The flags of the announced client port, plain and TLS.
const PORT_FLAG: &str = "--cluster-announce-client-port";
const TLS_PORT_FLAG: &str = "--cluster-announce-client-tls-port";

/// The client address `args` announce (for [`crate::formation`], which sees nodes at it in
/// CLUSTER NODES). A node announces one client port, plain or TLS, and CLUSTER NODES shows
/// it to a client of its kind: the operator dials nodes on TLS over TLS.
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
        port: value(PORT_FLAG)
            .or_else(|| value(TLS_PORT_FLAG))
            .and_then(|v| v.parse().ok()),
    }
}

/// The client IPs known only once a pod runs (a LoadBalancer's ingress, a Gateway's address,
/// the address of the Kubernetes node its NodePort is reached at): they cannot be on the
/// command line, so they are set at run time (`CONFIG SET cluster-announce-client-ipv4`),
/// and checked on every reconcile (a restarted pod has lost it). A node whose pod announces
/// no IP on its command line and that `hosts` gives no IP (a host name, or no host known any
/// more) has the one set before cleared, so that clients are not sent to an address that
/// is no longer its. Host names are not set (the hostname is announced from `domain`).
/// Returns what it changed.
pub async fn set_runtime_ips(
    pods: &Pods,
    hosts: &BTreeMap<NodeRef, String>,
    dial: &Dial,
) -> Vec<String> {
    let mut changed = Vec::new();
    for (node, pod) in &pods.nodes {
        // The command line's own IP (an `advertisedHost` that is one) is not for this.
        if pod.announced.ip.is_some() {
            continue;
        }
        let Some(addr) = pod.addr.filter(|_| pod.ready && !pod.deleting) else {
            continue;
        };
        let ip = hosts.get(node).and_then(|h| h.parse::<IpAddr>().ok());
        let result = match ip {
            Some(ip) => set_announced_ip(addr, ip, dial).await,
            None => clear_announced_ip(addr, dial).await,
        };
        match (result, ip) {
            (Ok(true), Some(ip)) => {
                changed.push(format!("node {node} announces client address {ip}"))
            }
            (Ok(true), None) => changed.push(format!(
                "node {node} no longer announces a client address of its own (its pod IP instead)"
            )),
            (Ok(false), _) => {}
            // The pod is not answering: formation waits for it, and this is tried again.
            (Err(e), _) => tracing::debug!("node {node} at {addr}: {e}"),
        }
    }
    changed
}

/// The config keys of the announced client IP, v4 and v6.
const ANNOUNCED_IP_KEYS: [&str; 2] = [
    "cluster-announce-client-ipv4",
    "cluster-announce-client-ipv6",
];

/// Sets the node at `addr` to announce `ip` as its client address (and not an IP of the
/// other family). Whether it changed anything.
async fn set_announced_ip(
    addr: std::net::SocketAddr,
    ip: IpAddr,
    dial: &Dial,
) -> Result<bool, shardgate_admin_client::Error> {
    let wanted = ip.to_string();
    let [v4, v6] = ANNOUNCED_IP_KEYS;
    let (key, other) = if ip.is_ipv4() { (v4, v6) } else { (v6, v4) };
    let mut c = Client::dial(addr, dial).await?;
    let mut changed = false;
    if config_get(&mut c, key).await? != wanted {
        c.command(["CONFIG", "SET", key, wanted.as_str()]).await?;
        changed = true;
    }
    if !config_get(&mut c, other).await?.is_empty() {
        c.command(["CONFIG", "SET", other, ""]).await?;
        changed = true;
    }
    Ok(changed)
}

/// Clears the client IPs the node at `addr` was set to announce. Whether there was one.
async fn clear_announced_ip(
    addr: std::net::SocketAddr,
    dial: &Dial,
) -> Result<bool, shardgate_admin_client::Error> {
    let mut c = Client::dial(addr, dial).await?;
    let mut changed = false;
    for key in ANNOUNCED_IP_KEYS {
        if !config_get(&mut c, key).await?.is_empty() {
            c.command(["CONFIG", "SET", key, ""]).await?;
            changed = true;
        }
    }
    Ok(changed)
}

/// A config value as text; empty when unset.
async fn config_get(c: &mut Client, key: &str) -> Result<String, shardgate_admin_client::Error> {
    Ok(match c.command(["CONFIG", "GET", key]).await? {
        Reply::Array(kv) => match kv.get(1) {
            Some(Reply::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
            _ => String::new(),
        },
        _ => String::new(),
    })
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
        // with `spec.tls`, as the TLS port (the nodes' client port speaks only TLS), which
        // is where the operator, on TLS, sees the node in CLUSTER NODES.
        let tls = ValkeyCluster::test("vc").tls("certs");
        let lb = exposure(ServiceType::LoadBalancer);
        let flags = args(&tls, Some(&ExternalAccess::announce()), node, Some(&lb));
        assert_eq!(flags, ["--cluster-announce-client-tls-port", "6380"]);
        assert_eq!(announced(&flags).port, Some(6380));
        // A host name is not an IP: without a domain, it is the node's hostname.
        ea.advertised_host = Some("valkey.example.com".into());
        ea.domain = None;
        assert_eq!(
            args(&vc, Some(&ea), node, Some(&e)),
            [
                "--cluster-announce-client-port",
                "31001",
                "--cluster-announce-hostname",
                "valkey.example.com",
            ]
        );
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

    /// Against a real node: an IP is set at run time, and cleared again once the node's
    /// host is no IP (a name, or none known); an IP on the command line is left alone.
    #[tokio::test]
    async fn run_time_ips_are_set_and_cleared() {
        use crate::pods::NodePod;
        use shardgate_harness::valkey::{ClusterSpec, ValkeyCluster};
        let cluster = tokio::task::spawn_blocking(|| ValkeyCluster::start(ClusterSpec::new(1, 0)))
            .await
            .unwrap()
            .expect("a one-node Valkey cluster (run scripts/setup for valkey-server)");
        let node = NodeRef::new(0, 0);
        let addr = cluster.node(node).addr();
        let pod = NodePod {
            name: "vc-0-0-0".into(),
            addr: Some(addr),
            ready: true,
            ..NodePod::default()
        };
        let mut pods = Pods::default();
        pods.nodes.insert(node, pod);
        let dial = &Dial::default();
        let get = |key: &'static str| async move {
            let mut c = Client::dial(addr, dial).await.unwrap();
            config_get(&mut c, key).await.unwrap()
        };
        let hosts = |h: &str| BTreeMap::from([(node, h.to_string())]);
        let [v4, v6] = ANNOUNCED_IP_KEYS;

        let changed = set_runtime_ips(&pods, &hosts("203.0.113.7"), dial).await;
        assert_eq!(changed, ["node 0-0 announces client address 203.0.113.7"]);
        assert_eq!(get(v4).await, "203.0.113.7");
        // Already so: nothing to do.
        assert!(set_runtime_ips(&pods, &hosts("203.0.113.7"), dial)
            .await
            .is_empty());
        // Another family: the other key, and the first cleared.
        assert_eq!(
            set_runtime_ips(&pods, &hosts("2001:db8::7"), dial)
                .await
                .len(),
            1
        );
        assert_eq!(
            (get(v4).await, get(v6).await),
            (String::new(), "2001:db8::7".to_string())
        );
        // A host name: no IP of its own any more.
        let changed = set_runtime_ips(&pods, &hosts("valkey.example.test"), dial).await;
        assert_eq!(changed.len(), 1, "{changed:?}");
        assert_eq!(
            (get(v4).await, get(v6).await),
            (String::new(), String::new())
        );
        // No host known: the same, and nothing left to clear.
        assert!(set_runtime_ips(&pods, &BTreeMap::new(), dial)
            .await
            .is_empty());
        // An IP on the command line is the pod's own: not touched.
        set_runtime_ips(&pods, &hosts("203.0.113.7"), dial).await;
        if let Some(p) = pods.nodes.get_mut(&node) {
            p.announced.ip = Some("203.0.113.7".parse().unwrap());
        }
        assert!(set_runtime_ips(&pods, &BTreeMap::new(), dial)
            .await
            .is_empty());
        assert_eq!(get(v4).await, "203.0.113.7");
    }
}
