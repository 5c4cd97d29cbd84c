//! Routes discovered from a seed node with `CLUSTER SHARDS`, refreshed periodically.
//!
//! Flat indices are deterministic and sticky: the first discovery orders shards by their
//! lowest slot and nodes by role (primary first) then node id; later refreshes keep every
//! known node on its port, so a failover or a restart never renumbers the listeners, and new
//! nodes take the lowest free index of their shard.
//!
//! Seed mode needs nodes that announce addresses the proxy can reach (Valkey's default). In
//! the announce mode of the design the nodes announce the proxy's own address; discovery then
//! finds the proxy itself, which the publisher refuses: give such routes in a file.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use redis_protocol::resp2::decode::decode;
use redis_protocol::resp2::types::OwnedFrame;
use shardgate_crds::{NodeRef, PortLayout};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::resolve::Resolver;
use crate::resp::{Scan, Scanner};
use crate::route::{Backend, Route, RoutePublisher, RouteSource, Routes};

/// The largest `CLUSTER SHARDS` reply accepted (a 1000-node cluster is well under 1 MiB).
const MAX_REPLY: usize = 16 << 20;

/// Why discovery failed.
#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    #[error("no seed answered CLUSTER SHARDS: {0}")]
    NoSeed(String),
    #[error("{addr}: {message}")]
    Node { addr: String, message: String },
    #[error("CLUSTER SHARDS reply: {0}")]
    Reply(String),
    #[error("port layout: {0}")]
    Ports(#[from] shardgate_crds::PortError),
}

/// A node as `CLUSTER SHARDS` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveredNode {
    pub id: String,
    pub ip: String,
    pub port: Option<u16>,
    pub tls_port: Option<u16>,
    pub primary: bool,
    pub health: String,
    /// `cluster-announce-hostname`, if set.
    pub hostname: Option<String>,
}

/// A shard as `CLUSTER SHARDS` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveredShard {
    pub id: Option<String>,
    pub slots: Vec<(u16, u16)>,
    pub nodes: Vec<DiscoveredNode>,
}

impl DiscoveredShard {
    /// A stable key: the shard id, or (before Valkey 7.2) its lowest node id.
    fn key(&self) -> String {
        self.id.clone().unwrap_or_else(|| {
            self.nodes
                .iter()
                .map(|n| n.id.clone())
                .min()
                .unwrap_or_default()
        })
    }
}

/// Asks one node for `CLUSTER SHARDS`.
pub async fn cluster_shards(
    addr: SocketAddr,
    timeout: Duration,
) -> Result<Vec<DiscoveredShard>, SeedError> {
    let node_err = |message: String| SeedError::Node {
        addr: addr.to_string(),
        message,
    };
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| node_err(format!("connect: {e}")))?;
        stream
            .write_all(b"*2\r\n$7\r\nCLUSTER\r\n$6\r\nSHARDS\r\n")
            .await
            .map_err(|e| node_err(format!("write: {e}")))?;
        let mut buf = BytesMut::with_capacity(16 * 1024);
        // Our scanner finds the reply's end first: it bounds nesting (redis-protocol's
        // decoder recurses without a limit, and a deep reply would overflow the stack) and
        // resumes where it stopped, so the decoder runs once, on a complete reply.
        let mut scanner = Scanner::default();
        let mut scanned = 0;
        loop {
            if scanned < buf.len() {
                match scanner.scan(&buf, scanned) {
                    Ok(Scan::Complete { .. }) => {
                        return match decode(&buf) {
                            Ok(Some((frame, _))) => Ok(frame),
                            Ok(None) => Err(node_err("incomplete reply".into())),
                            Err(e) => Err(node_err(format!("malformed reply: {e}"))),
                        };
                    }
                    Ok(Scan::Incomplete) => scanned = buf.len(),
                    Err(e) => return Err(node_err(format!("malformed reply: {e}"))),
                }
            }
            if buf.len() > MAX_REPLY {
                return Err(node_err(format!("reply larger than {MAX_REPLY} bytes")));
            }
            let n = stream
                .read_buf(&mut buf)
                .await
                .map_err(|e| node_err(format!("read: {e}")))?;
            if n == 0 {
                return Err(node_err("closed the connection before replying".into()));
            }
        }
    };
    let frame = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| node_err(format!("no reply within {timeout:?}")))??;
    parse_shards(frame).map_err(|e| match e {
        SeedError::Reply(m) => node_err(m),
        other => other,
    })
}

