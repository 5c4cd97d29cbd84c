//! Golden tests: every reply captured from a real Valkey 9.1.2 cluster (both protocols, every
//! endpoint type: ip, hostname, unknown-endpoint, `?`, client port and client IP announced;
//! `testdata/valkey-9.1.2-captures.tsv`, from shared/reference) goes through the rewriting
//! pipeline as a proxy sees it: the command on the request side, the reply on the reply side.

use std::collections::BTreeMap;
use std::sync::Arc;

use proptest::prelude::*;
use shardgate_crds::NodeRef;
use shardgate_proxy::model::{Backend, Route, Routes};
use shardgate_proxy::resp::{Scan, Scanner};
use shardgate_proxy::rewrite::stream::{flatten, Limits, ReplySide, RequestSide, Shared};
use shardgate_proxy::rewrite::{AddressMap, Report};

/// The captured cluster, as its CLUSTER NODES says (`c1-04`, `c1-14`): three primaries
/// owning slots in order, each with one replica. The fixture puts each shard's primary first
/// (the proxy's port layout: `30000 + 2 * shard + node`), as discovery would. Each node's
/// hostname (in the captures that announce them) is `node-N.example.test` for `127.0.10.N`.
/// `fixture_agrees_with_the_captures` checks this table against every captured CLUSTER NODES.
struct CapturedNode {
    ip: &'static str,
    id: &'static str,
    node: (u32, u32),
    primary: bool,
    /// The proxy's port for it.
    port: u16,
}

const NODES: [CapturedNode; 6] = [
    CapturedNode {
        ip: "127.0.10.1",
        id: "a539d95fb51874a91ad88b8f1c379041378f6000",
        node: (0, 0),
        primary: true,
        port: 30000,
    },
    CapturedNode {
        ip: "127.0.10.5",
        id: "2dd88adea70885bb44cbfa95de22bc992c322cf1",
        node: (0, 1),
        primary: false,
        port: 30001,
    },
    CapturedNode {
        ip: "127.0.10.2",
        id: "45a9dc707629b0798a2940235c6c132109b67d39",
        node: (1, 0),
        primary: true,
        port: 30002,
    },
    CapturedNode {
        ip: "127.0.10.6",
        id: "fa68a450d251922408bbc98e153b47689f7d1d6f",
        node: (1, 1),
        primary: false,
        port: 30003,
    },
    CapturedNode {
        ip: "127.0.10.3",
        id: "9be423741f0a3b818f633a9c16a1cf9ef42922d0",
        node: (2, 0),
        primary: true,
        port: 30004,
    },
    CapturedNode {
        ip: "127.0.10.4",
        id: "b6c576188309d2169652f87caed74d6812de842b",
        node: (2, 1),
        primary: false,
        port: 30005,
    },
];

/// The slots each shard's primary owns in the captures (outside a migration).
const SHARD_SLOTS: [(u16, u16); 3] = [(0, 5460), (5461, 10922), (10923, 16383)];

impl CapturedNode {
    fn hostname(&self) -> String {
        format!("node-{}.example.test", self.ip.rsplit('.').next().unwrap())
    }
}

fn node_by_id(id: &str) -> &'static CapturedNode {
    NODES
        .iter()
        .find(|n| n.id == id)
        .unwrap_or_else(|| panic!("{id} is not a captured node"))
}

fn routes() -> Routes {
    NODES
        .iter()
        .map(|n| {
            let route = Route {
                node: NodeRef::new(n.node.0, n.node.1),
                backend: format!("{}:6379", n.ip).parse::<Backend>().unwrap(),
                node_id: Some(n.id.to_string()),
                hostname: Some(n.hostname()),
                rewrite: true,
                primary: n.primary,
                tls_backend: None,
                slots: Vec::new(),
            };
            (n.port, Arc::new(route))
        })
        .collect()
}

struct Capture {
    id: String,
    command: String,
    reply: Vec<u8>,
}

