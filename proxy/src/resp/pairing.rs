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
use super::request::{Command, Commands};

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
    /// `quiet`: sent with replies off or skipped, when an error is not sent (only the
    /// confirmations are).
    PubSub {
        op: PubSubOp,
        channels: u64,
        seen: u64,
        quiet: bool,
    },
    Monitor,
    Reset,
    /// RESET after `CLIENT REPLY SKIP`: no reply, but its effect (no subscription, no
    /// MONITOR, RESP2) starts where its reply would have been. Never answers a reply: it
    /// is taken off once it is at the front.
    SkippedReset,
    /// `HELLO 2` or `HELLO 3` queued in a transaction: no reply of its own (it is inside
    /// EXEC's), but when EXEC's reply just placed is an array (the transaction ran), the
    /// connection speaks RESP3 (`true`) or RESP2 from then on. Taken off at the front.
    ExecProtocol(bool),
    /// HELLO: its reply's type says which protocol the connection speaks from then on (a
    /// map: RESP3, an array: RESP2, an error: unchanged).
    Hello,
    /// MULTI, taken as started when sent: an error in its place (an ACL rule, a missing
    /// AUTH) says that it did not start, and the commands sent after it run one by one.
    Multi,
    /// `CLIENT REPLY OFF` or `SKIP` sent with its own reply due: accepted, it has none
    /// (the commands behind it are taken as unanswered); refused (an ACL rule, a missing
    /// AUTH), an error comes in its place, and they were answered after all. Looked past by
    /// every rule but the placing of an in-band reply, which settles it: that error gives
    /// the connection up, anything else says it was accepted.
    ClientReply,
    /// A command queued in a transaction: `+QUEUED`, or an error (then EXEC aborts). Any
    /// other reply says that the transaction never started (a MULTI refused with its
    /// reply skipped): the command ran, and the pairing gives up before its reply goes out.
    Queued,
    /// EXEC whose transaction holds topology commands: what each queued command's reply
    /// is, in order, run-length encoded (every command that is not topology is `Other`, so
    /// a transaction of a million GETs and one CLUSTER SLOTS is two runs).
    Exec(Vec<(Expect, u64)>),
    /// A command after which replies can no longer be paired with requests: the reply side
    /// closes the connection when it gets there.
    Lost(Lost),
}

/// Why a connection's replies can no longer be paired with its requests. The connection is
/// closed at that point with an error line and this reason, never paired by guess.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lost {
    /// An in-band reply came with no request waiting for one.
    UnpairedReply,
    /// EXEC of a transaction with a subscribe command in it: its confirmations spill out of
    /// EXEC's array, and the connection is subscribed after it.
    SubscribeInTransaction,
    /// HELLO with options queued in a transaction: whether it switches the protocol depends
    /// on options (AUTH) whose outcome is not in EXEC's reply in a form followed here.
    HelloInTransaction,
    /// HELLO or MONITOR with replies off or skipped, or RESET skipped on a monitoring
    /// connection: the switch has no reply to confirm it.
    SwitchWithoutReply,
    /// CLIENT REPLY or MULTI on a RESP2 subscribed connection: Valkey refuses them there,
    /// which the request side cannot know in time.
    SubscribedResp2,
    /// EXEC on a monitoring connection: Valkey feeds the monitor line of each command it
    /// runs into the connection's output amid EXEC's array, which is then no RESP array.
    /// Told from the requests alone, so it errs on the safe side: a MONITOR still due that
    /// Valkey will refuse, or an EXEC that aborts, closes the connection all the same.
    TransactionWhileMonitoring,
    /// A subscribe command right behind one sent with replies off or skipped: Valkey may
    /// have refused that one without a word (a shard channel whose slot another node
    /// serves, a channel its ACL user may not use), and then the confirmations that come
    /// could be either's, which nothing followed here tells apart.
    SubscribeAfterQuietSubscribe,
    /// `CLIENT REPLY OFF` or `SKIP` refused (an ACL rule, a missing AUTH): the commands
    /// behind it were taken as unanswered.
    ClientReplyRefused,
    /// MULTI refused (an ACL rule, a missing AUTH) with commands already sent behind it, or
    /// with its reply skipped (seen when a queued command's reply is not `+QUEUED`): they
    /// were taken as queued, and run one by one instead (a subscribe, a CLIENT REPLY,
    /// another MULTI would then change what later replies are).
    MultiRefused,
}

impl Lost {
    /// Why, for logs and the client's error line.
    pub fn describe(self) -> &'static str {
        match self {
            Lost::UnpairedReply => "a reply came that no command was waiting for",
            Lost::SubscribeInTransaction => "a subscribe command inside MULTI",
            Lost::HelloInTransaction => "HELLO with options inside MULTI",
            Lost::SwitchWithoutReply => {
                "HELLO or MONITOR sent with CLIENT REPLY OFF or SKIP, or RESET skipped while monitoring"
            }
            Lost::SubscribedResp2 => "CLIENT REPLY or MULTI on a subscribed RESP2 connection",
            Lost::TransactionWhileMonitoring => "EXEC of a transaction on a monitoring connection",
            Lost::SubscribeAfterQuietSubscribe => {
                "a subscribe command right behind one sent with CLIENT REPLY OFF or SKIP"
            }
            Lost::MultiRefused => "MULTI refused, with commands sent behind it as if queued",
            Lost::ClientReplyRefused => {
                "CLIENT REPLY OFF or SKIP refused, with commands sent behind it as if unanswered"
            }
        }
    }
}

