//! The admin client against real `valkey-server` processes, and, for what a real node does
//! not send (a reply nested 20000 deep, no reply at all, half a reply), small fake nodes on
//! 127.0.0.1 that write those bytes.
//!
//! Each test starts its own cluster on its own loopback addresses. Run `scripts/setup` first
//! and `. ~/.cache/shardgate/env.sh`.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use shardgate_admin_client::{Client, Error, NodeView, Reply, Timeouts};
use shardgate_harness::valkey::{ClusterSpec, ValkeyCluster, SLOTS};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Starts a cluster off the runtime's thread (the harness is synchronous).
async fn start(spec: ClusterSpec) -> ValkeyCluster {
    tokio::task::spawn_blocking(move || ValkeyCluster::start(spec))
        .await
        .unwrap()
        .unwrap()
}

async fn connect(addr: SocketAddr) -> Client {
    Client::connect(addr, Timeouts::default()).await.unwrap()
}

#[tokio::test]
async fn cluster_shards_agrees_with_every_node() {
    let cluster = start(ClusterSpec::new(3, 1)).await;
    let seed = cluster.nodes()[0].addr();
    let mut client = connect(seed).await;
    assert_eq!(client.addr(), seed);
    client.ping().await.unwrap();

    let shards = client.cluster_shards().await.unwrap();
    assert_eq!(shards.len(), 3, "{shards:#?}");
    // Every slot is served by exactly one shard.
    let mut owners = vec![0u32; usize::from(SLOTS)];
    for shard in &shards {
        for &(lo, hi) in &shard.slots {
            for slot in lo..=hi {
                owners[usize::from(slot)] += 1;
            }
        }
    }
    assert!(owners.iter().all(|&n| n == 1), "{shards:#?}");

    let mut described: HashMap<String, &NodeView> = HashMap::new();
    for shard in &shards {
        assert_eq!(shard.nodes.len(), 2, "{shard:#?}");
        assert_eq!(shard.nodes.iter().filter(|n| n.primary).count(), 1);
        assert_eq!(
            shard.key(),
            *shard.id.as_ref().unwrap(),
            "Valkey 9 has shard ids"
        );
        // Both nodes are one shard of the harness.
        let positions: BTreeSet<u32> = shard
            .nodes
            .iter()
            .map(|n| cluster.node_by_id(&n.id).unwrap().pos.shard.0)
            .collect();
        assert_eq!(positions.len(), 1, "{shard:#?}");
        for n in &shard.nodes {
            described.insert(n.id.clone(), n);
        }
    }
    assert_eq!(described.len(), 6);

    // Each node, asked through the client, names itself as CLUSTER SHARDS describes it.
    for node in cluster.nodes() {
        let mut c = connect(node.addr()).await;
        let id = c.cluster_myid().await.unwrap();
        assert_eq!(id, node.node_id, "node {}", node.pos);
        let view = described[&id];
        assert_eq!(view.ip, node.ip().to_string());
        assert_eq!(view.endpoint.as_deref(), Some(view.ip.as_str()));
        assert_eq!(view.port, Some(node.port));
        assert_eq!(view.tls_port, None);
        assert_eq!(view.hostname, None);
        // The harness makes node 0 of each shard its primary, and nothing failed over.
        assert_eq!(view.primary, node.pos.node.0 == 0, "node {}", node.pos);
        assert_eq!(view.health, "online");
        assert!(view.replication_offset.is_some());
    }

    let info = client.cluster_info().await.unwrap();
    assert_eq!(info["cluster_state"], "ok");
    assert_eq!(info["cluster_slots_assigned"], SLOTS.to_string());
    assert_eq!(info["cluster_known_nodes"], "6");
    assert_eq!(info["cluster_size"], "3");
}

#[tokio::test]
async fn error_replies_are_server_errors_and_leave_the_connection_usable() {
    let cluster = start(ClusterSpec::new(1, 0)).await;
    let addr = cluster.nodes()[0].addr();
    let mut client = connect(addr).await;

    let unknown = "0123456789abcdef0123456789abcdef01234567";
    let err = client
        .command(["CLUSTER", "FORGET", unknown])
        .await
        .unwrap_err();
    let Error::Server { addr: at, message } = &err else {
        panic!("expected a server error, got {err:?}");
    };
    assert_eq!(*at, addr);
    assert_eq!(message, &format!("ERR Unknown node {unknown}"));
    assert_eq!(err.label(), "server");
    assert_eq!(
        err.to_string(),
        format!("{addr}: error reply: ERR Unknown node {unknown}")
    );

    let err = client.command(["NO-SUCH-COMMAND", "x"]).await.unwrap_err();
    let message = err.server_message().unwrap();
    assert!(message.starts_with("ERR unknown command"), "{message}");

    // command_raw hands the error reply over as it is.
    let reply = client
        .command_raw(["CLUSTER", "FORGET", unknown])
        .await
        .unwrap();
    assert!(matches!(&reply, Reply::Error(m) if m.starts_with("ERR Unknown node")));

    // Still usable.
    client.ping().await.unwrap();
    assert_eq!(
        client.command(["ECHO", "still here"]).await.unwrap(),
        Reply::BulkString("still here".into())
    );
    let err = client.command(Vec::<&str>::new()).await.unwrap_err();
    assert_eq!(err.label(), "empty_command");
    client.ping().await.unwrap();
}

