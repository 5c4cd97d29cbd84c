//! Proxy mode (`externalAccess.mode: proxy`): the operator runs `shardgate-proxy` in front of
//! the cluster. One Service (LoadBalancer by default) carries one port per node at
//! `proxy.basePort + flatIndex` (and the SNI TLS port); the proxy pods find the Valkey pods
//! with their Kubernetes route source and rewrite topology replies to the Service's address,
//! while Valkey keeps announcing pod IPs to clients inside (split horizon).
//!
//! Objects, all named `<cluster>-proxy`: a ServiceAccount and a Role (read pods in the
//! namespace: the least the route source needs) with its RoleBinding, the Deployment, a
//! PodDisruptionBudget and the Service. The proxy's pods carry `app.kubernetes.io/instance:
//! <cluster>-proxy`, not the cluster's instance label, so that nothing selecting the Valkey
//! pods (the headless Service, the PDB, the route source itself) selects them.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, DeleteParams, ListParams};
use kube::ResourceExt;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use shardgate_crds::external_access::{ExternalAccess, ProxySpec, ProxyTlsMode, ServiceType};
use shardgate_crds::names::labels;
use shardgate_crds::settings::{AdminAddr, ProxySettings, TlsBackend};
use shardgate_crds::valkey_cluster::{ExternalEndpoint, ValkeyCluster};
use shardgate_crds::NodeRef;

use super::External;
use crate::context::Context;
use crate::error::{Error, Result};
use crate::formation::Progress;
use crate::objects::{apply, build, namespace, owner};

/// The port of the proxy's `/metrics`, `/healthz` and `/readyz` in its pod.
pub const ADMIN_PORT: u16 = 9090;
/// Where the TLS Secret is mounted in the proxy's pod.
const TLS_DIR: &str = "/etc/shardgate/tls";
/// Where `spec.tls`'s Secret (the nodes' CA, and the certificate the proxy shows them) is
/// mounted in the proxy's pod.
const BACKEND_TLS_DIR: &str = "/etc/shardgate/backend-tls";
/// Where `proxy.clientSecretName`'s Secret (the proxy's own certificate for the nodes) is
/// mounted in the proxy's pod.
const CLIENT_TLS_DIR: &str = "/etc/shardgate/client-tls";
/// [`labels::COMPONENT`] of the proxy's objects.
pub const COMPONENT_PROXY: &str = "proxy";

/// The name of every proxy object of `cluster`.
pub fn name(cluster: &str) -> String {
    format!("{cluster}-proxy")
}

/// The `externalAccess` block when it is enabled in proxy mode, with its `proxy` part.
pub fn proxy_mode(vc: &ValkeyCluster) -> Option<(&ExternalAccess, &ProxySpec)> {
    let ea = vc.spec.external_access()?;
    if ea.mode != shardgate_crds::external_access::ExternalAccessMode::Proxy {
        return None;
    }
    Some((ea, ea.proxy.as_ref()?))
}

fn proxy_labels(vc: &ValkeyCluster) -> BTreeMap<String, String> {
    let cluster = vc.name_any();
    BTreeMap::from([
        (labels::MANAGED_BY.into(), labels::MANAGED_BY_VALUE.into()),
        (labels::INSTANCE.into(), name(&cluster)),
        (labels::CLUSTER.into(), cluster),
        (labels::COMPONENT.into(), COMPONENT_PROXY.into()),
    ])
}

fn invalid(e: impl std::fmt::Display) -> Error {
    Error::Invalid(e.to_string())
}

/// Every node's listener port: `proxy.basePort + flatIndex`.
pub fn ports(vc: &ValkeyCluster, proxy: &ProxySpec) -> Result<BTreeMap<NodeRef, u16>> {
    let layout = vc.spec.layout(proxy.base_port).map_err(invalid)?;
    vc.spec
        .node_refs()
        .map(|n| Ok((n, layout.port(n).map_err(invalid)?)))
        .collect()
}