impl Expect {
    /// Whether the reply must be captured whole and rewritten.
    pub fn is_topology(&self) -> bool {
        !matches!(
            self,
            Expect::Other
                | Expect::PubSub { .. }
                | Expect::Monitor
                | Expect::Reset
                | Expect::SkippedReset
                | Expect::ExecProtocol(_)
                | Expect::Hello
                | Expect::Multi
                | Expect::Queued
                | Expect::ClientReply
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
                quiet: false,
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
            b"monitor" if cmd.argc == 1 => Expect::Monitor,
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
    fn unsubscribes(self) -> bool {
        matches!(
            self,
            PubSubOp::Unsubscribe | PubSubOp::PUnsubscribe | PubSubOp::SUnsubscribe
        )
    }

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

/// Runs (of topology and other commands) that one transaction may queue before its EXEC's
/// reply is no longer rewritten; counted in [`Pairing::entries`] too.
pub const MAX_TRANSACTION_RUNS: usize = 16 * 1024;

/// The queue between the two directions of one connection.
// `repr(C)`: the queue and the flags that every read looks at first, so that with the
// lock before them they take one cache line (`rewrite::stream::Rewriting`).
#[derive(Debug, Default)]
#[repr(C)]
pub struct Pairing {
    /// Expected replies, oldest first, run-length encoded.
    queue: VecDeque<(Expect, u64)>,
    // Read on every read, by one side or the other.
    /// The pairing found a reply it cannot place.
    lost: Option<Lost>,
    in_multi: bool,
    reply_off: bool,
    skip_next: bool,
    subscribed: bool,
    monitor: bool,
    /// Whether the server speaks RESP3 (a HELLO 3 was answered with a map). In RESP3 only a
    /// push frame (`>`) is out of band: an array is a reply, whatever its first element.
    resp3: bool,
    /// Every reply placed by the general rules, without the shortcut for a run of plain
    /// commands: only in the test that holds the two to each other.
    general_only: bool,
    // The rest.
    /// Whether INFO and ROLE are rewritten.
    pub rewrite_info: bool,
    /// The transaction had more than [`MAX_TRANSACTION_RUNS`] runs: it is no longer
    /// recorded, and its EXEC's reply goes out as it comes.
    transaction_overflow: bool,
    /// The protocol the last `HELLO 2|3` queued in the transaction switches to.
    transaction_protocol: Option<bool>,
    /// The transaction being queued cannot be followed past its EXEC.
    transaction_lost: Option<Lost>,
    /// The status line being placed is not a monitor line, whatever `monitor` says (a long
    /// one, told by its first bytes).
    status_in_band: bool,
    /// Whether any command was seen (an error before that is Valkey's own refusal of the
    /// connection, such as `max number of clients reached`).
    requested: bool,
    /// The client sent input Valkey rejects with a protocol error: Valkey answers it and
    /// closes, with no command to pair that answer with.
    rejected: bool,
    /// The commands queued in the transaction, as [`Expect::Exec`] holds them (none unless
    /// `in_multi`). Boxed: few connections queue one, and inline it would take the shared
    /// state past two cache lines, 64 bytes more per idle connection (8 bytes against a
    /// `Vec`'s 24, hence the box clippy warns of).
    #[allow(clippy::box_collection)]
    transaction: Option<Box<Vec<(Expect, u64)>>>,
    /// Subscriptions held, as the confirmations report them: a (un)subscribe or
    /// p(un)subscribe confirmation counts channels and patterns together, an
    /// s(un)subscribe one counts shard channels alone.
    channels: u64,
    patterns: u64,
    shard_channels: u64,
}

impl Pairing {
    /// Where the fields that every read looks at end (see the layout above).
    #[cfg(test)]
    pub(crate) const HOT_END: usize = std::mem::offset_of!(Pairing, general_only) + 1;

    pub fn new(rewrite_info: bool) -> Self {
        Pairing {
            rewrite_info,
            // Room for one run, as idle and pipeline-1 connections need (VecDeque's first
            // push would take four: 128 bytes more per idle connection, in thousands).
            queue: VecDeque::with_capacity(1),
            ..Pairing::default()
        }
    }

    fn push(&mut self, e: Expect) {
        self.push_n(e, 1);
    }

    /// `n` replies of the same expectation, joined to the run at the back if it is one.
    #[inline]
    fn push_n(&mut self, e: Expect, n: u64) {
        if let Some((last, run)) = self.queue.back_mut() {
            // The common case, without the general comparison of two `Expect`s.
            if matches!((&e, &*last), (Expect::Other, Expect::Other)) || *last == e {
                *run += n;
                return;
            }
        }
        self.queue.push_back((e, n));
    }

    /// Where the front entry is: the first that is not a [`Expect::ClientReply`], which
    /// every rule looks past but the placing of an in-band reply
    /// ([`Pairing::settle_client_reply`]).
    fn first(&self) -> usize {
        match self.queue.front() {
            Some((Expect::ClientReply, _)) => self
                .queue
                .iter()
                .position(|(e, _)| !matches!(e, Expect::ClientReply))
                .unwrap_or(self.queue.len()),
            _ => 0,
        }
    }

    fn pop(&mut self) -> Option<Expect> {
        let i = self.first();
        let (front, n) = self.queue.get_mut(i)?;
        if *n > 1 {
            *n -= 1;
            return Some(front.clone());
        }
        self.queue.remove(i).map(|(e, _)| e)
    }

    fn front(&self) -> Option<&Expect> {
        match self.queue.front() {
            Some((Expect::ClientReply, _)) => self.queue.get(self.first()).map(|(e, _)| e),
            front => front.map(|(e, _)| e),
        }
    }

    /// An in-band reply is being placed behind `CLIENT REPLY OFF|SKIP` entries: it is
    /// their refusal (an error that says so: the connection is given up), or they were
    /// accepted and go. (Had one been refused, its error would have come first: Valkey
    /// runs commands in order.)
    fn settle_client_reply(&mut self, ty: u8, frame: Option<&Frame<'_>>) -> Option<Lost> {
        if !matches!(self.queue.front(), Some((Expect::ClientReply, _))) {
            return None;
        }
        // An error too long to hold (`None`) may be one as well.
        let refusal = ty == b'-'
            && match frame {
                Some(Frame::Error(e)) => refuses_client_reply(e),
                _ => true,
            };
        if refusal {
            return Some(Lost::ClientReplyRefused);
        }
        while matches!(self.queue.front(), Some((Expect::ClientReply, _))) {
            self.queue.pop_front();
        }
        None
    }

    /// Entries in the queue and in the transaction being queued: runs of like commands
    /// (what costs memory).
    #[inline]
    pub fn entries(&self) -> usize {
        // The transaction is looked at only in one: its vector is off the hot cache line.
        debug_assert!(self.in_multi || self.transaction_len() == 0);
        self.queue.len()
            + if self.in_multi {
                self.transaction_len()
            } else {
                0
            }
    }

    fn transaction_len(&self) -> usize {
        self.transaction.as_ref().map_or(0, |t| t.len())
    }

    /// Notes one command queued in the transaction (`expect`: its reply inside EXEC's).
    fn queue_in_transaction(&mut self, expect: Expect) {
        if self.transaction_overflow {
            return;
        }
        let expect = if expect.is_topology() {
            expect
        } else {
            Expect::Other
        };
        let transaction = self.transaction.get_or_insert_default();
        if let Some((last, n)) = transaction.last_mut() {
            if *last == expect {
                *n += 1;
                return;
            }
        }
        if transaction.len() >= MAX_TRANSACTION_RUNS {
            // Waiting for room cannot help here (only EXEC empties it): give up on this
            // transaction's rewriting rather than on the connection.
            self.transaction_overflow = true;
            self.transaction = None;
            return;
        }
        transaction.push((expect, 1));
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
        if cmd.argc == 0 {
            // An empty command: no reply, but it takes the place of the one skipped.
            self.skip_next = false;
            return;
        }
        self.requested = true;
        let name = cmd.name();
        if name == b"reset" {
            // Replies off do not silence RESET's (it turns them on first); a skip does.
            let skipped = std::mem::take(&mut self.skip_next) && !self.reply_off;
            if skipped && self.monitoring_when_due() {
                // Monitoring ends where RESET runs, but the monitor lines of the commands
                // before it (CLIENT REPLY SKIP's own, at least) may come after the last
                // reply, and no reply of RESET's marks where they stop.
                self.push(Expect::Lost(Lost::SwitchWithoutReply));
                return;
            }
            self.end_transaction();
            self.reply_off = false;
            if skipped {
                self.push(Expect::SkippedReset);
                self.drop_unanswered();
            } else {
                self.push(Expect::Reset);
            }
            return;
        }
        let client_reply = name == b"client" && cmd.arg(1) == b"reply";
        if (client_reply || name == b"multi") && !self.resp3_for_sure() && self.maybe_subscribed() {
            // Refused in RESP2 subscribed mode, and whether that is the mode when Valkey
            // reads this is not known yet.
            self.push(Expect::Lost(Lost::SubscribedResp2));
            return;
        }
        if client_reply && cmd.argc == 3 && !self.in_multi {
            match cmd.arg(2) {
                b"on" => {
                    self.reply_off = false;
                    self.skip_next = false;
                    self.push(Expect::Other);
                    return;
                }
                b"off" => {
                    // Its own reply is due unless skipped: no reply if accepted, an error
                    // if refused.
                    if !self.reply_off && !self.skip_next {
                        self.push(Expect::ClientReply);
                    }
                    self.reply_off = true;
                    return;
                }
                b"skip" => {
                    if !self.reply_off {
                        if !self.skip_next {
                            self.push(Expect::ClientReply);
                        }
                        self.skip_next = true;
                    }
                    return;
                }
                // A syntax error: an error reply, like any other command's.
                _ => {}
            }
        }
        if self.reply_off || std::mem::take(&mut self.skip_next) {
            if (name == b"hello" && cmd.argc >= 2) || name == b"monitor" {
                self.push(Expect::Lost(Lost::SwitchWithoutReply));
                return;
            }
            // The command runs all the same: a transaction it starts or ends is followed
            // (a MULTI whose `+OK` was skipped still has the next commands `+QUEUED`).
            if self.in_multi {
                self.quiet_in_transaction(cmd);
                return;
            }
            if name == b"multi" && cmd.argc == 1 {
                self.in_multi = true;
                return;
            }
            // No reply, but (un)subscribe confirmations are pushed all the same (an error is
            // not): they are expected as usual, unless the command is one Valkey rejects
            // for its arity.
            if let Some(op) = PubSubOp::of(name) {
                if !self.in_multi && (cmd.argc > 1 || op.unsubscribes()) {
                    self.push_pubsub(Expect::PubSub {
                        op,
                        channels: cmd.argc - 1,
                        seen: 0,
                        quiet: true,
                    });
                }
            }
            return;
        }
        let expect = Expect::of(cmd, self.rewrite_info);
        if self.in_multi {
            match name {
                b"exec" => {
                    // Even with the wrong arity, EXEC ends the transaction (with
                    // `-EXECABORT`).
                    self.in_multi = false;
                    let tx = self.transaction.take().map_or_else(Vec::new, |t| *t);
                    let overflow = std::mem::take(&mut self.transaction_overflow);
                    if self.monitoring_when_due() && (!tx.is_empty() || overflow) {
                        self.transaction_lost = Some(Lost::TransactionWhileMonitoring);
                    }
                    if let Some(lost) = self.transaction_lost.take() {
                        if cmd.argc == 1 {
                            self.transaction_protocol = None;
                            self.push(Expect::Lost(lost));
                            return;
                        }
                    }
                    if cmd.argc == 1 && !overflow && tx.iter().any(|(e, _)| e.is_topology()) {
                        self.push(Expect::Exec(tx));
                    } else {
                        self.push(Expect::Other);
                    }
                    if let Some(resp3) = self.transaction_protocol.take() {
                        if cmd.argc == 1 {
                            self.push(Expect::ExecProtocol(resp3));
                        }
                    }
                }
                b"discard" if cmd.argc == 1 => {
                    self.end_transaction();
                    self.push(Expect::Other);
                }
                _ => {
                    // A HELLO whose syntax makes it succeed switches the protocol when the
                    // transaction runs (Valkey's check: exactly `2` or `3`, no options).
                    if PubSubOp::of(name).is_some() {
                        self.transaction_lost = Some(Lost::SubscribeInTransaction);
                    }
                    if name == b"hello" && cmd.argc > 2 && matches!(cmd.arg(1), b"2" | b"3") {
                        self.transaction_lost = Some(Lost::HelloInTransaction);
                    }
                    if name == b"hello" && cmd.argc == 2 {
                        match cmd.arg(1) {
                            b"2" => self.transaction_protocol = Some(false),
                            b"3" => self.transaction_protocol = Some(true),
                            _ => {}
                        }
                    }
                    // `+QUEUED` (or an error) now; the real reply comes inside EXEC's. A
                    // command refused here (an error) aborts the EXEC, so that the queued
                    // list only has to be right when every command was queued.
                    self.queue_in_transaction(expect);
                    // QUIT is not queued: Valkey answers `+OK` and closes.
                    self.push(if name == b"quit" {
                        Expect::Other
                    } else {
                        Expect::Queued
                    });
                }
            }
            return;
        }
        if name == b"multi" && cmd.argc == 1 {
            self.in_multi = true;
            self.push(Expect::Multi);
            return;
        }
        if expect == Expect::Monitor && self.monitor_unanswered() && self.front().is_none() {
            // Every reply came, so monitoring is on: this MONITOR gets no reply.
            return;
        }
        if matches!(expect, Expect::PubSub { .. }) {
            self.push_pubsub(expect);
        } else {
            self.push(expect);
        }
    }

    /// A command sent inside a transaction with replies off or skipped (no `+QUEUED`, no
    /// EXEC reply). A quiet EXEC ends the transaction; it is followed on unless something
    /// queued in it switched what later replies are (a subscribe, a HELLO), or monitor
    /// lines may come from it, since no reply marks where its effects start.
    fn quiet_in_transaction(&mut self, cmd: &Command) {
        match cmd.name() {
            b"exec" => {
                let lost = self
                    .transaction_lost
                    .or(self.transaction_protocol.map(|_| Lost::SwitchWithoutReply))
                    .or(self
                        .monitoring_when_due()
                        .then_some(Lost::TransactionWhileMonitoring));
                // Even with the wrong arity EXEC ends the transaction, without running it.
                self.end_transaction();
                if let Some(lost) = lost.filter(|_| cmd.argc == 1) {
                    self.push(Expect::Lost(lost));
                }
            }
            b"discard" if cmd.argc == 1 => self.end_transaction(),
            name if PubSubOp::of(name).is_some() => {
                self.transaction_lost = Some(Lost::SubscribeInTransaction)
            }
            _ => {}
        }
    }

    /// No transaction any more (EXEC, DISCARD, RESET).
    fn end_transaction(&mut self) {
        self.in_multi = false;
        self.transaction_lost = None;
        self.transaction = None;
        self.transaction_overflow = false;
        self.transaction_protocol = None;
    }

    /// Queues an (un)subscribe command's entry. A subscribe right behind one sent with
    /// replies off or skipped, which Valkey may have refused silently, makes the pairing
    /// give up: the next confirmations could be that one's or this one's. (A command with a
    /// reply in between settles it: that reply ends the quiet one. An unsubscribe's
    /// confirmations are of another kind, and an unsubscribe is never refused.)
    fn push_pubsub(&mut self, e: Expect) {
        let subscribes = |e: &Expect| matches!(e, Expect::PubSub { op, .. } if !op.unsubscribes());
        if subscribes(&e) {
            // Back over the unsubscribes at the queue's back (their confirmations, of
            // another kind, do not end a quiet subscribe) to the nearest subscribe. One that
            // is not quiet passed this same test when it was queued, so nothing further back
            // needs a look: each entry is looked at about once, however long the pipeline.
            let behind_quiet_subscribe = self
                .queue
                .iter()
                .rev()
                // An accepted CLIENT REPLY has no reply to settle a quiet subscribe.
                .take_while(|(e, _)| matches!(e, Expect::PubSub { .. } | Expect::ClientReply))
                .find(|(e, _)| subscribes(e))
                .is_some_and(|(e, _)| matches!(e, Expect::PubSub { quiet: true, .. }));
            if behind_quiet_subscribe {
                self.push(Expect::Lost(Lost::SubscribeAfterQuietSubscribe));
                return;
            }
        }
        self.push(e);
    }

    /// The client sent input that Valkey rejects with a protocol error (and then closes).
    pub fn input_rejected(&mut self) {
        self.rejected = true;
    }

    /// Whether replies can no longer be paired from here on: a reply was found that no
    /// command waits for, or the next reply due comes after a command that cannot be
    /// followed. The connection is then closed before any more bytes are paired.
    #[inline]
    pub fn lost(&self) -> Option<Lost> {
        self.lost.or(match self.front() {
            Some(Expect::Lost(lost)) => Some(*lost),
            _ => None,
        })
    }

    /// [`Pairing::lost`], or lost at the reply frame that starts with type byte `ty`,
    /// before any of its bytes go out: a frame that no command waits for and that cannot
    /// come unasked (it would go out unpaired, and may be a topology reply to a command
    /// Valkey ran although the pairing took it as skipped, say a `CLIENT REPLY SKIP` that
    /// an ACL refused), or anything but `+QUEUED`, an error or a push where a queued
    /// command's reply is due (the transaction never started).
    #[inline]
    pub fn lost_at(&self, ty: u8) -> Option<Lost> {
        // The common case inline: a reply due to a plain command.
        if matches!(self.front(), Some(Expect::Other)) && self.lost.is_none() {
            return None;
        }
        self.lost_at_other(ty)
    }

    /// [`Pairing::lost_at`] past its common case.
    fn lost_at_other(&self, ty: u8) -> Option<Lost> {
        let front = self.front();
        if let Some(lost) = self.lost() {
            return Some(lost);
        }
        // Errors: Valkey's protocol error and its refusal of a connection come unasked.
        let unasked = match ty {
            b'-' | b'>' => true,
            b'+' => self.monitor,
            b'*' => !self.resp3 && self.subscribed,
            _ => false,
        };
        match front {
            None if !unasked => Some(Lost::UnpairedReply),
            Some(Expect::Queued) if !matches!(ty, b'+' | b'-' | b'>') => Some(Lost::MultiRefused),
            _ => None,
        }
    }

    /// Whether the connection may be subscribed when Valkey reads the next command: it is,
    /// or a subscribe command is still waiting for its confirmations.
    fn maybe_subscribed(&self) -> bool {
        // In the order Valkey runs them: a RESET ends every subscription, a subscribe
        // command may start one (an unsubscribe may not end them all).
        self.queue
            .iter()
            .fold(self.subscribed, |subscribed, (e, _)| match e {
                Expect::Reset | Expect::SkippedReset => false,
                Expect::PubSub { op, .. } if !op.unsubscribes() => true,
                _ => subscribed,
            })
    }

    /// Whether the connection will be monitoring when the commands still due have run: a
    /// MONITOR turns it on, a RESET off (only QUIT ends it otherwise).
    fn monitoring_when_due(&self) -> bool {
        self.queue.iter().fold(self.monitor, |on, (e, _)| match e {
            Expect::Monitor => true,
            Expect::Reset | Expect::SkippedReset => false,
            _ => on,
        })
    }

    /// Whether the connection speaks RESP3 and no HELLO still due can change that.
    fn resp3_for_sure(&self) -> bool {
        self.resp3
            && !self
                .queue
                .iter()
                .any(|(e, _)| matches!(e, Expect::Hello | Expect::Reset | Expect::ExecProtocol(_)))
    }

    /// Whether the reply frame that starts with type byte `ty` must be captured whole: a
    /// topology reply, an error (MOVED/ASK), or an array that may be a RESP2 pub/sub frame.
    pub fn capture(&self, ty: u8) -> bool {
        if self.monitor {
            // Monitor lines are simple strings; a command sent while monitoring is answered
            // in band, amid them. A simple string is captured while such a command waits,
            // to tell its reply from a monitor line by shape; any other frame is placed as
            // usual.
            if ty == b'+' {
                return self.front().is_some();
            }
        }
        let pubsub_front = matches!(self.front(), Some(Expect::PubSub { .. }));
        match ty {
            b'-' => true,
            // Held to be read: `+QUEUED`, or the transaction did not start.
            b'+' if self.next_in_band() == Some(&Expect::Queued) => true,
            // A push is out of band, but a subscribe waits for its confirmations in pushes.
            b'>' => pubsub_front,
            b'*' if !self.resp3 && (self.subscribed || pubsub_front) => true,
            _ => self.next_in_band().is_some_and(Expect::is_topology),
        }
    }

    /// Whether the aggregate that starts with type byte `ty` may be a pub/sub frame: it is
    /// then classified from its first elements ([`PubSubKind::of`]) as they stream by, not
    /// captured, and placed with [`Pairing::on_classified_reply`]. Checked before
    /// [`Pairing::capture`].
    pub fn classify_by_head(&self, ty: u8) -> bool {
        if self.monitor {
            return false;
        }
        let pubsub_front = matches!(self.front(), Some(Expect::PubSub { .. }));
        match ty {
            b'>' => pubsub_front,
            b'*' => !self.resp3 && (self.subscribed || pubsub_front),
            _ => false,
        }
    }

    /// Whether the reply frame that starts with type byte `ty` is certainly the reply to
    /// the plain command at the front: no monitor line, push or pub/sub frame can come
    /// instead. It is then neither captured nor classified ([`Pairing::capture`] and
    /// [`Pairing::classify_by_head`] say no to it).
    pub fn plain_reply_due(&self, ty: u8) -> bool {
        // An error may be a redirect (captured); a push or, subscribed in RESP2, an array
        // may be out of band.
        let maybe_other_frame = match ty {
            b'-' | b'>' => true,
            b'*' => !self.resp3 && self.subscribed,
            _ => false,
        };
        !self.monitor && !maybe_other_frame && matches!(self.front(), Some(Expect::Other))
    }

    /// Turns the shortcuts for runs of plain commands off (the test that holds them to the
    /// general rules).
    #[cfg(test)]
    pub(crate) fn general_only(&mut self) {
        self.general_only = true;
    }

    /// How many of the next replies answer plain commands whatever their bytes, if they
    /// are bulk strings, status lines or integers (no push, pub/sub message or error, which
    /// may be a redirect): the run of plain commands at the front, when not monitoring. They
    /// may be placed with [`Pairing::took_plain`]. If more is queued behind the run, its
    /// last reply is left to be placed as any reply, as what follows may change with it (a
    /// transaction's protocol, a MONITOR that gets no reply).
    #[inline]
    pub fn plain_run(&self) -> u64 {
        match self.queue.front() {
            Some((Expect::Other, n)) if !self.monitor && !self.general_only => {
                if self.queue.len() == 1 {
                    *n
                } else {
                    n - 1
                }
            }
            _ => 0,
        }
    }

    /// Places `n` replies within [`Pairing::plain_run`].
    #[inline]
    pub fn took_plain(&mut self, n: u64) {
        debug_assert!(n <= self.plain_run());
        let last = self.queue.len() == 1;
        if let Some((Expect::Other, left)) = self.queue.front_mut() {
            if n >= *left && last {
                self.queue.pop_front();
            } else {
                *left -= n.min(*left - 1);
            }
        }
    }

    /// What the next in-band reply answers (subscribe commands ahead of it aside), if known.
    pub fn next_in_band(&self) -> Option<&Expect> {
        self.queue.iter().map(|(e, _)| e).find(|e| {
            // MONITOR on a monitoring connection gets no reply.
            let unanswered = **e == Expect::Monitor && self.monitor_unanswered();
            !(matches!(e, Expect::PubSub { .. } | Expect::ClientReply) || unanswered)
        })
    }

    /// Places a reply that [`Pairing::classify_by_head`] picked out, from what its first
    /// elements said (`None`: not a pub/sub frame).
    pub fn on_classified_reply(&mut self, ty: u8, kind: Option<PubSubKind>) -> Answer {
        self.place(ty, None, kind)
    }

    /// Places a status line too long to hold, which streamed: `monitor_line` says whether
    /// its first bytes are a monitor line's (out of band while monitoring).
    pub fn on_long_status(&mut self, monitor_line: bool) -> Answer {
        self.status_in_band = !monitor_line;
        let answer = self.place(b'+', None, None);
        self.status_in_band = false;
        answer
    }

    /// Places one complete reply frame. `frame` is given when it was captured.
    pub fn on_reply(&mut self, ty: u8, frame: Option<&Frame<'_>>) -> Answer {
        self.place(ty, frame, frame.and_then(pubsub_kind))
    }

    fn place(&mut self, ty: u8, frame: Option<&Frame<'_>>, kind: Option<PubSubKind>) -> Answer {
        // Most replies answer one of a run of plain commands, with nothing else due: the
        // run is one shorter and nothing else changes, as `place_inner` would have it.
        if !self.general_only && self.plain_reply_due(ty) {
            if let Some((Expect::Other, n)) = self.queue.front_mut() {
                if *n > 1 {
                    *n -= 1;
                    return Answer::InBand(Expect::Other);
                }
            }
        }
        let answer = self.place_inner(ty, frame, kind);
        if let (Answer::InBand(_), Some(Expect::ExecProtocol(resp3))) = (&answer, self.front()) {
            // The reply just placed is EXEC's: an array if the transaction ran.
            if ty == b'*' {
                self.resp3 = *resp3;
            }
            self.pop();
        }
        self.drop_unanswered();
        answer
    }

    /// Whether MONITOR now gets no reply: when monitoring already, unless the connection is
    /// subscribed in RESP2 (then it is refused with an error).
    fn monitor_unanswered(&self) -> bool {
        self.monitor && (self.resp3 || !self.subscribed)
    }

    /// Entries at the front that get no reply are taken off, so that what is next is
    /// seen: MONITOR on a monitoring connection, and a skipped RESET (which takes effect).
    fn drop_unanswered(&mut self) {
        loop {
            match self.front() {
                Some(Expect::Monitor) if self.monitor_unanswered() => {}
                Some(Expect::SkippedReset) => self.reset_replies(),
                _ => return,
            }
            self.pop();
        }
    }

    fn place_inner(
        &mut self,
        ty: u8,
        frame: Option<&Frame<'_>>,
        kind: Option<PubSubKind>,
    ) -> Answer {
        if self.monitor && ty == b'+' && !std::mem::take(&mut self.status_in_band) {
            let Some(Frame::Simple(line)) = frame else {
                return Answer::OutOfBand;
            };
            if is_monitor_line(line) {
                return Answer::OutOfBand;
            }
            if line.as_ref() == b"RESET" {
                // RESET's reply ends monitoring (and answers the first RESET waiting).
                while let Some(e) = self.pop() {
                    if e == Expect::Reset {
                        break;
                    }
                }
                self.reset_replies();
                return Answer::InBand(Expect::Reset);
            }
        }
        let pubsub_front = matches!(self.front(), Some(Expect::PubSub { .. }));
        if ty == b'>' || (ty == b'*' && !self.resp3 && (self.subscribed || pubsub_front)) {
            match kind {
                Some(PubSubKind::Confirmation(op, count)) => {
                    self.confirmed(op, count);
                    return Answer::OutOfBand;
                }
                // PING's reply in RESP2 subscribed mode is in band.
                Some(PubSubKind::Pong) if ty == b'*' => {}
                _ if ty == b'>' => return Answer::OutOfBand,
                // Only while subscribed: a subscribe's confirmation comes before any of its
                // messages, so a message-shaped array before it is a command's reply (behind
                // a quiet subscribe that Valkey refused without a word, say).
                Some(PubSubKind::Message) if self.subscribed => return Answer::OutOfBand,
                _ => {}
            }
        }
        // An in-band reply from here on.
        if let Some(lost) = self.settle_client_reply(ty, frame) {
            self.lost.get_or_insert(lost);
            return Answer::InBand(Expect::Other);
        }
        if let Some(Expect::PubSub {
            seen: 0,
            quiet: false,
            ..
        }) = self.front()
        {
            if ty == b'-' {
                // One error answers a whole subscribe command.
                return Answer::InBand(self.pop().unwrap_or(Expect::Other));
            }
        }
        // An in-band reply: subscribe commands still ahead of it are over, and so is a
        // CLIENT REPLY they hid.
        while matches!(self.front(), Some(Expect::PubSub { .. })) {
            self.pop();
        }
        if let Some(lost) = self.settle_client_reply(ty, frame) {
            self.lost.get_or_insert(lost);
            return Answer::InBand(Expect::Other);
        }
        // Valkey's answer to input it rejected, after which it closes: it answers no command
        // (the MULTI behind the rejected input never ran).
        let protocol_error = matches!(
            frame,
            Some(Frame::Error(e)) if e.starts_with(b"ERR Protocol error")
        );
        let expect = match self.pop() {
            Some(e) => e,
            None => {
                // Valkey's answer to input it rejected, or its refusal of a connection
                // before any command, is an error no command waits for; anything else is a
                // reply this pairing cannot place.
                if !(self.rejected || protocol_error || (ty == b'-' && !self.requested)) {
                    self.lost.get_or_insert(Lost::UnpairedReply);
                }
                Expect::Other
            }
        };
        match expect {
            // Reached behind subscribe commands that only this reply ended.
            Expect::Lost(lost) => {
                self.lost.get_or_insert(lost);
            }
            Expect::Monitor if ty == b'+' => self.monitor = true,
            Expect::Reset => self.reset_replies(),
            Expect::Hello if ty == b'%' => self.resp3 = true,
            Expect::Hello if ty == b'*' => self.resp3 = false,
            Expect::Multi if ty == b'-' && !protocol_error => self.multi_refused(),
            Expect::Queued if ty == b'+' => {
                let queued = matches!(frame, Some(Frame::Simple(l)) if l.as_ref() == b"QUEUED");
                if !queued {
                    self.lost.get_or_insert(Lost::MultiRefused);
                }
            }
            _ => {}
        }
        Answer::InBand(expect)
    }

    /// MULTI's reply was an error: no transaction. Followed on only when nothing was sent
    /// behind it yet; else what was recorded as queued is wrong.
    fn multi_refused(&mut self) {
        let untouched = self.in_multi
            && self.queue.is_empty()
            && self.transaction_len() == 0
            && !self.transaction_overflow
            && self.transaction_lost.is_none()
            && self.transaction_protocol.is_none();
        if untouched {
            self.end_transaction();
        } else {
            self.lost.get_or_insert(Lost::MultiRefused);
        }
    }

    /// RESET's reply: no subscription, no MONITOR, RESP2.
    fn reset_replies(&mut self) {
        // RESET answered: a CLIENT REPLY before it was accepted (its error would have come
        // first), and replies are on again.
        while matches!(self.queue.front(), Some((Expect::ClientReply, _))) {
            self.queue.pop_front();
        }
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
        let i = self.first();
        let Some((
            Expect::PubSub {
                op: want,
                channels,
                seen,
                quiet,
            },
            n,
        )) = self.queue.get_mut(i)
        else {
            return; // Unasked (a slot moved away, say): nothing waits for it.
        };
        if *want != op {
            return; // Unasked too: an sunsubscribe when a slot moves away.
        }
        let (channels, seen, quiet) = (*channels, *seen + 1, *quiet);
        let done = if channels == 0 {
            left == 0
        } else {
            seen >= channels
        };
        // The front entry may stand for several identical commands: split this one off.
        if *n > 1 {
            *n -= 1;
            if !done {
                let e = Expect::PubSub {
                    op,
                    channels,
                    seen,
                    quiet,
                };
                self.queue.insert(i, (e, 1));
            }
        } else if done {
            self.queue.remove(i);
        } else if let Some((Expect::PubSub { seen: s, .. }, _)) = self.queue.get_mut(i) {
            *s = seen;
        }
    }
}

/// What a pub/sub-looking aggregate is, by its first elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PubSubKind {
    Message,
    /// A (un)subscribe confirmation, with the subscription count it reports.
    Confirmation(PubSubOp, i64),
    /// PING's reply in subscribed mode: in band.
    Pong,
}

impl PubSubKind {
    /// From an aggregate's first element, a string (`first`), and its third (`third`,
    /// only read for a confirmation: the subscription count).
    pub fn of(first: &[u8], third: Option<&Frame<'_>>) -> Option<PubSubKind> {
        let name = first.to_ascii_lowercase();
        match name.as_slice() {
            b"message" | b"pmessage" | b"smessage" => Some(PubSubKind::Message),
            b"pong" => Some(PubSubKind::Pong),
            name => PubSubOp::of(name)
                .map(|op| PubSubKind::Confirmation(op, third.and_then(Frame::as_int).unwrap_or(0))),
        }
    }

    /// Whether the third element is needed to know what the frame does.
    pub fn wants_third(first: &[u8]) -> bool {
        PubSubOp::of(&first.to_ascii_lowercase()).is_some()
    }
}

/// Whether an error is Valkey's refusal of `CLIENT REPLY`: an ACL rule, no AUTH yet, or
/// the command renamed away or filtered out (named as the client sent it).
fn refuses_client_reply(e: &[u8]) -> bool {
    let head = e[..e.len().min(64)].to_ascii_lowercase();
    head.starts_with(b"noauth")
        || (head.starts_with(b"noperm") && contains(e, b"'client|reply'"))
        || head.starts_with(b"err unknown command 'client'")
        || head.starts_with(b"err unknown subcommand 'reply'")
}

/// Whether `needle` occurs in `haystack`.
fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Whether a simple string has the shape of a MONITOR line, which no reply to a command
/// has: `<seconds>.<micros> [<db> <client>] ...` (`[<db> lua]` from a script), from its
/// first bytes at least.
pub fn is_monitor_line(s: &[u8]) -> bool {
    let digits = |b: &[u8]| !b.is_empty() && b.iter().all(u8::is_ascii_digit);
    let Some(dot) = s.iter().position(|&b| b == b'.') else {
        return false;
    };
    let Some(open) = s.windows(2).position(|w| w == b" [") else {
        return false;
    };
    dot < open
        && digits(&s[..dot])
        && digits(&s[dot + 1..open])
        && s[open..].windows(2).any(|w| w == b"] ")
}

/// The request side's commands go to the pairing; runs of plain ones as counts.
impl Commands for Pairing {
    fn command(&mut self, cmd: &Command) {
        self.on_request(cmd);
    }

    /// Outside a transaction and with replies on, a command whose name the pairing does
    /// not look at (most: GET, SET) is one more of a run of plain commands, whatever its
    /// arguments.
    #[inline]
    fn counts_plain(&self) -> bool {
        !(self.in_multi || self.reply_off || self.skip_next || self.general_only)
    }

    /// Not one of the names [`Pairing::on_request`] and [`Expect::of`] tell apart.
    #[inline(always)]
    fn plain_name(name: &[u8]) -> bool {
        // Most names have a first letter and length no looked-at name has (GET, SET): one
        // test, in the caller's loop; the others are compared out of line.
        match name.first() {
            Some(&first) if looked_at_shape(first, name.len()) => plain_name_by_words(name),
            _ => true,
        }
    }

    #[inline]
    fn plain(&mut self, n: u64) {
        self.requested = true;
        self.push_n(Expect::Other, n);
    }
}

/// Whether a looked-at name starts with `first`, in either case, and is `len` bytes long:
/// the names in [`plain_name_by_words`], by first letter and length.
#[inline(always)]
fn looked_at_shape(first: u8, len: usize) -> bool {
    const NAMES: &[&[u8]] = &[
        b"client",
        b"cluster",
        b"discard",
        b"exec",
        b"hello",
        b"info",
        b"multi",
        b"monitor",
        b"psubscribe",
        b"punsubscribe",
        b"reset",
        b"role",
        b"subscribe",
        b"ssubscribe",
        b"sunsubscribe",
        b"unsubscribe",
    ];
    // For each letter, a bit for each length (all under 16) a looked-at name of it has;
    // and a bit for each letter that has one.
    const LENGTHS: [u16; 26] = {
        let mut lengths = [0; 26];
        let mut i = 0;
        while i < NAMES.len() {
            lengths[(NAMES[i][0] - b'a') as usize] |= 1 << NAMES[i].len();
            i += 1;
        }
        lengths
    };
    const LETTERS: u32 = {
        let mut letters = 0;
        let mut k = 0;
        while k < 26 {
            letters |= ((LENGTHS[k] != 0) as u32) << k;
            k += 1;
        }
        letters
    };
    // `| 0x20` lowers a capital and leaves a small letter; no other byte lands in a..=z.
    // The letter first: one test for most names (GET), with no load.
    let k = (first | 0x20).wrapping_sub(b'a');
    k < 26 && LETTERS >> k & 1 == 1 && len < 16 && LENGTHS[usize::from(k)] >> len & 1 == 1
}

/// [`Commands::plain_name`] for a name with the first letter and length of a looked-at
/// one.
#[inline(never)]
fn plain_name_by_words(name: &[u8]) -> bool {
    let Some(first) = name.first() else {
        return true;
    };
    let looked_at: &[&[u8]] = match first.to_ascii_lowercase() {
        b'c' => &[b"client", b"cluster"],
        b'd' => &[b"discard"],
        b'e' => &[b"exec"],
        b'h' => &[b"hello"],
        b'i' => &[b"info"],
        b'm' => &[b"multi", b"monitor"],
        b'p' => &[b"psubscribe", b"punsubscribe"],
        b'r' => &[b"reset", b"role"],
        b's' => &[b"subscribe", b"ssubscribe", b"sunsubscribe"],
        b'u' => &[b"unsubscribe"],
        _ => return true,
    };
    !looked_at.iter().any(|n| n.eq_ignore_ascii_case(name))
}

/// Whether a RESP2 array is a pub/sub frame, by its first element.
fn pubsub_kind(f: &Frame<'_>) -> Option<PubSubKind> {
    let Frame::Array(b'*' | b'>', items) = f else {
        return None;
    };
    PubSubKind::of(items.first()?.as_bytes()?, items.get(2))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::resp::frame::parse;
    use crate::resp::request::RequestScanner;

    /// Places one reply frame, captured when the pairing asks for it.
    fn reply(p: &mut Pairing, r: &[u8]) -> Answer {
        let frame = parse(r).unwrap().0;
        let captured = p.capture(r[0]);
        p.on_reply(r[0], captured.then_some(&frame))
    }

    /// Feeds the requests, then places each reply; returns the answers.
    fn pair(requests: &[u8], replies: &[&[u8]]) -> Vec<Answer> {
        let mut p = Pairing::new(true);
        let mut s = RequestScanner::default();
        s.feed(requests, |c| p.on_request(c)).unwrap();
        replies.iter().map(|r| reply(&mut p, r)).collect()
    }

    use Answer::{InBand, OutOfBand};

    /// Found by the differential fuzzer: a skipped RESET ends monitoring, but CLIENT REPLY
    /// SKIP's own monitor line comes after the last reply before it (the bytes Valkey 9.1
    /// sent). Nothing marks where monitoring ends, so the connection is given up.
    #[test]
    fn a_skipped_reset_on_a_monitoring_connection_is_given_up() {
        let got = pair(
            b"MONITOR\r\nGET a\r\nCLIENT REPLY SKIP\r\nRESET\r\nPING\r\n",
            &[
                b"+OK\r\n",
                b"$-1\r\n",
                b"+1796112351.679651 [0 127.0.0.1:35364] \"CLIENT\" \"REPLY\" \"SKIP\"\r\n",
            ],
        );
        assert_eq!(
            got,
            vec![InBand(Expect::Monitor), InBand(Expect::Other), OutOfBand]
        );
        let mut p = Pairing::new(true);
        let mut s = RequestScanner::default();
        s.feed(b"MONITOR\r\nCLIENT REPLY SKIP\r\nRESET\r\n", |c| {
            p.on_request(c)
        })
        .unwrap();
        p.on_reply(b'+', Some(&parse(b"+OK\r\n").unwrap().0));
        assert_eq!(p.lost(), Some(Lost::SwitchWithoutReply));
        // Not monitoring: a skipped RESET is followed as before.
        let mut p = Pairing::new(true);
        s.feed(b"CLIENT REPLY SKIP\r\nRESET\r\n", |c| p.on_request(c))
            .unwrap();
        assert_eq!(p.lost(), None);
    }

    /// Inline commands (one per line, words split at spaces) as the arrays clients send.
    pub(crate) fn array_commands(inline: &[u8]) -> Vec<u8> {
        let mut out = vec![];
        for line in inline.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let words: Vec<&[u8]> = line.split(|&b| b == b' ').collect();
            out.extend(format!("*{}\r\n", words.len()).bytes());
            for w in words {
                out.extend(format!("${}\r\n", w.len()).bytes());
                out.extend(w);
                out.extend(b"\r\n");
            }
        }
        out
    }

    /// The shape test takes exactly the first letters and lengths of the looked-at names
    /// (written out here by hand), in either case: `| 0x20` folds no other byte onto a
    /// letter.
    #[test]
    fn the_shape_test_takes_the_looked_at_shapes_only() {
        let shapes = [
            "c6", "c7", "d7", "e4", "h5", "i4", "m5", "m7", "p10", "p12", "r5", "r4", "s9", "s10",
            "s12", "u11",
        ];
        for b in 0..=u8::MAX {
            for len in 0..40 {
                let want = shapes
                    .contains(&format!("{}{len}", b.to_ascii_lowercase() as char).as_str())
                    && b.is_ascii_alphabetic();
                assert_eq!(looked_at_shape(b, len), want, "{b:#04x} {len}");
            }
        }
    }

    /// Every lowercase word in the pairing's code (names and subcommands it looks at, and
    /// more), sent as a command name with up to two arguments, in either case, between
    /// plain commands: the shortcut for runs of plain commands leaves the pairing as the
    /// commands given one by one do.
    #[test]
    fn every_name_the_pairing_looks_at_is_left_to_it() {
        let code = include_str!("pairing.rs");
        let code = &code[..code.find("pub(crate) mod tests").unwrap_or(code.len())];
        let mut names: Vec<&str> = code
            .split('"')
            .skip(1)
            .step_by(2)
            .filter(|w| !w.is_empty() && w.bytes().all(|b| b.is_ascii_lowercase()))
            .collect();
        names.sort_unstable();
        names.dedup();
        assert!(names.len() > 20, "{names:?}");
        for name in names {
            for case in [name.to_string(), name.to_ascii_uppercase()] {
                for args in ["", " nodes", " reply off", " 3"] {
                    let commands =
                        array_commands(format!("GET a\r\n{case}{args}\r\nGET b\r\n").as_bytes());
                    let mut general = Pairing::new(true);
                    general.general_only = true;
                    let mut fast = Pairing::new(true);
                    RequestScanner::default()
                        .feed_to(&commands, &mut general)
                        .unwrap();
                    RequestScanner::default()
                        .feed_to(&commands, &mut fast)
                        .unwrap();
                    general.general_only = false;
                    assert_eq!(format!("{fast:?}"), format!("{general:?}"), "{case}{args}");
                }
            }
        }
    }

    /// Commands and replies of every kind the pairing tells apart (a monitor line, pub/sub
    /// confirmations and messages in both protocols, EXEC's array, HELLO's map).
    pub(crate) const REQUESTS: &[&[u8]] = &[
        b"GET a\r\n",
        b"GET a\r\nGET b\r\nSET c d\r\n",
        b"PING\r\n",
        b"SUBSCRIBE c\r\n",
        b"UNSUBSCRIBE\r\n",
        b"MONITOR\r\n",
        b"RESET\r\n",
        b"MULTI\r\n",
        b"EXEC\r\n",
        b"HELLO 3\r\n",
        b"HELLO 2\r\n",
        b"CLIENT REPLY SKIP\r\n",
        b"CLIENT REPLY OFF\r\n",
        b"CLIENT REPLY ON\r\n",
        b"CLUSTER NODES\r\n",
    ];
    pub(crate) const REPLIES: &[&[u8]] = &[
        b"+OK\r\n",
        b"$1\r\nx\r\n",
        b"$-1\r\n",
        b":1\r\n",
        b"-ERR x\r\n",
        b"*0\r\n",
        b"*1\r\n:1\r\n",
        b"%0\r\n",
        b"+RESET\r\n",
        b"+1796000000.000000 [0 127.0.0.1:50000] \"get\" \"a\"\r\n",
        b"*3\r\n$9\r\nsubscribe\r\n$1\r\nc\r\n:1\r\n",
        b"*3\r\n$11\r\nunsubscribe\r\n$1\r\nc\r\n:0\r\n",
        b"*3\r\n$7\r\nmessage\r\n$1\r\nc\r\n$1\r\nm\r\n",
        b">3\r\n$7\r\nmessage\r\n$1\r\nc\r\n$1\r\nm\r\n",
        b">3\r\n$9\r\nsubscribe\r\n$1\r\nc\r\n:1\r\n",
    ];

    proptest::proptest! {
        /// A reply to a run of plain commands is placed by a shortcut: with it on or off,
        /// any mix of commands and replies is placed alike and leaves the same queue.
        #[test]
        fn the_plain_reply_shortcut_places_as_the_general_rules_do(
            steps in proptest::collection::vec((proptest::bool::ANY, proptest::sample::select(REQUESTS), proptest::bool::ANY, proptest::sample::select(REPLIES)), 1..40),
        ) {
            let mut general = Pairing::new(true);
            general.general_only = true;
            let mut both = [(Pairing::new(true), RequestScanner::default()), (general, RequestScanner::default())];
            for (request, command, as_array, reply) in steps {
                let mut answers = vec![];
                // Commands as arrays are what the shortcut for runs of plain ones reads.
                let command = if as_array { array_commands(command) } else { command.to_vec() };
                for (p, s) in &mut both {
                    if request {
                        s.feed_to(&command, p).unwrap();
                    } else {
                        let ty = reply[0];
                        let frame = parse(reply).unwrap().0;
                        let captured = p.capture(ty);
                        answers.push(p.on_reply(ty, captured.then_some(&frame)));
                    }
                }
                let [(fast, _), (general, _)] = &both;
                proptest::prop_assert_eq!(&answers.first(), &answers.last());
                proptest::prop_assert_eq!(format!("{:?}", fast.queue), format!("{:?}", general.queue));
                proptest::prop_assert_eq!(fast.lost(), general.lost());
                proptest::prop_assert_eq!(
                    (fast.monitor, fast.subscribed, fast.resp3),
                    (general.monitor, general.subscribed, general.resp3)
                );
            }
        }
    }

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
            InBand(Expect::Exec(vec![
                (Expect::Other, 1),
                (Expect::ClusterShards, 1)
            ]))
        );
        assert_eq!(got[6], InBand(Expect::Other));
        assert_eq!(got[7], InBand(Expect::ClusterSlots));
    }

    /// MULTI refused (the bytes Valkey 9.1 sends for a user whose ACL lacks it): with
    /// nothing sent behind it, the next commands are followed as run one by one (CLUSTER
    /// SLOTS rewritten, CLIENT REPLY obeyed); with commands already sent as if queued, the
    /// connection is given up at MULTI's reply.
    #[test]
    fn a_refused_multi_starts_nothing() {
        let refused: &[u8] = b"-NOPERM User u has no permissions to run the 'multi' command\r\n";
        let mut p = Pairing::new(true);
        let mut s = RequestScanner::default();
        s.feed(b"MULTI\r\n", |c| p.on_request(c)).unwrap();
        assert_eq!(reply(&mut p, refused), InBand(Expect::Multi));
        s.feed(
            b"CLUSTER SLOTS\r\nCLIENT REPLY OFF\r\nGET a\r\nCLIENT REPLY ON\r\nEXEC\r\n",
            |c| p.on_request(c),
        )
        .unwrap();
        assert_eq!(reply(&mut p, b"*0\r\n"), InBand(Expect::ClusterSlots));
        assert_eq!(reply(&mut p, b"+OK\r\n"), InBand(Expect::Other));
        assert_eq!(
            reply(&mut p, b"-ERR EXEC without MULTI\r\n"),
            InBand(Expect::Other)
        );
        assert_eq!((p.pending(), p.lost()), (0, None));
        // Accepted, the same MULTI starts a transaction.
        let got = pair(
            b"MULTI\r\nCLUSTER SLOTS\r\nEXEC\r\n",
            &[b"+OK\r\n", b"+QUEUED\r\n", b"*1\r\n*0\r\n"],
        );
        assert!(matches!(got[2], InBand(Expect::Exec(_))), "{got:?}");
        // Pipelined behind a refused MULTI: lost where MULTI's reply is placed.
        let got = lost_after(
            b"GET a\r\nMULTI\r\nCLUSTER SLOTS\r\nEXEC\r\n",
            &[b"$-1\r\n", refused],
        );
        assert_eq!(got, [None, None, Some(Lost::MultiRefused)]);
        let got = lost_after(b"MULTI\r\nDISCARD\r\n", &[refused]);
        assert_eq!(got, [None, Some(Lost::MultiRefused)]);
        // Found by the differential fuzzer: input Valkey rejects before MULTI. Its protocol
        // error answers no command (Valkey closes), MULTI never ran: not a refusal.
        let got = lost_after(
            b"GET 'a\r\nMULTI\r\nCLUSTER NODES\r\n",
            &[b"-ERR Protocol error: unbalanced quotes in request\r\n"],
        );
        assert_eq!(got, [None, None]);
    }

    /// CLIENT REPLY OFF or SKIP refused (the bytes Valkey 9.1 sends for a user whose ACL
    /// lacks it, or before AUTH): the commands behind it were answered after all, which the
    /// pairing cannot follow, so it gives up at the refusal. Accepted, the first in-band
    /// reply behind it settles it, an error too.
    #[test]
    fn a_refused_client_reply_is_given_up_at_its_error() {
        let noperm: &[u8] =
            b"-NOPERM User u has no permissions to run the 'client|reply' command\r\n";
        let got = lost_after(
            b"CLIENT REPLY SKIP\r\nGET v\r\nGET w\r\nCLUSTER NODES\r\n",
            &[noperm],
        );
        assert_eq!(got, [None, Some(Lost::ClientReplyRefused)]);
        let got = lost_after(
            b"GET a\r\nCLIENT REPLY OFF\r\nCLUSTER NODES\r\nCLIENT REPLY ON\r\n",
            &[b"$-1\r\n", b"-NOAUTH Authentication required.\r\n"],
        );
        assert_eq!(got, [None, None, Some(Lost::ClientReplyRefused)]);
        // Accepted: GET a's reply is skipped; GET b's error is its own.
        let got = pair(
            b"CLIENT REPLY SKIP\r\nGET a\r\nGET b\r\nCLUSTER SLOTS\r\n",
            &[b"-MOVED 1 10.0.0.1:6379\r\n", b"*0\r\n"],
        );
        assert_eq!(got, [InBand(Expect::Other), InBand(Expect::ClusterSlots)]);
        // Its own reply skipped (a SKIP behind a SKIP): nothing to settle.
        let got = lost_after(
            b"CLIENT REPLY SKIP\r\nCLIENT REPLY SKIP\r\nGET a\r\nGET b\r\n",
            &[b"$-1\r\n"],
        );
        assert_eq!(got, [None, None]);
    }

    /// A message-shaped array while the connection is not subscribed is a command's reply,
    /// also behind a quiet subscribe that Valkey refused silently (two slots, its error
    /// skipped): had it been accepted, its confirmation would have come first. Found by the
    /// differential fuzzer: LRANGE's reply was taken as a message, and CLUSTER SHARDS's
    /// reply then went out as LRANGE's, with the nodes' own addresses.
    #[test]
    fn a_message_shaped_reply_before_any_confirmation_is_in_band() {
        let message: &[u8] = b"*3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$1\r\nx\r\n";
        let answers = pair(
            b"CLIENT REPLY SKIP\r\nSSUBSCRIBE {a}s {b}s\r\nLRANGE l 0 -1\r\nCLUSTER SHARDS\r\n",
            &[message, b"*0\r\n"],
        );
        assert_eq!(
            answers,
            [InBand(Expect::Other), InBand(Expect::ClusterShards)]
        );
        // Subscribed, the same array is a message.
        let answers = pair(
            b"SUBSCRIBE ch\r\nPING\r\n",
            &[
                b"*3\r\n$9\r\nsubscribe\r\n$2\r\nch\r\n:1\r\n",
                message,
                b"*2\r\n$4\r\npong\r\n$0\r\n\r\n",
            ],
        );
        assert_eq!(answers, [OutOfBand, OutOfBand, InBand(Expect::Other)]);
    }

    /// A CLIENT REPLY entry is looked past by the other rules (found in review): the
    /// guard for a subscribe behind a quiet one, MONITOR on a monitoring connection (no
    /// reply), an in-band reply behind a quiet subscribe that never got its confirmation,
    /// and the refusal of a renamed-away command.
    #[test]
    fn a_client_reply_entry_changes_no_other_rule() {
        let hello3: &[u8] = b"%1\r\n$5\r\nproto\r\n:3\r\n";
        let mut p = Pairing::new(true);
        let mut s = RequestScanner::default();
        s.feed(b"HELLO 3\r\n", |c| p.on_request(c)).unwrap();
        reply(&mut p, hello3);
        s.feed(b"CLIENT REPLY SKIP\r\nSSUBSCRIBE foreign\r\nCLIENT REPLY SKIP\r\nGET y\r\nSSUBSCRIBE local\r\n", |c| p.on_request(c)).unwrap();
        assert!(
            p.queue
                .iter()
                .any(|(e, _)| *e == Expect::Lost(Lost::SubscribeAfterQuietSubscribe)),
            "{:?}",
            p.queue
        );
        // A quiet subscribe that never got a confirmation (refused silently), then an
        // in-band reply: every CLIENT REPLY ahead of it is settled.
        let mut p = Pairing::new(true);
        s.feed(b"HELLO 3\r\n", |c| p.on_request(c)).unwrap();
        reply(&mut p, hello3);
        s.feed(
            b"CLIENT REPLY SKIP\r\nSSUBSCRIBE foreign\r\nCLIENT REPLY SKIP\r\nGET y\r\nGET x\r\n",
            |c| p.on_request(c),
        )
        .unwrap();
        assert_eq!(reply(&mut p, b"$1\r\nx\r\n"), InBand(Expect::Other));
        assert!(p.queue.is_empty(), "{:?}", p.queue);
        // MONITOR while monitoring gets no reply, CLIENT REPLY pending or not.
        let mut p = Pairing::new(true);
        s.feed(b"MONITOR\r\n", |c| p.on_request(c)).unwrap();
        reply(&mut p, b"+OK\r\n");
        s.feed(b"CLIENT REPLY SKIP\r\nGET a\r\n", |c| p.on_request(c))
            .unwrap();
        let line = b"+1796112351.679651 [0 127.0.0.1:35364] \"GET\" \"a\"\r\n";
        assert_eq!(reply(&mut p, line), OutOfBand);
        s.feed(b"MONITOR\r\nGET b\r\nCLUSTER NODES\r\n", |c| {
            p.on_request(c)
        })
        .unwrap();
        assert_eq!(reply(&mut p, b"$-1\r\n"), InBand(Expect::Other));
        assert_eq!(reply(&mut p, b"$0\r\n\r\n"), InBand(Expect::ClusterNodes));
        // CLIENT renamed away: refused as surely as by an ACL.
        let unknown: &[u8] =
            b"-ERR unknown command 'client', with args beginning with: 'REPLY' 'SKIP' \r\n";
        let got = lost_after(b"CLIENT REPLY SKIP\r\nGET a\r\nGET b\r\n", &[unknown]);
        assert_eq!(got, [None, Some(Lost::ClientReplyRefused)]);
        // An unknown command behind an accepted SKIP is that command's error.
        let typo: &[u8] = b"-ERR unknown command 'GETT', with args beginning with: 'b' \r\n";
        let got = lost_after(b"CLIENT REPLY SKIP\r\nGET a\r\nGETT b\r\n", &[typo]);
        assert_eq!(got, [None, None]);
    }

    /// Where no command waits, only what Valkey sends unasked is let through (an error: its
    /// protocol error or a refused connection; a push; a monitor line; a RESP2 pub/sub
    /// message); where a queued command's reply is due, only `+QUEUED`, an error or a push.
    #[test]
    fn a_frame_no_command_can_answer_is_lost_before_it_goes_out() {
        let mut p = Pairing::new(true);
        for ty in [b'-', b'>'] {
            assert_eq!(p.lost_at(ty), None);
        }
        for ty in [b'$', b'*', b':', b'%', b'+'] {
            assert_eq!(p.lost_at(ty), Some(Lost::UnpairedReply), "{}", ty as char);
        }
        let mut s = RequestScanner::default();
        s.feed(b"MULTI\r\nGET a\r\n", |c| p.on_request(c)).unwrap();
        p.on_reply(b'+', Some(&Frame::Simple(b"OK"[..].into())));
        for ty in [b'+', b'-', b'>'] {
            assert_eq!(p.lost_at(ty), None);
        }
        for ty in [b'$', b'*', b':'] {
            assert_eq!(p.lost_at(ty), Some(Lost::MultiRefused), "{}", ty as char);
        }
        assert!(p.capture(b'+'));
        p.on_reply(b'+', Some(&Frame::Simple(b"OK"[..].into())));
        assert_eq!(p.lost(), Some(Lost::MultiRefused));
        // QUIT in a transaction runs at once (`+OK`, then Valkey closes): not lost.
        let got = lost_after(
            b"MULTI\r\nGET a\r\nQUIT\r\n",
            &[b"+OK\r\n", b"+QUEUED\r\n", b"+OK\r\n"],
        );
        assert!(got.iter().all(Option::is_none), "{got:?}");
    }

    /// Found by the differential fuzzer: a MULTI whose reply is skipped or off still starts
    /// the transaction (the bytes Valkey 9.1 sent), and CLIENT REPLY inside it is refused.
    #[test]
    fn a_quiet_multi_still_starts_the_transaction() {
        // Skipped: the next commands are `+QUEUED`, EXEC's reply is the transaction's.
        let got = pair(
            b"CLIENT REPLY SKIP\r\nMULTI\r\nCLUSTER SLOTS\r\nEXEC\r\nCLUSTER NODES\r\n",
            &[b"+QUEUED\r\n", b"*1\r\n*0\r\n", b"$0\r\n\r\n"],
        );
        assert_eq!(got[0], InBand(Expect::Queued), "{got:?}");
        assert!(matches!(got[1], InBand(Expect::Exec(_))), "{got:?}");
        assert_eq!(got[2], InBand(Expect::ClusterNodes), "{got:?}");
        // Off: CLIENT REPLY ON inside the transaction is refused (silently), the quiet EXEC
        // ends it, and the CLIENT REPLY ON after it turns replies on.
        let got = pair(
            b"CLIENT REPLY OFF\r\nMULTI\r\nGET a\r\nCLIENT REPLY ON\r\nEXEC\r\nCLIENT REPLY ON\r\nCLUSTER SLOTS\r\n",
            &[b"+OK\r\n", b"*0\r\n"],
        );
        assert_eq!(got, [InBand(Expect::Other), InBand(Expect::ClusterSlots)]);
        // A quiet DISCARD ends it too.
        let got = pair(
            b"CLIENT REPLY OFF\r\nMULTI\r\nDISCARD\r\nCLIENT REPLY ON\r\nCLUSTER SLOTS\r\n",
            &[b"+OK\r\n", b"*0\r\n"],
        );
        assert_eq!(got, [InBand(Expect::Other), InBand(Expect::ClusterSlots)]);
        // A subscribe queued in it, then a quiet EXEC: its confirmations may come with no
        // reply to mark where, so the pairing gives up there.
        let got = lost_after(
            b"CLIENT REPLY OFF\r\nMULTI\r\nSUBSCRIBE c\r\nEXEC\r\nCLIENT REPLY ON\r\n",
            &[],
        );
        assert_eq!(got, [Some(Lost::SubscribeInTransaction)]);
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
                    seen: 0,
                    quiet: false,
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
            &[
                b"+OK\r\n",
                b"+1764547200.000001 [0 10.0.0.9:50000] \"get\"\r\n",
                b"+RESET\r\n",
                b"*0\r\n",
            ],
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
                b"+1764547200.000001 [0 10.0.0.9:50000] \"get\" \"a\"\r\n",
                b"$-1\r\n",
                b"+RESET\r\n",
                b"*0\r\n",
            ],
        );
        assert_eq!(
            got[1..],
            [
                OutOfBand,
                InBand(Expect::Other),
                InBand(Expect::Reset),
                InBand(Expect::ClusterSlots)
            ]
        );
    }

    /// Found by the differential fuzzer: an empty command (`*0`, `*-1`, an empty line) is
    /// the one a `CLIENT REPLY SKIP` skips; a line of blanks is not.
    #[test]
    fn an_empty_command_is_the_one_skipped() {
        for empty in [&b"*0\r\n"[..], b"*-1\r\n", b"\r\n", b"\n"] {
            let mut requests = b"CLIENT REPLY SKIP\r\n".to_vec();
            requests.extend_from_slice(empty);
            requests.extend_from_slice(b"CLUSTER NODES\r\n");
            let got = pair(&requests, &[b"$0\r\n\r\n"]);
            assert_eq!(got, [InBand(Expect::ClusterNodes)], "{empty:?}");
        }
        let got = pair(
            b"CLIENT REPLY SKIP\r\n \t \r\nGET k\r\nCLUSTER NODES\r\n",
            &[b"$0\r\n\r\n"],
        );
        assert_eq!(got, [InBand(Expect::ClusterNodes)]);
    }

    /// Found by the differential fuzzer: with replies off or skipped, (un)subscribe
    /// confirmations still come (an error does not).
    #[test]
    fn confirmations_come_with_replies_off() {
        let c = |kind: &str, ch: &str, n: u8| {
            format!(
                "*3\r\n${}\r\n{kind}\r\n${}\r\n{ch}\r\n:{n}\r\n",
                kind.len(),
                ch.len()
            )
            .into_bytes()
        };
        let got = pair(
            b"CLIENT REPLY OFF\r\nSUBSCRIBE\r\nSUBSCRIBE pong\r\nRESET\r\nCLUSTER SHARDS\r\n",
            &[&c("subscribe", "pong", 1), b"+RESET\r\n", b"*0\r\n"],
        );
        assert_eq!(
            got,
            [
                OutOfBand,
                InBand(Expect::Reset),
                InBand(Expect::ClusterShards)
            ]
        );
        // An SSUBSCRIBE refused (a shard channel of another node) gets no error then: the
        // next error is the next command's.
        let got = pair(
            b"CLIENT REPLY SKIP\r\nSSUBSCRIBE {x}s\r\nDISCARD\r\nCLUSTER NODES\r\n",
            &[b"-ERR DISCARD without MULTI\r\n", b"$0\r\n\r\n"],
        );
        assert_eq!(got, [InBand(Expect::Other), InBand(Expect::ClusterNodes)]);
        // Right behind it, another subscribe: whether a confirmation is the first's or the
        // second's cannot be told, so the pairing gives up there (before, the second's
        // confirmation was counted for the first, and the next error answered the second
        // in place of DISCARD, leaving CLUSTER NODES' reply to DISCARD's entry).
        let got = lost_after(
            b"CLIENT REPLY SKIP\r\nSSUBSCRIBE {x}s\r\nSSUBSCRIBE {y}t\r\nDISCARD\r\nCLUSTER NODES\r\n",
            &[&c("ssubscribe", "{y}t", 1), b"-ERR DISCARD without MULTI\r\n"],
        );
        assert_eq!(
            got.last(),
            Some(&Some(Lost::SubscribeAfterQuietSubscribe)),
            "{got:?}"
        );
        // With a reply in between, the quiet one is over by the time the next comes.
        let got = pair(
            b"CLIENT REPLY SKIP\r\nSSUBSCRIBE {x}s\r\nPING\r\nSSUBSCRIBE {y}t\r\nDISCARD\r\nCLUSTER NODES\r\n",
            &[
                b"+PONG\r\n",
                &c("ssubscribe", "{y}t", 1),
                b"-ERR DISCARD without MULTI\r\n",
                b"$0\r\n\r\n",
            ],
        );
        assert_eq!(
            got,
            [
                InBand(Expect::Other),
                OutOfBand,
                InBand(Expect::Other),
                InBand(Expect::ClusterNodes)
            ]
        );
        // Nor with an unsubscribe between the two (its confirmation, of another kind, does
        // not end the quiet one): found by review.
        let got = lost_after(
            b"CLIENT REPLY SKIP\r\nSSUBSCRIBE {x}s\r\nUNSUBSCRIBE\r\nSSUBSCRIBE {y}t\r\nDISCARD\r\nCLUSTER NODES\r\n",
            &[],
        );
        assert_eq!(got, [None], "{got:?}");
        let got = lost_after(
            b"CLIENT REPLY SKIP\r\nSSUBSCRIBE {x}s\r\nUNSUBSCRIBE\r\nSSUBSCRIBE {y}t\r\nDISCARD\r\nCLUSTER NODES\r\n",
            &[
                &c("unsubscribe", "", 0),
                &c("ssubscribe", "{y}t", 1),
                b"-ERR DISCARD without MULTI\r\n",
            ],
        );
        assert_eq!(
            got.last(),
            Some(&Some(Lost::SubscribeAfterQuietSubscribe)),
            "{got:?}"
        );
        // Unsubscribes are never refused (but for their arity): one behind another is
        // followed.
        let got = pair(
            b"CLIENT REPLY OFF\r\nUNSUBSCRIBE a\r\nUNSUBSCRIBE b\r\nCLIENT REPLY ON\r\nCLUSTER SLOTS\r\n",
            &[
                &c("unsubscribe", "a", 0),
                &c("unsubscribe", "b", 0),
                b"+OK\r\n",
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
        let got = pair(
            b"CLIENT REPLY SKIP\r\nSUBSCRIBE a\r\nPING\r\nUNSUBSCRIBE\r\nCLUSTER SLOTS\r\n",
            &[
                &c("subscribe", "a", 1),
                b"*2\r\n$4\r\npong\r\n$0\r\n\r\n",
                &c("unsubscribe", "a", 0),
                b"*0\r\n",
            ],
        );
        assert_eq!(
            got,
            [
                OutOfBand,
                InBand(Expect::Other),
                OutOfBand,
                InBand(Expect::ClusterSlots)
            ]
        );
    }

    /// HELLO queued in a transaction switches the protocol when EXEC runs it, not when it
    /// aborts.
    #[test]
    fn hello_inside_a_transaction() {
        let push = b">3\r\n$9\r\nsubscribe\r\n$2\r\nch\r\n:1\r\n";
        let array = b"*3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$1\r\nx\r\n";
        let got = pair(
            b"MULTI\r\nHELLO 3\r\nEXEC\r\nSUBSCRIBE ch\r\nLRANGE l 0 -1\r\nCLUSTER SLOTS\r\n",
            &[
                b"+OK\r\n",
                b"+QUEUED\r\n",
                b"*1\r\n%0\r\n",
                push,
                array,
                b"*0\r\n",
            ],
        );
        assert_eq!(
            got[3..],
            [
                OutOfBand,
                InBand(Expect::Other),
                InBand(Expect::ClusterSlots)
            ]
        );
        // Aborted (an unknown command was refused): still RESP2, where the array is a
        // message.
        let got = pair(
            b"MULTI\r\nHELLO 3\r\nNOSUCH\r\nEXEC\r\nSUBSCRIBE ch\r\nCLUSTER SLOTS\r\n",
            &[
                b"+OK\r\n",
                b"+QUEUED\r\n",
                b"-ERR unknown command\r\n",
                b"-EXECABORT x\r\n",
                &push.map(|b| if b == b'>' { b'*' } else { b }),
                array,
                b"*0\r\n",
            ],
        );
        assert_eq!(
            got[4..],
            [OutOfBand, OutOfBand, InBand(Expect::ClusterSlots)]
        );
    }

    /// Found by the differential fuzzer: a command sent while monitoring is answered in
    /// band, amid the monitor lines, and a topology reply then is rewritten like any other;
    /// a simple-string reply is told from a monitor line by shape.
    #[test]
    fn commands_sent_while_monitoring_are_answered_in_band() {
        // MONITOR again: no reply at all.
        let got = pair(
            b"MONITOR\r\nMONITOR\r\nMONITOR x\r\nCLUSTER NODES\r\nMONITOR\r\nCLUSTER SLOTS\r\n",
            &[
                b"+OK\r\n",
                b"-ERR wrong number\r\n",
                b"$0\r\n\r\n",
                b"*0\r\n",
            ],
        );
        assert_eq!(
            got[1..],
            [
                InBand(Expect::Other),
                InBand(Expect::ClusterNodes),
                InBand(Expect::ClusterSlots)
            ]
        );
        // Subscribed in RESP2, a second MONITOR is refused with an error (found by the
        // fuzzer); the monitor line of the PSUBSCRIBE comes after its confirmations.
        let got = pair(
            b"MONITOR\r\nPSUBSCRIBE p*\r\nMONITOR\r\nRESET\r\nCLUSTER SLOTS\r\n",
            &[
                b"+OK\r\n",
                b"*3\r\n$10\r\npsubscribe\r\n$2\r\np*\r\n:1\r\n",
                b"+1796085873.286728 [0 127.0.0.1:58604] \"PSUBSCRIBE\" \"p*\"\r\n",
                b"-ERR Can't execute 'monitor'\r\n",
                b"+RESET\r\n",
                b"*0\r\n",
            ],
        );
        assert_eq!(
            got[1..],
            [
                OutOfBand,
                OutOfBand,
                InBand(Expect::Monitor),
                InBand(Expect::Reset),
                InBand(Expect::ClusterSlots)
            ]
        );
        // A skipped RESET ends monitoring, but CLIENT REPLY SKIP's own monitor line comes
        // after MONITOR's reply and nothing marks where such lines stop: given up (see
        // `a_skipped_reset_on_a_monitoring_connection_is_given_up`).
        let got = pair(
            b"CLIENT REPLY SKIP\r\nRESET\r\nCLUSTER SHARDS\r\n",
            &[b"*0\r\n"],
        );
        assert_eq!(got, [InBand(Expect::ClusterShards)]);
        let mut p = Pairing::new(true);
        let mut s = RequestScanner::default();
        s.feed(b"MONITOR\r\nMONITOR\r\nCLUSTER SLOTS\r\n", |c| {
            p.on_request(c)
        })
        .unwrap();
        p.on_reply(b'+', Some(&Frame::Simple(b"OK"[..].into())));
        // The reply after is CLUSTER SLOTS', captured to be rewritten.
        assert!(p.capture(b'*'));
        // A confirmation after a second MONITOR is one (found by the fuzzer).
        let got = pair(
            b"MONITOR\r\nMONITOR\r\nUNSUBSCRIBE\r\nPUBLISH ch x\r\nCLUSTER SHARDS\r\n",
            &[
                b"+OK\r\n",
                b"*3\r\n$11\r\nunsubscribe\r\n$-1\r\n:0\r\n",
                b":0\r\n",
                b"*0\r\n",
            ],
        );
        assert_eq!(
            got[1..],
            [
                OutOfBand,
                InBand(Expect::Other),
                InBand(Expect::ClusterShards)
            ]
        );
        let got = pair(
            b"MONITOR\r\nUNSUBSCRIBE ch x\r\nCLUSTER NODES\r\n",
            &[
                b"+OK\r\n",
                b"*3\r\n$11\r\nunsubscribe\r\n$2\r\nch\r\n:0\r\n",
                b"*3\r\n$11\r\nunsubscribe\r\n$1\r\nx\r\n:0\r\n",
                b"$0\r\n\r\n",
            ],
        );
        assert_eq!(
            got[1..],
            [OutOfBand, OutOfBand, InBand(Expect::ClusterNodes)]
        );
        let got = pair(
            b"MONITOR\r\nCLUSTER SLOTS\r\nSET k v\r\nGET k\r\nCLUSTER NODES\r\n",
            &[
                b"+OK\r\n",
                b"+1764547200.000001 [0 10.0.0.9:50000] \"set\" \"k\" \"x\"\r\n",
                b"*0\r\n",
                b"+1764547200.000002 [0 lua] \"get\" \"k\"\r\n",
                b"+OK\r\n",
                b"$1\r\nv\r\n",
                b"$0\r\n\r\n",
                b"+1764547200.000003 [0 10.0.0.9:50000] \"get\" \"k\"\r\n",
            ],
        );
        assert_eq!(
            got,
            [
                InBand(Expect::Monitor),
                OutOfBand,
                InBand(Expect::ClusterSlots),
                OutOfBand,
                InBand(Expect::Other),
                InBand(Expect::Other),
                InBand(Expect::ClusterNodes),
                OutOfBand,
            ]
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

    /// Requests fed, then replies placed one by one: `lost()` after each.
    fn lost_after(requests: &[u8], replies: &[&[u8]]) -> Vec<Option<Lost>> {
        let mut p = Pairing::new(true);
        let mut s = RequestScanner::default();
        s.feed(requests, |c| p.on_request(c)).unwrap();
        let mut got = vec![p.lost()];
        for r in replies {
            reply(&mut p, r);
            got.push(p.lost());
        }
        got
    }

    #[test]
    fn what_cannot_be_followed_is_lost_at_its_place_in_the_reply_stream() {
        use Lost::*;
        // A subscribe in a transaction: followed up to EXEC, lost there.
        let got = lost_after(
            b"MULTI\r\nSUBSCRIBE c\r\nEXEC\r\n",
            &[b"+OK\r\n", b"+QUEUED\r\n"],
        );
        assert_eq!(got, [None, None, Some(SubscribeInTransaction)]);
        // ... unless it is discarded.
        let got = lost_after(
            b"MULTI\r\nSUBSCRIBE c\r\nDISCARD\r\nCLUSTER SLOTS\r\n",
            &[b"+OK\r\n", b"+QUEUED\r\n", b"+OK\r\n", b"*0\r\n"],
        );
        assert!(got.iter().all(Option::is_none), "{got:?}");
        // HELLO with options in a transaction.
        let got = lost_after(
            b"MULTI\r\nHELLO 3 AUTH u p\r\nEXEC\r\n",
            &[b"+OK\r\n", b"+QUEUED\r\n"],
        );
        assert_eq!(got[2], Some(HelloInTransaction));
        // HELLO and MONITOR with no reply to confirm them.
        for requests in [
            &b"CLIENT REPLY OFF\r\nHELLO 3\r\nCLIENT REPLY ON\r\n"[..],
            b"CLIENT REPLY SKIP\r\nMONITOR\r\n",
        ] {
            assert_eq!(lost_after(requests, &[]), [Some(SwitchWithoutReply)]);
        }
        // EXEC on a monitoring connection: Valkey 9.1.2 puts each command's monitor line
        // amid EXEC's array (captured by hand: `MONITOR`, `MULTI`, `PING x`, `EXEC`), so it
        // is lost there, whether MONITOR's reply came before EXEC was sent or not.
        let got = lost_after(
            b"MONITOR\r\nMULTI\r\nPING x\r\nEXEC\r\n",
            &[
                b"+OK\r\n",
                b"+OK\r\n",
                b"+1796095084.986223 [0 127.0.0.1:41660] \"MULTI\"\r\n",
                b"+QUEUED\r\n",
            ],
        );
        assert_eq!(
            got,
            [None, None, None, None, Some(TransactionWhileMonitoring)]
        );
        let mut p = Pairing::new(true);
        let mut s = RequestScanner::default();
        s.feed(b"MONITOR\r\n", |c| p.on_request(c)).unwrap();
        p.on_reply(b'+', None);
        s.feed(b"MULTI\r\nPING x\r\nEXEC\r\n", |c| p.on_request(c))
            .unwrap();
        for r in [&b"+OK\r\n"[..], b"+QUEUED\r\n"] {
            assert!(p.capture(b'+'), "a status line is told apart by its shape");
            p.on_reply(b'+', Some(&parse(r).unwrap().0));
        }
        assert_eq!(p.lost(), Some(TransactionWhileMonitoring));
        // A RESET due before EXEC ends monitoring first.
        let got = lost_after(b"MONITOR\r\nRESET\r\nMULTI\r\nPING x\r\nEXEC\r\n", &[]);
        assert_eq!(got, [None]);
        // An empty transaction runs nothing to feed: followed as usual.
        let got = lost_after(b"MONITOR\r\nMULTI\r\nEXEC\r\n", &[b"+OK\r\n", b"+OK\r\n"]);
        assert!(got.iter().all(Option::is_none), "{got:?}");
        // CLIENT REPLY or MULTI once a RESP2 connection is (or may be) subscribed.
        let got = lost_after(
            b"SUBSCRIBE c\r\nCLIENT REPLY SKIP\r\nGET k\r\n",
            &[b"*3\r\n$9\r\nsubscribe\r\n$1\r\nc\r\n:1\r\n"],
        );
        assert_eq!(got, [None, Some(SubscribedResp2)]);
        // A RESET still due ends the subscription first.
        let got = lost_after(b"SUBSCRIBE c\r\nRESET\r\nCLIENT REPLY SKIP\r\n", &[]);
        assert_eq!(got, [None]);
        // Behind a subscribe that only an in-band reply ends, it is still found.
        let got = lost_after(b"SUBSCRIBE c\r\nMULTI\r\n", &[b"+OK\r\n"]);
        assert_eq!(got, [None, Some(SubscribedResp2)]);
        // In RESP3 both are allowed while subscribed: followed as usual, once HELLO's
        // reply said RESP3 (pipelined behind HELLO, the pairing cannot know yet and gives
        // up).
        let mut p = Pairing::new(true);
        let mut s = RequestScanner::default();
        s.feed(b"HELLO 3\r\n", |c| p.on_request(c)).unwrap();
        p.on_reply(b'%', None);
        s.feed(b"SUBSCRIBE c\r\nMULTI\r\n", |c| p.on_request(c))
            .unwrap();
        assert_eq!(p.lost(), None);
    }

    #[test]
    fn a_reply_no_command_waits_for_is_lost_but_a_refused_connection_is_not() {
        let got = lost_after(b"GET k\r\n", &[b"$1\r\nv\r\n", b"$1\r\nw\r\n"]);
        assert_eq!(got, [None, None, Some(Lost::UnpairedReply)]);
        // Valkey refuses a connection (maxclients, protected mode) before any command.
        let got = lost_after(b"", &[b"-ERR max number of clients reached\r\n"]);
        assert_eq!(got, [None, None]);
        // Nor its protocol errors, for input the proxy took for a command.
        let got = lost_after(
            b"GET k\r\n",
            &[
                b"$1\r\nv\r\n",
                b"-ERR Protocol error: invalid bulk length\r\n",
            ],
        );
        assert_eq!(got, [None, None, None]);
        // Its answer to input it rejects has no command either.
        let mut p = Pairing::new(true);
        p.input_rejected();
        p.on_reply(b'-', None);
        assert_eq!(p.lost(), None);
    }
}
