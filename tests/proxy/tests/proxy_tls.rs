//! The TLS port, routed by SNI, against real Valkey nodes: termination (with topology
//! rewriting to the per-node SNI names, a rustls client, `redis-cli --tls --sni` and the redis
//! crate's cluster client over TLS), passthrough to TLS-speaking nodes (valkey behind
//! stunnel), TLS backends, refusals that open no backend connection, certificate errors, mTLS,
//! and a certificate reload during traffic.
//!
//! No DNS here: clients dial 127.0.0.1 with an explicit SNI name, and the cluster client
//! resolves `*.example.test` to 127.0.0.1 through its DNS resolver hook.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use shardgate_crds::{node_hostname, Hostnames, NodeRef};
use shardgate_harness::addr::{free_port, free_port_range};
use shardgate_harness::clients::{cli, spread_keys};
use shardgate_harness::http::{get, metric, metric_value};
use shardgate_harness::stunnel::Stunnel;
use shardgate_harness::tls::{self as ttls, command, text, CertPair, TestPki};
use shardgate_harness::valkey::{
    key_slot, slot_tags, ClusterSpec, Standalone, ValkeyCluster, DEFAULT_PORT,
};
use shardgate_proxy::config::CertFiles;
use shardgate_proxy::config::DetectLimits;
use shardgate_proxy::config::{BackendName, BackendTlsConfig, Identity};
use shardgate_proxy::config::{TlsConfig, TlsModeConfig};
use shardgate_proxy::model::Backend;
use shardgate_proxy::resp::{Scan, Scanner};
use shardgate_proxy::tls::sni::testing::{client_hello, message, records};
use shardgate_proxy::{Proxy, ProxyConfig, ProxyHandle, SourceConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::block_in_place;

const LO: Ipv4Addr = Ipv4Addr::LOCALHOST;
const DOMAIN: &str = "example.test";

fn names() -> Hostnames {
    Hostnames {
        prefix: "vc".into(),
        domain: DOMAIN.into(),
    }
}

fn name(s: u32, n: u32) -> String {
    node_hostname("vc", NodeRef::new(s, n), DOMAIN)
}

fn terminate(cert: &CertPair, client_ca: Option<PathBuf>) -> TlsModeConfig {
    TlsModeConfig::Terminate {
        files: CertFiles {
            cert: cert.cert.clone(),
            key: cert.key.clone(),
            client_ca,
        },
        reload: Duration::from_millis(100),
    }
}

/// An in-process proxy with a TLS port.
struct TlsProxy {
    handle: ProxyHandle,
    tls: SocketAddr,
    admin: SocketAddr,
}

impl TlsProxy {
    async fn start(source: SourceConfig, mode: TlsModeConfig, rewrite: bool) -> TlsProxy {
        Self::start_with(source, mode, rewrite, BackendTlsConfig::Plain).await
    }

    /// With `backend`, the legs to the nodes.
    async fn start_with(
        source: SourceConfig,
        mode: TlsModeConfig,
        rewrite: bool,
        backend: BackendTlsConfig,
    ) -> TlsProxy {
        let port = free_port(LO);
        let mut config = ProxyConfig::new(source);
        config.backend_tls = backend;
        config.listen_ip = LO.into();
        config.admin_addr = Some(SocketAddr::from((LO, 0)));
        config.rewrite = rewrite;
        config.advertise_host = Some("127.0.0.1".into());
        config.drain_timeout = Duration::from_millis(200);
        config.tls = Some(TlsConfig {
            port,
            names: names(),
            mode,
            detect: DetectLimits {
                timeout: Duration::from_millis(800),
                max_bytes: 16 * 1024,
            },
        });
        let handle = Proxy::start(config).await.unwrap();
        assert!(handle.wait_ready(Duration::from_secs(10)).await);
        let admin = handle.admin_addr().unwrap();
        TlsProxy {
            handle,
            tls: SocketAddr::from((LO, port)),
            admin,
        }
    }

    fn metric(&self, sample: &str) -> f64 {
        metric_value(&get(self.admin, "/metrics").unwrap().1, sample).unwrap()
    }

    fn refused(&self, reason: &str) -> f64 {
        self.metric(&format!(
            "shardgate_proxy_tls_refused_total{{reason=\"{reason}\"}}"
        ))
    }
}

/// A route file for `cluster`: each node's address and id, and its TLS address if given.
fn routes_file(dir: &std::path::Path, cluster: &ValkeyCluster, tls: &[SocketAddr]) -> SourceConfig {
    let spec = cluster.spec();
    let base = free_port_range(LO, (spec.shards * (spec.replicas + 1)) as u16);
    let out = shardgate_harness::routes::routes_yaml_with_tls(base, cluster, tls);
    let path = dir.join("routes.yaml");
    std::fs::write(&path, out).unwrap();
    SourceConfig::File {
        path,
        poll: Duration::from_secs(1),
    }
}

/// Resolves every `*.example.test` name (and 127.0.0.1) to 127.0.0.1: there is no DNS here.
struct Loopback;

impl redis::io::AsyncDNSResolver for Loopback {
    fn resolve<'a, 'b: 'a>(
        &'a self,
        host: &'b str,
        port: u16,
    ) -> redis::RedisFuture<'a, Box<dyn Iterator<Item = SocketAddr> + Send + 'a>> {
        Box::pin(async move {
            if host.ends_with(&format!(".{DOMAIN}")) || host == "127.0.0.1" {
                let it: Box<dyn Iterator<Item = SocketAddr> + Send> =
                    Box::new(std::iter::once(SocketAddr::from((LO, port))));
                Ok(it)
            } else {
                Err(std::io::Error::other(format!("no loopback name: {host}")).into())
            }
        })
    }
}

/// The redis crate's cluster client over TLS, bootstrapped from `<prefix>.<domain>`.
async fn tls_cluster_client(pki: &TestPki, port: u16) -> redis::cluster_async::ClusterConnection {
    redis::cluster::ClusterClientBuilder::new(vec![format!("rediss://vc.{DOMAIN}:{port}")])
        .certs(redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(pki.ca_pem.clone().into_bytes()),
        })
        .async_dns_resolver(Loopback)
        .retries(10)
        .connection_timeout(Duration::from_secs(3))
        .response_timeout(Duration::from_secs(3))
        .build()
        .unwrap()
        .get_async_connection()
        .await
        .unwrap()
}

/// SET then GET keys in every shard through the cluster client.
async fn cross_shard_set_get(con: &mut redis::cluster_async::ClusterConnection, tag: &str) {
    let keys = spread_keys(60, tag);
    for (i, k) in keys.iter().enumerate() {
        let _: () = con.set(k, i).await.unwrap();
    }
    for (i, k) in keys.iter().enumerate() {
        let v: usize = con.get(k).await.unwrap();
        assert_eq!(v, i, "{k}");
    }
}

