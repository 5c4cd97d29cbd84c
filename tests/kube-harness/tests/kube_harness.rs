//! Tests of the Kubernetes harness itself, against one real control plane: what a user of a
//! cluster would check (pods run and answer, Services reach them from outside, the API
//! server validates and garbage-collects), each test in its own namespace.

use std::net::{Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, PostParams};
use kube::core::GroupVersionKind;
use kube::Client;
use serde_json::json;
use shardgate_kube_harness::{
    free_loopback_ip, Fault, Suite, TestEnv, Traefik, NODE_NAME, TRAEFIK_CONTROLLER_NAME,
};

fn main() -> ExitCode {
    Suite::new()
        .test(
            "statefulset_becomes_a_ready_pod_running_valkey",
            statefulset_runs_valkey,
        )
        .test(
            "service_gets_an_endpointslice_with_the_pod_ip",
            endpointslice_has_pod_ip,
        )
        .test("nodeport_service_reaches_the_pod", nodeport_reaches_pod)
        .test(
            "loadbalancer_service_gets_an_ingress_ip_that_reaches_the_pod",
            loadbalancer_reaches_pod,
        )
        .test(
            "deleting_the_owner_garbage_collects_pods_and_stops_them",
            owner_deletion_collects,
        )
        .test(
            "invalid_objects_are_rejected_with_the_api_servers_message",
            invalid_objects_rejected,
        )
        .test("faults_restart_wipe_and_move_a_pod", faults)
        .test("kubectl_works_with_the_kubeconfig", kubectl_works)
        .test(
            "a_gateway_tcproute_through_traefik_reaches_the_pod_behind_each_listener",
            traefik_gateway_tcproutes,
        )
        .run()
}

const WAIT: Duration = Duration::from_secs(90);

/// A ConfigMap `valkey.conf` and a one-replica StatefulSet `name` running valkey-server with
/// it, announcing `$(POD_IP)` (expanded by the agent from the downward API).
async fn valkey_statefulset(client: &Client, ns: &str, name: &str) -> Result<()> {
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": { "name": format!("{name}-config") },
        "data": { "valkey.conf": "port 6379\nmaxmemory 12mb\nappendonly yes\n" },
    }))?;
    Api::<ConfigMap>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &cm)
        .await?;
    let sts: StatefulSet = serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": {
            "replicas": 1,
            "serviceName": name,
            "selector": { "matchLabels": { "app": name } },
            "template": {
                "metadata": { "labels": { "app": name } },
                "spec": {
                    "containers": [{
                        "name": "valkey",
                        "image": "valkey/valkey:9.0",
                        "command": ["valkey-server", "/config/valkey.conf"],
                        // Paths are mapped on the command line only (not inside files): `dir`
                        // goes here rather than in valkey.conf.
                        "args": ["--dir", "/data", "--replica-announce-ip", "$(POD_IP)"],
                        "env": [{ "name": "POD_IP", "valueFrom": { "fieldRef": { "fieldPath": "status.podIP" } } }],
                        "ports": [{ "name": "valkey", "containerPort": 6379 }],
                        "readinessProbe": { "tcpSocket": { "port": "valkey" } },
                        "volumeMounts": [
                            { "name": "config", "mountPath": "/config" },
                            { "name": "data", "mountPath": "/data" },
                        ],
                    }],
                    "volumes": [
                        { "name": "config", "configMap": { "name": format!("{name}-config") } },
                        { "name": "data", "emptyDir": {} },
                    ],
                },
            },
        },
    }))?;
    Api::<StatefulSet>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &sts)
        .await?;
    Ok(())
}

