//! Gateway mode (`externalAccess.gateway`): one Gateway API TCPRoute per node, attached to
//! the user's Gateway at `gateway.basePort + flatIndex` and routed to the node's port of its
//! (ClusterIP by default) external Service. The Gateway and its listeners are the user's:
//! this module reports which listeners the routes expect, which the Gateway lacks, and the
//! Gateway's address, which the nodes then announce.
//!
//! Gateway API is optional: [`discover`] looks for the TCPRoute kind once, at start-up.
//! Without it the operator runs every other mode, and a cluster that asks for a gateway is
//! told so once (an Event) and in its conditions.

use std::collections::{BTreeMap, BTreeSet};

use gateway_api::experimental::gateways::Gateway;
use gateway_api::experimental::tcproutes::TcpRoute;
use kube::api::Api;
use kube::discovery::{self, ApiResource};
use kube::{Client, ResourceExt};
use serde_json::json;
use shardgate_crds::external_access::ExternalAccess;
use shardgate_crds::names::{labels, objects};
use shardgate_crds::valkey_cluster::{ExpectedListener, GatewayRouting, ValkeyCluster};
use shardgate_crds::NodeRef;

use super::Exposures;
use crate::context::Context;
use crate::error::{Error, Result};
use crate::objects::{apply, build, cluster_labels, delete_external_except, namespace, owner};

/// The Gateway API group.
pub const GROUP: &str = "gateway.networking.k8s.io";

/// Whether the API server serves what gateway mode needs, found once at start-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GatewayApi {
    Served,
    /// Why not, for the one Event and the condition.
    Missing(String),
}

impl GatewayApi {
    pub fn served(&self) -> bool {
        matches!(self, GatewayApi::Served)
    }
}

/// Looks for the TCPRoute and Gateway kinds of Gateway API (TCPRoute is in its
/// experimental channel). An API server that does not answer is an error: the operator
/// must not decide "no Gateway API" from a timeout.
pub async fn discover(client: &Client) -> Result<GatewayApi> {
    let group = match discovery::group(client, GROUP).await {
        Ok(g) => g,
        Err(kube::Error::Discovery(kube::error::DiscoveryError::MissingApiGroup(_))) => {
            return Ok(GatewayApi::Missing(format!(
                "the API server does not serve {GROUP} (Gateway API CRDs not installed)"
            )))
        }
        Err(e) => return Err(e.into()),
    };
    let kinds: BTreeSet<String> = group
        .versions()
        .flat_map(|v| group.versioned_resources(v))
        .map(|(r, _)| format!("{}/{}", r.version, r.kind))
        .collect();
    for (ar, what) in [
        (route_resource(), "TCPRoute (experimental channel)"),
        (gateway_resource(), "Gateway"),
    ] {
        if !kinds.contains(&format!("{}/{}", ar.version, ar.kind)) {
            return Ok(GatewayApi::Missing(format!(
                "the API server serves {GROUP} but not {what} {}",
                ar.api_version
            )));
        }
    }
    Ok(GatewayApi::Served)
}

fn route_resource() -> ApiResource {
    ApiResource::erase::<TcpRoute>(&())
}

fn gateway_resource() -> ApiResource {
    ApiResource::erase::<Gateway>(&())
}

/// The listener port of every node: `gateway.basePort + flatIndex`.
pub fn ports(vc: &ValkeyCluster, base_port: i32) -> Result<BTreeMap<NodeRef, (u32, i32)>> {
    let layout = vc
        .spec
        .layout(base_port)
        .map_err(|e| Error::Invalid(e.to_string()))?;
    let mut out = BTreeMap::new();
    for node in vc.spec.node_refs() {
        let invalid = |e: shardgate_crds::PortError| Error::Invalid(e.to_string());
        let flat = layout.flat_index(node).map_err(invalid)?;
        let port = layout.port(node).map_err(invalid)?;
        out.insert(node, (flat, i32::from(port)));
    }
    Ok(out)
}

