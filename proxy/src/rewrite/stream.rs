//! The two directions of a rewriting connection.
//!
//! [`RequestSide`] watches the client's commands and records what each reply will be;
//! [`ReplySide`] walks the server's replies frame by frame. A reply that cannot carry an
//! address streams through untouched (its bytes are forwarded as they arrive, as ranges of
//! the read buffer); a topology reply is captured whole, rewritten, and sent on.
//!
//! What is held is bounded whatever the traffic, so that a reply is held only as far as
//! its rewriting needs:
//! - an error or simple string, up to [`LINE_CAPTURE`] bytes (a redirect fits; a longer
//!   line streams);
//! - a pub/sub-looking aggregate, its header and first element (the frame's kind), then
//!   for a confirmation its third (the count): a message of any size streams;
//! - an EXEC reply, only its elements that answer topology commands;
//! - a reply to a topology command, whole, up to [`Limits::max_frame`] (past it the
//!   connection closes: streaming it would leak internal addresses).

use std::future::Future;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use tokio::sync::Notify;

use super::{rewrite_to_bytes, AddressMap, Report};
use crate::resp::frame::parse;
use crate::resp::pairing::{is_monitor_line, Answer, Expect, Lost, Pairing, PubSubKind};
use crate::resp::request::RequestScanner;
use crate::resp::{Part, RespError, Scan, Scanner};

/// Limits of one rewriting connection.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// A reply paired with a topology command larger than this closes the connection (it
    /// cannot be rewritten, and must not leak internal addresses). Other replies pass at
    /// any size.
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

/// One rewriting connection's state, both directions, in one allocation laid out by hand:
/// each part starts a cache line with what a read of plain commands or replies touches, so
/// that such a read touches one line of its side's and one of the shared state. Between
/// two reads of a connection, the other connections' reads have evicted its lines: each
/// line touched is a miss (callgrind, GET from 50 clients: 4 misses per request in the
/// scanners and the pairing, 8.6 before).
#[repr(C)]
pub struct Rewriting {
    pub shared: Shared,
    pub requests: RequestSide,
    pub replies: ReplySide,
}

impl Rewriting {
    pub fn new(rewrite_info: bool, limits: Limits) -> Self {
        Rewriting {
            shared: Shared::new(rewrite_info),
            requests: RequestSide::new(limits),
            replies: ReplySide::new(limits),
        }
    }
}

/// State shared by the two directions of one connection.
// Fields in this order (`repr(C)`): the flag and the pairing's lock and hot fields share
// the first cache line (see [`Rewriting`]).
#[repr(C, align(64))]
pub struct Shared {
    /// The request side waits for `room`: only then does the reply side wake it (a wake-up
    /// takes a lock, and the reply side would take it on every read).
    waiting: AtomicBool,
    pub pairing: Mutex<Pairing>,
    /// Woken when the reply side has taken expected replies off a long queue.
    room: Notify,
}

/// Queue entries (runs of like commands) that the request side may run ahead of the replies
/// before it stops reading from the client: bounds the memory of a client that pipelines
/// without reading. A million pipelined GETs are one entry.
pub const MAX_PENDING: usize = 64 * 1024;

// A transaction's runs count in the entries too, but only its EXEC removes them: they must
// stay below the level at which a waiting request side is woken, or it would wait forever.
const _: () = assert!(crate::resp::pairing::MAX_TRANSACTION_RUNS < MAX_PENDING / 2);

impl Shared {
    pub fn new(rewrite_info: bool) -> Self {
        Shared {
            waiting: AtomicBool::new(false),
            pairing: Mutex::new(Pairing::new(rewrite_info)),
            room: Notify::new(),
        }
    }

    /// Waits until the queue of expected replies is short enough to read more requests.
    pub async fn room_for_requests(&self) {
        // Almost always: room, and no waiter to register (two more locks per read).
        if self.pairing().entries() < MAX_PENDING {
            return;
        }
        loop {
            let notified = self.room.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            // Set before the queue is looked at, under the lock the reply side takes before
            // it shortens the queue: either the look sees room, or the reply side sees this.
            self.waiting.store(true, Ordering::SeqCst);
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
// `repr(C)`: the flag and the scanner's hot fields on one cache line (see [`Rewriting`]).
#[repr(C, align(64))]
pub struct RequestSide {
    /// The queue was short enough to read more when the last commands were noted. It is
    /// still (no lock to look again: a lock per read), but for one entry: this side
    /// lengthens the queue, the reply side only by the one it splits off a run of
    /// subscribe commands, and the bound is soft anyway (one read adds many entries).
    room: bool,
    scanner: RequestScanner,
}

impl RequestSide {
    pub fn new(limits: Limits) -> Self {
        RequestSide {
            room: true,
            scanner: RequestScanner::new(limits.max_line),
        }
    }

    /// Notes the commands in `buf` (which is then forwarded unchanged).
    #[inline]
    pub fn observe(&mut self, buf: &[u8], shared: &Shared) -> Result<(), RespError> {
        let mut pairing = shared.pairing();
        let fed = self.scanner.feed_to(buf, &mut *pairing);
        if let Err(e) = &fed {
            if crate::resp::request::valkey_rejects(e) {
                pairing.input_rejected();
            }
        }
        self.room = pairing.entries() < MAX_PENDING;
        fed
    }

    /// What to wait for before more requests may be read ([`Shared::room_for_requests`]),
    /// if the queue was long when the last commands were noted.
    pub fn wait<'s>(&self, shared: &'s Shared) -> Option<impl Future<Output = ()> + Send + 's> {
        (!self.room).then(|| shared.room_for_requests())
    }
}

/// A piece of output: bytes of the input as they were, or rewritten bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    Input(Range<usize>),
    Owned(Vec<u8>),
}

/// Bytes of a simple line (an error, a status) captured to see whether it is rewritten: a
/// redirect (`-MOVED <slot> <host>:<port>`, whose host name is at most 255 bytes) or
/// RESET's `+RESET`. A longer line is neither, and streams (a script can return one of any
/// length).
const LINE_CAPTURE: usize = 1024;