/// Waits until the pod exists, is Running and Ready, and returns it.
async fn ready_pod(client: &Client, ns: &str, name: &str) -> Result<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(pod) = api.get_opt(name).await? {
            let status = pod.status.clone().unwrap_or_default();
            let ready = status
                .conditions
                .iter()
                .flatten()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            if status.phase.as_deref() == Some("Running") && ready {
                return Ok(pod);
            }
            if Instant::now() > deadline {
                bail!("pod {ns}/{name} not running and ready after {WAIT:?}: {status:?}");
            }
        } else if Instant::now() > deadline {
            bail!("pod {ns}/{name} never appeared");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn pod_ip(pod: &Pod) -> Result<Ipv4Addr> {
    pod.status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .context("pod without IP")?
        .parse()
        .context("pod IP")
}

/// Runs one Valkey command at `addr` (blocking; loopback, short).
fn valkey(addr: SocketAddr, args: &[&str]) -> Result<redis::Value> {
    let client = redis::Client::open(format!("redis://{addr}/"))?;
    let mut con = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .with_context(|| format!("connecting to {addr}"))?;
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    cmd.query(&mut con)
        .with_context(|| format!("{args:?} at {addr}"))
}

fn text(v: &redis::Value) -> String {
    match v {
        redis::Value::SimpleString(s) => s.clone(),
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        redis::Value::Array(items) => items.iter().map(text).collect::<Vec<_>>().join(" "),
        other => format!("{other:?}"),
    }
}

/// Polls `check` until it succeeds.
async fn eventually<F, Fut, T>(what: &str, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        match check().await {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() > deadline => {
                return Err(e.context(format!("{what}: not after {WAIT:?}")))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

async fn statefulset_runs_valkey(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, cp } = env;
    valkey_statefulset(&client, &ns, "vk").await?;
    let pod = ready_pod(&client, &ns, "vk-0").await?;
    let ip = pod_ip(&pod)?;
    ensure!(ip.is_loopback(), "pod IP {ip} is not a loopback address");
    let spec = pod.spec.clone().unwrap_or_default();
    ensure!(
        spec.node_name.as_deref() == Some(NODE_NAME),
        "bound to {:?}",
        spec.node_name
    );
    let status = pod.status.clone().unwrap_or_default();
    let container = &status.container_statuses.unwrap_or_default()[0];
    ensure!(
        container.ready && container.restart_count == 0,
        "{container:?}"
    );
    ensure!(
        status.host_ip.as_deref() == Some(cp.agent().node_ip().to_string().as_str()),
        "hostIP {:?}",
        status.host_ip
    );

    let addr = SocketAddr::from((ip, 6379));
    ensure!(text(&valkey(addr, &["PING"])?) == "PONG");
    // The ConfigMap's file is the config, and $(POD_IP) was expanded on the command line.
    ensure!(text(&valkey(addr, &["CONFIG", "GET", "maxmemory"])?) == "maxmemory 12582912");
    let announced = text(&valkey(addr, &["CONFIG", "GET", "replica-announce-ip"])?);
    ensure!(
        announced == format!("replica-announce-ip {ip}"),
        "{announced}"
    );
    Ok(())
}

async fn endpointslice_has_pod_ip(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = env;
    valkey_statefulset(&client, &ns, "vk").await?;
    create_service(&client, &ns, "vk", json!({ "clusterIP": "None" })).await?;
    let ip = pod_ip(&ready_pod(&client, &ns, "vk-0").await?)?;
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), &ns);
    eventually("an EndpointSlice with the pod's IP, ready", || async {
        let list = slices
            .list(&ListParams::default().labels("kubernetes.io/service-name=vk"))
            .await?;
        let found = list.items.iter().any(|s| {
            s.endpoints.iter().any(|e| {
                e.addresses == [ip.to_string()]
                    && e.conditions.as_ref().and_then(|c| c.ready) == Some(true)
                    && e.target_ref.as_ref().and_then(|t| t.name.as_deref()) == Some("vk-0")
            })
        });
        ensure!(found, "slices: {:?}", list.items);
        Ok(())
    })
    .await
}

async fn create_service(
    client: &Client,
    ns: &str,
    name: &str,
    spec: serde_json::Value,
) -> Result<Service> {
    let mut svc = json!({
        "metadata": { "name": name },
        "spec": {
            "selector": { "app": "vk" },
            "ports": [{ "name": "valkey", "port": 6379, "targetPort": "valkey" }],
        },
    });
    for (k, v) in spec.as_object().into_iter().flatten() {
        svc["spec"][k] = v.clone();
    }
    let svc: Service = serde_json::from_value(svc)?;
    Ok(Api::<Service>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &svc)
        .await?)
}

