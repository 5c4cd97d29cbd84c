//! `spec.externalAccess`: how clients outside Kubernetes reach a [`ValkeyCluster`]'s nodes
//! (design.md, "The custom resource"). The operator acts on it; this file holds the types,
//! their defaults and the rules that only look inside the block (the rules that also need
//! `shards`, `replicas` or `portsPerShard`, such as the port range, are on the spec).
//!
//! [`ValkeyCluster`]: crate::valkey_cluster::ValkeyCluster

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ResourceRequirements;
use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::names::Hostnames;

/// Defaults of the block, applied by serde and written into the schema (so the API server
/// fills them in too).
pub mod defaults {
    /// `externalAccess.proxy.replicas`.
    pub const PROXY_REPLICAS: i32 = 2;

    pub(crate) fn proxy_replicas() -> i32 {
        PROXY_REPLICAS
    }
}

/// The pattern of `hostnamePrefix`: one DNS label, lower case (RFC 1123).
pub const HOSTNAME_PREFIX_PATTERN: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";
/// The longest `hostnamePrefix`: a node's first label, `<prefix>-<shard>-<node>`, must stay
/// within DNS's 63 characters.
pub const HOSTNAME_PREFIX_MAX_LEN: usize = 52;
/// The pattern of `domain`: DNS labels separated by dots, lower case (RFC 1123 subdomain).
pub const DOMAIN_PATTERN: &str =
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";
/// The longest `domain`, leaving room for the first label within DNS's 253 characters.
pub const DOMAIN_MAX_LEN: usize = 190;

string_enum! {
    /// `announce`: the upstream design: each node announces its external endpoint
    /// (`--cluster-announce-client-port`, `--cluster-announce-hostname`), so Valkey itself
    /// hands out external addresses. `proxy`: the shardgate proxy rewrites the topology
    /// Valkey hands out; the nodes keep announcing pod IPs.
    pub enum ExternalAccessMode { Announce = "announce", Proxy = "proxy" }
    default = Announce
}

string_enum! {
    /// The type of the Services the operator makes, as Kubernetes spells it.
    pub enum ServiceType { NodePort = "NodePort", LoadBalancer = "LoadBalancer", ClusterIP = "ClusterIP" }
    default = NodePort
}

string_enum! {
    /// `shard`: one Service per shard with one port per node (the seeds' layout). `node`: one
    /// Service per node (upstream's later choice).
    pub enum ServiceLayout { Shard = "shard", Node = "node" }
    default = Shard
}

string_enum! {
    /// `cluster-preferred-endpoint-type`: what Valkey hands out in MOVED/ASK and CLUSTER
    /// SLOTS/SHARDS (`ip`: the announced address; `hostname`: the announced hostname). The
    /// spelling is Valkey's, so it is written into valkey.conf as is.
    pub enum EndpointType { Ip = "ip", Hostname = "hostname" }
    default = Ip
}

string_enum! {
    /// A Service's `externalTrafficPolicy`, as Kubernetes spells it.
    pub enum ExternalTrafficPolicy { Cluster = "Cluster", Local = "Local" }
    default = Cluster
}

string_enum! {
    /// Which of a Kubernetes node's addresses external clients reach NodePorts at, when no
    /// `advertisedHost` is given (Strimzi's `preferredNodePortAddressType`). The spellings
    /// are Kubernetes' `NodeAddress.type`.
    pub enum NodeAddressType {
        ExternalDns = "ExternalDNS",
        ExternalIp = "ExternalIP",
        Hostname = "Hostname",
        InternalDns = "InternalDNS",
        InternalIp = "InternalIP",
    }
    default = ExternalIp
}

impl NodeAddressType {
    /// The order node addresses are tried in when none is preferred (Strimzi's): external
    /// names and addresses before internal ones.
    pub const FALLBACK_ORDER: [NodeAddressType; 5] = [
        NodeAddressType::ExternalDns,
        NodeAddressType::ExternalIp,
        NodeAddressType::InternalDns,
        NodeAddressType::InternalIp,
        NodeAddressType::Hostname,
    ];

    /// The types to try, in order: `preferred` first, then [`Self::FALLBACK_ORDER`].
    pub fn preference(preferred: Option<NodeAddressType>) -> Vec<NodeAddressType> {
        preferred
            .into_iter()
            .chain(Self::FALLBACK_ORDER)
            .fold(Vec::with_capacity(5), |mut v, t| {
                if !v.contains(&t) {
                    v.push(t);
                }
                v
            })
    }
}

