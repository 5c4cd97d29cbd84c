//! The two directions of a rewriting connection.
//!
//! [`RequestSide`] watches the client's commands and records what each reply will be;
//! [`ReplySide`] walks the server's replies frame by frame. A reply that cannot carry an
//! address streams through untouched (its bytes are forwarded as they arrive, as ranges of
//! the read buffer); a topology reply or an error is captured whole, rewritten, and sent on.

use std::ops::Range;
use std::sync::Mutex;

use tokio::sync::Notify;

use super::{rewrite_to_bytes, AddressMap, Report};
use crate::resp::frame::parse;
use crate::resp::pairing::{Answer, Pairing};
use crate::resp::request::RequestScanner;
use crate::resp::{RespError, Scan, Scanner};

/// Limits of one rewriting connection.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// A captured reply (a topology reply) larger than this closes the connection.
    pub max_frame: usize,
    /// A header or simple line longer than this closes the connection.
    pub max_line: usize,
}

impl Default for Limits {
    fn default() -> Self {
        use shardgate_crds::settings::defaults;
        Limits {
            max_frame: defaults::MAX_FRAME,
            max_line: defaults::MAX_LINE,
        }
    }
}

/// State shared by the two directions of one connection.
pub struct Shared {
    pub pairing: Mutex<Pairing>,
    /// Woken when the reply side has taken expected replies off a long queue.
    room: Notify,
}

/// Queue entries (runs of like commands) that the request side may run ahead of the replies
/// before it stops reading from the client: bounds the memory of a client that pipelines
/// without reading. A million pipelined GETs are one entry.
pub const MAX_PENDING: usize = 64 * 1024;

impl Shared {
    pub fn new(rewrite_info: bool) -> Self {
        Shared {
            pairing: Mutex::new(Pairing::new(rewrite_info)),
            room: Notify::new(),
        }
    }

    /// Waits until the queue of expected replies is short enough to read more requests.
    pub async fn room_for_requests(&self) {
        loop {
            let notified = self.room.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.pairing().entries() < MAX_PENDING {
                return;
            }
            notified.await;
        }
    }

    fn pairing(&self) -> std::sync::MutexGuard<'_, Pairing> {
        // A panic while holding it would be a bug; the state is still usable.
        self.pairing.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Client → server.
pub struct RequestSide {
    scanner: RequestScanner,
}

impl RequestSide {
    pub fn new(limits: Limits) -> Self {
        RequestSide {
            scanner: RequestScanner::new(limits.max_line),
        }
    }

    /// Notes the commands in `buf` (which is then forwarded unchanged).
    pub fn observe(&mut self, buf: &[u8], shared: &Shared) -> Result<(), RespError> {
        let mut pairing = shared.pairing();
        self.scanner.feed(buf, |cmd| pairing.on_request(cmd))
    }
}

/// A piece of output: bytes of the input as they were, or rewritten bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    Input(Range<usize>),
    Owned(Vec<u8>),
}

/// Server → client.
pub struct ReplySide {
    scanner: Scanner,
    limits: Limits,
    /// The current frame's bytes, while it is captured.
    capture: Option<Vec<u8>>,
    ty: u8,
}

impl ReplySide {
    pub fn new(limits: Limits) -> Self {
        ReplySide {
            scanner: Scanner::new(limits.max_line),
            limits,
            capture: None,
            ty: 0,
        }
    }