async fn nodeport_reaches_pod(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, cp } = env;
    valkey_statefulset(&client, &ns, "vk").await?;
    let svc = create_service(&client, &ns, "vk-np", json!({ "type": "NodePort" })).await?;
    let node_port = svc.spec.unwrap_or_default().ports.unwrap_or_default()[0]
        .node_port
        .context("no nodePort allocated")?;
    ensure!((30000..=32767).contains(&node_port), "nodePort {node_port}");
    ready_pod(&client, &ns, "vk-0").await?;
    let addr = SocketAddr::from((cp.agent().node_ip(), node_port as u16));
    eventually("PING through the NodePort", || async {
        ensure!(text(&valkey(addr, &["PING"])?) == "PONG");
        Ok(())
    })
    .await
}

async fn loadbalancer_reaches_pod(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = env;
    valkey_statefulset(&client, &ns, "vk").await?;
    create_service(&client, &ns, "vk-lb", json!({ "type": "LoadBalancer" })).await?;
    ready_pod(&client, &ns, "vk-0").await?;
    let services: Api<Service> = Api::namespaced(client.clone(), &ns);
    let ip: Ipv4Addr = eventually("an ingress IP", || async {
        let svc = services.get("vk-lb").await?;
        let ip = svc
            .status
            .and_then(|s| s.load_balancer)
            .and_then(|lb| lb.ingress)
            .and_then(|i| i.into_iter().next())
            .and_then(|i| i.ip)
            .context("no ingress IP yet")?;
        Ok(ip.parse()?)
    })
    .await?;
    ensure!(ip.is_loopback(), "ingress IP {ip}");
    let addr = SocketAddr::from((ip, 6379));
    eventually("SET/GET through the LoadBalancer", || async {
        valkey(addr, &["SET", "through", "lb"])?;
        ensure!(text(&valkey(addr, &["GET", "through"])?) == "lb");
        Ok(())
    })
    .await
}

async fn owner_deletion_collects(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = env;
    valkey_statefulset(&client, &ns, "vk").await?;
    let ip = pod_ip(&ready_pod(&client, &ns, "vk-0").await?)?;
    Api::<StatefulSet>::namespaced(client.clone(), &ns)
        .delete("vk", &DeleteParams::background())
        .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    eventually("the StatefulSet's pod garbage-collected", || async {
        ensure!(pods.get_opt("vk-0").await?.is_none(), "vk-0 still exists");
        Ok(())
    })
    .await?;
    // The pod object goes only after its process has stopped.
    ensure!(
        std::net::TcpStream::connect_timeout(&SocketAddr::from((ip, 6379)), Duration::from_secs(1))
            .is_err(),
        "valkey-server still answers at {ip} after its pod was deleted"
    );
    Ok(())
}

