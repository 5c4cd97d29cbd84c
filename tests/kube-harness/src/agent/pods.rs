//! The kubelet part of the agent: binds pending pods to the node, runs their containers as
//! local processes on the pod's loopback IP, probes readiness, reports status, honours
//! deletion, and injects faults.

use std::collections::{BTreeMap, HashMap};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use k8s_openapi::api::core::v1::{Binding, Container, ObjectReference, Pod, Probe};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::jiff::Timestamp;
use kube::api::{
    Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions,
};
use kube::Client;
use serde_json::{json, Value};
use shardgate_harness::valkey::server::{bus_port, CLI_COMMANDS, DEFAULT_PORT};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::env::{container_env, in_cluster_kubeconfig, SERVICE_ACCOUNT_DIR};
use super::expand::{expand, rewrite_paths};
use super::images::{self, ImageKind};
use super::volumes::{self, Materialized};
use super::{Fault, NODE_NAME};
use crate::process::Daemon;

/// How often a readiness probe runs at most (faster than the kubelet's 10 s default, so tests
/// do not wait on it; `periodSeconds` below this is honoured).
const PROBE_PERIOD: Duration = Duration::from_millis(500);
/// Restart back-off after a crash: doubles from this up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// Longest a stopping container gets before SIGKILL, whatever its grace period.
const MAX_GRACE: Duration = Duration::from_secs(30);
/// How often ConfigMap and Secret volumes are compared with the API and rewritten.
const VOLUME_REFRESH: Duration = Duration::from_secs(1);

pub(super) struct Pods {
    client: Client,
    node_dir: PathBuf,
    node_ip: Ipv4Addr,
    api: SocketAddr,
    pods: HashMap<String, LocalPod>,
}

struct LocalPod {
    ns: String,
    name: String,
    uid: String,
    pod: Pod,
    ip: Ipv4Addr,
    dir: PathBuf,
    start_time: Timestamp,
    containers: Vec<LocalContainer>,
    volumes: BTreeMap<String, Materialized>,
    /// Why the containers could not be set up (missing ConfigMap, unknown image...):
    /// reported as Waiting, retried.
    setup_error: Option<(String, String)>,
    next_setup: Instant,
    next_refresh: Instant,
    /// Fault::Stop: containers down and not restarted until Fault::Restart.
    held: bool,
    /// Set when the pod's deletion began: the containers' SIGKILL deadline.
    stopping: Option<Instant>,
    last_status: Option<Value>,
}

struct LocalContainer {
    spec: Container,
    kind: ImageKind,
    program: PathBuf,
    argv: Vec<String>,
    env: Vec<(String, String)>,
    root: PathBuf,
    log: PathBuf,
    process: Option<Daemon>,
    started_at: Option<Timestamp>,
    restart_count: i32,
    last_exit: Option<Exit>,
    restart_at: Option<Instant>,
    backoff: Duration,
    ready: bool,
    next_probe: Instant,
}

#[derive(Clone)]
struct Exit {
    code: i32,
    /// The end of the container's log, as the kubelet's termination message.
    message: String,
    started: Timestamp,
    finished: Timestamp,
}

impl Pods {
    pub(super) fn new(
        client: Client,
        node_dir: PathBuf,
        node_ip: Ipv4Addr,
        api: SocketAddr,
    ) -> Self {
        Pods {
            client,
            node_dir,
            node_ip,
            api,
            pods: HashMap::new(),
        }
    }

