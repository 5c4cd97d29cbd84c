//! Routes from the pods of a ValkeyCluster, watched on the Kubernetes API (`--kubernetes`,
//! feature `kubernetes`).
//!
//! **Where each node is** comes from its pod. The operator labels every pod with its cluster
//! and its (shard, node) indices, so a pod with both index labels and an IP, not being
//! deleted, is node (s, n) at `podIP:6379` (or its container port `vk-<s>-<n>`), and its
//! listener is `basePort + s * portsPerShard + n` ([`PortLayout`]). Each watch event is
//! published at once: a pod's new IP is routed as soon as the API server says so.
//!
//! **Who each node is** (its Valkey id, role and slots, for rewriting) comes from the nodes:
//! each pod is asked `CLUSTER MYID`, and one of them `CLUSTER SHARDS`, with the shared admin
//! client, as seed discovery asks ([`crate::discovery`]). That runs beside the watch and
//! never holds a publish back. A node whose pod moved keeps its last id until it answers at
//! the new address (a restarted pod keeps its `nodes.conf`, so its id), so replies that
//! still name it by its old address and its id are rewritten while gossip catches up. The
//! nodes are asked again every `--refresh`, sooner while one has not answered, and when a
//! rewriter meets an address the table does not know.
//!
//! **When the watch fails** (the API server unreachable, or refusing), the table in force
//! stays, the failure is counted and shown on `/readyz`, and after a backoff the pods are
//! listed afresh. A fresh list rather than a resumed watch: its end is what tells the source
//! it is back, and it catches whatever changed meanwhile.

use std::collections::{BTreeMap, HashMap};
use std::future::pending;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, watcher, Event};
use kube::{Api, Client};
use shardgate_admin_client::{Dial, ShardView};
use shardgate_crds::names::{labels, objects};
use shardgate_crds::ports::CLIENT_PORT;
use shardgate_crds::{NodeRef, PortLayout};
use tokio::task::{JoinError, JoinHandle, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{RoutePublisher, RouteSource};
use crate::dial::{BackendTlsRx, Resolver};
use crate::discovery::{self, DiscoveryError};
use crate::model::{Backend, Route, Routes};

/// The source's name in logs and metric labels.
const NAME: &str = "kubernetes";
/// The first wait before listing again after a failed watch; doubled up to [`RELIST_MAX`].
const RELIST_MIN: Duration = Duration::from_millis(250);
const RELIST_MAX: Duration = Duration::from_secs(10);
/// The first wait before asking again a node that has not said its id; doubled up to the
/// refresh interval.
const ASK_RETRY_MIN: Duration = Duration::from_millis(250);
/// The shortest time between a rewriter's request and the round it starts.
const MIN_REFRESH: Duration = Duration::from_millis(500);

/// Why the Kubernetes source cannot start, or why a watch failed. kube's errors already
/// spell out their causes, so they are shown once, not also as a source chain.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    #[error(
        "--kubernetes: no Kubernetes API to talk to (neither a kubeconfig, from $KUBECONFIG or \
         ~/.kube/config, nor an in-cluster service account): {0}"
    )]
    Config(kube::config::InferConfigError),
    #[error("--kubernetes: cannot build a client for the API server at {url}: {error}")]
    Client { url: String, error: kube::Error },
    #[error("watching the pods of {target} (selector {selector}): {error}")]
    Watch {
        target: String,
        selector: String,
        error: watcher::Error,
    },
}

/// A pod that is a node: which node, and where it listens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PodNode {
    pub node: NodeRef,
    pub addr: SocketAddr,
}

/// Why a pod of the cluster is not routed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotANode {
    /// Not one of the cluster's nodes (the proxy's own pods carry the cluster's labels too).
    #[error("no {} and {} labels", labels::SHARD_INDEX, labels::NODE_INDEX)]
    NoIndexLabels,
    #[error("label {0}: {1:?} is not an index")]
    BadLabel(&'static str, String),
    #[error("being deleted")]
    Deleting,
    #[error("no IP yet")]
    NoIp,
    #[error("status.podIP {0:?} is not an IP address")]
    BadIp(String),
}

