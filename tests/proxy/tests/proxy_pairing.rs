//! Pairing exactly as Valkey pairs, or not at all (issue 12): scripts sent to a real Valkey
//! node directly and through the rewriting proxy give the same bytes, once the direct
//! transcript's internal addresses are mapped to the proxy's. The scripts are the inputs
//! that desynchronised the pairing: inline commands with quotes; commands Valkey rejects
//! (`CLIENT REPLY` with the wrong arity or inside MULTI, `MULTI x`, `EXEC x`,
//! `DISCARD x`); RESP3 arrays on a subscribed connection that look like pub/sub frames;
//! unsubscribing from everything with mixed subscriptions. And where a pairing is still
//! wrong, a stored value is never rewritten: a reply is rebuilt only in its command's
//! exact shape. Bad input gets Valkey's own protocol error line, as directly. The random
//! scripts of the same comparison are in `fuzz_differential.rs`.

use std::borrow::Cow;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use shardgate_crds::{NodeRef, PortLayout};
use shardgate_harness::addr::free_port_range;
use shardgate_harness::http::{get, metric};
use shardgate_harness::valkey::{hash_tag_for_slot, zero_ping_pong, ClusterSpec, ValkeyCluster};
use shardgate_proxy::model::Backend;
use shardgate_proxy::resp::frame::{encode, parse, Frame};
use shardgate_proxy::{Proxy, ProxyConfig, ProxyHandle, SourceConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::block_in_place;

const LO: Ipv4Addr = Ipv4Addr::LOCALHOST;

/// Two primaries behind a rewriting proxy; the scripts go to the first, and their keys
/// and channels are in its slots.
struct Fixture {
    cluster: Arc<ValkeyCluster>,
    _proxy: ProxyHandle,
    layout: PortLayout,
    admin: SocketAddr,
}

impl Fixture {
    async fn start() -> Fixture {
        let cluster =
            Arc::new(block_in_place(|| ValkeyCluster::start(ClusterSpec::new(2, 0))).unwrap());
        let port = free_port_range(LO, 2);
        let layout = PortLayout::new(u32::from(port), 2, 0, None).unwrap();
        let mut config = ProxyConfig::new(SourceConfig::Seed {
            seeds: vec![Backend::ip(cluster.node(NodeRef::new(0, 0)).addr())],
            base_port: port,
            ports_per_shard: None,
            refresh: Duration::from_secs(10),
        });
        config.listen_ip = LO.into();
        config.admin_addr = Some(SocketAddr::from((LO, 0)));
        config.rewrite = true;
        config.advertise_host = Some("127.0.0.1".into());
        config.drain_timeout = Duration::from_millis(200);
        let proxy = Proxy::start(config).await.unwrap();
        assert!(proxy.wait_ready(Duration::from_secs(10)).await);
        let admin = proxy.admin_addr().unwrap();
        Fixture {
            cluster,
            _proxy: proxy,
            layout,
            admin,
        }
    }

    /// `name` in the first node's slots.
    fn key(&self, name: &str) -> String {
        format!("{}{name}", hash_tag_for_slot(0))
    }

    /// A script with each `@name` made a key in the first node's slots.
    fn keys(&self, script: &str) -> Vec<u8> {
        script.replace('@', &hash_tag_for_slot(0)).into_bytes()
    }

    fn node(&self) -> SocketAddr {
        self.cluster.node(NodeRef::new(0, 0)).addr()
    }

    fn metric(&self, sample: &str) -> f64 {
        metric(&get(self.admin, "/metrics").unwrap().1, sample).unwrap_or(0.0)
    }

    fn set(&self, key: &str, value: &str) {
        let node = self.cluster.node(NodeRef::new(0, 0));
        let _: () = block_in_place(|| node.query(&["SET", key, value])).unwrap();
    }

    /// Users on the first node (password `pw`) who may run every command but MULTI
    /// (`nomulti`), or but CLIENT REPLY (`noreply`).
    fn users_refused_a_command(&self) {
        let node = self.cluster.node(NodeRef::new(0, 0));
        for (user, denied) in [("nomulti", "-multi"), ("noreply", "-client|reply")] {
            let acl = [
                "ACL", "SETUSER", user, "on", ">pw", "+@all", denied, "~*", "&*",
            ];
            let _: () = block_in_place(|| node.query(&acl)).unwrap();
        }
    }

    fn cluster_nodes(&self) -> String {
        let node = self.cluster.node(NodeRef::new(0, 0));
        block_in_place(|| node.query(&["CLUSTER", "NODES"])).unwrap()
    }

    /// The script's transcript directly and through the proxy.
    async fn both(&self, script: &[u8]) -> (Vec<u8>, Vec<u8>) {
        let direct = transcript(self.node(), script).await;
        let port = self.layout.port(NodeRef::new(0, 0)).unwrap();
        let proxied = transcript(SocketAddr::from((LO, port)), script).await;
        (direct, proxied)
    }

    /// Requires the two transcripts to be the same frames, byte for byte, once the direct
    /// one's internal address is mapped to the proxy's listener everywhere but in the
    /// stored `values` (and the connection ids in HELLO replies are set aside).
    fn assert_same(&self, script: &[u8], values: &[String], direct: &[u8], proxied: &[u8]) {
        let mapping = Mapping {
            nodes: (0..2)
                .map(|s| {
                    let n = NodeRef::new(s, 0);
                    (self.cluster.node(n).addr(), self.layout.port(n).unwrap())
                })
                .collect(),
            values,
        };
        let (d, p) = (frames(direct), frames(proxied));
        let show = |b: &[u8]| b.escape_ascii().to_string();
        assert_eq!(
            d.len(),
            p.len(),
            "{}\ndirect:  {}\nproxied: {}",
            show(script),
            show(direct),
            show(proxied)
        );
        for (d, p) in d.iter().zip(&p) {
            let mut want = parse(d).unwrap().0;
            normalise(&mut want, Some(&mapping));
            let mut got = parse(p).unwrap().0;
            // The proxy's bytes: the stored values and times are set aside the same way,
            // and no address is mapped.
            let unmapped = Mapping {
                nodes: vec![],
                values,
            };
            normalise(&mut got, Some(&unmapped));
            let (mut w, mut g) = (vec![], vec![]);
            encode(&want, &mut w);
            encode(&got, &mut g);
            assert_eq!(
                show(&w),
                show(&g),
                "script {}\ndirect frame {}",
                show(script),
                show(d)
            );
        }
    }
}

/// Writes `script` at once, then reads until the server has been quiet for a while.
async fn transcript(addr: SocketAddr, script: &[u8]) -> Vec<u8> {
    transcript_in_turns(addr, &[script]).await
}

/// Writes each part of a script at once, after the replies to the one before it (the
/// server quiet for a while).
async fn transcript_in_turns(addr: SocketAddr, parts: &[&[u8]]) -> Vec<u8> {
    // A listener is bound right after the route table that names it is published.
    let mut tries = 0;
    let mut s = loop {
        match TcpStream::connect(addr).await {
            Ok(s) => break s,
            Err(e) if tries < 50 => {
                tries += 1;
                tracing_free_sleep(e).await;
            }
            Err(e) => panic!("connecting to {addr}: {e}"),
        }
    };
    s.set_nodelay(true).unwrap();
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    for part in parts {
        s.write_all(part).await.unwrap();
        loop {
            match tokio::time::timeout(Duration::from_millis(700), s.read(&mut buf)).await {
                Ok(Ok(0)) => return out,
                Err(_) => break,
                Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
                Ok(Err(e)) => panic!("reading from {addr}: {e}"),
            }
        }
    }
    out
}

async fn tracing_free_sleep(_why: std::io::Error) {
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// The transcript cut into whole frames.
fn frames(mut bytes: &[u8]) -> Vec<&[u8]> {
    let mut out = vec![];
    while !bytes.is_empty() {
        let (_, n) = parse(bytes).unwrap_or_else(|e| panic!("{e}: {}", bytes.escape_ascii()));
        out.push(&bytes[..n]);
        bytes = &bytes[n..];
    }
    out
}

/// How the direct transcript is mapped to what the proxy must send.
struct Mapping<'v> {
    /// Each node's internal address and its listener port.
    nodes: Vec<(SocketAddr, u16)>,
    /// Stored values, which are never mapped: a value goes out as it is.
    values: &'v [String],
}

/// Sets what differs between two calls to 0 (HELLO's connection `id`, the ping and pong
/// times of CLUSTER NODES lines) and, with `mapping`, maps each node's internal address to
/// its listener on the proxy in every string but the stored values (`ip:port`, or the IP
/// alone as CLUSTER SLOTS gives it, with its port as the next integer).
fn normalise(f: &mut Frame<'_>, mapping: Option<&Mapping<'_>>) {
    match f {
        Frame::Bulk(b) | Frame::Simple(b) | Frame::Error(b) | Frame::Verbatim(b) => {
            let mut text = String::from_utf8_lossy(b).into_owned();
            let body = text.strip_prefix("txt:").unwrap_or(&text);
            if mapping.is_some_and(|m| m.values.iter().any(|v| v.as_str() == body)) {
                return;
            }
            for (internal, port) in mapping.map(|m| m.nodes.as_slice()).unwrap_or_default() {
                if text == internal.ip().to_string() {
                    text = "127.0.0.1".into();
                } else {
                    text = text.replace(&internal.to_string(), &format!("127.0.0.1:{port}"));
                }
            }
            *b = Cow::Owned(zero_ping_pong(&text).into_bytes());
        }
        Frame::Array(_, items) => {
            let mut port_next: Option<(SocketAddr, u16)> = None;
            for item in items.iter_mut() {
                if let (Some((internal, port)), Frame::Int(d)) = (port_next, &mut *item) {
                    if d.as_ref() == internal.port().to_string().as_bytes() {
                        *d = Cow::Owned(port.to_string().into_bytes());
                    }
                }
                port_next = mapping.and_then(|m| {
                    m.nodes
                        .iter()
                        .copied()
                        .find(|(a, _)| item.as_bytes() == Some(a.ip().to_string().as_bytes()))
                });
                normalise(item, mapping);
            }
        }
        Frame::Map(pairs) => {
            for (k, v) in pairs.iter_mut() {
                if k.as_bytes() == Some(b"id") && matches!(v, Frame::Int(_)) {
                    *v = Frame::Int(Cow::Borrowed(b"0"));
                }
                normalise(k, mapping);
                normalise(v, mapping);
            }
        }
        Frame::Attribute(_, inner) => normalise(inner, mapping),
        _ => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_valkey_rejects_change_no_pairing_state() {
    let f = Fixture::start().await;
    // Stored values that a wrong pairing would take for topology: a CLUSTER NODES text of
    // the exact shape (only exact pairing protects that one), and a redirect.
    let nodes = f.cluster_nodes().replace("myself,", "");
    f.set(&f.key("nodes"), &nodes);
    f.set(&f.key("moved"), &format!("MOVED 1 {}", f.node()));
    let scripts: [&str; 10] = [
        // Wrong arity or syntax: an error, and every later command is answered.
        "CLIENT REPLY SKIP x\r\nGET @nodes\r\nPING\r\nCLUSTER NODES\r\nGET @moved\r\nCLUSTER SLOTS\r\n",
        "CLIENT REPLY OFF x\r\nGET @nodes\r\nCLUSTER NODES\r\nCLIENT REPLY\r\nGET @nodes\r\nCLUSTER SLOTS\r\n",
        "CLIENT REPLY MAYBE\r\nGET @nodes\r\nCLUSTER NODES\r\nGET @moved\r\n",
        // `MULTI x` starts nothing; `DISCARD x` inside a transaction ends nothing, `EXEC x`
        // aborts it.
        "MULTI x\r\nGET @nodes\r\nCLUSTER NODES\r\nEXEC\r\nCLUSTER SLOTS\r\n",
        "MULTI\r\nGET @nodes\r\nEXEC x\r\nCLUSTER NODES\r\nEXEC\r\nGET @nodes\r\nCLUSTER SLOTS\r\n",
        "MULTI\r\nGET @nodes\r\nDISCARD x\r\nCLUSTER NODES\r\nEXEC\r\nMULTI\r\nDISCARD x\r\nCLUSTER SLOTS\r\nDISCARD\r\nCLUSTER NODES\r\n",
        // CLIENT REPLY inside MULTI is refused, and EXEC aborts.
        "MULTI\r\nCLIENT REPLY SKIP\r\nGET @nodes\r\nEXEC\r\nGET @nodes\r\nCLUSTER NODES\r\nMULTI\r\nCLIENT REPLY OFF\r\nEXEC\r\nGET @nodes\r\nCLUSTER SLOTS\r\n",
        // Unsubscribing from everything: Valkey counts channels and patterns together and
        // shard channels apart, and answers once with a NULL channel when none is left.
        "SUBSCRIBE a b\r\nPSUBSCRIBE p*\r\nSSUBSCRIBE @s\r\nUNSUBSCRIBE\r\nPUNSUBSCRIBE\r\nSUNSUBSCRIBE\r\nUNSUBSCRIBE\r\nGET\r\nCLUSTER NODES\r\nGET @nodes\r\nCLUSTER SLOTS\r\n",
        // Inline commands split as Valkey splits them: quotes, escapes, quotes glued on.
        "CLIENT \"REPLY\" 'OFF'\r\nGET @nodes\r\nCLIENT REPLY ON\r\nCLUSTER NODES\r\nGET @nodes\r\n\"CLUSTER\" n\"od\"'es'\r\nGET @nodes\r\nCLIENT \"re\\x70ly\" skip\r\nCLUSTER NODES\r\nGET @nodes\r\n",
        // The accepted forms, for contrast.
        "CLIENT REPLY SKIP\r\nCLUSTER NODES\r\nGET @nodes\r\nCLIENT REPLY OFF\r\nCLUSTER SLOTS\r\nCLIENT REPLY SKIP\r\nCLIENT REPLY ON\r\nMULTI\r\nGET @nodes\r\nCLUSTER NODES\r\nEXEC\r\nCLUSTER SLOTS\r\n",
    ];
    let values = [nodes.clone(), format!("MOVED 1 {}", f.node())];
    for script in scripts {
        let script = f.keys(script);
        let (direct, proxied) = f.both(&script).await;
        f.assert_same(&script, &values, &direct, &proxied);
    }
    assert_eq!(
        f.metric("shardgate_proxy_rewrite_skipped_total{reason=\"not_cluster_nodes\"}"),
        0.0
    );
}

/// MULTI that Valkey refuses (here an ACL rule) starts no transaction: a client that waits
/// for its reply gets the next commands' replies as directly, topology rewritten (the
/// pipelined case is in the test below: closed, never guessed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_multi_starts_nothing() {
    let f = Fixture::start().await;
    f.users_refused_a_command();
    let nodes = f.cluster_nodes().replace("myself,", "");
    f.set(&f.key("nodes"), &nodes);
    let first: &[u8] = b"AUTH nomulti pw\r\nMULTI\r\n";
    let then = f.keys("CLUSTER SLOTS\r\nGET @nodes\r\nCLIENT REPLY OFF\r\nGET @nodes\r\nCLIENT REPLY ON\r\nCLUSTER NODES\r\nEXEC\r\nGET @nodes\r\nCLUSTER SHARDS\r\n");
    let direct = transcript_in_turns(f.node(), &[first, &then]).await;
    let port = f.layout.port(NodeRef::new(0, 0)).unwrap();
    let proxied = transcript_in_turns(SocketAddr::from((LO, port)), &[first, &then]).await;
    // CLUSTER SHARDS carries offsets that may differ between two calls: it is checked for
    // internal addresses only (the last frame).
    let without_last = |t: &[u8]| -> Vec<u8> {
        let fr = frames(t);
        fr[..fr.len().saturating_sub(1)].concat()
    };
    let text = String::from_utf8_lossy(&direct);
    assert!(
        text.contains("-NOPERM") && text.contains("EXEC without MULTI"),
        "{text}"
    );
    // Neither `ip:port` (CLUSTER NODES, SHARDS) nor the port as an integer (SLOTS).
    let through = String::from_utf8_lossy(&proxied).replace(&nodes, "");
    for internal in [f.node().to_string(), format!(":{}\r\n", f.node().port())] {
        assert!(!through.contains(&internal), "{internal} in {through}");
    }
    let script = [first, &then].concat();
    f.assert_same(
        &script,
        &[nodes],
        &without_last(&direct),
        &without_last(&proxied),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resp3_arrays_on_a_subscribed_connection_are_replies() {
    let f = Fixture::start().await;
    let node = f.cluster.node(NodeRef::new(0, 0));
    let _: () = block_in_place(|| {
        node.query::<()>(&["RPUSH", &f.key("words"), "message", "ch", "x"])?;
        node.query::<()>(&["RPUSH", &f.key("confirm"), "subscribe", "ch", "1"])?;
        node.query::<()>(&["RPUSH", &f.key("pmsg"), "pmessage", "p*", "ch", "x"])
    })
    .unwrap();
    let script = f.keys("HELLO 3\r\nSUBSCRIBE ch\r\nLRANGE @words 0 -1\r\nCLUSTER SLOTS\r\nLRANGE @confirm 0 -1\r\nCLUSTER NODES\r\nPSUBSCRIBE p*\r\nLRANGE @pmsg 0 -1\r\nCLUSTER SHARDS\r\nECHO message\r\nPING\r\nUNSUBSCRIBE\r\nPUNSUBSCRIBE\r\nLRANGE @words 0 -1\r\nCLUSTER SLOTS\r\n");
    let script = script.as_slice();
    let (direct, proxied) = f.both(script).await;
    // CLUSTER SHARDS carries offsets and health that may differ between two calls: it is
    // checked for internal addresses only.
    let shards_at = |t: &[u8]| frames(t).iter().position(|fr| fr.starts_with(b"*2\r\n%"));
    let cut = |t: &[u8]| -> Vec<u8> {
        let fr = frames(t);
        let at = shards_at(t).unwrap_or(usize::MAX);
        fr.iter()
            .enumerate()
            .filter(|(i, _)| *i != at)
            .flat_map(|(_, b)| b.to_vec())
            .collect()
    };
    assert!(
        !String::from_utf8_lossy(&proxied).contains(&f.node().ip().to_string()),
        "internal address through the proxy: {}",
        proxied.escape_ascii()
    );
    f.assert_same(script, &[], &cut(&direct), &cut(&proxied));
}

/// Where the pairing cannot follow Valkey (`CLIENT REPLY SKIP` on a RESP2 subscribed
/// connection, which Valkey refuses there; a subscribe inside MULTI; HELLO sent with replies
/// off; a transaction on a monitoring connection, whose EXEC array Valkey interleaves with
/// monitor lines; MULTI refused with commands sent behind it as if queued, or with its
/// reply skipped; CLIENT REPLY SKIP refused, with commands behind it taken as unanswered),
/// the proxy forwards the replies up to that point as Valkey sent them, then an error
/// line, and closes, counted: a stored value that looks like topology is never rewritten,
/// and no later topology reply goes out with internal addresses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn where_the_pairing_cannot_follow_the_connection_is_closed_never_guessed() {
    let f = Fixture::start().await;
    let nodes = f.cluster_nodes();
    let value = format!("{nodes}MOVED 1 {}\n", f.node());
    f.set(&f.key("nodes"), &value);
    f.users_refused_a_command();
    let tail = "GET @nodes\r\nCLUSTER NODES\r\nCLUSTER SLOTS\r\n";
    let scripts = [
        format!("SUBSCRIBE ch\r\nCLIENT REPLY SKIP\r\nUNSUBSCRIBE ch\r\n{tail}"),
        format!("MULTI\r\nSUBSCRIBE ch\r\nEXEC\r\nUNSUBSCRIBE\r\n{tail}"),
        format!("CLIENT REPLY OFF\r\nHELLO 3\r\nCLIENT REPLY ON\r\n{tail}"),
        format!("MONITOR\r\nMULTI\r\nCLUSTER SHARDS\r\nEXEC\r\nRESET\r\n{tail}"),
        // MULTI refused with commands already sent behind it, taken as queued; refused
        // with its reply skipped (CLUSTER NODES runs, its reply is not `+QUEUED`).
        format!("AUTH nomulti pw\r\nMULTI\r\nCLUSTER SLOTS\r\nEXEC\r\n{tail}"),
        format!("AUTH nomulti pw\r\nCLIENT REPLY SKIP\r\nMULTI\r\nCLUSTER NODES\r\nEXEC\r\n{tail}"),
        // CLIENT REPLY SKIP refused: CLUSTER NODES, taken as unanswered, is answered.
        format!("AUTH noreply pw\r\nCLIENT REPLY SKIP\r\nCLUSTER NODES\r\nGET @nodes\r\n{tail}"),
    ];
    let counted = "shardgate_proxy_connections_closed_total{reason=\"pairing_lost\"}";
    let before = f.metric(counted);
    let internal = format!(":{}", f.node().port());
    for script in &scripts {
        let script = f.keys(script);
        let direct = transcript(f.node(), &script).await;
        let port = f.layout.port(NodeRef::new(0, 0)).unwrap();
        let proxied = until_closed(SocketAddr::from((LO, port)), &script).await;
        let show = |b: &[u8]| b.escape_ascii().to_string();
        let line = b"-ERR shardgate-proxy lost track of which reply answers which command";
        let at = proxied
            .windows(line.len())
            .position(|w| w == line)
            .unwrap_or_else(|| panic!("{}: no error line in {}", show(&script), show(&proxied)));
        // What came before the error line is what Valkey sent, unchanged (monitor lines,
        // whose times differ from run to run, aside); the line is the last thing sent.
        assert!(
            without_monitor_lines(&direct).starts_with(&without_monitor_lines(&proxied[..at])),
            "{}\ndirect:  {}\nproxied: {}",
            show(&script),
            show(&direct),
            show(&proxied)
        );
        assert_eq!(frames(&proxied[at..]).len(), 1, "{}", show(&proxied));
        // The value and the topology Valkey gave directly never went out, rewritten or not.
        let text = String::from_utf8_lossy(&proxied);
        assert!(!text.contains("MOVED 1 "), "{text}");
        assert!(!text.contains(&internal), "{text}");
        assert!(
            String::from_utf8_lossy(&direct).contains(&internal),
            "the direct transcript shows the internal address: {}",
            show(&direct)
        );
    }
    assert_eq!(f.metric(counted) - before, scripts.len() as f64);
}

/// `bytes` without the lines that are MONITOR output (`+<time> [<db> <client>] ...`).
fn without_monitor_lines(bytes: &[u8]) -> Vec<u8> {
    let is_monitor = |line: &[u8]| {
        let text = String::from_utf8_lossy(line);
        text.strip_prefix('+')
            .and_then(|t| t.split_once(' '))
            .is_some_and(|(time, rest)| {
                time.split_once('.').is_some_and(|(s, us)| {
                    [s, us]
                        .iter()
                        .all(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
                }) && rest.starts_with('[')
            })
    };
    bytes
        .split_inclusive(|&b| b == b'\n')
        .filter(|line| !is_monitor(line))
        .flatten()
        .copied()
        .collect()
}

/// Writes `script`, then reads until the proxy closes the connection (within 10 s).
async fn until_closed(addr: SocketAddr, script: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(script).await.unwrap();
    let mut out = Vec::new();
    let read = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .unwrap_or_else(|_| panic!("the proxy did not close the connection"));
    out
}

/// Bad client input gets Valkey's own `-ERR Protocol error: ...` line before the close,
/// through the proxy as directly, after the replies to the commands before it; and the
/// proxy counts what it saw rejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_valkeys_protocol_error_line() {
    let f = Fixture::start().await;
    let scripts: [&[u8]; 7] = [
        b"PING\r\n*1\r\n$abc\r\nPING\r\n",
        b"*1\r\n+PING\r\nPING\r\n",
        b"*abc\r\n",
        b"*1\r\n$4\r\nPINGxx\r\nPING\r\n",
        b"*1\r\n$04\r\nPING\r\n",
        b"PING\r\nGET \"a\r\nPING\r\n",
        b"*1\r\n$999999999999\r\n",
    ];
    let counted = "shardgate_proxy_protocol_errors_total{reason=\"client\"}";
    let before = f.metric(counted);
    for script in scripts {
        let (direct, proxied) = f.both(script).await;
        assert!(
            direct
                .windows(b"-ERR Protocol error: ".len())
                .any(|w| w == b"-ERR Protocol error: "),
            "Valkey answers {} with {}",
            script.escape_ascii(),
            direct.escape_ascii()
        );
        assert_eq!(
            proxied.escape_ascii().to_string(),
            direct.escape_ascii().to_string(),
            "{}",
            script.escape_ascii()
        );
    }
    // The first five are the proxy's to see (the last two Valkey alone rejects: an
    // unbalanced quote, a length past its configured limit).
    assert_eq!(f.metric(counted) - before, 5.0);
}
