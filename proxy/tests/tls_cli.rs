//! The TLS port from the command line: `--help`, flags that need each other, the binary
//! terminating TLS in front of a real valkey-server, and the TLS deploy sample's arguments.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde::Deserialize;
use shardgate_harness::addr::free_port;
use shardgate_harness::proxy_process::ProxyProcess;
use shardgate_harness::tls::{self as ttls, command, text, TestPki};
use shardgate_harness::valkey::Standalone;

const BIN: &str = env!("CARGO_BIN_EXE_shardgate-proxy");
const LO: Ipv4Addr = Ipv4Addr::LOCALHOST;

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(BIN).args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn help_explains_the_tls_port() {
    let (ok, help) = run(&["--help"]);
    assert!(ok);
    for needle in [
        "TLS port (SNI)",
        "--tls-port",
        "--tls-mode",
        "passthrough",
        "terminate",
        "--tls-cert",
        "--tls-key",
        "--tls-client-ca",
        "Nodes over TLS",
        "--tls-backend",
        "--tls-backend-ca",
        "--tls-backend-chain-only",
        "--tls-backend-cert",
        "--tls-backend-key",
        "tls-auth-clients",
        "--sni-prefix",
        "--sni-domain",
        "vc-<s>-<n>.example.com",
    ] {
        assert!(help.contains(needle), "--help lacks {needle}");
    }
}

#[test]
fn flags_that_need_each_other() {
    let base = [
        "--seed",
        "127.0.0.1:1",
        "--base-port",
        "30000",
        "--admin-addr",
        "off",
    ];
    for (extra, want) in [
        (&["--tls-port", "6380"][..], "--sni-prefix"),
        (
            &[
                "--tls-port",
                "6380",
                "--sni-prefix",
                "vc",
                "--sni-domain",
                "example.test",
            ][..],
            "--tls-mode terminate needs --tls-cert and --tls-key",
        ),
        (&["--tls-cert", "x.crt"][..], "--tls-cert needs --tls-port"),
        (
            &[
                "--tls-port",
                "6380",
                "--sni-prefix",
                "vc",
                "--sni-domain",
                "example.test",
                "--tls-mode",
                "passthrough",
                "--tls-cert",
                "x.crt",
            ][..],
            "--tls-cert is for --tls-mode terminate",
        ),
        (
            &[
                "--tls-port",
                "6380",
                "--sni-prefix",
                "vc",
                "--sni-domain",
                "example.test",
                "--tls-cert",
                "/nonexistent/tls.crt",
                "--tls-key",
                "/nonexistent/tls.key",
            ][..],
            "/nonexistent/tls.crt: cannot read",
        ),
        (
            &[
                "--tls-backend",
                "tls",
                "--tls-backend-ca",
                "/nonexistent/ca.crt",
            ][..],
            "--tls-backend tls needs a name to check",
        ),
        (
            &[
                "--tls-backend",
                "tls",
                "--tls-backend-ca",
                "/nonexistent/ca.crt",
                "--tls-backend-chain-only",
            ][..],
            "nodes over TLS (--tls-backend tls): /nonexistent/ca.crt: cannot read",
        ),
        (&["--tls-backend-cert", "c.crt"][..], "--tls-backend-key"),
    ] {
        let mut args: Vec<&str> = base.to_vec();
        args.extend_from_slice(extra);
        let (ok, out) = run(&args);
        assert!(!ok, "{args:?} should fail");
        assert!(out.contains(want), "{args:?}: want {want:?} in\n{out}");
    }
}

#[test]
fn the_binary_terminates_tls_in_front_of_valkey() {
    let server = Standalone::start().unwrap();
    let pki = TestPki::new("example.test").unwrap();
    let cert = pki.wildcard("proxy").unwrap();
    let routes = pki.dir().join("routes.yaml");
    std::fs::write(
        &routes,
        shardgate_harness::routes::one_node_per_shard(
            free_port(LO),
            &[format!("127.0.0.1:{}", server.port)],
        ),
    )
    .unwrap();
    let admin = SocketAddr::from((LO, free_port(LO)));
    let tls_port = free_port(LO);
    let args: Vec<String> = [
        "--listen-ip",
        "127.0.0.1",
        "--admin-addr",
        &admin.to_string(),
        "--routes",
        &routes.to_string_lossy(),
        "--tls-port",
        &tls_port.to_string(),
        "--sni-prefix",
        "vc",
        "--sni-domain",
        "example.test",
        "--tls-cert",
        &cert.cert.to_string_lossy(),
        "--tls-key",
        &cert.key.to_string_lossy(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let proxy = ProxyProcess::spawn(Path::new(BIN), &args, Some(admin)).unwrap();
    proxy.wait_ready(Duration::from_secs(10)).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let addr = SocketAddr::from((LO, tls_port));
        let mut tls = ttls::connect(addr, "vc-0-0.example.test", pki.client_config(None))
            .await
            .unwrap();
        command(&mut tls, &["SET", "k", "v"]).await.unwrap();
        assert_eq!(text(&command(&mut tls, &["GET", "k"]).await.unwrap()), "v");
        let err = ttls::connect(addr, "vc-0-0.example.org", pki.client_config(None))
            .await
            .unwrap_err();
        assert!(format!("{err:#}").contains("UnrecognisedName"), "{err:#}");
    });
    proxy
        .wait_log("TLS port refused a connection", Duration::from_secs(5))
        .unwrap();
}

#[test]
fn the_tls_deploy_sample_parses_on_the_command_line() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/proxy/shardgate-proxy-tls.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let docs: Vec<serde_json::Value> = serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde_json::Value::deserialize(d).unwrap())
        .collect();
    let deployment = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let mut args: Vec<String> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect();
    args.extend(["--admin-addr".into(), "off".into()]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    // Every flag parses; it stops at the certificate, which exists only in the pod.
    let (ok, out) = run(&refs);
    assert!(!ok);
    assert!(
        out.contains("/etc/shardgate/tls/tls.crt: cannot read"),
        "{out}"
    );
    let mount = container["volumeMounts"][0]["mountPath"].as_str().unwrap();
    assert!(args.contains(&format!("{mount}/tls.crt")));
    let service = docs.iter().find(|d| d["kind"] == "Service").unwrap();
    let at = args.iter().position(|a| a == "--tls-port").unwrap();
    assert_eq!(
        service["spec"]["ports"][0]["port"].to_string(),
        args[at + 1]
    );
}
