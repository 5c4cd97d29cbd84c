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
    /// one error. `channels` is 0 for an unsubscribe of everything, which ends at the
    /// confirmation after which no subscription of its kind is left (one per subscription,
    /// or one with a NULL channel when there was none); `seen` counts those arrived.
    PubSub {
        op: PubSubOp,
        channels: u64,
        seen: u64,
    },
    Monitor,
    Reset,
    /// HELLO: its reply's type says which protocol the connection speaks from then on (a
    /// map: RESP3, an array: RESP2, an error: unchanged).
    Hello,
    /// EXEC whose transaction holds topology commands, in order.
    Exec(Vec<Expect>),
}

impl Expect {
    /// Whether the reply must be captured whole and rewritten.
    pub fn is_topology(&self) -> bool {
        !matches!(
            self,
            Expect::Other | Expect::PubSub { .. } | Expect::Monitor | Expect::Reset | Expect::Hello
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
        if let Some(op) = PubSubOp::of(cmd.name()) {
            return Expect::PubSub {
                op,
                channels: cmd.argc.saturating_sub(1),
                seen: 0,
            };
        }
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
            b"monitor" => Expect::Monitor,
            b"reset" => Expect::Reset,
            b"hello" => Expect::Hello,
            _ => Expect::Other,
        }
    }
}

/// A pub/sub command, and the confirmations it gets (named alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PubSubOp {
    Subscribe,
    PSubscribe,
    SSubscribe,
    Unsubscribe,
    PUnsubscribe,
    SUnsubscribe,
}

impl PubSubOp {
    /// From a lowercase command or confirmation name.
    fn of(name: &[u8]) -> Option<PubSubOp> {
        Some(match name {
            b"subscribe" => PubSubOp::Subscribe,
            b"psubscribe" => PubSubOp::PSubscribe,
            b"ssubscribe" => PubSubOp::SSubscribe,
            b"unsubscribe" => PubSubOp::Unsubscribe,
            b"punsubscribe" => PubSubOp::PUnsubscribe,
            b"sunsubscribe" => PubSubOp::SUnsubscribe,
            _ => return None,
        })
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
    /// Subscriptions held, as the confirmations report them: a (un)subscribe or
    /// p(un)subscribe confirmation counts channels and patterns together, an
    /// s(un)subscribe one counts shard channels alone.
    channels: u64,
    patterns: u64,
    shard_channels: u64,
    monitor: bool,
    /// Whether the server speaks RESP3 (a HELLO 3 was answered with a map). In RESP3 only a
    /// push frame (`>`) is out of band: an array is a reply, whatever its first element.
    resp3: bool,
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
    ///
    /// A command changes how later replies pair (`CLIENT REPLY`, `MULTI`, `EXEC`,
    /// `DISCARD`) only when Valkey accepts it, which is decided here by Valkey's own syntax
    /// checks: the exact argument count (`MULTI x`, `CLIENT REPLY SKIP x` and `DISCARD x`
    /// are rejected with an error and change nothing, while `EXEC x` aborts the
    /// transaction), and `CLIENT REPLY` is refused inside a transaction (an error in place
    /// of `+QUEUED`, and EXEC then aborts).
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
        if name == b"client" && cmd.arg(1) == b"reply" && cmd.argc == 3 && !self.in_multi {
            match cmd.arg(2) {
                b"on" => {
                    self.reply_off = false;
                    self.skip_next = false;
                    self.push(Expect::Other);
                    return;
                }
                b"off" => {
                    self.reply_off = true;
                    return;
                }
                b"skip" => {
                    if !self.reply_off {
                        self.skip_next = true;
                    }
                    return;
                }
                // A syntax error: an error reply, like any other command's.
                _ => {}
            }
        }
        if self.reply_off || std::mem::take(&mut self.skip_next) {
            return;
        }
        let expect = Expect::of(cmd, self.rewrite_info);
        if self.in_multi {
            match name {
                b"exec" => {
                    // Even with the wrong arity, EXEC ends the transaction (with
                    // `-EXECABORT`).
                    self.in_multi = false;
                    let tx = std::mem::take(&mut self.transaction);
                    if cmd.argc == 1 && tx.iter().any(Expect::is_topology) {
                        self.push(Expect::Exec(tx));
                    } else {
                        self.push(Expect::Other);
                    }
                }
                b"discard" if cmd.argc == 1 => {
                    self.in_multi = false;
                    self.transaction.clear();
                    self.push(Expect::Other);
                }
                _ => {
                    // `+QUEUED` (or an error) now; the real reply comes inside EXEC's. A
                    // command refused here (an error) aborts the EXEC, so that the queued
                    // list only has to be right when every command was queued.
                    self.transaction.push(expect);
                    self.push(Expect::Other);
                }
            }
            return;
        }
        if name == b"multi" && cmd.argc == 1 {
            self.in_multi = true;
        }
        self.push(expect);
    }

