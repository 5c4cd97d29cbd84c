//! Typed single-command helpers: `PING`, `CLUSTER MYID`, `CLUSTER INFO`, `INFO`.
//!
//! Each is one [`Client::command`] call and a check of the reply's shape.

use std::collections::HashMap;

use redis_protocol::resp2::types::Resp2Frame;

use crate::client::Client;
use crate::{Error, Reply};

impl Client {
    /// `PING`: succeeds on `+PONG`.
    ///
    /// # Errors
    ///
    /// As [`Client::command`] (e.g. `NOAUTH` or `LOADING` error replies), and
    /// [`Error::Shape`] for any other reply.
    pub async fn ping(&mut self) -> Result<(), Error> {
        match self.command(["PING"]).await? {
            Reply::SimpleString(s) if &s[..] == b"PONG" => Ok(()),
            other => Err(unexpected("PING", &other).at(self.addr())),
        }
    }

    /// `CLUSTER MYID`: the node's 40-hex-digit id.
    ///
    /// # Errors
    ///
    /// As [`Client::command`] (an instance without cluster support answers with an error
    /// reply), and [`Error::Shape`] unless the reply is a non-empty string.
    pub async fn cluster_myid(&mut self) -> Result<String, Error> {
        match self.command(["CLUSTER", "MYID"]).await? {
            Reply::BulkString(id) | Reply::SimpleString(id) if !id.is_empty() => {
                Ok(String::from_utf8_lossy(&id).into_owned())
            }
            other => Err(unexpected("CLUSTER MYID", &other).at(self.addr())),
        }
    }

    /// `CLUSTER INFO` as its fields, e.g. `cluster_state` → `ok`, `cluster_known_nodes` → `6`.
    ///
    /// # Errors
    ///
    /// As [`Client::command`], and [`Error::Shape`] unless the reply is a string.
    pub async fn cluster_info(&mut self) -> Result<HashMap<String, String>, Error> {
        match self.command(["CLUSTER", "INFO"]).await? {
            Reply::BulkString(text) => Ok(parse_info(&String::from_utf8_lossy(&text))),
            other => Err(unexpected("CLUSTER INFO", &other).at(self.addr())),
        }
    }
}

impl Client {
    /// `INFO <section>` as its fields, e.g. `INFO replication`'s `master_link_status` → `up`.
    ///
    /// # Errors
    ///
    /// As [`Client::command`], and [`Error::Shape`] unless the reply is a string.
    pub async fn info(&mut self, section: &str) -> Result<HashMap<String, String>, Error> {
        match self.command(["INFO", section]).await? {
            Reply::BulkString(text) => Ok(parse_info(&String::from_utf8_lossy(&text))),
            other => Err(unexpected("INFO", &other).at(self.addr())),
        }
    }
}

fn unexpected(command: &str, reply: &Reply) -> Error {
    Error::shape(format!("{command}: {:?} reply", reply.kind()))
}

/// The `key:value` lines of an INFO-style text (`\r\n`-separated). Blank lines and `#`
/// section headers are skipped, and so are lines without a `:`, for fields a later Valkey
/// may add in another form.
fn parse_info(text: &str) -> HashMap<String, String> {
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .filter_map(|line| line.split_once(':'))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_text_becomes_fields() {
        // The start of a real CLUSTER INFO reply (valkey-server 9.1.2).
        let text = "cluster_state:ok\r\ncluster_slots_assigned:16384\r\ncluster_slots_ok:16384\r\n\
                    cluster_known_nodes:6\r\ncluster_size:3\r\n# Section\r\n\r\nodd line\r\n\
                    total_cluster_links_buffer_limit_exceeded:0\r\n";
        let info = parse_info(text);
        assert_eq!(info["cluster_state"], "ok");
        assert_eq!(info["cluster_slots_assigned"], "16384");
        assert_eq!(info["cluster_known_nodes"], "6");
        assert_eq!(info["total_cluster_links_buffer_limit_exceeded"], "0");
        assert_eq!(info.len(), 6);
    }

    #[test]
    fn unexpected_replies_name_the_command_and_kind() {
        let e = unexpected("PING", &Reply::Integer(1));
        assert_eq!(e.to_string(), "unexpected reply: PING: Integer reply");
    }
}
