//! The client→server direction: finds each command's name and first arguments as the bytes
//! stream past, without buffering them (a 512 MB SET streams through in buffer-sized
//! pieces). Both encodings are understood: RESP arrays of bulk strings and inline commands.

use super::scanner::short_header;
use super::RespError;

/// How many leading arguments (the name included) are kept.
pub const KEPT_ARGS: usize = 3;
/// Arguments longer than this are not kept (no command name, subcommand or INFO section
/// that the pairing looks at is: the longest are 12 bytes). Three of them are in every
/// rewriting connection's state, so that 16 rather than 32 is 64 bytes less per idle
/// connection (its request side one cache line shorter).
pub const KEPT_LEN: usize = 16;

/// One kept argument, lowercased, inline: a connection's command names cost no allocation.
#[derive(Debug, Clone, Copy)]
struct Kept {
    len: u8,
    bytes: [u8; KEPT_LEN],
    /// Longer than [`KEPT_LEN`]: no name we care about, so it matches nothing.
    too_long: bool,
}

impl Default for Kept {
    fn default() -> Self {
        Kept {
            len: 0,
            bytes: [0; KEPT_LEN],
            too_long: false,
        }
    }
}

/// Equal as arguments: the bytes past `len`, left from an earlier command, do not count.
impl PartialEq for Kept {
    fn eq(&self, other: &Kept) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for Kept {}

impl Kept {
    fn as_slice(&self) -> &[u8] {
        if self.too_long {
            // No command name or subcommand contains NUL.
            b"\0"
        } else {
            &self.bytes[..usize::from(self.len)]
        }
    }

    fn extend(&mut self, more: &[u8]) {
        let len = usize::from(self.len);
        match self.bytes.get_mut(len..len + more.len()) {
            Some(to) if !self.too_long => {
                for (t, b) in to.iter_mut().zip(more) {
                    *t = b.to_ascii_lowercase();
                }
                // Fits in a u8: the sum is at most KEPT_LEN.
                self.len = (len + more.len()) as u8;
            }
            _ => self.too_long = true,
        }
    }
}

/// A command's name and first arguments, lowercased.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Command {
    args: [Kept; KEPT_ARGS],
    /// The number of arguments, the name included.
    pub argc: u64,
}

const _: () = assert!(KEPT_LEN <= u8::MAX as usize);

impl Command {
    /// Argument `i` (0 is the name), lowercased; empty if absent, a NUL if too long to keep.
    pub fn arg(&self, i: usize) -> &[u8] {
        self.args.get(i).map_or(&[], Kept::as_slice)
    }

    pub fn name(&self) -> &[u8] {
        self.arg(0)
    }

    /// Whether the reply to this command depends on its arguments, so that they are worth
    /// keeping (the keys and values of data commands are not).
    fn wants_args(&self) -> bool {
        matches!(self.name(), b"cluster" | b"client" | b"info" | b"hello")
    }

    fn keep(&mut self, i: u64, bytes: &[u8]) {
        if let Some(a) = self.args.get_mut(i as usize) {
            a.extend(bytes);
        }
    }

    fn reset(&mut self) {
        for a in &mut self.args {
            a.len = 0;
            a.too_long = false;
        }
        self.argc = 0;
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Expecting `*` or an inline command.
    Start,
    /// In the `*<n>` line.
    Count,
    /// Expecting `$` for argument `i`.
    ArgType,
    /// In a `$<len>` line.
    ArgLen,
    /// In argument `i`'s payload; `left` counts its CRLF too.
    Arg { left: u64 },
    /// In an inline command's line.
    Inline,
    /// After bytes Valkey rejects (`doomed`), until it would say so.
    Doomed,
}

/// Where the scanner's commands go.
pub trait Commands {
    /// A command completed (or an empty one: `argc` 0).
    fn command(&mut self, cmd: &Command);

    /// Whether, in the present state, whole commands whose names
    /// [`Commands::plain_name`] accepts may be counted in bulk with [`Commands::plain`]
    /// rather than given one by one.
    fn counts_plain(&self) -> bool {
        false
    }

    /// Whether a command of this name (as it came, in any case) is one that
    /// [`Commands::plain`] may count.
    fn plain_name(_name: &[u8]) -> bool {
        false
    }

    /// `n` whole commands with plain names completed.
    fn plain(&mut self, _n: u64) {}
}

/// Every command given one by one to a closure.
#[cfg(any(test, feature = "test-util"))]
struct Each<F>(F);

#[cfg(any(test, feature = "test-util"))]
impl<F: FnMut(&Command)> Commands for Each<F> {
    fn command(&mut self, cmd: &Command) {
        (self.0)(cmd)
    }
}

/// The request scanner; one per connection.
#[derive(Debug)]
// `repr(C)`: what a read of whole plain commands touches comes first, in 56 bytes
// (`rewrite::stream::Rewriting` keeps them on one cache line).
#[repr(C)]
pub struct RequestScanner {
    /// Whole commands are read in one pass ([`RequestScanner::whole_command`]); off only
    /// in the test that holds that pass to the state machine.
    one_pass: bool,
    doomed_cr: bool,
    /// The current argument's CRLF is wrong.
    bad_terminator: bool,
    state: State,
    /// After an error the stream cannot be followed any more: every later call fails too.
    failed: Option<RespError>,
    max_line: usize,
    /// Arguments still to come, and the index of the current one.
    args_left: u64,
    index: u64,
    /// The error of [`State::Doomed`], and the bytes seen since. Boxed: rare, and inline it
    /// would take the request side past three cache lines.
    doomed: Option<Box<RespError>>,
    doomed_len: usize,
    line: Vec<u8>,
    cmd: Command,
}

impl Default for RequestScanner {
    fn default() -> Self {
        RequestScanner::new(64 * 1024)
    }
}

impl RequestScanner {
    /// Where the fields that a read of whole plain commands touches end (see the layout
    /// above).
    #[cfg(test)]
    pub(crate) const HOT_END: usize =
        std::mem::offset_of!(RequestScanner, max_line) + std::mem::size_of::<usize>();

