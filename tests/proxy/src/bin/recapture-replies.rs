//! Re-captures the replies corpus (`proxy/testdata/valkey-9.1.2-captures.tsv`, described in
//! `shared/reference/valkey-topology-replies.md`) from a fresh harness cluster, so that
//! anyone can confirm it: `scripts/recapture-replies [OUT.tsv]`.
//!
//! It starts a 3x1 cluster, maps the captured layout onto it (127.0.10.1-3 are the
//! primaries of shards 0-2; 127.0.10.4, .5, .6 the replicas of shards 2, 0, 1), sends every
//! command of the replayed sessions to the node in the captured node's place (its node ids
//! translated), and compares each reply with the captured one after translating the fresh
//! cluster's ids and addresses back and masking what the reference calls volatile (client
//! id, replication offsets, ping/pong times, the order of CLUSTER NODES lines and CLUSTER
//! SHARDS entries). The fresh replies are written to OUT.tsv in the corpus's format.
//!
//! Every session is replayed in the corpus's order, each on fresh connections, with the node
//! configuration the reference gives for it set first at run time (`CONFIG SET`, then waiting
//! until the cluster bus has carried it to every node), see [`prepare`]: c1 the default
//! configuration (MOVED, ASK mid-migration); c2 announced hostnames, then
//! `cluster-preferred-endpoint-type hostname`; c3 hostnames removed from shard 2, then
//! `unknown-endpoint` on 127.0.10.1; c4 `cluster-announce-client-port` / `-tls-port` (sent by
//! the captures themselves) and `cluster-announce-client-ipv4` on 127.0.10.3; c5 human node
//! names, then `availability-zone` on 127.0.10.3; c6 sharded pub/sub (multi-frame replies
//! compared frame by frame); c7 transactions; c8 ROLE and INFO replication. A session listed
//! in [`NOT_REPLAYED`] is skipped with its reason and counted as not replayed (never as
//! passed).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use redis::Value;
use shardgate_crds::NodeRef;
use shardgate_harness::valkey::{ClusterSpec, ValkeyCluster};

const CORPUS: &str = include_str!("../../../../proxy/testdata/valkey-9.1.2-captures.tsv");
const SESSIONS: &[&str] = &["c1", "c2", "c3", "c4", "c5", "c6", "c7", "c8"];

/// Sessions this harness cannot reproduce, with the reason (printed, and counted as not
/// replayed). Empty: every session's configuration can be set at run time on the harness.
const NOT_REPLAYED: &[(&str, &str)] = &[];

/// The slot of `bar`, migrated from shard 0 to shard 1 for the ASK captures.
const BAR_SLOT: &str = "5061";

/// The captured layout: address, node id, shard id, and the node's place.
const CAPTURED: [(&str, &str, &str, (u32, u32)); 6] = [
    (
        "127.0.10.1",
        "a539d95fb51874a91ad88b8f1c379041378f6000",
        "4cba700fee4546bb08302528fb68a37194ccf1ac",
        (0, 0),
    ),
    (
        "127.0.10.2",
        "45a9dc707629b0798a2940235c6c132109b67d39",
        "65bc16711e1db1dfc8e706390948c451ea6ffd04",
        (1, 0),
    ),
    (
        "127.0.10.3",
        "9be423741f0a3b818f633a9c16a1cf9ef42922d0",
        "3de10435381d991600148b6427881d8d83648888",
        (2, 0),
    ),
    (
        "127.0.10.4",
        "b6c576188309d2169652f87caed74d6812de842b",
        "3de10435381d991600148b6427881d8d83648888",
        (2, 1),
    ),
    (
        "127.0.10.5",
        "2dd88adea70885bb44cbfa95de22bc992c322cf1",
        "4cba700fee4546bb08302528fb68a37194ccf1ac",
        (0, 1),
    ),
    (
        "127.0.10.6",
        "fa68a450d251922408bbc98e153b47689f7d1d6f",
        "65bc16711e1db1dfc8e706390948c451ea6ffd04",
        (1, 1),
    ),
];

struct Capture {
    id: String,
    resp3: bool,
    sent_to: String,
    command: String,
    reply: Vec<u8>,
}

