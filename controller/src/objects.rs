//! What every child object shares: the design's labels, the owner reference, and
//! server-side apply under one field manager.

use std::collections::BTreeMap;
use std::fmt::Debug;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use shardgate_crds::names::labels;
use shardgate_crds::valkey_cluster::ValkeyCluster;
use shardgate_crds::NodeRef;

use crate::context::FIELD_MANAGER;
use crate::error::{Error, Result};

/// The labels on everything the operator makes for `vc`.
pub fn cluster_labels(vc: &ValkeyCluster) -> BTreeMap<String, String> {
    let name = vc.name_any();
    BTreeMap::from([
        (labels::MANAGED_BY.into(), labels::MANAGED_BY_VALUE.into()),
        (labels::INSTANCE.into(), name.clone()),
        (labels::CLUSTER.into(), name),
    ])
}

/// The labels of one node's objects: the cluster's and its indices.
pub fn node_labels(vc: &ValkeyCluster, node: NodeRef) -> BTreeMap<String, String> {
    let mut l = cluster_labels(vc);
    l.insert(labels::SHARD_INDEX.into(), node.shard.to_string());
    l.insert(labels::NODE_INDEX.into(), node.node.to_string());
    l
}

/// The label selector of every pod of `vc`.
pub fn cluster_selector(vc: &ValkeyCluster) -> String {
    labels::cluster_selector(&vc.name_any())
}

/// Deletes `vc`'s external-access objects of `api`'s kind (labelled
/// [`labels::COMPONENT_EXTERNAL`]) whose names are not in `keep`; returns their names.
pub async fn delete_external_except<K>(
    api: &Api<K>,
    vc: &ValkeyCluster,
    keep: &std::collections::BTreeSet<String>,
) -> Result<Vec<String>>
where
    K: Resource + Clone + Debug + DeserializeOwned,
{
    let selector = format!(
        "{},{}={}",
        cluster_selector(vc),
        labels::COMPONENT,
        labels::COMPONENT_EXTERNAL
    );
    let mut deleted = Vec::new();
    for obj in api.list(&ListParams::default().labels(&selector)).await? {
        let name = obj.name_any();
        if keep.contains(&name) || obj.meta().deletion_timestamp.is_some() {
            continue;
        }
        api.delete(&name, &DeleteParams::default()).await?;
        deleted.push(name);
    }
    Ok(deleted)
}

/// The controller owner reference to `vc`, so that its children are garbage-collected with
/// it.
pub fn owner(vc: &ValkeyCluster) -> Result<OwnerReference> {
    vc.controller_owner_ref(&()).ok_or(Error::Metadata("uid"))
}

/// The namespace of `vc`.
pub fn namespace(vc: &ValkeyCluster) -> Result<String> {
    vc.namespace().ok_or(Error::Metadata("namespace"))
}

/// Builds a typed object from JSON (checked against its type here, not by the API server).
pub fn build<K: DeserializeOwned>(what: &str, value: serde_json::Value) -> Result<K> {
    serde_json::from_value(value).map_err(|source| Error::Build {
        what: what.into(),
        source,
    })
}

/// Applies `obj` with server-side apply under the operator's field manager. An object
/// equal to what the server holds is not written (its resourceVersion stays).
pub async fn apply<K>(api: &Api<K>, obj: &K) -> Result<K>
where
    K: Resource + Clone + Debug + Serialize + DeserializeOwned,
{
    let name = obj.meta().name.clone().ok_or(Error::Metadata("name"))?;
    let params = PatchParams::apply(FIELD_MANAGER).force();
    Ok(api.patch(&name, &params, &Patch::Apply(obj)).await?)
}
