//! The typed view of `CLUSTER SHARDS`.
//!
//! # Format
//!
//! In RESP2 every map is a flat key/value array. The shard's `id` is its last key (Valkey
//! 7.2+; absent before), node keys come in the order shown, `hostname` only when one is
//! announced, `tls-port` only on TLS nodes, and keys this module does not know (e.g.
//! `availability-zone`) are skipped. Shards are not sorted by slot.
//!
//! ```text
//! *3                                  one entry per shard
//!   *6  slots  *2 :10923 :16383       start/end pairs
//!       nodes  *2
//!         *14  id <40 hex>  port :6379  ip 127.0.10.3  endpoint 127.0.10.3
//!              role master  replication-offset :28  health online
//!         *14  ...  role replica  ...
//!       id <40 hex>
//! ```

use crate::client::Client;
use crate::{Error, Reply};

/// A shard as `CLUSTER SHARDS` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardView {
    /// The shard id (Valkey 7.2+).
    pub id: Option<String>,
    /// Inclusive slot ranges, in the order the node gave them.
    pub slots: Vec<(u16, u16)>,
    pub nodes: Vec<NodeView>,
}

/// A node as `CLUSTER SHARDS` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeView {
    /// The 40-hex-digit node id.
    pub id: String,
    pub ip: String,
    /// The endpoint clients are told to use, as given: the ip, the hostname, `""` (the
    /// answering node uses `unknown-endpoint`) or `"?"` (hostname preferred, none set).
    pub endpoint: Option<String>,
    /// `cluster-announce-hostname`, if set.
    pub hostname: Option<String>,
    /// The plain-text client port; `None` when absent or 0.
    pub port: Option<u16>,
    /// The TLS client port; `None` when absent or 0.
    pub tls_port: Option<u16>,
    /// The role is `master`.
    pub primary: bool,
    /// `online`, `failed` or `loading`.
    pub health: String,
    pub replication_offset: Option<i64>,
}

impl ShardView {
    /// A stable key: the shard id, or (before Valkey 7.2) its lowest node id.
    pub fn key(&self) -> String {
        self.id.clone().unwrap_or_else(|| {
            self.nodes
                .iter()
                .map(|n| n.id.clone())
                .min()
                .unwrap_or_default()
        })
    }

    /// The shard's primary, if it has one.
    pub fn primary(&self) -> Option<&NodeView> {
        self.nodes.iter().find(|n| n.primary)
    }
}

impl Client {
    /// `CLUSTER SHARDS`, parsed.
    ///
    /// # Errors
    ///
    /// As [`Client::command`] (an instance without cluster support answers with an error
    /// reply), and [`Error::Shape`] if the reply is not shaped like `CLUSTER SHARDS`.
    pub async fn cluster_shards(&mut self) -> Result<Vec<ShardView>, Error> {
        let reply = self.command(["CLUSTER", "SHARDS"]).await?;
        parse_shards(&reply).map_err(|e| e.at(self.addr()))
    }
}

fn text(f: &Reply) -> Option<String> {
    match f {
        Reply::BulkString(b) | Reply::SimpleString(b) => {
            Some(String::from_utf8_lossy(b).into_owned())
        }
        Reply::Integer(i) => Some(i.to_string()),
        _ => None,
    }
}

fn int(f: &Reply) -> Option<i64> {
    match f {
        Reply::Integer(i) => Some(*i),
        other => text(other)?.parse().ok(),
    }
}

/// A port: 0 means none.
fn port(f: &Reply) -> Option<u16> {
    int(f)
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p > 0)
}

/// The key/value pairs of a RESP2 flat map.
fn pairs<'a>(f: &'a Reply, what: &str) -> Result<Vec<(String, &'a Reply)>, Error> {
    let Reply::Array(items) = f else {
        return Err(Error::shape(format!(
            "CLUSTER SHARDS: {what} is not an array of key/value pairs"
        )));
    };
    if items.len() % 2 != 0 {
        return Err(Error::shape(format!(
            "CLUSTER SHARDS: {what} has an odd number of elements"
        )));
    }
    items
        .chunks_exact(2)
        .map(|kv| {
            let key = text(&kv[0]).ok_or_else(|| {
                Error::shape(format!("CLUSTER SHARDS: {what} has a non-string key"))
            })?;
            Ok((key, &kv[1]))
        })
        .collect()
}

