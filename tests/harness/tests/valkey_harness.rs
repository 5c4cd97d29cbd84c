//! The Valkey cluster harness against real `valkey-server` processes.
//!
//! Each test starts its own cluster on its own loopback addresses, so they run in parallel.
//! Run `scripts/setup` first (and `. ~/.cache/shardgate/env.sh`).

use std::collections::HashSet;
use std::net::Ipv4Addr;
use std::path::Path;
use std::time::{Duration, Instant};

use redis::Value;
use shardgate_crds::NodeRef;
use shardgate_harness::addr;
use shardgate_harness::tools;
use shardgate_harness::valkey::{
    hash_tag_for_slot, key_slot, processes_mentioning, stray_processes, ClusterSpec, Node, Restart,
    ValkeyCluster, SLOTS,
};

fn cluster_info(node: &Node, field: &str) -> String {
    node.info_field("cluster", field)
        .unwrap()
        .unwrap_or_else(|| panic!("CLUSTER INFO of node {} has no {field}", node.pos))
}

fn assert_ok_everywhere(cluster: &ValkeyCluster) {
    for node in cluster.nodes().iter().filter(|n| n.is_running()) {
        assert_eq!(
            cluster_info(node, "cluster_state"),
            "ok",
            "node {}",
            node.pos
        );
    }
}

fn set(node: &Node, key: &str, value: &str) {
    let mut con = node.connection().unwrap();
    redis::cmd("SET")
        .arg(key)
        .arg(value)
        .exec(&mut con)
        .unwrap();
}

fn get(node: &Node, key: &str) -> Option<String> {
    let mut con = node.connection().unwrap();
    redis::cmd("GET").arg(key).query(&mut con).unwrap()
}

/// A key in the first slot of `shard`'s initial range.
fn key_in_shard(cluster: &ValkeyCluster, shard: u32, name: &str) -> String {
    let slot = *cluster.spec().initial_slots(shard).start();
    format!("{}:{name}", hash_tag_for_slot(slot))
}

/// Writes `key` on its primary and waits until it is in the primary's AOF on disk
/// (`WAITAOF 1 0`), so that it must survive a SIGKILL.
fn durable_set(node: &Node, key: &str, value: &str) {
    let mut con = node.connection().unwrap();
    redis::cmd("SET")
        .arg(key)
        .arg(value)
        .exec(&mut con)
        .unwrap();
    let acked: (i64, i64) = redis::cmd("WAITAOF")
        .arg(1)
        .arg(0)
        .arg(5000)
        .query(&mut con)
        .unwrap();
    assert_eq!(acked.0, 1, "the write did not reach the local AOF");
}

#[test]
fn tools_are_installed() {
    let server = tools::valkey_server().unwrap();
    let out = std::process::Command::new(&server)
        .arg("--version")
        .output()
        .unwrap();
    let version = String::from_utf8_lossy(&out.stdout);
    assert!(version.contains("v=9."), "{}: {version}", server.display());
    assert!(tools::redis_cli().unwrap().exists());
    assert!(tools::redis_benchmark().unwrap().exists());
}

