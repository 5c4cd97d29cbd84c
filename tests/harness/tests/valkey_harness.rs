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
    let _turn = STRAYS.lock().unwrap_or_else(|e| e.into_inner());
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

/// Tests that look at every harness process on the machine (strays) take turns: one of
/// them makes a stray on purpose.
static STRAYS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The child-process side of [`nodes_orphaned_by_a_killed_test_process_are_reaped_by_the_next_start`],
/// chosen by `SHARDGATE_HARNESS_CHILD`; run as a test of its own it does nothing.
#[test]
fn child_process_role() {
    match std::env::var("SHARDGATE_HARNESS_CHILD").as_deref() {
        // A test process that starts a node, says where (in the file its parent named),
        // and is then killed by its parent.
        Ok("orphan") => {
            let server = shardgate_harness::valkey::Standalone::start().unwrap();
            let out = std::env::var_os("SHARDGATE_HARNESS_CHILD_OUT").unwrap();
            let tmp = std::path::PathBuf::from(&out).with_extension("tmp");
            std::fs::write(&tmp, server.dir.display().to_string()).unwrap();
            std::fs::rename(&tmp, &out).unwrap();
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        // The next test run: its first harness start reaps what dead runs left.
        Ok("start") => {
            drop(shardgate_harness::valkey::Standalone::start().unwrap());
        }
        _ => {}
    }
}

/// This test binary, running only [`child_process_role`] as `role`.
fn child(role: &str) -> std::process::Command {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "child_process_role",
        "--nocapture",
        "--test-threads",
        "1",
    ])
    .env("SHARDGATE_HARNESS_CHILD", role)
    .stdin(std::process::Stdio::null())
    .stderr(std::process::Stdio::inherit());
    cmd
}

/// Whether `pid` is still a process (a zombie that only waits for its parent to collect
/// its status is not).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| Some(s.rsplit_once(')')?.1.trim_start().starts_with('Z')))
        .is_some_and(|zombie| !zombie)
}

#[test]
fn a_panicking_test_leaves_no_process_and_no_directory() {
    let _turn = STRAYS.lock().unwrap_or_else(|e| e.into_inner());
    let (tx, rx) = std::sync::mpsc::channel();
    let result = std::thread::spawn(move || {
        let cluster = ValkeyCluster::start(ClusterSpec::new(1, 1)).unwrap();
        let pids: Vec<u32> = cluster.nodes().iter().map(|n| n.pid().unwrap()).collect();
        tx.send((cluster.root_dir().to_path_buf(), pids)).unwrap();
        panic!("a test fails with its cluster running");
    })
    .join();
    assert!(result.is_err(), "the thread did not panic");
    let (root, pids) = rx.recv().unwrap();
    assert_eq!(pids.len(), 2);
    assert_eq!(
        processes_mentioning(&root.display().to_string()),
        Vec::<u32>::new()
    );
    for pid in pids {
        assert!(!running(pid), "node pid {pid} outlived the panic");
    }
    assert!(!root.exists(), "{} is left", root.display());
}

#[test]
fn nodes_orphaned_by_a_killed_test_process_are_reaped_by_the_next_start() {
    let _turn = STRAYS.lock().unwrap_or_else(|e| e.into_inner());
    let out = std::env::temp_dir().join(format!("orphan-test-{}", std::process::id()));
    let _ = std::fs::remove_file(&out);
    let mut test = child("orphan")
        .env("SHARDGATE_HARNESS_CHILD_OUT", &out)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let dir = loop {
        if let Ok(dir) = std::fs::read_to_string(&out) {
            break std::path::PathBuf::from(dir);
        }
        if let Some(status) = test.try_wait().unwrap() {
            let mut err = String::new();
            if let Some(mut e) = test.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            panic!("the child test exited ({status}) before starting its node:\n{err}");
        }
        assert!(Instant::now() < deadline, "the child test started no node");
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = std::fs::remove_file(&out);
    let marker = dir.display().to_string();
    let node = processes_mentioning(&marker);
    assert_eq!(node.len(), 1, "the child's node: {node:?}");
    let node = node[0];

    // SIGKILL: no drop, no cleanup; the node outlives its test process.
    test.kill().unwrap();
    test.wait().unwrap();
    assert!(running(node), "the node died with its test process");
    assert!(
        stray_processes().contains(&node),
        "the orphan is not seen as a stray"
    );
    assert!(dir.exists());

    let next = child("start")
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    assert!(
        next.status.success(),
        "the next run's harness start: {}\n{}",
        next.status,
        String::from_utf8_lossy(&next.stderr)
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while running(node) {
        assert!(
            Instant::now() < deadline,
            "the orphan {node} was not reaped"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!dir.exists(), "{} is left", dir.display());
    assert_eq!(processes_mentioning(&marker), Vec::<u32>::new());
}