    /// One pass: bind, start, stop, restart, probe and report.
    pub(super) async fn sync(&mut self) -> Result<()> {
        let api: Api<Pod> = Api::all(self.client.clone());
        let list = api
            .list(&ListParams::default())
            .await
            .context("listing pods")?;
        let mut seen = std::collections::HashSet::new();
        for pod in list.items {
            let Some(uid) = pod.metadata.uid.clone() else {
                continue;
            };
            let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
            match node.as_deref() {
                None => {
                    if let Err(e) = self.bind(&pod).await {
                        tracing::warn!("binding pod: {e:#}");
                    }
                }
                Some(NODE_NAME) => {
                    seen.insert(uid.clone());
                    if let Err(e) = self.on_pod(pod, &uid).await {
                        tracing::warn!("pod {uid}: {e:#}");
                    }
                }
                Some(_) => {}
            }
        }
        // Gone from the API (deleted with grace 0 by someone else): stop at once.
        let gone: Vec<String> = self
            .pods
            .keys()
            .filter(|uid| !seen.contains(*uid))
            .cloned()
            .collect();
        for uid in gone {
            if let Some(mut lp) = self.pods.remove(&uid) {
                lp.kill_all();
                let _ = std::fs::remove_dir_all(&lp.dir);
            }
        }
        let uids: Vec<String> = self.pods.keys().cloned().collect();
        for uid in uids {
            if let Err(e) = self.tend(&uid).await {
                tracing::warn!("pod {uid}: {e:#}");
            }
        }
        Ok(())
    }

