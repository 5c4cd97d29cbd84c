//! What every reconcile shares: the API client, the event recorder, metrics and settings.

use std::sync::Arc;

use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::Client;
use shardgate_admin_client::Timeouts;
use shardgate_crds::valkey_cluster::ValkeyCluster;

use crate::client::ApiTimeouts;
use crate::external::gateway::GatewayApi;
use crate::metrics::Metrics;
use crate::per_cluster::{Counts, Warnings};

/// The field manager of every object the operator applies (server-side apply).
pub const FIELD_MANAGER: &str = "shardgate-operator";

/// The proxy image of this release (`--proxy-image`'s default).
pub const DEFAULT_PROXY_IMAGE: &str = "ghcr.io/shardgate/shardgate-proxy:0.1.0";

/// The one dependency seam of the reconciler.
#[derive(Clone)]
pub struct Context {
    /// For calls ([`crate::client::for_calls`]).
    pub client: Client,
    /// For the controller's watches ([`crate::client::for_watches`]); [`Context::new`] sets
    /// the calls' client here too.
    pub watch_client: Client,
    /// How often the watches are renewed ([`crate::client`]).
    pub api_timeouts: ApiTimeouts,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    /// How long the operator waits for a Valkey node.
    pub timeouts: Timeouts,
    /// Consecutive failures per cluster, for the retry backoff.
    pub backoff: Arc<Counts>,
    /// Consecutive looks per cluster with nodes that did not take on a renewed TLS
    /// Secret ([`crate::tls::reload`]).
    pub reload_behind: Arc<Counts>,
    /// Whether Gateway API is served: found by [`crate::run`] at start-up.
    pub gateway_api: GatewayApi,
    /// The warnings published per cluster, by reason: one Event when a condition starts,
    /// not one per reconcile while it lasts.
    pub warned: Arc<Warnings>,
    /// The controller's cache of clusters, once it runs: what is remembered per cluster is
    /// dropped when the cluster leaves it ([`Context::forget_gone`]).
    pub clusters: Option<Store<ValkeyCluster>>,
    /// The proxy's image in proxy mode, unless a cluster names its own.
    pub proxy_image: String,
}

impl Context {
    /// A context whose events are reported as `instance` of the operator, with one client
    /// for calls and watches.
    pub fn new(client: Client, metrics: Arc<Metrics>, instance: Option<String>) -> Self {
        let reporter = Reporter {
            controller: FIELD_MANAGER.into(),
            instance,
        };
        Context {
            recorder: Recorder::new(client.clone(), reporter),
            watch_client: client.clone(),
            api_timeouts: ApiTimeouts::default(),
            client,
            metrics,
            timeouts: Timeouts::default(),
            backoff: Default::default(),
            reload_behind: Default::default(),
            gateway_api: GatewayApi::Missing("not looked for yet".into()),
            warned: Default::default(),
            clusters: None,
            proxy_image: DEFAULT_PROXY_IMAGE.into(),
        }
    }
}
