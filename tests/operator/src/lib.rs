//! What the operator's end-to-end tests share: the operator run in-process against the
//! harness's API server, `ValkeyCluster` objects made and waited on as a user would (through
//! the API and its status), and clients at the pods' addresses.

pub mod external;

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use kube::Client;
use prometheus_client::registry::Registry;
use shardgate_controller::metrics::Metrics;
use shardgate_controller::{Context, Scope};
use shardgate_crds::names::labels;
use shardgate_crds::valkey_cluster::ValkeyCluster;
use shardgate_crds::NodeRef;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A test suite whose control plane has the ValkeyCluster CRD (`deploy/crds/`) installed;
/// `None` (with the reason printed) when the CRD files cannot be read.
pub fn suite_with_crds() -> Option<shardgate_kube_harness::Suite> {
    suite_with(shardgate_kube_harness::Options::default())
}

/// As [`suite_with_crds`], with the control plane's other `options` (e.g. no Gateway API).
pub fn suite_with(
    mut options: shardgate_kube_harness::Options,
) -> Option<shardgate_kube_harness::Suite> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/crds");
    match shardgate_kube_harness::yaml_files_in(&dir) {
        Ok(files) if !files.is_empty() => {
            options.yaml_files.extend(files);
            Some(shardgate_kube_harness::Suite::new().options(options))
        }
        Ok(_) => {
            eprintln!("{}: no CRD YAML", dir.display());
            None
        }
        Err(e) => {
            eprintln!("{}: {e:#}", dir.display());
            None
        }
    }
}

/// The operator, running in this process on the test's namespace.
pub struct Operator {
    pub metrics: Arc<Metrics>,
    registry: Registry,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Operator {
    /// Starts the controller for `namespace`.
    pub fn start(client: &Client, namespace: &str) -> Operator {
        let mut registry = Registry::default();
        let metrics = Arc::new(Metrics::default().register(&mut registry));
        let ctx = Arc::new(Context::new(
            client.clone(),
            metrics.clone(),
            Some(format!("test-{namespace}")),
        ));
        let (tx, rx) = oneshot::channel();
        let scope = Scope {
            namespace: Some(namespace.to_string()),
        };
        let task = tokio::spawn(async move {
            let run = shardgate_controller::run(ctx, scope, async move {
                let _ = rx.await;
            });
            if let Err(e) = run.await {
                eprintln!("the operator stopped: {e}");
            }
        });
        Operator {
            metrics,
            registry,
            stop: Some(tx),
            task: Some(task),
        }
    }

    /// Reconciles finished so far, as `/metrics` reports them (the duration histogram's
    /// count, recorded when a reconcile ends).
    pub fn finished_reconciles(&self) -> u64 {
        let mut text = String::new();
        if prometheus_client::encoding::text::encode(&mut text, &self.registry).is_err() {
            return 0;
        }
        text.lines()
            .find_map(|l| l.strip_prefix("shardgate_operator_reconcile_duration_seconds_count "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Stops the controller and waits for it.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// A `ValkeyCluster` from JSON (as a user writes YAML).
pub fn valkey_cluster(value: serde_json::Value) -> Result<ValkeyCluster> {
    serde_json::from_value(value).context("a ValkeyCluster")
}

/// Creates `vc` in `ns`.
pub async fn create(client: &Client, ns: &str, vc: &ValkeyCluster) -> Result<ValkeyCluster> {
    Api::<ValkeyCluster>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), vc)
        .await
        .context("creating the ValkeyCluster")
}

/// Retries `check` until it succeeds or `timeout` passes; the last error says why not.
pub async fn eventually<F, Fut, T>(what: &str, timeout: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        match check().await {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() >= deadline => {
                return Err(e.context(format!("{what}: not within {timeout:?}")))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

/// The condition `type_` of `vc`'s status: (status, reason, message).
pub fn condition(vc: &ValkeyCluster, type_: &str) -> Option<(String, String, String)> {
    vc.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// Waits until `name`'s status says Ready for its current generation.
pub async fn wait_ready(
    client: &Client,
    ns: &str,
    name: &str,
    timeout: Duration,
) -> Result<ValkeyCluster> {
    let api = Api::<ValkeyCluster>::namespaced(client.clone(), ns);
    eventually(&format!("ValkeyCluster {name} Ready"), timeout, || async {
        let vc = api.get(name).await?;
        let generation = vc.metadata.generation;
        let observed = vc.status.as_ref().and_then(|s| s.observed_generation);
        match condition(&vc, "Ready") {
            Some((s, _, _)) if s == "True" && observed == generation => Ok(vc),
            other => {
                bail!("Ready is {other:?} (observed generation {observed:?} of {generation:?})")
            }
        }
    })
    .await
}

/// The address of each node's pod, from the pods' index labels.
pub async fn pod_addrs(
    client: &Client,
    ns: &str,
    cluster: &str,
) -> Result<BTreeMap<NodeRef, SocketAddr>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let list = pods
        .list(&ListParams::default().labels(&format!("{}={cluster}", labels::INSTANCE)))
        .await?;
    let mut out = BTreeMap::new();
    for pod in list {
        let l = pod.metadata.labels.clone().unwrap_or_default();
        let (Some(s), Some(n)) = (l.get(labels::SHARD_INDEX), l.get(labels::NODE_INDEX)) else {
            continue;
        };
        let Some(ip) = pod.status.as_ref().and_then(|s| s.pod_ip.clone()) else {
            continue;
        };
        out.insert(
            NodeRef::new(s.parse()?, n.parse()?),
            SocketAddr::new(ip.parse()?, 6379),
        );
    }
    Ok(out)
}

/// A cluster client that starts from `seeds` (pod addresses), patient enough for a
/// failover.
pub use shardgate_harness::clients::cluster_client_at as cluster_client;