/// Bytes of a pub/sub-looking frame held to classify it: its header and first element (a
/// name such as `punsubscribe`), or its third (a subscription count). A longer first
/// element names no pub/sub frame.
const HEAD_CAPTURE: usize = 96;

/// How the frame in progress is handled.
enum Mode {
    /// Its bytes go out as they come.
    Stream,
    /// Captured whole and rewritten if it has its command's shape (errors and simple
    /// strings stream from the point where they outgrow [`LINE_CAPTURE`]).
    Whole,
    /// An aggregate that may be a pub/sub frame: held until its first element says what it
    /// is. A pub/sub frame then streams (a message of any size costs no memory), its third
    /// element kept if it is a confirmation's count; any other frame is held whole if it
    /// may be a topology reply, as any reply is, else streams.
    PubSub {
        /// The first element, once known to name a pub/sub frame.
        first: Option<Box<[u8]>>,
        third: Option<Box<[u8]>>,
        /// Where the first element starts in the held bytes.
        head: usize,
    },
    /// An EXEC reply with topology replies in it: only those elements are captured (and
    /// rewritten); the others, a 100 MB GET say, stream. Boxed: rare, and inline it would
    /// take the reply side past three cache lines, 64 bytes more per idle connection.
    Exec(Box<Exec>),
}

/// The state of [`Mode::Exec`].
struct Exec {
    kinds: Vec<(Expect, u64)>,
    /// The next element's run in `kinds`, and how many of that run have passed.
    run: usize,
    used: u64,
    /// Whether the reply has one element per queued command.
    fits: bool,
    /// What the element in progress answers.
    current: Expect,
    /// Whether an element was rewritten (counted once, as `exec`).
    rewritten: bool,
}

/// The most a capture reserves on the word of a bulk string's length: a 1,000-node
/// cluster's CLUSTER NODES is about 150 KiB.
const RESERVE_AHEAD: usize = 1024 * 1024;

/// The piece of the frame being captured (the whole frame, its head, or one element).
struct Capture {
    /// Its bytes from earlier reads; empty while it all is in the current read.
    buf: Vec<u8>,
    /// Past this many bytes it is not captured any further.
    cap: usize,
    /// Whether a piece past `cap` is an error (a topology reply), rather than one that
    /// cannot be what is looked for and streams on.
    required: bool,
}

/// Server → client.
// `repr(C)`: what a read of plain replies touches first, on one cache line (see
// [`Rewriting`]); the frame in progress's state after it.
#[repr(C, align(64))]
pub struct ReplySide {
    /// The pairing was lost: the error line went out, and nothing more does.
    lost: Option<Lost>,
    /// A status line too long to hold streams: whether its first bytes are a monitor
    /// line's.
    long_status: Option<bool>,
    /// Whether the frame in progress was placed in the pairing when its capture ended.
    placed: bool,
    ty: u8,
    /// Boxed: a capture is rare next to plain replies, and inline it would push the
    /// scanner off the first cache line.
    capture: Option<Box<Capture>>,
    scanner: Scanner,
    limits: Limits,
    mode: Mode,
    /// Index of the element in progress in a split frame (`PubSub`, `Exec`).
    element: u64,
}

impl ReplySide {
    pub fn new(limits: Limits) -> Self {
        ReplySide {
            lost: None,
            long_status: None,
            placed: false,
            ty: 0,
            capture: None,
            scanner: Scanner::new(limits.max_line),
            limits,
            mode: Mode::Stream,
            element: 0,
        }
    }

    /// Set once the pairing was lost: the connection is to be closed after the bytes of the
    /// last read processed (which end with an error line to the client).
    pub fn lost(&self) -> Option<Lost> {
        self.lost
    }

    /// Ends the output at a frame boundary with an error line, because the replies from
    /// here on cannot be paired (and so neither rewritten nor known to need no rewrite).
    fn give_up(&mut self, lost: Lost, out: &mut Vec<Segment>) {
        let line = format!(
            "-ERR shardgate-proxy lost track of which reply answers which command ({}); closing the connection\r\n",
            lost.describe()
        );
        out.push(Segment::Owned(line.into_bytes()));
        self.lost = Some(lost);
    }

    /// Processes `input`, appending what to send to `out`, and accounting in `report`: the
    /// two steps below in one (the proxy takes them apart, tests and benchmarks do not).
    #[cfg(any(test, feature = "test-util"))]
    pub fn process(
        &mut self,
        input: &[u8],
        shared: &Shared,
        map: &AddressMap,
        out: &mut Vec<Segment>,
        report: &mut Report,
    ) -> Result<(), RespError> {
        match self.skip_plain_replies(input, shared) {
            Skipped::All => {
                emit(out, 0..input.len());
                Ok(())
            }
            Skipped::Rest(rest) => self.process_rest(input, rest, shared, map, out, report),
        }
    }