    /// Binds a pending pod to this node, as the scheduler would (only its nodeSelector is
    /// checked: there is one node).
    async fn bind(&self, pod: &Pod) -> Result<()> {
        let spec = pod.spec.as_ref().context("pod without spec")?;
        if pod.metadata.deletion_timestamp.is_some() {
            return Ok(());
        }
        if spec
            .scheduler_name
            .as_deref()
            .is_some_and(|s| s != "default-scheduler")
        {
            return Ok(());
        }
        let labels = super::node_labels();
        if let Some(selector) = &spec.node_selector {
            if selector.iter().any(|(k, v)| labels.get(k) != Some(v)) {
                return Ok(());
            }
        }
        let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
        let name = pod.metadata.name.as_deref().context("pod without name")?;
        let binding = Binding {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                uid: pod.metadata.uid.clone(),
                ..Default::default()
            },
            target: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(NODE_NAME.into()),
                ..Default::default()
            },
        };
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let _: Value = api
            .create_subresource("binding", name, &PostParams::default(), &binding)
            .await
            .with_context(|| format!("binding {ns}/{name}"))?;
        Ok(())
    }

    async fn on_pod(&mut self, pod: Pod, uid: &str) -> Result<()> {
        let deleting = pod.metadata.deletion_timestamp.is_some();
        if let Some(lp) = self.pods.get_mut(uid) {
            lp.pod = pod;
            if deleting && lp.stopping.is_none() {
                let grace = lp
                    .pod
                    .metadata
                    .deletion_grace_period_seconds
                    .map(|s| Duration::from_secs(s.max(0) as u64))
                    .unwrap_or(Duration::from_secs(30))
                    .min(MAX_GRACE);
                lp.stopping = Some(Instant::now() + grace);
                lp.signal_all("TERM");
            }
            return Ok(());
        }
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        if deleting {
            return self.finish_delete(&ns, &name, uid).await;
        }
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        if matches!(phase, Some("Succeeded") | Some("Failed")) {
            return Ok(());
        }
        let ip = shardgate_harness::addr::node_ip(&pod_ports(&pod))?;
        let dir = self
            .node_dir
            .join("pods")
            .join(format!("{ns}_{name}_{}", &uid[..8.min(uid.len())]));
        volumes::mkdir(&dir)?;
        let lp = LocalPod {
            ns,
            name,
            uid: uid.to_string(),
            pod,
            ip,
            dir,
            start_time: Timestamp::now(),
            containers: Vec::new(),
            volumes: BTreeMap::new(),
            setup_error: None,
            next_setup: Instant::now(),
            next_refresh: Instant::now() + VOLUME_REFRESH,
            held: false,
            stopping: None,
            last_status: None,
        };
        tracing::info!("pod {}/{} on {}", lp.ns, lp.name, lp.ip);
        self.pods.insert(uid.to_string(), lp);
        Ok(())
    }

    /// Everything a local pod needs this pass.
    async fn tend(&mut self, uid: &str) -> Result<()> {
        let Some(mut lp) = self.pods.remove(uid) else {
            return Ok(());
        };
        let result = self.tend_pod(&mut lp).await;
        if lp
            .stopping
            .is_some_and(|deadline| lp.all_exited() || Instant::now() > deadline)
        {
            lp.kill_all();
            let _ = std::fs::remove_dir_all(&lp.dir);
            return self.finish_delete(&lp.ns, &lp.name, &lp.uid).await;
        }
        self.pods.insert(uid.to_string(), lp);
        result
    }

    async fn tend_pod(&mut self, lp: &mut LocalPod) -> Result<()> {
        if lp.stopping.is_some() {
            return Ok(());
        }
        if lp.containers.is_empty() && Instant::now() >= lp.next_setup {
            match self.setup(lp).await {
                Ok(()) => lp.setup_error = None,
                Err(e) => {
                    let reason = if format!("{e:#}").contains("image") {
                        "ErrImagePull"
                    } else {
                        "CreateContainerConfigError"
                    };
                    lp.setup_error = Some((reason.into(), format!("{e:#}")));
                    lp.next_setup = Instant::now() + Duration::from_secs(1);
                }
            }
        }
        if Instant::now() >= lp.next_refresh {
            lp.next_refresh = Instant::now() + VOLUME_REFRESH;
            self.refresh_volumes(lp).await;
        }
        let restart_policy = lp
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.restart_policy.clone())
            .unwrap_or_else(|| "Always".into());
        for c in &mut lp.containers {
            if let Some(p) = &mut c.process {
                if let Some(code) = p.exited() {
                    tracing::info!(
                        "pod {}/{}: container {} exited ({code})",
                        lp.ns,
                        lp.name,
                        c.spec.name
                    );
                    c.process = None;
                    c.ready = false;
                    c.last_exit = Some(Exit {
                        code,
                        message: crate::process::log_tail(&c.log, 5),
                        started: c.started_at.unwrap_or_else(Timestamp::now),
                        finished: Timestamp::now(),
                    });
                    let again =
                        restart_policy == "Always" || (restart_policy == "OnFailure" && code != 0);
                    if again && !lp.held {
                        c.restart_at = Some(Instant::now() + c.backoff);
                        c.backoff = (c.backoff * 2).min(MAX_BACKOFF);
                    }
                }
            }
            if c.process.is_none() && !lp.held && c.restart_at.is_some_and(|t| Instant::now() >= t)
            {
                c.restart_at = None;
                c.restart_count += 1;
                c.spawn()?;
            }
            if c.process.is_some() && Instant::now() >= c.next_probe {
                let initial = c
                    .spec
                    .readiness_probe
                    .as_ref()
                    .and_then(|p| p.initial_delay_seconds)
                    .unwrap_or(0);
                let old_enough = c.started_at.is_some_and(|t| {
                    Timestamp::now().duration_since(t).as_secs() >= i64::from(initial)
                });
                c.ready = old_enough && probe(c, lp.ip).await;
                let period = c
                    .spec
                    .readiness_probe
                    .as_ref()
                    .and_then(|p| p.period_seconds)
                    .map(|s| Duration::from_secs(s.max(0) as u64))
                    .unwrap_or(PROBE_PERIOD)
                    .min(PROBE_PERIOD);
                c.next_probe = Instant::now() + period;
            }
        }
        self.report(lp).await
    }

    /// Volumes, environment, command line, and the first start of every container.
    async fn setup(&self, lp: &mut LocalPod) -> Result<()> {
        let pod_ip = lp.ip.to_string();
        let host_ip = self.node_ip.to_string();
        let spec = lp.pod.spec.clone().context("pod without spec")?;
        if spec.init_containers.as_ref().is_some_and(|c| !c.is_empty()) {
            bail!("init containers are not supported by the node agent");
        }
        lp.volumes.clear();
        for volume in spec.volumes.iter().flatten() {
            let m = volumes::materialize(
                &self.client,
                &lp.pod,
                volume,
                &lp.dir,
                &self.node_dir,
                &pod_ip,
                &host_ip,
            )
            .await
            .with_context(|| format!("volume {:?}", volume.name))?;
            lp.volumes.insert(volume.name.clone(), m);
        }
        let mut containers = Vec::new();
        for spec in &spec.containers {
            let image = spec.image.clone().unwrap_or_default();
            let resolved = images::resolve(&image)?;
            let env =
                container_env(&self.client, &lp.pod, spec, self.api, &pod_ip, &host_ip).await?;
            let vars: HashMap<String, String> = env.iter().cloned().collect();
            let root = lp.dir.join("containers").join(&spec.name).join("root");
            let mounts = link_mounts(spec, &root, &lp.volumes)?;
            let command: Vec<String> = spec
                .command
                .iter()
                .flatten()
                .map(|a| expand(a, &vars))
                .collect();
            let args: Vec<String> = spec
                .args
                .iter()
                .flatten()
                .map(|a| expand(a, &vars))
                .collect();
            let argv = images::argv(&resolved, &command, &args, lp.ip)?
                .into_iter()
                .map(|a| rewrite_paths(&a, &mounts, &root))
                .collect();
            let mut env: Vec<(String, String)> = env
                .into_iter()
                .map(|(k, v)| (k, rewrite_paths(&v, &mounts, &root)))
                .collect();
            // In-cluster clients read fixed paths the agent cannot map: give them a
            // kubeconfig naming the mapped files instead (see `in_cluster_kubeconfig`).
            if mounts.iter().any(|m| m == SERVICE_ACCOUNT_DIR)
                && !env.iter().any(|(k, _)| k == "KUBECONFIG")
            {
                let sa = root.join(SERVICE_ACCOUNT_DIR.trim_start_matches('/'));
                let path = lp.dir.join(format!("{}.kubeconfig", spec.name));
                std::fs::write(&path, in_cluster_kubeconfig(self.api, &sa, &lp.ns)?)
                    .with_context(|| format!("writing {}", path.display()))?;
                env.push(("KUBECONFIG".into(), path.display().to_string()));
            }
            containers.push(LocalContainer {
                log: lp.dir.join(format!("{}.log", spec.name)),
                spec: spec.clone(),
                kind: resolved.kind,
                program: resolved.program,
                argv,
                env,
                root,
                process: None,
                started_at: None,
                restart_count: 0,
                last_exit: None,
                restart_at: None,
                backoff: FIRST_BACKOFF,
                ready: false,
                next_probe: Instant::now(),
            });
        }
        for c in &mut containers {
            c.spawn()?;
        }
        lp.containers = containers;
        Ok(())
    }

    async fn refresh_volumes(&self, lp: &mut LocalPod) {
        let Some(spec) = lp.pod.spec.clone() else {
            return;
        };
        let pod_ip = lp.ip.to_string();
        let host_ip = self.node_ip.to_string();
        for volume in spec.volumes.iter().flatten() {
            // Tokens are not re-requested: they outlive any test.
            if volume.config_map.is_none() && volume.secret.is_none() {
                continue;
            }
            let Some(Materialized::Files { dir, files }) = lp.volumes.get_mut(&volume.name) else {
                continue;
            };
            match volumes::files_of(&self.client, &lp.pod, volume, &pod_ip, &host_ip).await {
                Ok(new) if new != *files => {
                    if let Err(e) = volumes::write_atomically(dir, &new) {
                        tracing::warn!("refreshing volume {}: {e:#}", volume.name);
                    } else {
                        *files = new;
                    }
                }
                Ok(_) => {}
                Err(e) => tracing::warn!("refreshing volume {}: {e:#}", volume.name),
            }
        }
    }

    /// Patches the pod's status if it changed since the last report.
    async fn report(&self, lp: &mut LocalPod) -> Result<()> {
        let status = lp.status(self.node_ip);
        if lp.last_status.as_ref() == Some(&status) {
            return Ok(());
        }
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &lp.ns);
        api.patch_status(
            &lp.name,
            &PatchParams::default(),
            // A merge patch replaces lists whole (podIPs after a move; a strategic one would
            // merge the old IP in). Every list here is sent complete.
            &Patch::Merge(json!({ "status": status })),
        )
        .await
        .with_context(|| format!("updating the status of {}/{}", lp.ns, lp.name))?;
        lp.last_status = Some(status);
        Ok(())
    }

    async fn finish_delete(&self, ns: &str, name: &str, uid: &str) -> Result<()> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: Some(uid.to_string()),
                resource_version: None,
            }),
            ..Default::default()
        };
        match api.delete(name, &params).await {
            Ok(_) => Ok(()),
            // Already gone, or a new pod with the same name: ours is done either way.
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
            Err(e) => Err(e).with_context(|| format!("deleting {ns}/{name}")),
        }
    }

    /// Applies a fault to the pod `ns/name`.
    pub(super) async fn fault(&mut self, ns: &str, name: &str, fault: Fault) -> Result<()> {
        let uid = self
            .pods
            .values()
            .find(|lp| lp.ns == ns && lp.name == name && lp.stopping.is_none())
            .map(|lp| lp.uid.clone())
            .with_context(|| format!("pod {ns}/{name} is not running on this node"))?;
        let mut lp = self.pods.remove(&uid).context("pod vanished")?;
        let result = self.apply_fault(&mut lp, fault).await;
        self.pods.insert(uid, lp);
        result
    }

    async fn apply_fault(&mut self, lp: &mut LocalPod, fault: Fault) -> Result<()> {
        tracing::info!("pod {}/{}: fault {fault:?}", lp.ns, lp.name);
        match fault {
            Fault::Kill => {
                lp.signal_all("KILL");
            }
            Fault::Stop => {
                lp.held = true;
                lp.kill_all();
                for c in &mut lp.containers {
                    c.mark_exited();
                    c.restart_at = None;
                }
            }
            Fault::Restart => {
                lp.held = false;
                lp.restart_all()?;
            }
            Fault::WipeData => {
                lp.held = false;
                lp.kill_all();
                for m in lp.volumes.values() {
                    if let Materialized::Writable { dir } = m {
                        let _ = std::fs::remove_dir_all(dir);
                        volumes::mkdir(dir)?;
                    }
                }
                // The working directory is the container's root: files a program wrote there
                // (e.g. nodes.conf without a `dir`) are data too. Mount links are remade.
                for c in &mut lp.containers {
                    let _ = std::fs::remove_dir_all(&c.root);
                    link_mounts(&c.spec, &c.root, &lp.volumes)?;
                }
                lp.restart_all()?;
            }
            Fault::RestartWithNewIp => {
                lp.held = false;
                lp.kill_all();
                let counts: Vec<i32> = lp.containers.iter().map(|c| c.restart_count + 1).collect();
                lp.ip = shardgate_harness::addr::node_ip(&pod_ports(&lp.pod))?;
                lp.containers.clear();
                self.setup(lp).await?;
                for (c, n) in lp.containers.iter_mut().zip(counts) {
                    c.restart_count = n;
                }
            }
        }
        self.report(lp).await
    }

    /// The directory of the pod `ns/name` (volumes, container roots, logs `<container>.log`).
    pub(super) fn pod_dir(&self, ns: &str, name: &str) -> Option<PathBuf> {
        self.pods
            .values()
            .find(|lp| lp.ns == ns && lp.name == name)
            .map(|lp| lp.dir.clone())
    }

    /// Stops every pod process (agent shutdown).
    pub(super) fn kill_all(&mut self) {
        for lp in self.pods.values_mut() {
            lp.kill_all();
        }
    }
}