/// The proxy's settings (its command line): the Kubernetes route source on this cluster,
/// rewriting to `advertise_host`, listeners on every address of the pod.
pub fn settings(
    vc: &ValkeyCluster,
    ea: &ExternalAccess,
    proxy: &ProxySpec,
    advertise_host: Option<&str>,
) -> Result<ProxySettings> {
    let ns = namespace(vc)?;
    let base_port = u16::try_from(proxy.base_port).map_err(invalid)?;
    let stride = vc.spec.stride();
    let mut s = ProxySettings {
        kubernetes: Some(format!("{ns}/{}", vc.name_any())),
        base_port: Some(base_port),
        ports_per_shard: Some(stride),
        rewrite: true,
        advertise_host: advertise_host.map(str::to_string),
        listen_ip: std::net::IpAddr::from([0, 0, 0, 0]),
        admin_addr: AdminAddr(Some(std::net::SocketAddr::from(([0, 0, 0, 0], ADMIN_PORT)))),
        ..ProxySettings::default()
    };
    if let Some(tls) = &proxy.tls {
        let h = ea
            .hostnames(&vc.name_any())
            .ok_or_else(|| invalid("externalAccess.proxy.tls needs externalAccess.domain"))?;
        s.tls_port = Some(u16::try_from(tls.port).map_err(invalid)?);
        s.sni_prefix = Some(h.prefix);
        s.sni_domain = Some(h.domain);
        s.tls_mode = tls.mode.into();
        if tls.mode == ProxyTlsMode::Terminate {
            s.tls_cert = Some(format!("{TLS_DIR}/tls.crt").into());
            s.tls_key = Some(format!("{TLS_DIR}/tls.key").into());
            if tls.verify_clients {
                s.tls_client_ca = Some(format!("{TLS_DIR}/ca.crt").into());
            }
        }
    }
    if vc.spec.tls.is_some() {
        // Nodes that speak only TLS: every leg to them is TLS, checked against the
        // cluster's CA, the chain only, as the operator and the nodes do (pods are dialled
        // at their IPs). The proxy shows its own certificate if it has one, else the
        // nodes'.
        let dir = match proxy.client_secret_name {
            Some(_) => CLIENT_TLS_DIR,
            None => BACKEND_TLS_DIR,
        };
        let file = |dir: &str, f: &str| Some(format!("{dir}/{f}").into());
        s.tls_backend = TlsBackend::Tls;
        s.tls_backend_ca = file(BACKEND_TLS_DIR, crate::tls::CA);
        s.tls_backend_cert = file(dir, crate::tls::CERT);
        s.tls_backend_key = file(dir, crate::tls::KEY);
        s.tls_backend_chain_only = true;
    }
    Ok(s)
}