/// What `pod` is: node (s, n) at its IP, or why not.
pub fn pod_node(pod: &Pod) -> Result<PodNode, NotANode> {
    let labels = pod.metadata.labels.as_ref();
    let label = |key| labels.and_then(|l| l.get(key));
    let (Some(shard), Some(node)) = (label(labels::SHARD_INDEX), label(labels::NODE_INDEX)) else {
        return Err(NotANode::NoIndexLabels);
    };
    let index = |key: &'static str, v: &String| {
        v.parse::<u32>()
            .map_err(|_| NotANode::BadLabel(key, v.clone()))
    };
    let node = NodeRef::new(
        index(labels::SHARD_INDEX, shard)?,
        index(labels::NODE_INDEX, node)?,
    );
    if pod.metadata.deletion_timestamp.is_some() {
        return Err(NotANode::Deleting);
    }
    let ip = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .filter(|ip| !ip.is_empty())
        .ok_or(NotANode::NoIp)?;
    let ip: IpAddr = ip.parse().map_err(|_| NotANode::BadIp(ip.to_string()))?;
    Ok(PodNode {
        node,
        addr: SocketAddr::new(ip, client_port(pod, node)),
    })
}

/// The pod's container port named `vk-<s>-<n>` (what the operator names its client port),
/// else Valkey's default.
fn client_port(pod: &Pod, node: NodeRef) -> u16 {
    let name = objects::container_port(node);
    pod.spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some(name.as_str()))
        .and_then(|p| u16::try_from(p.container_port).ok())
        .filter(|p| *p != 0)
        .unwrap_or(CLIENT_PORT)
}

/// The pods as the watch has shown them.
#[derive(Debug, Default)]
struct Pods {
    /// Pod name → node.
    nodes: BTreeMap<String, PodNode>,
    /// While a list is under way: what it has shown so far (swapped in when it ends).
    listing: Option<BTreeMap<String, PodNode>>,
    /// Whether a whole list has been seen: no table is published before.
    listed: bool,
}

impl Pods {
    /// Applies one watch event; returns whether the nodes changed (the end of a list counts
    /// as a change).
    fn apply(&mut self, event: Event<Pod>) -> bool {
        match event {
            Event::Init => {
                self.listing = Some(BTreeMap::new());
                false
            }
            Event::InitApply(pod) => {
                let name = pod.metadata.name.clone().unwrap_or_default();
                if let (Some(listing), Some(node)) = (&mut self.listing, routable(&name, &pod)) {
                    listing.insert(name, node);
                }
                false
            }
            Event::InitDone => {
                // Pods the list did not show are gone.
                self.nodes = self.listing.take().unwrap_or_default();
                self.listed = true;
                true
            }
            Event::Apply(pod) => {
                let name = pod.metadata.name.clone().unwrap_or_default();
                match routable(&name, &pod) {
                    Some(node) => self.nodes.insert(name, node) != Some(node),
                    None => self.nodes.remove(&name).is_some(),
                }
            }
            Event::Delete(pod) => {
                let name = pod.metadata.name.clone().unwrap_or_default();
                self.nodes.remove(&name).is_some()
            }
        }
    }
}

/// [`pod_node`], logging why a pod is not routed (quietly for pods that are no nodes, or
/// not yet or no longer).
fn routable(name: &str, pod: &Pod) -> Option<PodNode> {
    match pod_node(pod) {
        Ok(node) => Some(node),
        Err(e @ (NotANode::BadLabel(..) | NotANode::BadIp(_))) => {
            tracing::warn!(source = NAME, pod = name, "pod not routed: {e}");
            None
        }
        Err(e) => {
            tracing::debug!(source = NAME, pod = name, "pod not routed: {e}");
            None
        }
    }
}

/// What CLUSTER SHARDS says of a node.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Role {
    primary: bool,
    /// Its shard's slots, if it is the primary.
    slots: Vec<(u16, u16)>,
    hostname: Option<String>,
    tls_port: Option<u16>,
}

/// What the nodes said of themselves.
#[derive(Debug, Default)]
struct Known {
    /// Node → its id and the address it said so from. Kept when the node's pod moves, until
    /// it answers at the new address.
    ids: BTreeMap<NodeRef, (SocketAddr, String)>,
    /// Node id → its role, from the last CLUSTER SHARDS that answered.
    roles: HashMap<String, Role>,
}