    /// Whether the reply frame that starts with type byte `ty` must be captured whole: a
    /// topology reply, an error (MOVED/ASK), or an array that may be a RESP2 pub/sub frame.
    pub fn capture(&self, ty: u8) -> bool {
        if self.monitor {
            // An error answers a command sent while monitoring (a MOVED is rewritten); a
            // simple string is captured only to spot RESET's reply among the monitor lines.
            return ty == b'-'
                || (ty == b'+' && self.queue.iter().any(|(e, _)| *e == Expect::Reset));
        }
        let pubsub_front = matches!(self.front(), Some(Expect::PubSub { .. }));
        match ty {
            b'-' => true,
            // A push is out of band, but a subscribe waits for its confirmations in pushes.
            b'>' => pubsub_front,
            b'*' if !self.resp3 && (self.subscribed || pubsub_front) => true,
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
            self.reset_replies();
            return Answer::InBand(Expect::Reset);
        }
        let pubsub_front = matches!(self.front(), Some(Expect::PubSub { .. }));
        if ty == b'>' || (ty == b'*' && !self.resp3 && (self.subscribed || pubsub_front)) {
            match frame.and_then(pubsub_kind) {
                Some(PubSubKind::Confirmation(op, count)) => {
                    self.confirmed(op, count);
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
            Expect::Reset => self.reset_replies(),
            Expect::Hello if ty == b'%' => self.resp3 = true,
            Expect::Hello if ty == b'*' => self.resp3 = false,
            _ => {}
        }
        Answer::InBand(expect)
    }

    /// RESET's reply: no subscription, no MONITOR, RESP2.
    fn reset_replies(&mut self) {
        self.subscribed = false;
        self.monitor = false;
        self.resp3 = false;
        self.channels = 0;
        self.patterns = 0;
        self.shard_channels = 0;
    }

    /// A subscribe or unsubscribe confirmation arrived (`count`: subscriptions left, as
    /// Valkey counts them for `op`): it counts towards the command of the same name at the
    /// front, which ends with its last channel.
    fn confirmed(&mut self, op: PubSubOp, count: i64) {
        let count = u64::try_from(count).unwrap_or(0);
        let left = match op {
            PubSubOp::Subscribe | PubSubOp::Unsubscribe => {
                self.channels = count.saturating_sub(self.patterns);
                self.channels
            }
            PubSubOp::PSubscribe | PubSubOp::PUnsubscribe => {
                self.patterns = count.saturating_sub(self.channels);
                self.patterns
            }
            PubSubOp::SSubscribe | PubSubOp::SUnsubscribe => {
                self.shard_channels = count;
                count
            }
        };
        self.subscribed = self.channels + self.patterns + self.shard_channels > 0;
        let Some((
            Expect::PubSub {
                op: want,
                channels,
                seen,
            },
            n,
        )) = self.queue.front_mut()
        else {
            return; // Unasked (a slot moved away, say): nothing waits for it.
        };
        if *want != op {
            return; // Unasked too: an sunsubscribe when a slot moves away.
        }
        let (channels, seen) = (*channels, *seen + 1);
        let done = if channels == 0 {
            left == 0
        } else {
            seen >= channels
        };
        // The front entry may stand for several identical commands: split this one off.
        if *n > 1 {
            *n -= 1;
            if !done {
                self.queue
                    .push_front((Expect::PubSub { op, channels, seen }, 1));
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
    Confirmation(PubSubOp, i64),
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
        b"pong" => Some(PubSubKind::Pong),
        name => PubSubOp::of(name).map(|op| {
            PubSubKind::Confirmation(op, items.get(2).and_then(Frame::as_int).unwrap_or(0))
        }),
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
                    op: PubSubOp::SSubscribe,
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
                InBand(Expect::Hello),
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
    fn in_resp3_only_a_push_is_out_of_band() {
        let push = b">3\r\n$9\r\nsubscribe\r\n$2\r\nch\r\n:1\r\n";
        let message = b"*3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$1\r\nx\r\n";
        let got = pair(
            b"HELLO 3\r\nSUBSCRIBE ch\r\nLRANGE l 0 -1\r\nCLUSTER SLOTS\r\n",
            &[b"%0\r\n", push, message, b"*0\r\n"],
        );
        assert_eq!(
            got,
            [
                InBand(Expect::Hello),
                OutOfBand,
                InBand(Expect::Other),
                InBand(Expect::ClusterSlots)
            ]
        );
        // A HELLO 3 that failed leaves RESP2, where that array is a message; RESET goes
        // back to RESP2.
        let got = pair(
            b"HELLO 3 AUTH a b\r\nSUBSCRIBE ch\r\nCLUSTER SLOTS\r\n",
            &[
                b"-WRONGPASS x\r\n",
                &push.map(|b| if b == b'>' { b'*' } else { b }),
                message,
                b"*0\r\n",
            ],
        );
        assert_eq!(got[2..], [OutOfBand, InBand(Expect::ClusterSlots)]);
        let got = pair(
            b"HELLO 3\r\nRESET\r\nSUBSCRIBE ch\r\nCLUSTER SLOTS\r\n",
            &[
                b"%0\r\n",
                b"+RESET\r\n",
                &push.map(|b| if b == b'>' { b'*' } else { b }),
                message,
                b"*0\r\n",
            ],
        );
        assert_eq!(got[3..], [OutOfBand, InBand(Expect::ClusterSlots)]);
    }

    #[test]
    fn commands_valkey_rejects_change_no_state() {
        // Wrong arity: an error reply, and the next command is answered.
        for cmd in [
            &b"CLIENT REPLY SKIP x\r\n"[..],
            b"CLIENT REPLY OFF x\r\n",
            b"CLIENT REPLY\r\n",
            b"CLIENT REPLY FOO\r\n",
        ] {
            let mut requests = cmd.to_vec();
            requests.extend_from_slice(b"GET k\r\nPING\r\nCLUSTER NODES\r\n");
            let got = pair(
                &requests,
                &[b"-ERR x\r\n", b"$1\r\nv\r\n", b"+PONG\r\n", b"$0\r\n\r\n"],
            );
            assert_eq!(
                got[3],
                InBand(Expect::ClusterNodes),
                "{}",
                String::from_utf8_lossy(cmd)
            );
        }
        // `MULTI x` starts no transaction: CLUSTER SLOTS is answered at once.
        let got = pair(
            b"MULTI x\r\nCLUSTER SLOTS\r\nEXEC\r\n",
            &[b"-ERR x\r\n", b"*0\r\n", b"-ERR EXEC without MULTI\r\n"],
        );
        assert_eq!(got[1], InBand(Expect::ClusterSlots));
        // CLIENT REPLY inside MULTI is refused (and EXEC aborts); `DISCARD x` does not end
        // the transaction, `EXEC x` does (with -EXECABORT).
        let got = pair(
            b"MULTI\r\nCLUSTER NODES\r\nEXEC x\r\nCLUSTER SLOTS\r\n",
            &[b"+OK\r\n", b"+QUEUED\r\n", b"-EXECABORT x\r\n", b"*0\r\n"],
        );
        assert_eq!(got[3], InBand(Expect::ClusterSlots));
        let got = pair(
            b"MULTI\r\nCLIENT REPLY SKIP\r\nGET k\r\nDISCARD x\r\nEXEC\r\nCLUSTER SLOTS\r\n",
            &[
                b"+OK\r\n",
                b"-ERR no\r\n",
                b"+QUEUED\r\n",
                b"-ERR x\r\n",
                b"-EXECABORT x\r\n",
                b"*0\r\n",
            ],
        );
        assert_eq!(got[5], InBand(Expect::ClusterSlots));
        // Accepted forms still work.
        let got = pair(
            b"CLIENT REPLY SKIP\r\nGET k\r\nCLIENT REPLY OFF\r\nGET k\r\nCLIENT REPLY ON\r\nCLUSTER SLOTS\r\n",
            &[b"+OK\r\n", b"*0\r\n"],
        );
        assert_eq!(got, [InBand(Expect::Other), InBand(Expect::ClusterSlots)]);
    }

    #[test]
    fn unsubscribing_from_everything_counts_each_kind_apart() {
        let c = |kind: &str, ch: &str, n: u8| {
            format!(
                "*3\r\n${}\r\n{kind}\r\n${}\r\n{ch}\r\n:{n}\r\n",
                kind.len(),
                ch.len()
            )
            .into_bytes()
        };
        // The bytes Valkey 9 sends: subscribe counts channels and patterns together,
        // ssubscribe shard channels alone; an unsubscribe of everything with nothing of its
        // kind left answers once, with a NULL channel.
        let replies = [
            c("subscribe", "a", 1),
            c("subscribe", "b", 2),
            c("psubscribe", "p*", 3),
            c("ssubscribe", "s", 1),
            c("unsubscribe", "a", 2),
            c("unsubscribe", "b", 1),
            c("punsubscribe", "p*", 0),
            c("sunsubscribe", "s", 0),
            b"*3\r\n$11\r\nunsubscribe\r\n$-1\r\n:0\r\n".to_vec(),
            b"-MOVED 1 10.0.0.1:6379\r\n".to_vec(),
            b"*0\r\n".to_vec(),
        ];
        let replies: Vec<&[u8]> = replies.iter().map(Vec::as_slice).collect();
        let got = pair(
            b"SUBSCRIBE a b\r\nPSUBSCRIBE p*\r\nSSUBSCRIBE s\r\nUNSUBSCRIBE\r\nPUNSUBSCRIBE\r\nSUNSUBSCRIBE\r\nUNSUBSCRIBE\r\nGET k\r\nCLUSTER SLOTS\r\n",
            &replies,
        );
        assert!(got[..9].iter().all(|a| *a == OutOfBand), "{got:?}");
        assert_eq!(
            got[9..],
            [InBand(Expect::Other), InBand(Expect::ClusterSlots)]
        );
        // A message on a channel still held after the shard channels went is a message.
        let got = pair(
            b"SSUBSCRIBE s\r\nSUBSCRIBE a\r\nSUNSUBSCRIBE\r\nPING\r\n",
            &[
                &c("ssubscribe", "s", 1),
                &c("subscribe", "a", 1),
                &c("sunsubscribe", "s", 0),
                b"*3\r\n$7\r\nmessage\r\n$1\r\na\r\n$1\r\nx\r\n",
                b"*2\r\n$4\r\npong\r\n$0\r\n\r\n",
            ],
        );
        assert_eq!(got[3..], [OutOfBand, InBand(Expect::Other)]);
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
