//! The rewriting proxy's memory stays bounded whatever the traffic: 20 subscribers and a
//! 25 MB PUBLISH, a 100 MB shard message to one subscriber, a 100 MB value read in a
//! transaction together with CLUSTER SLOTS, a 70,000-byte error and status line from a
//! script, a script reply nested 71 deep.
//!
//! The proxy runs as its own process, so that its resident memory (`VmRSS`/`VmHWM` in
//! `/proc/<pid>/status`) is its alone. What each client receives is compared with bytes
//! written out here and with what Valkey sends a direct connection, never with the proxy's
//! own code.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use shardgate_crds::NodeRef;
use shardgate_harness::addr::{free_port, free_port_range};
use shardgate_harness::proxy_process::{ProxyProcess, PROXY_PROGRAM};
use shardgate_harness::valkey::{hash_tag_for_slot, ClusterSpec, ValkeyCluster};

const LO: Ipv4Addr = Ipv4Addr::LOCALHOST;
const MB: usize = 1_000_000;

/// The most the proxy's resident memory may grow (peak) while one case runs. Per
/// connection it holds two read buffers (16 KiB each) and at most one topology reply (a
/// CLUSTER SLOTS of three nodes, under 1 KiB): 22 connections are under 1 MiB; the rest is
/// margin for the allocator and the runtime (a run grows by well under 1 MiB). A third of
/// the smallest message: holding any one message whole fails (before this bound was kept,
/// the first case grew by about 490 MB).
const BOUND: u64 = 8 << 20;