fn unescape(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = vec![];
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' {
            match b[i + 1] {
                b'r' => out.push(b'\r'),
                b'n' => out.push(b'\n'),
                b'\\' => out.push(b'\\'),
                b'x' => {
                    out.push(u8::from_str_radix(&s[i + 2..i + 4], 16).unwrap());
                    i += 2;
                }
                other => panic!("bad escape \\{}", other as char),
            }
            i += 2;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

fn captures() -> Vec<Capture> {
    let text = include_str!("../testdata/valkey-9.1.2-captures.tsv");
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            Capture {
                id: f[0].into(),
                command: f[3].into(),
                reply: unescape(f[4]),
            }
        })
        .collect()
}

fn resp_command(cmd: &str) -> Vec<u8> {
    let args: Vec<&str> = cmd.split(' ').collect();
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n{a}\r\n", a.len()).as_bytes());
    }
    out
}

/// The client sends `command`; the server's `reply` arrives in the pieces cut at `cuts`.
fn through_proxy(
    map: &AddressMap,
    command: &str,
    reply: &[u8],
    cuts: &[usize],
) -> (Vec<u8>, Report) {
    let shared = Shared::new(true);
    RequestSide::new(Limits::default())
        .observe(&resp_command(command), &shared)
        .unwrap();
    let mut side = ReplySide::new(Limits::default());
    let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (reply.len() + 1)).collect();
    bounds.push(reply.len());
    bounds.sort_unstable();
    let (mut out, mut report, mut start) = (vec![], Report::default(), 0);
    for b in bounds {
        let piece = &reply[start..b];
        let mut segs = vec![];
        side.process(piece, &shared, map, &mut segs, &mut report)
            .unwrap();
        out.extend(flatten(piece, &segs));
        start = b;
    }
    (out, report)
}

fn frames(bytes: &[u8]) -> usize {
    let mut s = Scanner::default();
    let (mut i, mut n) = (0, 0);
    while i < bytes.len() {
        match s.scan(bytes, i).unwrap() {
            Scan::Complete { end } => {
                n += 1;
                i = end;
            }
            Scan::Incomplete => panic!("truncated output"),
        }
    }
    n
}

fn is_topology(c: &Capture) -> bool {
    let cmd = c.command.to_ascii_uppercase();
    [
        "CLUSTER SLOTS",
        "CLUSTER SHARDS",
        "CLUSTER NODES",
        "CLUSTER REPLICAS",
        "ROLE",
        "INFO replication",
    ]
    .iter()
    .any(|k| cmd.starts_with(&k.to_ascii_uppercase()))
        || c.reply.starts_with(b"-MOVED ")
        || c.reply.starts_with(b"-ASK ")
}

/// Redirects whose address the proxy cannot know: unknown endpoint, `?`, and a cluster that
/// already announces other client addresses (section 4 of the reference).
fn unmappable_redirect(reply: &[u8]) -> bool {
    let s = String::from_utf8_lossy(reply);
    (s.starts_with("-MOVED") || s.starts_with("-ASK"))
        && (s.contains(" :") || s.contains(" ?:") || s.contains(":30001"))
}

#[test]
fn every_capture_keeps_its_shape_and_loses_every_internal_address() {
    let caps = captures();
    assert!(caps.len() > 100, "only {} captures", caps.len());
    for host in ["127.0.77.70", "valkey.example.com"] {
        let map = AddressMap::new(host, &routes());
        let mut rewritten = 0;
        for c in &caps {
            let (out, report) = through_proxy(&map, &c.command, &c.reply, &[]);
            assert_eq!(
                frames(&out),
                frames(&c.reply),
                "{}: frame count changed",
                c.id
            );
            if !is_topology(c) {
                assert_eq!(out, c.reply, "{}: a non-topology reply changed", c.id);
                continue;
            }
            let text = String::from_utf8_lossy(&out);
            if unmappable_redirect(&c.reply) {
                assert_eq!(
                    out, c.reply,
                    "{}: an unknown redirect must pass whole",
                    c.id
                );
                assert_eq!(report.unknown.len(), 1, "{}", c.id);
                continue;
            }
            for n in &NODES {
                assert!(
                    !text.contains(n.ip),
                    "{}: internal {} left in {text}",
                    c.id,
                    n.ip
                );
                let name = n.hostname();
                assert!(
                    !text.contains(&name),
                    "{}: internal {name} left in {text}",
                    c.id
                );
            }
            assert!(
                !text.contains("127.0.99.3"),
                "{}: announced client IP left: {text}",
                c.id
            );
            assert!(
                report.unknown.is_empty(),
                "{}: unknown {:?}",
                c.id,
                report.unknown
            );
            assert!(report.rewritten > 0, "{}: nothing rewritten", c.id);
            rewritten += 1;
        }
        assert!(
            rewritten > 60,
            "only {rewritten} topology captures rewritten"
        );
    }
}