impl LocalPod {
    fn all_exited(&mut self) -> bool {
        self.containers
            .iter_mut()
            .all(|c| c.process.as_mut().is_none_or(|p| p.exited().is_some()))
    }

    fn signal_all(&mut self, signal: &str) {
        for c in &self.containers {
            if let Some(p) = &c.process {
                let _ = Command::new("kill")
                    .arg(format!("-{signal}"))
                    .arg(p.pid().to_string())
                    .stderr(std::process::Stdio::null())
                    .status();
            }
        }
    }

    fn kill_all(&mut self) {
        for c in &mut self.containers {
            if let Some(p) = &mut c.process {
                p.kill();
            }
        }
    }

    fn restart_all(&mut self) -> Result<()> {
        self.kill_all();
        for c in &mut self.containers {
            c.mark_exited();
            c.restart_at = None;
            c.restart_count += 1;
            c.spawn()?;
        }
        Ok(())
    }

    /// The pod's `status`, as JSON for a merge patch.
    fn status(&self, node_ip: Ipv4Addr) -> Value {
        let now = Timestamp::now();
        let ip = self.ip.to_string();
        let running =
            !self.containers.is_empty() && self.containers.iter().all(|c| c.process.is_some());
        let ready = running && self.containers.iter().all(|c| c.ready);
        let restart_policy = self
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.restart_policy.as_deref())
            .unwrap_or("Always");
        let all_done = !self.containers.is_empty()
            && restart_policy != "Always"
            && self
                .containers
                .iter()
                .all(|c| c.process.is_none() && c.restart_at.is_none() && c.last_exit.is_some());
        let phase = if all_done {
            if self
                .containers
                .iter()
                .all(|c| c.last_exit.as_ref().is_some_and(|e| e.code == 0))
            {
                "Succeeded"
            } else {
                "Failed"
            }
        } else if self
            .containers
            .iter()
            .any(|c| c.process.is_some() || c.last_exit.is_some())
        {
            "Running"
        } else {
            "Pending"
        };
        // Transition times are not tracked: a condition's time is when it last changed value
        // as far as this report knows, which is what readers compare.
        let cond = |type_: &str, ok: bool| {
            let previous = self.last_status.as_ref().and_then(|s| {
                s["conditions"]
                    .as_array()?
                    .iter()
                    .find(|c| c["type"] == type_)
                    .cloned()
            });
            let status = if ok { "True" } else { "False" };
            let time = match previous {
                Some(p) if p["status"] == status => p["lastTransitionTime"].clone(),
                _ => json!(Time(now)),
            };
            json!({ "type": type_, "status": status, "lastTransitionTime": time, "lastProbeTime": null })
        };
        let statuses: Vec<Value> = if self.containers.is_empty() {
            let spec_containers = self
                .pod
                .spec
                .as_ref()
                .map(|s| s.containers.clone())
                .unwrap_or_default();
            let (reason, message) = self
                .setup_error
                .clone()
                .unwrap_or_else(|| ("ContainerCreating".into(), String::new()));
            spec_containers
                .iter()
                .map(|c| {
                    json!({
                        "name": c.name, "image": c.image.clone().unwrap_or_default(), "imageID": "",
                        "ready": false, "started": false, "restartCount": 0,
                        "state": { "waiting": { "reason": reason, "message": message } },
                    })
                })
                .collect()
        } else {
            self.containers.iter().map(|c| c.status()).collect()
        };
        json!({
            "phase": phase,
            "hostIP": node_ip.to_string(),
            "hostIPs": [{ "ip": node_ip.to_string() }],
            "podIP": ip,
            "podIPs": [{ "ip": ip }],
            "startTime": Time(self.start_time),
            "conditions": [
                cond("PodReadyToStartContainers", true),
                cond("Initialized", true),
                cond("ContainersReady", ready),
                cond("Ready", ready),
                cond("PodScheduled", true),
            ],
            "containerStatuses": statuses,
        })
    }
}