/// The proxy's objects for `vc`, in the order they are applied.
pub fn desired(
    vc: &ValkeyCluster,
    ea: &ExternalAccess,
    proxy: &ProxySpec,
    image: &str,
    advertise_host: Option<&str>,
) -> Result<Objects> {
    let cluster = vc.name_any();
    let ns = namespace(vc)?;
    let name = name(&cluster);
    let labels = proxy_labels(vc);
    let meta = |kind_labels: &BTreeMap<String, String>| -> Result<Value> {
        Ok(json!({
            "name": name,
            "namespace": ns,
            "labels": kind_labels,
            "ownerReferences": [owner(vc)?],
        }))
    };
    let node_ports = ports(vc, proxy)?;
    let args = settings(vc, ea, proxy, advertise_host)?.to_args();

    let service_account: ServiceAccount = build(
        "proxy ServiceAccount",
        json!({ "apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(&labels)? }),
    )?;
    // The route source reads pods; RBAC cannot narrow that to the cluster's labels, so the
    // Role is the namespace's pods, read only (a Role grants only what the operator holds).
    let role: Role = build(
        "proxy Role",
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": meta(&labels)?,
            "rules": [{ "apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"] }],
        }),
    )?;
    let binding: RoleBinding = build(
        "proxy RoleBinding",
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": meta(&labels)?,
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name },
            "subjects": [{ "kind": "ServiceAccount", "name": name, "namespace": ns }],
        }),
    )?;

    // The node listeners are not declared as container ports (informational only): a
    // scale-out then changes the Service, not the pod template, and rolls no proxy pod.
    let mut container_ports: Vec<Value> =
        vec![json!({ "name": "admin", "containerPort": ADMIN_PORT, "protocol": "TCP" })];
    let mut service_ports: Vec<Value> = node_ports
        .iter()
        .map(|(n, p)| {
            json!({ "name": format!("vk-{n}"), "port": p, "targetPort": p, "protocol": "TCP" })
        })
        .collect();
    let mut volumes = Vec::new();
    let mut mounts = Vec::new();
    if let Some(tls) = &proxy.tls {
        container_ports
            .push(json!({ "name": "tls", "containerPort": tls.port, "protocol": "TCP" }));
        service_ports.push(
            json!({ "name": "tls", "port": tls.port, "targetPort": tls.port, "protocol": "TCP" }),
        );
        if let Some(secret) = &tls.secret_name {
            // Mounted as a directory (not subPath): the kubelet swaps a rotated Secret in
            // place, and the proxy reloads the files it watches.
            volumes.push(json!({ "name": "tls", "secret": { "secretName": secret } }));
            mounts.push(json!({ "name": "tls", "mountPath": TLS_DIR, "readOnly": true }));
        }
    }
    if let Some(tls) = &vc.spec.tls {
        // Directories too: the proxy reloads these files when a Secret is renewed.
        let mut nodes = json!({ "secretName": tls.secret_name });
        if let Some(client) = &proxy.client_secret_name {
            // Only the CA of the nodes' Secret: their key stays out of the proxy's pods.
            nodes["items"] = json!([{ "key": crate::tls::CA, "path": crate::tls::CA }]);
            volumes.push(json!({ "name": "client-tls", "secret": { "secretName": client } }));
            mounts.push(
                json!({ "name": "client-tls", "mountPath": CLIENT_TLS_DIR, "readOnly": true }),
            );
        }
        volumes.push(json!({ "name": "backend-tls", "secret": nodes }));
        mounts
            .push(json!({ "name": "backend-tls", "mountPath": BACKEND_TLS_DIR, "readOnly": true }));
    }
    let mut container = json!({
        "name": "proxy",
        "image": proxy.image.clone().unwrap_or_else(|| image.to_string()),
        "args": args,
        "ports": container_ports,
        "livenessProbe": {
            "httpGet": { "path": "/healthz", "port": ADMIN_PORT },
            "periodSeconds": 10,
        },
        "readinessProbe": {
            "httpGet": { "path": "/readyz", "port": ADMIN_PORT },
            "periodSeconds": 2,
        },
        "securityContext": {
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "capabilities": { "drop": ["ALL"] },
        },
    });
    if !mounts.is_empty() {
        container["volumeMounts"] = Value::Array(mounts);
    }
    if let Some(r) = &proxy.resources {
        container["resources"] = serde_json::to_value(r).map_err(|source| Error::Build {
            what: "proxy resources".into(),
            source,
        })?;
    }
    let mut pod_spec = json!({
        "serviceAccountName": name,
        "containers": [container],
        "securityContext": {
            "runAsNonRoot": true,
            "runAsUser": 65532,
            "runAsGroup": 65532,
            "seccompProfile": { "type": "RuntimeDefault" },
        },
    });
    if !volumes.is_empty() {
        pod_spec["volumes"] = Value::Array(volumes);
    }
    let deployment: Deployment = build(
        "proxy Deployment",
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": meta(&labels)?,
            "spec": {
                "replicas": proxy.replicas,
                "selector": { "matchLabels": labels },
                "template": {
                    "metadata": { "labels": labels },
                    "spec": pod_spec,
                },
            },
        }),
    )?;
    let budget: PodDisruptionBudget = build(
        "proxy PodDisruptionBudget",
        json!({
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": meta(&labels)?,
            "spec": { "maxUnavailable": 1, "selector": { "matchLabels": labels } },
        }),
    )?;
    // A NodePort Service: clients are handed basePort + flatIndex, so those are the
    // NodePorts too (not ports Kubernetes would pick).
    if proxy.service_type == ServiceType::NodePort {
        for p in &mut service_ports {
            p["nodePort"] = p["port"].clone();
        }
    }
    let mut service_spec = json!({
        "type": proxy.service_type.as_str(),
        "selector": labels,
        "ports": service_ports,
    });
    if let Some(policy) = ea.effective_external_traffic_policy_for(proxy.service_type) {
        service_spec["externalTrafficPolicy"] = json!(policy.as_str());
    }
    // serviceAnnotations, for the one Service: no shard or node; `{hostname}` is the
    // bootstrap name, which is where the proxy's address should be found.
    let bootstrap = ea
        .hostnames(&cluster)
        .map(|h| shardgate_crds::names::bootstrap_hostname(&h.prefix, &h.domain));
    let annotations: BTreeMap<String, String> = ea
        .service_annotations
        .iter()
        .map(|(k, v)| {
            let value = super::services::template(v, &cluster, None, None, bootstrap.as_deref());
            (k.clone(), value)
        })
        .collect();
    let mut service_meta = meta(&labels)?;
    if !annotations.is_empty() {
        service_meta["annotations"] = json!(annotations);
    }
    let service: Service = build(
        "proxy Service",
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": service_meta,
            "spec": service_spec,
        }),
    )?;
    Ok(Objects {
        service_account,
        role,
        binding,
        deployment,
        budget,
        service,
    })
}

