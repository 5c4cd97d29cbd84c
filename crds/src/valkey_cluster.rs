//! The `ValkeyCluster` custom resource (`shardgate.io/v1alpha1`): spec, status, their
//! defaults, the helpers the operator needs (port layout, nodes, hostnames) and the CRD YAML.
//! Its validation, in CEL and in Rust, is in [`crate::validation`].

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, CustomResourceExt, KubeSchema, ResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::external_access::ExternalAccess;
use crate::names::Hostnames;
use crate::ports::{NodeRef, PortLayout};
use crate::validation::{
    immutable, passthrough_rule, port_range_rule, proxy_client_secret_rule, proxy_tls_port_rule,
    reserved_config_rule, SpecError, BASE_PORT_FIELDS, MAX_SHARDS,
};

/// Defaults of the spec, applied by serde and written into the schema (so the API server
/// fills them in too).
pub mod defaults {
    /// `shards`.
    pub const SHARDS: i32 = 3;
    /// `replicas` (per shard).
    pub const REPLICAS: i32 = 1;
    /// `image`.
    pub const IMAGE: &str = "valkey/valkey:9.0";

    pub(crate) fn shards() -> i32 {
        SHARDS
    }
    pub(crate) fn replicas() -> i32 {
        REPLICAS
    }
    pub(crate) fn image() -> String {
        IMAGE.to_string()
    }
}

/// A Valkey cluster run by the shardgate operator: `shards` primaries with `replicas` replicas
/// each, one StatefulSet per node, and optionally reachable from outside Kubernetes
/// (`externalAccess`).
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
// One `printcolumn(...)` per column, each with its `type_`: not a duplicate.
#[allow(clippy::duplicated_attributes)]
#[kube(
    group = "shardgate.io",
    version = "v1alpha1",
    kind = "ValkeyCluster",
    namespaced,
    status = "ValkeyClusterStatus",
    shortname = "vkc",
    derive = "PartialEq",
    derive = "Default",
    doc = "A Valkey cluster run by the shardgate operator",
    printcolumn(name = "Shards", type_ = "integer", json_path = ".spec.shards"),
    printcolumn(name = "Replicas", type_ = "integer", json_path = ".spec.replicas"),
    printcolumn(
        name = "Ready",
        type_ = "string",
        description = "ready nodes / nodes",
        json_path = ".status.ready"
    ),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = port_range_rule(BASE_PORT_FIELDS[0]),
    validation = port_range_rule(BASE_PORT_FIELDS[1]),
    validation = port_range_rule(BASE_PORT_FIELDS[2]),
    validation = Rule::new("!has(self.portsPerShard) || self.portsPerShard >= self.replicas + 1")
        .message("portsPerShard must be at least replicas + 1")
        .field_path(".portsPerShard"),
    validation = proxy_tls_port_rule(),
    validation = passthrough_rule(),
    validation = proxy_client_secret_rule(),
    validation = Rule::new(
            "has(oldSelf.portsPerShard) \
             ? (has(self.portsPerShard) && self.portsPerShard == oldSelf.portsPerShard) \
             : (!has(self.portsPerShard) || self.portsPerShard == oldSelf.replicas + 1)"
        )
        .message(immutable::PORTS_PER_SHARD)
        .field_path(".portsPerShard")
        .reason(Reason::FieldValueForbidden),
    validation = Rule::new("has(self.persistence) == has(oldSelf.persistence)")
        .message(immutable::PERSISTENCE_PRESENCE)
        .field_path(".persistence")
        .reason(Reason::FieldValueForbidden),
    validation = Rule::new("has(self.tls) == has(oldSelf.tls)")
        .message(immutable::TLS_PRESENCE)
        .field_path(".tls")
        .reason(Reason::FieldValueForbidden),
)]
pub struct ValkeyClusterSpec {
    /// Shards (primaries, each serving a range of slots): 1 to 16384, default 3.
    #[serde(default = "defaults::shards")]
    #[schemars(range(min = 1, max = MAX_SHARDS))]
    pub shards: i32,

    /// Replicas per shard: at least 0, default 1. Without `portsPerShard`, changing it
    /// renumbers the external ports of every shard after the first.
    #[serde(default = "defaults::replicas")]
    #[schemars(range(min = 0))]
    pub replicas: i32,

    /// The Valkey image (9.0 or later for the announce flags of `externalAccess`).
    #[serde(default = "defaults::image")]
    #[schemars(length(min = 1))]
    pub image: String,

    /// The Valkey container's resources.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,

    /// valkey.conf settings (`name: value`), rendered by the operator; a change rolls the
    /// pods one at a time. Keys the operator writes itself (`port`, `cluster-enabled`,
    /// `cluster-announce-*`, ...) are refused.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[x_kube(validation = reserved_config_rule())]
    pub config: BTreeMap<String, String>,

