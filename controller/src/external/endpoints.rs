//! `status.externalEndpoints` and `status.bootstrap`: where each node is reached from outside,
//! read back from what the API server allocated, and what is still missing.
//!
//! A node's host is the `advertisedHost`; else, in gateway mode, the Gateway's address (its
//! port the Gateway listener's); on a LoadBalancer Service, its ingress; on a
//! NodePort Service, the address of the Kubernetes node its pod runs on, of type
//! `nodeAddressType` (else the first of ExternalDNS, ExternalIP, InternalDNS, InternalIP,
//! Hostname it has); on a ClusterIP Service, the Service's cluster DNS name.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use shardgate_crds::external_access::{
    is_dns_name, EndpointType, ExternalAccess, NodeAddressType, ServiceType,
};
use shardgate_crds::valkey_cluster::{ExternalEndpoint, NodeRole, ValkeyCluster};
use shardgate_crds::NodeRef;

use super::Exposures;
use crate::context::Context;
use crate::error::Result;
use crate::formation::Progress;
use crate::objects::namespace;
use crate::pods::Pods;

/// What status reports about external access.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct External {
    /// One per node that has an endpoint, in node order.
    pub endpoints: Vec<ExternalEndpoint>,
    /// Why the other nodes have none.
    pub missing: Vec<String>,
    /// Nodes whose host is a DNS name while Valkey hands out IPs
    /// (`preferredEndpointType: ip`): clients would be sent to the pods' own IPs.
    pub names_not_handed_out: Vec<String>,
}

impl External {
    /// `host:port,host:port,...`: every endpoint, primaries first.
    pub fn bootstrap(&self) -> Option<String> {
        if self.endpoints.is_empty() {
            return None;
        }
        let mut eps: Vec<&ExternalEndpoint> = self.endpoints.iter().collect();
        eps.sort_by_key(|e| e.role != Some(NodeRole::Primary));
        Some(
            eps.iter()
                .map(|e| e.address())
                .collect::<Vec<_>>()
                .join(","),
        )
    }
}

/// `node`'s live role, once the cluster is formed.
pub fn role(progress: &Progress, node: NodeRef) -> Option<NodeRole> {
    match progress {
        Progress::Formed(f) => f.nodes.get(&node).map(|s| {
            if s.primary {
                NodeRole::Primary
            } else {
                NodeRole::Replica
            }
        }),
        _ => None,
    }
}

/// A Kubernetes node's address of the first type of `preference` it has.
pub fn node_address(node: &Node, preferred: Option<NodeAddressType>) -> Option<String> {
    let addresses = node.status.as_ref()?.addresses.as_ref()?;
    NodeAddressType::preference(preferred)
        .into_iter()
        .find_map(|t| {
            addresses
                .iter()
                .find(|a| a.type_ == t.as_str() && !a.address.is_empty())
                .map(|a| a.address.clone())
        })
}

/// The hosts known only at run time, for the nodes without an `advertisedHost`: the
/// Gateway's address for a node routed by the Gateway (`gateway_address`), the ingress of a
/// LoadBalancer Service, else the address of the Kubernetes node the pod runs on, for a node
/// whose NodePort is reached there.
pub async fn node_hosts(
    ctx: &Context,
    ea: &ExternalAccess,
    exposures: &Exposures,
    pods: &Pods,
    gateway_address: Option<&str>,
) -> Result<BTreeMap<NodeRef, String>> {
    let mut out = BTreeMap::new();
    if ea.advertised_host.is_some() {
        return Ok(out);
    }
    let nodes_api: Api<Node> = Api::all(ctx.client.clone());
    let mut cache: BTreeMap<String, Option<Node>> = BTreeMap::new();
    for (node, exposure) in exposures {
        if exposure.gateway_port.is_some() {
            if let Some(address) = gateway_address {
                out.insert(*node, address.to_string());
            }
            continue;
        }
        if exposure.service_type == ServiceType::LoadBalancer {
            if let Some(ingress) = &exposure.ingress {
                out.insert(*node, ingress.clone());
            }
            continue;
        }
        if exposure.service_type != ServiceType::NodePort {
            continue;
        }
        let Some(name) = pods.nodes.get(node).and_then(|p| p.node_name.clone()) else {
            continue;
        };
        if !cache.contains_key(&name) {
            let n = nodes_api.get_opt(&name).await?;
            cache.insert(name.clone(), n);
        }
        if let Some(host) = cache[&name]
            .as_ref()
            .and_then(|n| node_address(n, ea.node_address_type))
        {
            out.insert(*node, host);
        }
    }
    Ok(out)
}

