//! Which request each reply answers, so that only topology replies are rebuilt.
//!
//! The request side records, per command, what its reply will be ([`Expect`]); the reply
//! side takes one entry per in-band reply. What does not fit one-request-one-reply is
//! handled here:
//! - pipelining: the queue is run-length encoded, so a million pipelined GETs cost one entry;
//! - MULTI/EXEC: queued commands answer `+QUEUED`; EXEC's array carries their real replies;
//! - `CLIENT REPLY OFF|SKIP`: commands that get no reply at all;
//! - pub/sub: subscribe commands answer with zero or more confirmation frames (RESP2 arrays
//!   or RESP3 pushes), and messages arrive unasked; they are told apart by shape;
//! - RESP3 push frames (`>`: pub/sub, client-side-tracking invalidations) are out of band;
//! - MONITOR: after its `+OK`, everything is out of band until RESET.

use std::collections::VecDeque;

use super::frame::Frame;
use super::request::Command;

/// What a request's reply is, for rewriting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expect {
    Other,
    ClusterSlots,
    ClusterShards,
    ClusterNodes,
    /// CLUSTER REPLICAS / CLUSTER SLAVES.
    ClusterReplicas,
    Role,
    /// INFO with the replication section in it.
    Info,
    /// (P|S)(UN)SUBSCRIBE: one confirmation per channel (RESP2 arrays or RESP3 pushes), or
    /// one error. `channels` is 0 for an UNSUBSCRIBE of everything, which ends at the
    /// confirmation that reports no subscription left; `seen` counts those arrived.
    PubSub {
        channels: u64,
        seen: u64,
    },
    Monitor,
    Reset,
    /// EXEC whose transaction holds topology commands, in order.
    Exec(Vec<Expect>),
}

impl Expect {
    /// Whether the reply must be captured whole and rewritten.
    pub fn is_topology(&self) -> bool {
        !matches!(
            self,
            Expect::Other | Expect::PubSub { .. } | Expect::Monitor | Expect::Reset
        )
    }

    /// A metric label.
    pub fn label(&self) -> &'static str {
        match self {
            Expect::ClusterSlots => "cluster_slots",
            Expect::ClusterShards => "cluster_shards",
            Expect::ClusterNodes => "cluster_nodes",
            Expect::ClusterReplicas => "cluster_replicas",
            Expect::Role => "role",
            Expect::Info => "info",
            Expect::Exec(_) => "exec",
            _ => "other",
        }
    }

    /// What `cmd`'s reply is. `info` says whether INFO and ROLE are rewritten.
    pub fn of(cmd: &Command, info: bool) -> Expect {
        match cmd.name() {
            b"cluster" => match cmd.arg(1) {
                b"slots" => Expect::ClusterSlots,
                b"shards" => Expect::ClusterShards,
                b"nodes" => Expect::ClusterNodes,
                b"replicas" | b"slaves" => Expect::ClusterReplicas,
                _ => Expect::Other,
            },
            b"role" if info => Expect::Role,
            b"info" if info => {
                // INFO with no section, or naming one that includes replication.
                let sections = [cmd.arg(1), cmd.arg(2)];
                if cmd.argc == 1
                    || sections.iter().any(|s| {
                        matches!(*s, b"replication" | b"all" | b"everything" | b"default")
                    })
                    // More sections than we kept: rewrite to be safe (the rewrite checks shape).
                    || cmd.argc > 3
                {
                    Expect::Info
                } else {
                    Expect::Other
                }
            }
            b"subscribe" | b"psubscribe" | b"ssubscribe" | b"unsubscribe" | b"punsubscribe"
            | b"sunsubscribe" => Expect::PubSub {
                channels: cmd.argc.saturating_sub(1),
                seen: 0,
            },
            b"monitor" => Expect::Monitor,
            b"reset" => Expect::Reset,
            _ => Expect::Other,
        }
    }
}

/// How a complete reply frame was placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// It answers a request that expected this.
    InBand(Expect),
    /// Pushed by the server unasked (pub/sub message, confirmation, invalidation, MONITOR).
    OutOfBand,
}

/// The queue between the two directions of one connection.
#[derive(Debug, Default)]
pub struct Pairing {
    /// Expected replies, oldest first, run-length encoded.
    queue: VecDeque<(Expect, u64)>,
    /// Whether INFO and ROLE are rewritten.
    pub rewrite_info: bool,
    // Request side.
    in_multi: bool,
    transaction: Vec<Expect>,
    reply_off: bool,
    skip_next: bool,
    // Reply side.
    subscribed: bool,
    monitor: bool,
}