fn unescape(s: &str) -> Result<Vec<u8>> {
    let (mut out, b) = (Vec::new(), s.as_bytes());
    let mut i = 0;
    while i < b.len() {
        if b[i] != b'\\' {
            out.push(b[i]);
            i += 1;
            continue;
        }
        match b.get(i + 1) {
            Some(b'r') => out.push(b'\r'),
            Some(b'n') => out.push(b'\n'),
            Some(b'\\') => out.push(b'\\'),
            Some(b'x') => {
                let hex = s.get(i + 2..i + 4).context("short \\x escape")?;
                out.push(u8::from_str_radix(hex, 16)?);
                i += 2;
            }
            other => bail!("unknown escape {other:?} in {s:?}"),
        }
        i += 2;
    }
    Ok(out)
}

fn escape(bytes: &[u8]) -> String {
    let mut out = String::new();
    for &c in bytes {
        match c {
            b'\r' => out.push_str("\\r"),
            b'\n' => out.push_str("\\n"),
            b'\\' => out.push_str("\\\\"),
            0x20..=0x7e => out.push(c as char),
            _ => out.push_str(&format!("\\x{c:02x}")),
        }
    }
    out
}

fn captures() -> Result<Vec<Capture>> {
    let mut out = Vec::new();
    for line in CORPUS.lines().filter(|l| !l.starts_with('#')) {
        let f: Vec<&str> = line.split('\t').collect();
        let [id, proto, sent_to, command, reply] = f[..] else {
            bail!("not 5 fields: {line:?}");
        };
        out.push(Capture {
            id: id.into(),
            resp3: proto == "RESP3",
            sent_to: sent_to.into(),
            command: command.into(),
            reply: unescape(reply)?,
        });
    }
    Ok(out)
}

/// The fresh node in the place of the captured node at `ip`.
fn place(ip: &str) -> Result<NodeRef> {
    let (_, _, _, (s, n)) = CAPTURED
        .iter()
        .find(|c| c.0 == ip)
        .with_context(|| format!("no captured node {ip}"))?;
    Ok(NodeRef::new(*s, *n))
}

/// One connection per node and protocol, as the captures reuse them (ASKING, then GET).
struct Connections(BTreeMap<(String, bool), TcpStream>);

impl Connections {
    fn get(&mut self, cluster: &ValkeyCluster, to: &str, resp3: bool) -> Result<&mut TcpStream> {
        let key = (to.to_string(), resp3);
        if !self.0.contains_key(&key) {
            let mut conn = TcpStream::connect(cluster.node(place(to)?).addr())?;
            conn.set_read_timeout(Some(Duration::from_secs(5)))?;
            if resp3 {
                send(&mut conn, &["HELLO", "3"])?;
                read_reply(&mut conn)?;
            }
            self.0.insert(key.clone(), conn);
        }
        self.0.get_mut(&key).context("just inserted")
    }
}

fn send(conn: &mut TcpStream, args: &[&str]) -> Result<()> {
    let mut req = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        req.extend_from_slice(format!("${}\r\n{a}\r\n", a.len()).as_bytes());
    }
    conn.write_all(&req)?;
    Ok(())
}

/// Reads until the bytes parse as one whole reply.
fn read_reply(conn: &mut TcpStream) -> Result<Vec<u8>> {
    read_frames(conn, 1)
}

/// Reads until the bytes are exactly `frames` whole RESP frames (a multi-channel
/// `SSUBSCRIBE` or an argument-less `SUNSUBSCRIBE` answers with one frame per channel).
fn read_frames(conn: &mut TcpStream, frames: usize) -> Result<Vec<u8>> {
    let (mut buf, mut chunk) = (Vec::new(), [0u8; 65536]);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let n = conn.read(&mut chunk)?;
        if n == 0 {
            bail!("connection closed after {buf:?}");
        }
        buf.extend_from_slice(&chunk[..n]);
        let split = split_frames(&buf);
        if split.len() >= frames && split.iter().map(|f| f.len()).sum::<usize>() == buf.len() {
            return Ok(buf);
        }
        if Instant::now() > deadline {
            bail!("no {frames} whole frames in {buf:?}");
        }
    }
}