#[test]
fn three_by_one_cluster_is_ok_with_all_slots_and_replicas_attached() {
    let cluster = ValkeyCluster::start(ClusterSpec::new(3, 1)).unwrap();
    assert_eq!(cluster.nodes().len(), 6);

    let ips: HashSet<Ipv4Addr> = cluster.nodes().iter().map(Node::ip).collect();
    assert_eq!(ips.len(), 6, "every node has its own address");
    for node in cluster.nodes() {
        let [a, b, _, _] = node.ip().octets();
        assert!(a == 127 && b >= 16, "node {} is on {}", node.pos, node.ip());
        assert_eq!(node.addr().port(), 6379);
        assert!(node.is_running());
        assert_eq!(node.node_id.len(), 40);
        assert!(node.node_id.bytes().all(|b| b.is_ascii_hexdigit()));
        let myid: String = node.query(&["CLUSTER", "MYID"]).unwrap();
        assert_eq!(myid, node.node_id);

        assert_eq!(cluster_info(node, "cluster_state"), "ok");
        assert_eq!(cluster_info(node, "cluster_slots_assigned"), "16384");
        assert_eq!(cluster_info(node, "cluster_slots_ok"), "16384");
        assert_eq!(cluster_info(node, "cluster_known_nodes"), "6");
        assert_eq!(cluster_info(node, "cluster_size"), "3");
    }

    for shard in 0..3 {
        let primary = cluster.node(NodeRef::new(shard, 0));
        let replica = cluster.node(NodeRef::new(shard, 1));
        assert_eq!(cluster.primary_of(shard).unwrap(), primary.pos);
        assert_eq!(primary.role().unwrap(), "master");

        // ROLE on a replica: ["slave", primary ip, primary port, state, offset].
        let role: Vec<Value> = replica.query(&["ROLE"]).unwrap();
        let role_ip: String = redis::from_redis_value(role[1].clone()).unwrap();
        let role_port: u16 = redis::from_redis_value(role[2].clone()).unwrap();
        let role_state: String = redis::from_redis_value(role[3].clone()).unwrap();
        assert_eq!(replica.role().unwrap(), "slave");
        assert_eq!(
            (role_ip.as_str(), role_port),
            (&*primary.ip().to_string(), 6379)
        );
        assert_eq!(role_state, "connected");
        assert_eq!(
            replica
                .info_field("replication", "master_link_status")
                .unwrap()
                .as_deref(),
            Some("up")
        );

        let slots = cluster.spec().initial_slots(shard);
        for slot in [*slots.start(), *slots.end()] {
            assert_eq!(cluster.slot_owner(slot).unwrap(), primary.pos);
        }
    }

    // Every node's CLUSTER NODES: three primaries with 16384 slots between them, each
    // replica under its own shard's primary, every address the node's own.
    for node in cluster.nodes() {
        let view = cluster.view(node.pos).unwrap();
        assert_eq!(view.len(), 6);
        let mut slots = 0;
        for line in &view {
            let other = cluster.node_by_id(&line.id).unwrap();
            assert_eq!(line.ip_port(), other.addr().to_string());
            assert!(!line.is_troubled() && line.connected, "{line:?}");
            if other.pos.node.0 == 0 {
                assert!(line.is_primary());
                slots += line
                    .slots
                    .iter()
                    .map(|&(lo, hi)| u32::from(hi - lo) + 1)
                    .sum::<u32>();
            } else {
                let primary = cluster.node(NodeRef::new(other.pos.shard.0, 0));
                assert_eq!(line.master.as_deref(), Some(primary.node_id.as_str()));
            }
        }
        assert_eq!(slots, u32::from(SLOTS));
    }
}

#[test]
fn key_slot_agrees_with_cluster_keyslot() {
    let cluster = ValkeyCluster::start(ClusterSpec::new(1, 0)).unwrap();
    let mut con = cluster.nodes()[0].connection().unwrap();

    let mut keys: Vec<Vec<u8>> = Vec::new();
    for i in 0..60u32 {
        keys.push(format!("key:{i}").into_bytes());
        keys.push(format!("{{user{i}}}.following").into_bytes());
        keys.push(format!("foo{{}}{{bar{i}}}").into_bytes());
        keys.push(format!("foo{{{{bar{i}}}}}zap").into_bytes());
        keys.push(format!("a{{b{i}").into_bytes());
        keys.push(format!("}}{i}{{").into_bytes());
        keys.push(format!("ключ-{i}-{{тег}}").into_bytes());
        keys.push(vec![i as u8, 0xff, b'{', 0, (i * 7) as u8, b'}', 0x80]);
    }
    keys.extend([b"".to_vec(), b"{}".to_vec(), b"{".to_vec(), b"}".to_vec()]);
    assert!(keys.len() > 300);

    for key in &keys {
        let expected: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key.as_slice())
            .query(&mut con)
            .unwrap();
        assert_eq!(
            key_slot(key),
            expected,
            "key {:?}",
            String::from_utf8_lossy(key)
        );
    }
    for slot in [0, 1, 8191, 16383] {
        let key = format!("{}:x", hash_tag_for_slot(slot));
        let expected: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(&key)
            .query(&mut con)
            .unwrap();
        assert_eq!(expected, slot, "{key}");
    }
}