fn text(f: &OwnedFrame) -> Option<String> {
    match f {
        OwnedFrame::BulkString(b) | OwnedFrame::SimpleString(b) => {
            Some(String::from_utf8_lossy(b).into_owned())
        }
        OwnedFrame::Integer(i) => Some(i.to_string()),
        _ => None,
    }
}

fn int(f: &OwnedFrame) -> Option<i64> {
    match f {
        OwnedFrame::Integer(i) => Some(*i),
        other => text(other)?.parse().ok(),
    }
}

/// The key/value pairs of a RESP2 flat map.
fn pairs(f: &OwnedFrame) -> Result<Vec<(String, &OwnedFrame)>, SeedError> {
    let OwnedFrame::Array(items) = f else {
        return Err(SeedError::Reply(
            "expected an array of key/value pairs".into(),
        ));
    };
    if items.len() % 2 != 0 {
        return Err(SeedError::Reply("odd number of elements in a map".into()));
    }
    items
        .chunks(2)
        .map(|kv| {
            let key = text(&kv[0]).ok_or_else(|| SeedError::Reply("non-string map key".into()))?;
            Ok((key, &kv[1]))
        })
        .collect()
}

/// Parses a RESP2 `CLUSTER SHARDS` reply.
pub fn parse_shards(frame: OwnedFrame) -> Result<Vec<DiscoveredShard>, SeedError> {
    let shards = match frame {
        OwnedFrame::Array(shards) => shards,
        OwnedFrame::Error(e) => return Err(SeedError::Reply(format!("error reply: {e}"))),
        _ => return Err(SeedError::Reply("expected an array of shards".into())),
    };
    let port = |f: &OwnedFrame| {
        int(f)
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p > 0)
    };
    let mut out = Vec::with_capacity(shards.len());
    for shard in &shards {
        let mut s = DiscoveredShard {
            id: None,
            slots: vec![],
            nodes: vec![],
        };
        for (key, value) in pairs(shard)? {
            match key.as_str() {
                "id" => s.id = text(value),
                "slots" => {
                    let OwnedFrame::Array(bounds) = value else {
                        return Err(SeedError::Reply("slots is not an array".into()));
                    };
                    let bounds: Vec<u16> = bounds
                        .iter()
                        .map(|b| int(b).and_then(|v| u16::try_from(v).ok()))
                        .collect::<Option<_>>()
                        .ok_or_else(|| SeedError::Reply("bad slot number".into()))?;
                    s.slots = bounds.chunks_exact(2).map(|r| (r[0], r[1])).collect();
                }
                "nodes" => {
                    let OwnedFrame::Array(nodes) = value else {
                        return Err(SeedError::Reply("nodes is not an array".into()));
                    };
                    for node in nodes {
                        let mut n = DiscoveredNode {
                            id: String::new(),
                            ip: String::new(),
                            port: None,
                            tls_port: None,
                            primary: false,
                            health: String::new(),
                            hostname: None,
                        };
                        for (k, v) in pairs(node)? {
                            match k.as_str() {
                                "id" => n.id = text(v).unwrap_or_default(),
                                "ip" => n.ip = text(v).unwrap_or_default(),
                                "port" => n.port = port(v),
                                "tls-port" => n.tls_port = port(v),
                                "role" => n.primary = text(v).as_deref() == Some("master"),
                                "health" => n.health = text(v).unwrap_or_default(),
                                "hostname" => n.hostname = text(v).filter(|h| !h.is_empty()),
                                _ => {}
                            }
                        }
                        if n.id.is_empty() {
                            return Err(SeedError::Reply("a node without id".into()));
                        }
                        s.nodes.push(n);
                    }
                }
                _ => {}
            }
        }
        out.push(s);
    }
    Ok(out)
}

/// Sticky (shard, node) indices across refreshes.
#[derive(Debug, Default)]
pub struct Assignment {
    stride: Option<u32>,
    shards: HashMap<String, u32>,
    nodes: HashMap<String, NodeRef>,
}

