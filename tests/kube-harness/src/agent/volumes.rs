//! Pod volumes as directories: ConfigMaps, Secrets, the downward API and service-account
//! tokens as files (written the way the kubelet writes them, so that an update is one atomic
//! symlink swap), emptyDirs, and PersistentVolumeClaims as directories that outlive the pod.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, DownwardAPIVolumeFile, KeyToPath, Pod, Secret, ServiceAccount, Volume,
};
use kube::api::{Api, PostParams};
use kube::Client;

use super::env::field_value;

/// The content of a file volume: relative path -> bytes.
pub type Files = BTreeMap<String, Vec<u8>>;

/// What a volume became.
pub enum Materialized {
    /// Files the agent owns and refreshes (ConfigMap, Secret, downward API, projected).
    Files { dir: PathBuf, files: Files },
    /// A writable directory: emptyDir (wiped with the data) or a claim's directory.
    Writable { dir: PathBuf },
}

impl Materialized {
    pub fn dir(&self) -> &Path {
        match self {
            Materialized::Files { dir, .. } | Materialized::Writable { dir } => dir,
        }
    }
}

/// Makes `volume` of `pod` under `pod_dir/volumes/<name>` (claims under `node_dir/claims`).
pub async fn materialize(
    client: &Client,
    pod: &Pod,
    volume: &Volume,
    pod_dir: &Path,
    node_dir: &Path,
    pod_ip: &str,
    host_ip: &str,
) -> Result<Materialized> {
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let dir = pod_dir.join("volumes").join(&volume.name);
    if volume.empty_dir.is_some() {
        mkdir(&dir)?;
        return Ok(Materialized::Writable { dir });
    }
    if let Some(claim) = &volume.persistent_volume_claim {
        // Keyed by claim, so a StatefulSet pod that comes back finds its data.
        let dir = node_dir.join("claims").join(ns).join(&claim.claim_name);
        mkdir(&dir)?;
        return Ok(Materialized::Writable { dir });
    }
    let files = files_of(client, pod, volume, pod_ip, host_ip).await?;
    write_atomically(&dir, &files)?;
    Ok(Materialized::Files { dir, files })
}

/// The files of a file volume, read afresh from the API (for the first write and refreshes).
pub async fn files_of(
    client: &Client,
    pod: &Pod,
    volume: &Volume,
    pod_ip: &str,
    host_ip: &str,
) -> Result<Files> {
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let mut files = Files::new();
    if let Some(cm) = &volume.config_map {
        config_map_files(
            client,
            ns,
            &cm.name,
            cm.items.as_deref(),
            cm.optional,
            &mut files,
        )
        .await?;
    } else if let Some(secret) = &volume.secret {
        let name = secret.secret_name.as_deref().unwrap_or_default();
        secret_files(
            client,
            ns,
            name,
            secret.items.as_deref(),
            secret.optional,
            &mut files,
        )
        .await?;
    } else if let Some(downward) = &volume.downward_api {
        downward_files(
            pod,
            downward.items.as_deref().unwrap_or_default(),
            pod_ip,
            host_ip,
            &mut files,
        )?;
    } else if let Some(projected) = &volume.projected {
        for source in projected.sources.iter().flatten() {
            if let Some(cm) = &source.config_map {
                config_map_files(
                    client,
                    ns,
                    &cm.name,
                    cm.items.as_deref(),
                    cm.optional,
                    &mut files,
                )
                .await?;
            }
            if let Some(secret) = &source.secret {
                secret_files(
                    client,
                    ns,
                    &secret.name,
                    secret.items.as_deref(),
                    secret.optional,
                    &mut files,
                )
                .await?;
            }
            if let Some(downward) = &source.downward_api {
                downward_files(
                    pod,
                    downward.items.as_deref().unwrap_or_default(),
                    pod_ip,
                    host_ip,
                    &mut files,
                )?;
            }
            if let Some(token) = &source.service_account_token {
                let sa = pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.service_account_name.as_deref())
                    .unwrap_or("default");
                let request = TokenRequest {
                    spec: TokenRequestSpec {
                        audiences: token.audience.iter().cloned().collect(),
                        expiration_seconds: token.expiration_seconds,
                        bound_object_ref: None,
                    },
                    ..Default::default()
                };
                let api: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
                let issued: TokenRequest = api
                    .create_subresource("token", sa, &PostParams::default(), &request)
                    .await
                    .with_context(|| format!("requesting a token for ServiceAccount {ns}/{sa}"))?;
                let status = issued.status.context("a TokenRequest without status")?;
                files.insert(token.path.clone(), status.token.into_bytes());
            }
        }
    } else {
        bail!(
            "volume {:?}: only configMap, secret, downwardAPI, projected, emptyDir and \
             persistentVolumeClaim volumes are supported by the node agent",
            volume.name
        );
    }
    Ok(files)
}

