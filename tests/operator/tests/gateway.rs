//! Gateway mode end to end: the operator's TCPRoutes on a real Gateway API implementation
//! (Traefik v3, run by the harness out of cluster against its API server, one entry point
//! per listener port on a loopback IP of its own), and clients outside Kubernetes that know
//! only the Gateway's address.

use std::collections::{BTreeMap, BTreeSet};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _, Result};
use gateway_api::experimental::tcproutes::TcpRoute;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use shardgate_crds::names::{labels, objects};
use shardgate_crds::valkey_cluster::ValkeyCluster;
use shardgate_kube_harness::{TestEnv, TRAEFIK_CONTROLLER_NAME};
use shardgate_operator_e2e::external::{
    bootstrap_seeds, external_cluster, external_services, failovers_under_load, gateway_access,
    only_external_addresses, port_range, redis_cli_set_get, wait_external_ready, TraefikGateway,
    FORM,
};
use shardgate_operator_e2e::tls::{refuses_plain_and_anonymous, topology_over_tls, ClusterTls};
use shardgate_operator_e2e::{condition, create, eventually, reconcile_again, Operator};

fn main() -> ExitCode {
    let Some(suite) = shardgate_operator_e2e::suite_with_crds() else {
        return ExitCode::FAILURE;
    };
    suite
        .timeout(Duration::from_secs(600))
        .test(
            "gateway_routes_every_node_and_external_clients_know_only_the_gateway",
            routes_every_node,
        )
        .test(
            "gateway_added_and_removed_services_change_type_and_routes_go",
            added_and_removed,
        )
        .test(
            "gateway_carries_tls_nodes_to_tls_clients_that_know_only_the_gateway",
            tls_through,
        )
        .test(
            "gateway_failover_under_load_and_a_killed_primary_lose_no_acknowledged_write",
            failovers,
        )
        .run()
}

/// The cluster's TCPRoutes, by name.
async fn routes(client: &Client, ns: &str) -> Result<BTreeMap<String, TcpRoute>> {
    let list = Api::<TcpRoute>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&format!("{}=vc", labels::INSTANCE)))
        .await?;
    Ok(list.into_iter().map(|r| (r.name_any(), r)).collect())
}

