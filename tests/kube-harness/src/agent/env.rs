//! A container's environment, as the kubelet builds it: the service variables of the API
//! server, `envFrom`, then `env` in order (each value expanded against the ones before it),
//! with the downward API and ConfigMap/Secret keys resolved.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;

use anyhow::{bail, Context, Result};
use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod, Secret};
use kube::api::Api;
use kube::Client;

use super::expand::expand;

/// Where the ServiceAccount admission plugin mounts a pod's token, CA and namespace (the
/// projected `kube-api-access-*` volume), and where in-cluster clients read them.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// A kubeconfig that reaches the API server `api` as the pod's ServiceAccount, from the
/// token, CA and namespace files in `sa_dir` (the container's mapped [`SERVICE_ACCOUNT_DIR`]).
///
/// This is the harness's stand-in for in-cluster configuration. A real pod has no
/// KUBECONFIG: its client reads the fixed paths under [`SERVICE_ACCOUNT_DIR`] and
/// `KUBERNETES_SERVICE_HOST`/`_PORT`. Here a container's files live under its own directory
/// (the agent maps mount paths in arguments and environment values, never inside a program),
/// so the agent writes this file and points the container's KUBECONFIG at it: clients that
/// fall back to in-cluster config (kube-rs, client-go) take KUBECONFIG first. The token is a
/// `tokenFile`, re-read by those clients, as in-cluster config re-reads the token.
pub fn in_cluster_kubeconfig(api: SocketAddr, sa_dir: &Path, namespace: &str) -> Result<String> {
    let file = |name: &str| {
        let path = sa_dir.join(name);
        path.to_str()
            .map(str::to_string)
            .with_context(|| format!("{} is not UTF-8", path.display()))
    };
    let config = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{
            "name": "in-cluster",
            "cluster": { "server": format!("https://{api}"), "certificate-authority": file("ca.crt")? },
        }],
        "users": [{ "name": "service-account", "user": { "tokenFile": file("token")? } }],
        "contexts": [{
            "name": "in-cluster",
            "context": { "cluster": "in-cluster", "user": "service-account", "namespace": namespace },
        }],
        "current-context": "in-cluster",
    });
    serde_yaml::to_string(&config).context("writing a kubeconfig")
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_in_cluster_kubeconfig_names_the_mapped_service_account_files() {
        let dir = std::env::temp_dir().join(format!("shardgate-sa-test-{}", std::process::id()));
        let sa = dir.join("root").join(&SERVICE_ACCOUNT_DIR[1..]);
        std::fs::create_dir_all(&sa).unwrap();
        std::fs::write(sa.join("token"), "t0ken").unwrap();
        // Any PEM certificate will do: the harness's own CA kind.
        let ca = rcgen::generate_simple_self_signed(vec!["ca".into()]).unwrap();
        std::fs::write(sa.join("ca.crt"), ca.cert.pem()).unwrap();
        let api: SocketAddr = "127.0.0.1:6443".parse().unwrap();
        let text = in_cluster_kubeconfig(api, &sa, "ns-1").unwrap();

        let parsed = kube::config::Kubeconfig::from_yaml(&text).unwrap();
        let user = parsed.auth_infos[0].auth_info.as_ref().unwrap();
        assert_eq!(
            user.token_file.as_deref(),
            Some(sa.join("token").to_str().unwrap())
        );
        // As a client reads it with KUBECONFIG pointing at it.
        let options = kube::config::KubeConfigOptions::default();
        let config = kube::Config::from_custom_kubeconfig(parsed, &options)
            .await
            .unwrap();
        assert_eq!(config.cluster_url.to_string(), "https://127.0.0.1:6443/");
        assert_eq!(config.default_namespace, "ns-1");
        assert_eq!(config.root_cert.as_ref().map(Vec::len), Some(1));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
