//! The external Services of announce mode: one per shard with one port per node
//! (`serviceLayout: shard`, named `vk-n<n>`, each targeting its node's own named container
//! port `vk-<s>-<n>`), or one per node (`serviceLayout: node`). What the API server
//! allocated (NodePorts) and assigned (LoadBalancer ingress) is read back from the applied
//! objects.
//!
//! The upstream review's pitfalls, each avoided here:
//! - annotations are applied (server-side apply owns only the keys it writes), never
//!   replaced: other controllers' keys stay, and keys removed from `serviceAnnotations` go;
//! - `externalTrafficPolicy` is written only when set, and only for NodePort and
//!   LoadBalancer (never `""`, never on ClusterIP); ports carry their protocol; nothing the
//!   API server defaults is written, so an unchanged spec writes nothing;
//! - NodePort → ClusterIP: NodePorts the operator never set are the API server's and are
//!   dropped with the type; NodePorts it set (`basePort`) it stops applying. An update the
//!   API server still refuses (422) is done as delete and create.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, DeleteParams};
use kube::ResourceExt;
use serde_json::json;
use shardgate_crds::external_access::{ExternalAccess, ServiceLayout, ServiceType};
use shardgate_crds::names::{labels, objects};
use shardgate_crds::valkey_cluster::ValkeyCluster;
use shardgate_crds::{NodeRef, ShardIndex};
use tracing::warn;

use crate::configmap::CLIENT_PORT;
use crate::context::Context;
use crate::error::{Error, Result};
use crate::objects::{apply, build, cluster_labels, delete_external_except, namespace, owner};

/// Where one node is exposed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exposure {
    /// The Service's name.
    pub service: String,
    pub service_type: ServiceType,
    /// The Service port.
    pub port: i32,
    /// The NodePort the API server allocated (NodePort and LoadBalancer Services).
    pub node_port: Option<i32>,
    /// The LoadBalancer's ingress (an IP or a name), once one is assigned.
    pub ingress: Option<String>,
    /// Gateway mode: the Gateway listener port routed to this node.
    pub gateway_port: Option<i32>,
}

impl Exposure {
    /// The port clients outside connect to: the Gateway's listener in gateway mode, the
    /// NodePort of a NodePort Service, else the Service port.
    pub fn external_port(&self) -> Option<i32> {
        if self.gateway_port.is_some() {
            return self.gateway_port;
        }
        match self.service_type {
            ServiceType::NodePort => self.node_port,
            ServiceType::LoadBalancer | ServiceType::ClusterIP => Some(self.port),
        }
    }
}

/// Every node's exposure.
pub type Exposures = BTreeMap<NodeRef, Exposure>;

/// One Service to apply and the nodes it exposes (with their port names).
pub struct Desired {
    pub service: Service,
    pub nodes: Vec<(NodeRef, String)>,
}

/// `{cluster}`, `{shard}`, `{node}` and `{hostname}` in an annotation value (`{node}` is
/// empty on a shard's Service, `{hostname}` the shard's name there, and empty without a
/// domain).
pub fn template(
    value: &str,
    cluster: &str,
    shard: Option<ShardIndex>,
    node: Option<NodeRef>,
    hostname: Option<&str>,
) -> String {
    value
        .replace("{cluster}", cluster)
        .replace("{shard}", &shard.map(|s| s.to_string()).unwrap_or_default())
        .replace(
            "{node}",
            &node.map(|n| n.node.to_string()).unwrap_or_default(),
        )
        .replace("{hostname}", hostname.unwrap_or_default())
}

/// The Service port of `node`, and the NodePort to ask for: `basePort + flatIndex` when
/// `basePort` is set (the Service port, and the NodePort of a NodePort Service); else the
/// client port, plus the node index on a shard's Service (its ports must differ).
fn ports(vc: &ValkeyCluster, ea: &ExternalAccess, node: NodeRef) -> Result<(i32, Option<i32>)> {
    if let Some(base) = ea.base_port {
        let layout = vc
            .spec
            .layout(base)
            .map_err(|e| Error::Invalid(e.to_string()))?;
        let port = i32::from(
            layout
                .port(node)
                .map_err(|e| Error::Invalid(e.to_string()))?,
        );
        let node_port = (ea.effective_service_type() == ServiceType::NodePort).then_some(port);
        return Ok((port, node_port));
    }
    let port = match ea.service_layout {
        ServiceLayout::Shard => i32::from(CLIENT_PORT) + node.node.0 as i32,
        ServiceLayout::Node => i32::from(CLIENT_PORT),
    };
    Ok((port, None))
}

