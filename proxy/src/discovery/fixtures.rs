//! Hand-written cluster answers for the discovery tests: a 2×1 cluster (shards `sa` and
//! `sb`), its nodes' `CLUSTER SHARDS` entries and `CLUSTER NODES` lines.

use std::net::SocketAddr;

use shardgate_admin_client::{NodeLine, NodeView, ShardView};

use super::Answer;

pub const A1: &str = "a100000000000000000000000000000000000000";
pub const A2: &str = "a200000000000000000000000000000000000000";
pub const B1: &str = "b100000000000000000000000000000000000000";
pub const B2: &str = "b200000000000000000000000000000000000000";

pub fn node(id: &str, ip: &str, primary: bool, health: &str) -> NodeView {
    NodeView {
        id: id.into(),
        ip: ip.into(),
        endpoint: Some(ip.into()),
        hostname: None,
        port: Some(6379),
        tls_port: None,
        primary,
        health: health.into(),
        replication_offset: None,
    }
}

/// A `CLUSTER NODES` line: flags and config epoch are what the choice reads.
pub fn line(id: &str, flags: &str, epoch: u64) -> NodeLine {
    NodeLine {
        id: id.into(),
        ip: String::new(),
        port: 6379,
        bus_port: 16379,
        hostname: None,
        flags: flags.split(',').map(String::from).collect(),
        primary_id: None,
        config_epoch: epoch,
        connected: true,
        slots: vec![],
    }
}

pub fn shard(id: &str, slots: Vec<(u16, u16)>, nodes: Vec<NodeView>) -> ShardView {
    ShardView {
        id: Some(id.into()),
        slots,
        nodes,
    }
}

pub fn addr(last: u8) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, last], 6379))
}

/// A healthy 2×1 cluster as node `me`, dialled at 127.0.0.`at`, sees it: shard `sa` (slots
/// 0-8191, epoch 1) and `sb` (8192-16383, epoch 2).
pub fn healthy(me: &str, at: u8) -> Answer {
    Answer {
        addr: addr(at),
        myself: me.into(),
        state_ok: true,
        shards: vec![
            shard(
                "sa",
                vec![(0, 8191)],
                vec![
                    node(A1, "127.0.0.1", true, "online"),
                    node(A2, "127.0.0.2", false, "online"),
                ],
            ),
            shard(
                "sb",
                vec![(8192, 16383)],
                vec![
                    node(B1, "127.0.0.3", true, "online"),
                    node(B2, "127.0.0.4", false, "online"),
                ],
            ),
        ],
        nodes: vec![
            line(A1, "master", 1),
            line(A2, "slave", 1),
            line(B1, "master", 2),
            line(B2, "slave", 2),
        ],
    }
}

/// A replica's `CLUSTER NODES` line, naming its primary.
pub fn replica_line(id: &str, primary: &str, epoch: u64) -> NodeLine {
    NodeLine {
        primary_id: Some(primary.into()),
        ..line(id, "slave", epoch)
    }
}
