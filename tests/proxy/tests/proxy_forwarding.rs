//! Forwarding behaviour against a real valkey-server: idle timeout, the connection limit,
//! graceful drain, large values byte for byte, DNS-named backends, unreachable backends, and
//! refusing routes that point at the proxy itself.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use shardgate_harness::addr::{free_port, free_port_range};
use shardgate_harness::clients::{closed_within, watch_idle_timeout};
use shardgate_harness::http::{get, metric, metric_value};
use shardgate_harness::routes::one_node_per_shard;
use shardgate_harness::tcp_table::keepalive_timer;
use shardgate_harness::valkey::Standalone;
use shardgate_proxy::{Proxy, ProxyConfig, ProxyHandle, SourceConfig};
use tokio::task::block_in_place;

const LO: Ipv4Addr = Ipv4Addr::LOCALHOST;

fn routes_file(dir: &Path, base: u16, backends: &[String]) -> PathBuf {
    let path = dir.join(format!("routes-{base}.yaml"));
    std::fs::write(&path, one_node_per_shard(base, backends)).unwrap();
    path
}

async fn proxy(routes: PathBuf, tune: impl FnOnce(&mut ProxyConfig)) -> ProxyHandle {
    let mut config = ProxyConfig::new(SourceConfig::File {
        path: routes,
        poll: Duration::from_secs(1),
    });
    config.listen_ip = LO.into();
    config.admin_addr = Some(SocketAddr::from((LO, 0)));
    tune(&mut config);
    let p = Proxy::start(config).await.unwrap();
    assert!(p.wait_ready(Duration::from_secs(10)).await);
    p
}