    pub fn new(max_line: usize) -> Self {
        RequestScanner {
            one_pass: true,
            doomed_cr: false,
            bad_terminator: false,
            state: State::Start,
            failed: None,
            max_line,
            args_left: 0,
            index: 0,
            doomed: None,
            doomed_len: 0,
            line: Vec::new(),
            cmd: Command::default(),
        }
    }

    /// Consumes `buf`, calling `on_command` for every command that completes in it, and
    /// for every empty command (`*0`, `*-1`, an empty inline line: `argc` 0), which Valkey
    /// answers with nothing but which uses up a `CLIENT REPLY SKIP`.
    #[cfg(any(test, feature = "test-util"))]
    pub fn feed(&mut self, buf: &[u8], on_command: impl FnMut(&Command)) -> Result<(), RespError> {
        self.feed_to(buf, &mut Each(on_command))
    }

    /// As [`RequestScanner::feed`], the commands going to `to`, which may take runs of
    /// plain commands as counts.
    pub fn feed_to<C: Commands>(&mut self, buf: &[u8], to: &mut C) -> Result<(), RespError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        // Most reads are whole plain commands and nothing else (every read of a GET or a
        // SET at pipeline 1): counted here, without the state machine's loop and its
        // error handling (callgrind: 55 user-space instructions fewer per GET at pipeline 1).
        let mut from = 0;
        if self.state == State::Start && self.one_pass && to.counts_plain() {
            let (n, len) = self.plain_commands::<C>(buf);
            if n > 0 {
                to.plain(n);
                if len == buf.len() {
                    return Ok(());
                }
                from = len;
            }
        }
        // The rest from a command's start, as if it had come in a read of its own.
        let r = self.feed_inner(&buf[from..], to);
        if let Err(e) = &r {
            self.failed = Some(e.clone());
        }
        r
    }

    fn feed_inner<C: Commands>(&mut self, buf: &[u8], to: &mut C) -> Result<(), RespError> {
        let mut i = 0;
        while i < buf.len() {
            match self.state {
                State::Start => {
                    // Most commands arrive whole in one read: read in one pass, no state;
                    // most of those are plain (GET, SET), counted in one tight loop.
                    if self.one_pass {
                        if to.counts_plain() {
                            let (n, len) = self.plain_commands::<C>(&buf[i..]);
                            if n > 0 {
                                to.plain(n);
                                i += len;
                                continue;
                            }
                        }
                        self.cmd.reset();
                        if let Some(len) = self.whole_command(&buf[i..]) {
                            to.command(&self.cmd);
                            i += len;
                            continue;
                        }
                    }
                    self.cmd.reset();
                    self.line.clear();
                    if buf[i] == b'*' {
                        i += 1;
                        self.state = State::Count;
                    } else {
                        self.state = State::Inline;
                    }
                }
                State::Count | State::ArgLen | State::Inline => {
                    let Some(nl) = memchr::memchr(b'\n', &buf[i..]) else {
                        self.push_line(&buf[i..])?;
                        return Ok(());
                    };
                    let end = i + nl;
                    let r = if self.line.is_empty() {
                        // The whole line is in this buffer: no copy.
                        let line = &buf[i..end];
                        if line.len() > self.max_line {
                            return Err(RespError::LineTooLong(self.max_line));
                        }
                        match self.strip_cr(line)? {
                            Some(line) => self.line_done(line, to),
                            None => {
                                self.doom(invalid_length(line));
                                Ok(())
                            }
                        }
                    } else {
                        self.push_line(&buf[i..end])?;
                        let mut line = std::mem::take(&mut self.line);
                        let r = match self.strip_cr(&line)?.map(<[u8]>::len) {
                            Some(len) => {
                                line.truncate(len);
                                self.line_done(&line, to)
                            }
                            None => {
                                self.doom(invalid_length(&line));
                                Ok(())
                            }
                        };
                        line.clear();
                        self.line = line;
                        r
                    };
                    i = end + 1;
                    r?;
                }
                State::ArgType => {
                    if buf[i] != b'$' {
                        self.doom(RespError::Type(buf[i]));
                        continue;
                    }
                    i += 1;
                    self.state = State::ArgLen;
                }
                State::Doomed => {
                    // Valkey reports the error once a CR and the byte after it came (until
                    // then it waits for the line to end): so does the scanner, so that the
                    // bytes forwarded make Valkey answer with that error.
                    let cr_then_more = match memchr::memchr(b'\r', &buf[i..]) {
                        _ if self.doomed_cr => true,
                        Some(p) if i + p + 1 < buf.len() => true,
                        Some(_) => {
                            self.doomed_cr = true;
                            false
                        }
                        None => false,
                    };
                    if cr_then_more {
                        let e = self.doomed.take().map_or(RespError::Type(b'?'), |e| *e);
                        return Err(e);
                    }
                    self.doomed_len += buf.len() - i;
                    if self.doomed_len > self.max_line {
                        return Err(RespError::LineTooLong(self.max_line));
                    }
                    return Ok(());
                }
                State::Arg { left } => {
                    let take = ((buf.len() - i) as u64).min(left) as usize;
                    let payload_left = left.saturating_sub(2);
                    let keep = (take as u64).min(payload_left) as usize;
                    if keep > 0
                        && (self.index == 0
                            || (self.index < KEPT_ARGS as u64 && self.cmd.wants_args()))
                    {
                        self.cmd.keep(self.index, &buf[i..i + keep]);
                    }
                    // The CRLF after the payload must be there; Valkey checks it once both
                    // bytes came.
                    if super::scanner::check_terminator(&buf[i..i + take], left).is_err() {
                        self.bad_terminator = true;
                    }
                    i += take;
                    let left = left - take as u64;
                    if left > 0 {
                        self.state = State::Arg { left };
                        return Ok(());
                    }
                    if self.bad_terminator {
                        return Err(RespError::Terminator);
                    }
                    self.index += 1;
                    self.args_left -= 1;
                    if self.args_left == 0 {
                        to.command(&self.cmd);
                        self.state = State::Start;
                    } else {
                        self.state = State::ArgType;
                    }
                }
            }
        }
        Ok(())
    }