async fn invalid_objects_rejected(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, cp } = env;
    // The API server's own Service validation: a nodePort on a ClusterIP Service.
    let err = create_service(
        &client,
        &ns,
        "bad",
        json!({ "type": "ClusterIP", "ports": [{ "port": 6379, "nodePort": 30001 }] }),
    )
    .await
    .err()
    .context("a ClusterIP Service with a nodePort was accepted")?;
    let msg = format!("{err:#}");
    ensure!(
        msg.contains("may not be used when `type` is 'ClusterIP'"),
        "{msg}"
    );

    // A CRD's CEL rule and default, installed by the harness's YAML installer.
    let dir = cp.root().join(format!("crd-{ns}"));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("widgets.yaml");
    std::fs::write(
        &file,
        r#"apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.harness.shardgate.io
spec:
  group: harness.shardgate.io
  names: { kind: Widget, plural: widgets, singular: widget }
  scope: Namespaced
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            x-kubernetes-validations:
            - rule: "self.basePort + self.count - 1 <= 65535"
              message: "ports past 65535"
            properties:
              basePort: { type: integer }
              count: { type: integer, default: 1 }
"#,
    )?;
    cp.apply_yaml_files(&[file]).await?;
    let gvk = kube::core::GroupVersionKind::gvk("harness.shardgate.io", "v1", "Widget");
    let (resource, _) = kube::discovery::pinned_kind(&client, &gvk).await?;
    let widgets: Api<kube::api::DynamicObject> =
        Api::namespaced_with(client.clone(), &ns, &resource);
    let widget = |name: &str, base: i64| -> Result<kube::api::DynamicObject> {
        Ok(serde_json::from_value(json!({
            "apiVersion": "harness.shardgate.io/v1", "kind": "Widget",
            "metadata": { "name": name }, "spec": { "basePort": base },
        }))?)
    };
    let ok = widgets
        .create(&PostParams::default(), &widget("ok", 30000)?)
        .await?;
    ensure!(
        ok.data["spec"]["count"] == 1,
        "default not applied: {:?}",
        ok.data
    );
    let err = widgets
        .create(&PostParams::default(), &widget("bad", 65536)?)
        .await
        .err()
        .context("a Widget past port 65535 was accepted")?;
    let msg = err.to_string();
    ensure!(msg.contains("ports past 65535"), "{msg}");
    Ok(())
}

async fn faults(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, cp } = env;
    valkey_statefulset(&client, &ns, "vk").await?;
    let ip = pod_ip(&ready_pod(&client, &ns, "vk-0").await?)?;
    let addr = SocketAddr::from((ip, 6379));
    valkey(addr, &["SET", "k", "v"])?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let restarts = |pod: &Pod| {
        pod.status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .map_or(-1, |c| c[0].restart_count)
    };

    // A crash: the restart policy brings it back, at the same IP, with its data (AOF in /data).
    cp.agent().fault(&ns, "vk-0", Fault::Kill).await?;
    eventually("a restart after the kill", || async {
        let pod = pods.get("vk-0").await?;
        ensure!(restarts(&pod) == 1, "restarts {}", restarts(&pod));
        ensure!(text(&valkey(addr, &["GET", "k"])?) == "v");
        Ok(())
    })
    .await?;

    // Stopped: not ready, not answering, until restarted.
    cp.agent().fault(&ns, "vk-0", Fault::Stop).await?;
    eventually("not ready while stopped", || async {
        let pod = pods.get("vk-0").await?;
        let ready = pod.status.and_then(|s| s.conditions).unwrap_or_default();
        ensure!(ready
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "False"));
        Ok(())
    })
    .await?;
    ensure!(valkey(addr, &["PING"]).is_err(), "a stopped pod answers");
    cp.agent().fault(&ns, "vk-0", Fault::Restart).await?;
    ready_pod(&client, &ns, "vk-0").await?;
    ensure!(text(&valkey(addr, &["GET", "k"])?) == "v");

    // Wiped: same IP, no data.
    cp.agent().fault(&ns, "vk-0", Fault::WipeData).await?;
    ready_pod(&client, &ns, "vk-0").await?;
    let got = eventually("valkey back after the wipe", || async {
        valkey(addr, &["GET", "k"])
    })
    .await?;
    ensure!(got == redis::Value::Nil, "data survived the wipe: {got:?}");

    // A new IP, reported in the pod's status and reachable there.
    cp.agent()
        .fault(&ns, "vk-0", Fault::RestartWithNewIp)
        .await?;
    let new_ip = eventually("a new pod IP", || async {
        let pod = ready_pod(&client, &ns, "vk-0").await?;
        let new_ip = pod_ip(&pod)?;
        ensure!(new_ip != ip, "still {ip}");
        Ok(new_ip)
    })
    .await?;
    ensure!(text(&valkey(SocketAddr::from((new_ip, 6379)), &["PING"])?) == "PONG");
    ensure!(valkey(addr, &["PING"]).is_err(), "the old IP still answers");
    Ok(())
}

