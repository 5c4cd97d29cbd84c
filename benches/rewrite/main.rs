//! Reply-side rewrite throughput: shardgate's pipeline against a decode-then-re-encode proxy
//! built on redis-protocol, on the same bytes, arriving in the same 16 KiB reads.
//!
//! Cases (each reports bytes/s and replies/s from one measurement, criterion's
//! `Throughput::ElementsAndBytes`):
//! - `plain_get_set`: a pipelined GET/SET reply stream (`+OK`, `$-1`, values of 16, 128 and
//!   1024 bytes), nothing to rewrite; next to it `memchr_lf_count`, a bare
//!   `memchr_iter(b'\n', ..).count()` over the same bytes, the "memchr speed" reference;
//! - `request_side`: the other direction of that connection, the pipelined GETs and SETs
//!   observed by `RequestSide` (the reply benchmarks do this in their untimed setup), next to
//!   `memchr_lf_count` over the request bytes;
//! - `moved_storm`: `-MOVED <slot> <ip>:6379` for random slots of a 30-shard cluster, every one
//!   rewritten;
//! - `cluster_slots_resp2`, `cluster_shards_resp2`, `cluster_shards_resp3`,
//!   `cluster_nodes_resp2`: the replies of a cluster of 3, 30 and 300 shards (the benchmark
//!   parameter), each shard a primary and one replica (so 6, 60 and 600 nodes), node ids of 40
//!   hex digits, pod IPs `10.244.y.z`, port 6379, shaped byte for byte like the Valkey 9
//!   captures in shared/reference/valkey-topology-replies.md (sections 1.2–1.4). Each
//!   iteration is a pipeline of copies of the reply, at least 256 KiB (the 300-shard replies
//!   are larger than one read, so they are captured across reads); every node is rewritten.
//!
//! The contenders, per case:
//! - `shardgate`: as a rewriting connection runs it (proxy/src/forward.rs): the request side
//!   observes the pipelined commands (in the untimed setup: it is the other direction, and the
//!   baseline is given the reply kinds for free), then `ReplySide::process` takes the reply
//!   bytes in 16 KiB reads, a fresh `Report` per read. The output is produced by copying every
//!   segment into one reused `Vec` per read (a write buffer), which charges shardgate a copy
//!   the proxy itself does not make (it writes the segments straight from its read buffer);
//!   `shardgate_no_copy` (plain stream only) sums the segment lengths instead.
//! - `redis_protocol_owned`: `resp2::decode::decode` / `resp3::decode::complete::decode`
//!   frame by frame into `OwnedFrame`s, the address substitution as a plain walk over the
//!   decoded frame (topology replies and redirects only), then `encode` into a reused buffer.
//!   The reads are the same: a frame that does not end in the bytes read so far is decoded
//!   again from its start once the next read is in, as redis-protocol requires.
//! - `redis_protocol_bytes`: the same with the zero-copy decoder (`decode_bytes`, frames whose
//!   strings are slices of one `Bytes`) and `extend_encode`.
//!
//! Before anything is timed, every case is checked: the outputs of shardgate and of both
//! baselines are the same bytes (same length for RESP3 maps, whose key order redis-protocol
//! does not keep), every node was rewritten and no internal address is left.
//!
//! Run: `cargo bench -p shardgate-benches --bench rewrite` (about two minutes). The same cases
//! counted in instructions per reply by callgrind: see [`count`].
mod count;

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use criterion::{criterion_group, BatchSize, BenchmarkGroup, BenchmarkId, Criterion, Throughput};
use shardgate_crds::{NodeRef, PortLayout};
use shardgate_proxy::model::{Backend, Route, Routes};
use shardgate_proxy::rewrite::stream::{Limits, ReplySide, RequestSide, Segment, Shared};
use shardgate_proxy::rewrite::{AddressMap, Report};

/// The proxy's default buffer size: the reply side sees the stream in reads of this size.
const READ: usize = 16 * 1024;
/// The host external clients dial (a documentation address).
const ADVERTISE: &str = "127.0.77.70";
const BASE_PORT: u32 = 30000;
/// Each topology iteration pipelines copies of the reply up to at least this many bytes.
const TOPOLOGY_BYTES: usize = 256 * 1024;
/// The plain and MOVED streams are this long.
const STREAM_BYTES: usize = 512 * 1024;

// === fixtures ===

/// Deterministic pseudo-random numbers (splitmix64), so every run sees the same bytes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// A Valkey node or shard id: 40 lowercase hex digits.
    fn id(&mut self) -> String {
        (0..40)
            .map(|_| char::from(b"0123456789abcdef"[self.below(16) as usize]))
            .collect()
    }
}

struct Node {
    id: String,
    ip: String,
    primary: bool,
    /// The proxy's listener port for this node.
    external: u16,
}

struct Shard {
    id: String,
    start: u16,
    end: u16,
    /// Indices into `Topology::nodes`: the primary, then its replica.
    nodes: [usize; 2],
}

/// A cluster of `shards` primaries with one replica each, slots split evenly.
struct Topology {
    nodes: Vec<Node>,
    shards: Vec<Shard>,
}