impl Known {
    fn roles_from(&mut self, shards: &[ShardView]) {
        self.roles = shards
            .iter()
            .flat_map(|s| {
                s.nodes.iter().map(move |n| {
                    let role = Role {
                        primary: n.primary,
                        slots: if n.primary { s.slots.clone() } else { vec![] },
                        hostname: n.hostname.clone(),
                        tls_port: n.tls_port,
                    };
                    (n.id.clone(), role)
                })
            })
            .collect();
    }

    /// Whether `pod`'s node has said its id from where its pod is now.
    fn confirmed(&self, pod: &PodNode) -> bool {
        self.ids
            .get(&pod.node)
            .is_some_and(|(at, _)| *at == pod.addr)
    }
}

/// Nodes → routes: the pure half of the source.
#[derive(Debug)]
struct Table {
    base_port: u16,
    ports_per_shard: Option<u32>,
    /// Ports per shard: `--ports-per-shard`, else fixed by the first table.
    stride: Option<u32>,
    rewrite: bool,
}

impl Table {
    fn new(base_port: u16, ports_per_shard: Option<u32>, rewrite: bool) -> Self {
        Table {
            base_port,
            ports_per_shard,
            stride: None,
            rewrite,
        }
    }

    /// The routes of `pods` (by pod name), and why any pod is left out.
    fn routes(&mut self, pods: &BTreeMap<String, PodNode>, known: &Known) -> (Routes, Vec<String>) {
        let stride = *self.stride.get_or_insert_with(|| {
            self.ports_per_shard
                .unwrap_or_else(|| pods.values().map(|p| p.node.node.0 + 1).max().unwrap_or(1))
                .max(1)
        });
        let mut routes = Routes::new();
        let mut owners: BTreeMap<NodeRef, &str> = BTreeMap::new();
        let mut skipped = vec![];
        for (name, pod) in pods {
            if let Some(other) = owners.get(&pod.node) {
                skipped.push(format!("pod {name}: node {} is pod {other}", pod.node));
                continue;
            }
            // A layout just large enough for this pod's shard: one pod out of range leaves
            // the others routed.
            let port = pod
                .node
                .shard
                .0
                .checked_add(1)
                .ok_or_else(|| "shard index out of range".to_string())
                .and_then(|shards| {
                    PortLayout::new(u32::from(self.base_port), shards, stride - 1, Some(stride))
                        .and_then(|l| l.port(pod.node))
                        .map_err(|e| e.to_string())
                });
            let port = match port {
                Ok(p) => p,
                Err(e) => {
                    skipped.push(format!("pod {name} (node {}): {e}", pod.node));
                    continue;
                }
            };
            owners.insert(pod.node, name);
            let id = known.ids.get(&pod.node).map(|(_, id)| id.clone());
            let role = id.as_ref().and_then(|id| known.roles.get(id));
            let route = Route {
                node: pod.node,
                backend: Backend::ip(pod.addr),
                hostname: role.and_then(|r| r.hostname.clone()),
                rewrite: self.rewrite,
                // Before the nodes answer: node 0, the initial primary.
                primary: role.map_or(pod.node.node.0 == 0, |r| r.primary),
                tls_backend: role
                    .and_then(|r| r.tls_port)
                    .map(|p| Backend::ip(SocketAddr::new(pod.addr.ip(), p))),
                slots: role.map(|r| r.slots.clone()).unwrap_or_default(),
                node_id: id,
            };
            routes.insert(port, Arc::new(route));
        }
        (routes, skipped)
    }
}

/// What one round of asking the nodes brought back.
struct Answers {
    ids: Vec<(PodNode, Result<String, shardgate_admin_client::Error>)>,
    shards: Result<Vec<ShardView>, DiscoveryError>,
}

/// Asks every node its id, and the first of them that answers CLUSTER SHARDS.
async fn ask(nodes: Vec<PodNode>, resolver: Resolver, dial: Dial) -> Answers {
    let mut ids = JoinSet::new();
    for pod in nodes.clone() {
        let dial = dial.clone();
        ids.spawn(async move { (pod, discovery::node_id(pod.addr, &dial).await) });
    }
    let candidates: Vec<Backend> = nodes.iter().map(|p| Backend::ip(p.addr)).collect();
    let shards = discovery::discover(&resolver, &candidates, &dial)
        .await
        .map(|c| c.shards);
    let mut answers = Answers {
        ids: Vec::with_capacity(nodes.len()),
        shards,
    };
    while let Some(joined) = ids.join_next().await {
        if let Ok(answer) = joined {
            answers.ids.push(answer);
        }
    }
    answers
}