async fn routes_every_node(env: TestEnv) -> Result<()> {
    let base = 32100u16;
    let ports = port_range(base, 6);
    // The user's Gateway declares only four of the six listeners the routes need.
    let gw = TraefikGateway::start(&env.cp, &env.client, &env.ns, &ports, 4, "l").await?;
    let TestEnv { client, ns, .. } = &env;
    let operator = Operator::start(client, ns);
    let started = Instant::now();
    create(
        client,
        ns,
        &external_cluster("vc", 3, 1, gateway_access(base, None))?,
    )
    .await?;

    // Status says which listeners are missing, and the condition why.
    let api = Api::<ValkeyCluster>::namespaced(client.clone(), ns);
    eventually("GatewayReady False: ListenersMissing", FORM, || async {
        let vc = api.get("vc").await?;
        let routing = vc
            .status
            .as_ref()
            .and_then(|s| s.gateway.clone())
            .context("no status.gateway")?;
        let expected: Vec<i32> = routing.expected_listeners.iter().map(|l| l.port).collect();
        ensure!(
            expected == ports.iter().map(|&p| i32::from(p)).collect::<Vec<_>>(),
            "{routing:?}"
        );
        ensure!(
            routing.missing_ports == [i32::from(base) + 4, i32::from(base) + 5],
            "{routing:?}"
        );
        let c = condition(&vc, "GatewayReady");
        let want = format!("ports {}-{}", base + 4, base + 5);
        ensure!(
            c.as_ref().is_some_and(|(s, r, m)| s == "False"
                && r == "ListenersMissing"
                && m.contains(&want)),
            "GatewayReady: {c:?}"
        );
        Ok(())
    })
    .await?;
    // One route per node, attached by port to the Gateway, to the node's Service port.
    let made = routes(client, ns).await?;
    ensure!(made.len() == 6, "routes {:?}", made.keys());
    let services = external_services(client, ns, "vc").await?;
    for node in (0..3).flat_map(|s| (0..2).map(move |n| shardgate_crds::NodeRef::new(s, n))) {
        let name = objects::tcp_route("vc", node);
        let route = made.get(&name).with_context(|| format!("route {name}"))?;
        let parent = route
            .spec
            .parent_refs
            .iter()
            .flatten()
            .next()
            .context("no parentRef")?;
        let flat = node.shard.0 * 2 + node.node.0;
        ensure!(
            parent.name == "gw" && parent.port == Some(i32::from(base) + flat as i32),
            "{name}: {parent:?}"
        );
        let backend = &route.spec.rules[0].backend_refs[0];
        let svc = objects::shard_service("vc", node.shard);
        let svc_port = services
            .get(&svc)
            .and_then(|s| s.spec.as_ref())
            .and_then(|s| s.ports.as_ref())
            .and_then(|p| {
                p.iter()
                    .find(|p| p.name.as_deref() == Some(&objects::service_port(node)))
            })
            .map(|p| p.port);
        ensure!(
            backend.name == svc && backend.port == svc_port,
            "{name}: {backend:?} vs {svc} {svc_port:?}"
        );
    }
    // The Services a Gateway routes to are ClusterIP: no NodePort, no traffic policy.
    for (name, s) in &services {
        let spec = s.spec.clone().unwrap_or_default();
        ensure!(
            spec.type_.as_deref() == Some("ClusterIP"),
            "{name}: {spec:?}"
        );
        ensure!(spec.external_traffic_policy.is_none(), "{name}: {spec:?}");
        ensure!(
            spec.ports.iter().flatten().all(|p| p.node_port.is_none()),
            "{name}: {spec:?}"
        );
    }

    // The user adds the two listeners: every route is accepted and every node reachable.
    gw.declare(&ports, "l").await?;
    let vc = wait_external_ready(client, ns, "vc").await?;
    eprintln!(
        "3x1 cluster behind the Gateway Ready in {:?}",
        started.elapsed()
    );
    let c = condition(&vc, "GatewayReady");
    ensure!(c.as_ref().is_some_and(|(s, ..)| s == "True"), "{c:?}");
    let status = vc.status.clone().context("status")?;
    let routing = status.gateway.clone().context("status.gateway")?;
    ensure!(routing.missing_ports.is_empty(), "{routing:?}");
    ensure!(
        routing.address.as_deref() == Some(gw.ip().to_string().as_str()),
        "{routing:?}"
    );
    ensure!(status.external_endpoints.len() == 6, "{status:?}");
    for ep in &status.external_endpoints {
        let flat = ep.shard * 2 + ep.node;
        ensure!(
            ep.host == gw.ip().to_string() && ep.port == i32::from(base) + flat,
            "{ep:?}"
        );
    }
    // Every route accepted by Traefik (as status shows it to a user).
    for (name, r) in routes(client, ns).await? {
        let accepted = r.status.as_ref().is_some_and(|s| {
            s.parents.iter().any(|p| {
                p.controller_name == TRAEFIK_CONTROLLER_NAME
                    && p.conditions
                        .iter()
                        .any(|c| c.type_ == "Accepted" && c.status == "True")
            })
        });
        ensure!(accepted, "{name} not accepted: {:?}", r.status);
    }

    // Clients that know only the Gateway: a cluster client seeded with the bootstrap list
    // does 10,000 SET/GET, and topology replies name only the Gateway's address.
    only_external_addresses(client, ns, "vc", &status, 10_000).await?;
    let seeds = bootstrap_seeds(&vc)?;
    ensure!(
        seeds.iter().all(|a| a.ip() == gw.ip()),
        "bootstrap {seeds:?}"
    );
    // redis-cli -c from one Gateway address: 10,000 SET/GET over every slot.
    let seed = seeds[0];
    tokio::task::spawn_blocking(move || redis_cli_set_get(seed, 10_000)).await??;

    // Nothing changed: more reconciles rewrite no route.
    let versions = |m: &BTreeMap<String, TcpRoute>| -> BTreeMap<String, String> {
        m.iter()
            .map(|(n, r)| (n.clone(), r.resource_version().unwrap_or_default()))
            .collect()
    };
    let before = versions(&routes(client, ns).await?);
    for i in 0..2 {
        reconcile_again(&api, &operator, "vc", i).await?;
    }
    let after = versions(&routes(client, ns).await?);
    ensure!(before == after, "routes rewritten: {before:?} -> {after:?}");
    gw.traefik.check_running()?;
    operator.stop().await;
    Ok(())
}