impl Topology {
    fn new(shards: u32) -> Self {
        let layout = PortLayout::new(BASE_PORT, shards, 1, None).expect("a valid port layout");
        let mut rng = Rng(u64::from(shards));
        let (mut nodes, mut list) = (vec![], vec![]);
        for s in 0..shards {
            let start = (s * 16384 / shards) as u16;
            let end = ((s + 1) * 16384 / shards - 1) as u16;
            let mut pair = [0; 2];
            for (n, slot) in pair.iter_mut().enumerate() {
                let k = nodes.len();
                *slot = k;
                nodes.push(Node {
                    id: rng.id(),
                    ip: format!("10.244.{}.{}", k / 250, k % 250 + 2),
                    primary: n == 0,
                    external: layout
                        .port(NodeRef::new(s, n as u32))
                        .expect("node inside the layout"),
                });
            }
            list.push(Shard {
                id: rng.id(),
                start,
                end,
                nodes: pair,
            });
        }
        Topology {
            nodes,
            shards: list,
        }
    }

    /// The route table the proxy would have: every node, by id and address.
    fn routes(&self) -> Routes {
        let layout = PortLayout::new(BASE_PORT, self.shards.len() as u32, 1, None)
            .expect("a valid port layout");
        self.nodes
            .iter()
            .map(|n| {
                let mut route = Route::new(
                    layout.node_of(n.external).expect("a port of the layout"),
                    format!("{}:6379", n.ip)
                        .parse::<Backend>()
                        .expect("ip:port"),
                );
                route.node_id = Some(n.id.clone());
                route.rewrite = true;
                (n.external, Arc::new(route))
            })
            .collect::<BTreeMap<_, _>>()
    }

    fn owner(&self, slot: u16) -> &Node {
        let shard = self
            .shards
            .iter()
            .find(|s| (s.start..=s.end).contains(&slot))
            .expect("every slot is served");
        &self.nodes[shard.nodes[0]]
    }

    /// `CLUSTER SLOTS`, RESP2, `cluster-preferred-endpoint-type ip`, no hostnames (c1-02).
    fn slots_reply(&self) -> Vec<u8> {
        let mut r = Resp::default();
        r.head(b'*', self.shards.len());
        for s in &self.shards {
            r.head(b'*', 4);
            r.int(s.start.into());
            r.int(s.end.into());
            for &k in &s.nodes {
                let n = &self.nodes[k];
                r.head(b'*', 4);
                r.bulk(&n.ip);
                r.int(6379);
                r.bulk(&n.id);
                r.head(b'*', 0);
            }
        }
        r.0
    }

    /// `CLUSTER SHARDS`: RESP2 flat arrays or RESP3 maps (c1-03, c1-09). Like Valkey's, not
    /// sorted by slot.
    fn shards_reply(&self, resp3: bool) -> Vec<u8> {
        let map = if resp3 { b'%' } else { b'*' };
        let pairs = |n: usize| if resp3 { n } else { 2 * n };
        let mut r = Resp::default();
        r.head(b'*', self.shards.len());
        let half = self.shards.len() / 2;
        for s in self.shards[half..].iter().chain(&self.shards[..half]) {
            r.head(map, pairs(3));
            r.bulk("slots");
            r.head(b'*', 2);
            r.int(s.start.into());
            r.int(s.end.into());
            r.bulk("nodes");
            r.head(b'*', 2);
            for &k in &s.nodes {
                let n = &self.nodes[k];
                r.head(map, pairs(7));
                r.bulk("id");
                r.bulk(&n.id);
                r.bulk("port");
                r.int(6379);
                r.bulk("ip");
                r.bulk(&n.ip);
                r.bulk("endpoint");
                r.bulk(&n.ip);
                r.bulk("role");
                r.bulk(if n.primary { "master" } else { "replica" });
                r.bulk("replication-offset");
                r.int(1_482_735);
                r.bulk("health");
                r.bulk("online");
            }
            r.bulk("id");
            r.bulk(&s.id);
        }
        r.0
    }

    /// `CLUSTER NODES`, RESP2 bulk string (c1-04), as asked on the first primary.
    fn nodes_reply(&self) -> Vec<u8> {
        let mut text = String::new();
        for (i, s) in self.shards.iter().enumerate() {
            let primary = &self.nodes[s.nodes[0]];
            let replica = &self.nodes[s.nodes[1]];
            let epoch = i + 1;
            let (flags, pong) = if i == 0 {
                ("myself,master", 0)
            } else {
                ("master", 1_796_001_045_863 + i as u64)
            };
            text += &format!(
                "{} {}:6379@16379 {flags} - 0 {pong} {epoch} connected {}-{}\n",
                primary.id, primary.ip, s.start, s.end
            );
            text += &format!(
                "{} {}:6379@16379 slave {} 0 {} {epoch} connected\n",
                replica.id,
                replica.ip,
                primary.id,
                1_796_001_046_000 + i as u64
            );
        }
        let mut r = Resp::default();
        r.bulk(&text);
        r.0
    }
}

