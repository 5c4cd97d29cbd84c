//! The node agent: the kubelet, kube-proxy and a LoadBalancer implementation for this one
//! machine, with no containers.
//!
//! - Registers the Node [`NODE_NAME`] (its IP a fresh loopback address) and renews its Lease,
//!   so the node lifecycle controller keeps it Ready.
//! - Binds pending pods to it, and runs each container as a local process: the image picks
//!   the program ([`images`]), the pod gets its own 127.x IP, `$(VAR)`s are expanded from the
//!   environment and the downward API, volumes are files in a per-pod directory and absolute
//!   paths under a mount are mapped there. Readiness comes from the readiness probe (or a
//!   PING for Valkey); the status is written back. Deleting a pod stops its processes
//!   (SIGTERM, then SIGKILL after the grace period) before the pod object goes.
//! - Serves NodePort and LoadBalancer Services ([`services`]).
//! - Injects faults: [`NodeAgent::fault`].
//!
//! Not emulated: ClusterIP routing and DNS (in-cluster clients use pod IPs or the API), init
//! containers, liveness/startup probes, resource limits.
//!
//! It runs on its own thread and Tokio runtime, so that it outlives the runtime of any one
//! test sharing the control plane.

mod env;
mod expand;
pub mod images;
mod pods;
mod services;
mod volumes;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::Client;
use serde_json::json;
use tokio::sync::{mpsc, oneshot, watch};

use pods::Pods;
use services::Services;

/// The one node's name.
pub const NODE_NAME: &str = "shardgate-node";
/// How often the agent looks at pods and Services.
const TICK: Duration = Duration::from_millis(200);
/// How often the node's Lease is renewed (the kubelet's default).
const LEASE_RENEW: Duration = Duration::from_secs(10);

/// A fault to inject into a pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL the containers; they are restarted as the restart policy says, as after a crash.
    Kill,
    /// SIGKILL the containers and keep them down (the pod stays, not ready) until
    /// [`Fault::Restart`]: a node or process that is gone.
    Stop,
    /// Stop the containers and start them again at the same IP.
    Restart,
    /// Stop the containers and start them again at a new IP, which the pod's status reports
    /// (on a real cluster only a re-created pod gets a new IP; deleting a StatefulSet's pod
    /// does that here too).
    RestartWithNewIp,
    /// Stop the containers, empty the pod's emptyDir and claim volumes and the containers'
    /// working directories, and start again at the same IP.
    WipeData,
}

pub(crate) struct AgentConfig {
    /// The agent's directory: pods, claims.
    pub root: PathBuf,
    pub client_config: kube::Config,
    /// The API server, for the pods' `KUBERNETES_SERVICE_*` variables.
    pub api: SocketAddr,
}

enum Request {
    Fault {
        ns: String,
        name: String,
        fault: Fault,
        reply: oneshot::Sender<Result<()>>,
    },
    PodDir {
        ns: String,
        name: String,
        reply: oneshot::Sender<Option<PathBuf>>,
    },
}