async fn config_map_files(
    client: &Client,
    ns: &str,
    name: &str,
    items: Option<&[KeyToPath]>,
    optional: Option<bool>,
    files: &mut Files,
) -> Result<()> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let Some(cm) = api
        .get_opt(name)
        .await
        .with_context(|| format!("reading ConfigMap {ns}/{name}"))?
    else {
        if optional == Some(true) {
            return Ok(());
        }
        bail!("ConfigMap {ns}/{name} not found");
    };
    let mut all: BTreeMap<String, Vec<u8>> = cm
        .data
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, v.into_bytes()))
        .collect();
    for (k, v) in cm.binary_data.unwrap_or_default() {
        all.insert(k, v.0);
    }
    select_items(&format!("ConfigMap {ns}/{name}"), all, items, files)
}

async fn secret_files(
    client: &Client,
    ns: &str,
    name: &str,
    items: Option<&[KeyToPath]>,
    optional: Option<bool>,
    files: &mut Files,
) -> Result<()> {
    let api: Api<Secret> = Api::namespaced(client.clone(), ns);
    let Some(secret) = api
        .get_opt(name)
        .await
        .with_context(|| format!("reading Secret {ns}/{name}"))?
    else {
        if optional == Some(true) {
            return Ok(());
        }
        bail!("Secret {ns}/{name} not found");
    };
    let mut all: BTreeMap<String, Vec<u8>> = secret
        .data
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, v.0))
        .collect();
    for (k, v) in secret.string_data.unwrap_or_default() {
        all.insert(k, v.into_bytes());
    }
    select_items(&format!("Secret {ns}/{name}"), all, items, files)
}

fn select_items(
    what: &str,
    mut all: BTreeMap<String, Vec<u8>>,
    items: Option<&[KeyToPath]>,
    files: &mut Files,
) -> Result<()> {
    match items {
        None => files.extend(all),
        Some(items) => {
            for item in items {
                let value = all
                    .remove(&item.key)
                    .with_context(|| format!("{what} has no key {:?}", item.key))?;
                files.insert(item.path.clone(), value);
            }
        }
    }
    Ok(())
}

fn downward_files(
    pod: &Pod,
    items: &[DownwardAPIVolumeFile],
    pod_ip: &str,
    host_ip: &str,
    files: &mut Files,
) -> Result<()> {
    for item in items {
        let value = match &item.field_ref {
            Some(f) => field_value(pod, &f.field_path, pod_ip, host_ip)?,
            None => bail!(
                "downwardAPI item {:?}: only fieldRef is supported",
                item.path
            ),
        };
        files.insert(item.path.clone(), value.into_bytes());
    }
    Ok(())
}

/// Writes `files` into `dir` as the kubelet's atomic writer does: the content in a fresh
/// `..<stamp>/` directory, `..data` a symlink to it (replaced by rename, so a reader sees the
/// old set or the new one), and each top-level name a symlink through `..data`.
pub fn write_atomically(dir: &Path, files: &Files) -> Result<()> {
    mkdir(dir)?;
    let stamp = format!(
        "..{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default()
    );
    let content = dir.join(&stamp);
    for (path, bytes) in files {
        if path.starts_with('/') || path.split('/').any(|c| c == "..") {
            bail!("volume file path {path:?} must be relative and stay inside the volume");
        }
        let file = content.join(path);
        if let Some(parent) = file.parent() {
            mkdir(parent)?;
        }
        std::fs::write(&file, bytes).with_context(|| format!("writing {}", file.display()))?;
    }
    mkdir(&content)?;
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(&stamp, &tmp)
        .with_context(|| format!("linking {}", tmp.display()))?;
    std::fs::rename(&tmp, dir.join("..data"))
        .with_context(|| format!("swapping {}/..data", dir.display()))?;

    let tops: std::collections::BTreeSet<&str> =
        files.keys().filter_map(|p| p.split('/').next()).collect();
    for entry in std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok())
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == "..data" || name == stamp {
            continue;
        }
        if name.starts_with("..") {
            let _ = std::fs::remove_dir_all(entry.path());
        } else if !tops.contains(name.as_str()) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    for top in tops {
        let link = dir.join(top);
        if std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink(format!("..data/{top}"), &link)
                .with_context(|| format!("linking {}", link.display()))?;
        }
    }
    Ok(())
}

pub fn mkdir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn updates_are_a_symlink_swap() {
        let dir =
            std::env::temp_dir().join(format!("shardgate-volume-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut files = Files::new();
        files.insert("valkey.conf".into(), b"port 6379\n".to_vec());
        files.insert("nested/a".into(), b"a".to_vec());
        write_atomically(&dir, &files).unwrap();
        assert_eq!(
            std::fs::read(dir.join("valkey.conf")).unwrap(),
            b"port 6379\n"
        );
        assert_eq!(std::fs::read(dir.join("nested/a")).unwrap(), b"a");
        files.insert("valkey.conf".into(), b"port 6380\n".to_vec());
        files.remove("nested/a");
        write_atomically(&dir, &files).unwrap();
        assert_eq!(
            std::fs::read(dir.join("valkey.conf")).unwrap(),
            b"port 6380\n"
        );
        assert!(std::fs::symlink_metadata(dir.join("nested")).is_err());
        let stamps = std::fs::read_dir(&dir)
            .unwrap()
            .filter(|e| {
                let n = e
                    .as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .into_owned();
                n.starts_with("..") && n != "..data"
            })
            .count();
        assert_eq!(stamps, 1, "old content directories are removed");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