/// Announce mode with NodePorts, then a gateway added (NodePort -> ClusterIP: the NodePorts
/// go, no update refused), then removed again (routes deleted, NodePorts back).
async fn added_and_removed(env: TestEnv) -> Result<()> {
    let base = 32200u16;
    let ports = port_range(base, 2);
    let gw = TraefikGateway::start(&env.cp, &env.client, &env.ns, &ports, 2, "l").await?;
    let TestEnv { client, ns, cp } = &env;
    let operator = Operator::start(client, ns);
    let node_ip = cp.agent().node_ip().to_string();
    let announce = json!({ "enabled": true, "mode": "announce", "advertisedHost": node_ip });
    create(client, ns, &external_cluster("vc", 1, 1, announce.clone())?).await?;
    wait_external_ready(client, ns, "vc").await?;
    let types = || async {
        let svcs = external_services(client, ns, "vc").await?;
        Ok::<_, anyhow::Error>(
            svcs.values()
                .map(|s| {
                    let spec = s.spec.clone().unwrap_or_default();
                    let node_ports = spec
                        .ports
                        .iter()
                        .flatten()
                        .filter(|p| p.node_port.is_some())
                        .count();
                    (spec.type_.unwrap_or_default(), node_ports)
                })
                .collect::<Vec<_>>(),
        )
    };
    ensure!(
        types().await? == [("NodePort".to_string(), 2)],
        "{:?}",
        types().await?
    );

    let api = Api::<ValkeyCluster>::namespaced(client.clone(), ns);
    let set_external = |ea: serde_json::Value| {
        let api = api.clone();
        async move {
            api.patch(
                "vc",
                &PatchParams::default(),
                &Patch::Merge(json!({ "spec": { "externalAccess": ea } })),
            )
            .await?;
            Ok::<_, anyhow::Error>(())
        }
    };
    // `gateway` added (and advertisedHost dropped): the Gateway's address is announced.
    set_external(
        json!({ "advertisedHost": null, "gateway": gateway_access(base, None)["gateway"] }),
    )
    .await?;
    let vc = wait_external_ready(client, ns, "vc").await?;
    ensure!(
        types().await? == [("ClusterIP".to_string(), 0)],
        "{:?}",
        types().await?
    );
    ensure!(routes(client, ns).await?.len() == 2);
    let seeds = bootstrap_seeds(&vc)?;
    ensure!(seeds.iter().all(|a| a.ip() == gw.ip()), "{seeds:?}");
    only_external_addresses(client, ns, "vc", vc.status.as_ref().context("status")?, 200).await?;

    // Removed: the routes go, the Services are NodePorts again, and status says nothing of
    // a gateway any more.
    set_external(json!({ "advertisedHost": node_ip, "gateway": null })).await?;
    let vc = wait_external_ready(client, ns, "vc").await?;
    ensure!(
        types().await? == [("NodePort".to_string(), 2)],
        "{:?}",
        types().await?
    );
    eventually("the routes deleted", Duration::from_secs(30), || async {
        let left = routes(client, ns).await?;
        ensure!(left.is_empty(), "{:?}", left.keys());
        Ok(())
    })
    .await?;
    let status = vc.status.clone().context("status")?;
    ensure!(status.gateway.is_none(), "{:?}", status.gateway);
    ensure!(
        condition(&vc, "GatewayReady").is_none(),
        "{:?}",
        status.conditions
    );
    ensure!(
        status.external_endpoints.iter().all(|e| e.host == node_ip),
        "{:?}",
        status.external_endpoints
    );
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), ns);
    let removed: Vec<String> = events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("TCPRouteRemoved"))
        .filter_map(|e| e.note)
        .collect();
    let both = ["vc-0-0", "vc-0-1"];
    ensure!(
        removed.len() == 1 && both.iter().all(|r| removed[0].contains(r)),
        "TCPRouteRemoved events: {removed:?}"
    );
    operator.stop().await;
    Ok(())
}