/// The proxy's objects.
pub struct Objects {
    pub service_account: ServiceAccount,
    pub role: Role,
    pub binding: RoleBinding,
    pub deployment: Deployment,
    pub budget: PodDisruptionBudget,
    pub service: Service,
}

/// What proxy mode found: where the proxy is reached.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Exposed {
    /// The Service's name.
    pub service: String,
    /// `proxy.advertisedHost`, else the LoadBalancer's ingress, once there is one.
    pub host: Option<String>,
    /// The ready proxy pods.
    pub ready_replicas: i32,
    /// What keeps the proxy pods from running that the user must fix (a Secret missing).
    pub problems: Vec<String>,
}

/// Applies the proxy's objects when `vc` is in proxy mode, and deletes them when it is not
/// (any more). The Service goes first so that its ingress, which the proxy hands out, is
/// known to the Deployment's arguments.
pub async fn apply_proxy(vc: &ValkeyCluster, ctx: &Context) -> Result<Option<Exposed>> {
    let ns = namespace(vc)?;
    let cluster = vc.name_any();
    let Some((ea, proxy)) = proxy_mode(vc) else {
        remove(ctx, &ns, &name(&cluster)).await?;
        return Ok(None);
    };
    // The address first: a Service with the ports, then its ingress.
    let first = desired(vc, ea, proxy, &ctx.proxy_image, None)?;
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), &ns);
    let svc = apply(&services, &first.service).await?;
    let ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .and_then(|i| i.first())
        .and_then(|i| i.ip.clone().or_else(|| i.hostname.clone()));
    let host = proxy.advertised_host.clone().or(match proxy.service_type {
        ServiceType::LoadBalancer => ingress,
        _ => None,
    });
    let objects = desired(vc, ea, proxy, &ctx.proxy_image, host.as_deref())?;
    let mut problems = vec![];
    if let (Some(_), Some(client)) = (&vc.spec.tls, &proxy.client_secret_name) {
        problems.extend(crate::tls::client_secret_problem(ctx, vc, &ns, client).await?);
    }
    apply_one(ctx, &ns, &objects.service_account).await?;
    apply_one(ctx, &ns, &objects.role).await?;
    apply_one(ctx, &ns, &objects.binding).await?;
    apply_one(ctx, &ns, &objects.budget).await?;
    // No address to hand out yet (a LoadBalancer still without ingress): no proxy either,
    // rather than one that must roll as soon as the ingress comes. The Service's change
    // brings the next reconcile.
    if host.is_none() {
        return Ok(Some(Exposed {
            service: svc.name_any(),
            host,
            ready_replicas: 0,
            problems,
        }));
    }
    let deployment = apply_one(ctx, &ns, &objects.deployment).await?;
    let ready_replicas = deployment
        .status
        .as_ref()
        .and_then(|s| s.ready_replicas)
        .unwrap_or(0);
    Ok(Some(Exposed {
        service: svc.name_any(),
        host,
        ready_replicas,
        problems,
    }))
}

async fn apply_one<K>(ctx: &Context, ns: &str, obj: &K) -> Result<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::Serialize
        + DeserializeOwned,
{
    apply(&Api::<K>::namespaced(ctx.client.clone(), ns), obj).await
}