/// The TCPRoutes of `vc`: one per node with a Service port, from its Gateway listener to it.
pub fn desired(
    vc: &ValkeyCluster,
    ea: &ExternalAccess,
    exposures: &Exposures,
) -> Result<(Vec<TcpRoute>, Vec<ExpectedListener>)> {
    let Some(g) = &ea.gateway else {
        return Ok((Vec::new(), Vec::new()));
    };
    let cluster = vc.name_any();
    let mut routes = Vec::new();
    let mut expected = Vec::new();
    for (node, (flat, port)) in ports(vc, g.base_port)? {
        let Some(exposure) = exposures.get(&node) else {
            continue;
        };
        let name = objects::tcp_route(&cluster, node);
        let section = g.gateway_ref.section_for(flat);
        let mut parent = json!({
            "group": GROUP,
            "kind": "Gateway",
            "name": g.gateway_ref.name,
            "port": port,
        });
        if let Some(s) = &section {
            parent["sectionName"] = json!(s);
        }
        let mut route_labels = cluster_labels(vc);
        route_labels.insert(labels::COMPONENT.into(), labels::COMPONENT_EXTERNAL.into());
        route_labels.insert(labels::SHARD_INDEX.into(), node.shard.to_string());
        route_labels.insert(labels::NODE_INDEX.into(), node.node.to_string());
        let route: TcpRoute = build(
            "TCPRoute",
            json!({
                "apiVersion": format!("{GROUP}/v1alpha2"),
                "kind": "TCPRoute",
                "metadata": {
                    "name": name,
                    "labels": route_labels,
                    "ownerReferences": [owner(vc)?],
                },
                "spec": {
                    "parentRefs": [parent],
                    "rules": [{
                        "backendRefs": [{
                            "group": "",
                            "kind": "Service",
                            "name": exposure.service,
                            "port": exposure.port,
                        }],
                    }],
                },
            }),
        )?;
        routes.push(route);
        expected.push(ExpectedListener {
            port,
            name: section,
            route: name,
        });
    }
    Ok((routes, expected))
}

/// What gateway mode found on a reconcile.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Routing {
    /// For `status.gateway`.
    pub status: GatewayRouting,
    /// What keeps clients from reaching every node through the Gateway (empty: nothing).
    pub problems: Vec<String>,
    /// Why the problems are there, for the GatewayReady condition's reason.
    pub reason: &'static str,
}

impl Routing {
    fn problem(name: &str, reason: &'static str, what: String) -> Routing {
        Routing {
            status: GatewayRouting {
                name: name.into(),
                ..Default::default()
            },
            problems: vec![what],
            reason,
        }
    }
}

/// Applies the TCPRoutes of `vc` and deletes the ones it no longer needs (removed nodes,
/// gateway mode or external access turned off). Returns what the Gateway has (`None`
/// without gateway mode) and the names of the routes deleted.
pub async fn apply_routes(
    vc: &ValkeyCluster,
    ctx: &Context,
    ea: Option<&ExternalAccess>,
    exposures: &Exposures,
) -> Result<(Option<Routing>, Vec<String>)> {
    let gateway = ea.and_then(|ea| ea.gateway.as_ref().map(|g| (ea, g)));
    if !ctx.gateway_api.served() {
        // Nothing can have been made: routes exist only where the kind is served.
        return Ok((
            gateway.map(|(_, g)| {
                let why = match &ctx.gateway_api {
                    GatewayApi::Missing(why) => why.clone(),
                    GatewayApi::Served => String::new(),
                };
                Routing::problem(&g.gateway_ref.name, "GatewayAPIUnavailable", why)
            }),
            Vec::new(),
        ));
    }
    let ns = namespace(vc)?;
    let api: Api<TcpRoute> = Api::namespaced(ctx.client.clone(), &ns);
    let (routes, expected) = match gateway {
        Some((ea, _)) => desired(vc, ea, exposures)?,
        None => (Vec::new(), Vec::new()),
    };
    let mut applied = Vec::with_capacity(routes.len());
    for route in &routes {
        applied.push(apply(&api, route).await?);
    }
    let wanted: BTreeSet<String> = routes.iter().map(ResourceExt::name_any).collect();
    let deleted = delete_external_except(&api, vc, &wanted).await?;
    let Some((_, g)) = gateway else {
        return Ok((None, deleted));
    };
    let gateways: Api<Gateway> = Api::namespaced(ctx.client.clone(), &ns);
    let routing = match gateways.get_opt(&g.gateway_ref.name).await? {
        Some(gw) => observe(&gw, expected, &applied),
        None => Routing::problem(
            &g.gateway_ref.name,
            "GatewayNotFound",
            format!("Gateway {} not found in namespace {ns}", g.gateway_ref.name),
        ),
    };
    Ok((Some(routing), deleted))
}