impl Pairing {
    pub fn new(rewrite_info: bool) -> Self {
        Pairing {
            rewrite_info,
            ..Pairing::default()
        }
    }

    fn push(&mut self, e: Expect) {
        if let Some((last, n)) = self.queue.back_mut() {
            if *last == e {
                *n += 1;
                return;
            }
        }
        self.queue.push_back((e, 1));
    }

    fn pop(&mut self) -> Option<Expect> {
        let (front, n) = self.queue.front_mut()?;
        if *n > 1 {
            *n -= 1;
            return Some(front.clone());
        }
        self.queue.pop_front().map(|(e, _)| e)
    }

    fn front(&self) -> Option<&Expect> {
        self.queue.front().map(|(e, _)| e)
    }

    /// Entries in the queue: runs of like commands (what costs memory).
    pub fn entries(&self) -> usize {
        self.queue.len()
    }

    /// Replies still expected.
    #[cfg(any(test, feature = "test-util"))]
    pub fn pending(&self) -> u64 {
        self.queue.iter().map(|(_, n)| n).sum()
    }

    /// Records a command the client sent.
    pub fn on_request(&mut self, cmd: &Command) {
        let name = cmd.name();
        if name == b"reset" {
            self.in_multi = false;
            self.transaction.clear();
            self.reply_off = false;
            self.skip_next = false;
            self.push(Expect::Reset);
            return;
        }
        if name == b"client" && cmd.arg(1) == b"reply" {
            match cmd.arg(2) {
                b"on" => {
                    self.reply_off = false;
                    self.skip_next = false;
                    self.push(Expect::Other);
                }
                b"off" => self.reply_off = true,
                b"skip" if !self.reply_off => self.skip_next = true,
                _ => {
                    if !self.reply_off && !std::mem::take(&mut self.skip_next) {
                        self.push(Expect::Other); // an error reply
                    }
                }
            }
            return;
        }
        if self.reply_off || std::mem::take(&mut self.skip_next) {
            return;
        }
        let expect = Expect::of(cmd, self.rewrite_info);
        if self.in_multi {
            match name {
                b"exec" => {
                    self.in_multi = false;
                    let tx = std::mem::take(&mut self.transaction);
                    if tx.iter().any(Expect::is_topology) {
                        self.push(Expect::Exec(tx));
                    } else {
                        self.push(Expect::Other);
                    }
                }
                b"discard" => {
                    self.in_multi = false;
                    self.transaction.clear();
                    self.push(Expect::Other);
                }
                _ => {
                    // `+QUEUED` (or an error) now; the real reply comes inside EXEC's.
                    self.transaction.push(expect);
                    self.push(Expect::Other);
                }
            }
            return;
        }
        if name == b"multi" {
            self.in_multi = true;
        }
        self.push(expect);
    }

    /// Whether the reply frame that starts with type byte `ty` must be captured whole: a
    /// topology reply, an error (MOVED/ASK), or an array that may be a RESP2 pub/sub frame.
    pub fn capture(&self, ty: u8) -> bool {
        if self.monitor {
            // Only to spot RESET's reply among the monitor lines.
            return ty == b'+' && self.queue.iter().any(|(e, _)| *e == Expect::Reset);
        }
        let pubsub_front = matches!(self.front(), Some(Expect::PubSub { .. }));
        match ty {
            b'-' => true,
            // A push is out of band, but a subscribe waits for its confirmations in pushes.
            b'>' => pubsub_front,
            b'*' if self.subscribed || pubsub_front => true,
            _ => self
                .queue
                .iter()
                .map(|(e, _)| e)
                .find(|e| !matches!(e, Expect::PubSub { .. }))
                .is_some_and(Expect::is_topology),
        }
    }