/// The Services `vc` needs in announce mode (`ea`).
pub fn desired(vc: &ValkeyCluster, ea: &ExternalAccess) -> Result<Vec<Desired>> {
    let cluster = vc.name_any();
    let hostnames = ea.hostnames(&cluster);
    let service_type = ea.effective_service_type();
    let nodes: Vec<NodeRef> = vc.spec.node_refs().collect();
    // (name, shard, node when one Service per node, its nodes)
    let groups: Vec<(String, ShardIndex, Option<NodeRef>, Vec<NodeRef>)> = match ea.service_layout {
        ServiceLayout::Shard => (0..vc.spec.shards.max(0) as u32)
            .map(|s| {
                let shard = ShardIndex(s);
                let members = nodes.iter().filter(|n| n.shard == shard).copied().collect();
                (
                    objects::shard_service(&cluster, shard),
                    shard,
                    None,
                    members,
                )
            })
            .collect(),
        ServiceLayout::Node => nodes
            .iter()
            .map(|n| {
                (
                    objects::node_service(&cluster, *n),
                    n.shard,
                    Some(*n),
                    vec![*n],
                )
            })
            .collect(),
    };
    let mut out = Vec::with_capacity(groups.len());
    for (name, shard, one, members) in groups {
        let mut svc_labels = cluster_labels(vc);
        svc_labels.insert(labels::COMPONENT.into(), labels::COMPONENT_EXTERNAL.into());
        svc_labels.insert(labels::SHARD_INDEX.into(), shard.to_string());
        let mut selector = BTreeMap::from([
            (
                labels::MANAGED_BY.to_string(),
                labels::MANAGED_BY_VALUE.to_string(),
            ),
            (labels::INSTANCE.to_string(), cluster.clone()),
            (labels::SHARD_INDEX.to_string(), shard.to_string()),
        ]);
        if let Some(n) = one {
            svc_labels.insert(labels::NODE_INDEX.into(), n.node.to_string());
            selector.insert(labels::NODE_INDEX.into(), n.node.to_string());
        }
        let hostname = hostnames.as_ref().map(|h| match one {
            Some(n) => shardgate_crds::node_hostname(&h.prefix, n, &h.domain),
            None => shardgate_crds::shard_hostname(&h.prefix, shard, &h.domain),
        });
        let annotations: BTreeMap<String, String> = ea
            .service_annotations
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    template(v, &cluster, Some(shard), one, hostname.as_deref()),
                )
            })
            .collect();
        let mut port_list = Vec::with_capacity(members.len());
        let mut named = Vec::with_capacity(members.len());
        for n in &members {
            let (port, node_port) = ports(vc, ea, *n)?;
            let port_name = objects::service_port(*n);
            let mut p = json!({
                "name": port_name,
                "port": port,
                "targetPort": objects::container_port(*n),
                "protocol": "TCP",
            });
            if let Some(np) = node_port {
                p["nodePort"] = json!(np);
            }
            port_list.push(p);
            named.push((*n, port_name));
        }
        let mut spec = json!({
            "type": service_type.as_str(),
            "selector": selector,
            "ports": port_list,
        });
        if let Some(policy) = ea.effective_external_traffic_policy() {
            spec["externalTrafficPolicy"] = json!(policy.as_str());
        }
        let mut metadata = json!({
            "name": name,
            "labels": svc_labels,
            "ownerReferences": [owner(vc)?],
        });
        if !annotations.is_empty() {
            metadata["annotations"] = json!(annotations);
        }
        let service: Service = build(
            "external Service",
            json!({ "apiVersion": "v1", "kind": "Service", "metadata": metadata, "spec": spec }),
        )?;
        out.push(Desired {
            service,
            nodes: named,
        });
    }
    Ok(out)
}