    /// The first step of [`ReplySide::process`], taken alone: the replies to plain commands
    /// that start `input`. Most reads hold only those (every read of GET or SET replies at
    /// pipeline 1), and then the caller sends `input` as it came, with no output segments
    /// and no report to set up and account (callgrind, GET at pipeline 1: 250 user-space
    /// instructions fewer per request, of the 1,066 that rewriting added).
    pub fn skip_plain_replies<'s>(&mut self, input: &[u8], shared: &'s Shared) -> Skipped<'s> {
        let pairing = shared.pairing();
        let mut rest = Rest { at: 0, pairing };
        let Some(&ty) = input.first() else {
            return Skipped::Rest(rest);
        };
        if self.lost.is_some() || self.scanner.in_frame() || self.capture.is_some() {
            return Skipped::Rest(rest);
        }
        let pairing = &mut rest.pairing;
        if pairing.lost_at(ty).is_some() {
            return Skipped::Rest(rest);
        }
        let run = pairing.plain_run();
        if run == 0 {
            return Skipped::Rest(rest);
        }
        let (n, end) = self.scanner.skip_plain(input, 0, run);
        if n > 0 {
            pairing.took_plain(n);
            rest.at = end;
        }
        // What the general path does at the end of its input, past a whole frame.
        if rest.at == input.len() && pairing.lost().is_none() {
            wake_requests(pairing, shared);
            return Skipped::All;
        }
        Skipped::Rest(rest)
    }

    /// [`ReplySide::process`] from where [`ReplySide::skip_plain_replies`] stopped: the
    /// input before `rest.at` goes out as it came.
    pub fn process_rest(
        &mut self,
        input: &[u8],
        rest: Rest<'_>,
        shared: &Shared,
        map: &AddressMap,
        out: &mut Vec<Segment>,
        report: &mut Report,
    ) -> Result<(), RespError> {
        let Rest {
            at: mut i,
            mut pairing,
        } = rest;
        // Start of the input not yet emitted; while a piece is captured, where its bytes in
        // this input start.
        let mut pending = 0;
        if self.lost.is_some() {
            return Ok(());
        }
        while i < input.len() {
            if !self.scanner.in_frame() {
                if let Some(lost) = pairing.lost_at(input[i]) {
                    emit(out, pending..i);
                    self.give_up(lost, out);
                    return Ok(());
                }
                // Most replies answer a run of plain commands: skipped in one tight loop.
                let run = pairing.plain_run();
                if run > 0 && self.capture.is_none() {
                    let (n, end) = self.scanner.skip_plain(input, i, run);
                    if n > 0 {
                        pairing.took_plain(n);
                        i = end;
                        continue;
                    }
                }
                self.start_frame(input[i], &pairing);
                if self.capture.is_some() {
                    emit(out, pending..i);
                    pending = i;
                }
            }
            let part = if matches!(self.mode, Mode::PubSub { .. } | Mode::Exec(_)) {
                self.scanner.scan_parts(input, i)?
            } else {
                match self.scanner.scan(input, i)? {
                    Scan::Complete { end } => Part::Complete { end },
                    Scan::Incomplete => Part::Incomplete,
                }
            };
            let end = match part {
                Part::Incomplete => input.len(),
                Part::Header { end, .. } | Part::Element { end } | Part::Complete { end } => end,
            };
            i = end;
            let held_past_cap = self
                .capture
                .as_ref()
                .is_some_and(|c| c.buf.len() + (end - pending) > c.cap);
            if held_past_cap {
                self.past_cap(&pairing, &input[pending..end], out)?;
            }
            if let (Some(c), Part::Incomplete) = (&mut self.capture, part) {
                if c.buf.is_empty() {
                    // A bulk reply (CLUSTER NODES) says its length: held in one allocation,
                    // not regrown (and copied) read after read. Up to a bound, so that a
                    // length that the bytes never follow costs no more than they would.
                    let left = self.scanner.top_payload_left().unwrap_or(0);
                    let left = usize::try_from(left).unwrap_or(usize::MAX);
                    let want = (end - pending).saturating_add(left);
                    c.buf.reserve(want.min(c.cap).min(RESERVE_AHEAD));
                }
                c.buf.extend_from_slice(&input[pending..end]);
                pending = end;
            }
            match part {
                Part::Incomplete => continue,
                Part::Header { count, .. } => {
                    self.element = 0;
                    match &mut self.mode {
                        Mode::Exec(exec) => {
                            exec.fits = count == super::exec_len(&exec.kinds);
                            if !exec.fits {
                                report.skipped.push("exec_length");
                            }
                        }
                        Mode::PubSub { head, .. } => {
                            if let Some(c) = &self.capture {
                                *head = c.buf.len() + (end - pending);
                            }
                            // The head capture goes on over the first element.
                            continue;
                        }
                        Mode::Stream | Mode::Whole => {}
                    }
                }
                // A frame held whole from its head on (`past_cap`): it ends at its end.
                Part::Element { .. } if matches!(self.mode, Mode::Whole) => continue,
                Part::Element { .. } | Part::Complete { .. } => {
                    let complete = matches!(part, Part::Complete { .. });
                    if let Some(c) = self.capture.take() {
                        let piece = Piece {
                            input,
                            range: pending..end,
                            buf: c.buf,
                            complete,
                        };
                        self.captured(piece, &mut pairing, map, out, report);
                        pending = end;
                    }
                    if complete {
                        self.frame_done(&mut pairing, report);
                        continue;
                    }
                    self.element += 1;
                }
            }
            // The next element starts.
            if self.start_element() {
                emit(out, pending..i);
                pending = i;
            }
        }
        match &mut self.capture {
            // Held on into the next read (a head that ended with this one).
            Some(c) => c.buf.extend_from_slice(&input[pending..]),
            None => emit(out, pending..input.len()),
        }
        if !self.scanner.in_frame() {
            if let Some(lost) = pairing.lost() {
                self.give_up(lost, out);
            }
        }
        wake_requests(&pairing, shared);
        Ok(())
    }

    /// A frame starts with type byte `ty`: decides how it is handled.
    fn start_frame(&mut self, ty: u8, pairing: &Pairing) {
        self.ty = ty;
        self.element = 0;
        self.placed = false;
        if pairing.plain_reply_due(ty) {
            debug_assert!(!pairing.classify_by_head(ty) && !pairing.capture(ty));
            // Stream already, as a frame ends (no drop to run).
            if !matches!(self.mode, Mode::Stream) {
                self.mode = Mode::Stream;
            }
            self.capture = None;
            return;
        }
        let (mode, capture) = if pairing.classify_by_head(ty) {
            let mode = Mode::PubSub {
                first: None,
                third: None,
                head: 0,
            };
            (mode, Some((HEAD_CAPTURE, false)))
        } else if !pairing.capture(ty) {
            (Mode::Stream, None)
        } else if let (b'*', Some(Expect::Exec(kinds))) = (ty, pairing.next_in_band()) {
            let mode = Mode::Exec(Box::new(Exec {
                kinds: kinds.clone(),
                run: 0,
                used: 0,
                fits: false,
                current: Expect::Other,
                rewritten: false,
            }));
            (mode, None)
        } else if matches!(ty, b'+' | b'-' | b':' | b'_' | b'#' | b',' | b'(') {
            (Mode::Whole, Some((LINE_CAPTURE, false)))
        } else {
            (Mode::Whole, Some((self.limits.max_frame, true)))
        };
        self.mode = mode;
        self.capture = capture.map(|(cap, required)| {
            Box::new(Capture {
                buf: Vec::new(),
                cap,
                required,
            })
        });
    }

    /// Whether a frame that is not a pub/sub frame after all must be held whole: an array
    /// when a topology reply is due (as any array then is).
    fn held_whole(&self, pairing: &Pairing) -> bool {
        self.ty == b'*' && pairing.next_in_band().is_some_and(Expect::is_topology)
    }

    /// The piece being captured outgrew its cap.
    fn past_cap(
        &mut self,
        pairing: &Pairing,
        more: &[u8],
        out: &mut Vec<Segment>,
    ) -> Result<(), RespError> {
        let head = matches!(self.mode, Mode::PubSub { .. }) && self.element == 0;
        let whole = head && self.held_whole(pairing);
        let Some(c) = &mut self.capture else {
            return Ok(());
        };
        if c.required {
            return Err(RespError::FrameTooLarge(c.cap));
        }
        if self.ty == b'+' && matches!(self.mode, Mode::Whole) {
            // A long status line: while monitoring, its first bytes say whether it is a
            // monitor line (a command with long arguments) or a reply in band.
            let mut line = c.buf.clone();
            line.extend_from_slice(more);
            self.long_status = Some(is_monitor_line(line.get(1..).unwrap_or_default()));
        }
        if whole {
            // Its first element is too long to name a pub/sub frame: a reply, held whole.
            self.mode = Mode::Whole;
            c.cap = self.limits.max_frame;
            c.required = true;
            return Ok(());
        }
        // Not what is looked for: what was held goes out, the rest streams.
        if !c.buf.is_empty() {
            out.push(Segment::Owned(std::mem::take(&mut c.buf)));
        }
        self.capture = None;
        if matches!(self.mode, Mode::Whole) {
            self.mode = Mode::Stream;
        }
        Ok(())
    }

    /// The next element of a split frame starts (`self.element`): captures it if it is
    /// needed. Returns whether it is captured.
    fn start_element(&mut self) -> bool {
        let (cap, required) = match &mut self.mode {
            Mode::PubSub { first, .. } => {
                if self.element != 2 || !first.as_deref().is_some_and(PubSubKind::wants_third) {
                    return false;
                }
                (HEAD_CAPTURE, false)
            }
            Mode::Exec(exec) => {
                let Exec {
                    kinds,
                    run,
                    used,
                    fits,
                    current,
                    ..
                } = &mut **exec;
                // The next queued command's reply kind.
                while kinds.get(*run).is_some_and(|(_, n)| *used >= *n) {
                    *run += 1;
                    *used = 0;
                }
                *used += 1;
                *current = kinds
                    .get(*run)
                    .map_or(Expect::Other, |(kind, _)| kind.clone());
                if !*fits || !current.is_topology() {
                    return false;
                }
                (self.limits.max_frame, true)
            }
            Mode::Stream | Mode::Whole => return false,
        };
        self.capture = Some(Box::new(Capture {
            buf: Vec::new(),
            cap,
            required,
        }));
        true
    }

    /// A captured piece is complete: handles it and emits it, rewritten or as it came.
    fn captured(
        &mut self,
        piece: Piece<'_>,
        pairing: &mut Pairing,
        map: &AddressMap,
        out: &mut Vec<Segment>,
        report: &mut Report,
    ) {
        let held_whole = self.held_whole(pairing);
        let Piece {
            input,
            range,
            mut buf,
            complete,
        } = piece;
        // A piece that came in one read is not copied.
        let owned = !buf.is_empty();
        if owned {
            buf.extend_from_slice(&input[range.clone()]);
        }
        let bytes: &[u8] = if owned { &buf } else { &input[range.clone()] };
        let new = match &mut self.mode {
            Mode::PubSub { .. } if complete && self.element == 0 => {
                // All of it held (a frame of one element, or none): placed as a whole.
                self.whole(bytes, pairing, map, report)
            }
            Mode::PubSub { first, head, .. } if self.element == 0 => {
                let name = bytes
                    .get(*head..)
                    .and_then(|b| parse(b).ok())
                    .and_then(|(f, _)| f.as_bytes().map(<[u8]>::to_vec))
                    .filter(|name| PubSubKind::of(name, None).is_some());
                if name.is_none() && held_whole {
                    // A reply after all, and maybe the topology one: held whole.
                    if !owned {
                        buf = bytes.to_vec();
                    }
                    self.mode = Mode::Whole;
                    self.capture = Some(Box::new(Capture {
                        buf,
                        cap: self.limits.max_frame,
                        required: true,
                    }));
                    return;
                }
                *first = name.map(Vec::into_boxed_slice);
                None
            }
            Mode::PubSub { third, .. } => {
                *third = Some(bytes.into());
                None
            }
            Mode::Exec(exec) => match parse(bytes) {
                Ok((frame, _)) => {
                    let kinds = report.kinds.len();
                    let new = rewrite_to_bytes(map, &exec.current, frame, bytes.len(), report);
                    // The transaction is the reply counted, as when it was captured whole.
                    report.kinds.truncate(kinds);
                    exec.rewritten |= new.is_some();
                    new
                }
                Err(_) => {
                    report.skipped.push("too_deep");
                    None
                }
            },
            Mode::Whole => self.whole(bytes, pairing, map, report),
            Mode::Stream => None,
        };
        match new {
            Some(new) => out.push(Segment::Owned(new)),
            None if owned => out.push(Segment::Owned(buf)),
            None => emit(out, range),
        }
    }

    /// A frame held whole: placed now, as only the parsed frame says what it is (RESET's
    /// reply is known by its text, a confirmation by its elements), and rewritten if it
    /// answers a topology command in its exact shape.
    fn whole(
        &mut self,
        bytes: &[u8],
        pairing: &mut Pairing,
        map: &AddressMap,
        report: &mut Report,
    ) -> Option<Vec<u8>> {
        self.placed = true;
        match parse(bytes) {
            Ok((frame, _)) => {
                let expect = match pairing.on_reply(self.ty, Some(&frame)) {
                    Answer::InBand(e) => e,
                    Answer::OutOfBand => Expect::Other,
                };
                rewrite_to_bytes(map, &expect, frame, bytes.len(), report)
            }
            Err(_) => {
                // Deeper than the parser goes: no topology reply is.
                pairing.on_reply(self.ty, None);
                report.skipped.push("too_deep");
                None
            }
        }
    }

    /// The frame is complete: places it, unless that was done with its capture.
    fn frame_done(&mut self, pairing: &mut Pairing, report: &mut Report) {
        let mode = std::mem::replace(&mut self.mode, Mode::Stream);
        if std::mem::take(&mut self.placed) {
            return;
        }
        match mode {
            Mode::Exec(exec) => {
                if exec.rewritten {
                    report.kinds.push(Expect::Exec(Vec::new()).label());
                }
                pairing.on_reply(self.ty, None);
            }
            Mode::PubSub { first, third, .. } => {
                let third = third.as_deref().and_then(|b| parse(b).ok()).map(|(f, _)| f);
                let kind = first.and_then(|name| PubSubKind::of(&name, third.as_ref()));
                pairing.on_classified_reply(self.ty, kind);
            }
            Mode::Stream | Mode::Whole => match self.long_status.take() {
                Some(monitor_line) => {
                    pairing.on_long_status(monitor_line);
                }
                None => {
                    pairing.on_reply(self.ty, None);
                }
            },
        }
    }

    /// Bytes held for the frame in progress (what a reply costs beyond the read buffer).
    #[cfg(test)]
    fn held(&self) -> usize {
        self.capture.as_ref().map_or(0, |c| c.buf.len())
            + match &self.mode {
                Mode::PubSub { first, third, .. } => {
                    first.as_ref().map_or(0, |b| b.len()) + third.as_ref().map_or(0, |b| b.len())
                }
                _ => 0,
            }
    }
}