#[test]
fn the_rewriting_proxy_streams_what_it_does_not_rewrite_in_bounded_memory() {
    let cluster = ValkeyCluster::start(ClusterSpec::new(3, 0)).unwrap();
    // A direct subscriber must keep its connection through a 100 MB message, so that the
    // proxy's subscribers have something to be compared with.
    cluster
        .config_set_all("client-output-buffer-limit", "pubsub 0 0 0")
        .unwrap();
    let node = cluster.node(NodeRef::new(0, 0)).addr();
    let base = free_port_range(LO, 3);
    let admin = SocketAddr::from((LO, free_port(LO)));
    let args: Vec<String> = [
        "--seed",
        &node.to_string(),
        "--base-port",
        &base.to_string(),
        "--rewrite",
        "--advertise-host",
        "127.0.0.1",
        "--listen-ip",
        "127.0.0.1",
        "--admin-addr",
        &admin.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let proxy = ProxyProcess::spawn(&proxy_binary(), &args, Some(admin)).unwrap();
    proxy.wait_ready(Duration::from_secs(20)).unwrap();
    let entry = SocketAddr::from((LO, base));
    let internal: Vec<String> = cluster.nodes().iter().map(|n| n.ip().to_string()).collect();
    let rss = Rss(proxy.pid());
    // A key and a shard channel in node 0's slots.
    let tag = hash_tag_for_slot(*cluster.spec().initial_slots(0u32).start());

    // 20 subscribers through the proxy, one direct, and a 25 MB PUBLISH.
    let mut subscribers: Vec<TcpStream> = (0..20).map(|_| connect(entry)).collect();
    subscribers.push(connect(node));
    for s in &mut subscribers {
        send(s, &[b"SUBSCRIBE", b"news"]);
        expect(s, b"*3\r\n$9\r\nsubscribe\r\n$4\r\nnews\r\n:1\r\n");
    }
    let payload = vec![b'p'; 25 * MB];
    let message = Arc::new(
        [
            format!(
                "*3\r\n$7\r\nmessage\r\n$4\r\nnews\r\n${}\r\n",
                payload.len()
            )
            .as_bytes(),
            &payload,
            b"\r\n",
        ]
        .concat(),
    );
    let growth = rss.growth_during(|| {
        let mut publisher = connect(entry);
        send(&mut publisher, &[b"PUBLISH", b"news", &payload]);
        let readers: Vec<_> = subscribers
            .drain(..)
            .map(|mut s| {
                let message = message.clone();
                std::thread::spawn(move || {
                    expect(&mut s, &message);
                    s
                })
            })
            .collect();
        expect(&mut publisher, b":21\r\n");
        subscribers = readers.into_iter().map(|r| r.join().unwrap()).collect();
    });
    assert!(
        growth < BOUND,
        "20 subscribers, 25 MB message: {growth} bytes"
    );
    // Every subscriber is still subscribed, as the direct one is.
    for s in &mut subscribers {
        send(s, &[b"PING"]);
        expect(s, b"*2\r\n$4\r\npong\r\n$0\r\n\r\n");
    }
    drop(subscribers);

    // A 100 MB shard message to one subscriber (and to a direct one).
    let channel = format!("{tag}ch");
    let payload = vec![b's'; 100 * MB];
    let mut subscribers = [connect(entry), connect(node)];
    for s in &mut subscribers {
        send(s, &[b"SSUBSCRIBE", channel.as_bytes()]);
        expect(
            s,
            format!(
                "*3\r\n$10\r\nssubscribe\r\n${}\r\n{channel}\r\n:1\r\n",
                channel.len()
            )
            .as_bytes(),
        );
    }
    let message = Arc::new(
        [
            format!(
                "*3\r\n$8\r\nsmessage\r\n${}\r\n{channel}\r\n${}\r\n",
                channel.len(),
                payload.len()
            )
            .as_bytes(),
            &payload,
            b"\r\n",
        ]
        .concat(),
    );
    let growth = rss.growth_during(|| {
        let mut publisher = connect(entry);
        send(&mut publisher, &[b"SPUBLISH", channel.as_bytes(), &payload]);
        std::thread::scope(|scope| {
            for s in &mut subscribers {
                let message = &message;
                scope.spawn(move || expect(s, message));
            }
        });
        expect(&mut publisher, b":2\r\n");
    });
    assert!(growth < BOUND, "100 MB shard message: {growth} bytes");
    for s in &mut subscribers {
        send(s, &[b"PING"]);
        expect(s, b"*2\r\n$4\r\npong\r\n$0\r\n\r\n");
    }
    drop(subscribers);
    drop(message);

    // A 100 MB value read in a transaction with CLUSTER SLOTS: the value streams, and
    // CLUSTER SLOTS in the transaction is rewritten as it is outside one.
    let key = format!("{tag}big");
    let mut direct = connect(node);
    send(&mut direct, &[b"SET", key.as_bytes(), &payload]);
    expect(&mut direct, b"+OK\r\n");
    let mut client = connect(entry);
    let slots = until_pong(&mut client, &[&[b"CLUSTER", b"SLOTS"]]);
    let text = String::from_utf8_lossy(&slots);
    assert!(text.contains("127.0.0.1"), "{text}");
    for ip in &internal {
        assert!(!text.contains(ip.as_str()), "internal {ip} in {text}");
    }
    let direct_slots = until_pong(&mut direct, &[&[b"CLUSTER", b"SLOTS"]]);
    let transaction: [&[&[u8]]; 4] = [
        &[b"MULTI"],
        &[b"GET", key.as_bytes()],
        &[b"CLUSTER", b"SLOTS"],
        &[b"EXEC"],
    ];
    let exec = |slots: &[u8]| {
        [
            format!("+OK\r\n+QUEUED\r\n+QUEUED\r\n*2\r\n${}\r\n", payload.len()).as_bytes(),
            &payload,
            b"\r\n",
            slots,
        ]
        .concat()
    };
    let growth = rss.growth_during(|| {
        for cmd in transaction {
            send(&mut client, cmd);
        }
        expect(&mut client, &exec(&slots));
    });
    assert!(growth < BOUND, "100 MB GET in MULTI: {growth} bytes");
    for cmd in transaction {
        send(&mut direct, cmd);
    }
    expect(&mut direct, &exec(&direct_slots));
    drop(payload);

    // Replies that are not rewritten pass whatever their length or depth, byte for byte as
    // Valkey sends them to a direct connection.
    let long = [b"ERR ".as_slice(), &vec![b'x'; 70_000]].concat();
    let nested = b"local t = {1} for i = 1, 70 do t = {t} end return t".as_slice();
    for (what, script, arg) in [
        (
            "70,000-byte error",
            b"return redis.error_reply(ARGV[1])".as_slice(),
            long.as_slice(),
        ),
        (
            "70,000-byte status",
            b"return redis.status_reply(ARGV[1])",
            &long,
        ),
        ("nested 71 deep", nested, b""),
    ] {
        let eval: &[&[u8]] = &[b"EVAL", script, b"0", arg];
        let want = until_pong(&mut direct, &[eval]);
        if what.starts_with("nested") {
            assert!(want.starts_with(&b"*1\r\n".repeat(71)), "{what}");
        } else {
            assert!(want.len() > 70_000, "{what}: {} bytes", want.len());
        }
        let mut got = vec![];
        let growth = rss.growth_during(|| {
            // Then CLUSTER SLOTS: the pairing is still in step after it.
            got = until_pong(&mut client, &[eval, &[b"CLUSTER", b"SLOTS"]]);
        });
        assert!(
            got == [&want[..], &slots].concat(),
            "{what}: the proxy's reply differs from Valkey's"
        );
        assert!(growth < BOUND, "{what}: {growth} bytes");
    }
    assert!(
        proxy.log().find("invalid RESP").is_none(),
        "{}",
        proxy.log()
    );
}

/// The proxy process's resident memory.
struct Rss(u32);

impl Rss {
    /// How much the peak resident memory grew above the resident memory before `f`.
    fn growth_during(&self, f: impl FnOnce()) -> u64 {
        // Writing 5 resets the peak (VmHWM) to the current size; without it, the peak
        // since the process started is the measure (an overestimate, so still a bound).
        let reset = std::fs::write(format!("/proc/{}/clear_refs", self.0), "5").is_ok();
        let before = self.field(if reset { "VmRSS" } else { "VmHWM" });
        f();
        let growth = self.field("VmHWM").saturating_sub(before);
        eprintln!("peak resident growth: {} KiB", growth >> 10);
        growth
    }

    /// A `kB` field of `/proc/<pid>/status`, in bytes.
    fn field(&self, name: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.0)).unwrap();
        let line = status
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .unwrap_or_else(|| panic!("no {name} in {status}"));
        let kb: u64 = line.trim().trim_end_matches("kB").trim().parse().unwrap();
        kb * 1024
    }
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// Sends one command as a RESP array of bulk strings.
fn send(s: &mut TcpStream, args: &[&[u8]]) {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    s.write_all(&out).unwrap();
}