#[test]
fn kill_and_restart_at_the_same_address_keeps_id_and_data() {
    // No replicas: nobody can take over, so the node must come back as the same primary.
    let cluster = ValkeyCluster::start(ClusterSpec::new(3, 0)).unwrap();
    let pos = NodeRef::new(1, 0);
    let node = cluster.node(pos);
    let key = key_in_shard(&cluster, 1, "durable");
    durable_set(node, &key, "v1");

    let (ip, id) = (node.ip(), node.node_id.clone());
    let old_pid = node.pid().unwrap();
    cluster.kill(pos);
    assert!(!node.is_running());
    assert!(!Path::new(&format!("/proc/{old_pid}")).exists());

    cluster.restart(pos, Restart::SameAddress).unwrap();
    assert!(node.is_running());
    assert_ne!(node.pid(), Some(old_pid));
    assert_eq!(node.ip(), ip);
    let myid: String = node.query(&["CLUSTER", "MYID"]).unwrap();
    assert_eq!(myid, id);
    assert_eq!(get(node, &key).as_deref(), Some("v1"));
    assert_eq!(cluster.slot_owner(key_slot(key.as_bytes())).unwrap(), pos);
    assert_ok_everywhere(&cluster);

    // A graceful stop flushes the AOF too.
    set(node, &key, "v2");
    cluster.stop(pos).unwrap();
    assert!(!node.is_running());
    cluster.restart(pos, Restart::SameAddress).unwrap();
    assert_eq!(get(node, &key).as_deref(), Some("v2"));
    assert_ok_everywhere(&cluster);
}

#[test]
fn restart_at_a_new_address_is_learned_by_every_node() {
    let cluster = ValkeyCluster::start(ClusterSpec::new(3, 1)).unwrap();
    let pos = NodeRef::new(1, 0);
    let node = cluster.node(pos);
    let key = key_in_shard(&cluster, 1, "moved");
    durable_set(node, &key, "v1");
    let old_ip = node.ip();

    cluster.restart(pos, Restart::NewAddress).unwrap();
    let new_ip = node.ip();
    assert_ne!(new_ip, old_ip);
    let myid: String = node.query(&["CLUSTER", "MYID"]).unwrap();
    assert_eq!(myid, node.node_id);

    assert_ok_everywhere(&cluster);
    for other in cluster.nodes() {
        let view = cluster.view(other.pos).unwrap();
        let line = view.iter().find(|l| l.id == node.node_id).unwrap();
        assert_eq!(
            line.ip_port(),
            format!("{new_ip}:6379"),
            "view of {}",
            other.pos
        );
        assert!(
            view.iter()
                .all(|l| !l.address.starts_with(&format!("{old_ip}:"))),
            "node {} still knows the old address {old_ip}",
            other.pos
        );
    }
    // The shard still serves the key, whichever of its nodes is primary now.
    let primary = cluster.node(cluster.primary_of(1).unwrap());
    assert_eq!(get(primary, &key).as_deref(), Some("v1"));
}

#[test]
fn failover_makes_the_replica_primary() {
    let cluster = ValkeyCluster::start(ClusterSpec::new(3, 1)).unwrap();
    let (old, new) = (NodeRef::new(2, 0), NodeRef::new(2, 1));

    cluster.failover(new).unwrap();
    assert_eq!(cluster.primary_of(2).unwrap(), new);
    assert_eq!(cluster.node(new).role().unwrap(), "master");
    assert_eq!(cluster.node(old).role().unwrap(), "slave");
    assert_eq!(cluster.slot_owner(16383).unwrap(), new);
    assert_ok_everywhere(&cluster);
    for node in cluster.nodes() {
        let view = cluster.view(node.pos).unwrap();
        let new_line = view
            .iter()
            .find(|l| l.id == cluster.node(new).node_id)
            .unwrap();
        let old_line = view
            .iter()
            .find(|l| l.id == cluster.node(old).node_id)
            .unwrap();
        assert!(new_line.is_primary(), "view of {}", node.pos);
        assert_eq!(new_line.slots, vec![(10922, 16383)], "view of {}", node.pos);
        assert_eq!(old_line.master.as_deref(), Some(new_line.id.as_str()));
    }
}