/// A RESP writer for the fixtures.
#[derive(Default)]
struct Resp(Vec<u8>);

impl Resp {
    fn head(&mut self, ty: u8, n: usize) {
        self.0.push(ty);
        self.0.extend_from_slice(format!("{n}\r\n").as_bytes());
    }

    fn int(&mut self, i: i64) {
        self.0.extend_from_slice(format!(":{i}\r\n").as_bytes());
    }

    fn bulk(&mut self, s: impl AsRef<[u8]>) {
        let s = s.as_ref();
        self.head(b'$', s.len());
        self.0.extend_from_slice(s);
        self.0.extend_from_slice(b"\r\n");
    }

    fn command(&mut self, args: &[&[u8]]) {
        self.head(b'*', args.len());
        args.iter().for_each(|a| self.bulk(a));
    }
}

/// What a case's replies are, which decides what the baseline substitutes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Plain,
    Moved,
    Slots,
    Shards,
    Nodes,
}

/// One benchmark input: the client's pipelined commands and the server's replies to them.
struct Case {
    kind: Kind,
    resp3: bool,
    requests: Vec<u8>,
    replies: Bytes,
    count: u64,
    map: AddressMap,
    base_map: baseline::Map,
}

impl Case {
    fn new(
        kind: Kind,
        resp3: bool,
        topology: &Topology,
        requests: Vec<u8>,
        replies: Vec<u8>,
        count: u64,
    ) -> Self {
        Case {
            kind,
            resp3,
            requests,
            replies: replies.into(),
            count,
            map: AddressMap::new(ADVERTISE, &topology.routes()),
            base_map: baseline::Map::new(ADVERTISE, topology),
        }
    }

    /// A pipeline of copies of one topology reply (`kind`: slots, shards or nodes) and the
    /// commands they answer.
    fn topology(kind: Kind, resp3: bool, topology: &Topology) -> Self {
        let (subcommand, reply): (&[u8], _) = match kind {
            Kind::Slots => (b"SLOTS", topology.slots_reply()),
            Kind::Shards => (b"SHARDS", topology.shards_reply(resp3)),
            Kind::Nodes => (b"NODES", topology.nodes_reply()),
            Kind::Plain | Kind::Moved => panic!("{kind:?} is not a topology reply"),
        };
        let copies = TOPOLOGY_BYTES.div_ceil(reply.len());
        let mut requests = Resp::default();
        (0..copies).for_each(|_| requests.command(&[b"CLUSTER", subcommand]));
        Case::new(
            kind,
            resp3,
            topology,
            requests.0,
            reply.repeat(copies),
            copies as u64,
        )
    }

    /// Pipelined SETs and GETs: a third `+OK`, a tenth misses, the rest values of 16, 128
    /// and 1024 bytes.
    fn plain(topology: &Topology) -> Self {
        let mut rng = Rng(7);
        let (mut requests, mut replies, mut count) = (Resp::default(), Resp::default(), 0);
        while replies.0.len() < STREAM_BYTES {
            let key = format!("key:{count}");
            match count % 10 {
                0..=2 => {
                    requests.command(&[b"SET", key.as_bytes(), b"v"]);
                    replies.0.extend_from_slice(b"+OK\r\n");
                }
                3 => {
                    requests.command(&[b"GET", key.as_bytes()]);
                    replies.0.extend_from_slice(b"$-1\r\n");
                }
                i => {
                    requests.command(&[b"GET", key.as_bytes()]);
                    let len = match i {
                        4..=6 => 16,
                        7 | 8 => 128,
                        _ => 1024,
                    };
                    let value: Vec<u8> = (0..len).map(|_| b'a' + rng.below(26) as u8).collect();
                    replies.bulk(&value);
                }
            }
            count += 1;
        }
        Case::new(Kind::Plain, false, topology, requests.0, replies.0, count)
    }

    /// GETs of keys in random slots, every one answered by a MOVED to the slot's primary.
    fn moved(topology: &Topology) -> Self {
        let mut rng = Rng(11);
        let (mut requests, mut replies, mut count) = (Resp::default(), Vec::new(), 0);
        while replies.len() < STREAM_BYTES {
            let slot = rng.below(16384) as u16;
            requests.command(&[b"GET", format!("key:{count}").as_bytes()]);
            let owner = topology.owner(slot);
            replies.extend_from_slice(format!("-MOVED {slot} {}:6379\r\n", owner.ip).as_bytes());
            count += 1;
        }
        Case::new(Kind::Moved, false, topology, requests.0, replies, count)
    }

    fn throughput(&self) -> Throughput {
        Throughput::ElementsAndBytes {
            elements: self.count,
            bytes: self.replies.len() as u64,
        }
    }
}

// === shardgate ===

/// A connection's state after the client's requests went by (the untimed setup).
fn observed(case: &Case) -> (Shared, ReplySide) {
    let shared = Shared::new(true);
    let mut requests = RequestSide::new(Limits::default());
    for chunk in case.requests.chunks(READ) {
        requests.observe(chunk, &shared).expect("valid requests");
    }
    (shared, ReplySide::new(Limits::default()))
}