/// A fake node on 127.0.0.1 for one connection: reads the command, writes `reply`, then
/// closes the connection if `close`, else holds it open until the client goes away.
async fn fake_node(reply: Vec<u8>, close: bool) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut command = [0u8; 1024];
        let _ = stream.read(&mut command).await;
        if stream.write_all(&reply).await.is_err() || close {
            return;
        }
        while matches!(stream.read(&mut command).await, Ok(n) if n > 0) {}
    });
    addr
}

#[tokio::test]
async fn a_deeply_nested_reply_is_an_error_not_a_stack_overflow() {
    // A real Valkey sends nothing like this to an admin client (CLUSTER SHARDS, the deepest
    // reply read here, is 4 levels deep): this is a broken or hostile node. Handed to
    // redis-protocol's recursive decoder, it would overflow this thread's stack.
    let addr = fake_node(b"*1\r\n".repeat(20_000), false).await;
    let mut client = connect(addr).await;
    let err = client.cluster_shards().await.unwrap_err();
    assert_eq!(err.label(), "protocol");
    assert!(err.to_string().contains("nested deeper than"), "{err}");
    assert!(err.to_string().starts_with(&addr.to_string()), "{err}");
    // The rest of the reply would be read as the next command's: the client refuses.
    assert_eq!(client.ping().await.unwrap_err().label(), "broken");
}

#[tokio::test]
async fn a_huge_reply_is_refused_before_it_arrives() {
    let addr = fake_node(b"$4000000000\r\n".to_vec(), false).await;
    let err = connect(addr).await.ping().await.unwrap_err();
    assert_eq!(err.label(), "protocol");
    assert!(err.to_string().contains("reply larger than"), "{err}");
}

#[tokio::test]
async fn a_node_that_never_replies_times_out() {
    let addr = fake_node(Vec::new(), false).await;
    let timeouts = Timeouts {
        connect: Duration::from_secs(5),
        reply: Duration::from_millis(300),
    };
    let mut client = Client::connect(addr, timeouts).await.unwrap();
    let started = Instant::now();
    let err = client.cluster_myid().await.unwrap_err();
    let took = started.elapsed();
    assert!(
        matches!(err, Error::Timeout { what: "reply", after, .. } if after == timeouts.reply),
        "{err:?}"
    );
    assert!(took >= timeouts.reply, "{took:?}");
    assert!(took < timeouts.reply + Duration::from_secs(2), "{took:?}");
    assert_eq!(
        err.to_string(),
        format!("{addr}: reply timed out after 300ms")
    );
    assert_eq!(client.ping().await.unwrap_err().label(), "broken");
}

#[tokio::test]
async fn a_node_that_closes_mid_reply_is_closed() {
    for reply in [&b""[..], b"*2\r\n$5\r\nslots\r\n"] {
        let addr = fake_node(reply.to_vec(), true).await;
        let err = connect(addr).await.cluster_shards().await.unwrap_err();
        assert!(matches!(err, Error::Closed { .. }), "{reply:?}: {err:?}");
    }
}

#[tokio::test]
async fn a_refused_connection_is_a_connect_error() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let err = Client::connect(addr, Timeouts::default())
        .await
        .unwrap_err();
    assert_eq!(err.label(), "connect");
    assert!(
        err.to_string().starts_with(&format!("{addr}: connect: ")),
        "{err}"
    );
}

#[tokio::test]
async fn cluster_nodes_agrees_with_cluster_shards() {
    let cluster = start(ClusterSpec::new(2, 1)).await;
    let mut client = connect(cluster.nodes()[1].addr()).await;
    let lines = client.cluster_nodes().await.unwrap();
    let shards = client.cluster_shards().await.unwrap();
    assert_eq!(lines.len(), 4, "{lines:#?}");
    // The answering node is itself, at the address the harness gave it.
    let me = lines.iter().find(|l| l.is_myself()).unwrap();
    assert_eq!(
        format!("{}:{}", me.ip, me.port),
        cluster.nodes()[1].addr().to_string()
    );
    for shard in &shards {
        for node in &shard.nodes {
            let line = lines.iter().find(|l| l.id == node.id).unwrap();
            assert_eq!(line.is_primary(), node.primary, "{line:?}");
            assert_eq!(line.ip, node.ip);
            assert!(line.connected && !line.is_failing());
            if node.primary {
                assert_eq!(line.slots, shard.slots);
            } else {
                let primary = shard.nodes.iter().find(|n| n.primary).unwrap();
                assert_eq!(line.primary_id.as_deref(), Some(primary.id.as_str()));
            }
        }
    }
}