#[test]
fn migrate_slot_moves_the_slot_and_its_keys() {
    let cluster = ValkeyCluster::start(ClusterSpec::new(3, 1)).unwrap();
    let (from, to) = (NodeRef::new(0, 0), NodeRef::new(2, 0));
    let slot = 100;
    let tag = hash_tag_for_slot(slot);
    let keys: Vec<String> = (0..250).map(|i| format!("{tag}:{i}")).collect();
    for key in &keys {
        set(cluster.node(from), key, &format!("value of {key}"));
    }

    cluster.migrate_slot(slot, 2).unwrap();

    assert_eq!(cluster.slot_owner(slot).unwrap(), to);
    assert_eq!(cluster.slot_owner(slot - 1).unwrap(), from);
    assert_eq!(cluster.slot_owner(slot + 1).unwrap(), from);
    let count = |pos: NodeRef| -> u64 {
        cluster
            .node(pos)
            .query(&["CLUSTER", "COUNTKEYSINSLOT", &slot.to_string()])
            .unwrap()
    };
    assert_eq!(count(to), 250);
    assert_eq!(count(from), 0);
    for key in &keys {
        assert_eq!(get(cluster.node(to), key), Some(format!("value of {key}")));
    }
    // The old owner redirects to the new one.
    let mut con = cluster.node(from).connection().unwrap();
    let err = redis::cmd("GET")
        .arg(&keys[0])
        .query::<Option<String>>(&mut con)
        .unwrap_err();
    assert_eq!(err.code(), Some("MOVED"), "{err}");
    let dest = cluster.node(to).addr();
    assert_eq!(err.detail(), Some(format!("{slot} {dest}").as_str()));
    // Every node agrees, and the cluster is ok.
    for node in cluster.nodes() {
        let view = cluster.view(node.pos).unwrap();
        let owner = view
            .iter()
            .find(|l| l.is_primary() && l.owns(slot))
            .unwrap();
        assert_eq!(owner.id, cluster.node(to).node_id, "view of {}", node.pos);
    }
    assert_ok_everywhere(&cluster);
}

#[test]
fn a_slot_midway_through_migration_answers_ask() {
    let cluster = ValkeyCluster::start(ClusterSpec::new(2, 0)).unwrap();
    let slot = 200;
    let tag = hash_tag_for_slot(slot);
    let (moved, stays) = (format!("{tag}:moved"), format!("{tag}:stays"));
    let (from, to) = (NodeRef::new(0, 0), NodeRef::new(1, 0));
    set(cluster.node(from), &moved, "m");
    set(cluster.node(from), &stays, "s");

    let migration = cluster.begin_slot_migration(slot, 1).unwrap();
    assert_eq!((migration.from, migration.to), (from, to));
    cluster
        .migrate_keys(&migration, &[moved.as_bytes()])
        .unwrap();

    let mut src = cluster.node(from).connection().unwrap();
    let err = redis::cmd("GET")
        .arg(&moved)
        .query::<Option<String>>(&mut src)
        .unwrap_err();
    assert_eq!(err.code(), Some("ASK"), "{err}");
    let dest = cluster.node(to).addr();
    assert_eq!(err.detail(), Some(format!("{slot} {dest}").as_str()));
    let value: Option<String> = redis::cmd("GET").arg(&stays).query(&mut src).unwrap();
    assert_eq!(value.as_deref(), Some("s"));
    // The destination serves the moved key after ASKING, still owned by the source.
    let mut dst = cluster.node(to).connection().unwrap();
    redis::cmd("ASKING").exec(&mut dst).unwrap();
    let value: Option<String> = redis::cmd("GET").arg(&moved).query(&mut dst).unwrap();
    assert_eq!(value.as_deref(), Some("m"));
    assert_eq!(cluster.slot_owner(slot).unwrap(), from);

    cluster.finish_slot_migration(&migration).unwrap();
    assert_eq!(cluster.slot_owner(slot).unwrap(), to);
    assert_eq!(get(cluster.node(to), &moved).as_deref(), Some("m"));
    assert_eq!(get(cluster.node(to), &stays).as_deref(), Some("s"));
    let err = redis::cmd("GET")
        .arg(&stays)
        .query::<Option<String>>(&mut src)
        .unwrap_err();
    assert_eq!(err.code(), Some("MOVED"), "{err}");
    assert_ok_everywhere(&cluster);
}