/// Routes from the pods of one ValkeyCluster.
pub struct KubernetesSource {
    client: Client,
    namespace: String,
    cluster: String,
    /// The cluster's selector, and the user's ANDed.
    selector: String,
    table: Table,
    refresh: Duration,
    /// How often the API server ends the pod watch (`shardgate_crds::api_watch`).
    watch: Duration,
    /// The admin client's connect and reply timeouts.
    timeout: Duration,
    resolver: Resolver,
    /// Nodes that speak TLS (on the client port): asked over TLS.
    tls: Option<BackendTlsRx>,
}

impl KubernetesSource {
    /// A source for the ValkeyCluster `cluster` in `namespace`, reaching the API server as
    /// kube does by default: `$KUBECONFIG` (or `~/.kube/config`), else the in-cluster
    /// service account.
    ///
    /// # Errors
    ///
    /// [`KubeError::Config`] when there is neither, [`KubeError::Client`] when the client
    /// cannot be built (e.g. a CA file that does not load). The API server is not contacted
    /// here: while it is unreachable the source keeps trying, and the proxy is not ready.
    #[allow(clippy::too_many_arguments)]
    pub async fn connect(
        namespace: String,
        cluster: String,
        extra_selector: Option<&str>,
        base_port: u16,
        ports_per_shard: Option<u32>,
        refresh: Duration,
        watch: Duration,
        timeout: Duration,
        resolver: Resolver,
        rewrite: bool,
        tls: Option<BackendTlsRx>,
    ) -> Result<Self, KubeError> {
        let mut config = kube::Config::infer().await.map_err(KubeError::Config)?;
        // kube's default is none: a list on a connection gone silent would wait for ever.
        config.read_timeout = Some(shardgate_crds::api_watch::read_timeout(watch));
        let url = config.cluster_url.to_string();
        let client = Client::try_from(config).map_err(|error| KubeError::Client {
            url: url.clone(),
            error,
        })?;
        tracing::info!(
            source = NAME,
            api = url,
            "watching the pods of {namespace}/{cluster}"
        );
        Ok(Self::with_client(
            client,
            namespace,
            cluster,
            extra_selector,
            base_port,
            ports_per_shard,
            refresh,
            watch,
            timeout,
            resolver,
            rewrite,
            tls,
        ))
    }

    /// As [`KubernetesSource::connect`], with a client made elsewhere.
    #[allow(clippy::too_many_arguments)]
    pub fn with_client(
        client: Client,
        namespace: String,
        cluster: String,
        extra_selector: Option<&str>,
        base_port: u16,
        ports_per_shard: Option<u32>,
        refresh: Duration,
        watch: Duration,
        timeout: Duration,
        resolver: Resolver,
        rewrite: bool,
        tls: Option<BackendTlsRx>,
    ) -> Self {
        let mut selector = labels::cluster_selector(&cluster);
        if let Some(extra) = extra_selector.map(str::trim).filter(|s| !s.is_empty()) {
            selector = format!("{selector},{extra}");
        }
        KubernetesSource {
            client,
            namespace,
            cluster,
            selector,
            table: Table::new(base_port, ports_per_shard, rewrite),
            refresh,
            watch,
            timeout,
            resolver,
            tls,
        }
    }
}

/// The source's state between events.
struct Run {
    publisher: RoutePublisher,
    pods: Pods,
    known: Known,
    table: Table,
    /// Whether the watch is up (listed, not failed since): only then is a publish a sign
    /// of health.
    watching: bool,
    /// The skip reasons last logged, so that each is logged when it appears.
    skipped: Vec<String>,
    /// Nodes (at an address) that have not answered yet: since when, and whether that was
    /// logged. A pod that just moved refuses for a moment; one that goes on is worth a warning.
    silent: HashMap<PodNode, (Instant, bool)>,
    refresh: Duration,
    /// Whether "no pod is routable yet" was logged.
    said_empty: bool,
}

