//! The proxy binary on one worker thread, as on a pod with a CPU limit of 1: tokio's
//! current-thread runtime runs the listeners, the copies, the idle timer and the drain. Values
//! pass byte for byte, a quiet connection is closed at the idle timeout, and SIGTERM drains
//! and exits.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::Duration;

use shardgate_harness::addr::{free_port, free_port_range};
use shardgate_harness::clients::watch_idle_timeout;
use shardgate_harness::http;
use shardgate_harness::proxy_process::{proxy_binary, ProxyProcess};
use shardgate_harness::routes::one_node_per_shard;
use shardgate_harness::valkey::Standalone;

const LO: Ipv4Addr = Ipv4Addr::LOCALHOST;
const IDLE: Duration = Duration::from_secs(1);

fn connect(port: u16) -> TcpStream {
    let s = TcpStream::connect((LO, port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// Sends `cmd` as a RESP array and reads `reply_len` bytes back.
fn call(s: &mut TcpStream, cmd: &[&[u8]], reply_len: usize) -> Vec<u8> {
    let mut req = format!("*{}\r\n", cmd.len()).into_bytes();
    for arg in cmd {
        req.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        req.extend_from_slice(arg);
        req.extend_from_slice(b"\r\n");
    }
    s.write_all(&req).unwrap();
    let mut reply = vec![0u8; reply_len];
    s.read_exact(&mut reply).unwrap();
    reply
}

/// PING → +PONG; false once the connection is closed.
fn pong(s: &mut TcpStream) -> bool {
    let mut reply = [0u8; 7];
    s.write_all(b"*1\r\n$4\r\nPING\r\n").is_ok()
        && s.read_exact(&mut reply).is_ok()
        && &reply == b"+PONG\r\n"
}

#[test]
fn one_worker_thread_forwards_idles_out_and_drains() {
    let v = Standalone::start().expect("valkey-server (run scripts/setup)");
    let base = free_port_range(LO, 1);
    let routes = v.dir.join("routes.yaml");
    std::fs::write(
        &routes,
        one_node_per_shard(base, &[format!("127.0.0.1:{}", v.port)]),
    )
    .unwrap();
    let admin = SocketAddr::from((LO, free_port(LO)));
    let args: Vec<String> = [
        "--routes",
        &routes.to_string_lossy(),
        "--listen-ip",
        "127.0.0.1",
        "--admin-addr",
        &admin.to_string(),
        "--idle-timeout",
        "1s",
        "--drain-timeout",
        "300ms",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let bin = proxy_binary().expect("the shardgate-proxy binary (cargo builds it with the tests)");
    let one = std::ffi::OsStr::new("1");
    let mut proxy =
        ProxyProcess::spawn_with_env(&bin, &args, &[("TOKIO_WORKER_THREADS", one)], Some(admin))
            .unwrap();
    proxy.wait_ready(Duration::from_secs(20)).unwrap();
    let log = proxy.log();
    assert!(
        log.contains("tokio runtime") && log.contains("current-thread"),
        "the one-thread runtime is not the current-thread one; log:\n{log}"
    );

    // Values of every byte and a few sizes, written through the proxy and read back both
    // through it and from Valkey directly.
    let mut through = connect(base);
    let mut direct = connect(v.port);
    for i in 0..200usize {
        let value: Vec<u8> = (0..(i * 97) % 70_000).map(|j| (j * 31 + i) as u8).collect();
        let key = format!("one-thread:{i}");
        assert_eq!(
            call(&mut through, &[b"SET", key.as_bytes(), &value], 5),
            b"+OK\r\n"
        );
        let mut bulk = format!("${}\r\n", value.len()).into_bytes();
        bulk.extend_from_slice(&value);
        bulk.extend_from_slice(b"\r\n");
        assert_eq!(
            call(&mut through, &[b"GET", key.as_bytes()], bulk.len()),
            bulk
        );
        assert_eq!(
            call(&mut direct, &[b"GET", key.as_bytes()], bulk.len()),
            bulk
        );
    }

    // The quiet connection (`through`, silent from now) is closed by the idle timeout, not
    // before it; one that keeps talking is not.
    let mut busy = connect(base);
    let w = watch_idle_timeout(through, &mut busy, IDLE, pong);
    w.check(IDLE);
    let busy_closed = w.busy_closed;
    let (_, metrics) = http::get(admin, "/metrics").unwrap();
    assert_eq!(
        http::metric(
            &metrics,
            "shardgate_proxy_connections_closed_total{reason=\"idle_timeout\"}",
        ),
        Some(1.0 + f64::from(u8::from(busy_closed)))
    );
    if busy_closed {
        busy = connect(base);
        assert!(pong(&mut busy));
    }

    // SIGTERM: the drain ends after 300 ms and closes `busy`, which keeps talking (so the
    // idle timeout does not close it), and the process exits cleanly. (That the drain's
    // end wakes a connection at once is `conn::watch`'s unit tests', under paused time.)
    let talker = std::thread::spawn(move || {
        let mut pongs = 0u32;
        while pong(&mut busy) {
            pongs += 1;
            std::thread::sleep(Duration::from_millis(50));
        }
        pongs
    });
    proxy.signal("TERM").unwrap();
    let status = proxy.wait_exit(Duration::from_secs(20)).unwrap();
    // Without the colours' escape sequences.
    let log: String = proxy
        .log()
        .split('\x1b')
        .enumerate()
        .map(|(i, part)| match (i, part.find('m')) {
            (0, _) | (_, None) => part,
            (_, Some(m)) => &part[m + 1..],
        })
        .collect();
    assert!(status.success(), "exit {status}; log:\n{log}");
    assert!(
        log.lines()
            .any(|l| l.contains("drain timeout") && l.contains("left=1")),
        "the drain did not end with the talking connection open; log:\n{log}"
    );
    let pongs = talker.join().unwrap();
    assert!(pongs > 0, "the connection never talked during the drain");
}