/// Compares the Gateway with the listeners the routes expect, and reads its address and
/// whether it accepted each route.
pub fn observe(gw: &Gateway, expected: Vec<ExpectedListener>, routes: &[TcpRoute]) -> Routing {
    let name = gw.name_any();
    let tcp: Vec<(&str, i32)> = gw
        .spec
        .listeners
        .iter()
        .filter(|l| l.protocol == "TCP")
        .map(|l| (l.name.as_str(), l.port))
        .collect();
    let missing_ports: Vec<i32> = expected
        .iter()
        .filter(|e| {
            !tcp.iter()
                .any(|(n, p)| *p == e.port && e.name.as_deref().is_none_or(|want| want == *n))
        })
        .map(|e| e.port)
        .collect();
    let address = gw
        .status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .and_then(|a| a.iter().find(|a| !a.value.is_empty()))
        .map(|a| a.value.clone());
    // Every problem, the first one's reason for the condition.
    let mut problems: Vec<(&'static str, String)> = Vec::new();
    if !missing_ports.is_empty() {
        problems.push((
            "ListenersMissing",
            format!(
                "Gateway {name} has no TCP listener on port{} {}{}",
                if missing_ports.len() == 1 { "" } else { "s" },
                ranges(&missing_ports),
                if expected.iter().any(|e| e.name.is_some()) {
                    " (with the expected names)"
                } else {
                    ""
                }
            ),
        ));
    }
    // Listeners there but reported unusable by the Gateway's controller: not accepted, not
    // programmed, unresolved or conflicted (a port another listener has, say). A controller
    // that reports no listener status, or no condition of a listener, is taken at its spec.
    let statuses = gw
        .status
        .as_ref()
        .and_then(|s| s.listeners.as_deref())
        .unwrap_or_default();
    let unusable: Vec<String> = tcp
        .iter()
        .filter(|(n, p)| {
            expected
                .iter()
                .any(|e| e.port == *p && e.name.as_deref().is_none_or(|want| want == *n))
        })
        .filter_map(|(n, p)| {
            let status = statuses.iter().find(|l| l.name == *n)?;
            let bad: Vec<String> = status
                .conditions
                .iter()
                // A condition written for an older spec says nothing of this one (a
                // conflict the user has since fixed, say).
                .filter(|c| {
                    !matches!((c.observed_generation, gw.metadata.generation),
                        (Some(seen), Some(now)) if seen < now)
                })
                .filter(|c| {
                    let is_true = c.status == "True";
                    match c.type_.as_str() {
                        "Accepted" | "Programmed" | "ResolvedRefs" => !is_true,
                        "Conflicted" => is_true,
                        _ => false,
                    }
                })
                .map(|c| format!("{}={} {}: {}", c.type_, c.status, c.reason, c.message))
                .collect();
            (!bad.is_empty()).then(|| format!("{n} (port {p}, {})", bad.join("; ")))
        })
        .collect();
    if !unusable.is_empty() {
        problems.push((
            "ListenersNotProgrammed",
            format!(
                "Gateway {name} reports listener{} not ready: {}",
                if unusable.len() == 1 { "" } else { "s" },
                unusable.join(", ")
            ),
        ));
    }
    // A route the Gateway's controller has not accepted (yet, or at all): its reason.
    let refused: Vec<String> = routes
        .iter()
        .filter_map(|r| {
            let parent = r
                .status
                .as_ref()
                .and_then(|s| s.parents.iter().find(|p| p.parent_ref.name == name));
            let accepted = parent.and_then(|p| p.conditions.iter().find(|c| c.type_ == "Accepted"));
            match accepted {
                Some(c) if c.status == "True" => None,
                Some(c) => Some(format!("{} ({}: {})", r.name_any(), c.reason, c.message)),
                None => Some(format!(
                    "{} (no answer from the Gateway's controller yet)",
                    r.name_any()
                )),
            }
        })
        .collect();
    if !refused.is_empty() {
        problems.push((
            "RoutesNotAccepted",
            format!(
                "routes not accepted by Gateway {name}: {}",
                refused.join(", ")
            ),
        ));
    }
    if address.is_none() {
        problems.push((
            "NoAddress",
            format!("Gateway {name} has no address in its status yet"),
        ));
    }
    let reason = problems.first().map_or("RoutesAccepted", |(r, _)| *r);
    Routing {
        status: GatewayRouting {
            name,
            address,
            expected_listeners: expected,
            missing_ports,
        },
        problems: problems.into_iter().map(|(_, what)| what).collect(),
        reason,
    }
}

/// `31000-31002, 31005`: ports as ranges, for messages.
fn ranges(ports: &[i32]) -> String {
    let mut sorted = ports.to_vec();
    sorted.sort_unstable();
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        out.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    out.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::external::Exposure;
    use shardgate_crds::external_access::ServiceType;

    fn exposures(vc: &ValkeyCluster) -> Exposures {
        vc.spec
            .node_refs()
            .map(|n| {
                (
                    n,
                    Exposure {
                        service: format!("vc-shard-{}", n.shard),
                        service_type: ServiceType::ClusterIP,
                        port: 6379 + n.node.0 as i32,
                        node_port: None,
                        ingress: None,
                        gateway_port: None,
                    },
                )
            })
            .collect()
    }

    #[test]
    fn one_route_per_node_at_base_port_plus_flat_index() {
        let vc = ValkeyCluster::test("vc")
            .shards(2)
            .replicas(1)
            .external(ExternalAccess::gateway("gw", 31000));
        let ea = vc.spec.external_access().unwrap();
        let (routes, expected) = desired(&vc, ea, &exposures(&vc)).unwrap();
        assert_eq!(routes.len(), 4);
        let last = serde_json::to_value(&routes[3]).unwrap();
        assert_eq!(last["metadata"]["name"], "vc-1-1");
        assert_eq!(
            last["spec"]["parentRefs"],
            json!([{ "group": GROUP, "kind": "Gateway", "name": "gw", "port": 31003 }])
        );
        assert_eq!(
            last["spec"]["rules"][0]["backendRefs"],
            json!([{ "group": "", "kind": "Service", "name": "vc-shard-1", "port": 6380 }])
        );
        assert_eq!(last["metadata"]["labels"][labels::NODE_INDEX], "1");
        let ports: Vec<i32> = expected.iter().map(|e| e.port).collect();
        assert_eq!(ports, [31000, 31001, 31002, 31003]);
        assert!(expected.iter().all(|e| e.name.is_none()));
    }

    #[test]
    fn a_section_name_is_a_prefix_of_one_listener_per_node() {
        let mut ea = ExternalAccess::gateway("gw", 31000);
        if let Some(g) = ea.gateway.as_mut() {
            g.gateway_ref.section_name = Some("valkey".into());
        }
        let vc = ValkeyCluster::test("vc").shards(1).replicas(1).external(ea);
        let ea = vc.spec.external_access().unwrap();
        let (routes, expected) = desired(&vc, ea, &exposures(&vc)).unwrap();
        let second = serde_json::to_value(&routes[1]).unwrap();
        assert_eq!(second["spec"]["parentRefs"][0]["sectionName"], "valkey-1");
        assert_eq!(second["spec"]["parentRefs"][0]["port"], 31001);
        assert_eq!(expected[1].name.as_deref(), Some("valkey-1"));
    }

    fn gateway(listeners: serde_json::Value, address: Option<&str>) -> Gateway {
        let mut gw = json!({
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "Gateway",
            "metadata": { "name": "gw", "namespace": "ns" },
            "spec": { "gatewayClassName": "traefik", "listeners": listeners },
        });
        if let Some(a) = address {
            gw["status"] = json!({ "addresses": [{ "type": "IPAddress", "value": a }] });
        }
        serde_json::from_value(gw).unwrap()
    }

    fn expected(ports: &[i32]) -> Vec<ExpectedListener> {
        ports
            .iter()
            .map(|&port| ExpectedListener {
                port,
                name: None,
                route: format!("r{port}"),
            })
            .collect()
    }

    #[test]
    fn missing_listeners_are_reported_as_port_ranges() {
        let gw = gateway(
            json!([
                { "name": "a", "port": 31000, "protocol": "TCP" },
                { "name": "b", "port": 31001, "protocol": "HTTP" },
                { "name": "c", "port": 31004, "protocol": "TCP" },
            ]),
            Some("127.0.0.9"),
        );
        let r = observe(
            &gw,
            expected(&[31000, 31001, 31002, 31003, 31004, 31006]),
            &[],
        );
        assert_eq!(r.status.missing_ports, [31001, 31002, 31003, 31006]);
        assert_eq!(r.reason, "ListenersMissing");
        assert!(
            r.problems[0].ends_with("no TCP listener on ports 31001-31003, 31006"),
            "{:?}",
            r.problems
        );
        assert_eq!(r.status.address.as_deref(), Some("127.0.0.9"));
    }

    #[test]
    fn every_listener_and_accepted_routes_is_no_problem() {
        let gw = gateway(
            json!([{ "name": "a", "port": 31000, "protocol": "TCP" }]),
            Some("127.0.0.9"),
        );
        let route: TcpRoute = serde_json::from_value(json!({
            "apiVersion": "gateway.networking.k8s.io/v1alpha2",
            "kind": "TCPRoute",
            "metadata": { "name": "vc-0-0" },
            "spec": { "rules": [{ "backendRefs": [{ "name": "s", "port": 6379 }] }] },
            "status": { "parents": [{
                "controllerName": "traefik.io/gateway-controller",
                "parentRef": { "name": "gw" },
                "conditions": [{
                    "type": "Accepted", "status": "True", "reason": "Accepted", "message": "",
                    "lastTransitionTime": "2026-11-30T00:00:00Z",
                }],
            }] },
        }))
        .unwrap();
        let r = observe(&gw, expected(&[31000]), std::slice::from_ref(&route));
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        // No address yet: that is a problem of its own.
        let r = observe(
            &gateway(
                json!([{ "name": "a", "port": 31000, "protocol": "TCP" }]),
                None,
            ),
            expected(&[31000]),
            &[route],
        );
        assert_eq!(r.reason, "NoAddress");
    }

    /// A listener the Gateway's controller reports unusable (here: a port conflict) is a
    /// problem; one it reports nothing about, or reports programmed, is not.
    #[test]
    fn listeners_reported_not_ready_are_a_problem() {
        let mut gw = gateway(
            json!([
                { "name": "a", "port": 31000, "protocol": "TCP" },
                { "name": "b", "port": 31001, "protocol": "TCP" },
                { "name": "c", "port": 31002, "protocol": "TCP" },
            ]),
            Some("127.0.0.9"),
        );
        let condition = |type_: &str, status: &str, reason: &str| {
            json!({
                "type": type_, "status": status, "reason": reason, "message": "",
                "lastTransitionTime": "2026-11-30T00:00:00Z",
            })
        };
        let status = json!({
            "addresses": [{ "type": "IPAddress", "value": "127.0.0.9" }],
            "listeners": [
                {
                    "name": "a", "attachedRoutes": 1,
                    "conditions": [condition("Programmed", "True", "Programmed")],
                },
                {
                    "name": "b", "attachedRoutes": 0,
                    "conditions": [
                        condition("Accepted", "True", "Accepted"),
                        condition("Conflicted", "True", "ProtocolConflict"),
                        condition("Programmed", "False", "Invalid"),
                    ],
                },
            ],
        });
        gw.status = Some(serde_json::from_value(status).unwrap());
        let r = observe(&gw, expected(&[31000, 31001, 31002]), &[]);
        assert_eq!(r.reason, "ListenersNotProgrammed");
        assert!(
            r.problems[0].contains(
                "b (port 31001, Conflicted=True ProtocolConflict: ; Programmed=False Invalid: )"
            ) && !r.problems[0].contains("a (")
                && !r.problems[0].contains("c ("),
            "{:?}",
            r.problems
        );
        assert_eq!(r.problems.len(), 1, "{:?}", r.problems);
        // Not accepted, or a reference unresolved: the same. Conditions written for an
        // older generation of the Gateway are not read.
        let mut status = serde_json::to_value(gw.status.as_ref().unwrap()).unwrap();
        status["listeners"][1]["conditions"] = json!([
            condition("Accepted", "False", "PortUnavailable"),
            condition("ResolvedRefs", "False", "InvalidRouteKinds"),
        ]);
        status["listeners"][0]["conditions"] = json!([{
            "type": "Programmed", "status": "False", "reason": "Pending", "message": "",
            "observedGeneration": 1, "lastTransitionTime": "2026-11-30T00:00:00Z",
        }]);
        gw.status = Some(serde_json::from_value(status).unwrap());
        gw.metadata.generation = Some(2);
        let r = observe(&gw, expected(&[31000, 31001, 31002]), &[]);
        assert_eq!(
            r.problems,
            ["Gateway gw reports listener not ready: b (port 31001, Accepted=False PortUnavailable: ; ResolvedRefs=False InvalidRouteKinds: )"]
        );
        // A route that names its listener (sectionName) is not served by another one on
        // its port: that listener's status is not its business either.
        let named = vec![ExpectedListener {
            port: 31001,
            name: Some("valkey-1".into()),
            route: "r".into(),
        }];
        let r = observe(&gw, named, &[]);
        assert_eq!(r.reason, "ListenersMissing");
        assert_eq!(r.problems.len(), 1, "{:?}", r.problems);
        // A listener no route expects is none of this cluster's business.
        let r = observe(&gw, expected(&[31000]), &[]);
        assert!(
            r.problems.iter().all(|p| !p.contains("listener")),
            "{:?}",
            r.problems
        );
    }
}