impl LocalContainer {
    fn spawn(&mut self) -> Result<()> {
        volumes::mkdir(&self.root)?;
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.argv)
            .current_dir(&self.root)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let what = format!("container {}", self.spec.name);
        self.process = Some(Daemon::spawn(&what, cmd, &self.log)?);
        self.started_at = Some(Timestamp::now());
        self.ready = false;
        self.next_probe = Instant::now();
        Ok(())
    }

    fn mark_exited(&mut self) {
        if let Some(p) = self.process.take() {
            let code = p.exited().unwrap_or(137);
            self.last_exit = Some(Exit {
                code,
                message: crate::process::log_tail(&self.log, 5),
                started: self.started_at.unwrap_or_else(Timestamp::now),
                finished: Timestamp::now(),
            });
        }
        self.ready = false;
    }

    fn status(&self) -> Value {
        let terminated = |e: &Exit| {
            json!({ "terminated": {
                "exitCode": e.code,
                "message": e.message,
                "reason": if e.code == 0 { "Completed" } else { "Error" },
                "startedAt": Time(e.started),
                "finishedAt": Time(e.finished),
            }})
        };
        let state = match (&self.process, &self.last_exit) {
            (Some(p), _) => {
                json!({ "running": { "startedAt": Time(self.started_at.unwrap_or_else(Timestamp::now)) }, "pid": p.pid() })
            }
            (None, Some(e)) if self.restart_at.is_some() => {
                json!({ "waiting": { "reason": "CrashLoopBackOff", "message": format!("exited with {}: {}", e.code, e.message) } })
            }
            (None, Some(e)) => terminated(e),
            (None, None) => json!({ "waiting": { "reason": "ContainerCreating" } }),
        };
        // "pid" is not a state field; it goes into the container ID instead.
        let mut state = state;
        let pid = state.as_object_mut().and_then(|o| o.remove("pid"));
        let mut status = json!({
            "name": self.spec.name,
            "image": self.spec.image.clone().unwrap_or_default(),
            "imageID": "",
            "ready": self.ready,
            "started": self.process.is_some(),
            "restartCount": self.restart_count,
            "state": state,
        });
        if let Some(pid) = pid {
            status["containerID"] = json!(format!("shardgate://{pid}"));
        }
        if let Some(e) = &self.last_exit {
            status["lastState"] = terminated(e);
        }
        status
    }
}

