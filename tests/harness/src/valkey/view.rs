//! Parsing `CLUSTER NODES`: one node's view of the cluster.

use anyhow::{bail, Context, Result};

/// One line of `CLUSTER NODES`:
/// `<id> <ip:port@cport[,hostname]> <flags> <master> <ping-sent> <pong-recv> <config-epoch>
/// <link-state> <slot> ...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodesLine {
    pub id: String,
    /// The address field as shown (`ip:port@cport[,hostname]`); with
    /// `cluster-announce-client-*` set it shows the announced address.
    pub address: String,
    pub flags: Vec<String>,
    /// The primary's id, for a replica.
    pub master: Option<String>,
    pub config_epoch: u64,
    pub connected: bool,
    /// Owned slot ranges, inclusive; migration markers (`[slot->-id]`) are left out.
    pub slots: Vec<(u16, u16)>,
}

impl NodesLine {
    pub fn has_flag(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }
    pub fn is_myself(&self) -> bool {
        self.has_flag("myself")
    }
    pub fn is_primary(&self) -> bool {
        self.has_flag("master")
    }
    /// `fail`, `fail?` (pfail), `handshake` or `noaddr`: not (yet) a healthy member.
    pub fn is_troubled(&self) -> bool {
        ["fail", "fail?", "handshake", "noaddr"]
            .iter()
            .any(|f| self.has_flag(f))
    }
    pub fn owns(&self, slot: u16) -> bool {
        self.slots.iter().any(|&(lo, hi)| lo <= slot && slot <= hi)
    }
    /// The `ip:port` part of the address.
    pub fn ip_port(&self) -> &str {
        self.address.split(['@', ',']).next().unwrap_or_default()
    }
}

/// `CLUSTER NODES` text (or any text holding its lines) with each line's ping and pong
/// times set to 0: what differs between two calls that should otherwise match. A line is
/// taken for a node line when it has 8 or more fields and a 40-character id (after a RESP3
/// verbatim string's `txt:`).
pub fn zero_ping_pong(text: &str) -> String {
    text.split('\n')
        .map(|line| {
            let mut f: Vec<&str> = line.split(' ').collect();
            if f.len() >= 8 && f[0].trim_start_matches("txt:").len() == 40 {
                f[4] = "0";
                f[5] = "0";
            }
            f.join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Parses a whole `CLUSTER NODES` reply.
pub fn parse_cluster_nodes(text: &str) -> Result<Vec<NodesLine>> {
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| parse_line(line).with_context(|| format!("CLUSTER NODES line {line:?}")))
        .collect()
}

fn parse_line(line: &str) -> Result<NodesLine> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    if fields.len() < 8 {
        bail!("fewer than 8 fields");
    }
    let mut slots = Vec::new();
    for field in &fields[8..] {
        if field.starts_with('[') {
            continue;
        }
        let (lo, hi) = match field.split_once('-') {
            Some((lo, hi)) => (lo.parse()?, hi.parse()?),
            None => {
                let slot = field.parse()?;
                (slot, slot)
            }
        };
        slots.push((lo, hi));
    }
    Ok(NodesLine {
        id: fields[0].to_string(),
        address: fields[1].to_string(),
        flags: fields[2].split(',').map(String::from).collect(),
        master: (fields[3] != "-").then(|| fields[3].to_string()),
        config_epoch: fields[6].parse().context("config epoch")?,
        connected: fields[7] == "connected",
        slots,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_primaries_replicas_and_migration_markers() {
        let text = "\
07c37dfeb235213a872192d90877d0cd55635b91 127.16.0.2:6379@16379 slave e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 0 1426238317239 4 connected
e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 127.16.0.1:6379@16379,node-a myself,master - 0 0 1 connected 0-5460 5462 [5461->-292f8b365bb7edb5e285caf0b7e6ddc7265d2f4f]
292f8b365bb7edb5e285caf0b7e6ddc7265d2f4f 127.16.0.3:6379@16379 master,fail? - 1426238316232 1426238316232 2 disconnected
";
        let lines = parse_cluster_nodes(text).unwrap();
        assert_eq!(lines.len(), 3);
        assert!(!lines[0].is_primary());
        assert_eq!(
            lines[0].master.as_deref(),
            Some("e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca")
        );
        assert!(lines[1].is_myself() && lines[1].is_primary());
        assert_eq!(lines[1].slots, vec![(0, 5460), (5462, 5462)]);
        assert_eq!(lines[1].ip_port(), "127.16.0.1:6379");
        assert!(lines[1].owns(5462) && !lines[1].owns(5461));
        assert!(lines[2].is_troubled() && !lines[2].connected);
        assert_eq!(lines[2].config_epoch, 2);
    }
}
