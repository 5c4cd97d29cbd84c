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

/// The captured cluster: 127.0.10.N (hostname node-N.example.test) → proxy port 30000+N-1.
const NODES: [(&str, &str); 6] = [
    ("127.0.10.1", "a539d95fb51874a91ad88b8f1c379041378f6000"),
    ("127.0.10.2", "45a9dc707629b0798a2940235c6c132109b67d39"),
    ("127.0.10.3", "9be423741f0a3b818f633a9c16a1cf9ef42922d0"),
    ("127.0.10.4", "b6c576188309d2169652f87caed74d6812de842b"),
    ("127.0.10.5", "2dd88adea70885bb44cbfa95de22bc992c322cf1"),
    ("127.0.10.6", "fa68a450d251922408bbc98e153b47689f7d1d6f"),
];

fn routes() -> Routes {
    NODES
        .iter()
        .enumerate()
        .map(|(i, (ip, id))| {
            let route = Route {
                node: NodeRef::new(i as u32 / 2, i as u32 % 2),
                backend: format!("{ip}:6379").parse::<Backend>().unwrap(),
                node_id: Some(id.to_string()),
                hostname: Some(format!("node-{}.example.test", i + 1)),
                rewrite: true,
                primary: i % 2 == 0,
                tls_backend: None,
                slots: Vec::new(),
            };
            (30000 + i as u16, Arc::new(route))
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
            for (n, (ip, _)) in NODES.iter().enumerate() {
                assert!(!text.contains(ip), "{}: internal {ip} left in {text}", c.id);
                let name = format!("node-{}.example.test", n + 1);
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
    assert_eq!(golden("c1-06", ip), "-MOVED 12182 127.0.77.70:30002\r\n");
    assert_eq!(golden("c1-18", ip), "-ASK 5061 127.0.77.70:30001\r\n");
    assert_eq!(golden("c2-20", ip), "-MOVED 12182 127.0.77.70:30002\r\n");
    assert_eq!(
        golden("c2-20", "valkey.example.com"),
        "-MOVED 12182 valkey.example.com:30002\r\n"
    );
    // CLUSTER SLOTS, RESP2: endpoint and port of every node.
    assert!(golden("c1-02", ip).starts_with(
        "*3\r\n*4\r\n:0\r\n:5460\r\n*4\r\n$11\r\n127.0.77.70\r\n:30000\r\n$40\r\na539d95fb51874a91ad88b8f1c379041378f6000\r\n*0\r\n*4\r\n$11\r\n127.0.77.70\r\n:30004\r\n"
    ));
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
    assert!(golden("c8-01", ip).contains("*3\r\n$11\r\n127.0.77.70\r\n$5\r\n30004\r\n"));
    // INFO: master_host/master_port and slaveN lines.
    let g = golden("c8-06", ip);
    assert!(
        g.contains("master_host:127.0.77.70\r\nmaster_port:30000\r\n"),
        "{g}"
    );
    let g = golden("c8-05", ip);
    assert!(
        g.contains("slave0:ip=127.0.77.70,port=30004,state=online"),
        "{g}"
    );
    // Bulk lengths follow the new content.
    for id in ["c1-04", "c1-10", "c8-06", "c8-07", "c2-24"] {
        let g = golden(id, "valkey.example.com");
        assert_eq!(frames(g.as_bytes()), 1, "{id}");
    }
}

#[test]
fn shards_in_both_protocols_and_with_hostnames() {
    // RESP3 map: ip and endpoint become the proxy, the port its listener, tls-port goes.
    let g = golden("c1-09", "127.0.77.70");
    assert!(g.contains("$2\r\nid\r\n$40\r\n9be423741f0a3b818f633a9c16a1cf9ef42922d0\r\n$4\r\nport\r\n:30002\r\n$2\r\nip\r\n$11\r\n127.0.77.70\r\n$8\r\nendpoint\r\n$11\r\n127.0.77.70\r\n"), "{g}");
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
        .collect();
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
    for (port, slots) in [
        (30000u16, (0u16, 5460u16)),
        (30001, (5461, 10922)),
        (30002, (10923, 16383)),
    ] {
        let mut r = (*routes[&port]).clone();
        r.slots = vec![slots];
        routes.insert(port, Arc::new(r));
    }
    let map = AddressMap::new("127.0.77.70", &routes);
    for (id, want) in [
        ("c3-11", "-MOVED 12182 :30002\r\n"),
        ("c3-03", "-MOVED 12182 ?:30002\r\n"),
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