impl Run {
    fn publish(&mut self) {
        if !self.pods.listed {
            return;
        }
        let (routes, skipped) = self.table.routes(&self.pods.nodes, &self.known);
        for s in skipped.iter().filter(|s| !self.skipped.contains(s)) {
            tracing::warn!(source = NAME, "not routed: {s}");
        }
        self.skipped = skipped;
        if routes.is_empty() && !self.publisher.current().is_loaded() {
            // No table yet rather than an empty one: the proxy is not ready with nothing to
            // route.
            if !self.said_empty {
                self.said_empty = true;
                tracing::info!(source = NAME, "no pod of the cluster is routable yet");
            }
        } else if let Err(e) = self.publisher.publish(NAME, routes) {
            self.publisher.report_error(NAME, &e);
            return;
        }
        if self.watching {
            self.publisher.report_ok(NAME);
        }
    }

    /// Whether some routed node has not said its id from where its pod is now.
    fn unconfirmed(&self) -> bool {
        self.pods.nodes.values().any(|p| !self.known.confirmed(p))
    }

    /// Takes in one round's answers.
    fn learn(&mut self, answers: Answers) {
        for (pod, answer) in answers.ids {
            // The pod may have moved while it was asked.
            let current = self.pods.nodes.values().any(|p| *p == pod);
            match answer {
                Ok(id) if current => {
                    self.silent.remove(&pod);
                    let previous = self.known.ids.insert(pod.node, (pod.addr, id.clone()));
                    if previous.as_ref().map(|(_, old)| old) != Some(&id) {
                        let (node, addr) = (pod.node, pod.addr);
                        tracing::info!(source = NAME, %node, %addr, id, "node id");
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    let (node, addr) = (pod.node, pod.addr);
                    let (since, warned) = self.silent.entry(pod).or_insert((Instant::now(), false));
                    let silent_for = since.elapsed();
                    if !*warned && silent_for >= self.refresh {
                        *warned = true;
                        tracing::warn!(
                            source = NAME,
                            %node,
                            %addr,
                            "no id from the node for {silent_for:?} (asking again): {e}"
                        );
                    } else {
                        tracing::debug!(source = NAME, %node, %addr, "no id yet: {e}");
                    }
                }
            }
        }
        let pods = &self.pods.nodes;
        self.silent.retain(|p, _| pods.values().any(|q| q == p));
        match answers.shards {
            Ok(shards) => self.known.roles_from(&shards),
            Err(e) => tracing::debug!(source = NAME, "no CLUSTER SHARDS this round: {e}"),
        }
    }
}

impl RouteSource for KubernetesSource {
    fn name(&self) -> &'static str {
        NAME
    }