    /// Places one complete reply frame. `frame` is given when it was captured.
    pub fn on_reply(&mut self, ty: u8, frame: Option<&Frame<'_>>) -> Answer {
        if self.monitor {
            let reset = matches!(frame, Some(Frame::Simple(s)) if s.as_ref() == b"RESET");
            if !reset {
                return Answer::OutOfBand;
            }
            // Commands sent while monitoring got replies that were taken for monitor output;
            // RESET's reply ends all that.
            while let Some(e) = self.pop() {
                if e == Expect::Reset {
                    break;
                }
            }
            self.subscribed = false;
            self.monitor = false;
            return Answer::InBand(Expect::Reset);
        }
        let pubsub_front = matches!(self.front(), Some(Expect::PubSub { .. }));
        if ty == b'>' || (ty == b'*' && (self.subscribed || pubsub_front)) {
            match frame.and_then(pubsub_kind) {
                Some(PubSubKind::Confirmation(count)) => {
                    self.subscribed = count > 0;
                    self.confirmed(count);
                    return Answer::OutOfBand;
                }
                // PING's reply in RESP2 subscribed mode is in band.
                Some(PubSubKind::Pong) if ty == b'*' => {}
                _ if ty == b'>' => return Answer::OutOfBand,
                Some(PubSubKind::Message) => return Answer::OutOfBand,
                _ => {}
            }
        }
        if let Some(Expect::PubSub { seen: 0, .. }) = self.front() {
            if ty == b'-' {
                // One error answers a whole subscribe command.
                return Answer::InBand(self.pop().unwrap_or(Expect::Other));
            }
        }
        // An in-band reply: subscribe commands still ahead of it are over.
        while matches!(self.front(), Some(Expect::PubSub { .. })) {
            self.pop();
        }
        let expect = self.pop().unwrap_or(Expect::Other);
        match expect {
            Expect::Monitor if ty == b'+' => self.monitor = true,
            Expect::Reset => {
                self.subscribed = false;
                self.monitor = false;
            }
            _ => {}
        }
        Answer::InBand(expect)
    }

