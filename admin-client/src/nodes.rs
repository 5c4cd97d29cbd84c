//! The typed view of `CLUSTER NODES`: one [`NodeLine`] per node the answering node knows.
//!
//! # Format
//!
//! ```text
//! <id> <ip:port@cport[,hostname]> <flags> <primary id|-> <ping-sent> <pong-recv> <config-epoch> <link-state> <slot> <slot> ...
//! ```
//!
//! e.g. `a539...6000 127.0.10.1:6379@16379,vc-0-0 myself,master - 0 0 1 connected 0-5460`.
//! Slots in brackets (`[93->-b0c1...]`, a migration in progress) are not ownership and are
//! skipped; a `noaddr` node shows `:0@0`.

use redis_protocol::resp2::types::Resp2Frame;

use crate::client::Client;
use crate::{Error, Reply};

/// A node as `CLUSTER NODES` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeLine {
    pub id: String,
    /// The announced IP (empty for `noaddr`).
    pub ip: String,
    pub port: u16,
    pub bus_port: u16,
    /// The announced hostname, if any.
    pub hostname: Option<String>,
    /// `myself`, `master`, `slave`, `fail?`, `fail`, `handshake`, `noaddr`, `nofailover`...
    pub flags: Vec<String>,
    /// The id of the primary this node replicates, if it is a replica.
    pub primary_id: Option<String>,
    pub config_epoch: u64,
    /// The cluster bus link to it is up.
    pub connected: bool,
    /// Inclusive slot ranges it serves.
    pub slots: Vec<(u16, u16)>,
}

impl NodeLine {
    pub fn has_flag(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }

    pub fn is_myself(&self) -> bool {
        self.has_flag("myself")
    }

    pub fn is_primary(&self) -> bool {
        self.has_flag("master")
    }

    /// Marked failed (`fail`) or possibly failed (`fail?`) by the answering node.
    pub fn is_failing(&self) -> bool {
        self.has_flag("fail") || self.has_flag("fail?")
    }

    /// Still in the handshake, or without an address.
    pub fn is_joining(&self) -> bool {
        self.has_flag("handshake") || self.has_flag("noaddr")
    }

    /// How many slots it serves.
    pub fn slot_count(&self) -> u32 {
        self.slots
            .iter()
            .map(|(a, b)| u32::from(*b) - u32::from(*a) + 1)
            .sum()
    }
}

/// Parses a `CLUSTER NODES` reply's text.
pub fn parse_nodes(text: &str) -> Result<Vec<NodeLine>, Error> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(parse_line)
        .collect()
}

fn parse_line(line: &str) -> Result<NodeLine, Error> {
    let bad = |what: &str| Error::shape(format!("CLUSTER NODES: {what} in {line:?}"));
    let fields: Vec<&str> = line.split(' ').collect();
    if fields.len() < 8 {
        return Err(bad("fewer than 8 fields"));
    }
    let (addr, hostname) = match fields[1].split_once(',') {
        Some((a, h)) => (a, (!h.is_empty()).then(|| h.to_string())),
        None => (fields[1], None),
    };
    let (ip_port, bus) = addr.split_once('@').ok_or_else(|| bad("no @cport"))?;
    // The bus port may carry more after a comma in older formats; the hostname was cut above.
    let (ip, port) = ip_port.rsplit_once(':').ok_or_else(|| bad("no :port"))?;
    let port = port.parse().map_err(|_| bad("a bad port"))?;
    let bus_port = bus.parse().map_err(|_| bad("a bad bus port"))?;
    let mut slots = Vec::new();
    for s in &fields[8..] {
        if s.starts_with('[') {
            continue;
        }
        let (a, b) = s.split_once('-').unwrap_or((s, s));
        let (Ok(a), Ok(b)) = (a.parse::<u16>(), b.parse::<u16>()) else {
            return Err(bad("a bad slot range"));
        };
        if a > b || b > 16383 {
            return Err(bad("a slot range out of order or past 16383"));
        }
        slots.push((a, b));
    }
    Ok(NodeLine {
        id: fields[0].to_string(),
        ip: ip.to_string(),
        port,
        bus_port,
        hostname,
        flags: fields[2].split(',').map(str::to_string).collect(),
        primary_id: (fields[3] != "-").then(|| fields[3].to_string()),
        config_epoch: fields[6].parse().map_err(|_| bad("a bad config epoch"))?,
        connected: fields[7] == "connected",
        slots,
    })
}

impl Client {
    /// `CLUSTER NODES`, parsed.
    ///
    /// # Errors
    ///
    /// As [`Client::command`], and [`Error::Shape`] when a line does not parse.
    pub async fn cluster_nodes(&mut self) -> Result<Vec<NodeLine>, Error> {
        match self.command(["CLUSTER", "NODES"]).await? {
            Reply::BulkString(text) => {
                parse_nodes(&String::from_utf8_lossy(&text)).map_err(|e| e.at(self.addr()))
            }
            other => Err(
                Error::shape(format!("CLUSTER NODES: {:?} reply", other.kind())).at(self.addr()),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines of a real reply (shared/reference/valkey-topology-replies.md shapes: a primary
    /// with a hostname, a replica, a node mid-migration, a failed noaddr node).
    const TEXT: &str = "\
a539d95fb51874a91ad88b8f1c379041378f6000 127.0.10.1:6379@16379,vc-0-0 myself,master - 0 1700000000000 1 connected 0-5460 [5461->-4cba700fee4546bb08302528fb68a37194ccf1ac]\n\
4cba700fee4546bb08302528fb68a37194ccf1ac 127.0.10.2:6379@16379 slave a539d95fb51874a91ad88b8f1c379041378f6000 0 1700000000001 1 connected\n\
9be423741f0a3b818f633a9c16a1cf9ef42922d0 :0@0 master,fail,noaddr - 1700000000000 1700000000000 3 disconnected 10923 10925-16383\n";

    #[test]
    fn parses_every_field() {
        let nodes = parse_nodes(TEXT).unwrap();
        assert_eq!(nodes.len(), 3);
        let a = &nodes[0];
        assert_eq!(a.ip, "127.0.10.1");
        assert_eq!((a.port, a.bus_port), (6379, 16379));
        assert_eq!(a.hostname.as_deref(), Some("vc-0-0"));
        assert!(a.is_myself() && a.is_primary() && a.connected);
        assert_eq!(a.slots, [(0, 5460)]);
        assert_eq!(a.slot_count(), 5461);
        let b = &nodes[1];
        assert_eq!(b.primary_id.as_deref(), Some(a.id.as_str()));
        assert!(!b.is_primary());
        let c = &nodes[2];
        assert_eq!((c.ip.as_str(), c.port), ("", 0));
        assert!(c.is_failing() && c.is_joining() && !c.connected);
        assert_eq!(c.slots, [(10923, 10923), (10925, 16383)]);
        assert_eq!(c.config_epoch, 3);
    }

    #[test]
    fn bad_lines_are_errors_that_quote_them() {
        for bad in [
            "abc 127.0.0.1:6379@16379 master - 0 0 1",
            "abc 127.0.0.1:6379 master - 0 0 1 connected",
            "abc 127.0.0.1:x@16379 master - 0 0 1 connected",
            "abc 127.0.0.1:6379@16379 master - 0 0 1 connected 5-3",
            "abc 127.0.0.1:6379@16379 master - 0 0 1 connected 0-16384",
        ] {
            let err = parse_nodes(bad).unwrap_err().to_string();
            assert!(err.contains(bad), "{err}");
        }
    }
}