fn golden(id: &str, host: &str) -> String {
    let c = captures().into_iter().find(|c| c.id == id).unwrap();
    let (out, _) = through_proxy(&AddressMap::new(host, &routes()), &c.command, &c.reply, &[]);
    String::from_utf8(out).unwrap()
}

#[test]
fn exact_rewrites() {
    let ip = "127.0.77.70";
    assert_eq!(golden("c1-06", ip), "-MOVED 12182 127.0.77.70:30004\r\n");
    assert_eq!(golden("c1-18", ip), "-ASK 5061 127.0.77.70:30002\r\n");
    assert_eq!(golden("c2-20", ip), "-MOVED 12182 127.0.77.70:30004\r\n");
    assert_eq!(
        golden("c2-20", "valkey.example.com"),
        "-MOVED 12182 valkey.example.com:30004\r\n"
    );
    // CLUSTER SLOTS, RESP2: endpoint and port of every node, each range's primary first.
    assert_eq!(
        golden("c1-02", ip),
        "*3\r\n\
         *4\r\n:0\r\n:5460\r\n\
         *4\r\n$11\r\n127.0.77.70\r\n:30000\r\n$40\r\na539d95fb51874a91ad88b8f1c379041378f6000\r\n*0\r\n\
         *4\r\n$11\r\n127.0.77.70\r\n:30001\r\n$40\r\n2dd88adea70885bb44cbfa95de22bc992c322cf1\r\n*0\r\n\
         *4\r\n:5461\r\n:10922\r\n\
         *4\r\n$11\r\n127.0.77.70\r\n:30002\r\n$40\r\n45a9dc707629b0798a2940235c6c132109b67d39\r\n*0\r\n\
         *4\r\n$11\r\n127.0.77.70\r\n:30003\r\n$40\r\nfa68a450d251922408bbc98e153b47689f7d1d6f\r\n*0\r\n\
         *4\r\n:10923\r\n:16383\r\n\
         *4\r\n$11\r\n127.0.77.70\r\n:30004\r\n$40\r\n9be423741f0a3b818f633a9c16a1cf9ef42922d0\r\n*0\r\n\
         *4\r\n$11\r\n127.0.77.70\r\n:30005\r\n$40\r\nb6c576188309d2169652f87caed74d6812de842b\r\n*0\r\n"
    );
    // Unknown endpoint: the NULL (RESP2 `$-1`, RESP3 `_`) stays, the port is the proxy's.
    let g = golden("c3-12", ip);
    assert!(
        g.starts_with("*3\r\n*4\r\n:0\r\n:5460\r\n*4\r\n$-1\r\n:30000\r\n"),
        "{g}"
    );
    let g = golden("c3-15", ip);
    assert!(
        g.starts_with("*3\r\n*4\r\n:0\r\n:5460\r\n*4\r\n_\r\n:30000\r\n"),
        "{g}"
    );
    // CLUSTER NODES keeps the bus port and everything after the address.
    let g = golden("c1-04", ip);
    assert!(g.contains("\na539d95fb51874a91ad88b8f1c379041378f6000 127.0.77.70:30000@16379 myself,master - 0 0 1 connected 0-5460\n"), "{g}");
    let g = golden("c1-04", "valkey.example.com");
    assert!(
        g.contains(" valkey.example.com:30000@16379,valkey.example.com myself,master "),
        "{g}"
    );
    // A replica's ROLE names its primary; a primary's names its replicas (port as a string).
    assert_eq!(
        golden("c8-02", ip).lines().take(5).collect::<Vec<_>>()[..4],
        ["*5", "$5", "slave", "$11"]
    );
    assert!(golden("c8-02", ip).contains("127.0.77.70\r\n:30000\r\n"));
    assert!(golden("c8-01", ip).contains("*3\r\n$11\r\n127.0.77.70\r\n$5\r\n30001\r\n"));
    // INFO: master_host/master_port and slaveN lines.
    let g = golden("c8-06", ip);
    assert!(
        g.contains("master_host:127.0.77.70\r\nmaster_port:30000\r\n"),
        "{g}"
    );
    let g = golden("c8-05", ip);
    assert!(
        g.contains("slave0:ip=127.0.77.70,port=30001,state=online"),
        "{g}"
    );
    // Bulk lengths follow the new content.
    for id in ["c1-04", "c1-10", "c8-06", "c8-07", "c2-24"] {
        let g = golden(id, "valkey.example.com");
        assert_eq!(frames(g.as_bytes()), 1, "{id}");
    }
}

