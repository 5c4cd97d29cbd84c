//! Rewriting the topology that Valkey hands out, so that external clients are sent to the
//! proxy's ports instead of the nodes' internal addresses.
//!
//! Each rewriter works on a parsed [`Frame`] and changes only address-bearing leaves; a
//! reply that names no known node comes back unchanged. An address is rewritten whole (host
//! and port together) or not at all: an address the map does not know is reported, so the
//! caller can count it and refresh its route source, and is never half-rewritten.
//!
//! The special endpoints keep their meaning: a NULL endpoint (same host as dialled), `""`
//! (unknown) and `"?"` (hostname preferred but none set) stay as they are, with the port
//! rewritten, since a client pairs them with the host it dialled: the proxy.
//!
//! - [`addresses`]: the [`AddressMap`] (internal address or node id → external endpoint),
//!   built from a route table: the per-port map and the TLS port's SNI map.
//! - `redirect`: `-MOVED` and `-ASK`.
//! - `topology`: CLUSTER SLOTS and CLUSTER SHARDS (RESP2 and RESP3).
//! - `nodes`: CLUSTER NODES and CLUSTER REPLICAS text.
//! - `replication`: ROLE and INFO replication.
//! - [`stream`]: the two directions of a rewriting connection: the request side that pairs
//!   replies with commands, and the reply side that scans frames and rebuilds the
//!   topology ones.
//! - here: [`rewrite`] and [`rewrite_to_bytes`], which dispatch one reply to its rewriter.

pub mod addresses;
mod nodes;
mod redirect;
mod replication;
pub mod stream;
mod topology;

pub use addresses::AddressMap;

use crate::resp::frame::{encode, Frame};
use crate::resp::pairing::Expect;

/// What a rewrite did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Report {
    /// Addresses rewritten.
    pub rewritten: u32,
    /// The kind of each reply rewritten (`moved`, `ask`, `cluster_slots`, ...).
    pub kinds: Vec<&'static str>,
    /// Addresses the map did not know (left as they were), as `host:port` or node id.
    pub unknown: Vec<String>,
    /// Whether the route source should look again (a redirect was mapped by slot).
    pub refresh: bool,
    /// Replies paired with a topology command that did not have its exact shape, and so
    /// went out byte for byte: the reason of each (`not_cluster_nodes`, `exec_length`, ...).
    pub skipped: Vec<&'static str>,
}

impl Report {
    pub(crate) fn unknown(&mut self, what: impl Into<String>) {
        self.unknown.push(what.into());
    }
}

/// Rewrites one complete reply `frame` that answers `expect`. Returns the new bytes if
/// anything changed.
pub fn rewrite(
    map: &AddressMap,
    expect: &Expect,
    frame: &mut Frame<'_>,
    report: &mut Report,
) -> bool {
    let before = report.rewritten;
    rewrite_in_place(map, expect, frame, report);
    let changed = report.rewritten > before;
    if changed {
        let kind = match frame {
            Frame::Error(line) if line.starts_with(b"ASK") => "ask",
            Frame::Error(_) => "moved",
            _ => expect.label(),
        };
        report.kinds.push(kind);
    }
    changed
}

/// Like [`rewrite`], then encodes the frame if it changed. `size` is the frame's encoded
/// size, to allocate the output once.
pub fn rewrite_to_bytes(
    map: &AddressMap,
    expect: &Expect,
    mut frame: Frame<'_>,
    size: usize,
    report: &mut Report,
) -> Option<Vec<u8>> {
    // A redirect, the one frequent rewrite: written straight out, without a frame round trip.
    if let Frame::Error(line) = &frame {
        let mut out = Vec::with_capacity(line.len() + 40);
        out.push(b'-');
        if !redirect::rewrite(map, line, report, &mut out) {
            return None;
        }
        out.extend_from_slice(b"\r\n");
        report.kinds.push(if line.starts_with(b"ASK") {
            "ask"
        } else {
            "moved"
        });
        return Some(out);
    }
    if !rewrite(map, expect, &mut frame, report) {
        return None;
    }
    let mut out = Vec::with_capacity(size + size / 8 + 64);
    encode(&frame, &mut out);
    Some(out)
}