/// Parses a RESP2 `CLUSTER SHARDS` reply.
///
/// # Errors
///
/// [`Error::Shape`] (without an address) for an error reply, or when the reply, a shard or
/// a node is not the documented shape: not an array, a map with an odd number of elements,
/// `slots` or `nodes` not arrays, a slot number out of range, a node without `id`.
pub fn parse_shards(reply: &Reply) -> Result<Vec<ShardView>, Error> {
    let shards = match reply {
        Reply::Array(shards) => shards,
        Reply::Error(e) => return Err(Error::shape(format!("CLUSTER SHARDS: error reply: {e}"))),
        _ => return Err(Error::shape("CLUSTER SHARDS: expected an array of shards")),
    };
    shards.iter().map(parse_shard).collect()
}

fn parse_shard(shard: &Reply) -> Result<ShardView, Error> {
    let mut s = ShardView {
        id: None,
        slots: vec![],
        nodes: vec![],
    };
    for (key, value) in pairs(shard, "a shard")? {
        match key.as_str() {
            "id" => s.id = text(value),
            "slots" => {
                let Reply::Array(bounds) = value else {
                    return Err(Error::shape("CLUSTER SHARDS: slots is not an array"));
                };
                let bounds: Vec<u16> = bounds
                    .iter()
                    .map(|b| int(b).and_then(|v| u16::try_from(v).ok()))
                    .collect::<Option<_>>()
                    .ok_or_else(|| Error::shape("CLUSTER SHARDS: bad slot number"))?;
                s.slots = bounds.chunks_exact(2).map(|r| (r[0], r[1])).collect();
            }
            "nodes" => {
                let Reply::Array(nodes) = value else {
                    return Err(Error::shape("CLUSTER SHARDS: nodes is not an array"));
                };
                s.nodes = nodes.iter().map(parse_node).collect::<Result<_, _>>()?;
            }
            _ => {}
        }
    }
    Ok(s)
}