    /// The length of the command at the start of `buf` if it is there whole and in the
    /// form every client library sends (`*<n>`, then `$<len>` and the payload for each
    /// argument, numbers without sign or leading zero, every line ended by CRLF), with its
    /// name and kept arguments in `self.cmd`. `None` for anything else (a command split
    /// over reads, an inline command, anything Valkey would answer with an error), which
    /// the state machine then reads from the start, so both read every stream alike.
    #[inline]
    fn whole_command(&mut self, buf: &[u8]) -> Option<usize> {
        let cmd = &mut self.cmd;
        let (argc, len) = command_at(buf, self.max_line, |index, arg| {
            if index == 0 || (index < KEPT_ARGS as u64 && cmd.wants_args()) {
                cmd.keep(index, arg);
            }
            true
        })?;
        cmd.argc = argc;
        Some(len)
    }

    /// The whole commands at the start of `buf` that [`RequestScanner::whole_command`]
    /// reads and whose names `C` takes as plain: how many, and where they end.
    ///
    /// Out of line, so that the loop has the registers to itself: it is called once or
    /// twice per read.
    #[inline(never)]
    fn plain_commands<C: Commands>(&self, buf: &[u8]) -> (u64, usize) {
        // A line limit under three bytes would refuse the short headers: take every command
        // the long way.
        let short = self.max_line > 2;
        let (mut n, mut at) = (0, 0);
        loop {
            if short {
                let (k, len) = short_plain_commands::<C>(&buf[at..]);
                n += k;
                at += len;
                // The read ends with a whole command (as most do): nothing for the long way.
                if at == buf.len() {
                    return (n, at);
                }
            }
            match command_at(&buf[at..], self.max_line, |index, arg| {
                index > 0 || C::plain_name(arg)
            }) {
                Some((_, len)) => {
                    n += 1;
                    at += len;
                }
                None => return (n, at),
            }
        }
    }