string_enum! {
    /// What the proxy does with TLS on its SNI port. `passthrough`: the stream goes to the
    /// node untouched (the nodes must speak TLS: `spec.tls` is required; the proxy cannot
    /// rewrite what it cannot read, so topology replies name the pods). `terminate`: the
    /// proxy terminates TLS with `secretName`'s certificate and talks to the node in plain,
    /// or in TLS with `spec.tls`.
    pub enum ProxyTlsMode { Passthrough = "passthrough", Terminate = "terminate" }
    default = Terminate
}

impl From<ProxyTlsMode> for crate::settings::TlsMode {
    fn from(mode: ProxyTlsMode) -> Self {
        match mode {
            ProxyTlsMode::Passthrough => crate::settings::TlsMode::Passthrough,
            ProxyTlsMode::Terminate => crate::settings::TlsMode::Terminate,
        }
    }
}

/// Whether `host` is a DNS name rather than an IP: it has a letter and no colon (an IPv4
/// address has no letter, an IPv6 address has colons). The CEL rule on
/// `preferredEndpointType` tests `advertisedHost` the same way.
pub fn is_dns_name(host: &str) -> bool {
    !host.contains(':') && host.bytes().any(|b| b.is_ascii_alphabetic())
}

/// `spec.externalAccess`: per-node external endpoints, by Services (announce mode), Gateway
/// API TCPRoutes (`gateway`) or the shardgate proxy (`proxy`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.preferredEndpointType) || self.preferredEndpointType != 'hostname' || (has(self.domain) && self.domain != '') || (has(self.advertisedHost) && !self.advertisedHost.contains(':') && self.advertisedHost.matches('[a-zA-Z]'))")
        .message("domain, or an advertisedHost that is a DNS name, is required when preferredEndpointType is hostname")
        .field_path(".domain")
        .reason(Reason::FieldValueRequired),
    validation = Rule::new("!has(self.proxy) || !has(self.proxy.tls) || (has(self.domain) && self.domain != '')")
        .message("domain is required when proxy.tls is set: the SNI names are <hostnamePrefix>-<shard>-<node>.<domain>")
        .field_path(".domain")
        .reason(Reason::FieldValueRequired),
    validation = Rule::new("!has(self.mode) || self.mode != 'proxy' || has(self.proxy)")
        .message("proxy is required when mode is proxy")
        .field_path(".proxy")
        .reason(Reason::FieldValueRequired),
)]
pub struct ExternalAccess {
    /// Off: the cluster renders exactly as without the block (nothing external is made, and
    /// what was made is removed). The rest of the block is validated either way.
    #[serde(default)]
    pub enabled: bool,

    /// `announce` (default) or `proxy`.
    #[serde(default)]
    pub mode: ExternalAccessMode,

    /// The type of the per-shard (or per-node) Services. Default: NodePort, or ClusterIP
    /// when `gateway` is set (`effective_service_type()` in Rust).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_type: Option<ServiceType>,

    /// `shard` (default): one Service per shard, one port per node; `node`: one Service per
    /// node.
    #[serde(default)]
    pub service_layout: ServiceLayout,

    /// The first external port, `basePort + flatIndex` for each node: the NodePorts requested
    /// (NodePort) or the Service ports (LoadBalancer). Unset: NodePorts are allocated by
    /// Kubernetes, and Service ports are 6379 plus the node index (one Service per shard)
    /// or 6379 (one per node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub base_port: Option<i32>,

    /// The host (IP or DNS name) external clients reach the NodePorts at. Unset: a node's
    /// address of type `nodeAddressType`. Announced as the nodes' client IP when it is an
    /// IP; when it is a DNS name and no `domain` is set, as every node's hostname, which
    /// clients are handed with `preferredEndpointType: hostname`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub advertised_host: Option<String>,

    /// Which node address to announce when no `advertisedHost` is set (Strimzi's
    /// `preferredNodePortAddressType`). Unset: ExternalDNS, ExternalIP, InternalDNS,
    /// InternalIP, Hostname, the first a node has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_address_type: Option<NodeAddressType>,