/// The reply side over the whole stream in 16 KiB reads; each read's output is copied into
/// `out` (cleared per read) and handed to `sent`.
fn shardgate(
    case: &Case,
    (shared, mut side): (Shared, ReplySide),
    segments: &mut Vec<Segment>,
    out: &mut Vec<u8>,
    mut sent: impl FnMut(&[u8]),
) -> Report {
    let mut total = Report::default();
    for chunk in case.replies.chunks(READ) {
        let mut report = Report::default();
        segments.clear();
        side.process(chunk, &shared, &case.map, segments, &mut report)
            .expect("valid replies");
        out.clear();
        for s in segments.iter() {
            match s {
                Segment::Input(r) => out.extend_from_slice(&chunk[r.clone()]),
                Segment::Owned(v) => out.extend_from_slice(v),
            }
        }
        sent(out);
        total.rewritten += report.rewritten;
        total.unknown.extend(report.unknown);
    }
    total
}

/// Like [`shardgate`], but the output is only measured: the sum of the segment lengths.
fn shardgate_no_copy(
    case: &Case,
    (shared, mut side): (Shared, ReplySide),
    segments: &mut Vec<Segment>,
) -> usize {
    let mut total = 0;
    for chunk in case.replies.chunks(READ) {
        let mut report = Report::default();
        segments.clear();
        side.process(chunk, &shared, &case.map, segments, &mut report)
            .expect("valid replies");
        total += segments
            .iter()
            .map(|s| match s {
                Segment::Input(r) => r.len(),
                Segment::Owned(v) => v.len(),
            })
            .sum::<usize>();
    }
    total
}

// === the decode-then-re-encode baseline ===

mod baseline {
    use std::collections::HashMap;
    use std::io::Write;
    use std::ops::Range;

    use bytes::{Bytes, BytesMut};
    use redis_protocol::bytes_utils::Str;
    use redis_protocol::resp2::types::{BytesFrame as Bytes2, OwnedFrame as Owned2, Resp2Frame};
    use redis_protocol::resp3::types::{BytesFrame as Bytes3, OwnedFrame as Owned3, Resp3Frame};

    use super::{Kind, Topology, READ};

    /// Internal `ip`, port → the proxy's port; no allocation per lookup.
    pub struct Map {
        host: Vec<u8>,
        by_ip: HashMap<Vec<u8>, Vec<(i64, u16)>>,
    }

    impl Map {
        pub fn new(host: &str, topology: &Topology) -> Self {
            let mut by_ip: HashMap<Vec<u8>, Vec<(i64, u16)>> = HashMap::new();
            for n in &topology.nodes {
                by_ip
                    .entry(n.ip.as_bytes().to_vec())
                    .or_default()
                    .push((6379, n.external));
            }
            Map {
                host: host.as_bytes().to_vec(),
                by_ip,
            }
        }

        fn get(&self, ip: &[u8], port: i64) -> Option<u16> {
            self.by_ip
                .get(ip)?
                .iter()
                .find(|(p, _)| *p == port)
                .map(|(_, ext)| *ext)
        }
    }

    /// A decoded frame, as much of it as the substitution needs.
    pub trait Tree: Sized {
        /// A bulk/blob or simple string's bytes.
        fn text(&self) -> Option<&[u8]>;
        fn int(&self) -> Option<i64>;
        fn error(&self) -> Option<&str>;
        fn items_mut(&mut self) -> Option<&mut [Self]>;
        /// A map's value by key: RESP3 map, or RESP2 flat array of keys and values.
        fn get(&self, key: &[u8]) -> Option<&Self>;
        fn get_mut(&mut self, key: &[u8]) -> Option<&mut Self>;
        fn set_text(&mut self, b: Vec<u8>);
        fn set_int(&mut self, i: i64);
        fn set_error(&mut self, s: String);
    }

    /// A decoder and encoder of one protocol and frame type.
    pub trait Codec {
        type Frame: Tree;
        /// Decodes the first frame of `all[range]`, if it is complete.
        fn decode(all: &Bytes, range: Range<usize>) -> Option<(Self::Frame, usize)>;
        fn encode(f: &Self::Frame, out: &mut BytesMut);
    }

    /// The reply stream in 16 KiB reads: decode every complete frame of what was read so far,
    /// substitute, re-encode into `out` (cleared per read), hand each read's output to `sent`.
    /// A frame that runs past the read is decoded again from its start after the next one.
    pub fn run<C: Codec>(
        kind: Kind,
        map: &Map,
        input: &Bytes,
        out: &mut BytesMut,
        mut sent: impl FnMut(&[u8]),
    ) {
        let (mut start, mut end) = (0, 0);
        while end < input.len() {
            end = (end + READ).min(input.len());
            out.clear();
            while let Some((mut frame, n)) = C::decode(input, start..end) {
                start += n;
                rewrite(kind, map, &mut frame);
                C::encode(&frame, out);
            }
            sent(out);
        }
        assert_eq!(start, input.len(), "the stream ends with a complete frame");
    }