/// The `CLUSTER NODES` lines of a reply (RESP2 bulk or RESP3 verbatim `txt:`).
fn nodes_lines(reply: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(reply).into_owned();
    let body = text.split_once("\r\n").unwrap().1;
    let body = body.strip_prefix("txt:").unwrap_or(body);
    body.trim_end_matches("\r\n")
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

#[test]
fn fixture_agrees_with_the_captures() {
    // Every captured CLUSTER NODES names the table's nodes in the table's roles, each
    // replica following its shard's primary, each primary owning its shard's slots.
    let caps: Vec<Capture> = captures()
        .into_iter()
        .filter(|c| c.command == "CLUSTER NODES")
        .collect();
    assert!(
        caps.len() >= 8,
        "only {} CLUSTER NODES captures",
        caps.len()
    );
    for c in &caps {
        let lines = nodes_lines(&c.reply);
        assert_eq!(lines.len(), NODES.len(), "{}", c.id);
        for line in lines {
            let f: Vec<&str> = line.split(' ').collect();
            let n = node_by_id(f[0]);
            let ip = f[1].split(':').next().unwrap();
            // Section 4 of the reference announces a client IP for 127.0.10.3.
            let announced = ip == "127.0.99.3" && n.ip == "127.0.10.3";
            assert!(ip == n.ip || announced, "{}: {line}", c.id);
            let flags: Vec<&str> = f[2].split(',').collect();
            assert_eq!(flags.contains(&"master"), n.primary, "{}: {line}", c.id);
            assert_eq!(flags.contains(&"slave"), !n.primary, "{}: {line}", c.id);
            if n.primary {
                let (lo, hi) = SHARD_SLOTS[n.node.0 as usize];
                assert_eq!(f[8], format!("{lo}-{hi}"), "{}: {line}", c.id);
            } else {
                let primary = node_by_id(f[3]);
                assert!(primary.primary, "{}: {line}", c.id);
                assert_eq!(primary.node.0, n.node.0, "{}: {line}", c.id);
            }
        }
    }
}

#[test]
fn cluster_nodes_names_each_node_at_its_own_port_in_its_role() {
    // Each line keeps its id, flags, primary, epochs, link state and slots; only the
    // address becomes the proxy's (the table's port for that id, the bus port kept).
    for (id, host) in [
        ("c1-04", "127.0.77.70"),
        ("c1-10", "127.0.77.70"),
        ("c1-14", "127.0.77.70"),
        ("c1-28", "127.0.77.70"),
        ("c1-29", "127.0.77.70"),
        ("c2-09", "valkey.example.com"),
        ("c2-23", "valkey.example.com"),
    ] {
        let c = captures().into_iter().find(|c| c.id == id).unwrap();
        let out = golden(id, host);
        let (before, after) = (nodes_lines(&c.reply), nodes_lines(out.as_bytes()));
        assert_eq!(before.len(), after.len(), "{id}");
        for (was, now) in before.iter().zip(&after) {
            let (was, now): (Vec<&str>, Vec<&str>) =
                (was.split(' ').collect(), now.split(' ').collect());
            let n = node_by_id(was[0]);
            let address = if host.parse::<std::net::IpAddr>().is_err() {
                // A proxy reached by name announces it as every node's hostname too.
                format!("{host}:{}@16379,{host}", n.port)
            } else {
                format!("{host}:{}@16379", n.port)
            };
            assert_eq!(now[1], address, "{id}: {}", now.join(" "));
            assert_eq!(now[0], was[0], "{id}");
            assert_eq!(now[2..], was[2..], "{id}: only the address changes");
        }
    }
}

#[test]
fn replication_replies_name_each_peer_at_its_own_port() {
    let ip = "127.0.77.70";
    // ROLE of the primary 127.0.10.1: its replica 127.0.10.5, offsets kept.
    assert_eq!(
        golden("c8-01", ip),
        "*3\r\n$6\r\nmaster\r\n:1425\r\n*1\r\n*3\r\n$11\r\n127.0.77.70\r\n$5\r\n30001\r\n$4\r\n1388\r\n"
    );
    // CLUSTER REPLICAS of 127.0.10.3: 127.0.10.4 at its port, as a replica of the same id.
    let g = golden("c1-05", ip);
    assert!(
        g.contains("\r\nb6c576188309d2169652f87caed74d6812de842b 127.0.77.70:30005@16379 slave 9be423741f0a3b818f633a9c16a1cf9ef42922d0 "),
        "{g}"
    );
}

#[test]
fn shards_in_both_protocols_and_with_hostnames() {
    // RESP3 map: ip and endpoint become the proxy, the port its listener, tls-port goes.
    let g = golden("c1-09", "127.0.77.70");
    assert!(g.contains("$2\r\nid\r\n$40\r\n9be423741f0a3b818f633a9c16a1cf9ef42922d0\r\n$4\r\nport\r\n:30004\r\n$2\r\nip\r\n$11\r\n127.0.77.70\r\n$8\r\nendpoint\r\n$11\r\n127.0.77.70\r\n"), "{g}");
    // With hostnames announced and a proxy reached by name: hostname is the proxy's name,
    // and the internal IP key goes (its element count shrinks accordingly).
    let g = golden("c2-22", "valkey.example.com");
    assert!(!g.contains("$2\r\nip\r\n"), "{g}");
    assert!(
        g.contains("$8\r\nhostname\r\n$18\r\nvalkey.example.com\r\n"),
        "{g}"
    );
    assert_eq!(frames(g.as_bytes()), 1);
}

/// Two nodes that speak TLS only (`port 0`, `tls-port`), asked over TLS: Valkey 9.1.2's
/// CLUSTER SHARDS names `tls-port` and no `port` (captured from valkey-server, RESP2 and,
/// after HELLO 3, RESP3).
const TLS_ONLY_SHARDS: &[u8] = b"*2\r\n*6\r\n$5\r\nslots\r\n*2\r\n:8001\r\n:16383\r\n$5\r\nnodes\r\n*1\r\n*14\r\n$2\r\nid\r\n$40\r\ne362793ff9eef72b3dc053abae7a164525e7c7f1\r\n$8\r\ntls-port\r\n:27002\r\n$2\r\nip\r\n$9\r\n127.0.0.1\r\n$8\r\nendpoint\r\n$9\r\n127.0.0.1\r\n$4\r\nrole\r\n$6\r\nmaster\r\n$18\r\nreplication-offset\r\n:0\r\n$6\r\nhealth\r\n$6\r\nonline\r\n$2\r\nid\r\n$40\r\nbcff7225fc9c84dd79943a2453ac4e78f6f27772\r\n*6\r\n$5\r\nslots\r\n*2\r\n:0\r\n:8000\r\n$5\r\nnodes\r\n*1\r\n*14\r\n$2\r\nid\r\n$40\r\n81c302d01c2b9553c64817e614a287debb2542d2\r\n$8\r\ntls-port\r\n:27001\r\n$2\r\nip\r\n$9\r\n127.0.0.1\r\n$8\r\nendpoint\r\n$9\r\n127.0.0.1\r\n$4\r\nrole\r\n$6\r\nmaster\r\n$18\r\nreplication-offset\r\n:0\r\n$6\r\nhealth\r\n$6\r\nonline\r\n$2\r\nid\r\n$40\r\n5fc1adf13e633136cc0fac8a406c3d8e0e8c7bfa\r\n";

const TLS_ONLY_SHARDS_RESP3: &[u8] = b"*2\r\n%3\r\n$5\r\nslots\r\n*2\r\n:8001\r\n:16383\r\n$5\r\nnodes\r\n*1\r\n%7\r\n$2\r\nid\r\n$40\r\ne362793ff9eef72b3dc053abae7a164525e7c7f1\r\n$8\r\ntls-port\r\n:27002\r\n$2\r\nip\r\n$9\r\n127.0.0.1\r\n$8\r\nendpoint\r\n$9\r\n127.0.0.1\r\n$4\r\nrole\r\n$6\r\nmaster\r\n$18\r\nreplication-offset\r\n:0\r\n$6\r\nhealth\r\n$6\r\nonline\r\n$2\r\nid\r\n$40\r\nbcff7225fc9c84dd79943a2453ac4e78f6f27772\r\n%3\r\n$5\r\nslots\r\n*2\r\n:0\r\n:8000\r\n$5\r\nnodes\r\n*1\r\n%7\r\n$2\r\nid\r\n$40\r\n81c302d01c2b9553c64817e614a287debb2542d2\r\n$8\r\ntls-port\r\n:27001\r\n$2\r\nip\r\n$9\r\n127.0.0.1\r\n$8\r\nendpoint\r\n$9\r\n127.0.0.1\r\n$4\r\nrole\r\n$6\r\nmaster\r\n$18\r\nreplication-offset\r\n:0\r\n$6\r\nhealth\r\n$6\r\nonline\r\n$2\r\nid\r\n$40\r\n5fc1adf13e633136cc0fac8a406c3d8e0e8c7bfa\r\n";

#[test]
fn tls_only_nodes_are_named_at_their_listeners_port_for_plain_clients() {
    // The proxy dials them over TLS (--tls-backend tls); its node ports speak plain, so a
    // client there reads `port`: `tls-port` becomes `port`, in its place, at the listener.
    let routes: Routes = [
        ("81c302d01c2b9553c64817e614a287debb2542d2", 27001, 0, 31000),
        ("e362793ff9eef72b3dc053abae7a164525e7c7f1", 27002, 1, 31001),
    ]
    .into_iter()
    .map(|(id, port, shard, listener)| {
        let route = Route {
            node: NodeRef::new(shard, 0),
            backend: format!("127.0.0.1:{port}").parse::<Backend>().unwrap(),
            node_id: Some(id.to_string()),
            hostname: None,
            rewrite: true,
            primary: true,
            tls_backend: None,
            slots: Vec::new(),
        };
        (listener, Arc::new(route))
    })
    .collect();
    let map = AddressMap::new("203.0.113.9", &routes);
    for (reply, header) in [(TLS_ONLY_SHARDS, "*14"), (TLS_ONLY_SHARDS_RESP3, "%7")] {
        let (out, report) = through_proxy(&map, "CLUSTER SHARDS", reply, &[]);
        let node = |id: &str, port: u16| {
            format!("{header}\r\n$2\r\nid\r\n$40\r\n{id}\r\n$4\r\nport\r\n:{port}\r\n$2\r\nip\r\n$11\r\n203.0.113.9\r\n$8\r\nendpoint\r\n$11\r\n203.0.113.9\r\n$4\r\nrole\r\n$6\r\nmaster\r\n")
        };
        let out = String::from_utf8(out).unwrap();
        assert!(
            out.contains(&node("e362793ff9eef72b3dc053abae7a164525e7c7f1", 31001)),
            "{out}"
        );
        assert!(
            out.contains(&node("81c302d01c2b9553c64817e614a287debb2542d2", 31000)),
            "{out}"
        );
        assert!(
            !out.contains("tls-port") && !out.contains("127.0.0.1"),
            "{out}"
        );
        assert!(
            report.unknown.is_empty() && report.rewritten == 2,
            "{report:?}"
        );
        assert_eq!(frames(out.as_bytes()), 1);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn any_split_into_reads_gives_the_same_output(
        which in 0usize..1000,
        cuts in proptest::collection::vec(0usize..4000, 0..8),
    ) {
        let caps = captures();
        let c = &caps[which % caps.len()];
        let map = AddressMap::new("127.0.77.70", &routes());
        let whole = through_proxy(&map, &c.command, &c.reply, &[]);
        let split = through_proxy(&map, &c.command, &c.reply, &cuts);
        prop_assert_eq!(whole, split, "{}", c.id);
    }
}

#[test]
fn pipelined_captures_in_one_stream() {
    // All captures of one protocol back to back, as one pipelined connection sees them.
    let caps: Vec<Capture> = captures()
        .into_iter()
        .filter(|c| !c.reply.starts_with(b">"))
        // A HELLO 3 switches the connection to RESP3, after which arrays are replies, not
        // pushes: no connection sends the RESP2 pub/sub captures after it.
        .filter(|c| !c.command.starts_with("HELLO"))
        .collect();
    // The subscribe captures last: Valkey refuses MULTI and CLIENT REPLY on a subscribed
    // RESP2 connection (and the proxy gives up on a connection that sends them there).
    let mut caps = caps;
    caps.sort_by_key(|c| c.command.to_ascii_uppercase().contains("SUBSCRIBE"));
    let map = AddressMap::new("127.0.77.70", &routes());
    let shared = Shared::new(true);
    let mut req = RequestSide::new(Limits::default());
    let mut side = ReplySide::new(Limits::default());
    let mut expected = BTreeMap::new();
    let mut stream = vec![];
    for c in caps.iter().filter(|c| frames(&c.reply) == 1) {
        req.observe(&resp_command(&c.command), &shared).unwrap();
        expected.insert(
            stream.len(),
            through_proxy(&map, &c.command, &c.reply, &[]).0,
        );
        stream.extend_from_slice(&c.reply);
    }
    let mut segs = vec![];
    let mut report = Report::default();
    side.process(&stream, &shared, &map, &mut segs, &mut report)
        .unwrap();
    let out = flatten(&stream, &segs);
    let want: Vec<u8> = expected.values().flatten().copied().collect();
    assert_eq!(
        String::from_utf8_lossy(&out),
        String::from_utf8_lossy(&want)
    );
}

#[test]
fn redirects_without_a_host_are_mapped_by_slot_when_the_source_knows_slots() {
    // Seed discovery knows each primary's slots (section 3 of the reference: unknown-endpoint
    // and `?` redirects name only a port).
    let mut routes = routes();
    for n in NODES.iter().filter(|n| n.primary) {
        let mut r = (*routes[&n.port]).clone();
        r.slots = vec![SHARD_SLOTS[n.node.0 as usize]];
        routes.insert(n.port, Arc::new(r));
    }
    let map = AddressMap::new("127.0.77.70", &routes);
    for (id, want) in [
        ("c3-11", "-MOVED 12182 :30004\r\n"),
        ("c3-03", "-MOVED 12182 ?:30004\r\n"),
    ] {
        let c = captures().into_iter().find(|c| c.id == id).unwrap();
        let (out, report) = through_proxy(&map, &c.command, &c.reply, &[]);
        assert_eq!(String::from_utf8(out).unwrap(), want, "{id}");
        assert!(
            report.unknown.is_empty() && report.refresh,
            "{id}: {report:?}"
        );
    }
    // Without slots (a route file), they stay whole and are reported.
    let c = captures().into_iter().find(|c| c.id == "c3-11").unwrap();
    let (out, report) = through_proxy(
        &AddressMap::new("127.0.77.70", &self::routes()),
        &c.command,
        &c.reply,
        &[],
    );
    assert_eq!(out, c.reply);
    assert_eq!(report.unknown.len(), 1);
}
