//! The binary as a user meets it: `--help`, refusals of bad route files, reloads that keep
//! the last good table, an unreachable seed.

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use shardgate_harness::addr::{free_port, free_port_range};
use shardgate_harness::http::{get, metric};
use shardgate_harness::proxy_process::ProxyProcess;

const BIN: &str = env!("CARGO_BIN_EXE_shardgate-proxy");
const LO: Ipv4Addr = Ipv4Addr::LOCALHOST;

fn tmp_file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("shardgate-cli-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("routes.yaml");
    write_atomically(&path, text);
    path
}

/// As a ConfigMap update does: a new file renamed over the old one.
fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn start(args: &[String], admin: SocketAddr) -> ProxyProcess {
    let mut all = vec![
        "--listen-ip".to_string(),
        "127.0.0.1".into(),
        "--admin-addr".into(),
        admin.to_string(),
    ];
    all.extend_from_slice(args);
    ProxyProcess::spawn(Path::new(BIN), &all, Some(admin)).unwrap()
}

fn routes_version(admin: SocketAddr) -> u64 {
    let (_, body) = get(admin, "/routes").unwrap();
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["version"].as_u64().unwrap()
}

#[test]
fn help_explains_how_to_run_it() {
    let out = Command::new(BIN).arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "--routes",
        "--seed",
        "--base-port",
        "basePort + flatIndex",
        "cluster-announce-client-port",
        "/metrics",
        "--drain-timeout",
        "shards:",
        "--kubernetes <NAMESPACE/CLUSTER>",
        "--kube-selector",
    ] {
        assert!(help.contains(needle), "--help lacks {needle:?}:\n{help}");
    }
    let out = Command::new(BIN).output().unwrap();
    assert!(!out.status.success(), "no source must be an error");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--routes") && err.contains("--seed"), "{err}");
}