    /// Processes `input`, appending what to send to `out`, and accounting in `report`.
    pub fn process(
        &mut self,
        input: &[u8],
        shared: &Shared,
        map: &AddressMap,
        out: &mut Vec<Segment>,
        report: &mut Report,
    ) -> Result<(), RespError> {
        let mut pairing = shared.pairing();
        // Start of the input range not yet emitted.
        let mut pending = 0;
        let mut i = 0;
        while i < input.len() {
            if !self.scanner.in_frame() {
                self.ty = input[i];
                if pairing.capture(self.ty) {
                    emit(out, pending..i);
                    pending = i;
                    self.capture = Some(Vec::new());
                }
            }
            let start = i;
            match self.scanner.scan(input, i)? {
                Scan::Complete { end } => {
                    i = end;
                    match self.capture.take() {
                        None => {
                            pairing.on_reply(self.ty, None);
                        }
                        Some(mut buf) => {
                            let whole: &[u8] = if buf.is_empty() {
                                // The limit holds for a frame that arrived in one read too.
                                if end - start > self.limits.max_frame {
                                    return Err(RespError::FrameTooLarge(self.limits.max_frame));
                                }
                                &input[start..end]
                            } else {
                                self.grow(&mut buf, &input[start..end])?;
                                &buf
                            };
                            let (frame, _) = parse(whole)?;
                            let answer = pairing.on_reply(self.ty, Some(&frame));
                            let expect = match answer {
                                Answer::InBand(e) => e,
                                Answer::OutOfBand => crate::resp::pairing::Expect::Other,
                            };
                            match rewrite_to_bytes(map, &expect, frame, whole.len(), report) {
                                Some(new) => out.push(Segment::Owned(new)),
                                None if buf.is_empty() => emit(out, start..end),
                                None => out.push(Segment::Owned(buf)),
                            }
                            pending = end;
                        }
                    }
                }
                Scan::Incomplete => {
                    i = input.len();
                    if let Some(mut buf) = self.capture.take() {
                        self.grow(&mut buf, &input[start..])?;
                        self.capture = Some(buf);
                        pending = i;
                    }
                }
            }
        }
        emit(out, pending..input.len());
        if pairing.entries() < MAX_PENDING / 2 {
            shared.room.notify_waiters();
        }
        Ok(())
    }

    fn grow(&self, buf: &mut Vec<u8>, more: &[u8]) -> Result<(), RespError> {
        if buf.len() + more.len() > self.limits.max_frame {
            return Err(RespError::FrameTooLarge(self.limits.max_frame));
        }
        buf.extend_from_slice(more);
        Ok(())
    }
}

/// Appends an input range, merging it with the previous one when they touch.
fn emit(out: &mut Vec<Segment>, r: Range<usize>) {
    if r.is_empty() {
        return;
    }
    if let Some(Segment::Input(prev)) = out.last_mut() {
        if prev.end == r.start {
            prev.end = r.end;
            return;
        }
    }
    out.push(Segment::Input(r));
}