/// The keys [`cross_shard_set_get`] wrote with `tag`, read from the nodes themselves (not
/// through the proxy): each is on the node that Valkey says owns its slot, with its value,
/// and together they reached every shard. What the proxy's names routed is checked
/// against Valkey, not against how the test built its keys.
fn landed_on_their_owners(cluster: &ValkeyCluster, tag: &str) {
    let mut shards = std::collections::BTreeSet::new();
    for (i, k) in spread_keys(60, tag).iter().enumerate() {
        let owner = cluster.slot_owner(key_slot(k.as_bytes())).unwrap();
        let got: Option<String> = cluster.node(owner).query(&["GET", k]).unwrap();
        assert_eq!(got, Some(i.to_string()), "{k} at its owner {owner}");
        shards.insert(owner.shard);
    }
    assert_eq!(
        shards.len() as u32,
        cluster.spec().shards,
        "shards written: {shards:?}"
    );
}

/// Every string in a reply, joined.
fn flat(v: &redis::Value) -> String {
    match v {
        redis::Value::Array(items) | redis::Value::Set(items) => {
            items.iter().map(flat).collect::<Vec<_>>().join(" ")
        }
        redis::Value::Map(pairs) => pairs
            .iter()
            .map(|(k, v)| format!("{} {}", flat(k), flat(v)))
            .collect::<Vec<_>>()
            .join(" "),
        redis::Value::Int(i) => i.to_string(),
        other => text(other),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminate_routes_every_name_and_hands_out_sni_names() {
    let pki = TestPki::new(DOMAIN).unwrap();
    let cert = pki.wildcard("proxy").unwrap();
    let cluster =
        Arc::new(block_in_place(|| ValkeyCluster::start(ClusterSpec::new(3, 1))).unwrap());
    let base = free_port_range(LO, 6);
    let source = SourceConfig::Seed {
        seeds: vec![Backend::ip(cluster.node(NodeRef::new(0, 0)).addr())],
        base_port: base,
        ports_per_shard: None,
        refresh: Duration::from_secs(1),
    };
    let p = TlsProxy::start(source, terminate(&cert, None), true).await;
    let config = pki.client_config(None);

    // Node names reach their node; the shard name its primary; the bootstrap name any node.
    for s in 0..3 {
        for n in 0..2 {
            let mut tls = ttls::connect(p.tls, &name(s, n), config.clone())
                .await
                .unwrap();
            let id = text(&command(&mut tls, &["CLUSTER", "MYID"]).await.unwrap());
            assert_eq!(
                id,
                cluster.node(NodeRef::new(s, n)).node_id,
                "{}",
                name(s, n)
            );
        }
        let mut tls = ttls::connect(p.tls, &format!("vc-{s}.{DOMAIN}"), config.clone())
            .await
            .unwrap();
        let role = flat(&command(&mut tls, &["ROLE"]).await.unwrap());
        assert!(role.starts_with("master"), "shard {s}: {role}");
    }
    let mut boot = ttls::connect(p.tls, &format!("vc.{DOMAIN}"), config.clone())
        .await
        .unwrap();
    assert_eq!(text(&command(&mut boot, &["PING"]).await.unwrap()), "PONG");

    // Topology on the TLS port names the nodes' SNI names on the TLS port.
    let tls_port = p.tls.port().to_string();
    let slots = flat(&command(&mut boot, &["CLUSTER", "SLOTS"]).await.unwrap());
    for s in 0..3 {
        for n in 0..2 {
            assert!(slots.contains(&name(s, n)), "{slots}");
        }
    }
    assert!(slots.contains(&tls_port), "{slots}");
    for node in cluster.nodes() {
        assert!(!slots.contains(&node.ip().to_string()), "{slots}");
    }
    let shards = flat(&command(&mut boot, &["CLUSTER", "SHARDS"]).await.unwrap());
    assert!(
        shards.contains("tls-port") && shards.contains(&name(2, 1)),
        "{shards}"
    );
    let slot = *cluster.spec().initial_slots(2u32).start();
    let key = format!("{}k", slot_tags()[usize::from(slot)]);
    let mut n0 = ttls::connect(p.tls, &name(0, 0), config.clone())
        .await
        .unwrap();
    let moved = text(&command(&mut n0, &["GET", &key]).await.unwrap());
    assert_eq!(moved, format!("MOVED {slot} {}:{tls_port}", name(2, 0)));
    // Byte for byte what the node says to a direct client: a pipelined burst whose 3 MiB
    // value is more than a socket, a read buffer or rustls's queue of records holds, each
    // way.
    let value: String = (0..3 << 20)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    let own = *cluster.spec().initial_slots(0u32).start();
    let big = format!("{}big", slot_tags()[usize::from(own)]);
    let burst: &[&[&str]] = &[
        &["SET", &big, &value],
        &["PING"],
        &["GET", &big],
        &["STRLEN", &big],
        // Last, so that nothing after it pushes out what the socket did not take.
        &["GET", &big],
    ];
    let mut direct = TcpStream::connect(cluster.node(NodeRef::new(0, 0)).addr())
        .await
        .unwrap();
    let want = pipeline(&mut direct, burst).await;
    assert!(
        want.len() > 6 << 20,
        "the node's replies: {} bytes",
        want.len()
    );
    let mut big_tls = ttls::connect(p.tls, &name(0, 0), config.clone())
        .await
        .unwrap();
    let got = pipeline(&mut big_tls, burst).await;
    assert!(
        got == want,
        "{} bytes through TLS, {} direct",
        got.len(),
        want.len()
    );

    // The plain ports keep handing out the advertised host and their own ports.
    let mut plain = TcpStream::connect((LO, base)).await.unwrap();
    let moved = text(&command(&mut plain, &["GET", &key]).await.unwrap());
    assert_eq!(moved, format!("MOVED {slot} 127.0.0.1:{}", base + 4));

    // TLS 1.2 only, and redis-cli (OpenSSL) with --sni.
    let tls12 = ttls::client_config(&[&pki.ca_pem], None, Some(&[&rustls::version::TLS12]));
    let mut c12 = ttls::connect(p.tls, &name(1, 0), tls12).await.unwrap();
    assert_eq!(text(&command(&mut c12, &["PING"]).await.unwrap()), "PONG");
    let ca = pki.ca.to_string_lossy().to_string();
    let cli_id = block_in_place(|| {
        cli(&[
            "--tls",
            "--sni",
            &name(1, 1),
            "--cacert",
            &ca,
            "-h",
            "127.0.0.1",
            "-p",
            &tls_port,
            "CLUSTER",
            "MYID",
        ])
    })
    .unwrap();
    assert_eq!(cli_id, cluster.node(NodeRef::new(1, 1)).node_id);
    assert!(p.metric("shardgate_proxy_tls_handshakes_total{version=\"TLSv1_2\"}") >= 1.0);
    assert!(p.metric("shardgate_proxy_tls_handshakes_total{version=\"TLSv1_3\"}") >= 8.0);

    // A cluster client over TLS: cross-shard SET/GET through per-node names.
    let mut con = tls_cluster_client(&pki, p.tls.port()).await;
    cross_shard_set_get(&mut con, "tls").await;
    block_in_place(|| landed_on_their_owners(&cluster, "tls"));

    // After a failover the shard name follows the new primary (seed refresh: 1s).
    let c = cluster.clone();
    block_in_place(|| c.failover(NodeRef::new(1, 1))).unwrap();
    let want = cluster.node(NodeRef::new(1, 1)).node_id.clone();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let mut tls = ttls::connect(p.tls, &format!("vc-1.{DOMAIN}"), config.clone())
            .await
            .unwrap();
        let id = text(&command(&mut tls, &["CLUSTER", "MYID"]).await.unwrap());
        if id == want {
            break;
        }
        assert!(Instant::now() < deadline, "vc-1 still goes to {id}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    cross_shard_set_get(&mut con, "after-failover").await;
    drop(con);
    p.handle.shutdown().await;
}

/// A real Valkey node whose connections the test counts: `total_connections_received`,
/// read over one connection opened up front (itself counted once, before the baseline).
struct CountedNode {
    server: Standalone,
    admin: redis::aio::MultiplexedConnection,
    baseline: u64,
}

impl CountedNode {
    async fn start() -> CountedNode {
        let server = block_in_place(Standalone::start).unwrap();
        let mut admin = redis::Client::open(format!("redis://127.0.0.1:{}", server.port))
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let baseline = Self::received(&mut admin).await;
        CountedNode {
            server,
            admin,
            baseline,
        }
    }

    fn addr(&self) -> SocketAddr {
        SocketAddr::from((LO, self.server.port))
    }

    async fn received(admin: &mut redis::aio::MultiplexedConnection) -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("stats")
            .query_async(admin)
            .await
            .unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("total_connections_received:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("INFO stats has total_connections_received")
    }

    /// Connections the node accepted since [`CountedNode::start`], the test's own aside.
    async fn dialled(&mut self) -> u64 {
        Self::received(&mut self.admin).await - self.baseline
    }
}

fn one_node_routes(dir: &std::path::Path, backend: SocketAddr) -> SourceConfig {
    let path = dir.join("routes.yaml");
    std::fs::write(
        &path,
        shardgate_harness::routes::one_node_per_shard(free_port(LO), &[backend]),
    )
    .unwrap();
    SourceConfig::File {
        path,
        poll: Duration::from_secs(1),
    }
}

/// Sends `bytes` (then half-closes if `close`), returns what came back before the proxy
/// closed the connection. Every refusal closes it; one that does not within 30 s (a limit
/// only a broken proxy reaches, not a slow machine) fails the test.
async fn raw(addr: SocketAddr, bytes: &[u8], close: bool) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    if close {
        s.shutdown().await.unwrap();
    }
    let mut out = vec![];
    match tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out)).await {
        Ok(Ok(_)) => {}
        // A reset after the refusal's bytes is a close too.
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Ok(Err(e)) => panic!("reading the refusal of {bytes:?}: {e}"),
        Err(_) => panic!("the proxy kept the connection open after {bytes:?}: {out:?}"),
    }
    out
}