/// Deletes the proxy's objects named `name`, if the operator made them. The Service (made
/// first, always) or the Deployment (made last, once there is an address to hand out),
/// labelled as the proxy's, is the mark: a cluster that never had a proxy costs two reads.
/// (Services are listed, by name and label: the operator may list them, not get them.)
/// The Service goes last, so that a removal cut short by an error keeps its mark and the
/// retry finishes it, rather than leaving the rest unmarked for good.
async fn remove(ctx: &Context, ns: &str, name: &str) -> Result<()> {
    let services = Api::<Service>::namespaced(ctx.client.clone(), ns);
    let deployments = Api::<Deployment>::namespaced(ctx.client.clone(), ns);
    let by_name = ListParams::default()
        .fields(&format!("metadata.name={name}"))
        .labels(&format!("{}={COMPONENT_PROXY}", labels::COMPONENT));
    let ours = |d: &Deployment| {
        d.labels().get(labels::COMPONENT).map(String::as_str) == Some(COMPONENT_PROXY)
    };
    let marked = !services.list(&by_name).await?.items.is_empty()
        || deployments.get_opt(name).await?.is_some_and(|d| ours(&d));
    if !marked {
        return Ok(());
    }
    delete::<Deployment>(ctx, ns, name).await?;
    delete::<PodDisruptionBudget>(ctx, ns, name).await?;
    delete::<RoleBinding>(ctx, ns, name).await?;
    delete::<Role>(ctx, ns, name).await?;
    delete::<ServiceAccount>(ctx, ns, name).await?;
    delete::<Service>(ctx, ns, name).await
}