/// The running agent; stops (and kills every pod process) on [`NodeAgent::shutdown`] or drop.
pub struct NodeAgent {
    node_ip: Ipv4Addr,
    requests: mpsc::UnboundedSender<Request>,
    stop: watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl NodeAgent {
    pub(crate) fn start(config: AgentConfig) -> Result<NodeAgent> {
        let node_ip = shardgate_harness::addr::node_ip(&[])?;
        volumes::mkdir(&config.root)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("node-agent")
            .enable_all()
            .build()
            .context("building the node agent's runtime")?;
        let (requests, rx) = mpsc::unbounded_channel();
        let (stop, stop_rx) = watch::channel(false);
        let thread = std::thread::Builder::new()
            .name("node-agent".into())
            .spawn(move || {
                if let Err(e) = runtime.block_on(run(config, node_ip, rx, stop_rx)) {
                    tracing::error!("node agent stopped: {e:#}");
                }
                runtime.shutdown_timeout(Duration::from_secs(1));
            })
            .context("starting the node agent thread")?;
        Ok(NodeAgent {
            node_ip,
            requests,
            stop,
            thread: Some(thread),
        })
    }

    /// The node's IP: NodePort Services listen here.
    pub fn node_ip(&self) -> Ipv4Addr {
        self.node_ip
    }

    /// Injects `fault` into the pod `ns/name`, which must run on the node.
    pub async fn fault(&self, ns: &str, name: &str, fault: Fault) -> Result<()> {
        let (reply, rx) = oneshot::channel();
        self.requests
            .send(Request::Fault {
                ns: ns.into(),
                name: name.into(),
                fault,
                reply,
            })
            .map_err(|_| anyhow!("the node agent has stopped"))?;
        rx.await
            .map_err(|_| anyhow!("the node agent has stopped"))?
    }

    /// The pod's directory on this machine: `<container>.log` files, `volumes/`,
    /// `containers/<name>/root/` (each container's working directory).
    pub async fn pod_dir(&self, ns: &str, name: &str) -> Result<PathBuf> {
        let (reply, rx) = oneshot::channel();
        self.requests
            .send(Request::PodDir {
                ns: ns.into(),
                name: name.into(),
                reply,
            })
            .map_err(|_| anyhow!("the node agent has stopped"))?;
        rx.await
            .map_err(|_| anyhow!("the node agent has stopped"))?
            .with_context(|| format!("pod {ns}/{name} does not run on the node"))
    }

    /// Stops the agent: every pod process is killed.
    pub fn shutdown(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        let _ = self.stop.send(true);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        self.stop_now();
    }
}

/// The node's labels (also what nodeSelectors are matched against).
pub(crate) fn node_labels() -> BTreeMap<String, String> {
    [
        ("kubernetes.io/hostname", NODE_NAME),
        ("kubernetes.io/os", "linux"),
        ("kubernetes.io/arch", "amd64"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

async fn run(
    config: AgentConfig,
    node_ip: Ipv4Addr,
    mut requests: mpsc::UnboundedReceiver<Request>,
    mut stop: watch::Receiver<bool>,
) -> Result<()> {
    let client = Client::try_from(config.client_config).context("agent client")?;
    register_node(&client, node_ip).await?;
    let mut pods = Pods::new(client.clone(), config.root.clone(), node_ip, config.api);
    let mut services = Services::new(client.clone(), node_ip);
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut lease = tokio::time::interval(LEASE_RENEW);
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            Some(request) = requests.recv() => match request {
                Request::Fault { ns, name, fault, reply } => {
                    let _ = reply.send(pods.fault(&ns, &name, fault).await);
                }
                Request::PodDir { ns, name, reply } => {
                    let _ = reply.send(pods.pod_dir(&ns, &name));
                }
            },
            _ = lease.tick() => {
                if let Err(e) = renew_lease(&client).await {
                    tracing::warn!("renewing the node lease: {e:#}");
                }
            }
            _ = tick.tick() => {
                if let Err(e) = pods.sync().await {
                    tracing::warn!("{e:#}");
                }
                if let Err(e) = services.sync().await {
                    tracing::warn!("{e:#}");
                }
            }
        }
    }
    pods.kill_all();
    services.stop();
    Ok(())
}

async fn register_node(client: &Client, node_ip: Ipv4Addr) -> Result<()> {
    let api: Api<Node> = Api::all(client.clone());
    let params = PatchParams::apply(super::crds::FIELD_MANAGER).force();
    let node = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": NODE_NAME, "labels": node_labels() },
        "spec": {},
    });
    api.patch(NODE_NAME, &params, &Patch::Apply(&node))
        .await
        .context("registering the node")?;
    let now = Time(Timestamp::now());
    let capacity =
        json!({ "cpu": "2", "memory": "24Gi", "pods": "110", "ephemeral-storage": "100Gi" });
    let condition = |type_: &str, status: &str, reason: &str| {
        json!({ "type": type_, "status": status, "reason": reason, "message": reason,
                "lastHeartbeatTime": now, "lastTransitionTime": now })
    };
    let status = json!({
        "status": {
            "addresses": [
                { "type": "InternalIP", "address": node_ip.to_string() },
                { "type": "Hostname", "address": NODE_NAME },
            ],
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": [
                condition("Ready", "True", "KubeletReady"),
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID"),
            ],
            "nodeInfo": {
                "machineID": "", "systemUUID": "", "bootID": "",
                "kernelVersion": "", "osImage": "shardgate node agent",
                "containerRuntimeVersion": "local-process://0",
                "kubeletVersion": "v1.34.4", "kubeProxyVersion": "",
                "operatingSystem": "linux", "architecture": "amd64",
            },
        }
    });
    api.patch_status(NODE_NAME, &PatchParams::default(), &Patch::Merge(status))
        .await
        .context("writing the node's status")?;
    renew_lease(client).await
}

async fn renew_lease(client: &Client) -> Result<()> {
    let api: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    let lease = json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": { "name": NODE_NAME },
        "spec": {
            "holderIdentity": NODE_NAME,
            "leaseDurationSeconds": 40,
            "renewTime": MicroTime(Timestamp::now()),
        },
    });
    api.patch(
        NODE_NAME,
        &PatchParams::apply(super::crds::FIELD_MANAGER).force(),
        &Patch::Apply(&lease),
    )
    .await
    .context("renewing the node lease")?;
    Ok(())
}