const fn alert(desc: u8) -> [u8; 7] {
    [21, 3, 3, 0, 2, 2, desc]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_clear_counted_and_dial_nothing() {
    let pki = TestPki::new(DOMAIN).unwrap();
    let cert = pki.wildcard("proxy").unwrap();
    // A real node: that the proxy dials nothing for a refused client is read from its
    // own connection count.
    let mut backend = CountedNode::start().await;
    let source = one_node_routes(pki.dir(), backend.addr());
    let p = TlsProxy::start(source, terminate(&cert, None), false).await;
    let config = pki.client_config(None);

    // An unknown name and a name of a node that does not exist: unrecognized_name.
    for sni in ["other.example.org", "vc-7-0.example.test"] {
        let err = ttls::connect(p.tls, sni, config.clone()).await.unwrap_err();
        assert!(
            format!("{err:#}").contains("UnrecognisedName"),
            "{sni}: {err:#}"
        );
    }
    // No SNI: missing_extension.
    assert_eq!(raw(p.tls, &client_hello(None, 0), false).await, alert(109));
    // Not TLS: a RESP client sees an error line.
    let reply = raw(p.tls, b"*1\r\n$4\r\nPING\r\n", false).await;
    assert!(
        String::from_utf8_lossy(&reply).starts_with("-ERR this port speaks TLS only"),
        "{reply:?}"
    );
    assert!(raw(p.tls, b"GET / HTTP/1.1\r\n\r\n", false)
        .await
        .starts_with(b"-ERR"));
    // Truncated: the client closes halfway; nothing to say.
    let hello = client_hello(Some(&name(0, 0)), 0);
    assert_eq!(raw(p.tls, &hello[..hello.len() / 2], true).await, b"");
    // Oversized (in records small enough to be legal): handshake_failure.
    let big = records(&message(&client_hello(Some(&name(0, 0)), 30_000)), 16_000);
    assert_eq!(raw(p.tls, &big, false).await, alert(40));
    // Garbled inside (cipher_suites length): decode_error.
    let mut bad = hello.clone();
    bad[5 + 4 + 2 + 32 + 1] = 0xff;
    assert_eq!(raw(p.tls, &bad, false).await, alert(50));
    // A handshake record that is no ClientHello: decode_error.
    assert_eq!(
        raw(p.tls, &[22, 3, 3, 0, 4, 2, 0, 0, 0], false).await,
        alert(50)
    );
    // Silent after three bytes: closed at the hello timeout (800 ms), never before it; how
    // much later depends on the machine, so only `raw`'s limit bounds it.
    let t = Instant::now();
    assert_eq!(raw(p.tls, &[22, 3, 1], false).await, b"");
    assert!(
        t.elapsed() >= Duration::from_millis(800),
        "closed {:?} after connecting, before the hello timeout",
        t.elapsed()
    );

    assert_eq!(
        backend.dialled().await,
        0,
        "a refused client made the proxy dial"
    );
    for (reason, n) in [
        ("unknown_sni", 1.0),
        ("no_route", 1.0),
        ("no_sni", 1.0),
        ("not_tls", 2.0),
        ("closed", 1.0),
        ("too_large", 1.0),
        ("malformed", 1.0),
        ("not_client_hello", 1.0),
        ("timeout", 1.0),
    ] {
        assert_eq!(p.refused(reason), n, "{reason}");
    }
    let accepted = format!(
        "shardgate_proxy_connections_accepted_total{{port=\"{}\"}}",
        p.tls.port()
    );
    assert_eq!(p.metric(&accepted), 0.0);

    // And a good name does reach the node.
    let mut tls = ttls::connect(p.tls, &name(0, 0), config).await.unwrap();
    assert_eq!(text(&command(&mut tls, &["PING"]).await.unwrap()), "PONG");
    assert_eq!(backend.dialled().await, 1);
    p.handle.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_errors_and_mtls() {
    let pki = TestPki::new(DOMAIN).unwrap();
    let other = TestPki::new("other.test").unwrap();
    let server = Standalone::start().unwrap();
    let backend = SocketAddr::from((LO, server.port));
    let trusting = pki.client_config(None);

    // A client that trusts another CA.
    let good = pki.wildcard("good").unwrap();
    let p = TlsProxy::start(
        one_node_routes(pki.dir(), backend),
        terminate(&good, None),
        false,
    )
    .await;
    let err = ttls::connect(p.tls, &name(0, 0), other.client_config(None))
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("UnknownIssuer"), "{err:#}");
    p.handle.shutdown().await;

    // A certificate for other names, and an expired one.
    let mismatched = pki
        .server_cert("mismatched", &["*.other.test".into()], false)
        .unwrap();
    let expired = pki.expired_wildcard("expired").unwrap();
    for (cert, want) in [(&mismatched, "not valid for name"), (&expired, "expired")] {
        let p = TlsProxy::start(
            one_node_routes(pki.dir(), backend),
            terminate(cert, None),
            false,
        )
        .await;
        let err = ttls::connect(p.tls, &name(0, 0), trusting.clone())
            .await
            .unwrap_err();
        let msg = format!("{err:#}").to_lowercase();
        assert!(msg.contains(want), "{want}: {msg}");
        p.handle.shutdown().await;
    }

    // mTLS: no client certificate, one from another CA, then a good one.
    let p = TlsProxy::start(
        one_node_routes(pki.dir(), backend),
        terminate(&good, Some(pki.ca.clone())),
        false,
    )
    .await;
    let wrong = other.client_cert("wrong-client", "intruder").unwrap();
    let right = pki.client_cert("client", "app").unwrap();
    for (client, want) in [(None, "CertificateRequired"), (Some(&wrong), "UnknownCA")] {
        let config = pki_client(&pki, client);
        let outcome = async {
            let mut tls = ttls::connect(p.tls, &name(0, 0), config).await?;
            command(&mut tls, &["PING"]).await
        }
        .await;
        let err = outcome.unwrap_err();
        assert!(format!("{err:#}").contains(want), "{want}: {err:#}");
    }
    let mut tls = ttls::connect(p.tls, &name(0, 0), pki_client(&pki, Some(&right)))
        .await
        .unwrap();
    assert_eq!(text(&command(&mut tls, &["PING"]).await.unwrap()), "PONG");
    assert_eq!(p.refused("handshake"), 2.0);
    p.handle.shutdown().await;
}

fn pki_client(pki: &TestPki, client: Option<&CertPair>) -> Arc<rustls::ClientConfig> {
    pki.client_config(client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_reload_during_traffic_drops_nothing() {
    let pki = TestPki::new(DOMAIN).unwrap();
    let cert = pki.wildcard("proxy").unwrap();
    let server = Standalone::start().unwrap();
    let p = TlsProxy::start(
        one_node_routes(pki.dir(), SocketAddr::from((LO, server.port))),
        terminate(&cert, None),
        false,
    )
    .await;
    let config = pki.client_config(None);
    let old = cert.cert_der().unwrap();
    let new = pki.wildcard("proxy-2").unwrap();
    let new_der = new.cert_der().unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = vec![];
    // Long-lived connections, each busy all along.
    for w in 0..6 {
        let (stop, config, addr) = (stop.clone(), config.clone(), p.tls);
        workers.push(tokio::spawn(async move {
            let mut tls = ttls::connect(addr, &name(0, 0), config).await?;
            let mut ops = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let k = format!("w{w}");
                command(&mut tls, &["SET", &k, &ops.to_string()]).await?;
                let v = text(&command(&mut tls, &["GET", &k]).await?);
                anyhow::ensure!(v == ops.to_string(), "worker {w}: {v} != {ops}");
                ops += 1;
            }
            anyhow::Ok((ops, None))
        }));
    }
    // New connections all along, noting the certificate each saw.
    {
        let (stop, config, addr, new_der) = (stop.clone(), config.clone(), p.tls, new_der.clone());
        workers.push(tokio::spawn(async move {
            let mut ops = 0u64;
            let mut saw_new = None;
            while !stop.load(Ordering::Relaxed) {
                let mut tls = ttls::connect(addr, &name(0, 0), config.clone()).await?;
                let leaf = tls.get_ref().1.peer_certificates().map(|c| c[0].clone());
                if saw_new.is_none() && leaf.as_ref() == Some(&new_der) {
                    saw_new = Some(ops);
                }
                anyhow::ensure!(text(&command(&mut tls, &["PING"]).await?) == "PONG");
                ops += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            anyhow::Ok((ops, saw_new))
        }));
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    cert.replace_with(&new).unwrap();
    // Wait for the reload to show on a new connection.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut tls = ttls::connect(p.tls, &name(0, 0), config.clone())
            .await
            .unwrap();
        let leaf = tls.get_ref().1.peer_certificates().unwrap()[0].clone();
        // A client that reads what it was sent closes cleanly (no reset).
        assert_eq!(text(&command(&mut tls, &["PING"]).await.unwrap()), "PONG");
        if leaf == new_der {
            break;
        }
        assert_eq!(leaf, old);
        assert!(
            Instant::now() < deadline,
            "the new certificate never showed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A broken version (a key that does not match) is refused; the new one stays.
    let errors = p.metric("shardgate_proxy_tls_certificate_reloads_total{reason=\"error\"}");
    std::fs::write(&cert.key, pki.wildcard("unrelated").unwrap().key_pem).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while p.metric("shardgate_proxy_tls_certificate_reloads_total{reason=\"error\"}") <= errors {
        assert!(
            Instant::now() < deadline,
            "the broken key was never noticed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    for (i, w) in workers.into_iter().enumerate() {
        let (ops, saw_new) = w
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("worker {i}: {e:#}"));
        assert!(ops > 10, "worker {i}: {ops} ops");
        if i == 6 {
            assert!(saw_new.is_some(), "new connections saw the new certificate");
        }
    }
    let mut tls = ttls::connect(p.tls, &name(0, 0), config).await.unwrap();
    assert_eq!(tls.get_ref().1.peer_certificates().unwrap()[0], new_der);
    assert_eq!(text(&command(&mut tls, &["PING"]).await.unwrap()), "PONG");
    assert!(p.metric("shardgate_proxy_tls_certificate_reloads_total{reason=\"ok\"}") >= 1.0);
    assert_eq!(
        p.metric("shardgate_proxy_connections_closed_total{reason=\"client_error\"}")
            + p.metric("shardgate_proxy_connections_closed_total{reason=\"backend_error\"}"),
        0.0
    );
    p.handle.shutdown().await;
}

/// stunnel in front of every node of `cluster`, with `cert`: the TLS address of each node.
fn stunnel_for(cluster: &ValkeyCluster, cert: &CertPair) -> (Stunnel, Vec<SocketAddr>) {
    let services: Vec<(SocketAddr, SocketAddr)> = cluster
        .nodes()
        .iter()
        .map(|n| (SocketAddr::from((LO, free_port(LO))), n.addr()))
        .collect();
    let st = Stunnel::start(&cert.cert, &cert.key, &services).unwrap();
    let tls = services.iter().map(|(a, _)| *a).collect();
    (st, tls)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_to_tls_speaking_nodes() {
    let pki = TestPki::new(DOMAIN).unwrap();
    let node_cert = pki
        .server_cert("nodes", &[format!("*.{DOMAIN}")], false)
        .unwrap();
    // The nodes announce their SNI names and the TLS port (the passthrough deployment).
    let tls_port = free_port(LO);
    let spec = ClusterSpec::new(3, 0)
        .with_config("cluster-preferred-endpoint-type", "hostname")
        .with_node_config(move |n| {
            vec![
                (
                    "cluster-announce-hostname".into(),
                    node_hostname("vc", n, DOMAIN),
                ),
                ("cluster-announce-client-port".into(), tls_port.to_string()),
            ]
        });
    let cluster = block_in_place(|| ValkeyCluster::start(spec)).unwrap();
    let (stunnel, tls_addrs) = block_in_place(|| stunnel_for(&cluster, &node_cert));
    let source = routes_file(pki.dir(), &cluster, &tls_addrs);
    // The port is chosen here so that the nodes could announce it.
    let mut config = ProxyConfig::new(source);
    config.listen_ip = LO.into();
    config.admin_addr = Some(SocketAddr::from((LO, 0)));
    config.drain_timeout = Duration::from_millis(200);
    config.tls = Some(TlsConfig {
        port: tls_port,
        names: names(),
        mode: TlsModeConfig::Passthrough,
        detect: DetectLimits::default(),
    });
    let handle = Proxy::start(config).await.unwrap();
    assert!(handle.wait_ready(Duration::from_secs(10)).await);
    let admin = handle.admin_addr().unwrap();
    let addr = SocketAddr::from((LO, tls_port));
    let config = pki.client_config(None);

    // The node's own certificate comes through: the proxy holds none.
    let mut tls = ttls::connect(addr, &name(1, 0), config.clone())
        .await
        .unwrap();
    let leaf = tls.get_ref().1.peer_certificates().unwrap()[0].clone();
    assert_eq!(leaf, node_cert.cert_der().unwrap());
    let id = text(&command(&mut tls, &["CLUSTER", "MYID"]).await.unwrap());
    assert_eq!(id, cluster.node(NodeRef::new(1, 0)).node_id);

    let ca = pki.ca.to_string_lossy().to_string();
    let port = tls_port.to_string();
    let cli_id = block_in_place(|| {
        cli(&[
            "--tls",
            "--sni",
            &name(2, 0),
            "--cacert",
            &ca,
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "CLUSTER",
            "MYID",
        ])
    })
    .unwrap();
    assert_eq!(cli_id, cluster.node(NodeRef::new(2, 0)).node_id);

    // A cluster client over TLS: the nodes' own topology names the SNI names.
    let mut con = tls_cluster_client(&pki, tls_port).await;
    cross_shard_set_get(&mut con, "passthrough").await;
    drop(con);
    block_in_place(|| landed_on_their_owners(&cluster, "passthrough"));

    // Refusals are the same in passthrough.
    let err = ttls::connect(addr, "nope.example.test", config)
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("UnrecognisedName"), "{err:#}");
    let body = get(admin, "/metrics").unwrap().1;
    assert_eq!(
        metric(
            &body,
            "shardgate_proxy_tls_refused_total{reason=\"unknown_sni\"}"
        ),
        Some(1.0)
    );
    handle.shutdown().await;
    drop(stunnel);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminate_with_tls_backends_and_rewriting() {
    let pki = TestPki::new(DOMAIN).unwrap();
    let cert = pki.wildcard("proxy").unwrap();
    let node_cert = pki
        .server_cert("nodes", &[format!("*.{DOMAIN}")], false)
        .unwrap();
    let cluster = block_in_place(|| ValkeyCluster::start(ClusterSpec::new(3, 0))).unwrap();
    let (_stunnel, tls_addrs) = block_in_place(|| stunnel_for(&cluster, &node_cert));
    let source = routes_file(pki.dir(), &cluster, &tls_addrs);
    let backend = BackendTlsConfig::Tls {
        ca: pki.ca.clone(),
        name: BackendName::Sni(names()),
        identity: None,
    };
    let p = TlsProxy::start_with(source, terminate(&cert, None), true, backend).await;
    let mut tls = ttls::connect(p.tls, &name(0, 0), pki.client_config(None))
        .await
        .unwrap();
    let slots = flat(&command(&mut tls, &["CLUSTER", "SLOTS"]).await.unwrap());
    assert!(slots.contains(&name(2, 0)), "{slots}");
    let mut con = tls_cluster_client(&pki, p.tls.port()).await;
    cross_shard_set_get(&mut con, "tls-backends").await;
    drop(con);
    block_in_place(|| landed_on_their_owners(&cluster, "tls-backends"));
    let port = p.tls.port();
    assert_eq!(
        p.metric(&format!(
            "shardgate_proxy_backend_errors_total{{port=\"{port}\",kind=\"tls\"}}"
        )),
        0.0
    );
    p.handle.shutdown().await;

    // A backend whose certificate does not match the name checked: a clear backend error.
    let backend = BackendTlsConfig::Tls {
        ca: pki.ca.clone(),
        name: BackendName::Fixed("wrong.other.test".into()),
        identity: None,
    };
    let source = routes_file(pki.dir(), &cluster, &tls_addrs);
    let p = TlsProxy::start_with(source, terminate(&cert, None), false, backend).await;
    let mut tls = ttls::connect(p.tls, &name(0, 0), pki.client_config(None))
        .await
        .unwrap();
    assert!(command(&mut tls, &["PING"]).await.is_err());
    let port = p.tls.port();
    assert_eq!(
        p.metric(&format!(
            "shardgate_proxy_backend_errors_total{{port=\"{port}\",kind=\"tls\"}}"
        )),
        1.0
    );
    p.handle.shutdown().await;
}

/// Reads until the proxy closes the connection (or 30 s, which only a broken proxy takes).
async fn until_closed(s: &mut TcpStream) -> Vec<u8> {
    let mut out = vec![];
    match tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Ok(Err(e)) => panic!("reading until the close: {e}"),
        Err(_) => panic!("the proxy kept the connection open: {out:?}"),
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_hellos_cannot_lock_out_the_node_ports() {
    const MAX_CONNECTIONS: usize = 150;
    const HANDSHAKES: usize = 100;
    const SLOW: usize = 200;
    let pki = TestPki::new(DOMAIN).unwrap();
    let cert = pki.wildcard("proxy").unwrap();
    let node = block_in_place(Standalone::start).unwrap();
    let source = one_node_routes(pki.dir(), SocketAddr::from((LO, node.port)));
    let tls_port = free_port(LO);
    let mut config = ProxyConfig::new(source);
    config.listen_ip = LO.into();
    config.admin_addr = Some(SocketAddr::from((LO, 0)));
    config.max_connections = MAX_CONNECTIONS;
    config.tls_max_handshakes = HANDSHAKES;
    config.drain_timeout = Duration::from_millis(200);
    config.tls = Some(TlsConfig {
        port: tls_port,
        names: names(),
        mode: terminate(&cert, None),
        // Far longer than the test: the slow hellos hold their place throughout.
        detect: DetectLimits {
            timeout: Duration::from_secs(300),
            max_bytes: 16 * 1024,
        },
    });
    let proxy = Proxy::start(config).await.unwrap();
    assert!(proxy.wait_ready(Duration::from_secs(10)).await);
    let admin = proxy.admin_addr().unwrap();
    let metric = |sample: &str| {
        block_in_place(|| metric_value(&get(admin, "/metrics").unwrap().1, sample)).unwrap()
    };
    let tls = SocketAddr::from((LO, tls_port));
    let plain = SocketAddr::from((LO, proxy.routes().borrow().ports().next().unwrap()));

    // 200 clients send half a ClientHello each and wait.
    let hello = client_hello(Some(&name(0, 0)), 0);
    let mut slow = vec![];
    for _ in 0..SLOW {
        let mut s = TcpStream::connect(tls).await.unwrap();
        s.write_all(&hello[..hello.len() / 2]).await.unwrap();
        slow.push(s);
    }
    // The budget's worth are held; the rest were closed at once, and said so.
    let over = "shardgate_proxy_tls_refused_total{reason=\"handshake_limit\"}";
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric_value(&get(admin, "/metrics").unwrap().1, over).unwrap_or(0.0)
        < (SLOW - HANDSHAKES) as f64
    {
        assert!(
            Instant::now() < deadline,
            "the handshake budget was never reached"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(metric(over), (SLOW - HANDSHAKES) as f64);
    assert_eq!(
        metric("shardgate_proxy_connections_rejected_total{reason=\"handshake_limit\"}"),
        (SLOW - HANDSHAKES) as f64
    );
    // The node port serves its whole connection limit meanwhile: every connection answers.
    let mut clients = vec![];
    for i in 0..MAX_CONNECTIONS {
        let mut s = TcpStream::connect(plain).await.unwrap();
        s.write_all(b"*1\r\n$4\r\nPING\r\n").await.unwrap();
        let mut reply = [0u8; 7];
        tokio::time::timeout(Duration::from_secs(30), s.read_exact(&mut reply))
            .await
            .unwrap_or_else(|_| panic!("connection {i} got no reply"))
            .unwrap();
        assert_eq!(&reply, b"+PONG\r\n", "connection {i}");
        clients.push(s);
    }
    // One more is past the limit: Valkey's own maxclients line, then the close.
    let mut extra = TcpStream::connect(plain).await.unwrap();
    assert_eq!(
        until_closed(&mut extra).await,
        b"-ERR max number of clients reached\r\n"
    );
    assert_eq!(
        metric("shardgate_proxy_connections_rejected_total{reason=\"connection_limit\"}"),
        1.0
    );
    drop(clients);

    // The slow clients give up: their budget comes back, and a real client gets through.
    drop(slow);
    let gone = "shardgate_proxy_tls_refused_total{reason=\"closed\"}";
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric_value(&get(admin, "/metrics").unwrap().1, gone).unwrap_or(0.0) < HANDSHAKES as f64
    {
        assert!(
            Instant::now() < deadline,
            "the slow clients' closes were never seen"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut client = ttls::connect(tls, &name(0, 0), pki.client_config(None))
        .await
        .unwrap();
    assert_eq!(
        text(&command(&mut client, &["PING"]).await.unwrap()),
        "PONG"
    );
    proxy.shutdown().await;
}

/// A TCP connection to `to` from the loopback address `from` (any of 127.0.0.0/8).
async fn connect_from(from: Ipv4Addr, to: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((from, 0))).unwrap();
    socket.connect(to).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_address_cannot_take_the_whole_handshake_budget() {
    const PER_SOURCE: usize = 30;
    let pki = TestPki::new(DOMAIN).unwrap();
    let cert = pki.wildcard("proxy").unwrap();
    let node = block_in_place(Standalone::start).unwrap();
    let source = one_node_routes(pki.dir(), SocketAddr::from((LO, node.port)));
    let tls_port = free_port(LO);
    let mut config = ProxyConfig::new(source);
    config.listen_ip = LO.into();
    config.admin_addr = Some(SocketAddr::from((LO, 0)));
    config.drain_timeout = Duration::from_millis(200);
    config.tls_max_handshakes = 100;
    config.tls_max_handshakes_per_source = PER_SOURCE;
    config.tls = Some(TlsConfig {
        port: tls_port,
        names: names(),
        mode: terminate(&cert, None),
        detect: DetectLimits {
            timeout: Duration::from_secs(300),
            max_bytes: 16 * 1024,
        },
    });
    let proxy = Proxy::start(config).await.unwrap();
    assert!(proxy.wait_ready(Duration::from_secs(10)).await);
    let admin = proxy.admin_addr().unwrap();
    let tls = SocketAddr::from((LO, tls_port));

    // One address sends 50 half hellos: 30 are held, 20 closed at once and counted.
    let hello = client_hello(Some(&name(0, 0)), 0);
    let mut slow = vec![];
    for _ in 0..50 {
        let mut s = connect_from(Ipv4Addr::new(127, 0, 0, 2), tls).await;
        s.write_all(&hello[..hello.len() / 2]).await.unwrap();
        slow.push(s);
    }
    let over = "shardgate_proxy_tls_refused_total{reason=\"source_handshake_limit\"}";
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let seen = block_in_place(|| metric_value(&get(admin, "/metrics").unwrap().1, over));
        if seen.unwrap_or(0.0) >= 20.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the per-address budget was never reached"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Another address (127.0.0.1) still gets through, all the way to the node.
    let mut client = ttls::connect(tls, &name(0, 0), pki.client_config(None))
        .await
        .unwrap();
    assert_eq!(
        text(&command(&mut client, &["PING"]).await.unwrap()),
        "PONG"
    );
    let body = block_in_place(|| get(admin, "/metrics").unwrap().1);
    assert_eq!(metric_value(&body, over).unwrap(), 20.0);
    assert_eq!(
        metric_value(
            &body,
            "shardgate_proxy_tls_refused_total{reason=\"handshake_limit\"}"
        )
        .unwrap(),
        0.0
    );
    drop(slow);
    proxy.shutdown().await;
}

/// Sends `commands` pipelined and reads until one reply per command has come: the bytes.
async fn pipeline<S>(stream: &mut S, commands: &[&[&str]]) -> Vec<u8>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut req = vec![];
    for args in commands {
        req.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
        for a in *args {
            req.extend_from_slice(format!("${}\r\n{a}\r\n", a.len()).as_bytes());
        }
    }
    stream.write_all(&req).await.unwrap();
    // A TLS stream may hold the last records until flushed.
    stream.flush().await.unwrap();
    let mut out = vec![];
    let mut buf = [0u8; 4096];
    let frames = |bytes: &[u8]| {
        let mut s = Scanner::default();
        let (mut i, mut n) = (0, 0);
        while let Ok(Scan::Complete { end }) = s.scan(bytes, i) {
            n += 1;
            i = end;
        }
        n
    };
    while frames(&out) < commands.len() {
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
            .await
            .expect("replies within 10 s")
            .unwrap();
        assert!(n > 0, "closed after {:?}", String::from_utf8_lossy(&out));
        out.extend_from_slice(&buf[..n]);
    }
    out
}

/// The node ports in front of nodes that speak TLS (`--tls-backend tls`): clients speak
/// plain RESP to the proxy, the proxy TLS to the nodes, showing its client certificate
/// (Valkey asks for one: `tls-auth-clients yes`) and checking only the chain of theirs
/// (nodes at addresses their certificate does not name). Replies are the node's, byte for
/// byte, but for the topology, rewritten to the node ports; the files are reloaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_ports_reach_nodes_over_tls() {
    let pki = TestPki::new(DOMAIN).unwrap();
    // A name no node is dialled at: only the chain is checked.
    let node_cert = pki.node_cert("nodes", &["valkey.internal".into()]).unwrap();
    let good = pki.client_cert("proxy-good", "shardgate").unwrap();
    let client_cert = pki.client_cert("proxy", "shardgate").unwrap();
    let tls_port = DEFAULT_PORT + 1;
    let spec = ClusterSpec::new(3, 0)
        .with_config("tls-port", tls_port.to_string())
        .with_config("tls-cert-file", node_cert.cert.display().to_string())
        .with_config("tls-key-file", node_cert.key.display().to_string())
        .with_config("tls-ca-cert-file", pki.ca.display().to_string());
    let cluster = block_in_place(|| ValkeyCluster::start(spec)).unwrap();
    let tls_addrs: Vec<SocketAddr> = cluster
        .nodes()
        .iter()
        .map(|n| SocketAddr::from((n.ip(), tls_port)))
        .collect();
    let SourceConfig::File { path, poll } = routes_file(pki.dir(), &cluster, &tls_addrs) else {
        unreachable!()
    };
    let routes =
        shardgate_crds::RouteFile::from_yaml(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let base = u16::try_from(routes.base_port).unwrap();
    let mut config = ProxyConfig::new(SourceConfig::File { path, poll });
    config.listen_ip = LO.into();
    config.admin_addr = Some(SocketAddr::from((LO, 0)));
    config.rewrite = true;
    config.advertise_host = Some("127.0.0.1".into());
    config.drain_timeout = Duration::from_millis(200);
    config.backend_tls_reload = Duration::from_millis(100);
    config.backend_tls = BackendTlsConfig::Tls {
        ca: pki.ca.clone(),
        name: BackendName::ChainOnly,
        identity: Some(Identity {
            cert: client_cert.cert.clone(),
            key: client_cert.key.clone(),
        }),
    };
    let handle = Proxy::start(config).await.unwrap();
    assert!(handle.wait_ready(Duration::from_secs(10)).await);
    let admin = handle.admin_addr().unwrap();
    let metrics = || get(admin, "/metrics").unwrap().1;
    let backend_errors = || {
        let m = metrics();
        (0..3u16)
            .flat_map(|i| ["tls", "io"].map(|kind| (base + i, kind)))
            .map(|(port, kind)| {
                metric(
                    &m,
                    &format!(
                        "shardgate_proxy_backend_errors_total{{port=\"{port}\",kind=\"{kind}\"}}"
                    ),
                )
                .unwrap_or(0.0)
            })
            .sum::<f64>()
    };

    // The same traffic straight to the node over TLS and through its node port in plain.
    let tag = "{tls-legs}";
    let owner = cluster.slot_owner(key_slot(tag.as_bytes())).unwrap();
    let listener = base + owner.shard.0 as u16;
    // Each path its own keys, in the same slot and of the same length.
    let big: String = (0..3 << 20)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    let traffic = |p: &str| -> Vec<Vec<String>> {
        let k = |name: &str| format!("{tag}{p}{name}");
        [
            vec!["PING".into()],
            vec!["SET".into(), k("k"), "v1".into()],
            vec!["GET".into(), k("k")],
            vec!["INCR".into(), k("n")],
            vec!["RPUSH".into(), k("l"), "a".into(), "b".into(), "c".into()],
            vec!["LRANGE".into(), k("l"), "0".into(), "-1".into()],
            vec!["GET".into(), k("missing")],
            vec!["NOSUCHCOMMAND".into()],
            // More than a socket, a read buffer or rustls's queue holds, each way; last,
            // so that nothing after it pushes out what a full socket did not take.
            vec!["SET".into(), k("big"), big.clone()],
            vec!["GET".into(), k("big")],
        ]
        .into()
    };
    let (direct_cmds, proxied_cmds) = (traffic("d"), traffic("p"));
    fn refs(cmds: &[Vec<String>]) -> Vec<Vec<&str>> {
        cmds.iter()
            .map(|c| c.iter().map(String::as_str).collect())
            .collect()
    }
    let (d, p) = (refs(&direct_cmds), refs(&proxied_cmds));
    let d: Vec<&[&str]> = d.iter().map(Vec::as_slice).collect();
    let p: Vec<&[&str]> = p.iter().map(Vec::as_slice).collect();
    let owner_tls = SocketAddr::from((cluster.node(owner).ip(), tls_port));
    let mut node = ttls::connect(owner_tls, "valkey.internal", pki.client_config(Some(&good)))
        .await
        .unwrap();
    let direct = pipeline(&mut node, &d).await;
    let mut proxied = TcpStream::connect((LO, listener)).await.unwrap();
    let through = pipeline(&mut proxied, &p).await;
    let differs = direct.iter().zip(&through).position(|(a, b)| a != b);
    assert!(
        direct == through,
        "not the node's own bytes: {} direct, {} through, first difference at {differs:?}",
        direct.len(),
        through.len()
    );
    // The leg is the node's TLS port (the nodes listen in plain too, for the harness).
    let info = pipeline(&mut proxied, &[&["CLIENT", "INFO"]]).await;
    let laddr = format!("laddr={}:{tls_port} ", cluster.node(owner).ip());
    let info = String::from_utf8_lossy(&info);
    assert!(info.contains(&laddr), "{info}");
    // A TLS leg has keepalive (60 s) from its handshake on: its reader does not set it
    // late, as a plain leg's does.
    let proxy_end: SocketAddr = info
        .split_whitespace()
        .find_map(|f| f.strip_prefix("addr="))
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no addr= in {info}"));
    // Read a few times: another timer (a loss probe) can show in its place for a moment,
    // and a row can be missed while other sockets come and go. Well within the second
    // after which a plain leg gets it.
    let deadline = Instant::now() + Duration::from_millis(500);
    let keepalive = loop {
        let k = shardgate_harness::tcp_table::keepalive_timer(proxy_end, owner_tls);
        if k.is_some_and(|(on, _)| on) || Instant::now() >= deadline {
            break k;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        matches!(keepalive, Some((true, ticks)) if ticks <= 6_000),
        "the TLS leg's keepalive: {keepalive:?}"
    );
    // A redirect: Valkey names the other owner at its TLS port, the proxy at its node port.
    let slot = key_slot(b"{other}");
    let other = cluster.slot_owner(slot).unwrap();
    assert_ne!(other, owner, "the tags are in different shards");
    let moved: &[&[&str]] = &[&["GET", "{other}k"]];
    let at = |ip: String, port: u16| format!("-MOVED {slot} {ip}:{port}\r\n").into_bytes();
    assert_eq!(
        pipeline(&mut node, moved).await,
        at(cluster.node(other).ip().to_string(), tls_port)
    );
    assert_eq!(
        pipeline(&mut proxied, moved).await,
        at("127.0.0.1".into(), base + other.shard.0 as u16)
    );

    // The topology, as a plain client on the node ports needs it: the listener as `port`,
    // no `tls-port`, no node address.
    let shards = pipeline(&mut proxied, &[&["CLUSTER", "SHARDS"]]).await;
    let shards = String::from_utf8_lossy(&shards).into_owned();
    for i in 0..3u16 {
        assert!(
            shards.contains(&format!("$4\r\nport\r\n:{}\r\n", base + i)),
            "{shards}"
        );
    }
    assert!(!shards.contains("tls-port"), "{shards}");
    for n in cluster.nodes() {
        assert!(!shards.contains(&n.ip().to_string()), "{shards}");
    }
    // A cluster client that knows only the proxy: every shard written where Valkey says.
    let mut con = shardgate_harness::clients::cluster_client(base)
        .await
        .unwrap();
    cross_shard_set_get(&mut con, "tls-legs").await;
    drop(con);
    block_in_place(|| landed_on_their_owners(&cluster, "tls-legs"));
    assert_eq!(backend_errors(), 0.0);

    // The proxy's certificate replaced with one the nodes' CA did not sign: reloaded, new
    // connections are refused by the nodes (counted), the one already up goes on.
    let stranger = TestPki::new(DOMAIN)
        .unwrap()
        .client_cert("stranger", "shardgate")
        .unwrap();
    client_cert.replace_with(&stranger).unwrap();
    let reloads = |reason: &str| {
        metric(
            &metrics(),
            &format!("shardgate_proxy_backend_tls_reloads_total{{reason=\"{reason}\"}}"),
        )
        .unwrap_or(0.0)
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while reloads("ok") < 1.0 {
        assert!(
            Instant::now() < deadline,
            "the new certificate was not loaded"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut refused = TcpStream::connect((LO, listener)).await.unwrap();
    refused.write_all(b"*1\r\n$4\r\nPING\r\n").await.unwrap();
    let closed = until_closed(&mut refused).await;
    assert!(closed.is_empty(), "a refused leg sends nothing: {closed:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while backend_errors() < 1.0 {
        assert!(Instant::now() < deadline, "the refused leg was not counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(backend_errors(), 1.0);
    assert_eq!(pipeline(&mut proxied, &[&["PING"]]).await, b"+PONG\r\n");

    // Back to a certificate of the CA: new connections get through again.
    client_cert.replace_with(&good).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while reloads("ok") < 2.0 {
        assert!(
            Instant::now() < deadline,
            "the good certificate was not loaded again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut again = TcpStream::connect((LO, listener)).await.unwrap();
    assert_eq!(pipeline(&mut again, &[&["PING"]]).await, b"+PONG\r\n");
    assert_eq!(backend_errors(), 1.0);
    handle.shutdown().await;

    // Discovery over TLS: a seed that is a node's TLS port, asked CLUSTER SHARDS over TLS.
    let base = free_port_range(LO, 3);
    let mut config = ProxyConfig::new(SourceConfig::Seed {
        seeds: vec![Backend::ip(tls_addrs[0])],
        base_port: base,
        ports_per_shard: None,
        refresh: Duration::from_secs(5),
    });
    config.listen_ip = LO.into();
    config.admin_addr = None;
    config.rewrite = true;
    config.advertise_host = Some("127.0.0.1".into());
    config.drain_timeout = Duration::from_millis(200);
    config.backend_tls = BackendTlsConfig::Tls {
        ca: pki.ca.clone(),
        name: BackendName::ChainOnly,
        identity: Some(Identity {
            cert: good.cert.clone(),
            key: good.key.clone(),
        }),
    };
    let handle = Proxy::start(config).await.unwrap();
    assert!(
        handle.wait_ready(Duration::from_secs(10)).await,
        "no route from a TLS seed"
    );
    let mut con = shardgate_harness::clients::cluster_client(base)
        .await
        .unwrap();
    cross_shard_set_get(&mut con, "tls-seed").await;
    drop(con);
    block_in_place(|| landed_on_their_owners(&cluster, "tls-seed"));
    handle.shutdown().await;

    // A name asked for (--tls-backend-name): discovery and the node ports check it. Every
    // node's certificate names valkey.internal.
    let named = |name: &str| BackendTlsConfig::Tls {
        ca: pki.ca.clone(),
        name: BackendName::Fixed(name.into()),
        identity: Some(Identity {
            cert: good.cert.clone(),
            key: good.key.clone(),
        }),
    };
    let base = free_port_range(LO, 3);
    let mut config = ProxyConfig::new(SourceConfig::Seed {
        seeds: vec![Backend::ip(tls_addrs[1])],
        base_port: base,
        ports_per_shard: None,
        refresh: Duration::from_secs(5),
    });
    config.listen_ip = LO.into();
    config.admin_addr = None;
    config.drain_timeout = Duration::from_millis(200);
    config.backend_tls = named("valkey.internal");
    let handle = Proxy::start(config).await.unwrap();
    assert!(
        handle.wait_ready(Duration::from_secs(10)).await,
        "no route from a named seed"
    );
    let mut s = TcpStream::connect((LO, base)).await.unwrap();
    assert_eq!(pipeline(&mut s, &[&["PING"]]).await, b"+PONG\r\n");
    handle.shutdown().await;
    // Another name: discovery refuses the seed, and says why on /readyz.
    let mut config = ProxyConfig::new(SourceConfig::Seed {
        seeds: vec![Backend::ip(tls_addrs[1])],
        base_port: free_port_range(LO, 3),
        ports_per_shard: None,
        refresh: Duration::from_millis(200),
    });
    config.listen_ip = LO.into();
    config.admin_addr = Some(SocketAddr::from((LO, 0)));
    config.drain_timeout = Duration::from_millis(200);
    config.backend_tls = named("other.internal");
    let handle = Proxy::start(config).await.unwrap();
    let admin = handle.admin_addr().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body) = get(admin, "/readyz").unwrap();
        if body.contains("not valid for name") {
            assert_eq!(status, 503, "{body}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no name refusal on /readyz: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    handle.shutdown().await;
    // Another name: the node ports' legs are refused, counted, and the client closed.
    let source = routes_file(pki.dir(), &cluster, &tls_addrs);
    let SourceConfig::File { path, .. } = &source else {
        unreachable!()
    };
    let routes =
        shardgate_crds::RouteFile::from_yaml(&std::fs::read_to_string(path).unwrap()).unwrap();
    let base = u16::try_from(routes.base_port).unwrap();
    let mut config = ProxyConfig::new(source);
    config.listen_ip = LO.into();
    config.admin_addr = Some(SocketAddr::from((LO, 0)));
    config.drain_timeout = Duration::from_millis(200);
    config.backend_tls = named("other.internal");
    let handle = Proxy::start(config).await.unwrap();
    assert!(handle.wait_ready(Duration::from_secs(10)).await);
    let admin = handle.admin_addr().unwrap();
    let mut s = TcpStream::connect((LO, base)).await.unwrap();
    s.write_all(b"*1\r\n$4\r\nPING\r\n").await.unwrap();
    assert!(
        until_closed(&mut s).await.is_empty(),
        "a refused leg sends nothing"
    );
    let sample = format!("shardgate_proxy_backend_errors_total{{port=\"{base}\",kind=\"tls\"}}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(&get(admin, "/metrics").unwrap().1, &sample).unwrap_or(0.0) < 1.0 {
        assert!(Instant::now() < deadline, "the wrong name was not counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    handle.shutdown().await;
}