impl Assignment {
    /// Places every node; returns the placed nodes and what could not be placed.
    pub fn assign<'a>(
        &mut self,
        ports_per_shard: Option<u32>,
        shards: &'a [DiscoveredShard],
    ) -> (Vec<(NodeRef, &'a DiscoveredNode)>, Vec<String>) {
        let stride = *self.stride.get_or_insert_with(|| {
            ports_per_shard
                .unwrap_or_else(|| {
                    shards
                        .iter()
                        .map(|s| s.nodes.len() as u32)
                        .max()
                        .unwrap_or(1)
                })
                .max(1)
        });
        // First-time order: by lowest slot, slotless shards last.
        let mut order: Vec<&DiscoveredShard> = shards.iter().collect();
        order.sort_by_key(|s| {
            (
                s.slots
                    .iter()
                    .map(|r| r.0)
                    .min()
                    .map_or(u32::MAX, u32::from),
                s.key(),
            )
        });
        let mut placed = vec![];
        let mut skipped = vec![];
        for shard in order {
            let key = shard.key();
            let next_shard = self.shards.values().map(|s| s + 1).max().unwrap_or(0);
            let s = *self.shards.entry(key).or_insert(next_shard);
            let mut nodes: Vec<&DiscoveredNode> = shard.nodes.iter().collect();
            nodes.sort_by(|a, b| b.primary.cmp(&a.primary).then(a.id.cmp(&b.id)));
            let mut used: Vec<u32> = nodes
                .iter()
                .filter_map(|n| self.nodes.get(&n.id))
                .filter(|r| r.shard.0 == s)
                .map(|r| r.node.0)
                .collect();
            for node in nodes {
                let known = self.nodes.get(&node.id).filter(|r| r.shard.0 == s).copied();
                let r = match known {
                    Some(r) => r,
                    None => match (0..stride).find(|i| !used.contains(i)) {
                        Some(i) => {
                            used.push(i);
                            let r = NodeRef::new(s, i);
                            self.nodes.insert(node.id.clone(), r);
                            r
                        }
                        None => {
                            skipped.push(format!(
                                "node {} of shard {s}: no free port (ports per shard: {stride})",
                                node.id
                            ));
                            continue;
                        }
                    },
                };
                placed.push((r, node));
            }
        }
        (placed, skipped)
    }

    pub fn stride(&self) -> Option<u32> {
        self.stride
    }
}

/// Discovers the cluster from seed nodes.
pub struct SeedSource {
    rewrite: bool,
    seeds: Vec<Backend>,
    base_port: u16,
    ports_per_shard: Option<u32>,
    interval: Duration,
    timeout: Duration,
    resolver: Resolver,
    assignment: Assignment,
}

impl SeedSource {
    pub fn new(
        seeds: Vec<Backend>,
        base_port: u16,
        ports_per_shard: Option<u32>,
        interval: Duration,
        timeout: Duration,
        resolver: Resolver,
        rewrite: bool,
    ) -> Self {
        SeedSource {
            rewrite,
            seeds,
            base_port,
            ports_per_shard,
            interval,
            timeout,
            resolver,
            assignment: Assignment::default(),
        }
    }

    /// Asks the seeds, then the nodes of the table in force, until one answers.
    async fn discover(&self, known: &Routes) -> Result<Vec<DiscoveredShard>, SeedError> {
        let mut candidates: Vec<Backend> = self.seeds.clone();
        for r in known.values() {
            if !candidates.contains(&r.backend) {
                candidates.push(r.backend.clone());
            }
        }
        let mut errors = vec![];
        for seed in &candidates {
            let addrs = match self.resolver.resolve(seed).await {
                Ok(a) => a,
                Err(e) => {
                    errors.push(e.to_string());
                    continue;
                }
            };
            for addr in addrs {
                match cluster_shards(addr, self.timeout).await {
                    Ok(shards) if !shards.is_empty() => return Ok(shards),
                    Ok(_) => errors.push(format!("{addr}: no shards (cluster not formed?)")),
                    Err(e) => errors.push(e.to_string()),
                }
            }
        }
        Err(SeedError::NoSeed(errors.join("; ")))
    }