    /// TLS between clients and nodes and among the nodes, with this Secret's certificate:
    /// the nodes speak only TLS, on the client port, the cluster bus and replication, and
    /// ask clients for a certificate signed by its `ca.crt` unless `config` sets
    /// `tls-auth-clients` to `no` or `optional`. Can be neither added nor removed (a node on
    /// TLS and one on plain RESP cannot talk on the cluster bus). In proxy mode the proxy
    /// dials the nodes over TLS too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsSpec>,

    /// A PersistentVolumeClaim per node for its data. Immutable, and can be neither added
    /// nor removed: it becomes each node's StatefulSet's volumeClaimTemplate, which
    /// Kubernetes never lets change, and the data lives on those volumes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(
        validation = Rule::new("self == oldSelf")
            .message(immutable::PERSISTENCE)
            .reason(Reason::FieldValueForbidden)
    )]
    pub persistence: Option<PersistenceSpec>,

    /// External ports per shard (at least replicas + 1): node (s, n) gets
    /// `basePort + s * portsPerShard + n`. Unset: replicas + 1. Set it to keep every port
    /// where it is while replicas scale. Immutable once set (it can be added only with the
    /// current replicas + 1): changing it renumbers every external port, and clients and DNS
    /// records would reach other nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub ports_per_shard: Option<i32>,

    /// How clients outside Kubernetes reach the nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_access: Option<ExternalAccess>,
}

impl Default for ValkeyClusterSpec {
    /// What the API server fills in for an empty spec.
    fn default() -> Self {
        ValkeyClusterSpec {
            shards: defaults::SHARDS,
            replicas: defaults::REPLICAS,
            image: defaults::image(),
            resources: None,
            config: BTreeMap::new(),
            tls: None,
            persistence: None,
            ports_per_shard: None,
            external_access: None,
        }
    }
}

/// `spec.tls`: the nodes speak TLS, with this Secret's certificate.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TlsSpec {
    /// A Secret in the cluster's namespace with `ca.crt`, `tls.crt` and `tls.key` (a
    /// `kubernetes.io/tls` Secret as cert-manager writes it). Every node presents `tls.crt`
    /// as server and as client (cluster bus, replication), so it needs both extended key
    /// usages (or none); the operator presents it too. A change of name restarts the nodes
    /// one at a time: the new certificate must chain to a CA the old nodes trust.
    #[schemars(length(min = 1, max = 253))]
    pub secret_name: String,
}

/// `spec.persistence`: a PersistentVolumeClaim per node.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PersistenceSpec {
    /// The claim's storage request, e.g. `1Gi`.
    pub size: Quantity,
    /// The claim's StorageClass; unset: the cluster's default class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class_name: Option<String>,
}

string_enum! {
    /// Where the cluster is, in one word (the printer column; the conditions say why).
    pub enum Phase {
        Pending = "Pending",
        Forming = "Forming",
        Ready = "Ready",
        Scaling = "Scaling",
        Upgrading = "Upgrading",
        Degraded = "Degraded",
        Failed = "Failed",
    }
    default = Pending
}

string_enum! {
    /// The condition types in `status.conditions`.
    pub enum ConditionType {
        Ready = "Ready",
        ClusterFormed = "ClusterFormed",
        Progressing = "Progressing",
        Degraded = "Degraded",
        ExternalAccessReady = "ExternalAccessReady",
        GatewayReady = "GatewayReady",
    }
    default = Ready
}

string_enum! {
    /// A node's live role, as Valkey reports it (not its index: node 0 is only the initial
    /// primary).
    pub enum NodeRole { Primary = "primary", Replica = "replica" }
    default = Primary
}

/// What the operator observed.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ValkeyClusterStatus {
    /// One per type: Ready, ClusterFormed, Progressing, Degraded, ExternalAccessReady,
    /// GatewayReady (`ConditionType` in Rust).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,

    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Pending, Forming, Ready, Scaling, Upgrading, Degraded or Failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,

    /// Nodes that are running, ready and part of the cluster.
    #[serde(default)]
    pub ready_nodes: i32,

    /// Shards whose primary is ready and serves its slots.
    #[serde(default)]
    pub ready_shards: i32,

    /// Ready nodes out of all, e.g. `5/6` (the printer column).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<String>,

    /// Per node: where clients outside Kubernetes connect.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub external_endpoints: Vec<ExternalEndpoint>,

    /// A `host:port,host:port,...` list to start a cluster client from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap: Option<String>,

    /// Gateway mode: the listeners the routes expect on the Gateway, and what it lacks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<GatewayRouting>,

    /// The shape the cluster last formed whole with. While the spec asks for another, the
    /// phase is Scaling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub formed: Option<Shape>,
}