/// Whether `frame` has the exact shape of `expect`'s reply; else the reason it is not
/// rebuilt (a metric label). This is what keeps a value from being rewritten when a reply
/// is paired with the wrong command: a GET of a text that merely holds addresses is not a
/// CLUSTER NODES reply unless every line of it is a node line (NODES itself is checked as
/// it is rewritten, in one pass: [`nodes::nodes`]).
fn shape(expect: &Expect, frame: &Frame<'_>) -> Result<(), &'static str> {
    let ok = match expect {
        Expect::ClusterSlots => topology::is_slots(frame),
        Expect::ClusterShards => topology::is_shards(frame),
        Expect::ClusterReplicas => nodes::is_replicas(frame),
        Expect::Role => replication::is_role(frame),
        Expect::Info => replication::is_info(frame),
        Expect::Exec(kinds) => {
            return match frame {
                Frame::Array(b'*', items) if items.len() as u64 == exec_len(kinds) => Ok(()),
                // A transaction that a WATCH aborted: nothing to rewrite.
                Frame::Null(_) => Ok(()),
                _ => Err("exec_length"),
            };
        }
        _ => true,
    };
    if ok {
        return Ok(());
    }
    Err(match expect {
        Expect::ClusterSlots => "not_cluster_slots",
        Expect::ClusterShards => "not_cluster_shards",
        Expect::ClusterReplicas => "not_cluster_replicas",
        Expect::Role => "not_role",
        _ => "not_info",
    })
}

/// The number of replies in an EXEC's reply.
pub(crate) fn exec_len(kinds: &[(Expect, u64)]) -> u64 {
    kinds.iter().map(|(_, n)| n).sum()
}

/// What each reply in an EXEC's reply answers, in order.
fn exec_kinds(kinds: &[(Expect, u64)]) -> impl Iterator<Item = &Expect> {
    kinds
        .iter()
        .flat_map(|(e, n)| std::iter::repeat_n(e, usize::try_from(*n).unwrap_or(usize::MAX)))
}

fn rewrite_in_place(map: &AddressMap, expect: &Expect, frame: &mut Frame<'_>, report: &mut Report) {
    if let Frame::Error(line) = frame {
        let mut new = Vec::new();
        if redirect::rewrite(map, line, report, &mut new) {
            *line = new.into();
        }
        return;
    }
    if let Frame::Attribute(_, inner) = frame {
        return rewrite_in_place(map, expect, inner, report);
    }
    if let Expect::ClusterNodes = expect {
        // Its shape is checked line by line as it is rewritten.
        if nodes::nodes(map, frame, report).is_err() {
            report.skipped.push("not_cluster_nodes");
        }
        return;
    }
    if let Err(reason) = shape(expect, frame) {
        report.skipped.push(reason);
        return;
    }
    match expect {
        Expect::ClusterSlots => topology::slots(map, frame, report),
        Expect::ClusterShards => topology::shards(map, frame, report),
        // Rewritten above.
        Expect::ClusterNodes => {}
        Expect::ClusterReplicas => nodes::replicas(map, frame, report),
        Expect::Role => replication::role(map, frame, report),
        Expect::Info => replication::info(map, frame, report),
        Expect::Exec(kinds) => {
            if let Frame::Array(_, items) = frame {
                for (item, kind) in items.iter_mut().zip(exec_kinds(kinds)) {
                    rewrite_in_place(map, kind, item, report);
                }
            }
        }
        Expect::Other
        | Expect::PubSub { .. }
        | Expect::Monitor
        | Expect::Reset
        | Expect::SkippedReset
        | Expect::ExecProtocol(_)
        | Expect::Lost(_)
        | Expect::Hello
        | Expect::Multi
        | Expect::Queued
        | Expect::ClientReply => {}
    }
}