/// The length of the whole RESP2/RESP3 frame at the start of `b`, if it is all there.
fn frame_len(b: &[u8]) -> Option<usize> {
    let end = b.windows(2).position(|w| w == b"\r\n")?;
    let after = end + 2;
    let header = std::str::from_utf8(b.get(1..end)?).ok()?;
    let count = || header.parse::<i64>().ok();
    let elements = match b.first()? {
        b'$' | b'!' | b'=' => {
            let n = count()?;
            if n < 0 {
                return Some(after);
            }
            let total = after + usize::try_from(n).ok()? + 2;
            return (total <= b.len()).then_some(total);
        }
        b'*' | b'~' | b'>' => count()?,
        b'%' => count()? * 2,
        // An attribute map precedes the value it annotates.
        b'|' => count()? * 2 + 1,
        _ => return Some(after),
    };
    let mut pos = after;
    for _ in 0..elements.max(0) {
        pos += frame_len(b.get(pos..)?)?;
    }
    Some(pos)
}

/// The whole frames at the start of `b`, in order.
fn split_frames(b: &[u8]) -> Vec<&[u8]> {
    let (mut out, mut pos) = (Vec::new(), 0);
    while let Some(n) = b.get(pos..).filter(|r| !r.is_empty()).and_then(frame_len) {
        out.push(&b[pos..pos + n]);
        pos += n;
    }
    out
}

/// A reply in a form that compares what is not volatile: `subst` maps the fresh cluster's
/// ids and addresses to the captured ones.
fn canon(v: &Value, subst: &dyn Fn(&str) -> String, sort: bool) -> String {
    let text = |s: &str| {
        // CLUSTER NODES / REPLICAS: ping-sent and pong-received times vary, and so do the
        // config epochs (they depend on how the cluster was formed: valkey-cli then, the
        // harness now); the order of the lines depends on the answering node.
        let mut lines: Vec<String> = subst(s)
            .split('\n')
            .map(|l| {
                let mut f: Vec<&str> = l.split(' ').collect();
                if f.len() >= 8 && f[1].contains('@') {
                    f[4] = "*";
                    f[5] = "*";
                    f[6] = "*";
                }
                let l = f.join(" ");
                // INFO replication: offsets, replication ids and times.
                match l.trim_end_matches('\r').split_once(':') {
                    Some((k, _))
                        if VOLATILE_INFO.contains(&k) || k.starts_with("cluster_stats_") =>
                    {
                        format!("{k}:*")
                    }
                    Some((k, v)) if k.starts_with("slave") && v.contains("offset=") => {
                        let v: Vec<String> = v
                            .split(',')
                            .map(|kv| match kv.split_once('=') {
                                Some((k @ ("offset" | "lag"), _)) => format!("{k}=*"),
                                _ => kv.to_string(),
                            })
                            .collect();
                        format!("{k}:{}", v.join(","))
                    }
                    _ => l,
                }
            })
            .collect();
        // CLUSTER INFO lists a `cluster_stats_messages_<type>_{sent,received}` counter only
        // once it is non-zero, so which types appear depends on the cluster's history: the
        // captured node had received a MEET (valkey-cli formed that cluster), the harness's
        // node 0 sends them. Those lines are left out; the totals stay (masked).
        lines.retain(|l| !is_message_type_counter(l));
        lines.sort();
        lines.join("\n")
    };
    let list = |items: Vec<String>, sort: bool| {
        let mut items = items;
        if sort {
            items.sort();
        }
        format!("[{}]", items.join(", "))
    };
    // A value after one of these keys is volatile.
    let volatile = |k: &Value| {
        matches!(k, Value::BulkString(b) if b == b"replication-offset" || b == b"id")
            || matches!(k, Value::SimpleString(s) if s == "replication-offset" || s == "id")
    };
    match v {
        Value::BulkString(b) => format!("bulk {:?}", text(&String::from_utf8_lossy(b))),
        Value::SimpleString(s) => format!("simple {:?}", text(s)),
        Value::VerbatimString { format, text: t } => format!("verbatim {format:?} {:?}", text(t)),
        Value::ServerError(e) => format!("error {:?}", subst(&format!("{e:?}"))),
        Value::Array(items) | Value::Set(items) => {
            let mut out = Vec::new();
            for (i, item) in items.iter().enumerate() {
                let masked = i > 0 && volatile(&items[i - 1]) && matches!(item, Value::Int(_));
                out.push(if masked {
                    "int *".into()
                } else {
                    canon(item, subst, false)
                });
            }
            list(out, sort)
        }
        Value::Map(pairs) => list(
            pairs
                .iter()
                .map(|(k, v)| {
                    let value = if volatile(k) && matches!(v, Value::Int(_)) {
                        "int *".into()
                    } else {
                        canon(v, subst, false)
                    };
                    format!("{} => {value}", canon(k, subst, false))
                })
                .collect(),
            sort,
        ),
        other => format!("{other:?}"),
    }
}

