//! A container's environment, as the kubelet builds it: the service variables of the API
//! server, `envFrom`, then `env` in order (each value expanded against the ones before it),
//! with the downward API and ConfigMap/Secret keys resolved.

use std::collections::HashMap;
use std::net::SocketAddr;

use anyhow::{bail, Result};
use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod, Secret};
use kube::api::Api;
use kube::Client;

use super::expand::expand;

/// The environment of `container` in `pod`, in order; values are expanded.
pub async fn container_env(
    client: &Client,
    pod: &Pod,
    container: &Container,
    api: SocketAddr,
    pod_ip: &str,
    host_ip: &str,
) -> Result<Vec<(String, String)>> {
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let mut env: Vec<(String, String)> = Vec::new();
    let set = |env: &mut Vec<(String, String)>, k: String, v: String| {
        env.retain(|(name, _)| *name != k);
        env.push((k, v));
    };
    // There is no ClusterIP routing here: the `kubernetes` Service's variables name the API
    // server itself, which is where kube-proxy would send its ClusterIP.
    let host = api.ip().to_string();
    let port = api.port().to_string();
    for (k, v) in [
        ("KUBERNETES_SERVICE_HOST", host.clone()),
        ("KUBERNETES_SERVICE_PORT", port.clone()),
        ("KUBERNETES_SERVICE_PORT_HTTPS", port.clone()),
        ("KUBERNETES_PORT", format!("tcp://{api}")),
        ("KUBERNETES_PORT_443_TCP", format!("tcp://{api}")),
        ("KUBERNETES_PORT_443_TCP_PROTO", "tcp".into()),
        ("KUBERNETES_PORT_443_TCP_ADDR", host),
        ("KUBERNETES_PORT_443_TCP_PORT", port),
        (
            "HOSTNAME",
            pod.spec
                .as_ref()
                .and_then(|s| s.hostname.clone())
                .or_else(|| pod.metadata.name.clone())
                .unwrap_or_default(),
        ),
    ] {
        set(&mut env, k.to_string(), v);
    }

    for from in container.env_from.iter().flatten() {
        let prefix = from.prefix.clone().unwrap_or_default();
        if let Some(r) = &from.config_map_ref {
            match Api::<ConfigMap>::namespaced(client.clone(), ns)
                .get_opt(&r.name)
                .await?
            {
                Some(cm) => {
                    for (k, v) in cm.data.unwrap_or_default() {
                        set(&mut env, format!("{prefix}{k}"), v);
                    }
                }
                None if r.optional == Some(true) => {}
                None => bail!("envFrom: ConfigMap {ns}/{} not found", r.name),
            }
        }
        if let Some(r) = &from.secret_ref {
            match Api::<Secret>::namespaced(client.clone(), ns)
                .get_opt(&r.name)
                .await?
            {
                Some(s) => {
                    for (k, v) in s.data.unwrap_or_default() {
                        set(
                            &mut env,
                            format!("{prefix}{k}"),
                            String::from_utf8_lossy(&v.0).into_owned(),
                        );
                    }
                }
                None if r.optional == Some(true) => {}
                None => bail!("envFrom: Secret {ns}/{} not found", r.name),
            }
        }
    }

    for var in container.env.iter().flatten() {
        let vars: HashMap<String, String> = env.iter().cloned().collect();
        let value = if let Some(value) = &var.value {
            Some(expand(value, &vars))
        } else if let Some(from) = &var.value_from {
            if let Some(f) = &from.field_ref {
                Some(field_value(pod, &f.field_path, pod_ip, host_ip)?)
            } else if let Some(r) = &from.resource_field_ref {
                Some(resource_value(container, &r.resource))
            } else if let Some(k) = &from.config_map_key_ref {
                let cm = Api::<ConfigMap>::namespaced(client.clone(), ns)
                    .get_opt(&k.name)
                    .await?;
                match cm.and_then(|cm| cm.data.unwrap_or_default().remove(&k.key)) {
                    Some(v) => Some(v),
                    None if k.optional == Some(true) => None,
                    None => bail!(
                        "env {}: ConfigMap {ns}/{} has no key {:?}",
                        var.name,
                        k.name,
                        k.key
                    ),
                }
            } else if let Some(k) = &from.secret_key_ref {
                let s = Api::<Secret>::namespaced(client.clone(), ns)
                    .get_opt(&k.name)
                    .await?;
                match s.and_then(|s| s.data.unwrap_or_default().remove(&k.key)) {
                    Some(v) => Some(String::from_utf8_lossy(&v.0).into_owned()),
                    None if k.optional == Some(true) => None,
                    None => bail!(
                        "env {}: Secret {ns}/{} has no key {:?}",
                        var.name,
                        k.name,
                        k.key
                    ),
                }
            } else {
                None
            }
        } else {
            Some(String::new())
        };
        if let Some(value) = value {
            set(&mut env, var.name.clone(), value);
        }
    }
    Ok(env)
}

/// A downward-API field: `metadata.name`, `metadata.labels['k']`, `status.podIP`, ...
pub fn field_value(pod: &Pod, path: &str, pod_ip: &str, host_ip: &str) -> Result<String> {
    let meta = &pod.metadata;
    let spec = pod.spec.as_ref();
    let keyed = |prefix: &str| -> Option<String> {
        path.strip_prefix(prefix)?
            .strip_suffix("']")
            .map(str::to_string)
    };
    if let Some(key) = keyed("metadata.labels['") {
        return Ok(meta
            .labels
            .as_ref()
            .and_then(|l| l.get(&key).cloned())
            .unwrap_or_default());
    }
    if let Some(key) = keyed("metadata.annotations['") {
        return Ok(meta
            .annotations
            .as_ref()
            .and_then(|a| a.get(&key).cloned())
            .unwrap_or_default());
    }
    let join = |m: Option<&std::collections::BTreeMap<String, String>>| {
        m.map(|m| {
            m.iter()
                .map(|(k, v)| format!("{k}=\"{v}\""))
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_default()
    };
    Ok(match path {
        "metadata.name" => meta.name.clone().unwrap_or_default(),
        "metadata.namespace" => meta.namespace.clone().unwrap_or_default(),
        "metadata.uid" => meta.uid.clone().unwrap_or_default(),
        "metadata.labels" => join(meta.labels.as_ref()),
        "metadata.annotations" => join(meta.annotations.as_ref()),
        "spec.nodeName" => spec.and_then(|s| s.node_name.clone()).unwrap_or_default(),
        "spec.serviceAccountName" => spec
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_default(),
        "status.podIP" | "status.podIPs" => pod_ip.to_string(),
        "status.hostIP" | "status.hostIPs" => host_ip.to_string(),
        other => bail!("downward API field {other:?} is not supported by the node agent"),
    })
}

/// `limits.cpu` and friends: the container's own value, else the node's capacity.
fn resource_value(container: &Container, resource: &str) -> String {
    let (section, name) = resource.split_once('.').unwrap_or(("limits", resource));
    let res = container.resources.as_ref();
    let map = match section {
        "requests" => res.and_then(|r| r.requests.as_ref()),
        _ => res.and_then(|r| r.limits.as_ref()),
    };
    if let Some(q) = map.and_then(|m| m.get(name)) {
        return q.0.clone();
    }
    match name {
        "cpu" => "2".into(),
        "memory" => (24u64 << 30).to_string(),
        _ => "0".into(),
    }
}