    /// Cluster or Local; written only for NodePort and LoadBalancer Services, and only when
    /// set (an unset policy is left to Kubernetes' default, Cluster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_traffic_policy: Option<ExternalTrafficPolicy>,

    /// Merged into the Services' annotations (other controllers' keys are kept; keys removed
    /// here are removed). Values may use `{cluster}`, `{shard}`, `{node}` and `{hostname}`.
    /// In proxy mode, the proxy's one Service: `{shard}` and `{node}` are empty, and
    /// `{hostname}` is the bootstrap name `<hostnamePrefix>.<domain>`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub service_annotations: BTreeMap<String, String>,

    /// The DNS domain of the per-node, per-shard and bootstrap names
    /// (`<hostnamePrefix>-<s>-<n>.<domain>`, `<hostnamePrefix>-<s>.<domain>`,
    /// `<hostnamePrefix>.<domain>`). Required when `proxy.tls` is set, and when
    /// `preferredEndpointType` is `hostname` unless `advertisedHost` is a DNS name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = DOMAIN_MAX_LEN), regex(pattern = DOMAIN_PATTERN))]
    pub domain: Option<String>,

    /// The first part of the names; default: the cluster's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = HOSTNAME_PREFIX_MAX_LEN), regex(pattern = HOSTNAME_PREFIX_PATTERN))]
    pub hostname_prefix: Option<String>,

    /// `ip` (default) or `hostname`: Valkey's `cluster-preferred-endpoint-type`. To turn
    /// hostnames off safely, set `ip` first, then remove the domain (or the name in
    /// `advertisedHost`); to turn them on, the other way round.
    #[serde(default)]
    pub preferred_endpoint_type: EndpointType,

    /// Gateway API: one TCPRoute per node, attached to this Gateway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<GatewaySpec>,

    /// The shardgate proxy's Deployment: required in `proxy` mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy: Option<ProxySpec>,
}

impl ExternalAccess {
    /// The fields set here that `mode` does not use, as the resource spells them: in proxy
    /// mode, the announce-mode Services' and a gateway's settings (the proxy block has its
    /// own port, type and host); in announce mode, the proxy block.
    pub fn ignored_fields(&self) -> Vec<&'static str> {
        let mut ignored = Vec::new();
        match self.mode {
            ExternalAccessMode::Proxy => {
                let set = [
                    ("externalAccess.serviceType", self.service_type.is_some()),
                    (
                        "externalAccess.serviceLayout",
                        self.service_layout != ServiceLayout::default(),
                    ),
                    ("externalAccess.basePort", self.base_port.is_some()),
                    (
                        "externalAccess.advertisedHost",
                        self.advertised_host.is_some(),
                    ),
                    (
                        "externalAccess.nodeAddressType",
                        self.node_address_type.is_some(),
                    ),
                    (
                        "externalAccess.preferredEndpointType",
                        self.preferred_endpoint_type != EndpointType::default(),
                    ),
                    ("externalAccess.gateway", self.gateway.is_some()),
                ];
                ignored.extend(set.into_iter().filter(|(_, on)| *on).map(|(f, _)| f));
            }
            ExternalAccessMode::Announce if self.proxy.is_some() => {
                ignored.push("externalAccess.proxy");
            }
            ExternalAccessMode::Announce => {}
        }
        ignored
    }

    /// The Services' type: `serviceType`, else ClusterIP when a gateway routes to them, else
    /// NodePort.
    pub fn effective_service_type(&self) -> ServiceType {
        self.service_type.unwrap_or(if self.gateway.is_some() {
            ServiceType::ClusterIP
        } else {
            ServiceType::NodePort
        })
    }

    /// The `externalTrafficPolicy` to write: the one asked for, and only on NodePort and
    /// LoadBalancer Services (on ClusterIP the API server rejects it). `None`: write nothing
    /// (never an empty string, which the API server defaults and every reconcile would
    /// then "fix" again).
    pub fn effective_external_traffic_policy(&self) -> Option<ExternalTrafficPolicy> {
        self.effective_external_traffic_policy_for(self.effective_service_type())
    }

    /// As [`effective_external_traffic_policy`](Self::effective_external_traffic_policy),
    /// for a Service of `service_type` (the proxy's has its own type).
    pub fn effective_external_traffic_policy_for(
        &self,
        service_type: ServiceType,
    ) -> Option<ExternalTrafficPolicy> {
        match service_type {
            ServiceType::ClusterIP => None,
            ServiceType::NodePort | ServiceType::LoadBalancer => self.external_traffic_policy,
        }
    }

    /// `advertisedHost` when it is a DNS name rather than an IP ([`is_dns_name`]).
    pub fn advertised_name(&self) -> Option<&str> {
        self.advertised_host.as_deref().filter(|h| is_dns_name(h))
    }

    /// The block's hostnames, when a domain is set: the prefix is `hostnamePrefix`, else the
    /// cluster's name.
    pub fn hostnames(&self, cluster_name: &str) -> Option<Hostnames> {
        let domain = self.domain.as_deref().filter(|d| !d.is_empty())?;
        Some(Hostnames {
            prefix: self
                .hostname_prefix
                .clone()
                .unwrap_or_else(|| cluster_name.to_string()),
            domain: domain.to_string(),
        })
    }

    /// Every base port the block sets, with its field's path: each must leave room for all
    /// nodes below 65536.
    pub fn base_ports(&self) -> Vec<(&'static str, i32)> {
        let mut ports = Vec::with_capacity(3);
        if let Some(p) = self.base_port {
            ports.push(("externalAccess.basePort", p));
        }
        if let Some(g) = &self.gateway {
            ports.push(("externalAccess.gateway.basePort", g.base_port));
        }
        if let Some(p) = &self.proxy {
            ports.push(("externalAccess.proxy.basePort", p.base_port));
        }
        ports
    }
}