/// Applies the external Services of `vc` (none unless external access is on in announce
/// mode), deletes the ones no longer needed (scale-in, another layout, disabled), and
/// returns where each node is exposed. Returns the names of the Services deleted too.
pub async fn apply_services(
    vc: &ValkeyCluster,
    ctx: &Context,
    ea: Option<&ExternalAccess>,
) -> Result<(Exposures, Vec<String>)> {
    let api: Api<Service> = Api::namespaced(ctx.client.clone(), &namespace(vc)?);
    let wanted = match ea {
        Some(ea) => desired(vc, ea)?,
        None => Vec::new(),
    };
    let gateway_ports = match ea.and_then(|ea| ea.gateway.as_ref()) {
        Some(g) => super::gateway::ports(vc, g.base_port)?,
        None => BTreeMap::new(),
    };
    let mut exposures = Exposures::new();
    let mut names = BTreeSet::new();
    for d in wanted {
        let name = d.service.name_any();
        let applied = match apply(&api, &d.service).await {
            Ok(s) => s,
            // A change the API server refuses in place (a field the new type forbids that
            // no field manager owns): the Service is made again.
            Err(Error::Kube(kube::Error::Api(status))) if status.is_invalid() => {
                warn!(service = %name, "re-creating the Service: {}", status.message);
                api.delete(&name, &DeleteParams::default()).await?;
                apply(&api, &d.service).await?
            }
            Err(e) => return Err(e),
        };
        let spec = applied.spec.clone().unwrap_or_default();
        let service_type = spec
            .type_
            .as_deref()
            .and_then(|t| t.parse().ok())
            .unwrap_or(ServiceType::ClusterIP);
        let ingress = applied
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|lb| lb.ingress.as_ref())
            .and_then(|i| i.first())
            .and_then(|i| i.ip.clone().or_else(|| i.hostname.clone()));
        for (node, port_name) in d.nodes {
            let Some(p) = spec
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some(port_name.as_str()))
            else {
                continue;
            };
            exposures.insert(
                node,
                Exposure {
                    service: name.clone(),
                    service_type,
                    port: p.port,
                    node_port: p.node_port,
                    ingress: ingress.clone(),
                    gateway_port: gateway_ports.get(&node).map(|&(_, port)| port),
                },
            );
        }
        names.insert(name);
    }
    let deleted = delete_external_except(&api, vc, &names).await?;
    Ok((exposures, deleted))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;
    use shardgate_crds::external_access::ExternalTrafficPolicy;

    fn services(vc: &ValkeyCluster) -> Vec<Value> {
        let ea = vc.spec.external_access().unwrap();
        desired(vc, ea)
            .unwrap()
            .into_iter()
            .map(|d| serde_json::to_value(d.service).unwrap())
            .collect()
    }

    #[test]
    fn one_service_per_shard_with_a_port_per_node() {
        let vc = ValkeyCluster::test("vc").shards(2).replicas(1).external(
            ExternalAccess::announce().annotation("dns/name", "{hostname}:{shard}/{node}"),
        );
        let svcs = services(&vc);
        assert_eq!(svcs.len(), 2);
        let s1 = &svcs[1];
        assert_eq!(s1["metadata"]["name"], "vc-shard-1");
        assert_eq!(s1["spec"]["type"], "NodePort");
        assert_eq!(s1["spec"]["selector"][labels::SHARD_INDEX], "1");
        assert!(s1["spec"]["selector"].get(labels::NODE_INDEX).is_none());
        assert_eq!(
            s1["spec"]["ports"],
            json!([
                { "name": "vk-n0", "port": 6379, "targetPort": "vk-1-0", "protocol": "TCP" },
                { "name": "vk-n1", "port": 6380, "targetPort": "vk-1-1", "protocol": "TCP" },
            ])
        );
        // No policy asked for: none written (never "").
        assert!(s1["spec"].get("externalTrafficPolicy").is_none());
        assert_eq!(s1["metadata"]["annotations"]["dns/name"], ":1/");
        assert_eq!(s1["metadata"]["labels"][labels::COMPONENT], "external");
    }

    #[test]
    fn one_service_per_node_with_base_ports_and_templates() {
        let mut ea = ExternalAccess::announce()
            .base_port(30100)
            .domain("example.com")
            .annotation("external-dns.alpha.kubernetes.io/hostname", "{hostname}");
        ea.service_layout = ServiceLayout::Node;
        ea.external_traffic_policy = Some(ExternalTrafficPolicy::Local);
        let vc = ValkeyCluster::test("vc")
            .shards(2)
            .replicas(1)
            .external(ea.clone());
        let svcs = services(&vc);
        assert_eq!(svcs.len(), 4);
        let last = &svcs[3];
        assert_eq!(last["metadata"]["name"], "vc-node-1-1");
        assert_eq!(last["spec"]["selector"][labels::NODE_INDEX], "1");
        assert_eq!(
            last["spec"]["ports"],
            json!([{ "name": "vk-n1", "port": 30103, "nodePort": 30103, "targetPort": "vk-1-1", "protocol": "TCP" }])
        );
        assert_eq!(last["spec"]["externalTrafficPolicy"], "Local");
        assert_eq!(
            last["metadata"]["annotations"]["external-dns.alpha.kubernetes.io/hostname"],
            "vc-1-1.example.com"
        );
        // ClusterIP: no NodePort, no traffic policy.
        let vc = ValkeyCluster::test("vc")
            .shards(2)
            .replicas(1)
            .external(ea.service_type(ServiceType::ClusterIP));
        let svcs = services(&vc);
        assert_eq!(svcs[0]["spec"]["type"], "ClusterIP");
        assert!(svcs[0]["spec"].get("externalTrafficPolicy").is_none());
        assert!(svcs[0]["spec"]["ports"][0].get("nodePort").is_none());
    }
}