    /// A line without its CR. A RESP header line (`*<n>`, `$<n>`) ends at its first CR,
    /// which Valkey requires to be followed by LF ("invalid CRLF in request"), and a header
    /// ended by a bare LF is no number ("invalid ... length"); an inline line ends at its LF,
    /// with the CR before it optional.
    ///
    /// `None` for a header with no CR: Valkey reads on to the next CR, and rejects it then.
    fn strip_cr<'l>(&self, line: &'l [u8]) -> Result<Option<&'l [u8]>, RespError> {
        if self.state == State::Inline {
            return Ok(Some(line.strip_suffix(b"\r").unwrap_or(line)));
        }
        match memchr::memchr(b'\r', line) {
            Some(cr) if cr + 1 == line.len() => Ok(Some(&line[..cr])),
            Some(_) => Err(RespError::Terminator),
            None => Ok(None),
        }
    }

    /// Valkey rejects what came with `e`, once a CR follows.
    fn doom(&mut self, e: RespError) {
        self.state = State::Doomed;
        self.doomed = Some(Box::new(e));
        self.doomed_len = 0;
    }

    fn push_line(&mut self, part: &[u8]) -> Result<(), RespError> {
        if self.line.len() + part.len() > self.max_line {
            return Err(RespError::LineTooLong(self.max_line));
        }
        self.line.extend_from_slice(part);
        Ok(())
    }

    fn line_done(&mut self, line: &[u8], to: &mut impl Commands) -> Result<(), RespError> {
        let invalid = invalid_length;
        match self.state {
            State::Count => {
                let n = header_number(line).ok_or_else(|| invalid(line))?;
                // A count of 0 or less is an empty command (no reply); one past `INT_MAX`
                // is a protocol error.
                if n <= 0 {
                    self.state = State::Start;
                    to.command(&self.cmd);
                    return Ok(());
                }
                if n > i64::from(i32::MAX) {
                    return Err(invalid(line));
                }
                let n = n.unsigned_abs();
                self.cmd.argc = n;
                self.args_left = n;
                self.index = 0;
                self.state = State::ArgType;
            }
            State::ArgLen => {
                let n = header_number(line)
                    .and_then(|n| u64::try_from(n).ok())
                    .ok_or_else(|| invalid(line))?;
                self.state = State::Arg {
                    left: n.saturating_add(2),
                };
            }
            State::Inline => {
                self.state = State::Start;
                // What Valkey 9 does with a NUL byte here is not sdssplitargs' (it answers
                // nothing at all): close rather than guess.
                if line.contains(&0) {
                    return Err(RespError::InlineNul);
                }
                // Unbalanced quotes: Valkey answers with a protocol error and closes the
                // connection, and runs nothing.
                let Some(words) = split_args(line) else {
                    return Ok(());
                };
                for (k, w) in words.iter().enumerate() {
                    if k == 0 || self.cmd.wants_args() {
                        self.cmd.keep(k as u64, w);
                    }
                }
                // An empty line is an empty command (no reply); a line of blanks is nothing
                // at all (it does not even use up a `CLIENT REPLY SKIP`).
                if !words.is_empty() || line.is_empty() {
                    self.cmd.argc = words.len() as u64;
                    to.command(&self.cmd);
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// The command at the start of `buf` if it is there whole in the form of
/// [`RequestScanner::whole_command`], each argument given to `arg` with its index, as long
/// as it says to go on: its argument count and length.
#[inline]
fn command_at(
    buf: &[u8],
    max_line: usize,
    mut arg: impl FnMut(u64, &[u8]) -> bool,
) -> Option<(u64, usize)> {
    let (argc, mut at) = header(buf, b'*', max_line)?;
    if argc == 0 || argc > i64::from(i32::MAX) as u64 {
        return None;
    }
    for index in 0..argc {
        let (len, payload) = header(buf.get(at..)?, b'$', max_line)?;
        let start = at + payload;
        let end = start.checked_add(usize::try_from(len).ok()?)?;
        if buf.get(end..end.checked_add(2)?)? != b"\r\n" || !arg(index, &buf[start..end]) {
            return None;
        }
        at = end + 2;
    }
    Some((argc, at))
}

/// The whole plain commands at the start of `buf` that [`short_plain_command`] takes: how
/// many, and where they end. A loop of its own, with nothing else to keep in registers.
#[inline(always)]
fn short_plain_commands<C: Commands>(buf: &[u8]) -> (u64, usize) {
    let (mut n, mut at) = (0, 0);
    while let Some(len) = short_plain_command::<C>(&buf[at..]) {
        n += 1;
        at += len;
    }
    (n, at)
}

/// The length of the whole plain command at the start of `buf` when every header in it has
/// one or two digits, and it is followed by at least one byte: what [`command_at`] with a
/// plain name gives then, in fewer steps (one window per header, no sums that can
/// overflow). `None` when unsure, for [`command_at`] to decide; never for a command it
/// would take otherwise. The line limit must be 3 or more.
#[inline(always)]
fn short_plain_command<C: Commands>(buf: &[u8]) -> Option<usize> {
    let (argc, mut at) = short_header(buf, 0, b'*')?;
    if argc == 0 {
        return None;
    }
    let (len, head) = short_header(buf, at, b'$')?;
    let (start, end) = (at + head, at + head + len);
    if buf.get(end..end + 2)? != b"\r\n" || !C::plain_name(buf.get(start..end)?) {
        return None;
    }
    at = end + 2;
    for _ in 1..argc {
        let (len, head) = short_header(buf, at, b'$')?;
        let end = at + head + len;
        if buf.get(end..end + 2)? != b"\r\n" {
            return None;
        }
        at = end + 2;
    }
    Some(at)
}

/// A `<ty><digits>\r\n` header at the start of `buf`, its digits a number without sign
/// or leading zero (`0` alone excepted) that fits in 18 digits, its line no longer than
/// `max_line`: the number and the header's length. `None` for anything else, and for a
/// header not all in `buf`.
#[inline(always)]
fn header(buf: &[u8], ty: u8, max_line: usize) -> Option<(u64, usize)> {
    // Nearly every header has one or two digits: read here, in the caller's loop; the
    // rest out of line.
    match *buf {
        [t, d @ b'0'..=b'9', b'\r', b'\n', ..] if t == ty && max_line > 1 => {
            Some((u64::from(d - b'0'), 4))
        }
        [t, d1 @ b'1'..=b'9', d2 @ b'0'..=b'9', b'\r', b'\n', ..] if t == ty && max_line > 2 => {
            Some((u64::from((d1 - b'0') * 10 + (d2 - b'0')), 5))
        }
        _ => long_header(buf, ty, max_line),
    }
}

/// [`header`] for any number of digits.
#[inline(never)]
fn long_header(buf: &[u8], ty: u8, max_line: usize) -> Option<(u64, usize)> {
    let rest = buf.strip_prefix(&[ty])?;
    let mut n: u64 = 0;
    let mut digits = 0;
    for &b in rest.iter().take(19) {
        if !b.is_ascii_digit() {
            break;
        }
        n = n * 10 + u64::from(b - b'0');
        digits += 1;
    }
    let valid = (1..=18).contains(&digits)
        && (rest.first() != Some(&b'0') || digits == 1)
        && rest.get(digits..digits + 2)? == b"\r\n"
        // The state machine's line: the digits and the CR.
        && digits < max_line;
    valid.then_some((n, digits + 3))
}

fn invalid_length(line: &[u8]) -> RespError {
    RespError::Length(String::from_utf8_lossy(line).into_owned())
}

/// A header's number as Valkey reads it (`string2ll`): an optional `-`, then digits with
/// no leading zero (`0` alone excepted), within an `i64`. `None` is Valkey's "invalid
/// multibulk length" or "invalid bulk length".
fn header_number(line: &[u8]) -> Option<i64> {
    let (negative, digits) = match line.strip_prefix(b"-") {
        Some(rest) => (true, rest),
        None => (false, line),
    };
    match digits {
        [] => return None,
        [b'0'] if negative => return None,
        [b'0', _, ..] => return None,
        _ => {}
    }
    let mut n: i64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        let d = i64::from(d - b'0');
        n = n.checked_mul(10).and_then(|n| {
            if negative {
                n.checked_sub(d)
            } else {
                n.checked_add(d)
            }
        })?;
    }
    Some(n)
}

/// Whether Valkey itself rejects a request stream that the scanner failed on with `e`, at
/// the same command, with a protocol error of its own ("invalid multibulk length", "invalid
/// bulk length", "expected '$', got ...", "invalid CRLF in request") after which it runs
/// nothing and closes. Such a stream can be forwarded as it is, so that the client gets
/// Valkey's own error line, as a direct connection does.
pub fn valkey_rejects(e: &RespError) -> bool {
    matches!(
        e,
        RespError::Type(_) | RespError::Length(_) | RespError::Terminator
    )
}

/// Splits an inline command into its arguments as Valkey 9 does (`sdssplitargs`): blanks
/// between arguments; within one, `"..."` with the `\xHH`, `\n`, `\r`, `\t`, `\b`, `\a`
/// and `\<c>` escapes, and `'...'` with `\'`, glued to what is next to them (`"a"b` is
/// `ab`). `None` for unbalanced quotes (Valkey answers "Protocol error: unbalanced quotes"
/// and runs nothing).
fn split_args(line: &[u8]) -> Option<Vec<Vec<u8>>> {
    let at = |i: usize| line.get(i).copied();
    let hex = |b: Option<u8>| b.and_then(|b| char::from(b).to_digit(16)).map(|d| d as u8);
    // `isspace`: space, \t, \n, \v, \f, \r.
    let blank = |b: u8| matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r');
    let mut args = Vec::new();
    let mut p = 0;
    loop {
        while at(p).is_some_and(blank) {
            p += 1;
        }
        if at(p).is_none() {
            return Some(args);
        }
        let mut current = Vec::new();
        // The quote in force, if any.
        let mut quote = None;
        loop {
            let Some(c) = at(p) else {
                if quote.is_some() {
                    return None;
                }
                break;
            };
            match quote {
                Some(b'"') => {
                    if let (b'\\', Some(b'x'), Some(h), Some(l)) =
                        (c, at(p + 1), hex(at(p + 2)), hex(at(p + 3)))
                    {
                        current.push(h * 16 + l);
                        p += 3;
                    } else if let (b'\\', Some(e)) = (c, at(p + 1)) {
                        p += 1;
                        current.push(match e {
                            b'n' => b'\n',
                            b'r' => b'\r',
                            b't' => b'\t',
                            b'b' => 0x08,
                            b'a' => 0x07,
                            other => other,
                        });
                    } else if c == b'"' {
                        quote = None;
                    } else {
                        current.push(c);
                    }
                }
                Some(_) => {
                    if c == b'\\' && at(p + 1) == Some(b'\'') {
                        p += 1;
                        current.push(b'\'');
                    } else if c == b'\'' {
                        quote = None;
                    } else {
                        current.push(c);
                    }
                }
                None => match c {
                    b' ' | b'\n' | b'\r' | b'\t' => break,
                    b'"' | b'\'' => quote = Some(c),
                    _ => current.push(c),
                },
            }
            p += 1;
        }
        args.push(current);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every buffer of a type byte and up to `n` bytes from `bytes`.
    pub(crate) fn every_buffer(first: u8, bytes: &[u8], n: u32, mut each: impl FnMut(&[u8])) {
        let mut buf = Vec::new();
        for len in 0..=n {
            for mut code in 0..bytes.len().pow(len) {
                buf.clear();
                buf.push(first);
                for _ in 0..len {
                    buf.push(bytes[code % bytes.len()]);
                    code /= bytes.len();
                }
                each(&buf);
            }
        }
    }

    /// The header's inline arms read what its general reading does: every header-like
    /// buffer of up to six bytes after the type byte, of either type, under each small line
    /// limit (the property tests below give no limit of 0).
    #[test]
    fn a_header_reads_alike_inline_and_out_of_line() {
        for first in [b'*', b'$'] {
            every_buffer(first, b"019-\r\nx", 6, |buf| {
                for ty in [b'*', b'$'] {
                    for max_line in [0, 1, 2, 3, 64] {
                        assert_eq!(
                            header(buf, ty, max_line),
                            long_header(buf, ty, max_line),
                            "{:?} as {} under {max_line}",
                            String::from_utf8_lossy(buf),
                            ty as char
                        );
                    }
                }
            });
        }
        // Hand-read: two digits, a leading zero, a line one byte too long.
        assert_eq!(header(b"$16\r\nkey", b'$', 64), Some((16, 5)));
        assert_eq!(header(b"*05\r\n", b'*', 64), None);
        assert_eq!(header(b"$16\r\n", b'$', 2), None);
        assert_eq!(header(b"$16\r\n", b'$', 3), Some((16, 5)));
    }

    /// The short header reads what the header does, or leaves it to it: every header-like
    /// buffer of up to six bytes after the type byte. It takes every one- and two-digit
    /// header with a byte after it, so that the short path is the one commands take.
    #[test]
    fn a_short_header_reads_as_the_header() {
        for first in [b'*', b'$'] {
            every_buffer(first, b"019-\r\nx", 6, |buf| {
                for ty in [b'*', b'$'] {
                    let long = header(buf, ty, 3);
                    match short_header(buf, 0, ty) {
                        Some((n, len)) => assert_eq!(long, Some((n as u64, len))),
                        None => assert!(
                            long.is_none_or(|(n, len)| n > 99 || buf.len() <= len),
                            "{:?} left to the header",
                            String::from_utf8_lossy(buf)
                        ),
                    }
                }
            });
        }
        // Hand-read: at an offset, a leading zero, no byte after the header.
        assert_eq!(short_header(b"xx$16\r\nk", 2, b'$'), Some((16, 5)));
        assert_eq!(short_header(b"*05\r\nk", 0, b'*'), None);
        assert_eq!(short_header(b"$3\r\n", 0, b'$'), None);
    }

    /// A pipeline of plain commands with one- and two-digit headers goes the short way
    /// whole, up to the command cut off by the read.
    #[test]
    fn plain_commands_go_the_short_way() {
        use crate::resp::pairing::Pairing;
        let get = b"*2\r\n$3\r\nGET\r\n$16\r\nkey:__rand_int__\r\n";
        let set = b"*3\r\n$3\r\nset\r\n$1\r\nk\r\n$10\r\n0123456789\r\n";
        let read = [&get[..], set, get, &set[..9]].concat();
        assert_eq!(short_plain_commands::<Pairing>(&read), (3, 36 + 37 + 36));
        // A looked-at name stops it.
        let read = [&get[..], b"*2\r\n$7\r\nCLUSTER\r\n$5\r\nslots\r\n"].concat();
        assert_eq!(short_plain_commands::<Pairing>(&read), (1, 36));
    }

    /// (name, first argument, argument count) of each command.
    type Seen = Vec<(Vec<u8>, Vec<u8>, u64)>;

    fn commands(input: &[u8], cuts: &[usize]) -> Result<Seen, RespError> {
        let mut s = RequestScanner::default();
        let mut out = vec![];
        let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
        bounds.push(input.len());
        bounds.sort_unstable();
        let mut start = 0;
        for b in bounds {
            s.feed(&input[start..b], |c| {
                out.push((c.name().to_vec(), c.arg(1).to_vec(), c.argc))
            })?;
            start = b;
        }
        Ok(out)
    }

    type EveryArg = (Vec<(Vec<Vec<u8>>, u64)>, Result<(), RespError>);

    /// Every kept argument and the count of each command, and how the stream ended, fed in
    /// two reads cut at `split`, lines up to `max_line`, with the one-pass read on or off.
    fn every_arg(input: &[u8], split: usize, max_line: usize, one_pass: bool) -> EveryArg {
        let mut s = RequestScanner::new(max_line);
        s.one_pass = one_pass;
        let mut out = vec![];
        let mut note =
            |c: &Command| out.push(((0..KEPT_ARGS).map(|i| c.arg(i).to_vec()).collect(), c.argc));
        let (a, b) = input.split_at(split);
        let r = s.feed(a, &mut note).and_then(|()| s.feed(b, &mut note));
        (out, r)
    }

    /// A command as a client sends it, or something near it: odd numbers, a missing CR,
    /// an inline command, an empty one.
    fn request_piece() -> impl Strategy<Value = Vec<u8>> {
        let arg = prop_oneof![
            Just(b"CLUSTER".to_vec()),
            Just(b"client".to_vec()),
            Just(b"INFO".to_vec()),
            Just(b"nodes".to_vec()),
            Just(b"reply".to_vec()),
            Just(b"get".to_vec()),
            Just(b"MULTI".to_vec()),
            Just(b"exec".to_vec()),
            Just(b"Reset".to_vec()),
            Just(b"subscribe".to_vec()),
            Just(b"off".to_vec()),
            Just(vec![]),
            proptest::collection::vec(any::<u8>(), 0..48),
        ];
        let number = prop_oneof![
            4 => Just(None),
            1 => prop_oneof![
                Just("0".to_string()),
                Just("01".to_string()),
                Just("-1".to_string()),
                Just("+2".to_string()),
                Just("99999999999999999999".to_string()),
                Just("1 ".to_string()),
            ].prop_map(Some),
        ];
        prop_oneof![
            4 => (proptest::collection::vec((arg, number.clone()), 1..5), number).prop_map(|(args, count)| {
                let mut v = format!("*{}\r\n", count.unwrap_or_else(|| args.len().to_string())).into_bytes();
                for (a, len) in args {
                    v.extend(format!("${}\r\n", len.unwrap_or_else(|| a.len().to_string())).bytes());
                    v.extend(a);
                    v.extend(b"\r\n");
                }
                v
            }),
            1 => Just(b"*0\r\n".to_vec()),
            1 => Just(b"*-1\r\n".to_vec()),
            1 => Just(b"PING\r\n".to_vec()),
            1 => Just(b"client reply off\n".to_vec()),
            1 => Just(b"*1\n$4\r\nPING\r\n".to_vec()),
        ]
    }

    /// The pieces one after the other, one byte of them replaced if `flip` says so.
    fn flipped(pieces: &[Vec<u8>], flip: Option<(prop::sample::Index, u8)>) -> Vec<u8> {
        let mut input = pieces.concat();
        if let Some((at, byte)) = flip {
            let at = at.index(input.len());
            input[at] = byte;
        }
        input
    }

    const PIPELINE: &[u8] = b"*2\r\n$7\r\nCLUSTER\r\n$5\r\nSLOTS\r\n*3\r\n$3\r\nSET\r\n$3\r\nkey\r\n$10\r\n0123456789\r\nPING\r\n  cluster   nodes  \r\n*1\r\n$5\r\nMULTI\r\n";

    #[test]
    fn names_and_subcommands_of_a_pipeline() {
        let want: Vec<(Vec<u8>, Vec<u8>, u64)> = vec![
            (b"cluster".to_vec(), b"slots".to_vec(), 2),
            // A data command's key is not kept: its reply never depends on it.
            (b"set".to_vec(), vec![], 3),
            (b"ping".to_vec(), vec![], 1),
            (b"cluster".to_vec(), b"nodes".to_vec(), 2),
            (b"multi".to_vec(), vec![], 1),
        ];
        assert_eq!(commands(PIPELINE, &[]).unwrap(), want);
        assert_eq!(
            commands(b"*1\r\n$4\r\nMULTI\r\n", &[]),
            Err(RespError::Terminator)
        );
        assert!(commands(b"*1\r\n+PING\r\n", &[]).is_err());
    }

    /// The headers Valkey 9.1 accepts, skips and rejects, as it answered them (a rejection
    /// is "-ERR Protocol error: ..." and a close; a skip is no reply at all).
    #[test]
    fn headers_are_read_as_valkey_reads_them() {
        let (empty, ping) = ((vec![], vec![], 0), (b"ping".to_vec(), vec![], 1));
        // Empty commands: a count of 0 or less.
        for skipped in [&b"*0\r\n"[..], b"*-1\r\n", b"*-5\r\n"] {
            let mut input = skipped.to_vec();
            input.extend_from_slice(b"*1\r\n$4\r\nPING\r\n");
            assert_eq!(
                commands(&input, &[]),
                Ok(vec![empty.clone(), ping.clone()]),
                "{input:?}"
            );
        }
        // Rejected, each with the error Valkey's own rejection is recognised by.
        for (input, msg) in [
            (&b"*00\r\n"[..], "invalid multibulk length"),
            (b"*-0\r\n", "invalid multibulk length"),
            (b"*+1\r\n", "invalid multibulk length"),
            (b"*abc\r\n", "invalid multibulk length"),
            (b"*2147483648\r\n", "invalid multibulk length"),
            (b"*1 \r\n", "invalid multibulk length"),
            (b"*1\n$4\r\nPING\r\n", "invalid multibulk length"),
            (b"*1\r\n$abc\r\n", "invalid bulk length"),
            (b"*1\r\n$04\r\nPING\r\n", "invalid bulk length"),
            (b"*1\r\n$-1\r\n", "invalid bulk length"),
            (b"*1\r\n$\r\n", "invalid bulk length"),
            (b"*1\r\n+PING\r\n", "expected '$', got '+'"),
            (b"*1\rX$4\r\nPING\r\n", "invalid CRLF in request"),
            (b"*1\r\n$4\rXPING\r\n", "invalid CRLF in request"),
            (b"*1\r\n$4\r\nPINGxx\r\n", "invalid CRLF in request"),
        ] {
            let e = commands(input, &[]).expect_err(msg);
            assert!(valkey_rejects(&e), "{msg}: {e}");
        }
        // Valkey says so only once the CR that ends the bad line (or both bytes of a bad
        // CRLF) came: until then, neither does the scanner (found by the differential
        // fuzzer: the proxy gave up, and shut the backend's side, before Valkey answered).
        for (first, rest) in [
            (&b"*1\r\n+PI"[..], &b"NG\r\n"[..]),
            (b"*1\r\n+PING\r", b"\n"),
            (b"*1\n$4", b"\r\nPING\r\n"),
            (b"*1\r\n$4\r\nPINGx", b"x"),
        ] {
            let mut s = RequestScanner::default();
            assert_eq!(s.feed(first, |_| {}), Ok(()), "{first:?}");
            let e = s.feed(rest, |_| {}).expect_err("rejected");
            assert!(valkey_rejects(&e), "{e}");
        }
        // Accepted: the largest count (Valkey then waits for the arguments).
        assert_eq!(commands(b"*2147483647\r\n", &[]), Ok(vec![]));
        assert_eq!(header_number(b"-9223372036854775808"), Some(i64::MIN));
        assert_eq!(header_number(b"9223372036854775808"), None);
    }

    #[test]
    fn inline_commands_are_split_as_valkey_splits_them() {
        let one = |line: &[u8]| commands(line, &[]).unwrap();
        assert_eq!(
            one(b"\"CLUSTER\" 'nodes'\r\n"),
            vec![(b"cluster".to_vec(), b"nodes".to_vec(), 2)]
        );
        assert_eq!(
            one(b"client \"re\\x70ly\" \"OFF\"\n"),
            vec![(b"client".to_vec(), b"reply".to_vec(), 3)]
        );
        // One argument with a blank in it; an escaped quote.
        assert_eq!(
            one(b"GET \"a b\" 'it\\'s'\r\n"),
            vec![(b"get".to_vec(), vec![], 3)]
        );
        // Unbalanced quotes: Valkey runs nothing. Quotes glue to what is next to them.
        assert!(one(b"GET \"a\r\n").is_empty());
        assert_eq!(
            one(b"CLUSTER n\"od\"'es'\r\n"),
            vec![(b"cluster".to_vec(), b"nodes".to_vec(), 2)]
        );
        assert_eq!(commands(b"ECHO a\0b\r\n", &[]), Err(RespError::InlineNul));
        // Blank lines are no command; a vertical tab is a blank between arguments only.
        assert!(one(b" \t \r\n").is_empty());
        assert_eq!(one(b"\x0bPING\r\n"), vec![(b"ping".to_vec(), vec![], 1)]);
    }

    #[test]
    fn after_an_error_every_call_fails() {
        let mut s = RequestScanner::default();
        assert!(s.feed(b"*x\r\n", |_| {}).is_err());
        assert!(s
            .feed(b"PING\r\n", |_| panic!("a command after an error"))
            .is_err());
    }

    proptest! {
        #[test]
        fn any_split_gives_the_same_commands(cuts in proptest::collection::vec(0usize..200, 0..10)) {
            prop_assert_eq!(commands(PIPELINE, &cuts).unwrap(), commands(PIPELINE, &[]).unwrap());
        }

        /// Whole commands are read in one pass (`whole_command`), anything else by the
        /// state machine: with the pass on or off, a stream gives the same commands and
        /// fails at the same point, valid RESP or not, whole or cut in two.
        #[test]
        fn the_one_pass_read_agrees_with_the_state_machine(
            pieces in proptest::collection::vec(request_piece(), 1..8),
            flip in proptest::option::of((any::<prop::sample::Index>(), any::<u8>())),
            cut in proptest::option::of(any::<prop::sample::Index>()),
            split in any::<prop::sample::Index>(),
            max_line in prop_oneof![Just(1usize), Just(2), Just(3), Just(40)],
        ) {
            let mut input = flipped(&pieces, flip);
            if let Some(cut) = cut {
                input.truncate(cut.index(input.len() + 1));
            }
            let split = split.index(input.len() + 1);
            prop_assert_eq!(
                every_arg(&input, split, max_line, true),
                every_arg(&input, split, max_line, false),
                "{:?}",
                String::from_utf8_lossy(&input)
            );
        }

        /// Runs of plain commands are counted in one loop (`plain_commands`) when the
        /// pairing takes them so: on any stream, valid or not, whole or cut in two, with
        /// any `max_line`, the pairing ends as when every command is given to it, and the
        /// reads fail alike.
        #[test]
        fn counting_plain_commands_leaves_the_pairing_as_one_by_one(
            pieces in proptest::collection::vec(request_piece(), 1..8),
            flip in proptest::option::of((any::<prop::sample::Index>(), any::<u8>())),
            split in any::<prop::sample::Index>(),
            max_line in prop_oneof![Just(1usize), Just(2), Just(3), Just(40)],
        ) {
            use crate::resp::pairing::Pairing;
            let input = flipped(&pieces, flip);
            let (a, b) = input.split_at(split.index(input.len() + 1));
            let run = |general: bool| {
                let mut pairing = Pairing::new(true);
                if general {
                    pairing.general_only();
                }
                let mut s = RequestScanner::new(max_line);
                let reads = [a, b].map(|read| s.feed_to(read, &mut pairing));
                let state = format!("{pairing:?}").replace("general_only: true", "general_only: false");
                (reads, state)
            };
            prop_assert_eq!(run(false), run(true), "{:?}", String::from_utf8_lossy(&input));
        }

        /// A command the short path takes is one the general reading takes, with the same
        /// length, under any line limit of 3 or more.
        #[test]
        fn the_short_path_takes_what_the_general_one_does(
            pieces in proptest::collection::vec(request_piece(), 1..4),
            flip in proptest::option::of((any::<prop::sample::Index>(), any::<u8>())),
            cut in proptest::option::of(any::<prop::sample::Index>()),
            max_line in prop_oneof![Just(3usize), Just(4), Just(40)],
        ) {
            use crate::resp::pairing::Pairing;
            let mut input = flipped(&pieces, flip);
            if let Some(cut) = cut {
                input.truncate(cut.index(input.len() + 1));
            }
            if let Some(len) = short_plain_command::<Pairing>(&input) {
                let general = command_at(&input, max_line, |index, arg| {
                    index > 0 || Pairing::plain_name(arg)
                });
                prop_assert_eq!(general.map(|(_, len)| len), Some(len), "{:?}", String::from_utf8_lossy(&input));
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256), cuts in proptest::collection::vec(0usize..300, 0..4)) {
            let _ = commands(&bytes, &cuts);
        }
    }
}