/// A cluster's shape: its shards, and the replicas of each.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Shape {
    pub shards: i32,
    pub replicas: i32,
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let replicas = if self.replicas == 1 {
            "replica"
        } else {
            "replicas"
        };
        write!(
            f,
            "{} shards, {} {replicas} each",
            self.shards, self.replicas
        )
    }
}

/// `status.gateway`: the TCP listeners the routes need on the user's Gateway (the listeners
/// are the user's to declare), and which of them it does not have.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GatewayRouting {
    /// The Gateway's name (in the cluster's namespace).
    pub name: String,
    /// The Gateway's address (its `status.addresses`), once it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// One TCP listener per node, in flat-index order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expected_listeners: Vec<ExpectedListener>,
    /// The expected listener ports the Gateway has no TCP listener for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing_ports: Vec<i32>,
}

/// A listener the routes need: its port, and its name when `sectionName` is set.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExpectedListener {
    pub port: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The TCPRoute that attaches to it.
    pub route: String,
}

/// `ready/total`, the text of `status.ready`.
pub fn ready_text(ready: u32, total: u32) -> String {
    format!("{ready}/{total}")
}

/// One node's external endpoint, as reported in `status.externalEndpoints`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExternalEndpoint {
    pub shard: i32,
    pub node: i32,
    /// The Service (or proxy Service) that exposes it.
    pub service: String,
    /// The IP address or DNS name clients connect to.
    pub host: String,
    pub port: i32,
    /// The node's hostname (`<prefix>-<s>-<n>.<domain>`), when hostnames are configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// The node's live role.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<NodeRole>,
}

impl ExternalEndpoint {
    /// `host:port` (`[host]:port` for an IPv6 address).
    pub fn address(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

impl fmt::Display for ExternalEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "shard {} node {} at {}",
            self.shard,
            self.node,
            self.address()
        )
    }
}

impl ValkeyClusterSpec {
    /// Ports per shard: `portsPerShard`, else `replicas + 1` (of a valid spec).
    pub fn stride(&self) -> u32 {
        match self.ports_per_shard {
            Some(p) => u32::try_from(p).unwrap_or(0),
            None => u32::try_from(self.replicas).unwrap_or(0).saturating_add(1),
        }
    }

    /// The external ports from `base_port`: checks `basePort + shards * stride - 1 <= 65535`
    /// (with [`PortLayout::new`], the one Rust implementation of the rule).
    pub fn layout(&self, base_port: i32) -> Result<PortLayout, SpecError> {
        self.layout_for("basePort", base_port)
    }

    /// Every node, shard by shard: `(0, 0), (0, 1), ..., (shards - 1, replicas)`.
    pub fn node_refs(&self) -> impl Iterator<Item = NodeRef> {
        let shards = u32::try_from(self.shards).unwrap_or(0);
        let nodes = u32::try_from(self.replicas).map_or(0, |r| r.saturating_add(1));
        (0..shards).flat_map(move |s| (0..nodes).map(move |n| NodeRef::new(s, n)))
    }

    /// Nodes in all: `shards * (replicas + 1)`.
    pub fn node_count(&self) -> u32 {
        let shards = u32::try_from(self.shards).unwrap_or(0);
        let nodes = u32::try_from(self.replicas).map_or(0, |r| r.saturating_add(1));
        shards.saturating_mul(nodes)
    }

    /// The shape the spec asks for.
    pub fn shape(&self) -> Shape {
        Shape {
            shards: self.shards,
            replicas: self.replicas,
        }
    }

    /// The `externalAccess` block when it is enabled (a disabled block acts as if absent).
    pub fn external_access(&self) -> Option<&ExternalAccess> {
        self.external_access.as_ref().filter(|ea| ea.enabled)
    }

    /// The cluster's hostnames, when external access is enabled and has a domain; the prefix
    /// is `hostnamePrefix`, else `cluster_name`.
    pub fn hostnames(&self, cluster_name: &str) -> Option<Hostnames> {
        self.external_access()?.hostnames(cluster_name)
    }
}

impl ValkeyCluster {
    /// The cluster's hostnames (prefix default: the resource's name), when external access
    /// is enabled and has a domain.
    pub fn hostnames(&self) -> Option<Hostnames> {
        self.spec.hostnames(&self.name_any())
    }
}

/// The header of the generated CRD file.
pub const CRD_HEADER: &str =
    "# generated by `cargo run -p shardgate-crds --features resource --bin crdgen`; do not edit\n";

/// Where the generated CRD is checked in, from the workspace root.
pub const CRD_FILE: &str = "deploy/crds/valkeyclusters.shardgate.io.yaml";