/// A per-type CLUSTER INFO message counter (not the `cluster_stats_messages_sent` /
/// `_received` totals).
fn is_message_type_counter(line: &str) -> bool {
    let key = line.split(':').next().unwrap_or_default();
    key.strip_prefix("cluster_stats_messages_")
        .is_some_and(|rest| rest.contains('_'))
}

/// INFO replication fields that differ between runs of the same cluster.
const VOLATILE_INFO: &[&str] = &[
    "master_replid",
    "master_replid2",
    "master_repl_offset",
    "second_repl_offset",
    "slave_read_repl_offset",
    "slave_repl_offset",
    "repl_backlog_first_byte_offset",
    "repl_backlog_histlen",
    "master_last_io_seconds_ago",
    // CLUSTER INFO: the epochs depend on how the cluster was formed (as in CLUSTER NODES);
    // the `cluster_stats_*` message and byte counters are masked too.
    "cluster_current_epoch",
    "cluster_my_epoch",
];

/// ROLE with its replication offsets masked: a primary's own and each replica's (a bulk
/// string), a replica's (an integer, last).
fn mask_role(v: &mut Value) {
    let Value::Array(items) = v else { return };
    match items.first() {
        Some(Value::BulkString(r)) if r == b"master" => {
            if let Some(offset) = items.get_mut(1) {
                *offset = Value::Int(0);
            }
            if let Some(Value::Array(replicas)) = items.get_mut(2) {
                for r in replicas {
                    if let Value::Array(r) = r {
                        if let Some(offset) = r.get_mut(2) {
                            *offset = Value::BulkString(b"*".to_vec());
                        }
                    }
                }
            }
        }
        Some(Value::BulkString(r)) if r == b"slave" => {
            if let Some(offset) = items.get_mut(4) {
                *offset = Value::Int(0);
            }
        }
        _ => {}
    }
}

/// One command on a new connection to the node in the captured node's place.
fn raw(cluster: &ValkeyCluster, pos: NodeRef, args: &[&str]) -> Result<String> {
    let mut conn = TcpStream::connect(cluster.node(pos).addr())?;
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    send(&mut conn, args)?;
    Ok(String::from_utf8_lossy(&read_reply(&mut conn)?).into_owned())
}