/// Reads exactly `want.len()` bytes and requires them to be `want`, comparing as they
/// come (a 100 MB reply is not collected).
fn expect(s: &mut TcpStream, want: &[u8]) {
    let mut buf = vec![0u8; 1 << 16];
    let mut at = 0;
    while at < want.len() {
        let n = s.read(&mut buf[..(want.len() - at).min(1 << 16)]).unwrap();
        assert!(n > 0, "closed after {at} of {} bytes", want.len());
        if buf[..n] != want[at..at + n] {
            let off = at
                + buf[..n]
                    .iter()
                    .zip(&want[at..])
                    .take_while(|(a, b)| a == b)
                    .count();
            panic!(
                "differs at byte {off} of {}: got {:?}, want {:?}",
                want.len(),
                String::from_utf8_lossy(&buf[off - at..n.min(off - at + 80)]),
                String::from_utf8_lossy(&want[off..want.len().min(off + 80)])
            );
        }
        at += n;
    }
}

/// Sends `commands` and a PING, and returns the replies to `commands`: everything before
/// the `+PONG` that ends the stream (none of the replies read here holds that text).
fn until_pong(s: &mut TcpStream, commands: &[&[&[u8]]]) -> Vec<u8> {
    for c in commands {
        send(s, c);
    }
    send(s, &[b"PING"]);
    let mut got = vec![];
    let mut buf = vec![0u8; 1 << 16];
    while !got.ends_with(b"+PONG\r\n") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "closed after {} bytes", got.len());
        got.extend_from_slice(&buf[..n]);
    }
    got.truncate(got.len() - b"+PONG\r\n".len());
    got
}

/// The proxy binary: `$SHARDGATE_PROXY_BIN`, else built here (a no-op when it is up to
/// date) into this test's target directory and profile, so that the test never runs an
/// older proxy than the code it checks.
fn proxy_binary() -> PathBuf {
    if let Some(bin) = std::env::var_os("SHARDGATE_PROXY_BIN") {
        return bin.into();
    }
    // <target>/<profile>/deps/<test binary>
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let target_dir = profile_dir.parent().unwrap();
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => "dev",
        Some(other) => other,
        None => panic!("no profile directory in {}", exe.display()),
    };
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.toml");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = std::process::Command::new(cargo)
        .args([
            "build",
            "--quiet",
            "-p",
            "shardgate-proxy",
            "--bin",
            PROXY_PROGRAM,
        ])
        .arg("--profile")
        .arg(profile)
        .arg("--manifest-path")
        .arg(manifest)
        .arg("--target-dir")
        .arg(target_dir)
        .status()
        .unwrap();
    assert!(status.success(), "building the proxy failed");
    profile_dir.join(PROXY_PROGRAM)
}