    fn rewrite<T: Tree>(kind: Kind, map: &Map, f: &mut T) {
        match kind {
            // Any error may be a redirect.
            Kind::Plain | Kind::Moved => redirect(map, f),
            Kind::Slots => slots(map, f),
            Kind::Shards => shards(map, f),
            Kind::Nodes => nodes(map, f),
        }
    }

    /// `MOVED|ASK <slot> <ip>:<port>`.
    fn redirect<T: Tree>(map: &Map, f: &mut T) {
        let Some(line) = f.error() else { return };
        let Some((kind, rest)) = line.split_once(' ') else {
            return;
        };
        if kind != "MOVED" && kind != "ASK" {
            return;
        }
        let Some((slot, addr)) = rest.split_once(' ') else {
            return;
        };
        let Some((ip, port)) = addr.rsplit_once(':') else {
            return;
        };
        let Some(ext) = port.parse().ok().and_then(|p| map.get(ip.as_bytes(), p)) else {
            return;
        };
        let host = String::from_utf8_lossy(&map.host);
        let new = format!("{kind} {slot} {host}:{ext}");
        f.set_error(new);
    }

    /// `[[start, end, [ip, port, id, meta], ...], ...]`.
    fn slots<T: Tree>(map: &Map, f: &mut T) {
        let Some(ranges) = f.items_mut() else { return };
        for range in ranges {
            let Some(items) = range.items_mut() else {
                continue;
            };
            for node in items.iter_mut().skip(2) {
                let Some(fields) = node.items_mut() else {
                    continue;
                };
                if fields.len() < 2 {
                    continue;
                }
                let ext = match (fields[0].text(), fields[1].int()) {
                    (Some(ip), Some(port)) => map.get(ip, port),
                    _ => None,
                };
                if let Some(ext) = ext {
                    fields[0].set_text(map.host.clone());
                    fields[1].set_int(ext.into());
                }
            }
        }
    }

    /// `[{slots, nodes: [{id, port, ip, endpoint, ...}], id}, ...]`.
    fn shards<T: Tree>(map: &Map, f: &mut T) {
        let Some(shards) = f.items_mut() else { return };
        for shard in shards {
            let Some(nodes) = shard.get_mut(b"nodes").and_then(T::items_mut) else {
                continue;
            };
            for node in nodes {
                let ext = (|| map.get(node.get(b"ip")?.text()?, node.get(b"port")?.int()?))();
                let Some(ext) = ext else { continue };
                if let Some(port) = node.get_mut(b"port") {
                    port.set_int(ext.into());
                }
                for key in [&b"ip"[..], b"endpoint"] {
                    if let Some(v) = node.get_mut(key) {
                        v.set_text(map.host.clone());
                    }
                }
            }
        }
    }

    /// Text lines `<id> <ip>:<port>@<cport> ...`.
    fn nodes<T: Tree>(map: &Map, f: &mut T) {
        let Some(text) = f.text() else { return };
        let mut out = Vec::with_capacity(text.len());
        for (i, line) in text.split(|&b| b == b'\n').enumerate() {
            if i > 0 {
                out.push(b'\n');
            }
            let mut fields = line.splitn(3, |&b| b == b' ');
            let (Some(id), Some(addr), Some(rest)) = (fields.next(), fields.next(), fields.next())
            else {
                out.extend_from_slice(line);
                continue;
            };
            let at = addr.iter().position(|&b| b == b'@').unwrap_or(addr.len());
            let (hostport, cport) = addr.split_at(at);
            let ext = hostport.iter().rposition(|&b| b == b':').and_then(|c| {
                let port = std::str::from_utf8(&hostport[c + 1..]).ok()?.parse().ok()?;
                map.get(&hostport[..c], port)
            });
            let Some(ext) = ext else {
                out.extend_from_slice(line);
                continue;
            };
            out.extend_from_slice(id);
            out.push(b' ');
            out.extend_from_slice(&map.host);
            write!(out, ":{ext}").expect("writing to a Vec");
            out.extend_from_slice(cport);
            out.push(b' ');
            out.extend_from_slice(rest);
        }
        f.set_text(out);
    }

    // --- RESP2 ---