/// Waits until every node's reply to `args` satisfies `ok`: settings reach the other nodes
/// through cluster-bus gossip a few seconds later (reference, finding 14).
fn wait_all(cluster: &ValkeyCluster, args: &[&str], ok: impl Fn(&str) -> bool) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut all = true;
        for node in cluster.nodes() {
            all &= ok(&raw(cluster, node.pos, args)?);
        }
        if all {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{args:?}: not every node agrees after 30 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Slot 5061 (`bar`) MIGRATING from shard 0 to shard 1 (`on`), or stable again on both.
fn migration(cluster: &ValkeyCluster, on: bool) -> Result<()> {
    let (src, dst) = (
        cluster.node(place("127.0.10.1")?),
        cluster.node(place("127.0.10.2")?),
    );
    if on {
        dst.query::<()>(&["CLUSTER", "SETSLOT", BAR_SLOT, "IMPORTING", &src.node_id])?;
        src.query::<()>(&["CLUSTER", "SETSLOT", BAR_SLOT, "MIGRATING", &dst.node_id])?;
    } else {
        for n in [src, dst] {
            n.query::<()>(&["CLUSTER", "SETSLOT", BAR_SLOT, "STABLE"])?;
        }
    }
    Ok(())
}

/// How many nodes of a CLUSTER NODES reply announce a hostname.
fn hostnames(nodes: &str) -> usize {
    nodes.matches(",node-").count()
}

/// Sets the configuration the reference gives for the captures from `id` on (the steps
/// whose own replies are not in the corpus, e.g. c2-01 … c2-06).
fn prepare(cluster: &ValkeyCluster, id: &str) -> Result<()> {
    let at = |ip: &str| place(ip);
    let nodes = ["CLUSTER", "NODES"];
    match id {
        // Section 2: slot 5061 stable again after c1; `cluster-announce-hostname
        // node-<i>.example.test` on every node i (c2-01 … c2-06).
        "c2-07" => {
            migration(cluster, false)?;
            for (i, (ip, ..)) in CAPTURED.iter().enumerate() {
                let name = format!("node-{}.example.test", i + 1);
                cluster.config_set(at(ip)?, "cluster-announce-hostname", &name)?;
            }
            wait_all(cluster, &nodes, |r| hostnames(r) == 6)?;
        }
        // 2.2: `cluster-preferred-endpoint-type hostname` on every node (c2-14 … c2-19).
        "c2-20" => cluster.config_set_all("cluster-preferred-endpoint-type", "hostname")?,
        // c2-30 and c3-17 were taken with slot 5061 again MIGRATING / IMPORTING.
        "c2-30" | "c3-17" => migration(cluster, true)?,
        // 3.1: hostnames removed from 127.0.10.3 and .4 (c3-01, c3-02).
        "c3-03" => {
            migration(cluster, false)?;
            for ip in ["127.0.10.3", "127.0.10.4"] {
                cluster.config_set(at(ip)?, "cluster-announce-hostname", "")?;
            }
            wait_all(cluster, &nodes, |r| hostnames(r) == 4)?;
        }
        // 3.2: `unknown-endpoint` on 127.0.10.1 only (c3-10).
        "c3-11" => cluster.config_set(
            at("127.0.10.1")?,
            "cluster-preferred-endpoint-type",
            "unknown-endpoint",
        )?,
        // Section 4: every node back to `preferred=ip`, hostnames cleared. The client port
        // and TLS port are set by the captures c4-01 and c4-02 themselves.
        "c4-01" => {
            migration(cluster, false)?;
            cluster.config_set_all("cluster-preferred-endpoint-type", "ip")?;
            cluster.config_set_all("cluster-announce-hostname", "")?;
            wait_all(cluster, &nodes, |r| hostnames(r) == 0)?;
        }
        "c4-04" => wait_all(cluster, &nodes, |r| r.contains(":30001@"))?,
        // 4.2: `cluster-announce-client-ipv4 127.0.99.3` on 127.0.10.3 (c4-16).
        "c4-17" => {
            cluster.config_set(
                at("127.0.10.3")?,
                "cluster-announce-client-ipv4",
                "127.0.99.3",
            )?;
            wait_all(cluster, &nodes, |r| r.contains("127.0.99.3:30001@"))?;
        }
        // Section 5: the client address settings of section 4 undone (c5-07 shows
        // 127.0.10.3:6379), then `cluster-announce-human-nodename human-<i>` on every node
        // (c5-01 … c5-06). The names appear in no reply, so there is nothing to wait for.
        "c5-07" => {
            let n3 = at("127.0.10.3")?;
            cluster.config_set(n3, "cluster-announce-client-ipv4", "")?;
            cluster.config_set(n3, "cluster-announce-client-port", "0")?;
            cluster.config_set(n3, "cluster-announce-client-tls-port", "0")?;
            wait_all(cluster, &nodes, |r| !r.contains(":30001@"))?;
            for (i, (ip, ..)) in CAPTURED.iter().enumerate() {
                let name = format!("human-{}", i + 1);
                cluster.config_set(at(ip)?, "cluster-announce-human-nodename", &name)?;
            }
        }
        // 5.2: `availability-zone zone-c` on 127.0.10.3.
        "c5-17" => {
            cluster.config_set(at("127.0.10.3")?, "availability-zone", "zone-c")?;
            wait_all(cluster, &["CLUSTER", "SHARDS"], |r| r.contains("zone-c"))?;
        }
        _ => {}
    }
    Ok(())
}

fn recapture(out: Option<&str>) -> Result<bool> {
    let cluster = ValkeyCluster::start(ClusterSpec::new(3, 1))?;
    // The fresh cluster's ids and addresses, translated back to the captured ones.
    let mut pairs: Vec<(String, String)> = Vec::new();
    let mut to_fresh: Vec<(String, String)> = Vec::new();
    for (ip, id, shard_id, (s, n)) in CAPTURED {
        let node = cluster.node(NodeRef::new(s, n));
        let fresh_shard: String = node.query(&["CLUSTER", "MYSHARDID"])?;
        pairs.push((node.node_id.clone(), id.into()));
        pairs.push((fresh_shard, shard_id.into()));
        pairs.push((node.ip().to_string(), ip.into()));
        to_fresh.push((id.into(), node.node_id.clone()));
    }
    // Longest first, so that no address is a prefix of another's replacement.
    pairs.sort_by_key(|(fresh, _)| std::cmp::Reverse(fresh.len()));
    let subst = |s: &str| {
        pairs.iter().fold(s.to_string(), |acc, (fresh, captured)| {
            acc.replace(fresh, captured)
        })
    };
    // The captured cluster was made by valkey-cli, whose split gives slot 10922 to shard 1;
    // the harness's gives it to shard 2.
    cluster.migrate_slot(10922, 1)?;
    cluster.wait_healthy(Duration::from_secs(30))?;
    // What the captures assume exists before c1-16 (reference, section 1.7).
    let primary = cluster.node(NodeRef::new(0, 0));
    let _: () = primary.query(&["SET", "{bar}present", "here"])?;

    let mut conns = Connections(BTreeMap::new());
    let mut fresh_lines = Vec::new();
    let (mut same, mut differ, mut skipped) = (0, 0, 0);
    // Per session: replies as captured, different, not replayed.
    let mut tally: BTreeMap<String, (u32, u32, u32)> = BTreeMap::new();
    let mut session = String::new();
    for c in captures()? {
        let this = c.id.split('-').next().unwrap_or_default().to_string();
        let counts = tally.entry(this.clone()).or_default();
        let not_replayed = NOT_REPLAYED.iter().find(|(s, _)| *s == this);
        if !SESSIONS.contains(&this.as_str()) || not_replayed.is_some() {
            if this != session {
                if let Some((_, why)) = not_replayed {
                    println!("session {this} not replayed: {why}");
                }
                session = this;
            }
            skipped += 1;
            counts.2 += 1;
            continue;
        }
        if this != session {
            // Each session on fresh connections, as captured (a subscribed RESP2 connection
            // of c6 could not run c7's MULTI).
            conns = Connections(BTreeMap::new());
            session = this;
        }
        prepare(&cluster, &c.id).with_context(|| format!("preparing {}", c.id))?;
        let command = to_fresh
            .iter()
            .fold(c.command.clone(), |acc, (captured, fresh)| {
                acc.replace(captured, fresh)
            });
        let args: Vec<&str> = command.split(' ').collect();
        let frames = split_frames(&c.reply).len().max(1);
        let conn = conns.get(&cluster, &c.sent_to, c.resp3)?;
        send(conn, &args)?;
        let reply = read_frames(conn, frames).with_context(|| format!("{} {command}", c.id))?;
        fresh_lines.push(format!(
            "{}\t{}\t{}\t{}\t{}",
            c.id,
            if c.resp3 { "RESP3" } else { "RESP2" },
            c.sent_to,
            c.command,
            escape(&reply)
        ));
        let sort = c.command == "CLUSTER SHARDS";
        // Frame by frame; the type byte too: RESP2's `$-1` and RESP3's `_` are both Nil once
        // parsed.
        let parse = |b: &[u8]| -> Result<String> {
            let mut out = Vec::new();
            for frame in split_frames(b) {
                let mut v = redis::parse_redis_value(frame)?;
                if c.command == "ROLE" {
                    mask_role(&mut v);
                }
                out.push(format!(
                    "{} {}",
                    char::from(frame[0]),
                    canon(&v, &subst, sort)
                ));
            }
            Ok(out.join(" | "))
        };
        let (want, got) = (parse(&c.reply)?, parse(&reply)?);
        if want == got {
            same += 1;
            counts.0 += 1;
        } else {
            differ += 1;
            counts.1 += 1;
            println!(
                "{} {} {}: differs\n  captured {want}\n  now      {got}",
                c.id, c.sent_to, c.command
            );
        }
    }
    if let Some(path) = out {
        let header = "# Re-captured by scripts/recapture-replies (fresh ids and addresses).\n";
        std::fs::write(path, format!("{header}{}\n", fresh_lines.join("\n")))
            .with_context(|| format!("writing {path}"))?;
        println!("fresh replies written to {path}");
    }
    for (s, (ok, bad, skip)) in &tally {
        println!("  {s}: {ok} as captured, {bad} different, {skip} not replayed");
    }
    let total = same + differ + skipped;
    println!("{same} of {total} replies as captured, {differ} different, {skipped} not replayed");
    Ok(differ == 0)
}

fn main() -> ExitCode {
    let out = std::env::args().nth(1);
    match recapture(out.as_deref()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("recapture-replies: {e:#}");
            ExitCode::FAILURE
        }
    }
}