    /// One discovery → routes.
    async fn refresh(&mut self, known: &Routes) -> Result<(Routes, Vec<String>), SeedError> {
        let shards = self.discover(known).await?;
        let (placed, mut skipped) = self.assignment.assign(self.ports_per_shard, &shards);
        let stride = self.assignment.stride().unwrap_or(1);
        let shard_count = placed.iter().map(|(r, _)| r.shard.0 + 1).max().unwrap_or(1);
        let layout = PortLayout::new(
            u32::from(self.base_port),
            shard_count,
            stride - 1,
            Some(stride),
        )?;
        // A primary serves its shard's slots.
        let slots_of: HashMap<&str, &[(u16, u16)]> = shards
            .iter()
            .flat_map(|s| {
                s.nodes
                    .iter()
                    .filter(|n| n.primary)
                    .map(|n| (n.id.as_str(), s.slots.as_slice()))
            })
            .collect();
        let mut routes = BTreeMap::new();
        for (r, node) in placed {
            let Some(port) = node.port.or(node.tls_port) else {
                skipped.push(format!("node {}: no port announced", node.id));
                continue;
            };
            let backend = match format!("{}:{port}", node.ip).parse::<Backend>() {
                Ok(b) if !node.ip.is_empty() => b,
                _ => {
                    skipped.push(format!("node {}: no usable ip ({:?})", node.id, node.ip));
                    continue;
                }
            };
            routes.insert(
                layout.port(r)?,
                Arc::new(Route {
                    node: r,
                    backend,
                    node_id: Some(node.id.clone()),
                    hostname: node.hostname.clone(),
                    rewrite: self.rewrite,
                    primary: node.primary,
                    tls_backend: match (node.port, node.tls_port) {
                        (Some(_), Some(tls)) => format!("{}:{tls}", node.ip).parse().ok(),
                        _ => None,
                    },
                    slots: slots_of
                        .get(node.id.as_str())
                        .map(|s| s.to_vec())
                        .unwrap_or_default(),
                }),
            );
        }
        Ok((routes, skipped))
    }
}

impl RouteSource for SeedSource {
    fn name(&self) -> &'static str {
        "seed"
    }

    async fn run(mut self, publisher: RoutePublisher, shutdown: CancellationToken) {
        let name = self.name();
        let mut backoff = Duration::from_millis(250);
        let refresh = publisher.refresh_requests();
        loop {
            let known = publisher.current().routes.clone();
            let wait = match self.refresh(&known).await {
                Ok((routes, skipped)) => {
                    for s in skipped {
                        tracing::warn!(source = name, "not routed: {s}");
                    }
                    if let Err(e) = publisher.publish(name, routes) {
                        publisher.report_error(name, &e);
                    }
                    backoff = Duration::from_millis(250);
                    self.interval
                }
                Err(e) => {
                    publisher.report_error(name, &e);
                    backoff = (backoff * 2).min(self.interval);
                    backoff
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
                // A rewriter met an unknown address: look again now, but not more than
                // once per MIN_REFRESH, whatever the rate of unknown addresses.
                _ = refresh.notified() => {
                    tracing::info!(source = name, "refresh requested: a reply named an unknown node");
                    tokio::time::sleep(MIN_REFRESH).await;
                }
            }
        }
    }
}