/// Links each volume mount of `container` at `<root><mountPath>` and returns the mount paths.
fn link_mounts(
    container: &Container,
    root: &Path,
    volumes: &BTreeMap<String, Materialized>,
) -> Result<Vec<String>> {
    volumes::mkdir(root)?;
    let mut mounts = Vec::new();
    for m in container.volume_mounts.iter().flatten() {
        let volume = volumes
            .get(&m.name)
            .with_context(|| format!("volumeMount {:?} names no volume", m.name))?;
        let mut target = volume.dir().to_path_buf();
        if let Some(sub) = m.sub_path.as_deref().filter(|s| !s.is_empty()) {
            target = target.join(sub);
            if matches!(volume, Materialized::Writable { .. }) {
                volumes::mkdir(&target)?;
            }
        }
        let path = m.mount_path.trim_end_matches('/');
        if !path.starts_with('/') {
            bail!("mountPath {:?} is not absolute", m.mount_path);
        }
        let link = root.join(&path[1..]);
        if let Some(parent) = link.parent() {
            volumes::mkdir(parent)?;
        }
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&target, &link)
            .with_context(|| format!("linking {}", link.display()))?;
        mounts.push(path.to_string());
    }
    Ok(mounts)
}

/// The ports a pod will listen on (with the cluster bus port of a Valkey image's ports), to
/// find an IP where all are free.
fn pod_ports(pod: &Pod) -> Vec<u16> {
    let mut ports = Vec::new();
    for c in pod.spec.iter().flat_map(|s| s.containers.iter()) {
        let valkey = c
            .image
            .as_deref()
            .is_some_and(|i| images::kind(i) == Some(ImageKind::Valkey));
        for p in c.ports.iter().flatten() {
            if let Ok(port) = u16::try_from(p.container_port) {
                ports.push(port);
                if valkey {
                    ports.extend(bus_port(port));
                }
            }
        }
    }
    ports
}