    fn flat_get<'f, T: Tree>(items: &'f [T], key: &[u8]) -> Option<&'f T> {
        items
            .chunks_exact(2)
            .find(|kv| kv[0].text() == Some(key))
            .map(|kv| &kv[1])
    }

    fn flat_get_mut<'f, T: Tree>(items: &'f mut [T], key: &[u8]) -> Option<&'f mut T> {
        items
            .chunks_exact_mut(2)
            .find(|kv| kv[0].text() == Some(key))
            .map(|kv| &mut kv[1])
    }

    impl Tree for Owned2 {
        fn text(&self) -> Option<&[u8]> {
            match self {
                Owned2::BulkString(b) | Owned2::SimpleString(b) => Some(b),
                _ => None,
            }
        }
        fn int(&self) -> Option<i64> {
            match self {
                Owned2::Integer(i) => Some(*i),
                _ => None,
            }
        }
        fn error(&self) -> Option<&str> {
            match self {
                Owned2::Error(s) => Some(s),
                _ => None,
            }
        }
        fn items_mut(&mut self) -> Option<&mut [Self]> {
            match self {
                Owned2::Array(items) => Some(items),
                _ => None,
            }
        }
        fn get(&self, key: &[u8]) -> Option<&Self> {
            match self {
                Owned2::Array(items) => flat_get(items, key),
                _ => None,
            }
        }
        fn get_mut(&mut self, key: &[u8]) -> Option<&mut Self> {
            flat_get_mut(self.items_mut()?, key)
        }
        fn set_text(&mut self, b: Vec<u8>) {
            *self = Owned2::BulkString(b);
        }
        fn set_int(&mut self, i: i64) {
            *self = Owned2::Integer(i);
        }
        fn set_error(&mut self, s: String) {
            *self = Owned2::Error(s);
        }
    }

    impl Tree for Bytes2 {
        fn text(&self) -> Option<&[u8]> {
            match self {
                Bytes2::BulkString(b) | Bytes2::SimpleString(b) => Some(b),
                _ => None,
            }
        }
        fn int(&self) -> Option<i64> {
            match self {
                Bytes2::Integer(i) => Some(*i),
                _ => None,
            }
        }
        fn error(&self) -> Option<&str> {
            match self {
                Bytes2::Error(s) => Some(s),
                _ => None,
            }
        }
        fn items_mut(&mut self) -> Option<&mut [Self]> {
            match self {
                Bytes2::Array(items) => Some(items),
                _ => None,
            }
        }
        fn get(&self, key: &[u8]) -> Option<&Self> {
            match self {
                Bytes2::Array(items) => flat_get(items, key),
                _ => None,
            }
        }
        fn get_mut(&mut self, key: &[u8]) -> Option<&mut Self> {
            flat_get_mut(self.items_mut()?, key)
        }
        fn set_text(&mut self, b: Vec<u8>) {
            *self = Bytes2::BulkString(b.into());
        }
        fn set_int(&mut self, i: i64) {
            *self = Bytes2::Integer(i);
        }
        fn set_error(&mut self, s: String) {
            *self = Bytes2::Error(Str::from(s));
        }
    }

    pub struct Resp2Owned;
    pub struct Resp2Bytes;

    impl Codec for Resp2Owned {
        type Frame = Owned2;
        fn decode(all: &Bytes, range: Range<usize>) -> Option<(Owned2, usize)> {
            redis_protocol::resp2::decode::decode(&all[range]).expect("valid RESP2")
        }
        fn encode(f: &Owned2, out: &mut BytesMut) {
            let at = out.len();
            out.resize(at + f.encode_len(false), 0);
            redis_protocol::resp2::encode::encode(&mut out[at..], f, false)
                .expect("room to encode");
        }
    }

    impl Codec for Resp2Bytes {
        type Frame = Bytes2;
        fn decode(all: &Bytes, range: Range<usize>) -> Option<(Bytes2, usize)> {
            redis_protocol::resp2::decode::decode_bytes(&all.slice(range)).expect("valid RESP2")
        }
        fn encode(f: &Bytes2, out: &mut BytesMut) {
            redis_protocol::resp2::encode::extend_encode(out, f, false).expect("room to encode");
        }
    }

    // --- RESP3 ---

    impl Tree for Owned3 {
        fn text(&self) -> Option<&[u8]> {
            match self {
                Owned3::BlobString { data, .. } | Owned3::SimpleString { data, .. } => Some(data),
                _ => None,
            }
        }
        fn int(&self) -> Option<i64> {
            match self {
                Owned3::Number { data, .. } => Some(*data),
                _ => None,
            }
        }
        fn error(&self) -> Option<&str> {
            match self {
                Owned3::SimpleError { data, .. } => Some(data),
                _ => None,
            }
        }
        fn items_mut(&mut self) -> Option<&mut [Self]> {
            match self {
                Owned3::Array { data, .. } => Some(data),
                _ => None,
            }
        }
        fn get(&self, key: &[u8]) -> Option<&Self> {
            match self {
                Owned3::Map { data, .. } => data
                    .iter()
                    .find(|(k, _)| k.text() == Some(key))
                    .map(|(_, v)| v),
                _ => None,
            }
        }
        fn get_mut(&mut self, key: &[u8]) -> Option<&mut Self> {
            match self {
                Owned3::Map { data, .. } => data
                    .iter_mut()
                    .find(|(k, _)| k.text() == Some(key))
                    .map(|(_, v)| v),
                _ => None,
            }
        }
        fn set_text(&mut self, data: Vec<u8>) {
            *self = Owned3::BlobString {
                data,
                attributes: None,
            };
        }
        fn set_int(&mut self, data: i64) {
            *self = Owned3::Number {
                data,
                attributes: None,
            };
        }
        fn set_error(&mut self, data: String) {
            *self = Owned3::SimpleError {
                data,
                attributes: None,
            };
        }
    }

    impl Tree for Bytes3 {
        fn text(&self) -> Option<&[u8]> {
            match self {
                Bytes3::BlobString { data, .. } | Bytes3::SimpleString { data, .. } => Some(data),
                _ => None,
            }
        }
        fn int(&self) -> Option<i64> {
            match self {
                Bytes3::Number { data, .. } => Some(*data),
                _ => None,
            }
        }
        fn error(&self) -> Option<&str> {
            match self {
                Bytes3::SimpleError { data, .. } => Some(data),
                _ => None,
            }
        }
        fn items_mut(&mut self) -> Option<&mut [Self]> {
            match self {
                Bytes3::Array { data, .. } => Some(data),
                _ => None,
            }
        }
        fn get(&self, key: &[u8]) -> Option<&Self> {
            match self {
                Bytes3::Map { data, .. } => data
                    .iter()
                    .find(|(k, _)| k.text() == Some(key))
                    .map(|(_, v)| v),
                _ => None,
            }
        }
        fn get_mut(&mut self, key: &[u8]) -> Option<&mut Self> {
            match self {
                Bytes3::Map { data, .. } => data
                    .iter_mut()
                    .find(|(k, _)| k.text() == Some(key))
                    .map(|(_, v)| v),
                _ => None,
            }
        }
        fn set_text(&mut self, data: Vec<u8>) {
            *self = Bytes3::BlobString {
                data: data.into(),
                attributes: None,
            };
        }
        fn set_int(&mut self, data: i64) {
            *self = Bytes3::Number {
                data,
                attributes: None,
            };
        }
        fn set_error(&mut self, data: String) {
            *self = Bytes3::SimpleError {
                data: Str::from(data),
                attributes: None,
            };
        }
    }

    pub struct Resp3Owned;
    pub struct Resp3Bytes;

    impl Codec for Resp3Owned {
        type Frame = Owned3;
        fn decode(all: &Bytes, range: Range<usize>) -> Option<(Owned3, usize)> {
            redis_protocol::resp3::decode::complete::decode(&all[range]).expect("valid RESP3")
        }
        fn encode(f: &Owned3, out: &mut BytesMut) {
            let at = out.len();
            out.resize(at + f.encode_len(false), 0);
            redis_protocol::resp3::encode::complete::encode(&mut out[at..], f, false)
                .expect("room to encode");
        }
    }

    impl Codec for Resp3Bytes {
        type Frame = Bytes3;
        fn decode(all: &Bytes, range: Range<usize>) -> Option<(Bytes3, usize)> {
            redis_protocol::resp3::decode::complete::decode_bytes(&all.slice(range))
                .expect("valid RESP3")
        }
        fn encode(f: &Bytes3, out: &mut BytesMut) {
            redis_protocol::resp3::encode::complete::extend_encode(out, f, false)
                .expect("room to encode");
        }
    }
}