/// The shortest time between two refreshes asked for by rewriters.
const MIN_REFRESH: Duration = Duration::from_millis(500);

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, primary: bool) -> DiscoveredNode {
        DiscoveredNode {
            id: id.into(),
            ip: "10.0.0.1".into(),
            port: Some(6379),
            tls_port: None,
            primary,
            health: "online".into(),
            hostname: None,
        }
    }

    fn shard(id: &str, first_slot: u16, nodes: Vec<DiscoveredNode>) -> DiscoveredShard {
        DiscoveredShard {
            id: Some(id.into()),
            slots: vec![(first_slot, first_slot + 10)],
            nodes,
        }
    }

    fn placed(a: &mut Assignment, shards: &[DiscoveredShard]) -> Vec<(String, NodeRef)> {
        let (p, _) = a.assign(None, shards);
        let mut v: Vec<_> = p.into_iter().map(|(r, n)| (n.id.clone(), r)).collect();
        v.sort();
        v
    }

    #[test]
    fn first_discovery_orders_by_slot_then_primary_first() {
        let shards = vec![
            shard("s-b", 100, vec![node("b2", false), node("b1", true)]),
            shard("s-a", 0, vec![node("a1", true), node("a2", false)]),
        ];
        let got = placed(&mut Assignment::default(), &shards);
        assert_eq!(
            got,
            vec![
                ("a1".into(), NodeRef::new(0, 0)),
                ("a2".into(), NodeRef::new(0, 1)),
                ("b1".into(), NodeRef::new(1, 0)),
                ("b2".into(), NodeRef::new(1, 1)),
            ]
        );
    }

    #[test]
    fn failover_and_reorder_keep_every_port() {
        let mut a = Assignment::default();
        let before = placed(
            &mut a,
            &[
                shard("s-a", 0, vec![node("a1", true), node("a2", false)]),
                shard("s-b", 100, vec![node("b1", true), node("b2", false)]),
            ],
        );
        // a2 took over; the reply lists shards in another order.
        let after = placed(
            &mut a,
            &[
                shard("s-b", 100, vec![node("b2", false), node("b1", true)]),
                shard("s-a", 0, vec![node("a2", true), node("a1", false)]),
            ],
        );
        assert_eq!(before, after);
    }

    #[test]
    fn new_nodes_take_free_indices_and_overflow_is_reported() {
        let mut a = Assignment::default();
        placed(
            &mut a,
            &[shard("s-a", 0, vec![node("a1", true), node("a2", false)])],
        );
        // a2 is gone, a3 joins: it takes a2's free index.
        let got = placed(
            &mut a,
            &[shard("s-a", 0, vec![node("a1", true), node("a3", false)])],
        );
        assert_eq!(got[1], ("a3".into(), NodeRef::new(0, 1)));
        // A third node has no port left (stride 2 from the first discovery).
        let three = [shard(
            "s-a",
            0,
            vec![node("a1", true), node("a3", false), node("a4", false)],
        )];
        let (p, skipped) = a.assign(None, &three);
        assert_eq!(p.len(), 2);
        assert!(skipped[0].contains("a4"), "{skipped:?}");
    }

    #[test]
    fn parses_a_real_resp2_reply() {
        // Shape of shared/reference c1 CLUSTER SHARDS (RESP2), trimmed to one shard.
        let bytes = b"*1\r\n*6\r\n$5\r\nslots\r\n*2\r\n:0\r\n:5460\r\n$5\r\nnodes\r\n*1\r\n*14\r\n$2\r\nid\r\n$40\r\na539d95fb51874a91ad88b8f1c379041378f6000\r\n$4\r\nport\r\n:6379\r\n$2\r\nip\r\n$10\r\n127.0.10.1\r\n$8\r\nendpoint\r\n$10\r\n127.0.10.1\r\n$4\r\nrole\r\n$6\r\nmaster\r\n$18\r\nreplication-offset\r\n:182\r\n$6\r\nhealth\r\n$6\r\nonline\r\n$2\r\nid\r\n$40\r\n4cba700fee4546bb08302528fb68a37194ccf1ac\r\n";
        let (frame, len) = decode(bytes).unwrap().unwrap();
        assert_eq!(len, bytes.len());
        let shards = parse_shards(frame).unwrap();
        assert_eq!(shards.len(), 1);
        assert_eq!(shards[0].slots, vec![(0, 5460)]);
        assert_eq!(
            shards[0].id.as_deref(),
            Some("4cba700fee4546bb08302528fb68a37194ccf1ac")
        );
        let n = &shards[0].nodes[0];
        assert_eq!(
            (n.ip.as_str(), n.port, n.primary),
            ("127.0.10.1", Some(6379), true)
        );
    }

    #[tokio::test]
    async fn a_deeply_nested_reply_is_an_error_not_a_stack_overflow() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut deep = b"*1\r\n".repeat(20_000);
            deep.extend_from_slice(b":1\r\n");
            let _ = s.write_all(&deep).await;
            // Keep the connection open until the client gives up.
            let mut b = [0u8; 64];
            let _ = s.read(&mut b).await;
        });
        let err = cluster_shards(addr, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("nested deeper"), "{err}");
    }

    #[test]
    fn bad_replies_are_errors() {
        for frame in [
            OwnedFrame::Error("ERR This instance has cluster support disabled".into()),
            OwnedFrame::Integer(3),
            OwnedFrame::Array(vec![OwnedFrame::Integer(1)]),
            OwnedFrame::Array(vec![OwnedFrame::Array(vec![OwnedFrame::Null])]),
        ] {
            assert!(parse_shards(frame).is_err());
        }
    }
}