/// A captured piece that is complete: its bytes from earlier reads (`buf`) and its last
/// bytes, `input[range]`; `complete` if the frame ends with it.
struct Piece<'a> {
    input: &'a [u8],
    range: Range<usize>,
    buf: Vec<u8>,
    complete: bool,
}

/// What [`ReplySide::skip_plain_replies`] did with a read.
#[must_use = "a read not all skipped must go on to `ReplySide::process_rest`"]
pub enum Skipped<'s> {
    /// It all answers plain commands: it goes out as it came, and nothing else does.
    All,
    /// The rest is for [`ReplySide::process_rest`].
    Rest(Rest<'s>),
}

/// Where [`ReplySide::skip_plain_replies`] stopped, with the pairing's lock still held.
pub struct Rest<'s> {
    at: usize,
    pairing: MutexGuard<'s, Pairing>,
}

/// Wakes the request side if it waits for room and replies made it (`pairing` is the
/// lock held by the reply side).
fn wake_requests(pairing: &Pairing, shared: &Shared) {
    // Looked at before it is swapped (an atomic write per read otherwise): the lock held
    // by the caller orders the look against the request side's `room_for_requests`.
    if pairing.entries() < MAX_PENDING / 2
        && shared.waiting.load(Ordering::Relaxed)
        && shared.waiting.swap(false, Ordering::SeqCst)
    {
        shared.room.notify_waiters();
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

    /// What a read of plain commands or replies touches lies on one cache line per part,
    /// the point of [`Rewriting`]'s layout: a field added in the wrong place fails this.
    #[test]
    fn each_side_reads_one_cache_line_of_its_own_and_one_shared() {
        use std::mem::offset_of;
        const LINE: usize = 64;
        let state = Rewriting::new(true, Limits::default());
        let at = |p: *const u8| p as usize - &state as *const Rewriting as usize;
        let shared = at((&state.shared as *const Shared).cast());
        let pairing = at((&*state.shared.pairing() as *const Pairing).cast());
        let requests = at((&state.requests as *const RequestSide).cast());
        let replies = at((&state.replies as *const ReplySide).cast());
        for (part, start) in [
            ("shared", shared),
            ("requests", requests),
            ("replies", replies),
        ] {
            assert_eq!(start % LINE, 0, "{part} starts a cache line");
        }
        let shared_hot = pairing + Pairing::HOT_END;
        assert!(shared_hot <= shared + LINE, "shared: {shared_hot} bytes");
        let request_hot = offset_of!(RequestSide, scanner) + RequestScanner::HOT_END;
        assert!(request_hot <= LINE, "requests: {request_hot} bytes");
        let reply_hot = offset_of!(ReplySide, scanner) + Scanner::HOT_END;
        assert!(reply_hot <= LINE, "replies: {reply_hot} bytes");
        assert!(offset_of!(ReplySide, capture) < LINE);
        // What an idle rewriting connection holds beyond a plain one's (its RSS is measured
        // beside HAProxy's by the load harness): two lines shared, three per side.
        for (part, size, lines) in [
            ("shared", std::mem::size_of::<Shared>(), 2),
            ("requests", std::mem::size_of::<RequestSide>(), 3),
            ("replies", std::mem::size_of::<ReplySide>(), 3),
        ] {
            assert!(size <= lines * LINE, "{part}: {size} bytes");
        }
    }

    #[tokio::test]
    async fn a_client_far_ahead_of_its_replies_waits_for_them() {
        let shared = Shared::new(true);
        let mut requests = RequestSide::new(Limits::default());
        assert!(
            requests.wait(&shared).is_none(),
            "a wait with the queue empty"
        );
        // Alternating commands cannot share queue entries.
        let n = MAX_PENDING / 2 + 1;
        requests
            .observe(&b"PING\r\nROLE\r\n".repeat(n), &shared)
            .unwrap();
        // The same wait, parked and then woken by the replies (a bound, not a pause: it
        // ends as soon as it is woken).
        let mut wait = Box::pin(requests.wait(&shared).expect("a wait with the queue full"));
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut wait)
                .await
                .is_err(),
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
        let woken = tokio::time::timeout(Duration::from_secs(10), wait);
        assert!(
            woken.await.is_ok(),
            "the waiting request side was not woken"
        );
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

    /// As [`through`], with `limits`, the replies arriving `piece` bytes at a time; also
    /// returns the most bytes the reply side held between reads.
    fn through_in_pieces(
        requests: &[u8],
        replies: &[u8],
        limits: Limits,
        piece: usize,
    ) -> Result<(Vec<u8>, Report, usize), RespError> {
        let shared = Shared::new(true);
        RequestSide::new(limits).observe(requests, &shared)?;
        let mut side = ReplySide::new(limits);
        let (mut all, mut report, mut held) = (vec![], Report::default(), 0);
        for chunk in replies.chunks(piece) {
            let mut out = vec![];
            side.process(chunk, &shared, &map(), &mut out, &mut report)?;
            all.extend_from_slice(&flatten(chunk, &out));
            held = held.max(side.held());
        }
        Ok((all, report, held))
    }

    fn small() -> Limits {
        Limits {
            max_frame: 4096,
            ..Limits::default()
        }
    }

    fn array(items: &[&[u8]]) -> Vec<u8> {
        let mut v = format!("*{}\r\n", items.len()).into_bytes();
        for i in items {
            v.extend_from_slice(i);
        }
        v
    }

    const SLOTS: &[u8] = b"*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$8\r\n10.0.0.1\r\n:6379\r\n$40\r\n0000000000000000000000000000000000000000\r\n";
    const SLOTS_REWRITTEN: &[u8] = b"*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$11\r\n127.0.77.70\r\n:30000\r\n$40\r\n0000000000000000000000000000000000000000\r\n";

    #[test]
    fn pubsub_messages_of_any_size_stream_and_are_classified_by_their_first_elements() {
        let big = vec![b'm'; 100_000];
        let confirm = |kind: &[u8], ch: &[u8], n: &[u8]| array(&[&bulk(kind), &bulk(ch), n]);
        let mut replies = confirm(b"subscribe", b"a", b":1\r\n");
        replies.extend(confirm(b"psubscribe", b"p*", b":2\r\n"));
        replies.extend(array(&[&bulk(b"message"), &bulk(b"a"), &bulk(&big)]));
        replies.extend(array(&[
            &bulk(b"pmessage"),
            &bulk(b"p*"),
            &bulk(b"pa"),
            &bulk(&big),
        ]));
        // A channel name as long as a message: a confirmation streams too.
        replies.extend(confirm(b"unsubscribe", &big, b":1\r\n"));
        replies.extend(confirm(b"punsubscribe", b"p*", b":0\r\n"));
        // No subscription left: this is CLUSTER SLOTS' reply, rewritten.
        replies.extend_from_slice(SLOTS);
        let requests = [
            &b"SUBSCRIBE a\r\nPSUBSCRIBE p*\r\n"[..],
            &array(&[&bulk(b"UNSUBSCRIBE"), &bulk(&big)]),
            b"PUNSUBSCRIBE\r\nCLUSTER SLOTS\r\n",
        ]
        .concat();
        let mut want = replies[..replies.len() - SLOTS.len()].to_vec();
        want.extend_from_slice(SLOTS_REWRITTEN);
        for piece in [1, 7, 4096, replies.len()] {
            let (out, report, held) =
                through_in_pieces(&requests, &replies, small(), piece).unwrap();
            assert!(out == want, "piece {piece}");
            assert_eq!(report.kinds, ["cluster_slots"], "piece {piece}");
            // The most held is CLUSTER SLOTS' reply, whatever the size of the messages.
            assert!(held <= SLOTS.len(), "held {held} bytes, piece {piece}");
        }
        // RESP3: a push message while a subscribe waits for its confirmation.
        let mut replies = b"%0\r\n".to_vec();
        let mut push = array(&[&bulk(b"message"), &bulk(b"a"), &bulk(&big)]);
        push[0] = b'>';
        replies.extend_from_slice(&push);
        let mut confirmation = confirm(b"subscribe", b"b", b":1\r\n");
        confirmation[0] = b'>';
        replies.extend_from_slice(&confirmation);
        replies.extend_from_slice(SLOTS);
        let (out, _, held) = through_in_pieces(
            b"HELLO 3\r\nSUBSCRIBE b\r\nCLUSTER SLOTS\r\n",
            &replies,
            small(),
            1000,
        )
        .unwrap();
        assert!(out.ends_with(SLOTS_REWRITTEN) && held <= SLOTS.len());
    }

    #[test]
    fn an_array_that_is_no_pub_sub_frame_is_held_whole_when_a_topology_reply_is_due() {
        // Subscribed in RESP2, CLUSTER SLOTS' reply is placed in band (as it was before
        // messages streamed): its first element, longer than a pub/sub name, is held on
        // with the rest, at every split.
        let id = |n: u8| vec![n; 40];
        let node = |ip: &[u8], n: u8| array(&[&bulk(ip), b":6379\r\n", &bulk(&id(n))]);
        let slots = array(&[&array(&[
            b":0\r\n",
            b":16383\r\n",
            &node(b"10.0.0.1", b'0'),
            &node(b"10.0.0.2", b'1'),
        ])]);
        let confirmation = array(&[&bulk(b"ssubscribe"), &bulk(b"s"), b":1\r\n"]);
        let replies = [confirmation.as_slice(), &slots].concat();
        let (whole, report) = through(b"SSUBSCRIBE s\r\nCLUSTER SLOTS\r\n", &replies);
        assert!(
            String::from_utf8_lossy(&whole).contains("127.0.77.70"),
            "{report:?}"
        );
        for piece in 1..replies.len() {
            let (out, _, _) = through_in_pieces(
                b"SSUBSCRIBE s\r\nCLUSTER SLOTS\r\n",
                &replies,
                small(),
                piece,
            )
            .unwrap();
            assert!(out == whole, "piece {piece}");
        }
    }

    #[test]
    fn an_exec_reply_holds_only_its_topology_elements() {
        let big = vec![b'v'; 100_000];
        let replies = [
            &b"+OK\r\n+QUEUED\r\n+QUEUED\r\n+QUEUED\r\n"[..],
            &array(&[&bulk(&big), SLOTS, b":1\r\n"]),
            SLOTS,
        ]
        .concat();
        let want = [
            &b"+OK\r\n+QUEUED\r\n+QUEUED\r\n+QUEUED\r\n"[..],
            &array(&[&bulk(&big), SLOTS_REWRITTEN, b":1\r\n"]),
            SLOTS_REWRITTEN,
        ]
        .concat();
        let requests = b"MULTI\r\nGET k\r\nCLUSTER SLOTS\r\nINCR n\r\nEXEC\r\nCLUSTER SLOTS\r\n";
        for piece in [1, 3, 4096, replies.len()] {
            let (out, report, held) =
                through_in_pieces(requests, &replies, small(), piece).unwrap();
            assert!(
                out == want,
                "piece {piece}: {}",
                String::from_utf8_lossy(&out[out.len().saturating_sub(300)..])
            );
            assert_eq!(report.kinds, ["exec", "cluster_slots"], "piece {piece}");
            assert!(held <= SLOTS.len(), "held {held} bytes, piece {piece}");
        }
        // An EXEC reply of the wrong length is not rewritten at all; a null one (WATCH)
        // passes.
        let odd = [&b"+OK\r\n+QUEUED\r\n"[..], &array(&[SLOTS, SLOTS])].concat();
        let (out, report, _) =
            through_in_pieces(b"MULTI\r\nCLUSTER SLOTS\r\nEXEC\r\n", &odd, small(), 5).unwrap();
        assert_eq!(out, odd);
        assert_eq!(report.skipped, ["exec_length"]);
        let null = b"+OK\r\n+QUEUED\r\n*-1\r\n";
        let (out, _, _) =
            through_in_pieces(b"MULTI\r\nCLUSTER SLOTS\r\nEXEC\r\n", null, small(), 5).unwrap();
        assert_eq!(out, null);
    }

    #[test]
    fn replies_not_rewritten_pass_at_any_size_and_depth_but_topology_ones_are_bounded() {
        let line = |ty: u8| [&[ty][..], &vec![b'x'; 70_000], b"\r\n"].concat();
        let mut deep = b"*1\r\n".repeat(71);
        deep.extend_from_slice(b":1\r\n");
        for (request, reply) in [
            (&b"EVAL x 0\r\n"[..], line(b'-')),
            (b"EVAL x 0\r\n", line(b'+')),
            (b"EVAL x 0\r\n", deep.clone()),
            // Paired with a topology command, and still not of its shape.
            (b"CLUSTER SLOTS\r\n", line(b'-')),
            (b"CLUSTER SLOTS\r\n", deep.clone()),
            (
                // The error answers EVAL (sent while monitoring), the long status is a
                // monitor line.
                b"MONITOR\r\nEVAL x 0\r\n",
                [
                    &b"+OK\r\n+1733000000.123456 [0 127.0.0.1:5000] \"SET\" \"k\" \""[..],
                    &line(b'x')[1..],
                    &line(b'-'),
                ]
                .concat(),
            ),
        ] {
            for piece in [1000, reply.len()] {
                let (out, _, held) = through_in_pieces(request, &reply, small(), piece).unwrap();
                assert!(out == reply, "{}", String::from_utf8_lossy(request));
                assert!(held <= LINE_CAPTURE.max(deep.len()));
            }
        }
        // A reply to CLUSTER NODES too large to hold closes the connection: it would leak
        // every internal address if it went out as it is.
        let nodes = bulk(&vec![b'n'; 5000]);
        let e = through_in_pieces(b"CLUSTER NODES\r\n", &nodes, small(), 100).unwrap_err();
        assert_eq!(e, RespError::FrameTooLarge(4096));
        assert!(e.is_limit());
    }

    /// A reply that the pairing cannot place is never sent: the error line goes out in its
    /// place. Both are bytes Valkey 9.1 sends to a user whose ACL lacks the command: a MULTI
    /// refused with its reply skipped (the next command's reply is not `+QUEUED`), and a
    /// refused `CLIENT REPLY SKIP` (its error goes out, then nothing more: the commands
    /// behind it were taken as unanswered).
    #[test]
    fn a_reply_the_pairing_cannot_place_never_goes_out() {
        let nodes = bulk(b"e7d1 10.0.0.1:6379@16379 myself,master - 0 0 1 connected 0-16383\n");
        let line = |why: &str| {
            format!("-ERR shardgate-proxy lost track of which reply answers which command ({why}); closing the connection\r\n")
        };
        let refused = "MULTI refused, with commands sent behind it as if queued";
        for piece in [1, 7, 1000] {
            let requests = b"CLIENT REPLY SKIP\r\nMULTI\r\nCLUSTER NODES\r\nEXEC\r\n";
            let replies = [&nodes[..], b"-ERR EXEC without MULTI\r\n"].concat();
            let (out, ..) = through_in_pieces(requests, &replies, small(), piece).unwrap();
            assert_eq!(
                String::from_utf8_lossy(&out),
                line(refused),
                "piece {piece}"
            );
            // A command that answers a status line: it goes out (no address in it), and
            // the pairing gives up behind it.
            let requests = b"CLIENT REPLY SKIP\r\nMULTI\r\nSET k v\r\nCLUSTER NODES\r\n";
            let replies = [&b"+OK\r\n"[..], &nodes].concat();
            let (out, ..) = through_in_pieces(requests, &replies, small(), piece).unwrap();
            let want = format!("+OK\r\n{}", line(refused));
            assert_eq!(String::from_utf8_lossy(&out), want, "piece {piece}");
            let requests = b"CLIENT REPLY SKIP\r\nCLUSTER NODES\r\nGET k\r\n";
            let noperm =
                &b"-NOPERM User u has no permissions to run the 'client|reply' command\r\n"[..];
            let replies = [noperm, &nodes, b"$-1\r\n"].concat();
            let (out, ..) = through_in_pieces(requests, &replies, small(), piece).unwrap();
            let refused =
                "CLIENT REPLY OFF or SKIP refused, with commands sent behind it as if unanswered";
            let want = [noperm, line(refused).as_bytes()].concat();
            assert_eq!(
                out.escape_ascii().to_string(),
                want.escape_ascii().to_string()
            );
        }
    }

    #[test]
    fn a_long_transaction_is_bounded_and_its_exec_then_passes_unchanged() {
        use crate::resp::pairing::MAX_TRANSACTION_RUNS;
        let shared = Shared::new(true);
        let mut requests = RequestSide::new(Limits::default());
        requests.observe(b"MULTI\r\n", &shared).unwrap();
        let commands = b"GET k\r\nCLUSTER SLOTS\r\n".repeat(MAX_TRANSACTION_RUNS);
        requests.observe(&commands, &shared).unwrap();
        let entries = shared.pairing().entries();
        assert!(entries < MAX_PENDING / 2, "{entries} entries");
        requests
            .observe(b"EXEC\r\nCLUSTER SLOTS\r\n", &shared)
            .unwrap();
        let mut replies = b"+OK\r\n".to_vec();
        replies.extend(b"+QUEUED\r\n".repeat(2 * MAX_TRANSACTION_RUNS));
        let exec = [
            format!("*{}\r\n", 2 * MAX_TRANSACTION_RUNS).as_bytes(),
            &[&b"$-1\r\n"[..], SLOTS]
                .concat()
                .repeat(MAX_TRANSACTION_RUNS),
        ]
        .concat();
        replies.extend_from_slice(&exec);
        replies.extend_from_slice(SLOTS);
        let (mut out, mut report) = (vec![], Report::default());
        ReplySide::new(Limits::default())
            .process(&replies, &shared, &map(), &mut out, &mut report)
            .unwrap();
        let out = flatten(&replies, &out);
        assert!(out[..out.len() - SLOTS_REWRITTEN.len()] == replies[..replies.len() - SLOTS.len()]);
        assert!(out.ends_with(SLOTS_REWRITTEN));
        // A million GETs in a transaction are one run (and their +QUEUED replies another,
        // behind MULTI's own reply).
        let shared = Shared::new(true);
        let cmds = [
            &b"MULTI\r\n"[..],
            &b"GET k\r\n".repeat(1_000_000),
            b"CLUSTER SLOTS\r\n",
        ]
        .concat();
        requests.observe(&cmds, &shared).unwrap();
        assert_eq!(shared.pairing().entries(), 4);
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

    #[test]
    fn long_status_lines_while_monitoring_are_told_apart_by_their_first_bytes() {
        let long = |head: &str| {
            let mut l = format!("+{head}").into_bytes();
            l.extend_from_slice(&vec![b'x'; 5000]);
            l.extend_from_slice(b"\r\n");
            l
        };
        // A monitor line for a SET with a long value, then EVAL's long status, then the
        // CLUSTER SLOTS sent after EVAL: rewritten, because EVAL's reply was placed in band.
        let replies = [
            &b"+OK\r\n"[..],
            &long("1733000000.123456 [0 127.0.0.1:5000] \"SET\" \"k\" \""),
            &long("not a monitor line "),
            SLOTS,
        ]
        .concat();
        for piece in [7, 100, 2000, replies.len()] {
            let (out, report, _) = through_in_pieces(
                b"MONITOR\r\nEVAL x 0\r\nCLUSTER SLOTS\r\n",
                &replies,
                small(),
                piece,
            )
            .unwrap();
            let text = String::from_utf8_lossy(&out);
            assert!(!text.contains("10.0.0.1"), "piece {piece}: {text}");
            assert!(text.contains("127.0.77.70"), "piece {piece}");
            assert_eq!(report.kinds, ["cluster_slots"], "piece {piece}");
        }
    }

    use proptest::strategy::Strategy;

    const PLAIN_REPLIES: &[&[u8]] = &[b"+OK\r\n", b"$1\r\nx\r\n", b":7\r\n", b"$-1\r\n"];

    proptest::proptest! {
        /// Replies to a run of plain commands are skipped in a tight loop: with it on or
        /// off, any mix of commands and replies (several per read, cut anywhere) gives the
        /// same bytes out, the same report and the same pairing.
        #[test]
        fn the_plain_run_skip_gives_what_the_general_path_does(
            steps in proptest::collection::vec(
                (
                    proptest::bool::ANY,
                    proptest::collection::vec(
                        (proptest::sample::select(crate::resp::pairing::tests::REQUESTS), proptest::bool::ANY)
                            .prop_map(|(c, array)| if array {
                                crate::resp::pairing::tests::array_commands(c)
                            } else {
                                c.to_vec()
                            }),
                        1..4,
                    ),
                    proptest::collection::vec(
                        proptest::prop_oneof![
                            3 => proptest::sample::select(PLAIN_REPLIES),
                            1 => proptest::sample::select(crate::resp::pairing::tests::REPLIES),
                        ],
                        1..8,
                    ),
                    proptest::sample::select(&[0usize, 1, 3, 7, 1000][..]),
                ),
                1..24,
            ),
        ) {
            let run = |general: bool| {
                let shared = Shared::new(true);
                if general {
                    shared.pairing().general_only();
                }
                let mut requests = RequestSide::new(Limits::default());
                let mut replies = ReplySide::new(Limits::default());
                let (mut sent, mut report) = (vec![], Report::default());
                for (request, commands, frames, cut) in &steps {
                    if *request {
                        if requests.observe(&commands.concat(), &shared).is_err() {
                            break;
                        }
                        continue;
                    }
                    let bytes = frames.concat();
                    let (a, b) = bytes.split_at((*cut).min(bytes.len()));
                    for read in [a, b] {
                        let mut out = vec![];
                        let r = replies.process(read, &shared, &map(), &mut out, &mut report);
                        sent.extend_from_slice(&flatten(read, &out));
                        if r.is_err() || replies.lost().is_some() {
                            return (sent, report, format!("{r:?} {:?}", replies.lost()));
                        }
                    }
                }
                let pairing = format!("{:?}", *shared.pairing());
                (sent, report, pairing.replace("general_only: true", "general_only: false"))
            };
            let (fast, general) = (run(false), run(true));
            proptest::prop_assert_eq!(String::from_utf8_lossy(&fast.0), String::from_utf8_lossy(&general.0));
            proptest::prop_assert_eq!(fast.1, general.1);
            proptest::prop_assert_eq!(fast.2, general.2);
        }
    }
}