/// Each node's endpoint, from the Services (`exposures`), the pods' Kubernetes nodes'
/// addresses (`node_hosts`, from [`node_hosts`]) and the formation's view of the roles.
pub fn observe(
    vc: &ValkeyCluster,
    ea: &ExternalAccess,
    exposures: &Exposures,
    node_hosts: &BTreeMap<NodeRef, String>,
    progress: &Progress,
) -> Result<External> {
    let ns = namespace(vc)?;
    let mut out = External::default();
    for node in vc.spec.node_refs() {
        let Some(exposure) = exposures.get(&node) else {
            out.missing.push(format!("node {node}: no Service port"));
            continue;
        };
        let Some(port) = exposure.external_port() else {
            out.missing.push(format!(
                "node {node}: Service {} has no NodePort yet",
                exposure.service
            ));
            continue;
        };
        let host = match (&ea.advertised_host, exposure.service_type) {
            (Some(h), _) => Some(h.clone()),
            (None, _) if exposure.gateway_port.is_some() => node_hosts.get(&node).cloned(),
            (None, ServiceType::LoadBalancer) => exposure.ingress.clone(),
            (None, ServiceType::ClusterIP) => Some(format!("{}.{ns}.svc", exposure.service)),
            (None, ServiceType::NodePort) => node_hosts.get(&node).cloned(),
        };
        let Some(host) = host else {
            out.missing.push(match exposure.service_type {
                _ if exposure.gateway_port.is_some() => {
                    format!("node {node}: the Gateway has no address yet")
                }
                ServiceType::LoadBalancer => format!(
                    "node {node}: LoadBalancer Service {} has no ingress yet",
                    exposure.service
                ),
                _ => format!("node {node}: its pod is not on a Kubernetes node with an address"),
            });
            continue;
        };
        // Valkey hands out an IP only when it is one, and a name only as a hostname. (A
        // ClusterIP Service's cluster DNS name is for clients inside, which reach the pods.)
        let inside = exposure.service_type == ServiceType::ClusterIP
            && exposure.gateway_port.is_none()
            && ea.advertised_host.is_none();
        if ea.preferred_endpoint_type == EndpointType::Ip && is_dns_name(&host) && !inside {
            out.names_not_handed_out
                .push(format!("node {node}: {host}"));
        }
        let role = role(progress, node);
        out.endpoints.push(ExternalEndpoint {
            shard: node.shard.0 as i32,
            node: node.node.0 as i32,
            service: exposure.service.clone(),
            host,
            port,
            hostname: super::announce::hostname(vc, ea, node),
            role,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn node_addresses_by_preference() {
        let node: Node = serde_json::from_value(json!({
            "metadata": { "name": "n" },
            "status": { "addresses": [
                { "type": "InternalIP", "address": "10.0.0.1" },
                { "type": "Hostname", "address": "n" },
                { "type": "ExternalIP", "address": "203.0.113.1" },
            ] }
        }))
        .unwrap();
        assert_eq!(node_address(&node, None).as_deref(), Some("203.0.113.1"));
        assert_eq!(
            node_address(&node, Some(NodeAddressType::InternalIp)).as_deref(),
            Some("10.0.0.1")
        );
        assert_eq!(
            node_address(&node, Some(NodeAddressType::Hostname)).as_deref(),
            Some("n")
        );
    }

    /// A node reached at a DNS name is handed out only as a hostname: under
    /// `preferredEndpointType: ip` it is named as one clients would not be sent to, and
    /// an `advertisedHost` name without a domain is every node's hostname.
    #[test]
    fn names_are_handed_out_only_as_hostnames() {
        use crate::external::Exposure;
        let vc = ValkeyCluster::test("vc").shards(1).replicas(1);
        let exposure = |t, ingress: &str| Exposure {
            service: "vc-shard-0".into(),
            service_type: t,
            port: 6379,
            node_port: Some(31000),
            ingress: Some(ingress.into()),
            gateway_port: None,
        };
        let exposures = |t, ingress: &str| -> Exposures {
            vc.spec
                .node_refs()
                .map(|n| (n, exposure(t, ingress)))
                .collect()
        };
        let observed = |ea: &ExternalAccess, exposures: &Exposures| {
            let waiting = Progress::Waiting(String::new());
            observe(&vc, ea, exposures, &BTreeMap::new(), &waiting).unwrap()
        };
        let lb = ExternalAccess::announce().service_type(ServiceType::LoadBalancer);
        // An ingress IP is handed out as is.
        let e = observed(&lb, &exposures(ServiceType::LoadBalancer, "203.0.113.7"));
        assert_eq!((e.endpoints.len(), e.names_not_handed_out.len()), (2, 0));
        // An ingress name (a cloud load balancer's) is not, under `ip`.
        let named = exposures(ServiceType::LoadBalancer, "lb-1.elb.example.com");
        let e = observed(&lb, &named);
        assert_eq!(e.endpoints.len(), 2);
        assert_eq!(
            e.names_not_handed_out,
            [
                "node 0-0: lb-1.elb.example.com",
                "node 0-1: lb-1.elb.example.com"
            ]
        );
        // With hostnames from a domain, it is.
        let hostnames = lb
            .clone()
            .domain("example.com")
            .endpoint_type(EndpointType::Hostname);
        assert!(observed(&hostnames, &named).names_not_handed_out.is_empty());
        // An IPv6 ingress is an IP.
        let v6 = exposures(ServiceType::LoadBalancer, "2001:db8::7");
        assert!(observed(&lb, &v6).names_not_handed_out.is_empty());
        // A ClusterIP Service's DNS name is for clients inside, which reach the pods.
        let inside = exposures(ServiceType::ClusterIP, "");
        let e = observed(&ExternalAccess::announce(), &inside);
        assert_eq!((e.endpoints.len(), e.names_not_handed_out.len()), (2, 0));
        // Unless an advertisedHost name stands in for it: that one is for clients outside.
        let named_inside = ExternalAccess::announce().advertised_host("valkey.example.com");
        let e = observed(&named_inside, &inside);
        assert_eq!(e.names_not_handed_out.len(), 2);
        // An advertisedHost name, without a domain: every node's hostname and host.
        let named_host = ExternalAccess::announce()
            .advertised_host("valkey.example.com")
            .endpoint_type(EndpointType::Hostname);
        let e = observed(&named_host, &exposures(ServiceType::NodePort, ""));
        assert!(e.names_not_handed_out.is_empty());
        assert!(e.endpoints.iter().all(|ep| ep.host == "valkey.example.com"
            && ep.hostname.as_deref() == Some("valkey.example.com")));
        // The same under `ip`: named as not handed out.
        let under_ip = named_host.endpoint_type(EndpointType::Ip);
        let e = observed(&under_ip, &exposures(ServiceType::NodePort, ""));
        assert_eq!(e.names_not_handed_out.len(), 2);
    }

    #[test]
    fn bootstrap_lists_primaries_first() {
        let ep = |node, port, role| ExternalEndpoint {
            shard: 0,
            node,
            service: "vc-shard-0".into(),
            host: "127.0.0.9".into(),
            port,
            hostname: None,
            role,
        };
        let e = External {
            endpoints: vec![
                ep(0, 30001, Some(NodeRole::Replica)),
                ep(1, 30002, Some(NodeRole::Primary)),
            ],
            missing: vec![],
            names_not_handed_out: vec![],
        };
        assert_eq!(
            e.bootstrap().as_deref(),
            Some("127.0.0.9:30002,127.0.0.9:30001")
        );
        assert_eq!(External::default().bootstrap(), None);
    }
}