/// Deletes `name`; already gone is fine.
async fn delete<K>(ctx: &Context, ns: &str, name: &str) -> Result<()>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + DeserializeOwned,
{
    match Api::<K>::namespaced(ctx.client.clone(), ns)
        .delete(name, &DeleteParams::default())
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// `status.externalEndpoints` in proxy mode: every node at the proxy's host and its port
/// (with its SNI name under `proxy.tls`).
pub fn observe(
    vc: &ValkeyCluster,
    ea: &ExternalAccess,
    proxy: &ProxySpec,
    exposed: &Exposed,
    progress: &Progress,
) -> Result<External> {
    let mut out = External::default();
    let hostnames = ea.hostnames(&vc.name_any());
    out.missing.extend(exposed.problems.iter().cloned());
    let Some(host) = &exposed.host else {
        out.missing.push(match proxy.service_type {
            ServiceType::LoadBalancer => {
                format!(
                    "the proxy's LoadBalancer Service {} has no ingress yet",
                    exposed.service
                )
            }
            _ => format!(
                "the proxy's {} Service {} has no external address: set proxy.advertisedHost",
                proxy.service_type.as_str(),
                exposed.service
            ),
        });
        return Ok(out);
    };
    if exposed.ready_replicas == 0 {
        out.missing.push("no proxy pod is ready yet".into());
    }
    for (node, port) in ports(vc, proxy)? {
        let role = super::endpoints::role(progress, node);
        out.endpoints.push(ExternalEndpoint {
            shard: node.shard.0 as i32,
            node: node.node.0 as i32,
            service: exposed.service.clone(),
            host: host.clone(),
            port: i32::from(port),
            hostname: proxy
                .tls
                .as_ref()
                .and(hostnames.as_ref())
                .map(|h| shardgate_crds::node_hostname(&h.prefix, node, &h.domain)),
            role,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardgate_crds::external_access::ProxyTls;

    fn proxy_cluster(tls: bool) -> ValkeyCluster {
        let mut ea = ExternalAccess::proxy(31000);
        if tls {
            ea.domain = Some("example.com".into());
            if let Some(p) = ea.proxy.as_mut() {
                p.tls = Some(ProxyTls {
                    port: 31443,
                    secret_name: Some("vc-tls".into()),
                    mode: ProxyTlsMode::Terminate,
                    verify_clients: false,
                });
            }
        }
        ValkeyCluster::test("vc")
            .namespace("ns")
            .shards(2)
            .replicas(1)
            .external(ea)
    }

    #[test]
    fn the_proxy_runs_the_kubernetes_source_with_rewriting() {
        let vc = proxy_cluster(false);
        let (ea, proxy) = proxy_mode(&vc).unwrap();
        let o = desired(
            &vc,
            ea,
            proxy,
            "ghcr.io/shardgate/shardgate-proxy:0.1.0",
            Some("203.0.113.7"),
        )
        .unwrap();
        let d = serde_json::to_value(&o.deployment).unwrap();
        let c = &d["spec"]["template"]["spec"]["containers"][0];
        let args: Vec<String> = serde_json::from_value(c["args"].clone()).unwrap();
        // Parsed back by the proxy's own command line: nothing rendered by hand.
        let parsed = <ProxySettings as clap::Parser>::try_parse_from(
            std::iter::once("shardgate-proxy".to_string()).chain(args.iter().cloned()),
        )
        .unwrap();
        assert_eq!(parsed.kubernetes.as_deref(), Some("ns/vc"));
        assert_eq!(parsed.base_port, Some(31000));
        assert_eq!(parsed.ports_per_shard, Some(2));
        assert!(parsed.rewrite);
        assert_eq!(parsed.advertise_host.as_deref(), Some("203.0.113.7"));
        assert_eq!(
            d["spec"]["template"]["spec"]["serviceAccountName"],
            "vc-proxy"
        );
        assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
        assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
        let s = serde_json::to_value(&o.service).unwrap();
        assert_eq!(s["spec"]["type"], "LoadBalancer");
        let ports: Vec<i64> = s["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["port"].as_i64().unwrap())
            .collect();
        assert_eq!(ports, [31000, 31001, 31002, 31003]);
        // The proxy's pods are not the cluster's: another instance label.
        assert_eq!(s["spec"]["selector"][labels::INSTANCE], "vc-proxy");
        let r = serde_json::to_value(&o.role).unwrap();
        assert_eq!(r["rules"][0]["verbs"], json!(["get", "list", "watch"]));
    }

    #[test]
    fn tls_adds_the_sni_port_and_mounts_the_secret() {
        let vc = proxy_cluster(true);
        let (ea, proxy) = proxy_mode(&vc).unwrap();
        let o = desired(&vc, ea, proxy, "img", None).unwrap();
        let d = serde_json::to_value(&o.deployment).unwrap();
        let c = &d["spec"]["template"]["spec"]["containers"][0];
        let args: Vec<String> = serde_json::from_value(c["args"].clone()).unwrap();
        let parsed = <ProxySettings as clap::Parser>::try_parse_from(
            std::iter::once("shardgate-proxy".to_string()).chain(args.iter().cloned()),
        )
        .unwrap();
        assert_eq!(parsed.tls_port, Some(31443));
        assert_eq!(parsed.sni_prefix.as_deref(), Some("vc"));
        assert_eq!(parsed.sni_domain.as_deref(), Some("example.com"));
        // Any client, unless verifyClients asks for its certificate (the Secret's ca.crt).
        assert_eq!(parsed.tls_client_ca, None);
        let mut verifying = vc.clone();
        let tls = verifying
            .spec
            .external_access
            .as_mut()
            .and_then(|ea| ea.proxy.as_mut())
            .and_then(|p| p.tls.as_mut())
            .unwrap();
        tls.verify_clients = true;
        let (ea, proxy) = proxy_mode(&verifying).unwrap();
        let s = settings(&verifying, ea, proxy, None).unwrap();
        assert_eq!(
            s.tls_client_ca,
            Some(std::path::PathBuf::from(format!("{TLS_DIR}/ca.crt")))
        );
        assert_eq!(c["volumeMounts"][0]["mountPath"], TLS_DIR);
        assert_eq!(
            d["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"],
            "vc-tls"
        );
        let s = serde_json::to_value(&o.service).unwrap();
        assert_eq!(
            s["spec"]["ports"].as_array().unwrap().last().unwrap()["port"],
            31443
        );
    }

    /// Nodes on TLS (`spec.tls`): the proxy dials them over TLS with the cluster's Secret,
    /// mounted apart from the TLS port's, and checks the chain only (pods are at IPs).
    #[test]
    fn tls_nodes_are_dialled_with_the_clusters_secret() {
        let plain = proxy_cluster(true);
        let (ea, proxy) = proxy_mode(&plain).unwrap();
        let s = settings(&plain, ea, proxy, None).unwrap();
        assert_eq!(s.tls_backend, TlsBackend::Plain);
        assert!(!s.to_args().iter().any(|a| a.starts_with("--tls-backend")));

        let vc = proxy_cluster(true).tls("vc-nodes");
        let (ea, proxy) = proxy_mode(&vc).unwrap();
        let o = desired(&vc, ea, proxy, "img", None).unwrap();
        let d = serde_json::to_value(&o.deployment).unwrap();
        let pod = &d["spec"]["template"]["spec"];
        let args: Vec<String> =
            serde_json::from_value(pod["containers"][0]["args"].clone()).unwrap();
        for want in [
            "--tls-backend",
            "tls",
            "--tls-backend-ca",
            "/etc/shardgate/backend-tls/ca.crt",
            "--tls-backend-cert",
            "/etc/shardgate/backend-tls/tls.crt",
            "--tls-backend-key",
            "/etc/shardgate/backend-tls/tls.key",
            "--tls-backend-chain-only",
        ] {
            assert!(args.iter().any(|a| a == want), "{want} not in {args:?}");
        }
        // The proxy's own checks accept them.
        let parsed = <ProxySettings as clap::Parser>::try_parse_from(
            std::iter::once("shardgate-proxy".to_string()).chain(args.iter().cloned()),
        )
        .unwrap();
        assert!(parsed.tls_backend_chain_only);
        assert_eq!(
            pod["volumes"][1],
            json!({ "name": "backend-tls", "secret": { "secretName": "vc-nodes" } })
        );
        assert_eq!(
            pod["containers"][0]["volumeMounts"][1],
            json!({ "name": "backend-tls", "mountPath": "/etc/shardgate/backend-tls", "readOnly": true })
        );

        // The proxy's own certificate: the nodes' Secret gives only its CA.
        let mut own = vc.clone();
        if let Some(p) = own
            .spec
            .external_access
            .as_mut()
            .and_then(|ea| ea.proxy.as_mut())
        {
            p.client_secret_name = Some("vc-proxy-client".into());
        }
        let (ea, proxy) = proxy_mode(&own).unwrap();
        let s = settings(&own, ea, proxy, None).unwrap();
        let path = |p: &str| Some(std::path::PathBuf::from(p));
        assert_eq!(s.tls_backend_ca, path("/etc/shardgate/backend-tls/ca.crt"));
        assert_eq!(
            s.tls_backend_cert,
            path("/etc/shardgate/client-tls/tls.crt")
        );
        assert_eq!(s.tls_backend_key, path("/etc/shardgate/client-tls/tls.key"));
        let o = desired(&own, ea, proxy, "img", None).unwrap();
        let d = serde_json::to_value(&o.deployment).unwrap();
        let volumes = &d["spec"]["template"]["spec"]["volumes"];
        assert_eq!(
            volumes[1],
            json!({ "name": "client-tls", "secret": { "secretName": "vc-proxy-client" } })
        );
        assert_eq!(
            volumes[2],
            json!({ "name": "backend-tls", "secret": {
                "secretName": "vc-nodes", "items": [{ "key": "ca.crt", "path": "ca.crt" }],
            } })
        );
    }

    /// A NodePort Service asks for the ports clients are handed (basePort + flatIndex, and
    /// the TLS port) as its NodePorts; serviceAnnotations reach the one Service, with
    /// `{cluster}` and `{hostname}` (the bootstrap name) filled in.
    #[test]
    fn the_service_takes_the_handed_out_node_ports_and_the_annotations() {
        let mut vc = proxy_cluster(true);
        let ea = vc.spec.external_access.as_mut().unwrap();
        ea.service_annotations = BTreeMap::from([
            (
                "external-dns.alpha.kubernetes.io/hostname".to_string(),
                "{hostname}".to_string(),
            ),
            ("team".to_string(), "{cluster}-{shard}{node}".to_string()),
        ]);
        let (ea, proxy) = proxy_mode(&vc).unwrap();
        let plain = desired(&vc, ea, proxy, "img", None).unwrap();
        let s = serde_json::to_value(&plain.service).unwrap();
        assert!(s["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p.get("nodePort").is_none()));
        assert_eq!(
            s["metadata"]["annotations"],
            json!({ "external-dns.alpha.kubernetes.io/hostname": "vc.example.com", "team": "vc-" })
        );

        let mut node_port = vc.clone();
        if let Some(p) = node_port
            .spec
            .external_access
            .as_mut()
            .and_then(|ea| ea.proxy.as_mut())
        {
            p.service_type = ServiceType::NodePort;
        }
        let (ea, proxy) = proxy_mode(&node_port).unwrap();
        let o = desired(&node_port, ea, proxy, "img", None).unwrap();
        let s = serde_json::to_value(&o.service).unwrap();
        let pairs: Vec<(i64, i64)> = s["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p["port"].as_i64().unwrap(), p["nodePort"].as_i64().unwrap()))
            .collect();
        assert_eq!(
            pairs,
            [
                (31000, 31000),
                (31001, 31001),
                (31002, 31002),
                (31003, 31003),
                (31443, 31443)
            ]
        );
    }
}