fn connect(port: u16) -> TcpStream {
    let s = TcpStream::connect((LO, port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

/// PING → +PONG, or the error that prevented it.
fn ping(s: &mut TcpStream) -> std::io::Result<()> {
    s.write_all(b"*1\r\n$4\r\nPING\r\n")?;
    let mut buf = [0u8; 7];
    s.read_exact(&mut buf)?;
    // Past the connection limit the proxy answers Valkey's `-ERR max number of clients
    // reached` line: an error here, as a refusal.
    if &buf != b"+PONG\r\n" {
        return Err(std::io::Error::other(format!(
            "not +PONG: {:?}",
            String::from_utf8_lossy(&buf)
        )));
    }
    Ok(())
}

fn sample(p: &ProxyHandle, name: &str) -> f64 {
    let (_, m) = get(p.admin_addr().unwrap(), "/metrics").unwrap();
    metric_value(&m, name).unwrap()
}

/// The idle timeout closes a quiet connection, never before the timeout, and leaves one
/// that keeps talking open. Timings are judged against what was observed: the quiet
/// connection's close is timed from its last reply, and the busy one may be closed only if
/// the machine stalled it (a gap between its pings of half the timeout or more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_and_busy_ones_are_not() {
    const IDLE: Duration = Duration::from_secs(1);
    let v = block_in_place(Standalone::start).unwrap();
    let base = free_port_range(LO, 1);
    let p = proxy(
        routes_file(&v.dir, base, &[format!("127.0.0.1:{}", v.port)]),
        |c| c.idle_timeout = Some(IDLE),
    )
    .await;
    let busy_closed = block_in_place(|| {
        let mut quiet = connect(base);
        let mut busy = connect(base);
        ping(&mut quiet).unwrap();
        let w = watch_idle_timeout(quiet, &mut busy, IDLE, |s| ping(s).is_ok());
        w.check(IDLE);
        let busy_closed = w.busy_closed;
        if !busy_closed {
            ping(&mut busy).expect("a busy connection was closed");
        }
        eprintln!("{w:?}");
        busy_closed
    });
    assert_eq!(
        sample(
            &p,
            "shardgate_proxy_connections_closed_total{reason=\"idle_timeout\"}"
        ),
        1.0 + f64::from(u8::from(busy_closed))
    );
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_limit_are_closed_and_counted() {
    let v = block_in_place(Standalone::start).unwrap();
    let base = free_port_range(LO, 1);
    let p = proxy(
        routes_file(&v.dir, base, &[format!("127.0.0.1:{}", v.port)]),
        |c| c.max_connections = 2,
    )
    .await;
    block_in_place(|| {
        let mut a = connect(base);
        let mut b = connect(base);
        ping(&mut a).unwrap();
        ping(&mut b).unwrap();
        let mut c = connect(base);
        assert!(
            ping(&mut c).is_err() || closed_within(&mut c, Duration::from_secs(2)),
            "a third connection was served"
        );
        drop(a);
        // The permit comes back when the connection task ends.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let mut d = connect(base);
            if ping(&mut d).is_ok() {
                break;
            }
            assert!(Instant::now() < deadline, "a freed slot was never reused");
            std::thread::sleep(Duration::from_millis(50));
        }
        ping(&mut b).unwrap();
    });
    assert!(
        sample(
            &p,
            "shardgate_proxy_connections_rejected_total{reason=\"connection_limit\"}"
        ) >= 1.0
    );
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_stops_accepting_and_lets_open_connections_finish() {
    let v = block_in_place(Standalone::start).unwrap();
    let base = free_port_range(LO, 1);
    let p = proxy(
        routes_file(&v.dir, base, &[format!("127.0.0.1:{}", v.port)]),
        |c| c.drain_timeout = Duration::from_secs(20),
    )
    .await;
    let mut open = connect(base);
    ping(&mut open).unwrap();
    let admin = p.admin_addr().unwrap();
    let started = Instant::now();
    let drain = tokio::spawn(p.shutdown());
    // The admin server outlives the drain: wait until it reports the port closed.
    let deadline = Instant::now() + Duration::from_secs(10);
    while block_in_place(|| get(admin, "/metrics"))
        .ok()
        .and_then(|(_, m)| metric(&m, "shardgate_proxy_listeners"))
        != Some(0.0)
    {
        assert!(Instant::now() < deadline, "the listener never closed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    block_in_place(|| {
        assert!(
            TcpStream::connect((LO, base)).is_err(),
            "still accepting while draining"
        );
        ping(&mut open).expect("an open connection was cut during the drain");
        drop(open);
    });
    let forced = drain.await.unwrap();
    assert_eq!(forced, 0);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "drain waited for nothing"
    );

    // With a short drain timeout, what is still open is closed.
    let p = proxy(
        routes_file(&v.dir, base, &[format!("127.0.0.1:{}", v.port)]),
        |c| c.drain_timeout = Duration::from_millis(300),
    )
    .await;
    let mut open = connect(base);
    ping(&mut open).unwrap();
    assert_eq!(p.shutdown().await, 1);
    assert!(block_in_place(|| closed_within(
        &mut open,
        Duration::from_secs(2)
    )));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_values_pass_byte_for_byte() {
    let v = block_in_place(Standalone::start).unwrap();
    let base = free_port_range(LO, 1);
    let p = proxy(
        routes_file(&v.dir, base, &[format!("127.0.0.1:{}", v.port)]),
        |c| c.buffer_size = 4096,
    )
    .await;
    let value: Vec<u8> = (0..8 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    // Raw RESP: the redis crate re-parses a partial reply from its start on every read,
    // which is slow for one 8 MiB reply arriving in 4 KiB pieces.
    block_in_place(|| {
        let mut s = connect(base);
        let mut req = format!("*3\r\n$3\r\nSET\r\n$3\r\nbig\r\n${}\r\n", value.len()).into_bytes();
        req.extend_from_slice(&value);
        req.extend_from_slice(b"\r\n*2\r\n$3\r\nGET\r\n$3\r\nbig\r\n");
        s.write_all(&req).unwrap();
        let header = format!("+OK\r\n${}\r\n", value.len());
        let mut back = vec![0u8; header.len() + value.len() + 2];
        s.read_exact(&mut back).unwrap();
        assert_eq!(&back[..header.len()], header.as_bytes());
        assert!(
            back[header.len()..header.len() + value.len()] == value[..],
            "value changed on the way"
        );
        assert_eq!(&back[back.len() - 2..], b"\r\n");
    });
    let up = sample(
        &p,
        &format!("shardgate_proxy_bytes_total{{port=\"{base}\",direction=\"to_backend\"}}"),
    );
    let down = sample(
        &p,
        &format!("shardgate_proxy_bytes_total{{port=\"{base}\",direction=\"to_client\"}}"),
    );
    assert!(up > 8e6 && down > 8e6, "bytes not counted: {up} {down}");
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backends_by_dns_name_and_unreachable_backends() {
    let v = block_in_place(Standalone::start).unwrap();
    let closed_port = free_port(LO);
    let base = free_port_range(LO, 2);
    // `localhost` resolves from /etc/hosts: no query leaves the machine.
    let p = proxy(
        routes_file(
            &v.dir,
            base,
            &[
                format!("localhost:{}", v.port),
                format!("127.0.0.1:{closed_port}"),
            ],
        ),
        |c| c.connect_timeout = Duration::from_secs(2),
    )
    .await;
    block_in_place(|| {
        let mut s = connect(base);
        ping(&mut s).expect("no PONG through a DNS-named backend");
        let mut dead = connect(base + 1);
        assert!(
            closed_within(&mut dead, Duration::from_secs(5)),
            "a connection to a dead backend stayed open"
        );
    });
    let errors = sample(
        &p,
        &format!(
            "shardgate_proxy_backend_errors_total{{port=\"{}\",kind=\"connect\"}}",
            base + 1
        ),
    );
    assert_eq!(errors, 1.0);
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_to_the_proxy_itself_is_refused() {
    let dir = std::env::temp_dir().join(format!("shardgate-loop-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let base = free_port_range(LO, 2);
    let path = routes_file(
        &dir,
        base,
        &[format!("127.0.0.1:{}", base + 1), "127.0.0.1:6379".into()],
    );
    let mut config = ProxyConfig::new(SourceConfig::File {
        path,
        poll: Duration::from_secs(1),
    });
    config.listen_ip = LO.into();
    config.admin_addr = None;
    let err = Proxy::start(config)
        .await
        .err()
        .expect("a looping table was accepted")
        .to_string();
    assert!(err.contains("this proxy's own listener"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Sends `command` (RESP bytes) on `s` and reads until `answer` finds what it wants in the
/// reply so far.
fn ask<T>(s: &mut TcpStream, command: &[u8], answer: impl Fn(&str) -> Option<T>) -> T {
    s.write_all(command).unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = 0;
    loop {
        let n = s.read(&mut buf[got..]).unwrap();
        assert!(n > 0, "closed");
        got += n;
        if let Some(found) = answer(&String::from_utf8_lossy(&buf[..got])) {
            return found;
        }
    }
}

/// `INFO server`'s `tcp_port` asked through a connection: which server is behind it.
fn server_port(s: &mut TcpStream) -> u16 {
    ask(s, b"*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n", |text| {
        let line = text.lines().find(|l| l.starts_with("tcp_port:"))?;
        text.ends_with("\r\n\r\n")
            .then(|| line["tcp_port:".len()..].trim().parse().unwrap())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_table_applies_to_new_connections_and_open_ones_keep_their_backend() {
    let a = block_in_place(Standalone::start).unwrap();
    let b = block_in_place(Standalone::start).unwrap();
    let base = free_port_range(LO, 1);
    let path = routes_file(&a.dir, base, &[format!("127.0.0.1:{}", a.port)]);
    let mut config = ProxyConfig::new(SourceConfig::File {
        path: path.clone(),
        poll: Duration::from_millis(50),
    });
    config.listen_ip = LO.into();
    config.admin_addr = None;
    config.drain_timeout = Duration::from_millis(100);
    let p = Proxy::start(config).await.unwrap();
    assert!(p.wait_ready(Duration::from_secs(10)).await);
    let mut before = connect(base);
    assert_eq!(block_in_place(|| server_port(&mut before)), a.port);

    std::fs::write(
        &path,
        one_node_per_shard(base, &[format!("127.0.0.1:{}", b.port)]),
    )
    .unwrap();
    let mut rx = p.routes();
    tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|t| t.version == 2))
        .await
        .unwrap()
        .unwrap();
    block_in_place(|| {
        let mut after = connect(base);
        assert_eq!(
            server_port(&mut after),
            b.port,
            "a new connection went to the old backend"
        );
        assert_eq!(
            server_port(&mut before),
            a.port,
            "an open connection changed backend"
        );
    });
    p.shutdown().await;
}

/// A half-close passes through both ways, and a connection ended both ways is closed with
/// a FIN: the client reads everything the node sent, then its end, never a reset. The node
/// is a scripted TCP peer, not Valkey: Valkey closes both ways at once and never
/// half-closes, so it cannot show either direction on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_closes_pass_both_ways_and_the_end_is_a_fin() {
    let node = std::net::TcpListener::bind((LO, 0)).unwrap();
    let node_port = node.local_addr().unwrap().port();
    let dir = std::env::temp_dir().join(format!("shardgate-half-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let base = free_port_range(LO, 1);
    let p = proxy(
        routes_file(&dir, base, &[format!("127.0.0.1:{node_port}")]),
        |_| {},
    )
    .await;
    let node = std::thread::spawn(move || {
        let read_all = |s: &mut TcpStream| {
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).map(|_| got)
        };
        // The client ends first: the node reads to its end, then answers and closes.
        let (mut s, _) = node.accept().unwrap();
        let got = read_all(&mut s).unwrap();
        s.write_all(format!("+{}\r\n", got.len()).as_bytes())
            .unwrap();
        drop(s);
        // The node ends first: it says goodbye and half-closes, then reads the client's
        // last words to their end.
        let (mut s, _) = node.accept().unwrap();
        s.write_all(b"+BYE\r\n").unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        read_all(&mut s).unwrap()
    });
    block_in_place(|| {
        let mut c = connect(base);
        c.write_all(b"*1\r\n$4\r\nPING\r\n").unwrap();
        c.shutdown(std::net::Shutdown::Write).unwrap();
        let mut back = Vec::new();
        c.read_to_end(&mut back)
            .expect("the end of a connection closed both ways was not a FIN");
        assert_eq!(back, b"+14\r\n", "the node did not see the client's end");

        let mut c = connect(base);
        let mut back = Vec::new();
        c.read_to_end(&mut back)
            .expect("the node's half-close did not reach the client");
        assert_eq!(back, b"+BYE\r\n");
        c.write_all(b"*1\r\n$4\r\nQUIT\r\n").unwrap();
        c.shutdown(std::net::Shutdown::Write).unwrap();
    });
    let last_words = block_in_place(|| node.join()).unwrap();
    assert_eq!(
        last_words, b"*1\r\n$4\r\nQUIT\r\n",
        "the client's bytes after the node's half-close were lost"
    );
    p.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// `CLIENT INFO` asked through a connection: the `addr=` Valkey sees, which is the proxy's
/// end of its connection to the node.
fn node_side_addr(s: &mut TcpStream) -> SocketAddr {
    ask(s, b"*2\r\n$6\r\nCLIENT\r\n$4\r\nINFO\r\n", |text| {
        (text.matches("\r\n").count() >= 2).then(|| {
            let addr = text
                .split_whitespace()
                .find_map(|f| f.strip_prefix("addr="))
                .unwrap_or_else(|| panic!("no addr= in {text:?}"));
            addr.parse().unwrap()
        })
    })
}

/// A node connection gets TCP keepalive (60 s, then every 10 s) once it has lasted a
/// second: the three socket options are left off connections that end sooner. Seen in the
/// kernel's table of sockets, where the proxy's socket to the node shows its keepalive
/// timer; with the idle timeout on (the default hour) and off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_connection_gets_keepalive_once_it_has_lasted_a_second() {
    let v = block_in_place(Standalone::start).unwrap();
    let node = SocketAddr::from((LO, v.port));
    for idle in [Some(Duration::from_secs(3600)), None] {
        let base = free_port_range(LO, 1);
        let p = proxy(
            routes_file(&v.dir, base, &[format!("127.0.0.1:{}", v.port)]),
            |c| c.idle_timeout = idle,
        )
        .await;
        block_in_place(|| {
            let mut s = connect(base);
            let opened = Instant::now();
            let local = node_side_addr(&mut s);
            // Judged only if seen well within the second. (The table is read in pieces,
            // so a row can be missed while other sockets come and go: then no judgement.)
            let first = keepalive_timer(local, node);
            if opened.elapsed() < Duration::from_millis(800) {
                assert!(
                    !first.is_some_and(|(on, _)| on),
                    "keepalive set at once (idle timeout {idle:?})"
                );
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            let ticks = loop {
                match keepalive_timer(local, node) {
                    Some((true, ticks)) => break ticks,
                    _ if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
                    other => panic!(
                        "no keepalive on the node connection after {:?} (idle timeout \
                         {idle:?}): {other:?}",
                        opened.elapsed()
                    ),
                }
            };
            assert!(
                opened.elapsed() >= Duration::from_secs(1),
                "keepalive before a second"
            );
            // The proxy's 60 s, not the system's two hours.
            assert!(ticks <= 6_000, "keepalive fires in {ticks} ticks");
            ping(&mut s).expect("the connection still answers");
        });
        p.shutdown().await;
    }
}