#[test]
fn per_node_config_and_runtime_config_are_applied_and_kept() {
    // What the proxy tests do: every node announces the proxy's address for it.
    let proxy_ip = Ipv4Addr::LOCALHOST;
    let base = addr::free_port_range(proxy_ip, 4);
    let spec = ClusterSpec::new(2, 1).with_node_config(move |pos| {
        let flat = u16::try_from(pos.shard.0 * 2 + pos.node.0).unwrap();
        vec![
            ("cluster-announce-client-ipv4".into(), "127.0.0.1".into()),
            (
                "cluster-announce-client-port".into(),
                (base + flat).to_string(),
            ),
        ]
    });
    let cluster = ValkeyCluster::start(spec).unwrap();
    assert_ok_everywhere(&cluster);
    for node in cluster.nodes() {
        for line in cluster.view(node.pos).unwrap() {
            let other = cluster.node_by_id(&line.id).unwrap();
            let flat = u16::try_from(other.pos.shard.0 * 2 + other.pos.node.0).unwrap();
            assert_eq!(line.ip_port(), format!("127.0.0.1:{}", base + flat));
        }
    }

    // Runtime settings survive a restart (nodes have no config file to rewrite).
    let pos = NodeRef::new(1, 1);
    cluster
        .config_set(pos, "maxmemory-policy", "allkeys-lru")
        .unwrap();
    cluster.config_set_all("slowlog-max-len", "17").unwrap();
    cluster.restart(pos, Restart::SameAddress).unwrap();
    let policy: Vec<String> = cluster
        .node(pos)
        .query(&["CONFIG", "GET", "maxmemory-policy"])
        .unwrap();
    assert_eq!(policy, ["maxmemory-policy", "allkeys-lru"]);
    let len: Vec<String> = cluster
        .node(pos)
        .query(&["CONFIG", "GET", "slowlog-max-len"])
        .unwrap();
    assert_eq!(len, ["slowlog-max-len", "17"]);
}

#[test]
fn dropping_the_cluster_leaves_no_process_and_no_directory() {
    let cluster = ValkeyCluster::start(ClusterSpec::new(1, 1)).unwrap();
    let root = cluster.root_dir().to_path_buf();
    let marker = root.display().to_string();
    let pids: Vec<u32> = cluster.nodes().iter().map(|n| n.pid().unwrap()).collect();
    let mut found = processes_mentioning(&marker);
    found.sort_unstable();
    let mut expected = pids.clone();
    expected.sort_unstable();
    assert_eq!(
        found, expected,
        "the nodes carry the marker on their command line"
    );

    drop(cluster);
    assert_eq!(processes_mentioning(&marker), Vec::<u32>::new());
    for pid in pids {
        assert!(!Path::new(&format!("/proc/{pid}")).exists(), "pid {pid}");
    }
    assert!(!root.exists(), "{} is left", root.display());
    assert_eq!(stray_processes(), Vec::<u32>::new());
}

#[test]
fn a_node_that_fails_to_start_is_reported_with_its_log() {
    let err = ValkeyCluster::start(ClusterSpec::new(1, 0).with_config("no-such-directive", "1"))
        .unwrap_err();
    let msg = format!("{err:#}");
    assert!(msg.contains("node 0-0"), "{msg}");
    assert!(
        msg.contains("no-such-directive"),
        "the log tail is missing: {msg}"
    );
}

#[test]
fn a_node_that_dies_on_its_own_is_reported_at_once() {
    let cluster = ValkeyCluster::start(ClusterSpec::new(1, 0)).unwrap();
    let node = &cluster.nodes()[0];
    // Not through the harness: as if the process crashed.
    let _ = node.query::<()>(&["SHUTDOWN", "NOSAVE"]);
    let start = Instant::now();
    let err = cluster.wait_healthy(Duration::from_secs(30)).unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
    let msg = format!("{err:#}");
    assert!(
        msg.contains("node 0-0") && msg.contains("exited on its own"),
        "{msg}"
    );
    assert!(node.unexpected_exit().is_some());
    assert!(!node.is_running());

    cluster.restart(node.pos, Restart::SameAddress).unwrap();
    assert_ok_everywhere(&cluster);
}