// === checks, then benchmarks ===

/// Which frames the baseline decodes into.
#[derive(Debug, Clone, Copy)]
enum Frames {
    /// `OwnedFrame`: every string copied out.
    Owned,
    /// `BytesFrame`: every string a slice of the input.
    Bytes,
}

/// The decode-then-re-encode baseline on `case`, in its protocol.
fn redis_protocol(case: &Case, frames: Frames, out: &mut BytesMut, sent: impl FnMut(&[u8])) {
    use baseline::{run, Resp2Bytes, Resp2Owned, Resp3Bytes, Resp3Owned};
    let (kind, map, input) = (case.kind, &case.base_map, &case.replies);
    match (case.resp3, frames) {
        (false, Frames::Owned) => run::<Resp2Owned>(kind, map, input, out, sent),
        (false, Frames::Bytes) => run::<Resp2Bytes>(kind, map, input, out, sent),
        (true, Frames::Owned) => run::<Resp3Owned>(kind, map, input, out, sent),
        (true, Frames::Bytes) => run::<Resp3Bytes>(kind, map, input, out, sent),
    }
}

/// The bytes each contender sends for `case`, concatenated over the reads.
fn outputs(case: &Case) -> (Vec<u8>, Report, Vec<u8>, Vec<u8>) {
    let (mut ours, mut segments, mut out) = (vec![], vec![], vec![]);
    let report = shardgate(case, observed(case), &mut segments, &mut out, |b| {
        ours.extend_from_slice(b)
    });
    let (mut owned, mut zero_copy, mut buf) = (vec![], vec![], BytesMut::new());
    redis_protocol(case, Frames::Owned, &mut buf, |b| {
        owned.extend_from_slice(b)
    });
    redis_protocol(case, Frames::Bytes, &mut buf, |b| {
        zero_copy.extend_from_slice(b)
    });
    (ours, report, owned, zero_copy)
}