/// A named or numbered port of the container.
fn resolve_port(c: &Container, port: &IntOrString) -> Option<u16> {
    match port {
        IntOrString::Int(n) => u16::try_from(*n).ok(),
        IntOrString::String(name) => c
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name))
            .and_then(|p| u16::try_from(p.container_port).ok()),
    }
}

/// The readiness probe, or for Valkey without one a PING, or else "running".
async fn probe(c: &LocalContainer, ip: Ipv4Addr) -> bool {
    const TIMEOUT: Duration = Duration::from_secs(1);
    match &c.spec.readiness_probe {
        // The probe's own timeout, as the kubelet takes it (1 s by default).
        Some(p) => {
            let secs = p.timeout_seconds.and_then(|s| u64::try_from(s).ok());
            let timeout = secs.filter(|&s| s > 0).map_or(TIMEOUT, Duration::from_secs);
            run_probe(c, p, ip, timeout).await
        }
        None if c.kind == ImageKind::Valkey => {
            let port = c
                .spec
                .ports
                .iter()
                .flatten()
                .next()
                .and_then(|p| u16::try_from(p.container_port).ok())
                .unwrap_or(DEFAULT_PORT);
            tokio::time::timeout(TIMEOUT, ping(SocketAddr::from((ip, port))))
                .await
                .is_ok_and(|r| r.unwrap_or(false))
        }
        None => true,
    }
}