    async fn run(self, publisher: RoutePublisher, shutdown: CancellationToken) {
        let target = format!("{}/{}", self.namespace, self.cluster);
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        // Renewed often enough that one fallen silent is found.
        let config = watcher::Config::default()
            .labels(&self.selector)
            .timeout(shardgate_crds::api_watch::watch_secs(self.watch));
        let new_watch = || Box::pin(watcher(api.clone(), config.clone()));
        let refresh_requested = publisher.refresh_requests();
        let mut run = Run {
            publisher,
            pods: Pods::default(),
            known: Known::default(),
            table: self.table,
            watching: false,
            skipped: vec![],
            silent: HashMap::new(),
            refresh: self.refresh,
            said_empty: false,
        };
        let mut watch = Some(new_watch());
        let mut relist_at: Option<Instant> = None;
        let mut relist_wait = RELIST_MIN;
        let mut asking: Option<JoinHandle<Answers>> = None;
        let mut ask_at: Option<Instant> = None;
        let mut ask_retry = ASK_RETRY_MIN;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                event = next_event(&mut watch) => {
                    match event {
                        Some(Ok(event)) => {
                            let listed = matches!(event, Event::InitDone);
                            if listed {
                                run.watching = true;
                                relist_wait = RELIST_MIN;
                            }
                            if run.pods.apply(event) {
                                run.publish();
                                if run.unconfirmed() {
                                    ask_at = Some(Instant::now());
                                }
                            }
                        }
                        // 410 Gone: the watch's resource version was compacted away, a
                        // routine event. List again at once, and count nothing.
                        Some(Err(watcher::Error::WatchError(status))) if status.code == 410 => {
                            tracing::debug!(source = NAME, "watch expired (410): listing again");
                            watch = None;
                            relist_at = Some(Instant::now());
                        }
                        Some(Err(error)) => {
                            let e = KubeError::Watch {
                                target: target.clone(),
                                selector: self.selector.clone(),
                                error,
                            };
                            run.publisher.report_error(NAME, &e);
                            run.watching = false;
                            watch = None;
                            relist_at = Some(Instant::now() + relist_wait);
                            relist_wait = (relist_wait * 2).min(RELIST_MAX);
                        }
                        // The watcher's stream does not end; should it, list again.
                        None => {
                            watch = None;
                            relist_at = Some(Instant::now() + relist_wait);
                        }
                    }
                }
                _ = sleep_until(relist_at) => {
                    relist_at = None;
                    watch = Some(new_watch());
                }
                _ = sleep_until(ask_at), if asking.is_none() => {
                    ask_at = None;
                    // Nodes that answered before first: CLUSTER SHARDS asks them in turn.
                    let mut nodes: Vec<PodNode> = run.pods.nodes.values().copied().collect();
                    nodes.sort_by_key(|p| !run.known.confirmed(p));
                    if !nodes.is_empty() {
                        let dial = discovery::dial(self.timeout, self.tls.as_ref());
                        let round = ask(nodes, self.resolver.clone(), dial);
                        asking = Some(tokio::spawn(round));
                    }
                }
                answers = join(&mut asking) => {
                    asking = None;
                    if let Ok(answers) = answers {
                        run.learn(answers);
                        run.publish();
                    }
                    let wait = if run.unconfirmed() {
                        let wait = ask_retry;
                        ask_retry = (ask_retry * 2).min(self.refresh);
                        wait
                    } else {
                        ask_retry = ASK_RETRY_MIN;
                        self.refresh
                    };
                    let next = Instant::now() + wait;
                    ask_at = Some(ask_at.map_or(next, |at| at.min(next)));
                }
                _ = refresh_requested.notified() => {
                    tracing::info!(source = NAME, "a reply named an unknown node: asking the nodes");
                    let soon = Instant::now() + MIN_REFRESH;
                    ask_at = Some(ask_at.map_or(soon, |at| at.min(soon)));
                }
            }
        }
        if let Some(task) = asking {
            task.abort();
        }
    }
}

/// The watch's next event; never, while there is no watch.
async fn next_event<S: Stream + Unpin>(watch: &mut Option<S>) -> Option<S::Item> {
    match watch {
        Some(stream) => stream.next().await,
        None => pending().await,
    }
}

/// At `at`; never, for `None`.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => pending().await,
    }
}