async fn kubectl_works(env: TestEnv) -> Result<()> {
    let TestEnv { client, cp, .. } = env;
    let out = cp.kubectl(&["get", "nodes", "-o", "name"])?;
    ensure!(out.trim() == format!("node/{NODE_NAME}"), "{out}");
    let node = Api::<Node>::all(client).get(NODE_NAME).await?;
    let ready = node.status.and_then(|s| s.conditions).unwrap_or_default();
    ensure!(ready
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True"));
    let crds = cp.kubectl(&["get", "crd", "-o", "name"])?;
    ensure!(
        crds.contains("tcproutes.gateway.networking.k8s.io"),
        "{crds}"
    );
    Ok(())
}

/// A Gateway API kind (its `version` and `plural`) as a dynamic API in `ns` (or
/// cluster-wide): the harness does not depend on the gateway-api crate.
fn gateway_api(
    client: &Client,
    ns: Option<&str>,
    version: &str,
    kind: &str,
    plural: &str,
) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("gateway.networking.k8s.io", version, kind);
    let resource = ApiResource::from_gvk_with_plural(&gvk, plural);
    match ns {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
        None => Api::all_with(client.clone(), &resource),
    }
}

async fn create_dynamic(api: &Api<DynamicObject>, object: serde_json::Value) -> Result<()> {
    let object: DynamicObject = serde_json::from_value(object).context("a Gateway API object")?;
    let name = object.metadata.name.clone().unwrap_or_default();
    api.create(&PostParams::default(), &object)
        .await
        .with_context(|| format!("creating {name}"))?;
    Ok(())
}

/// A bare pod `name` running valkey-server on 6379, that port named `port_name` (each pod's
/// name differs, so a Service port targeting it by name reaches only that pod).
async fn valkey_pod(client: &Client, ns: &str, name: &str, port_name: &str) -> Result<()> {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": name, "labels": { "app": "gw" } },
        "spec": {
            "containers": [{
                "name": "valkey",
                "image": "valkey/valkey:9.0",
                "command": ["valkey-server", "--port", "6379"],
                "ports": [{ "name": port_name, "containerPort": 6379 }],
                "readinessProbe": { "tcpSocket": { "port": port_name } },
            }],
        },
    }))?;
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &pod)
        .await
        .with_context(|| format!("creating pod {name}"))?;
    Ok(())
}

/// The value of `field=` in a `CLIENT INFO` line.
fn client_info_field(info: &str, field: &str) -> Option<String> {
    info.split_whitespace()
        .find_map(|kv| kv.strip_prefix(field)?.strip_prefix('='))
        .map(str::to_string)
}

/// The `type` condition of `conditions` (a JSON array) has status `True`.
fn condition_true(conditions: &serde_json::Value, type_: &str) -> bool {
    conditions
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"].as_str() == Some(type_) && c["status"].as_str() == Some("True"))
}

