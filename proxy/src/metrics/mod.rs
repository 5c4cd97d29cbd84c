//! Prometheus metrics, one struct per concern, each registering itself.
//!
//! Per-connection counters are fetched once when the connection starts (a `Family` lookup
//! takes a lock), so the byte counting on the copy path is one atomic add per read, to a
//! slot of the thread's own ([`per_thread`]).

mod per_thread;

pub use per_thread::PerThreadCounter;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PortLabels {
    pub port: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BytesLabels {
    pub port: u16,
    /// `to_backend` or `to_client`.
    pub direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub port: u16,
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    pub source: &'static str,
}

/// Connections and bytes.
#[derive(Default)]
pub struct ConnectionMetrics {
    pub accepted: Family<PortLabels, Counter>,
    pub active: Family<PortLabels, Gauge>,
    pub rejected: Family<ReasonLabels, Counter>,
    pub closed: Family<ReasonLabels, Counter>,
    pub bytes: Family<BytesLabels, PerThreadCounter>,
    pub backend_errors: Family<KindLabels, Counter>,
}

/// Route tables and listeners.
#[derive(Default)]
pub struct RouteMetrics {
    pub version: Gauge,
    pub updates: Counter,
    pub source_errors: Family<SourceLabels, Counter>,
    /// 1 while the source's last fetch succeeded, 0 while it fails (and before its first).
    pub source_up: Family<SourceLabels, Gauge>,
    pub listeners: Gauge,
    pub listener_errors: Counter,
    /// 1 while the table in force is stale: the source's last fetch failed, or was refused.
    pub stale: Gauge,
    /// Fetches the source finished, failed or not: what a test waits on to know that the
    /// source has looked again.
    pub fetches: Family<SourceLabels, Counter>,
    /// Seed discovery: nodes' answers not used, by reason (`no_slots`, `state_fail`, `older`).
    pub views_refused: Family<ReasonLabels, Counter>,
}

impl RouteMetrics {
    /// Shows `source`'s error count from the start (0), so that a scrape tells "no errors"
    /// from "no such source".
    pub fn source_started(&self, source: &'static str) {
        let _ = self.source_errors.get_or_create(&SourceLabels { source });
        let _ = self.source_up.get_or_create(&SourceLabels { source });
        let _ = self.fetches.get_or_create(&SourceLabels { source });
    }

    pub fn source_up(&self, source: &'static str, up: bool) {
        self.fetches.get_or_create(&SourceLabels { source }).inc();
        self.source_up
            .get_or_create(&SourceLabels { source })
            .set(i64::from(up));
    }

    pub fn source_error(&self, source: &'static str) {
        self.source_errors
            .get_or_create(&SourceLabels { source })
            .inc();
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RewriteLabels {
    /// `moved`, `ask`, `cluster_slots`, ...
    pub kind: &'static str,
}

/// Topology rewriting.
#[derive(Default)]
pub struct RewriteMetrics {
    pub replies: Family<RewriteLabels, Counter>,
    pub unknown_addresses: Counter,
    pub protocol_errors: Family<ReasonLabels, Counter>,
    /// Replies paired with a topology command but not of its exact shape, forwarded byte
    /// for byte, by reason (`not_cluster_nodes`, `exec_length`, ...).
    pub skipped: Family<ReasonLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TlsVersionLabels {
    /// `TLSv1_2`, `TLSv1_3`.
    pub version: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TlsTargetLabels {
    /// `node`, `shard`, `bootstrap`.
    pub target: &'static str,
}

/// The TLS port.
#[derive(Default)]
pub struct TlsMetrics {
    /// Connections refused before any backend was dialled, by reason.
    pub refused: Family<ReasonLabels, Counter>,
    /// Connections routed, by what their SNI name names.
    pub routed: Family<TlsTargetLabels, Counter>,
    /// Completed TLS handshakes (termination), by version.
    pub handshakes: Family<TlsVersionLabels, Counter>,
    /// Certificate and key reloads, by result (`ok`, `error`).
    pub reloads: Family<ReasonLabels, Counter>,
    /// Reloads of the TLS legs to the nodes' files (`--tls-backend tls`), by result.
    pub backend_reloads: Family<ReasonLabels, Counter>,
}

impl TlsMetrics {
    pub fn refuse(&self, reason: &'static str) {
        self.refused.get_or_create(&ReasonLabels { reason }).inc();
    }
}

/// All of the proxy's metrics.
#[derive(Default)]
pub struct Metrics {
    pub connections: ConnectionMetrics,
    pub routes: RouteMetrics,
    pub rewrite: RewriteMetrics,
    pub tls: TlsMetrics,
}

impl Metrics {
    /// Registers everything under the `shardgate_proxy` prefix.
    pub fn register(self, registry: &mut Registry) -> Self {
        let r = registry.sub_registry_with_prefix("shardgate_proxy");
        let c = &self.connections;
        r.register(
            "connections_accepted",
            "Client connections accepted, per listener port",
            c.accepted.clone(),
        );
        r.register(
            "connections_active",
            "Client connections open now, per listener port",
            c.active.clone(),
        );
        r.register(
            "connections_rejected",
            "Client connections refused before any backend was dialled",
            c.rejected.clone(),
        );
        r.register(
            "connections_closed",
            "Client connections closed, by reason",
            c.closed.clone(),
        );
        r.register(
            "bytes",
            "Bytes forwarded, per listener port and direction",
            c.bytes.clone(),
        );
        r.register(
            "backend_errors",
            "Failures to reach or talk to a backend, per port and kind",
            c.backend_errors.clone(),
        );
        let t = &self.routes;
        r.register(
            "route_table_version",
            "Version of the route table in force (0: none loaded yet)",
            t.version.clone(),
        );
        r.register(
            "route_table_updates",
            "Route tables swapped in",
            t.updates.clone(),
        );
        r.register(
            "route_source_errors",
            "Route source failures (the table in force was kept)",
            t.source_errors.clone(),
        );
        r.register(
            "route_source_up",
            "Whether the route source's last fetch succeeded (1) or failed (0: the table in force is kept)",
            t.source_up.clone(),
        );
        r.register(
            "route_table_stale",
            "Whether the route table in force is stale (1: the source's last fetch failed or was refused, the last good table is kept)",
            t.stale.clone(),
        );
        r.register(
            "route_source_fetches",
            "Fetches the route source finished (whether they succeeded or not)",
            t.fetches.clone(),
        );
        r.register(
            "discovery_views_refused",
            "Seed discovery: nodes' answers not used (no slots, cluster_state fail, older epochs), per reason",
            t.views_refused.clone(),
        );
        r.register("listeners", "Listener ports bound now", t.listeners.clone());
        r.register(
            "listener_errors",
            "Listener ports that could not be bound or failed to accept",
            t.listener_errors.clone(),
        );
        let w = &self.rewrite;
        r.register(
            "rewritten_replies",
            "Replies whose topology was rewritten, per kind",
            w.replies.clone(),
        );
        r.register(
            "rewrite_unknown_addresses",
            "Addresses in replies that no route knows (forwarded unchanged; a refresh is asked for)",
            w.unknown_addresses.clone(),
        );
        r.register(
            "rewrite_skipped",
            "Replies paired with a topology command but not of its exact shape (forwarded unchanged), per reason",
            w.skipped.clone(),
        );
        r.register(
            "protocol_errors",
            "Connections closed because a stream was not valid RESP or broke a limit, per side",
            w.protocol_errors.clone(),
        );
        let t = &self.tls;
        r.register(
            "tls_refused",
            "TLS port: connections refused before any backend was dialled, by reason",
            t.refused.clone(),
        );
        r.register(
            "tls_routed",
            "TLS port: connections routed by their SNI name, by what it names",
            t.routed.clone(),
        );
        r.register(
            "tls_handshakes",
            "TLS port: handshakes completed by the proxy (termination), by TLS version",
            t.handshakes.clone(),
        );
        r.register(
            "tls_certificate_reloads",
            "TLS port: certificate/key reloads, by result",
            t.reloads.clone(),
        );
        r.register(
            "backend_tls_reloads",
            "Nodes over TLS: reloads of the CA and client certificate files, by result",
            t.backend_reloads.clone(),
        );
        self
    }
}