/// `externalAccess.gateway`: the user's Gateway (in the cluster's namespace) and the first
/// listener port; node `(s, n)` is routed from listener port `basePort + flatIndex`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GatewaySpec {
    /// The Gateway the TCPRoutes attach to.
    pub gateway_ref: GatewayRef,
    /// The Gateway listener port of shard 0, node 0. The listeners themselves are the
    /// user's: the operator reports which ports it expects.
    #[schemars(range(min = 1, max = 65535))]
    pub base_port: i32,
}

/// A Gateway in the cluster's namespace, and optionally one of its listeners.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GatewayRef {
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The listeners' name prefix: node `k` (flat index) attaches to listener
    /// `<sectionName>-<k>` (`parentRefs[].sectionName`), which must also have the node's
    /// port. Unset: each route attaches to the Gateway's listener with its port
    /// (`parentRefs[].port`). A TCP listener carries one route, so one name cannot serve
    /// every node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 240))]
    pub section_name: Option<String>,
}

impl GatewayRef {
    /// The listener the route of the node at `flat_index` names, if any.
    pub fn section_for(&self, flat_index: u32) -> Option<String> {
        self.section_name
            .as_deref()
            .map(|prefix| format!("{prefix}-{flat_index}"))
    }
}

/// `externalAccess.proxy`: the shardgate proxy's Deployment and Service.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxySpec {
    /// Proxy pods (default 2).
    #[serde(default = "defaults::proxy_replicas")]
    #[schemars(range(min = 0))]
    pub replicas: i32,

    /// The proxy's listener port of shard 0, node 0: node `(s, n)` listens at
    /// `basePort + flatIndex`.
    #[schemars(range(min = 1, max = 65535))]
    pub base_port: i32,

    /// The proxy Service's type (default LoadBalancer).
    #[serde(default = "proxy_service_type")]
    pub service_type: ServiceType,

    /// The host clients reach the proxy at, handed out in rewritten replies; unset: the
    /// Service's LoadBalancer ingress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub advertised_host: Option<String>,

    /// One TLS port for the whole cluster, routed by SNI name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<ProxyTls>,

    /// With `tls` (nodes on TLS): a `kubernetes.io/tls` Secret whose certificate, signed by
    /// the CA of `tls.secretName`'s Secret, the proxy shows the nodes. Unset: the nodes' own
    /// certificate and key; a proxy pod, which faces clients outside, then holds a key the
    /// nodes would take for one of theirs on the cluster bus. Set, the proxy pods mount only
    /// `ca.crt` of `tls.secretName`'s Secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub client_secret_name: Option<String>,

    /// The proxy container's resources.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,

    /// The proxy's image; unset: the operator's `--proxy-image` (its own release's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub image: Option<String>,
}