/// The CRD as YAML, with [`CRD_HEADER`]: what `crdgen` prints and [`CRD_FILE`] holds.
pub fn crd_yaml() -> String {
    let yaml = serde_yaml::to_string(&ValkeyCluster::crd())
        .unwrap_or_else(|e| unreachable!("a CRD always serializes: {e}"));
    format!("{CRD_HEADER}{yaml}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::external_access::{EndpointType, ServiceType};

    #[test]
    fn an_empty_spec_gets_the_defaults() {
        let spec: ValkeyClusterSpec = serde_json::from_str("{}").unwrap();
        assert_eq!(spec, ValkeyClusterSpec::default());
        assert_eq!((spec.shards, spec.replicas), (3, 1));
        assert_eq!(spec.image, "valkey/valkey:9.0");
        assert_eq!(
            serde_json::to_value(&spec).unwrap(),
            serde_json::json!({ "shards": 3, "replicas": 1, "image": "valkey/valkey:9.0" })
        );
        let status: ValkeyClusterStatus = serde_json::from_str("{}").unwrap();
        assert_eq!(status, ValkeyClusterStatus::default());
    }

    #[test]
    fn the_schema_carries_the_defaults() {
        let crd = serde_json::to_value(ValkeyCluster::crd()).unwrap();
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
            ["properties"];
        assert_eq!(spec["shards"]["default"], 3);
        assert_eq!(spec["shards"]["minimum"], 1.0);
        assert_eq!(spec["replicas"]["default"], 1);
        assert_eq!(spec["replicas"]["minimum"], 0.0);
        let ea = &spec["externalAccess"]["properties"];
        assert_eq!(ea["serviceLayout"]["default"], "shard");
        assert_eq!(ea["mode"]["default"], "announce");
        assert_eq!(ea["preferredEndpointType"]["default"], "ip");
        assert_eq!(ea["proxy"]["properties"]["replicas"]["default"], 2);
        assert_eq!(
            ea["proxy"]["properties"]["serviceType"]["default"],
            "LoadBalancer"
        );
        // No default for a service type that depends on `gateway`.
        assert!(ea["serviceType"].get("default").is_none());
        let columns: Vec<&str> = crd["spec"]["versions"][0]["additionalPrinterColumns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert_eq!(columns, ["Shards", "Replicas", "Ready", "Phase", "Age"]);
        assert!(crd_yaml().starts_with(CRD_HEADER));
    }

    #[test]
    fn layout_and_nodes() {
        let vc = ValkeyCluster::test("vc").shards(3).replicas(1);
        assert_eq!(vc.spec.stride(), 2);
        let layout = vc.spec.layout(30000).unwrap();
        assert_eq!(layout.last_port(), 30005);
        assert_eq!(layout.port(NodeRef::new(2, 1)).unwrap(), 30005);
        assert!(vc.spec.layout(65531).is_err());
        let nodes: Vec<NodeRef> = vc.spec.node_refs().collect();
        assert_eq!(nodes.len(), 6);
        assert_eq!(vc.spec.node_count(), 6);
        assert_eq!(nodes[0], NodeRef::new(0, 0));
        assert_eq!(nodes[5], NodeRef::new(2, 1));
        let pinned = vc.clone().ports_per_shard(4);
        assert_eq!(pinned.spec.stride(), 4);
        assert_eq!(pinned.spec.node_refs().count(), 6);
        assert_eq!(pinned.spec.layout(30000).unwrap().last_port(), 30011);
    }

    #[test]
    fn hostnames_only_when_enabled() {
        let ea = ExternalAccess::announce()
            .domain("example.com")
            .endpoint_type(EndpointType::Hostname);
        let vc = ValkeyCluster::test("vc").external(ea.clone());
        assert_eq!(
            vc.hostnames(),
            Some(Hostnames {
                prefix: "vc".into(),
                domain: "example.com".into()
            })
        );
        let off = ValkeyCluster::test("vc").external(ea.disabled());
        assert_eq!(off.hostnames(), None);
        assert!(off.spec.external_access().is_none());
        let gw = ValkeyCluster::test("vc").external(ExternalAccess::gateway("gw", 40000));
        assert_eq!(
            gw.spec.external_access().unwrap().effective_service_type(),
            ServiceType::ClusterIP
        );
    }

    #[test]
    fn status_texts() {
        assert_eq!(ready_text(5, 6), "5/6");
        let ep = ExternalEndpoint {
            shard: 1,
            node: 0,
            service: "vc-1".into(),
            host: "fd00::1".into(),
            port: 30002,
            hostname: None,
            role: Some(NodeRole::Primary),
        };
        assert_eq!(ep.address(), "[fd00::1]:30002");
        assert_eq!(ep.to_string(), "shard 1 node 0 at [fd00::1]:30002");
        assert_eq!(Phase::Ready.to_string(), "Ready");
        assert_eq!(
            ConditionType::ExternalAccessReady.as_str(),
            "ExternalAccessReady"
        );
        assert_eq!(
            serde_json::to_value(NodeRole::Replica).unwrap(),
            serde_json::json!("replica")
        );
    }
}