async fn traefik_gateway_tcproutes(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, cp } = env;
    // Two listener ports, one entry point each, on an IP of their own.
    let ports = [7000u16, 7001];
    let ip = free_loopback_ip(&ports)?;
    let entry_points: Vec<(String, u16)> = ports
        .iter()
        .enumerate()
        .map(|(i, &port)| (format!("gw{i}"), port))
        .collect();
    // Only this namespace: other tests' Gateways are not this Traefik's.
    let traefik = Traefik::start_in(&cp, &[ns.as_str()], ip, &entry_points).await?;

    // Two pods behind one Service whose ports target a different pod each, by port name.
    for i in 0..2 {
        valkey_pod(&client, &ns, &format!("vk-{i}"), &format!("vk-n{i}")).await?;
    }
    create_service(
        &client,
        &ns,
        "gw-backend",
        json!({
            "selector": { "app": "gw" },
            "ports": [
                { "name": "n0", "port": 7100, "targetPort": "vk-n0" },
                { "name": "n1", "port": 7101, "targetPort": "vk-n1" },
            ],
        }),
    )
    .await?;
    let mut pod_ips = Vec::new();
    for i in 0..2 {
        pod_ips.push(pod_ip(&ready_pod(&client, &ns, &format!("vk-{i}")).await?)?);
    }

    // GatewayClasses are cluster-scoped: one per test namespace.
    let class = format!("traefik-{ns}");
    let classes = gateway_api(&client, None, "v1", "GatewayClass", "gatewayclasses");
    create_dynamic(
        &classes,
        json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
            "metadata": { "name": class },
            "spec": { "controllerName": TRAEFIK_CONTROLLER_NAME },
        }),
    )
    .await?;
    let gateways = gateway_api(&client, Some(&ns), "v1", "Gateway", "gateways");
    let listeners: Vec<serde_json::Value> = ports
        .iter()
        .enumerate()
        .map(|(i, port)| {
            json!({
                "name": format!("l{i}"), "port": port, "protocol": "TCP",
                "allowedRoutes": { "kinds": [{ "kind": "TCPRoute" }] },
            })
        })
        .collect();
    create_dynamic(
        &gateways,
        json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
            "metadata": { "name": "gw" },
            "spec": { "gatewayClassName": class, "listeners": listeners },
        }),
    )
    .await?;
    let routes = gateway_api(&client, Some(&ns), "v1alpha2", "TCPRoute", "tcproutes");
    for i in 0..2 {
        create_dynamic(
            &routes,
            json!({
                "apiVersion": "gateway.networking.k8s.io/v1alpha2", "kind": "TCPRoute",
                "metadata": { "name": format!("r{i}") },
                "spec": {
                    "parentRefs": [{ "name": "gw", "sectionName": format!("l{i}") }],
                    "rules": [{ "backendRefs": [{ "name": "gw-backend", "port": 7100 + i }] }],
                },
            }),
        )
        .await?;
    }

    // Status, as Traefik writes it: the address, each listener with its one route.
    let status = eventually("the Gateway's status from Traefik", || async {
        traefik.check_running()?;
        let gw = gateways.get("gw").await?;
        let status = gw.data["status"].clone();
        ensure!(
            status["addresses"][0]["value"].as_str() == Some(ip.to_string().as_str()),
            "status.addresses: {}",
            status["addresses"]
        );
        ensure!(
            condition_true(&status["conditions"], "Programmed"),
            "conditions: {}",
            status["conditions"]
        );
        for i in 0..2 {
            let name = format!("l{i}");
            let listener = status["listeners"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|l| l["name"].as_str() == Some(name.as_str()))
                .with_context(|| format!("no status for listener {name}: {status}"))?;
            ensure!(
                listener["attachedRoutes"] == 1
                    && condition_true(&listener["conditions"], "Programmed"),
                "listener {name}: {listener}"
            );
        }
        Ok(status)
    })
    .await
    .with_context(|| format!("traefik log tail:\n{}", traefik.log_tail(20)))?;
    for i in 0..2 {
        let name = format!("r{i}");
        eventually(&format!("TCPRoute {name} accepted"), || async {
            let route = routes.get(&name).await?;
            let parents = &route.data["status"]["parents"];
            let accepted = parents.as_array().into_iter().flatten().any(|p| {
                p["controllerName"].as_str() == Some(TRAEFIK_CONTROLLER_NAME)
                    && condition_true(&p["conditions"], "Accepted")
                    && condition_true(&p["conditions"], "ResolvedRefs")
            });
            ensure!(accepted, "status.parents: {parents}");
            Ok(())
        })
        .await?;
    }

    // Through each listener, the connection arrives at its own pod (laddr: the pod's side).
    for (i, port) in ports.iter().enumerate() {
        let addr = traefik.addr(*port);
        let want = SocketAddr::from((pod_ips[i], 6379)).to_string();
        eventually(
            &format!("listener l{i} at {addr} reaching vk-{i}"),
            || async {
                traefik.check_running()?;
                let info = text(&valkey(addr, &["CLIENT", "INFO"])?);
                let laddr = client_info_field(&info, "laddr").context("no laddr in CLIENT INFO")?;
                ensure!(laddr == want, "laddr {laddr}, want {want}: {info}");
                Ok(())
            },
        )
        .await
        .with_context(|| format!("gateway status: {status}"))?;
    }
    Ok(())
}