impl ProxySpec {
    /// A proxy listening from `base_port`, with the defaults (2 replicas, a LoadBalancer
    /// Service, no TLS port).
    pub fn new(base_port: i32) -> Self {
        ProxySpec {
            replicas: defaults::PROXY_REPLICAS,
            base_port,
            service_type: proxy_service_type(),
            advertised_host: None,
            tls: None,
            client_secret_name: None,
            resources: None,
            image: None,
        }
    }
}

fn proxy_service_type() -> ServiceType {
    ServiceType::LoadBalancer
}

/// `externalAccess.proxy.tls`: the proxy's SNI port.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.mode) || self.mode != 'terminate' || (has(self.secretName) && self.secretName != '')")
        .message("secretName is required when mode is terminate")
        .field_path(".secretName")
        .reason(Reason::FieldValueRequired),
    validation = Rule::new("!has(self.verifyClients) || !self.verifyClients || !has(self.mode) || self.mode == 'terminate'")
        .message(crate::validation::VERIFY_CLIENTS_NEEDS_TERMINATE)
        .field_path(".verifyClients"),
)]
pub struct ProxyTls {
    /// The TLS port; outside the node ports (`basePort` to `basePort + shards * stride - 1`).
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,

    /// The Secret (`tls.crt`, `tls.key`, and `ca.crt` with `verifyClients`) the proxy
    /// terminates with; required for `terminate`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub secret_name: Option<String>,

    /// `terminate` (default) or `passthrough`.
    #[serde(default)]
    pub mode: ProxyTlsMode,

    /// Mutual TLS: every client must present a certificate signed by the Secret's `ca.crt`
    /// (which must then be there); `terminate` only. Off: any client may connect.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub verify_clients: bool,
}

/// Whether `s` is a valid `hostnamePrefix` ([`HOSTNAME_PREFIX_PATTERN`],
/// [`HOSTNAME_PREFIX_MAX_LEN`]).
pub fn is_hostname_prefix(s: &str) -> bool {
    s.len() <= HOSTNAME_PREFIX_MAX_LEN && is_dns_label(s)
}

/// Whether `s` is a valid `domain` ([`DOMAIN_PATTERN`], [`DOMAIN_MAX_LEN`]).
pub fn is_domain(s: &str) -> bool {
    s.len() <= DOMAIN_MAX_LEN && s.split('.').all(is_dns_label)
}