fn parse_node(node: &Reply) -> Result<NodeView, Error> {
    let mut n = NodeView {
        id: String::new(),
        ip: String::new(),
        endpoint: None,
        hostname: None,
        port: None,
        tls_port: None,
        primary: false,
        health: String::new(),
        replication_offset: None,
    };
    for (k, v) in pairs(node, "a node")? {
        match k.as_str() {
            "id" => n.id = text(v).unwrap_or_default(),
            "ip" => n.ip = text(v).unwrap_or_default(),
            "endpoint" => n.endpoint = text(v),
            "hostname" => n.hostname = text(v).filter(|h| !h.is_empty()),
            "port" => n.port = port(v),
            "tls-port" => n.tls_port = port(v),
            "role" => n.primary = text(v).as_deref() == Some("master"),
            "health" => n.health = text(v).unwrap_or_default(),
            "replication-offset" => n.replication_offset = int(v),
            _ => {}
        }
    }
    if n.id.is_empty() {
        return Err(Error::shape("CLUSTER SHARDS: a node without id"));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;
    use redis_protocol::codec::Resp2;
    use tokio_util::codec::Decoder;

    use crate::depth::BoundedCodec;

    fn decode(bytes: &[u8]) -> Reply {
        let mut buf = BytesMut::from(bytes);
        let reply = BoundedCodec::new(Resp2::default())
            .decode(&mut buf)
            .unwrap()
            .unwrap();
        assert!(buf.is_empty(), "{} bytes left over", buf.len());
        reply
    }

    /// shared/reference/valkey-topology-replies.md, c2-08: CLUSTER SHARDS (RESP2) from
    /// 127.0.10.1 with announced hostnames; verbatim, the lines joined by `\`.
    const C2_08: &[u8] = b"*3\r\n\
  *6\r\n\
    $5\r\nslots\r\n*2\r\n:10923\r\n:16383\r\n\
    $5\r\nnodes\r\n\
      *2\r\n\
        *16\r\n\
          $2\r\nid\r\n$40\r\n9be423741f0a3b818f633a9c16a1cf9ef42922d0\r\n\
          $4\r\nport\r\n:6379\r\n\
          $2\r\nip\r\n$10\r\n127.0.10.3\r\n\
          $8\r\nendpoint\r\n$10\r\n127.0.10.3\r\n\
          $8\r\nhostname\r\n$19\r\nnode-3.example.test\r\n\
          $4\r\nrole\r\n$6\r\nmaster\r\n\
          $18\r\nreplication-offset\r\n:28\r\n\
          $6\r\nhealth\r\n$6\r\nonline\r\n\
        *16\r\n\
          $2\r\nid\r\n$40\r\nb6c576188309d2169652f87caed74d6812de842b\r\n\
          $4\r\nport\r\n:6379\r\n\
          $2\r\nip\r\n$10\r\n127.0.10.4\r\n\
          $8\r\nendpoint\r\n$10\r\n127.0.10.4\r\n\
          $8\r\nhostname\r\n$19\r\nnode-4.example.test\r\n\
          $4\r\nrole\r\n$7\r\nreplica\r\n\
          $18\r\nreplication-offset\r\n:28\r\n\
          $6\r\nhealth\r\n$6\r\nonline\r\n\
    $2\r\nid\r\n$40\r\n3de10435381d991600148b6427881d8d83648888\r\n\
  *6\r\n\
    $5\r\nslots\r\n*2\r\n:5461\r\n:10922\r\n\
    $5\r\nnodes\r\n\
      *2\r\n\
        *16\r\n\
          $2\r\nid\r\n$40\r\n45a9dc707629b0798a2940235c6c132109b67d39\r\n\
          $4\r\nport\r\n:6379\r\n\
          $2\r\nip\r\n$10\r\n127.0.10.2\r\n\
          $8\r\nendpoint\r\n$10\r\n127.0.10.2\r\n\
          $8\r\nhostname\r\n$19\r\nnode-2.example.test\r\n\
          $4\r\nrole\r\n$6\r\nmaster\r\n\
          $18\r\nreplication-offset\r\n:279\r\n\
          $6\r\nhealth\r\n$6\r\nonline\r\n\
        *16\r\n\
          $2\r\nid\r\n$40\r\nfa68a450d251922408bbc98e153b47689f7d1d6f\r\n\
          $4\r\nport\r\n:6379\r\n\
          $2\r\nip\r\n$10\r\n127.0.10.6\r\n\
          $8\r\nendpoint\r\n$10\r\n127.0.10.6\r\n\
          $8\r\nhostname\r\n$19\r\nnode-6.example.test\r\n\
          $4\r\nrole\r\n$7\r\nreplica\r\n\
          $18\r\nreplication-offset\r\n:279\r\n\
          $6\r\nhealth\r\n$6\r\nonline\r\n\
    $2\r\nid\r\n$40\r\n65bc16711e1db1dfc8e706390948c451ea6ffd04\r\n\
  *6\r\n\
    $5\r\nslots\r\n*2\r\n:0\r\n:5460\r\n\
    $5\r\nnodes\r\n\
      *2\r\n\
        *16\r\n\
          $2\r\nid\r\n$40\r\na539d95fb51874a91ad88b8f1c379041378f6000\r\n\
          $4\r\nport\r\n:6379\r\n\
          $2\r\nip\r\n$10\r\n127.0.10.1\r\n\
          $8\r\nendpoint\r\n$10\r\n127.0.10.1\r\n\
          $8\r\nhostname\r\n$19\r\nnode-1.example.test\r\n\
          $4\r\nrole\r\n$6\r\nmaster\r\n\
          $18\r\nreplication-offset\r\n:367\r\n\
          $6\r\nhealth\r\n$6\r\nonline\r\n\
        *16\r\n\
          $2\r\nid\r\n$40\r\n2dd88adea70885bb44cbfa95de22bc992c322cf1\r\n\
          $4\r\nport\r\n:6379\r\n\
          $2\r\nip\r\n$10\r\n127.0.10.5\r\n\
          $8\r\nendpoint\r\n$10\r\n127.0.10.5\r\n\
          $8\r\nhostname\r\n$19\r\nnode-5.example.test\r\n\
          $4\r\nrole\r\n$7\r\nreplica\r\n\
          $18\r\nreplication-offset\r\n:353\r\n\
          $6\r\nhealth\r\n$6\r\nonline\r\n\
    $2\r\nid\r\n$40\r\n4cba700fee4546bb08302528fb68a37194ccf1ac\r\n";

    /// c3-13, trimmed to its first shard: `unknown-endpoint`, so `endpoint` is `$0` (empty),
    /// and no hostname is announced for this shard.
    const C3_13_FIRST_SHARD: &[u8] = b"*1\r\n\
  *6\r\n\
    $5\r\nslots\r\n*2\r\n:10923\r\n:16383\r\n\
    $5\r\nnodes\r\n\
      *2\r\n\
        *14\r\n\
          $2\r\nid\r\n$40\r\n9be423741f0a3b818f633a9c16a1cf9ef42922d0\r\n\
          $4\r\nport\r\n:6379\r\n\
          $2\r\nip\r\n$10\r\n127.0.10.3\r\n\
          $8\r\nendpoint\r\n$0\r\n\r\n\
          $4\r\nrole\r\n$6\r\nmaster\r\n\
          $18\r\nreplication-offset\r\n:42\r\n\
          $6\r\nhealth\r\n$6\r\nonline\r\n\
        *14\r\n\
          $2\r\nid\r\n$40\r\nb6c576188309d2169652f87caed74d6812de842b\r\n\
          $4\r\nport\r\n:6379\r\n\
          $2\r\nip\r\n$10\r\n127.0.10.4\r\n\
          $8\r\nendpoint\r\n$0\r\n\r\n\
          $4\r\nrole\r\n$7\r\nreplica\r\n\
          $18\r\nreplication-offset\r\n:42\r\n\
          $6\r\nhealth\r\n$6\r\nonline\r\n\
    $2\r\nid\r\n$40\r\n3de10435381d991600148b6427881d8d83648888\r\n";

    #[test]
    fn parses_a_real_resp2_reply() {
        let shards = parse_shards(&decode(C2_08)).unwrap();
        // The reference's table (section 0.2), in the reply's order (not sorted by slot).
        let summary: Vec<_> = shards
            .iter()
            .map(|s| {
                let p = s.primary().unwrap();
                (
                    s.id.as_deref().unwrap(),
                    s.slots.clone(),
                    p.id.as_str(),
                    p.ip.as_str(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            [
                (
                    "3de10435381d991600148b6427881d8d83648888",
                    vec![(10923, 16383)],
                    "9be423741f0a3b818f633a9c16a1cf9ef42922d0",
                    "127.0.10.3"
                ),
                (
                    "65bc16711e1db1dfc8e706390948c451ea6ffd04",
                    vec![(5461, 10922)],
                    "45a9dc707629b0798a2940235c6c132109b67d39",
                    "127.0.10.2"
                ),
                (
                    "4cba700fee4546bb08302528fb68a37194ccf1ac",
                    vec![(0, 5460)],
                    "a539d95fb51874a91ad88b8f1c379041378f6000",
                    "127.0.10.1"
                ),
            ]
        );
        // 127.0.10.4, the replica of 127.0.10.3, every field.
        assert_eq!(
            shards[0].nodes[1],
            NodeView {
                id: "b6c576188309d2169652f87caed74d6812de842b".into(),
                ip: "127.0.10.4".into(),
                endpoint: Some("127.0.10.4".into()),
                hostname: Some("node-4.example.test".into()),
                port: Some(6379),
                tls_port: None,
                primary: false,
                health: "online".into(),
                replication_offset: Some(28),
            }
        );
        assert_eq!(shards[2].nodes[0].replication_offset, Some(367));
        for s in &shards {
            assert_eq!(s.nodes.iter().filter(|n| n.primary).count(), 1);
            assert_eq!(s.key(), *s.id.as_ref().unwrap());
        }
    }

    #[test]
    fn an_empty_endpoint_stays_meaningful_and_no_hostname_is_none() {
        let shards = parse_shards(&decode(C3_13_FIRST_SHARD)).unwrap();
        assert_eq!(shards.len(), 1);
        let n = &shards[0].nodes[0];
        assert_eq!(n.endpoint.as_deref(), Some(""));
        assert_eq!(n.hostname, None);
        assert_eq!(
            (n.ip.as_str(), n.port, n.primary),
            ("127.0.10.3", Some(6379), true)
        );
        assert_eq!(shards[0].nodes[1].replication_offset, Some(42));
    }

    #[test]
    fn unknown_keys_zero_ports_and_empty_hostnames() {
        let node = |extra: Vec<Reply>| {
            let mut kv = vec![
                Reply::BulkString("id".into()),
                Reply::BulkString("b6c576188309d2169652f87caed74d6812de842b".into()),
                Reply::BulkString("port".into()),
                Reply::Integer(0),
                Reply::BulkString("tls-port".into()),
                Reply::Integer(6380),
                Reply::BulkString("hostname".into()),
                Reply::BulkString("".into()),
                Reply::BulkString("availability-zone".into()),
                Reply::BulkString("zone-c".into()),
            ];
            kv.extend(extra);
            Reply::Array(kv)
        };
        let reply = Reply::Array(vec![Reply::Array(vec![
            Reply::BulkString("nodes".into()),
            Reply::Array(vec![node(vec![])]),
            Reply::BulkString("future-key".into()),
            Reply::Array(vec![Reply::Null]),
        ])]);
        let shards = parse_shards(&reply).unwrap();
        let n = &shards[0].nodes[0];
        assert_eq!(
            (n.port, n.tls_port, n.hostname.as_deref()),
            (None, Some(6380), None)
        );
        assert_eq!(n.endpoint, None);
        // Before Valkey 7.2 there is no shard id: the lowest node id is the key.
        assert_eq!(shards[0].id, None);
        assert_eq!(shards[0].key(), "b6c576188309d2169652f87caed74d6812de842b");
    }

    #[test]
    fn bad_replies_are_errors() {
        let node_without_id = Reply::Array(vec![Reply::Array(vec![
            Reply::BulkString("nodes".into()),
            Reply::Array(vec![Reply::Array(vec![
                Reply::BulkString("ip".into()),
                Reply::BulkString("127.0.0.1".into()),
            ])]),
        ])]);
        let bad_slot = Reply::Array(vec![Reply::Array(vec![
            Reply::BulkString("slots".into()),
            Reply::Array(vec![Reply::Integer(0), Reply::Integer(70000)]),
        ])]);
        for (reply, message) in [
            (
                Reply::Error("ERR This instance has cluster support disabled".into()),
                "error reply: ERR This instance has cluster support disabled",
            ),
            (Reply::Integer(3), "expected an array of shards"),
            (
                Reply::Array(vec![Reply::Integer(1)]),
                "a shard is not an array of key/value pairs",
            ),
            (
                Reply::Array(vec![Reply::Array(vec![Reply::Null])]),
                "a shard has an odd number of elements",
            ),
            (
                Reply::Array(vec![Reply::Array(vec![Reply::Null, Reply::Null])]),
                "a shard has a non-string key",
            ),
            (
                Reply::Array(vec![Reply::Array(vec![
                    Reply::BulkString("nodes".into()),
                    Reply::Integer(1),
                ])]),
                "nodes is not an array",
            ),
            (node_without_id, "a node without id"),
            (bad_slot, "bad slot number"),
        ] {
            let err = parse_shards(&reply).unwrap_err();
            assert_eq!(err.label(), "shape");
            assert_eq!(
                err.to_string(),
                format!("unexpected reply: CLUSTER SHARDS: {message}")
            );
        }
    }
}