/// Concatenates the output for `input` (tests and benchmarks).
#[cfg(any(test, feature = "test-util"))]
pub fn flatten(input: &[u8], segments: &[Segment]) -> Vec<u8> {
    let mut v = Vec::with_capacity(input.len());
    for s in segments {
        match s {
            Segment::Input(r) => v.extend_from_slice(&input[r.clone()]),
            Segment::Owned(b) => v.extend_from_slice(b),
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_client_far_ahead_of_its_replies_waits_for_them() {
        let shared = Shared::new(true);
        let mut requests = RequestSide::new(Limits::default());
        // Alternating commands cannot share queue entries.
        let n = MAX_PENDING / 2 + 1;
        requests
            .observe(&b"PING\r\nROLE\r\n".repeat(n), &shared)
            .unwrap();
        let wait = tokio::time::timeout(Duration::from_millis(50), shared.room_for_requests());
        assert!(
            wait.await.is_err(),
            "read on with {} entries queued",
            shared.pairing().entries()
        );

        let replies = b"+PONG\r\n*0\r\n".repeat(n);
        let mut side = ReplySide::new(Limits::default());
        let (mut out, mut report) = (vec![], Report::default());
        side.process(
            &replies,
            &shared,
            &AddressMap::default(),
            &mut out,
            &mut report,
        )
        .unwrap();
        let wait = tokio::time::timeout(Duration::from_secs(1), shared.room_for_requests());
        assert!(wait.await.is_ok());
        assert_eq!(shared.pairing().pending(), 0);
    }

    fn map() -> AddressMap {
        use crate::model::{Backend, Route, Routes};
        use shardgate_crds::NodeRef;
        use std::sync::Arc;
        let routes: Routes = (0..2u32)
            .map(|i| {
                let mut r = Route::new(
                    NodeRef::new(i, 0),
                    format!("10.0.0.{}:6379", i + 1).parse::<Backend>().unwrap(),
                );
                r.node_id = Some(format!("{i:040}"));
                (30000 + i as u16, Arc::new(r))
            })
            .collect();
        AddressMap::new("127.0.77.70", &routes)
    }

    /// Sends `requests`, then `replies` in one read; returns the output and the report.
    fn through(requests: &[u8], replies: &[u8]) -> (Vec<u8>, Report) {
        let shared = Shared::new(true);
        RequestSide::new(Limits::default())
            .observe(requests, &shared)
            .unwrap();
        let (mut out, mut report) = (vec![], Report::default());
        ReplySide::new(Limits::default())
            .process(replies, &shared, &map(), &mut out, &mut report)
            .unwrap();
        (flatten(replies, &out), report)
    }

    fn bulk(text: &[u8]) -> Vec<u8> {
        let mut v = format!("${}\r\n", text.len()).into_bytes();
        v.extend_from_slice(text);
        v.extend_from_slice(b"\r\n");
        v
    }

    #[test]
    fn a_reply_paired_with_a_topology_command_is_rebuilt_only_in_its_exact_shape() {
        let id = format!("{:040}", 0);
        let line = format!("{id} 10.0.0.1:6379@16379 myself,master - 0 0 1 connected 0-16383");
        // The real shape is rebuilt...
        let nodes = bulk(format!("{line}\n").as_bytes());
        let (out, report) = through(b"CLUSTER NODES\r\n", &nodes);
        assert!(String::from_utf8_lossy(&out).contains("127.0.77.70:30000@16379"));
        assert!(report.skipped.is_empty());

        // ... but values that only hold addresses go out byte for byte, counted: a node
        // line among other text, INFO-like text with no section header, a MOVED in a
        // string, arrays that are not CLUSTER SLOTS / SHARDS / ROLE.
        let cases: Vec<(&[u8], Vec<u8>, &str)> = vec![
            (
                b"CLUSTER NODES\r\n",
                bulk(format!("my note\n{line}\n").as_bytes()),
                "not_cluster_nodes",
            ),
            (
                b"CLUSTER NODES\r\n",
                bulk(line.as_bytes()),
                "not_cluster_nodes",
            ),
            (
                b"CLUSTER REPLICAS x\r\n",
                format!("*2\r\n{}$3\r\nabc\r\n", String::from_utf8(bulk(line.as_bytes())).unwrap())
                    .into_bytes(),
                "not_cluster_replicas",
            ),
            (
                b"INFO\r\n",
                bulk(b"master_host:10.0.0.1\r\nmaster_port:6379\r\n"),
                "not_info",
            ),
            (
                b"INFO\r\n",
                bulk(b"# Replication\r\nmaster_host:10.0.0.1\r\nmaster_port:6379\r\nMOVED 1 10.0.0.1:6379\r\n"),
                "not_info",
            ),
            (
                b"CLUSTER SLOTS\r\n",
                b"*1\r\n*3\r\n$1\r\n0\r\n$5\r\n16383\r\n*2\r\n$8\r\n10.0.0.1\r\n:6379\r\n".to_vec(),
                "not_cluster_slots",
            ),
            (
                b"CLUSTER SLOTS\r\n",
                bulk(b"MOVED 1 10.0.0.1:6379"),
                "not_cluster_slots",
            ),
            (
                b"CLUSTER SHARDS\r\n",
                b"*1\r\n*2\r\n$5\r\nnodes\r\n*1\r\n*4\r\n$2\r\nip\r\n$8\r\n10.0.0.1\r\n$4\r\nport\r\n:6379\r\n".to_vec(),
                "not_cluster_shards",
            ),
            (
                b"ROLE\r\n",
                b"*3\r\n$5\r\nslave\r\n$8\r\n10.0.0.1\r\n:6379\r\n".to_vec(),
                "not_role",
            ),
            (
                b"MULTI\r\nCLUSTER NODES\r\nEXEC\r\n",
                format!("+OK\r\n+QUEUED\r\n*2\r\n{}:1\r\n", String::from_utf8(nodes.clone()).unwrap()).into_bytes(),
                "exec_length",
            ),
        ];
        for (request, reply, reason) in cases {
            let (out, report) = through(request, &reply);
            assert_eq!(
                String::from_utf8_lossy(&out),
                String::from_utf8_lossy(&reply),
                "{reason}"
            );
            assert_eq!(report.skipped, [reason]);
            assert_eq!(report.rewritten, 0);
        }
        // A MOVED answering a command sent while monitoring is rewritten.
        let (out, _) = through(
            b"MONITOR\r\nGET k\r\n",
            b"+OK\r\n-MOVED 1 10.0.0.1:6379\r\n",
        );
        assert_eq!(out, b"+OK\r\n-MOVED 1 127.0.77.70:30000\r\n");
        // A MOVED with a slot out of range is not a redirect.
        let err = b"-MOVED 99999 10.0.0.1:6379\r\n";
        assert_eq!(through(b"GET k\r\n", err).0, err);
    }
}