/// `[a-z0-9]([-a-z0-9]*[a-z0-9])?`
fn is_dns_label(s: &str) -> bool {
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    match s.as_bytes() {
        [] => false,
        [only] => alnum(*only),
        [first, middle @ .., last] => {
            alnum(*first) && alnum(*last) && middle.iter().all(|&b| alnum(b) || b == b'-')
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each mode names the fields it leaves unused, and only those.
    #[test]
    fn fields_a_mode_does_not_use_are_named() {
        assert!(ExternalAccess::proxy(31000).ignored_fields().is_empty());
        let used = ExternalAccess::proxy(31000)
            .domain("example.com")
            .endpoint_type(EndpointType::Ip);
        assert!(used.ignored_fields().is_empty());
        let mixed = ExternalAccess::proxy(31000)
            .base_port(30000)
            .endpoint_type(EndpointType::Hostname);
        assert_eq!(
            mixed.ignored_fields(),
            [
                "externalAccess.basePort",
                "externalAccess.preferredEndpointType"
            ]
        );
        assert!(ExternalAccess::announce().ignored_fields().is_empty());
        let mut announce = ExternalAccess::announce();
        announce.proxy = Some(ProxySpec::new(31000));
        assert_eq!(announce.ignored_fields(), ["externalAccess.proxy"]);
    }

    #[test]
    fn enums_spell_as_the_design_does() {
        assert_eq!(ExternalAccessMode::Proxy.to_string(), "proxy");
        assert_eq!(ServiceType::ClusterIP.to_string(), "ClusterIP");
        assert_eq!(ServiceLayout::Node.to_string(), "node");
        assert_eq!(EndpointType::Hostname.to_string(), "hostname");
        assert_eq!(NodeAddressType::ExternalIp.to_string(), "ExternalIP");
        assert_eq!(ProxyTlsMode::Passthrough.to_string(), "passthrough");
        assert_eq!(
            "LoadBalancer".parse::<ServiceType>(),
            Ok(ServiceType::LoadBalancer)
        );
        let err = "nodeport".parse::<ServiceType>().unwrap_err();
        assert_eq!(
            err.to_string(),
            r#""nodeport" is not one of NodePort, LoadBalancer, ClusterIP"#
        );
        for t in NodeAddressType::ALL {
            assert_eq!(serde_json::to_value(t).unwrap(), t.as_str());
            assert_eq!(t.as_str().parse::<NodeAddressType>(), Ok(*t));
        }
        assert_eq!(
            crate::settings::TlsMode::from(ProxyTlsMode::default()),
            crate::settings::TlsMode::Terminate
        );
    }

    #[test]
    fn defaults_are_serdes_and_defaults() {
        let ea: ExternalAccess = serde_json::from_str("{}").unwrap();
        assert_eq!(ea, ExternalAccess::default());
        assert_eq!(ea.mode, ExternalAccessMode::Announce);
        assert_eq!(ea.service_layout, ServiceLayout::Shard);
        assert_eq!(ea.preferred_endpoint_type, EndpointType::Ip);
        assert!(!ea.enabled);
        // Nothing unset is written back (no nulls, no empty maps).
        assert_eq!(
            serde_json::to_value(&ea).unwrap(),
            serde_json::json!({
                "enabled": false, "mode": "announce", "serviceLayout": "shard",
                "preferredEndpointType": "ip",
            })
        );
        let proxy: ProxySpec = serde_json::from_str(r#"{"basePort": 30000}"#).unwrap();
        assert_eq!(proxy.replicas, 2);
        assert_eq!(proxy.service_type, ServiceType::LoadBalancer);
        let tls: ProxyTls = serde_json::from_str(r#"{"port": 6380}"#).unwrap();
        assert_eq!(tls.mode, ProxyTlsMode::Terminate);
    }

    #[test]
    fn service_type_and_traffic_policy() {
        let mut ea = ExternalAccess {
            external_traffic_policy: Some(ExternalTrafficPolicy::Local),
            ..Default::default()
        };
        assert_eq!(ea.effective_service_type(), ServiceType::NodePort);
        assert_eq!(
            ea.effective_external_traffic_policy(),
            Some(ExternalTrafficPolicy::Local)
        );
        ea.gateway = Some(GatewaySpec {
            gateway_ref: GatewayRef {
                name: "gw".into(),
                section_name: None,
            },
            base_port: 40000,
        });
        assert_eq!(ea.effective_service_type(), ServiceType::ClusterIP);
        assert_eq!(ea.effective_external_traffic_policy(), None);
        ea.service_type = Some(ServiceType::LoadBalancer);
        assert_eq!(ea.effective_service_type(), ServiceType::LoadBalancer);
        ea.external_traffic_policy = None;
        assert_eq!(ea.effective_external_traffic_policy(), None);
    }

    #[test]
    fn hostnames_default_to_the_cluster_name() {
        let mut ea = ExternalAccess::default();
        assert_eq!(ea.hostnames("vc"), None);
        ea.domain = Some("example.com".into());
        assert_eq!(
            ea.hostnames("vc"),
            Some(Hostnames {
                prefix: "vc".into(),
                domain: "example.com".into()
            })
        );
        ea.hostname_prefix = Some("valkey".into());
        assert_eq!(ea.hostnames("vc").unwrap().prefix, "valkey");
    }

    #[test]
    fn node_address_preference() {
        assert_eq!(
            NodeAddressType::preference(None),
            NodeAddressType::FALLBACK_ORDER.to_vec()
        );
        let p = NodeAddressType::preference(Some(NodeAddressType::InternalIp));
        assert_eq!(p[0], NodeAddressType::InternalIp);
        assert_eq!(p.len(), 5);
    }

    #[test]
    fn dns_names() {
        for good in ["a", "vc", "valkey-0", "0"] {
            assert!(is_hostname_prefix(good), "{good}");
        }
        for bad in ["", "-a", "a-", "A", "a.b", "a_b", &"a".repeat(53)] {
            assert!(!is_hostname_prefix(bad), "{bad}");
        }
        for good in ["example.com", "a", "a-b.c-d.e"] {
            assert!(is_domain(good), "{good}");
        }
        for bad in ["", ".", "a..b", "a.", ".a", "Example.com", "a_b.c", "a.-b"] {
            assert!(!is_domain(bad), "{bad}");
        }
    }
}