/// The task's result; never, while there is none.
async fn join<T>(task: &mut Option<JoinHandle<T>>) -> Result<T, JoinError> {
    match task {
        Some(task) => task.await,
        None => pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Container, ContainerPort, PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
    use shardgate_admin_client::NodeView;

    /// The operator's pod of node (s, n) of `vc`, at `ip` (if any).
    fn pod(name: &str, s: &str, n: &str, ip: Option<&str>) -> Pod {
        let labels = [
            (labels::MANAGED_BY, labels::MANAGED_BY_VALUE),
            (labels::INSTANCE, "vc"),
            (labels::SHARD_INDEX, s),
            (labels::NODE_INDEX, n),
        ];
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                ..Default::default()
            },
            spec: None,
            status: Some(PodStatus {
                pod_ip: ip.map(str::to_string),
                ..Default::default()
            }),
        }
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_labelled_pod_with_an_ip_is_its_node_at_6379() {
        let p = pod_node(&pod("vc-1-0-0", "1", "0", Some("10.1.2.3"))).unwrap();
        assert_eq!(p.node, NodeRef::new(1, 0));
        assert_eq!(p.addr, addr("10.1.2.3:6379"));
        let v6 = pod_node(&pod("vc-0-1-0", "0", "1", Some("fd00::7"))).unwrap();
        assert_eq!(v6.addr, addr("[fd00::7]:6379"));
    }

    #[test]
    fn the_named_container_port_wins() {
        let mut p = pod("vc-2-1-0", "2", "1", Some("10.0.0.9"));
        p.spec = Some(PodSpec {
            containers: vec![Container {
                name: "valkey".into(),
                ports: Some(vec![
                    ContainerPort {
                        name: Some("bus".into()),
                        container_port: 16380,
                        ..Default::default()
                    },
                    ContainerPort {
                        name: Some("vk-2-1".into()),
                        container_port: 6380,
                        ..Default::default()
                    },
                ]),
                ..Default::default()
            }],
            ..Default::default()
        });
        assert_eq!(pod_node(&p).unwrap().addr, addr("10.0.0.9:6380"));
    }

    #[test]
    fn pods_that_are_not_nodes_are_left_out_with_the_reason() {
        let mut no_node_label = pod("proxy", "0", "0", Some("10.0.0.1"));
        if let Some(l) = no_node_label.metadata.labels.as_mut() {
            l.remove(labels::NODE_INDEX);
        }
        let mut deleting = pod("vc-0-0-0", "0", "0", Some("10.0.0.1"));
        deleting.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::now()));
        let mut no_status = pod("vc-0-0-0", "0", "0", None);
        no_status.status = None;
        for (p, want) in [
            (no_node_label, NotANode::NoIndexLabels),
            (deleting, NotANode::Deleting),
            (pod("vc-0-0-0", "0", "0", None), NotANode::NoIp),
            (pod("vc-0-0-0", "0", "0", Some("")), NotANode::NoIp),
            (no_status, NotANode::NoIp),
            (
                pod("vc-0-0-0", "0", "zero", Some("10.0.0.1")),
                NotANode::BadLabel(labels::NODE_INDEX, "zero".into()),
            ),
            (
                pod("vc-0-0-0", "-1", "0", Some("10.0.0.1")),
                NotANode::BadLabel(labels::SHARD_INDEX, "-1".into()),
            ),
            (
                pod("vc-0-0-0", "0", "0", Some("pod-a")),
                NotANode::BadIp("pod-a".into()),
            ),
        ] {
            assert_eq!(pod_node(&p), Err(want));
        }
    }

    fn nodes(pods: &[(&str, u32, u32, &str)]) -> BTreeMap<String, PodNode> {
        pods.iter()
            .map(|(name, s, n, a)| {
                (
                    name.to_string(),
                    PodNode {
                        node: NodeRef::new(*s, *n),
                        addr: addr(a),
                    },
                )
            })
            .collect()
    }

    #[test]
    fn listener_ports_are_base_plus_shard_times_ports_per_shard_plus_node() {
        let pods = nodes(&[
            ("vc-0-0-0", 0, 0, "10.0.0.1:6379"),
            ("vc-0-1-0", 0, 1, "10.0.0.2:6379"),
            ("vc-2-1-0", 2, 1, "10.0.0.6:6379"),
        ]);
        let mut table = Table::new(31000, Some(3), true);
        let (routes, skipped) = table.routes(&pods, &Known::default());
        assert!(skipped.is_empty(), "{skipped:?}");
        let ports: Vec<u16> = routes.keys().copied().collect();
        assert_eq!(ports, [31000, 31001, 31007]);
        let r = &routes[&31007];
        assert_eq!(r.node, NodeRef::new(2, 1));
        assert_eq!(r.backend.to_string(), "10.0.0.6:6379");
        assert!(r.rewrite && !r.primary && r.node_id.is_none());
        assert!(
            routes[&31000].primary,
            "node 0 until the nodes say otherwise"
        );

        // Without --ports-per-shard: the first table's largest node index + 1, then fixed.
        let mut table = Table::new(31000, None, false);
        let (routes, _) = table.routes(&pods, &Known::default());
        assert_eq!(
            routes.keys().copied().collect::<Vec<_>>(),
            [31000, 31001, 31005]
        );
        let more = nodes(&[("vc-1-2-0", 1, 2, "10.0.0.9:6379")]);
        let (routes, skipped) = table.routes(&more, &Known::default());
        assert!(routes.is_empty());
        assert_eq!(
            skipped,
            ["pod vc-1-2-0 (node 1-2): node index 2 is out of range (a shard has 2 ports)"]
        );
    }

    #[test]
    fn a_pod_past_the_last_port_or_a_second_pod_of_a_node_is_left_out_alone() {
        let pods = nodes(&[
            ("a", 0, 0, "10.0.0.1:6379"),
            ("b", 0, 0, "10.0.0.2:6379"),
            ("c", 3, 0, "10.0.0.3:6379"),
        ]);
        let (routes, skipped) = Table::new(65530, Some(2), false).routes(&pods, &Known::default());
        assert_eq!(routes.len(), 1);
        assert_eq!(routes[&65530].backend.to_string(), "10.0.0.1:6379");
        assert_eq!(skipped.len(), 2, "{skipped:?}");
        assert_eq!(skipped[0], "pod b: node 0-0 is pod a");
        assert!(skipped[1].contains("past 65535"), "{skipped:?}");
    }

    #[test]
    fn ids_and_roles_come_from_the_nodes_and_outlive_a_move() {
        let id = |c: char| std::iter::repeat_n(c, 40).collect::<String>();
        let mut known = Known::default();
        known
            .ids
            .insert(NodeRef::new(0, 0), (addr("10.0.0.1:6379"), id('a')));
        known
            .ids
            .insert(NodeRef::new(0, 1), (addr("10.0.0.2:6379"), id('b')));
        let view = |id: String, primary| NodeView {
            id,
            ip: String::new(),
            endpoint: None,
            hostname: None,
            port: Some(6379),
            tls_port: None,
            primary,
            health: "online".into(),
            replication_offset: None,
        };
        // After a failover: node 1 is the primary.
        known.roles_from(&[ShardView {
            id: None,
            slots: vec![(0, 16383)],
            nodes: vec![view(id('a'), false), view(id('b'), true)],
        }]);
        // Node 1's pod moved; it has not answered at its new address yet.
        let pods = nodes(&[("p0", 0, 0, "10.0.0.1:6379"), ("p1", 0, 1, "10.0.0.9:6379")]);
        let (routes, _) = Table::new(30000, Some(2), true).routes(&pods, &known);
        let (r0, r1) = (&routes[&30000], &routes[&30001]);
        assert_eq!(r0.node_id.as_deref(), Some(id('a').as_str()));
        assert!(!r0.primary && r0.slots.is_empty());
        assert_eq!(r1.node_id.as_deref(), Some(id('b').as_str()));
        assert_eq!(r1.backend.to_string(), "10.0.0.9:6379");
        assert!(r1.primary && r1.slots == [(0, 16383)]);
        assert!(known.confirmed(&pods["p0"]) && !known.confirmed(&pods["p1"]));
    }

    #[test]
    fn watch_events_keep_the_pod_set() {
        let mut pods = Pods::default();
        assert!(!pods.apply(Event::Init));
        assert!(!pods.apply(Event::InitApply(pod("a", "0", "0", Some("10.0.0.1")))));
        assert!(!pods.apply(Event::InitApply(pod("b", "0", "1", None))));
        assert!(
            !pods.listed && pods.nodes.is_empty(),
            "nothing before the list ends"
        );
        assert!(pods.apply(Event::InitDone));
        assert!(pods.listed);
        assert_eq!(pods.nodes.keys().collect::<Vec<_>>(), ["a"]);
        // b gets its IP; a moves; the same again is no change.
        assert!(pods.apply(Event::Apply(pod("b", "0", "1", Some("10.0.0.2")))));
        assert!(pods.apply(Event::Apply(pod("a", "0", "0", Some("10.0.0.3")))));
        assert!(!pods.apply(Event::Apply(pod("a", "0", "0", Some("10.0.0.3")))));
        assert_eq!(pods.nodes["a"].addr, addr("10.0.0.3:6379"));
        // a starts being deleted: no longer routed; then gone.
        let mut deleting = pod("a", "0", "0", Some("10.0.0.3"));
        deleting.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::now()));
        assert!(pods.apply(Event::Apply(deleting.clone())));
        assert!(!pods.apply(Event::Delete(deleting)));
        assert!(pods.apply(Event::Delete(pod("b", "0", "1", Some("10.0.0.2")))));
        assert!(pods.nodes.is_empty());
        // A relist replaces the set whole: what it does not show is gone.
        pods.apply(Event::Apply(pod("c", "1", "0", Some("10.0.0.4"))));
        pods.apply(Event::Init);
        pods.apply(Event::InitApply(pod("d", "1", "1", Some("10.0.0.5"))));
        assert!(pods.nodes.contains_key("c"), "kept until the list ends");
        assert!(pods.apply(Event::InitDone));
        assert_eq!(pods.nodes.keys().collect::<Vec<_>>(), ["d"]);
    }
}
