//! What the operator's end-to-end tests share: the operator run in-process against the
//! harness's API server, `ValkeyCluster` objects made and waited on as a user would (through
//! the API and its status), and clients at the pods' addresses.

pub mod external;
pub mod tls;

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

/// Touches `name` (an annotation, `touch: <n>`) and waits until the operator has finished
/// a reconcile since: a reconcile with nothing to change.
pub async fn reconcile_again(
    api: &Api<ValkeyCluster>,
    operator: &Operator,
    name: &str,
    n: u32,
) -> Result<()> {
    let before = operator.finished_reconciles();
    api.patch(
        name,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(serde_json::json!({
            "metadata": { "annotations": { "touch": n.to_string() } }
        })),
    )
    .await?;
    eventually("a reconcile", Duration::from_secs(60), || async {
        anyhow::ensure!(operator.finished_reconciles() > before, "none yet");
        Ok(())
    })
    .await
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

/// The `shardgate-proxy` binary, built with its `kubernetes` feature (the route source
/// `--kubernetes`): `$SHARDGATE_PROXY_BIN` if set, else built here with cargo (`cargo build
/// -p shardgate-proxy`: default features, which include `kubernetes`) into this test's own
/// target directory and profile, once per process. Building rather than finding is the point:
/// this crate does not depend on the proxy, so `cargo test` here builds no proxy binary, and
/// one left by an earlier build may lack the feature (built by the proxy's e2e crate without
/// default features, say). It lands beside the test binaries' directory, where
/// `shardgate_harness::proxy_process::proxy_binary` (and so the node agent, for pods of a
/// `shardgate-proxy` image) finds it.
pub fn proxy_binary() -> Result<std::path::PathBuf> {
    static BUILT: std::sync::OnceLock<std::result::Result<std::path::PathBuf, String>> =
        std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| build_proxy().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn build_proxy() -> Result<std::path::PathBuf> {
    if let Some(bin) = std::env::var_os("SHARDGATE_PROXY_BIN") {
        return Ok(bin.into());
    }
    // <target>/<profile>/deps/<test binary>
    let exe = std::env::current_exe().context("current_exe")?;
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .context("the test binary is not in <target>/<profile>/deps")?;
    let target_dir = profile_dir.parent().context("no target directory")?;
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => "dev",
        Some(other) => other,
        None => bail!("no profile directory in {}", exe.display()),
    };
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.toml");
    // `cargo test` sets CARGO to itself for the tests it runs.
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let started = Instant::now();
    let status = std::process::Command::new(&cargo)
        .args(["build", "--quiet", "-p", "shardgate-proxy", "--bin"])
        .arg(shardgate_harness::proxy_process::PROXY_PROGRAM)
        .arg("--profile")
        .arg(profile)
        .arg("--manifest-path")
        .arg(&manifest)
        .arg("--target-dir")
        .arg(target_dir)
        .status()
        .with_context(|| format!("running {cargo:?} build -p shardgate-proxy"))?;
    if !status.success() {
        bail!("cargo build -p shardgate-proxy failed: {status}");
    }
    let bin = profile_dir.join(shardgate_harness::proxy_process::PROXY_PROGRAM);
    if !bin.is_file() {
        bail!("cargo build -p shardgate-proxy made no {}", bin.display());
    }
    eprintln!(
        "shardgate-proxy (with the kubernetes feature) built in {:.1?}: {}",
        started.elapsed(),
        bin.display()
    );
    Ok(bin)
}