    /// A subscribe or unsubscribe confirmation arrived (`count`: subscriptions left): it
    /// counts towards the subscribe command at the front, which ends with its last channel.
    fn confirmed(&mut self, count: i64) {
        let Some((Expect::PubSub { channels, seen }, n)) = self.queue.front_mut() else {
            return; // Unasked (a slot moved away, say): nothing waits for it.
        };
        let (channels, seen) = (*channels, *seen + 1);
        let done = if channels == 0 {
            count <= 0
        } else {
            seen >= channels
        };
        // The front entry may stand for several identical commands: split this one off.
        if *n > 1 {
            *n -= 1;
            if !done {
                self.queue
                    .push_front((Expect::PubSub { channels, seen }, 1));
            }
        } else if done {
            self.queue.pop_front();
        } else if let Some((Expect::PubSub { seen: s, .. }, _)) = self.queue.front_mut() {
            *s = seen;
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PubSubKind {
    Message,
    /// A (un)subscribe confirmation, with the subscription count it reports.
    Confirmation(i64),
    /// PING's reply in subscribed mode: in band.
    Pong,
}

/// Whether a RESP2 array is a pub/sub frame, by its first element.
fn pubsub_kind(f: &Frame<'_>) -> Option<PubSubKind> {
    let Frame::Array(b'*' | b'>', items) = f else {
        return None;
    };
    let first = items.first()?.as_bytes()?;
    let name = first.to_ascii_lowercase();
    match name.as_slice() {
        b"message" | b"pmessage" | b"smessage" => Some(PubSubKind::Message),
        b"subscribe" | b"psubscribe" | b"ssubscribe" | b"unsubscribe" | b"punsubscribe"
        | b"sunsubscribe" => Some(PubSubKind::Confirmation(
            items.get(2).and_then(Frame::as_int).unwrap_or(0),
        )),
        b"pong" => Some(PubSubKind::Pong),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resp::frame::parse;
    use crate::resp::request::RequestScanner;

    /// Feeds the requests, then places each reply; returns the answers.
    fn pair(requests: &[u8], replies: &[&[u8]]) -> Vec<Answer> {
        let mut p = Pairing::new(true);
        let mut s = RequestScanner::default();
        s.feed(requests, |c| p.on_request(c)).unwrap();
        replies
            .iter()
            .map(|r| {
                let ty = r[0];
                let frame = parse(r).unwrap().0;
                let captured = p.capture(ty);
                p.on_reply(ty, captured.then_some(&frame))
            })
            .collect()
    }

    use Answer::{InBand, OutOfBand};

    #[test]
    fn pipelined_commands() {
        let got = pair(
            b"GET a\r\nCLUSTER SLOTS\r\nGET b\r\ncluster nodes\r\nROLE\r\nINFO server\r\nINFO\r\n",
            &[
                b"$1\r\nx\r\n",
                b"*0\r\n",
                b"$-1\r\n",
                b"$0\r\n\r\n",
                b"*0\r\n",
                b"$0\r\n\r\n",
                b"$0\r\n\r\n",
            ],
        );
        assert_eq!(
            got,
            vec![
                InBand(Expect::Other),
                InBand(Expect::ClusterSlots),
                InBand(Expect::Other),
                InBand(Expect::ClusterNodes),
                InBand(Expect::Role),
                InBand(Expect::Other),
                InBand(Expect::Info),
            ]
        );
    }

    #[test]
    fn transactions() {
        let got = pair(
            b"MULTI\r\nGET a\r\nCLUSTER SHARDS\r\nEXEC\r\nMULTI\r\nGET a\r\nEXEC\r\nCLUSTER SLOTS\r\n",
            &[b"+OK\r\n", b"+QUEUED\r\n", b"+QUEUED\r\n", b"*2\r\n$-1\r\n*0\r\n", b"+OK\r\n", b"-MOVED 1 a:1\r\n", b"-EXECABORT x\r\n", b"*0\r\n"],
        );
        assert_eq!(
            got[3],
            InBand(Expect::Exec(vec![Expect::Other, Expect::ClusterShards]))
        );
        assert_eq!(got[6], InBand(Expect::Other));
        assert_eq!(got[7], InBand(Expect::ClusterSlots));
    }

    #[test]
    fn client_reply_off_and_skip() {
        let got = pair(
            b"CLIENT REPLY SKIP\r\nGET a\r\nCLUSTER SLOTS\r\nCLIENT REPLY OFF\r\nGET b\r\nCLUSTER NODES\r\nCLIENT REPLY ON\r\nROLE\r\n",
            &[b"*0\r\n", b"+OK\r\n", b"*0\r\n"],
        );
        assert_eq!(
            got,
            vec![
                InBand(Expect::ClusterSlots),
                InBand(Expect::Other),
                InBand(Expect::Role)
            ]
        );
    }

    #[test]
    fn resp2_pubsub_messages_are_out_of_band() {
        let got = pair(
            b"SUBSCRIBE a b\r\nPING\r\nUNSUBSCRIBE\r\nCLUSTER SLOTS\r\n",
            &[
                b"*3\r\n$9\r\nsubscribe\r\n$1\r\na\r\n:1\r\n",
                b"*3\r\n$9\r\nsubscribe\r\n$1\r\nb\r\n:2\r\n",
                b"*3\r\n$7\r\nmessage\r\n$1\r\na\r\n$5\r\nhello\r\n",
                b"*2\r\n$4\r\npong\r\n$0\r\n\r\n",
                b"*3\r\n$11\r\nunsubscribe\r\n$1\r\na\r\n:1\r\n",
                b"*3\r\n$11\r\nunsubscribe\r\n$1\r\nb\r\n:0\r\n",
                b"*0\r\n",
            ],
        );
        assert_eq!(
            got,
            vec![
                OutOfBand,
                OutOfBand,
                OutOfBand,
                InBand(Expect::Other),
                OutOfBand,
                OutOfBand,
                InBand(Expect::ClusterSlots)
            ]
        );
    }

    #[test]
    fn a_subscribe_error_answers_the_whole_command() {
        // SSUBSCRIBE to a foreign slot: one -MOVED, in band.
        let got = pair(
            b"SSUBSCRIBE foo\r\nCLUSTER SLOTS\r\n",
            &[b"-MOVED 12182 127.0.10.3:6379\r\n", b"*0\r\n"],
        );
        assert_eq!(
            got,
            vec![
                InBand(Expect::PubSub {
                    channels: 1,
                    seen: 0
                }),
                InBand(Expect::ClusterSlots)
            ]
        );
    }

    #[test]
    fn resp3_pushes_and_monitor() {
        let got = pair(
            b"HELLO 3\r\nSUBSCRIBE a\r\nCLUSTER SLOTS\r\n",
            &[
                b"%0\r\n",
                b">3\r\n$9\r\nsubscribe\r\n$1\r\na\r\n:1\r\n",
                b">3\r\n$7\r\nmessage\r\n$1\r\na\r\n$1\r\nx\r\n",
                b"*0\r\n",
            ],
        );
        assert_eq!(
            got,
            vec![
                InBand(Expect::Other),
                OutOfBand,
                OutOfBand,
                InBand(Expect::ClusterSlots)
            ]
        );
        let got = pair(
            b"MONITOR\r\nRESET\r\nCLUSTER SLOTS\r\n",
            &[b"+OK\r\n", b"+1 \"get\"\r\n", b"+RESET\r\n", b"*0\r\n"],
        );
        assert_eq!(
            got,
            vec![
                InBand(Expect::Monitor),
                OutOfBand,
                InBand(Expect::Reset),
                InBand(Expect::ClusterSlots)
            ]
        );
    }

    #[test]
    fn confirmations_end_their_subscribe_so_later_errors_stay_in_step() {
        // Found in review: the subscribe's entry stayed, and the next error was taken for its.
        let confirm = |kind: &str, ch: &str, n: u8| {
            format!(
                "*3\r\n${}\r\n{kind}\r\n${}\r\n{ch}\r\n:{n}\r\n",
                kind.len(),
                ch.len()
            )
            .into_bytes()
        };
        let push = |kind: &str, ch: &str, n: u8| {
            let mut b = confirm(kind, ch, n);
            b[0] = b'>';
            b
        };
        let (s1, u0) = (confirm("subscribe", "a", 1), confirm("unsubscribe", "a", 0));
        let got = pair(
            b"SUBSCRIBE a\r\nUNSUBSCRIBE a\r\nEVALSHA x 0\r\nCLUSTER SLOTS\r\n",
            &[&s1, &u0, b"-NOSCRIPT No matching script\r\n", b"*0\r\n"],
        );
        assert_eq!(
            got[2..],
            [InBand(Expect::Other), InBand(Expect::ClusterSlots)]
        );
        // Data that looks like a message, after the last unsubscribe, is data.
        let got = pair(
            b"SUBSCRIBE a\r\nUNSUBSCRIBE a\r\nLRANGE l 0 -1\r\nCLUSTER SLOTS\r\n",
            &[
                &s1,
                &u0,
                b"*3\r\n$7\r\nmessage\r\n$1\r\nx\r\n$1\r\ny\r\n",
                b"*0\r\n",
            ],
        );
        assert_eq!(
            got,
            [
                OutOfBand,
                OutOfBand,
                InBand(Expect::Other),
                InBand(Expect::ClusterSlots)
            ]
        );
        // RESP3: confirmations are pushes.
        let got = pair(
            b"HELLO 3\r\nSUBSCRIBE ch\r\nGET k\r\nCLUSTER SLOTS\r\n",
            &[
                b"%0\r\n",
                &push("subscribe", "ch", 1),
                b"-WRONGTYPE x\r\n",
                b"*0\r\n",
            ],
        );
        assert_eq!(
            got[2..],
            [InBand(Expect::Other), InBand(Expect::ClusterSlots)]
        );
        // Unsubscribing from everything ends at the count of 0; identical pipelined
        // subscribes each take their own confirmation.
        let (s2, u1) = (confirm("subscribe", "b", 2), confirm("unsubscribe", "a", 1));
        let u0b = confirm("unsubscribe", "b", 0);
        let got = pair(
            b"SUBSCRIBE a\r\nSUBSCRIBE b\r\nUNSUBSCRIBE\r\nCLUSTER SLOTS\r\n",
            &[&s1, &s2, &u1, &u0b, b"*0\r\n"],
        );
        assert_eq!(got[4], InBand(Expect::ClusterSlots));
        let got = pair(
            b"SUBSCRIBE a\r\nSUBSCRIBE a\r\nROLE\r\n",
            &[&s1, &s1, b"*0\r\n"],
        );
        assert_eq!(got[2], InBand(Expect::Role));
    }

    #[test]
    fn replies_given_while_monitoring_do_not_trap_the_connection() {
        let got = pair(
            b"MONITOR\r\nGET a\r\nRESET\r\nCLUSTER SLOTS\r\n",
            &[
                b"+OK\r\n",
                b"+1 \"get\" \"a\"\r\n",
                b"$-1\r\n",
                b"+RESET\r\n",
                b"*0\r\n",
            ],
        );
        assert_eq!(
            got[3..],
            [InBand(Expect::Reset), InBand(Expect::ClusterSlots)]
        );
    }

    #[test]
    fn a_million_pipelined_gets_take_one_entry() {
        let mut p = Pairing::new(true);
        let mut s = RequestScanner::default();
        let req = b"*2\r\n$3\r\nGET\r\n$1\r\na\r\n".repeat(1_000_000);
        s.feed(&req, |c| p.on_request(c)).unwrap();
        assert_eq!(p.pending(), 1_000_000);
        assert_eq!(p.queue.len(), 1);
    }
}