/// A node that speaks only TLS, and asks clients for a certificate (Valkey's default): the
/// client checks the node's chain against the CA but not its name (nodes are dialled by IP,
/// which this certificate does not name), presents its own certificate, and fails the
/// handshake, naming the node, on a node signed by another CA or without a certificate.
#[tokio::test]
async fn tls_checks_the_chain_not_the_name_and_presents_the_client_certificate() {
    use shardgate_admin_client::{Dial, Tls};
    use shardgate_harness::tls::TestPki;
    use shardgate_harness::valkey::Standalone;

    let pki = TestPki::new("cluster.test").unwrap();
    let node = pki
        .node_cert("node", &["vc-0-0.cluster.test".to_string()])
        .unwrap();
    let server = tokio::task::spawn_blocking({
        let (cert, key, ca) = (node.cert.clone(), node.key.clone(), pki.ca.clone());
        move || Standalone::start_tls(&cert, &key, &ca)
    })
    .await
    .unwrap()
    .unwrap();
    let addr: SocketAddr = ([127, 0, 0, 1], server.port).into();
    let dial = |tls: Tls| Dial {
        timeouts: Timeouts::default(),
        tls: Some(tls),
    };
    let identity = Some((node.cert_pem.as_bytes(), node.key_pem.as_bytes()));

    let tls = Tls::from_pem(pki.ca_pem.as_bytes(), identity).unwrap();
    let mut client = Client::dial(addr, &dial(tls)).await.unwrap();
    client.ping().await.unwrap();
    assert_eq!(
        client.peer_certificate(),
        Some(node.cert_der().unwrap().as_ref()),
        "the node's certificate, as it presented it"
    );
    let reply = client.command(["SET", "k", "v"]).await.unwrap();
    assert_eq!(reply, Reply::SimpleString("OK".into()));

    // The plain protocol on a TLS port: Valkey drops the connection.
    let mut plain = connect(addr).await;
    assert_eq!(plain.peer_certificate(), None);
    assert!(
        plain.ping().await.is_err(),
        "plain RESP answered on the TLS port"
    );

    // No client certificate: the node refuses the handshake (TLS 1.3 reports it on the
    // first read, so the command fails rather than the dial).
    let anonymous = Tls::from_pem(pki.ca_pem.as_bytes(), None).unwrap();
    let refused = match Client::dial(addr, &dial(anonymous)).await {
        Ok(mut c) => c.ping().await.err(),
        Err(e) => Some(e),
    };
    assert!(refused.is_some(), "a client without a certificate got in");

    // A node signed by another CA is not trusted.
    let other = TestPki::new("other.test").unwrap();
    let stranger = Tls::from_pem(other.ca_pem.as_bytes(), identity).unwrap();
    match Client::dial(addr, &dial(stranger)).await {
        Err(e @ Error::Tls { .. }) => {
            let message = e.to_string();
            assert!(message.contains(&addr.to_string()), "{message}");
            assert!(message.contains("UnknownIssuer"), "{message}");
        }
        other => panic!("a node of another CA was trusted: {other:?}"),
    }

    // A name asked for: the node's certificate must carry it.
    let named = Tls::from_pem_named(pki.ca_pem.as_bytes(), identity, "vc-0-0.cluster.test");
    let mut client = Client::dial(addr, &dial(named.unwrap())).await.unwrap();
    client.ping().await.unwrap();
    let wrong = Tls::from_pem_named(pki.ca_pem.as_bytes(), identity, "vc-1-0.cluster.test");
    match Client::dial(addr, &dial(wrong.unwrap())).await {
        Err(e @ Error::Tls { .. }) => {
            let message = e.to_string();
            assert!(message.contains("not valid for name"), "{message}");
        }
        other => panic!("a node without the name was trusted: {other:?}"),
    }
    let e = Tls::from_pem_named(pki.ca_pem.as_bytes(), None, "not a name").unwrap_err();
    assert!(e.to_string().starts_with("server name: "), "{e}");

    // PEM without what it must hold is a clear error, not a panic.
    let e = Tls::from_pem(b"not pem", None).unwrap_err();
    assert!(e.to_string().starts_with("ca: "), "{e}");
    let e =
        Tls::from_pem(pki.ca_pem.as_bytes(), Some((node.cert_pem.as_bytes(), b""))).unwrap_err();
    assert!(e.to_string().starts_with("key: "), "{e}");
}