async fn run_probe(c: &LocalContainer, p: &Probe, ip: Ipv4Addr, timeout: Duration) -> bool {
    if let Some(tcp) = &p.tcp_socket {
        let Some(port) = resolve_port(&c.spec, &tcp.port) else {
            return false;
        };
        return tokio::time::timeout(timeout, TcpStream::connect((ip, port)))
            .await
            .is_ok_and(|r| r.is_ok());
    }
    if let Some(http) = &p.http_get {
        let Some(port) = resolve_port(&c.spec, &http.port) else {
            return false;
        };
        let path = http.path.clone().unwrap_or_else(|| "/".into());
        return tokio::time::timeout(timeout, http_status(SocketAddr::from((ip, port)), &path))
            .await
            .is_ok_and(|r| r.is_ok_and(|code| (200..400).contains(&code)));
    }
    if let Some(exec) = &p.exec {
        let Some((first, rest)) = exec.command.as_deref().unwrap_or_default().split_first() else {
            return false;
        };
        let base = first.rsplit('/').next().unwrap_or(first);
        let mut cmd = if CLI_COMMANDS.contains(&base) {
            // In the pod's own network namespace, localhost would be the pod.
            let Ok(cli) = shardgate_harness::tools::redis_cli() else {
                return false;
            };
            let mut cmd = tokio::process::Command::new(cli);
            if !rest.iter().any(|a| a == "-h") {
                cmd.args(["-h", &ip.to_string()]);
            }
            cmd
        } else {
            tokio::process::Command::new(first)
        };
        // The container's paths (a mounted Secret's files, say) are under its root here.
        let mounts: Vec<String> = c
            .spec
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| m.mount_path.trim_end_matches('/').to_string())
            .collect();
        cmd.args(rest.iter().map(|a| rewrite_paths(a, &mounts, &c.root)))
            .current_dir(&c.root)
            .envs(c.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true);
        return tokio::time::timeout(timeout, cmd.status())
            .await
            .is_ok_and(|r| r.is_ok_and(|s| s.success()));
    }
    // gRPC probes and the like: running is the best this agent can say.
    true
}

async fn ping(addr: SocketAddr) -> std::io::Result<bool> {
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(b"*1\r\n$4\r\nPING\r\n").await?;
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf).await?;
    Ok(buf[..n].starts_with(b"+PONG"))
}

async fn http_status(addr: SocketAddr, path: &str) -> Result<u16> {
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await?;
    let text = String::from_utf8_lossy(&buf);
    text.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("no HTTP status line")
}
