//! Applying YAML manifests (CRDs and whatever else) with server-side apply, as
//! `kubectl apply --server-side` would.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::discovery::{pinned_kind, Scope};
use kube::Client;
use serde::Deserialize as _;

/// The field manager of everything the harness applies.
pub const FIELD_MANAGER: &str = "shardgate-kube-harness";

/// Applies every document of every file: CustomResourceDefinitions first, then the rest; waits
/// until each CRD is established and served.
pub async fn apply_files(client: &Client, files: &[PathBuf]) -> Result<()> {
    let mut docs = Vec::new();
    for file in files {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let value = serde_yaml::Value::deserialize(doc)
                .with_context(|| format!("parsing {}", file.display()))?;
            if value.is_null() {
                continue;
            }
            let obj: DynamicObject = serde_yaml::from_value(value)
                .with_context(|| format!("{}: not a Kubernetes object", file.display()))?;
            docs.push((file.clone(), obj));
        }
    }
    let is_crd = |o: &DynamicObject| {
        o.types
            .as_ref()
            .is_some_and(|t| t.kind == "CustomResourceDefinition")
    };
    docs.sort_by_key(|(_, o)| !is_crd(o));

    let params = PatchParams::apply(FIELD_MANAGER).force();
    let mut crds = Vec::new();
    for (file, obj) in docs {
        let types = obj
            .types
            .clone()
            .with_context(|| format!("{}: a document without apiVersion/kind", file.display()))?;
        let name = obj
            .metadata
            .name
            .clone()
            .with_context(|| format!("{}: a {} without a name", file.display(), types.kind))?;
        let gvk = GroupVersionKind::try_from(&types)
            .with_context(|| format!("{}: bad apiVersion {}", file.display(), types.api_version))?;
        let (resource, caps) = pinned_kind(client, &gvk).await.with_context(|| {
            format!("{}: the API server does not serve {gvk:?}", file.display())
        })?;
        let api: Api<DynamicObject> = match caps.scope {
            Scope::Cluster => Api::all_with(client.clone(), &resource),
            Scope::Namespaced => Api::namespaced_with(
                client.clone(),
                obj.metadata.namespace.as_deref().unwrap_or("default"),
                &resource,
            ),
        };
        api.patch(&name, &params, &Patch::Apply(&obj))
            .await
            .with_context(|| format!("{}: applying {} {name}", file.display(), types.kind))?;
        if types.kind == "CustomResourceDefinition" {
            crds.push(name);
        }
    }

    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in crds {
        let crd = wait_established(&api, &name).await?;
        wait_served(client, &crd).await?;
    }
    Ok(())
}

/// Waits until every served version of `crd` is in discovery and answers a list:
/// Established can come a moment before the API server routes either path (a 404 "page not
/// found" then, seen on a loaded machine).
async fn wait_served(client: &Client, crd: &CustomResourceDefinition) -> Result<()> {
    let name = crd.metadata.name.as_deref().unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(60);
    for version in crd.spec.versions.iter().filter(|v| v.served) {
        let gvk = GroupVersionKind::gvk(&crd.spec.group, &version.name, &crd.spec.names.kind);
        let resource = kube::api::ApiResource::from_gvk_with_plural(&gvk, &crd.spec.names.plural);
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
        loop {
            let served = match pinned_kind(client, &gvk).await {
                Ok(_) => api
                    .list(&kube::api::ListParams::default().limit(1))
                    .await
                    .map(|_| ()),
                Err(e) => Err(e),
            };
            match served {
                Ok(()) => break,
                // A 404 while the path is not routed yet, or a kind discovery does not
                // list yet.
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => {
                    return Err(e).with_context(|| {
                        format!("CRD {name} established but {} not served", version.name)
                    })
                }
            }
        }
    }
    Ok(())
}

async fn wait_established(
    api: &Api<CustomResourceDefinition>,
    name: &str,
) -> Result<CustomResourceDefinition> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let crd = api
            .get(name)
            .await
            .with_context(|| format!("reading CRD {name}"))?;
        let established = crd
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| {
                cs.iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
            });
        if established {
            return Ok(crd);
        }
        if Instant::now() > deadline {
            bail!("CRD {name} not established after 60s: {:?}", crd.status);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