/// `spec.tls` through a Gateway: Traefik's TCP routes carry the nodes' TLS untouched (the
/// Gateway holds no certificate), each node announces its listener port as its TLS port,
/// and clients outside that know only the Gateway speak TLS to the nodes themselves.
/// Traefik sits behind a LoadBalancer Service of its own, as it is deployed in a cluster:
/// the Gateway's address, and so every address the nodes announce, is the Service's.
async fn tls_through(env: TestEnv) -> Result<()> {
    let base = 32400u16;
    let ports = port_range(base, 6);
    let (cp, client, ns) = (&env.cp, &env.client, &env.ns);
    let gw = TraefikGateway::start_behind_load_balancer(cp, client, ns, &ports, 6, "l").await?;
    let TestEnv { client, ns, .. } = &env;
    let operator = Operator::start(client, ns);
    let tls = ClusterTls::new()?;
    tls.create_secret(client, ns, "vc-tls").await?;
    let mut vc = external_cluster("vc", 3, 1, gateway_access(base, None))?;
    vc.spec.tls = serde_json::from_value(json!({ "secretName": "vc-tls" }))?;
    create(client, ns, &vc).await?;
    let vc = wait_external_ready(client, ns, "vc").await?;
    let seeds = bootstrap_seeds(&vc)?;
    ensure!(seeds.iter().all(|a| a.ip() == gw.ip()), "{seeds:?}");

    let allowed: BTreeSet<String> = ports.iter().map(|p| format!("{}:{p}", gw.ip())).collect();
    let dial = tls.dial()?;
    eventually(
        "the topology seen through the Gateway over TLS",
        Duration::from_secs(30),
        || topology_over_tls(seeds[0], &dial, &allowed),
    )
    .await?;
    // redis-cli over TLS from one Gateway address: 2,000 SET/GET over every slot, following
    // MOVED to the Gateway's other listeners.
    let seed = seeds[0];
    tls.redis_cli_set_get(seed, 2_000).await?;
    refuses_plain_and_anonymous(seed, &tls.pki).await?;
    gw.traefik.check_running()?;
    operator.stop().await;
    Ok(())
}

async fn failovers(env: TestEnv) -> Result<()> {
    let base = 32300u16;
    let ports = port_range(base, 6);
    // Listeners named `valkey-<k>`: the routes attach by sectionName and port.
    let gw = TraefikGateway::start(&env.cp, &env.client, &env.ns, &ports, 6, "valkey").await?;
    let operator = Operator::start(&env.client, &env.ns);
    create(
        &env.client,
        &env.ns,
        &external_cluster("vc", 3, 1, gateway_access(base, Some("valkey")))?,
    )
    .await?;
    let vc = wait_external_ready(&env.client, &env.ns, "vc").await?;
    let seeds = bootstrap_seeds(&vc)?;
    ensure!(seeds.iter().all(|a| a.ip() == gw.ip()), "{seeds:?}");
    failovers_under_load(&env, &seeds, "gateway").await?;
    gw.traefik.check_running()?;
    operator.stop().await;
    Ok(())
}