/// Every contender produces the same rewrite, and it is complete.
fn check(name: &str, case: &Case, topology: &Topology) {
    let (ours, report, owned, zero_copy) = outputs(case);
    assert!(
        report.unknown.is_empty(),
        "{name}: unknown addresses {:?}",
        report.unknown
    );
    let expected = match case.kind {
        Kind::Plain => 0,
        Kind::Moved => case.count,
        _ => case.count * topology.nodes.len() as u64,
    };
    assert_eq!(
        u64::from(report.rewritten),
        expected,
        "{name}: addresses rewritten"
    );
    if case.kind == Kind::Plain {
        assert_eq!(
            ours, case.replies,
            "{name}: a plain stream passes unchanged"
        );
    }
    let text = String::from_utf8_lossy(&ours);
    for n in &topology.nodes {
        assert!(
            !text.contains(&format!("{}:", n.ip)) && !text.contains(&format!("{}\r", n.ip)),
            "{name}: {} left",
            n.ip
        );
    }
    if case.resp3 {
        // redis-protocol keeps RESP3 maps in a HashMap: same bytes, another key order.
        assert_eq!(ours.len(), owned.len(), "{name}: owned baseline");
        assert_eq!(ours.len(), zero_copy.len(), "{name}: zero-copy baseline");
    } else {
        assert!(ours == owned, "{name}: the owned baseline differs");
        assert!(ours == zero_copy, "{name}: the zero-copy baseline differs");
    }
}

fn configure(group: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    group
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_millis(1500));
}

/// shardgate and both baselines on `case`, as `<contender>/<param>`.
fn contenders(
    group: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>,
    param: &str,
    case: &Case,
) {
    group.throughput(case.throughput());
    let (mut segments, mut out) = (Vec::new(), Vec::new());
    group.bench_function(BenchmarkId::new("shardgate", param), |b| {
        b.iter_batched(
            || observed(case),
            |conn| {
                let mut sent = 0;
                shardgate(case, conn, &mut segments, &mut out, |o| sent += o.len());
                sent
            },
            BatchSize::SmallInput,
        )
    });
    let mut buf = BytesMut::new();
    for (name, frames) in [
        ("redis_protocol_owned", Frames::Owned),
        ("redis_protocol_bytes", Frames::Bytes),
    ] {
        group.bench_function(BenchmarkId::new(name, param), |b| {
            b.iter(|| {
                let mut sent = 0;
                redis_protocol(case, frames, &mut buf, |o| sent += o.len());
                sent
            })
        });
    }
}

fn streams(c: &mut Criterion) {
    let topology = Topology::new(30);

    let plain = Case::plain(&topology);
    check("plain_get_set", &plain, &topology);
    let mut group = c.benchmark_group("plain_get_set");
    configure(&mut group);
    group.throughput(plain.throughput());
    group.bench_function(BenchmarkId::new("memchr_lf_count", "stream"), |b| {
        b.iter(|| memchr::memchr_iter(b'\n', black_box(&plain.replies[..])).count())
    });
    let mut segments = Vec::new();
    group.bench_function(BenchmarkId::new("shardgate_no_copy", "stream"), |b| {
        b.iter_batched(
            || observed(&plain),
            |conn| shardgate_no_copy(&plain, conn, &mut segments),
            BatchSize::SmallInput,
        )
    });
    contenders(&mut group, "stream", &plain);
    group.finish();

    // The other direction of the same connection: the client's pipelined GETs and SETs,
    // which `shardgate` above observes in its untimed setup.
    let mut group = c.benchmark_group("request_side");
    configure(&mut group);
    group.throughput(Throughput::ElementsAndBytes {
        elements: plain.count,
        bytes: plain.requests.len() as u64,
    });
    group.bench_function(BenchmarkId::new("memchr_lf_count", "stream"), |b| {
        b.iter(|| memchr::memchr_iter(b'\n', black_box(&plain.requests[..])).count())
    });
    group.bench_function(BenchmarkId::new("shardgate_observe", "stream"), |b| {
        b.iter(|| observed(&plain))
    });
    group.finish();

    let moved = Case::moved(&topology);
    check("moved_storm", &moved, &topology);
    let mut group = c.benchmark_group("moved_storm");
    configure(&mut group);
    contenders(&mut group, "stream", &moved);
    group.finish();
}

/// The topology groups: name, reply, RESP3.
const TOPOLOGY_GROUPS: [(&str, Kind, bool); 4] = [
    ("cluster_slots_resp2", Kind::Slots, false),
    ("cluster_shards_resp2", Kind::Shards, false),
    ("cluster_shards_resp3", Kind::Shards, true),
    ("cluster_nodes_resp2", Kind::Nodes, false),
];
/// Each topology group's clusters (the benchmark parameter).
const SHARDS: [u32; 3] = [3, 30, 300];

fn topologies(c: &mut Criterion) {
    let topologies: Vec<Topology> = SHARDS.into_iter().map(Topology::new).collect();
    for (name, kind, resp3) in TOPOLOGY_GROUPS {
        let mut group = c.benchmark_group(name);
        configure(&mut group);
        for t in &topologies {
            let case = Case::topology(kind, resp3, t);
            let param = t.shards.len().to_string();
            check(&format!("{name}/{param}"), &case, t);
            contenders(&mut group, &param, &case);
        }
        group.finish();
    }
}

criterion_group!(benches, streams, topologies);

fn main() -> anyhow::Result<()> {
    if count::from_env()? {
        return Ok(());
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
    Ok(())
}