#[test]
fn bad_route_files_refuse_to_start_with_a_clear_error() {
    for (name, text, want) in [
        ("malformed", "basePort: 30000\nshards: [\n", "invalid route file"),
        (
            "past-65535",
            "basePort: 65535\nshards:\n- nodes: [127.0.0.1:6379, 127.0.0.1:6380]\n",
            "basePort: the last port, basePort 65535 + shards 1 * stride 2 - 1 = 65536, is past 65535",
        ),
        (
            "duplicate",
            "basePort: 30000\nshards:\n- nodes: [127.0.0.1:6379, 127.0.0.1:6380]\n- nodes:\n  - address: 127.0.0.1:6381\n    port: 30000\n",
            "shards[1].nodes[0].port: listener port 30000 is already used by shards[0].nodes[0]",
        ),
    ] {
        let path = tmp_file(name, text);
        let out = Command::new(BIN)
            .args(["--admin-addr", "off", "--listen-ip", "127.0.0.1", "--routes"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{name}: started anyway");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{name}: stderr lacks {want:?}:\n{err}");
        assert!(err.contains(&path.display().to_string()), "{name}: error must name the file:\n{err}");
    }
}

#[test]
fn kubernetes_without_an_api_to_talk_to_refuses_to_start_with_a_clear_error() {
    let out = Command::new(BIN)
        .args(["--admin-addr", "off", "--listen-ip", "127.0.0.1"])
        .args(["--kubernetes", "valkey/vc", "--base-port", "30000"])
        // Neither a kubeconfig nor in-cluster configuration.
        .env("KUBECONFIG", "/nonexistent/kubeconfig")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBERNETES_SERVICE_PORT")
        .output()
        .unwrap();
    assert!(!out.status.success(), "started anyway");
    let err = String::from_utf8_lossy(&out.stderr);
    let want = if cfg!(feature = "kubernetes") {
        "--kubernetes: no Kubernetes API to talk to"
    } else {
        "built without its `kubernetes` feature"
    };
    assert!(err.contains(want), "stderr lacks {want:?}:\n{err}");
}

#[test]
fn a_bad_reload_keeps_the_last_good_table() {
    let base = free_port_range(LO, 4);
    let admin = SocketAddr::from((LO, free_port(LO)));
    // The backends need not run: this test is about the table, not traffic.
    let good = format!("basePort: {base}\nshards:\n- nodes: [127.0.0.1:1]\n");
    let path = tmp_file("reload", &good);
    let mut proxy = start(
        &[
            "--routes".into(),
            path.display().to_string(),
            "--routes-poll".into(),
            "50ms".into(),
        ],
        admin,
    );
    proxy.wait_ready(Duration::from_secs(10)).unwrap();
    assert_eq!(routes_version(admin), 1);
    assert!(
        TcpStream::connect((LO, base)).is_ok(),
        "listener {base} not bound"
    );

    for (i, bad) in [
        "basePort: [\n".to_string(),
        "basePort: 65535\nshards:\n- nodes: [127.0.0.1:1, 127.0.0.1:2]\n".to_string(),
        format!("basePort: {base}\nshards:\n- nodes: [127.0.0.1:1, 127.0.0.1:2]\n- nodes:\n  - address: 127.0.0.1:3\n    port: {base}\n"),
    ]
    .iter()
    .enumerate()
    {
        write_atomically(&path, bad);
        let want = format!("shardgate_proxy_route_source_errors_total{{source=\"file\"}} {}", i + 1);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let (_, m) = get(admin, "/metrics").unwrap();
            if m.contains(&want) {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "error {i} not counted:\n{m}\n{}", proxy.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(proxy.is_running(), "a bad reload stopped the proxy");
        assert_eq!(routes_version(admin), 1, "a bad file replaced the table");
        assert_eq!(get(admin, "/readyz").unwrap().0, 200);
        assert!(TcpStream::connect((LO, base)).is_ok(), "the listener went away");
    }
    assert!(proxy.log().contains("past 65535"), "{}", proxy.log());

    // A good file again: swapped in, the new port bound, the old one closed.
    let next = format!("basePort: {}\nshards:\n- nodes: [127.0.0.1:1]\n", base + 2);
    write_atomically(&path, &next);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while routes_version(admin) != 2 {
        assert!(std::time::Instant::now() < deadline, "{}", proxy.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    proxy.wait_ready(Duration::from_secs(5)).unwrap();
    assert!(TcpStream::connect((LO, base + 2)).is_ok());
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while TcpStream::connect((LO, base)).is_ok() {
        assert!(
            std::time::Instant::now() < deadline,
            "old listener {base} still open"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn an_unreachable_seed_is_reported_and_the_proxy_waits() {
    let closed = free_port(LO);
    let admin = SocketAddr::from((LO, free_port(LO)));
    let base = free_port_range(LO, 4);
    let mut proxy = start(
        &[
            "--seed".into(),
            format!("127.0.0.1:{closed}"),
            "--base-port".into(),
            base.to_string(),
            "--connect-timeout".into(),
            "500ms".into(),
        ],
        admin,
    );
    proxy
        .wait_log("no seed answered CLUSTER SHARDS", Duration::from_secs(10))
        .unwrap();
    assert!(
        proxy.log().contains(&format!("127.0.0.1:{closed}")),
        "{}",
        proxy.log()
    );
    assert!(proxy.is_running());
    let (status, body) = get(admin, "/readyz").unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("no route table"), "{body}");
    assert!(body.contains("route source seed failing"), "{body}");
    let (_, m) = get(admin, "/metrics").unwrap();
    assert_eq!(
        metric(&m, "shardgate_proxy_route_source_up{source=\"seed\"}"),
        Some(0.0),
        "{m}"
    );
    assert!(
        metric(
            &m,
            "shardgate_proxy_route_source_errors_total{source=\"seed\"}"
        )
        .unwrap_or(0.0)
            >= 1.0,
        "{m}"
    );
    assert_eq!(
        metric(&m, "shardgate_proxy_route_table_version"),
        Some(0.0),
        "{m}"
    );
}

#[test]
fn sigterm_drains_open_connections_then_exits_cleanly() {
    use std::io::{Read, Write};
    let valkey = shardgate_harness::valkey::Standalone::start().unwrap();
    let base = free_port_range(LO, 1);
    let admin = SocketAddr::from((LO, free_port(LO)));
    let path = tmp_file(
        "sigterm",
        &format!(
            "basePort: {base}\nshards:\n- nodes: [127.0.0.1:{}]\n",
            valkey.port
        ),
    );
    let mut proxy = start(
        &[
            "--routes".into(),
            path.display().to_string(),
            "--drain-timeout".into(),
            "20s".into(),
        ],
        admin,
    );
    proxy.wait_ready(Duration::from_secs(10)).unwrap();
    let ping = |s: &mut TcpStream| -> std::io::Result<()> {
        s.write_all(b"*1\r\n$4\r\nPING\r\n")?;
        let mut buf = [0u8; 7];
        s.read_exact(&mut buf)?;
        assert_eq!(&buf, b"+PONG\r\n");
        Ok(())
    };
    let mut open = TcpStream::connect((LO, base)).unwrap();
    open.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    ping(&mut open).unwrap();

    proxy.signal("TERM").unwrap();
    proxy.wait_log("draining", Duration::from_secs(5)).unwrap();
    // The log line comes before the listeners close; /metrics says when they have.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while get(admin, "/metrics")
        .ok()
        .and_then(|(_, m)| metric(&m, "shardgate_proxy_listeners"))
        != Some(0.0)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the listener never closed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        get(admin, "/readyz").unwrap().0,
        503,
        "still ready while draining"
    );
    assert!(
        TcpStream::connect((LO, base)).is_err(),
        "still accepting while draining"
    );
    ping(&mut open).expect("the open connection was cut by SIGTERM");
    assert!(proxy.is_running(), "exited before its connection finished");

    drop(open);
    let status = proxy.wait_exit(Duration::from_secs(10)).unwrap();
    assert!(
        status.success(),
        "exit status {status}; log:\n{}",
        proxy.log()
    );
    assert!(proxy.log().contains("stopped"), "{}", proxy.log());
}
