//! A resumable RESP2/RESP3 frame scanner.
//!
//! It finds where each top-level frame ends without building it: lines are found with
//! `memchr`, bulk payloads are skipped by their length, and aggregates are a stack of
//! element counts. The state survives between calls, so when a frame is split over many
//! reads each byte is looked at once, never re-parsed from the frame's start (the decoders
//! of redis-protocol restart from the beginning, which is quadratic on a large reply that
//! arrives in small pieces).
//!
//! Memory is bounded whatever the frame: the text of simple lines (strings, errors,
//! numbers) is never kept, so they pass at any length; only headers (lengths and counts)
//! are kept while split across reads, and a header longer than `max_line` is an error (a
//! length or count has at most 18 digits here, as in the frame parser). Aggregates nested
//! deeper than [`MAX_DEPTH`] are refused: the stack of counts is the one thing that grows
//! with the input.
//!
//! [`Scanner::scan_parts`] also stops inside a top-level aggregate, after its header and
//! after each of its elements, so that a caller can keep some elements and let the others
//! stream (a pub/sub message is known by its first element, an EXEC reply's topology
//! elements are its only ones rewritten).

/// Aggregates nested deeper than this are refused. Valkey's own replies nest a few levels,
/// but a script's reply nests as deep as its Lua tables (bounded by Lua's stack, a few
/// thousand); each level costs 16 bytes here.
pub const MAX_DEPTH: usize = 8192;

/// Why a byte stream is not RESP.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RespError {
    #[error("invalid RESP type byte {0:#04x}")]
    Type(u8),
    #[error("invalid length or count {0:?}")]
    Length(String),
    #[error("line longer than {0} bytes")]
    LineTooLong(usize),
    #[error("missing CRLF after a bulk payload")]
    Terminator,
    #[error("line not terminated by CRLF")]
    BareLf,
    #[error("aggregates nested deeper than {MAX_DEPTH}")]
    TooDeep,
    #[error("RESP3 streamed aggregates are not supported")]
    Streamed,
    /// A reply held to be rewritten (a topology reply) grew past the limit.
    #[error("a reply to rewrite larger than {0} bytes")]
    FrameTooLarge(usize),
    /// Valkey's answer to such a line could not be foretold: the connection is closed
    /// rather than paired by guess.
    #[error("NUL byte in an inline command")]
    InlineNul,
}

impl RespError {
    /// Whether the bytes may be valid RESP that merely goes past one of the proxy's limits
    /// (as opposed to bytes that are not RESP at all): said so in logs and metrics, never
    /// called "invalid".
    pub fn is_limit(&self) -> bool {
        matches!(self, RespError::TooDeep | RespError::FrameTooLarge(_))
    }
}

/// The outcome of one [`Scanner::scan`] call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scan {
    /// The top-level frame in progress ends at `end` (exclusive, an index into the buffer
    /// passed); the scanner is ready for the next frame.
    Complete { end: usize },
    /// Every byte from `from` was consumed; the frame goes on in the next buffer.
    Incomplete,
}

/// The outcome of one [`Scanner::scan_parts`] call: like [`Scan`], with two more stops
/// inside a top-level aggregate (`*`, `>`, `~`, `%`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The aggregate's header ends at `end`; `count` elements follow (a map's count is
    /// its keys plus its values).
    Header {
        end: usize,
        count: u64,
    },
    /// One of its elements, not the last, ends at `end`.
    Element {
        end: usize,
    },
    /// The frame ends at `end` (for an aggregate: with its last element).
    Complete {
        end: usize,
    },
    Incomplete,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Expecting a type byte.
    Type,
    /// Inside a line that started with `ty`. `cr`: whether the last byte seen of it was CR
    /// (the text of a simple line is not kept, only whether it ends in CRLF).
    Line { ty: u8, cr: bool },
    /// Skipping a payload; `left` counts the trailing CRLF too.
    Payload { left: u64 },
}

/// What finishing a line or an element did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    More,
    /// The top-level frame is complete.
    Frame,
    /// An element directly inside the top-level aggregate is complete (not its last).
    Element,
    /// The top-level aggregate's header is complete.
    Header(u64),
}

#[derive(Debug, Clone, Copy)]
struct Open {
    /// Elements still expected.
    left: u64,
    /// An attribute (`|`) precedes the element it annotates and is not an element itself.
    attribute: bool,
}

/// The scanner; one per direction per connection.
#[derive(Debug, Clone)]
// `repr(C)`: what a read of whole plain replies touches comes first
// (`rewrite::stream::Rewriting` keeps it on one cache line).
#[repr(C)]
pub struct Scanner {
    /// Whether some bytes of a top-level frame have been seen.
    in_frame: bool,
    /// A top-level bulk string or line that is all in the buffer is read in one pass
    /// ([`whole_line_or_bulk`]); off only in the test that holds that pass to the state machine.
    one_pass: bool,
    /// After an error the stream cannot be followed any more: every later call fails too.
    failed: Option<RespError>,
    max_line: usize,
    state: State,
    stack: Vec<Open>,
    /// The start of a header line split across buffers.
    line: Vec<u8>,
}

impl Default for Scanner {
    fn default() -> Self {
        Scanner::new(64 * 1024)
    }
}

impl Scanner {
    /// Where the fields that a read of whole plain replies touches end (see the layout
    /// above).
    #[cfg(test)]
    pub(crate) const HOT_END: usize =
        std::mem::offset_of!(Scanner, max_line) + std::mem::size_of::<usize>();

    pub fn new(max_line: usize) -> Self {
        Scanner {
            in_frame: false,
            one_pass: true,
            failed: None,
            max_line,
            state: State::Type,
            stack: Vec::new(),
            line: Vec::new(),
        }
    }

    /// Whether a top-level frame is in progress (its first byte has been seen).
    pub fn in_frame(&self) -> bool {
        self.in_frame
    }

    /// The bytes still to come of a top-level bulk string whose header has been read, its
    /// CRLF included: what a capture of it can reserve at once.
    pub fn top_payload_left(&self) -> Option<u64> {
        match self.state {
            State::Payload { left } if self.stack.is_empty() => Some(left),
            _ => None,
        }
    }

    /// Scans `buf[from..]`, continuing the frame in progress, and stops at the end of the
    /// first top-level frame that completes.
    pub fn scan(&mut self, buf: &[u8], from: usize) -> Result<Scan, RespError> {
        Ok(match self.scan_checked(buf, from, false)? {
            Part::Complete { end } => Scan::Complete { end },
            // Not returned without `parts`.
            Part::Incomplete | Part::Header { .. } | Part::Element { .. } => Scan::Incomplete,
        })
    }

    /// As [`Scanner::scan`], and stops also at the end of a top-level aggregate's header
    /// and of each of its elements.
    pub fn scan_parts(&mut self, buf: &[u8], from: usize) -> Result<Part, RespError> {
        self.scan_checked(buf, from, true)
    }

    fn scan_checked(&mut self, buf: &[u8], from: usize, parts: bool) -> Result<Part, RespError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let r = self.scan_inner(buf, from, parts);
        if let Err(e) = &r {
            self.failed = Some(e.clone());
        }
        r
    }

    fn scan_inner(&mut self, buf: &[u8], from: usize, parts: bool) -> Result<Part, RespError> {
        let mut i = from;
        while i < buf.len() {
            let step = match self.state {
                State::Type => {
                    // Most replies are a bulk string (GET's) all in one read.
                    if self.one_pass && self.stack.is_empty() {
                        if let Some(end) = whole_line_or_bulk(&buf[i..], self.max_line) {
                            // It may end a frame begun with an attribute.
                            self.in_frame = false;
                            return Ok(Part::Complete { end: i + end });
                        }
                    }
                    let ty = buf[i];
                    i += 1;
                    self.in_frame = true;
                    self.state = State::Line { ty, cr: false };
                    self.line.clear();
                    if !is_type(ty) {
                        return Err(RespError::Type(ty));
                    }
                    Step::More
                }
                State::Line { ty, cr } => {
                    let rest = &buf[i..];
                    let Some(nl) = memchr::memchr(b'\n', rest) else {
                        if is_simple(ty) {
                            let cr = rest.last().map_or(cr, |&b| b == b'\r');
                            self.state = State::Line { ty, cr };
                        } else {
                            self.push_line(rest)?;
                        }
                        return Ok(Part::Incomplete);
                    };
                    let end = i + nl;
                    let step = if is_simple(ty) {
                        // The byte before LF: in this buffer, or the last one of the line's
                        // earlier part (`cr` stays false for a line with no bytes yet).
                        let ends_cr = if nl > 0 { rest[nl - 1] == b'\r' } else { cr };
                        if !ends_cr {
                            return Err(RespError::BareLf);
                        }
                        self.state = State::Type;
                        self.element_done()
                    } else if self.line.is_empty() {
                        self.header_done(ty, &rest[..nl])?
                    } else {
                        self.push_line(&rest[..nl])?;
                        let line = std::mem::take(&mut self.line);
                        let r = self.header_done(ty, &line);
                        self.line = line;
                        r?
                    };
                    i = end + 1;
                    step
                }
                State::Payload { left } => {
                    let avail = (buf.len() - i) as u64;
                    if avail < left {
                        // Check whichever terminator bytes are in this buffer.
                        check_terminator(&buf[i..], left)?;
                        self.state = State::Payload { left: left - avail };
                        return Ok(Part::Incomplete);
                    }
                    let end = i + left as usize;
                    check_terminator(&buf[i..end], left)?;
                    i = end;
                    self.state = State::Type;
                    self.element_done()
                }
            };
            match step {
                Step::More => {}
                Step::Frame => return Ok(Part::Complete { end: i }),
                Step::Element if parts => return Ok(Part::Element { end: i }),
                Step::Header(count) if parts => return Ok(Part::Header { end: i, count }),
                Step::Element | Step::Header(_) => {}
            }
        }
        Ok(Part::Incomplete)
    }

    /// Skips up to `max` whole top-level frames from `buf[from..]` that are bulk strings,
    /// status lines or integers (`$`, `+`, `:`), the replies of most commands, and stops
    /// at anything else (an error, an aggregate, a frame split across reads) for
    /// [`Scanner::scan`] to read. Returns how many it skipped and where they end. Only at a
    /// frame boundary.
    pub fn skip_plain(&self, buf: &[u8], from: usize, max: u64) -> (u64, usize) {
        debug_assert!(!self.in_frame);
        let mut at = from;
        let mut n = 0;
        if !self.one_pass || self.failed.is_some() {
            return (0, at);
        }
        // A line limit under two bytes would refuse two-digit lengths: no short way then.
        let short = self.max_line >= 2;
        while n < max {
            if short {
                let (k, len) = short_replies(&buf[at..], max - n);
                n += k;
                at += len;
                if n == max {
                    break;
                }
            }
            let rest = &buf[at..];
            let end = match rest.first() {
                Some(b'$') => whole_bulk(rest, self.max_line),
                Some(b'+' | b':') => whole_line(rest),
                _ => None,
            };
            let Some(end) = end else { break };
            at += end;
            n += 1;
        }
        (n, at)
    }

    fn push_line(&mut self, part: &[u8]) -> Result<(), RespError> {
        if self.line.len() + part.len() > self.max_line {
            return Err(RespError::LineTooLong(self.max_line));
        }
        self.line.extend_from_slice(part);
        Ok(())
    }

    /// A header line (a length or a count, without its LF) is complete.
    fn header_done(&mut self, ty: u8, line: &[u8]) -> Result<Step, RespError> {
        let Some((&b'\r', body)) = line.split_last() else {
            return Err(RespError::BareLf);
        };
        if body.len() > self.max_line {
            return Err(RespError::LineTooLong(self.max_line));
        }
        self.state = State::Type;
        match ty {
            b'$' | b'!' | b'=' => match parse_len(body)? {
                None => Ok(self.element_done()),
                Some(n) => {
                    self.state = State::Payload { left: n + 2 };
                    Ok(Step::More)
                }
            },
            b'*' | b'~' | b'>' | b'%' | b'|' => {
                let Some(n) = parse_len(body)? else {
                    return Ok(self.element_done()); // *-1: a null array
                };
                let n = if matches!(ty, b'%' | b'|') {
                    n.checked_mul(2)
                        .ok_or_else(|| RespError::Length(String::from_utf8_lossy(body).into()))?
                } else {
                    n
                };
                if n == 0 && ty != b'|' {
                    return Ok(self.element_done());
                }
                if self.stack.len() >= MAX_DEPTH {
                    return Err(RespError::TooDeep);
                }
                let top_level = self.stack.is_empty();
                self.stack.push(Open {
                    left: n,
                    attribute: ty == b'|',
                });
                if n == 0 {
                    // An empty attribute: the annotated element follows.
                    self.stack.pop();
                    return Ok(Step::More);
                }
                Ok(if top_level && ty != b'|' {
                    Step::Header(n)
                } else {
                    Step::More
                })
            }
            _ => Err(RespError::Type(ty)),
        }
    }

    /// One element finished: pops finished aggregates.
    fn element_done(&mut self) -> Step {
        loop {
            let depth = self.stack.len();
            let Some(top) = self.stack.last_mut() else {
                self.in_frame = false;
                return Step::Frame;
            };
            top.left -= 1;
            if top.left > 0 {
                return if depth == 1 && !top.attribute {
                    Step::Element
                } else {
                    Step::More
                };
            }
            let attribute = top.attribute;
            self.stack.pop();
            if attribute {
                // The attribute is done; the element it annotates is still to come.
                return Step::More;
            }
        }
    }
}

/// `bytes` continue a payload whose remainder (with its CRLF) is `left`: those among them
/// that are the final two must be CR and LF. Checks two bytes at most.
pub(crate) fn check_terminator(bytes: &[u8], left: u64) -> Result<(), RespError> {
    // bytes[k] has `left - k` bytes remaining: CR at remaining 2, LF at remaining 1.
    let at = |remaining: u64| left.checked_sub(remaining).map(|k| k as usize);
    if let Some(k) = at(2).filter(|&k| k < bytes.len()) {
        if bytes[k] != b'\r' {
            return Err(RespError::Terminator);
        }
    }
    if let Some(k) = at(1).filter(|&k| k < bytes.len()) {
        if bytes[k] != b'\n' {
            return Err(RespError::Terminator);
        }
    }
    Ok(())
}

/// The length of the bulk string at the start of `buf` if it is there whole (`$`, 1 to
/// 18 digits, CRLF, the payload, CRLF; or `$-1` CRLF) and its header line fits in
/// `max_line`: a frame the state machine reads alike. `None` for anything else, left to the state machine.
#[inline(always)]
fn whole_bulk(buf: &[u8], max_line: usize) -> Option<usize> {
    // Nearly every length has one or two digits: read here, in the caller's loop; the
    // rest out of line.
    let (n, header) = match *buf {
        [b'$', d @ b'0'..=b'9', b'\r', b'\n', ..] if max_line >= 1 => (usize::from(d - b'0'), 4),
        [b'$', d1 @ b'0'..=b'9', d2 @ b'0'..=b'9', b'\r', b'\n', ..] if max_line >= 2 => {
            (usize::from(d1 - b'0') * 10 + usize::from(d2 - b'0'), 5)
        }
        _ => return long_bulk(buf, max_line),
    };
    let end = header + n;
    (buf.get(end..end + 2)? == b"\r\n").then_some(end + 2)
}

/// A `<ty><d>\r\n` or `<ty><d><d>\r\n` header at `at` in `buf`, no leading zero, read
/// from a window of five bytes (a one-digit header in a whole frame or command has at
/// least one byte after it): its number and length. `None` for anything else.
#[inline(always)]
pub(super) fn short_header(buf: &[u8], at: usize, ty: u8) -> Option<(usize, usize)> {
    let &[t, d1, c2, c3, c4] = buf.get(at..)?.first_chunk::<5>()?;
    let d1 = d1.wrapping_sub(b'0');
    if t != ty || d1 > 9 {
        return None;
    }
    if c2 == b'\r' {
        return (c3 == b'\n').then_some((usize::from(d1), 4));
    }
    let d2 = c2.wrapping_sub(b'0');
    (d2 <= 9 && d1 != 0 && c3 == b'\r' && c4 == b'\n').then(|| (usize::from(d1 * 10 + d2), 5))
}

/// [`whole_bulk`] for any length.
#[inline(never)]
fn long_bulk(buf: &[u8], max_line: usize) -> Option<usize> {
    let rest = buf.strip_prefix(b"$")?;
    if rest.starts_with(b"-1\r\n") {
        // A null bulk string (GET of a missing key).
        return (max_line >= 2).then_some(5);
    }
    let mut n: u64 = 0;
    let mut digits = 0;
    for &b in rest.iter().take(19) {
        if !b.is_ascii_digit() {
            break;
        }
        n = n * 10 + u64::from(b - b'0');
        digits += 1;
    }
    if !(1..=18).contains(&digits) || digits > max_line || rest.get(digits..digits + 2)? != b"\r\n"
    {
        return None;
    }
    let end = (digits + 3).checked_add(usize::try_from(n).ok()?)?;
    (buf.get(end..end.checked_add(2)?)? == b"\r\n").then_some(end + 2)
}

/// The length of the simple line (`+`, `-`, `:`, ...) at the start of `buf` if its LF is
/// in `buf` and a CR precedes it: the frame the state machine reads, which holds no such
/// line's bytes and so sets it no length limit.
#[inline]
fn whole_line(buf: &[u8]) -> Option<usize> {
    let nl = memchr::memchr(b'\n', buf.get(1..)?)?;
    // `buf[nl]` is the byte before the LF; the type byte itself if the line is empty.
    (nl > 0 && buf[nl] == b'\r').then_some(nl + 2)
}

/// Up to `max` whole replies at the start of `buf` that are `+OK`, null bulk strings (a
/// GET's miss) or bulk strings whose lengths have one or two digits, as [`whole_line`] and
/// [`whole_bulk`] read them: how many, and where they end. A loop of its own, with nothing
/// else to keep in registers; the line limit must be 2 or more.
#[inline(always)]
fn short_replies(buf: &[u8], max: u64) -> (u64, usize) {
    let (mut n, mut at) = (0, 0);
    while n < max {
        at = match short_header(buf, at, b'$') {
            Some((len, head)) => {
                let end = at + head + len;
                if buf.get(end..end + 2) != Some(b"\r\n") {
                    break;
                }
                end + 2
            }
            None if matches!(buf.get(at..at + 5), Some(b"+OK\r\n" | b"$-1\r\n")) => at + 5,
            None => break,
        };
        n += 1;
    }
    (n, at)
}

/// A top-level frame that is one line, or one bulk string, all in `buf`.
#[inline]
fn whole_line_or_bulk(buf: &[u8], max_line: usize) -> Option<usize> {
    match *buf.first()? {
        b'$' => whole_bulk(buf, max_line),
        ty if is_simple(ty) => whole_line(buf),
        _ => None,
    }
}

/// A line whose text the scanner does not need: it is skipped, not kept.
fn is_simple(ty: u8) -> bool {
    matches!(ty, b'+' | b'-' | b':' | b'_' | b'#' | b',' | b'(')
}

fn is_type(b: u8) -> bool {
    matches!(
        b,
        b'+' | b'-'
            | b':'
            | b'$'
            | b'*'
            | b'_'
            | b'#'
            | b','
            | b'('
            | b'!'
            | b'='
            | b'%'
            | b'~'
            | b'>'
            | b'|'
    )
}

/// A length or count: `-1` is null (`None`); `?` (streamed) is refused.
fn parse_len(body: &[u8]) -> Result<Option<u64>, RespError> {
    let bad = || RespError::Length(String::from_utf8_lossy(body).into_owned());
    match body {
        b"-1" => Ok(None),
        b"?" => Err(RespError::Streamed),
        [] => Err(bad()),
        // 18 digits at most, as the frame parser reads them (`frame::Parser::len`): the
        // two must agree on where a frame ends.
        digits if digits.len() <= 18 && digits.iter().all(u8::is_ascii_digit) => Ok(Some(
            digits
                .iter()
                .fold(0u64, |n, d| n * 10 + u64::from(d - b'0')),
        )),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resp::request::tests::every_buffer;
    use proptest::prelude::*;

    /// What is left of a top-level bulk string is known once its header is read (the
    /// reserve of a CLUSTER NODES capture); not of a bulk inside an array, nor of a line.
    #[test]
    fn a_top_level_bulk_says_what_is_left_of_it() {
        let mut s = Scanner::default();
        assert_eq!(s.top_payload_left(), None);
        assert_eq!(s.scan(b"$10\r\nabc", 0), Ok(Scan::Incomplete));
        assert_eq!(s.top_payload_left(), Some(9), "7 bytes and the CRLF");
        assert_eq!(s.scan(b"defghij\r\n", 0), Ok(Scan::Complete { end: 9 }));
        assert_eq!(s.top_payload_left(), None);
        assert_eq!(s.scan(b"*1\r\n$4\r\nab", 0), Ok(Scan::Incomplete));
        assert_eq!(s.top_payload_left(), None, "inside an array");
        let mut s = Scanner::default();
        assert_eq!(s.scan(b"+OK", 0), Ok(Scan::Incomplete));
        assert_eq!(s.top_payload_left(), None, "a line");
    }

    /// A bulk string's inline reading agrees with its general one: every bulk-like buffer
    /// of up to seven bytes after the `$`, under each small line limit (the property tests
    /// below give no limit of 0), and hand-read cases past that length.
    #[test]
    fn a_bulk_string_reads_alike_inline_and_out_of_line() {
        every_buffer(b'$', b"019-\r\nx", 7, |buf| {
            for max_line in [0, 1, 2, 3, 64] {
                assert_eq!(
                    whole_bulk(buf, max_line),
                    long_bulk(buf, max_line),
                    "{:?} under {max_line}",
                    String::from_utf8_lossy(buf)
                );
            }
        });
        for (buf, max_line, want) in [
            (&b"$10\r\n0123456789\r\n+OK"[..], 64, Some(17)),
            (b"$05\r\nhello\r\n", 64, Some(12)),
            (b"$05\r\nhello\r\n", 1, None),
            (b"$00\r\n\r\n", 2, Some(7)),
            (b"$10\r\n0123456789\r", 64, None),
            (b"$-1\r\n", 2, Some(5)),
            (b"$123\r\n", 64, None),
        ] {
            assert_eq!(
                whole_bulk(buf, max_line),
                want,
                "{:?}",
                String::from_utf8_lossy(buf)
            );
            assert_eq!(
                long_bulk(buf, max_line),
                want,
                "{:?}",
                String::from_utf8_lossy(buf)
            );
        }
    }

    /// The short loop takes a bulk string (a null one too) only as the inline reading does,
    /// `+OK` as a line, and stops at `max`.
    #[test]
    fn the_short_loop_reads_replies_as_the_inline_reading() {
        every_buffer(b'$', b"019-\r\nx", 7, |buf| {
            if let (1, len) = short_replies(buf, 1) {
                assert_eq!(
                    whole_bulk(buf, 2),
                    Some(len),
                    "{:?}",
                    String::from_utf8_lossy(buf)
                );
            }
        });
        every_buffer(b'+', b"OK\r\n", 5, |buf| {
            if let (1, len) = short_replies(buf, 1) {
                assert_eq!(
                    whole_line(buf),
                    Some(len),
                    "{:?}",
                    String::from_utf8_lossy(buf)
                );
            }
        });
        let three = b"$10\r\n0123456789\r\n+OK\r\n$3\r\nabc\r\n+OKAY\r\n";
        assert_eq!(short_replies(three, 5), (3, 31));
        assert_eq!(short_replies(three, 1), (1, 17));
        // A GET's miss, then a hit.
        assert_eq!(short_replies(b"$-1\r\n$3\r\nabc\r\n", 5), (2, 14));
        assert_eq!(short_replies(b"$-2\r\n", 5), (0, 0));
        assert_eq!(short_replies(b"+OK\r", 5), (0, 0));
    }

    /// Frame ends, scanning the whole input in one call per frame.
    fn ends(input: &[u8]) -> Result<Vec<usize>, RespError> {
        let mut s = Scanner::default();
        let mut out = vec![];
        let mut i = 0;
        while i < input.len() {
            match s.scan(input, i)? {
                Scan::Complete { end } => {
                    out.push(end);
                    i = end;
                }
                Scan::Incomplete => break,
            }
        }
        Ok(out)
    }

    /// Frame ends when the input arrives in the given pieces.
    fn ends_split(input: &[u8], cuts: &[usize]) -> Result<Vec<usize>, RespError> {
        let mut s = Scanner::default();
        let mut out = vec![];
        let mut start = 0;
        let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
        bounds.push(input.len());
        bounds.sort_unstable();
        for b in bounds {
            let piece = &input[start..b];
            let mut i = 0;
            while i < piece.len() {
                match s.scan(piece, i)? {
                    Scan::Complete { end } => {
                        out.push(start + end);
                        i = end;
                    }
                    Scan::Incomplete => break,
                }
            }
            start = b;
        }
        Ok(out)
    }

    /// A reply, or something near it: bulk strings with odd lengths and payloads, in and
    /// out of arrays, and other frames.
    fn reply_piece() -> impl Strategy<Value = Vec<u8>> {
        let len = prop_oneof![
            4 => Just(None),
            1 => prop_oneof![
                Just("007".to_string()),
                Just("07".to_string()),
                // The payload's own length with a leading zero.
                Just("pad".to_string()),
                Just("-1".to_string()),
                Just("?".to_string()),
                Just("9999999999999999999".to_string()),
                Just("1234567890123".to_string()),
                Just("".to_string()),
                Just("2 ".to_string()),
            ].prop_map(Some),
        ];
        let bulk = (proptest::collection::vec(any::<u8>(), 0..40), len).prop_map(|(p, len)| {
            let len = match len.as_deref() {
                None => p.len().to_string(),
                Some("pad") => format!("0{}", p.len()),
                Some(other) => other.to_string(),
            };
            let mut v = format!("${len}\r\n").into_bytes();
            v.extend(p);
            v.extend(b"\r\n");
            v
        });
        prop_oneof![
            4 => bulk.clone(),
            1 => proptest::collection::vec(bulk, 0..3).prop_map(|items| {
                let mut v = format!("*{}\r\n", items.len()).into_bytes();
                v.extend(items.concat());
                v
            }),
            1 => Just(b"+OK\r\n".to_vec()),
            // An attribute: the frame it annotates follows.
            1 => Just(b"|1\r\n+a\r\n:1\r\n".to_vec()),
            1 => Just(b":12\r\n".to_vec()),
            1 => Just(b"$3\r\nab\r\n".to_vec()),
            1 => Just(b"$-1\r\n".to_vec()),
            1 => Just(SAMPLE.to_vec()),
            // Lines: empty, a CR inside, a bare LF (an error), other types.
            1 => prop_oneof![
                Just(b"+\r\n".to_vec()),
                Just(b"+a\rb\r\n".to_vec()),
                Just(b"+\n".to_vec()),
                Just(b":1\n".to_vec()),
                Just(b"-ERR x\r\n".to_vec()),
                Just(b"_\r\n".to_vec()),
                Just(b"#t\r\n".to_vec()),
            ],
        ]
    }

    const SAMPLE: &[u8] = b"+OK\r\n$3\r\nbar\r\n$-1\r\n*-1\r\n:42\r\n-MOVED 12182 127.0.10.3:6379\r\n*3\r\n:0\r\n:5460\r\n*4\r\n$10\r\n127.0.10.1\r\n:6379\r\n$2\r\nid\r\n%1\r\n$8\r\nhostname\r\n_\r\n*0\r\n%0\r\n=8\r\ntxt:ab\r\n\r\n>3\r\n$7\r\nmessage\r\n$1\r\nc\r\n$0\r\n\r\n|1\r\n+key\r\n+val\r\n#t\r\n,1.5\r\n(123\r\n!3\r\nERR\r\n~2\r\n:1\r\n:2\r\n";

    #[test]
    fn finds_every_frame_of_both_protocols() {
        let e = ends(SAMPLE).unwrap();
        assert_eq!(e.len(), 16, "{e:?}");
        assert_eq!(*e.last().unwrap(), SAMPLE.len());
        assert_eq!(&SAMPLE[..e[0]], b"+OK\r\n");
        assert_eq!(&SAMPLE[e[0]..e[1]], b"$3\r\nbar\r\n");
        // The attribute and the boolean it annotates are one frame.
        let attr = SAMPLE.windows(3).position(|w| w == b"|1\r").unwrap();
        assert!(e.contains(&attr));
        assert!(!e.contains(&(attr + b"|1\r\n+key\r\n+val\r\n".len())));
    }

    #[test]
    fn bad_input_is_an_error() {
        for bad in [
            &b"?x\r\n"[..],
            b"$abc\r\n",
            b"$3\r\nbarXY",
            b"*2\n",
            b"$-2\r\n",
            b"*?\r\n",
            b"$99999999999999999999\r\n",
        ] {
            assert!(ends(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        let mut deep = b"*1\r\n".repeat(MAX_DEPTH + 1);
        deep.extend_from_slice(b":1\r\n");
        assert_eq!(ends(&deep), Err(RespError::TooDeep));
        // A header is a few digits: one longer than the limit is not RESP.
        let long = [b"*".as_slice(), &vec![b'1'; 70_000], b"\r\n"].concat();
        assert_eq!(ends(&long), Err(RespError::LineTooLong(64 * 1024)));
        // Split over reads, the limit holds too.
        assert!(ends_split(&long, &[10, 40_000]).is_err());
        // A simple line must end in CRLF, also when the CR came in an earlier read.
        assert_eq!(ends_split(b"+ab\n", &[3]), Err(RespError::BareLf));
        assert_eq!(ends_split(b"+\n", &[1]), Err(RespError::BareLf));
        assert_eq!(ends_split(b"+a\rb\n", &[3]), Err(RespError::BareLf));
    }

    #[test]
    fn simple_lines_pass_at_any_length_and_scripts_nest_deep() {
        // What a script's `redis.error_reply` / `status_reply` can send, and a reply nested
        // as deep as a script's tables: valid, and not rewritten, so they must pass.
        for ty in [b'-', b'+'] {
            let line = [&[ty][..], &vec![b'x'; 70_000], b"\r\n"].concat();
            assert_eq!(ends(&line).unwrap(), [line.len()]);
            assert_eq!(
                ends_split(&line, &[1, 2, 40_000, 70_001]).unwrap(),
                [line.len()]
            );
        }
        let mut deep = b"*1\r\n".repeat(71);
        deep.extend_from_slice(b":1\r\n");
        assert_eq!(ends(&deep).unwrap(), [deep.len()]);
        let mut deepest = b"*2\r\n".repeat(MAX_DEPTH);
        deepest.extend_from_slice(&b":1\r\n".repeat(MAX_DEPTH + 1));
        assert_eq!(ends(&deepest).unwrap(), [deepest.len()]);
    }

    /// Every stop of `scan_parts` over `input` in the given pieces, as offsets into `input`.
    fn parts_split(input: &[u8], cuts: &[usize]) -> Vec<Part> {
        let mut s = Scanner::default();
        let mut out = vec![];
        let mut start = 0;
        let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
        bounds.push(input.len());
        bounds.sort_unstable();
        for b in bounds {
            let piece = &input[start..b];
            let mut i = 0;
            while i < piece.len() {
                let (part, end) = match s.scan_parts(piece, i).unwrap() {
                    Part::Incomplete => break,
                    Part::Header { end, count } => (
                        Part::Header {
                            end: start + end,
                            count,
                        },
                        end,
                    ),
                    Part::Element { end } => (Part::Element { end: start + end }, end),
                    Part::Complete { end } => (Part::Complete { end: start + end }, end),
                };
                out.push(part);
                i = end;
            }
            start = b;
        }
        out
    }

    #[test]
    fn parts_stop_after_the_header_and_each_top_level_element() {
        let message =
            b"*3\r\n$7\r\nmessage\r\n*2\r\n:1\r\n|1\r\n+a\r\n+b\r\n:2\r\n$3\r\nabc\r\n+OK\r\n";
        let want = vec![
            Part::Header { end: 4, count: 3 },
            Part::Element { end: 17 },
            Part::Element { end: 41 },
            Part::Complete { end: 50 },
            Part::Complete { end: 55 },
        ];
        assert_eq!(parts_split(message, &[]), want);
        for cut in 0..message.len() {
            assert_eq!(parts_split(message, &[cut, cut / 2]), want, "cut at {cut}");
        }
        // An aggregate with one element, or none, and a null.
        assert_eq!(
            parts_split(b"*1\r\n:1\r\n*0\r\n*-1\r\n", &[]),
            [
                Part::Header { end: 4, count: 1 },
                Part::Complete { end: 8 },
                Part::Complete { end: 12 },
                Part::Complete { end: 17 }
            ]
        );
    }

    proptest! {
        #[test]
        fn any_split_gives_the_same_frames(cuts in proptest::collection::vec(0usize..1000, 0..12)) {
            prop_assert_eq!(ends_split(SAMPLE, &cuts).unwrap(), ends(SAMPLE).unwrap());
        }

        #[test]
        fn parts_end_frames_where_scan_does(bytes in proptest::collection::vec(any::<u8>(), 0..256), cuts in proptest::collection::vec(0usize..300, 0..4)) {
            let mut input = bytes;
            // Mostly valid frames, so that the stops inside aggregates are reached.
            input.splice(0..0, SAMPLE.iter().copied());
            let whole = ends(&input);
            let mut s = Scanner::default();
            let mut got = vec![];
            let mut start = 0;
            let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
            bounds.push(input.len());
            bounds.sort_unstable();
            let mut failed = false;
            'reads: for b in bounds {
                let piece = &input[start..b];
                let mut i = 0;
                while i < piece.len() {
                    match s.scan_parts(piece, i) {
                        Ok(Part::Incomplete) => break,
                        Ok(Part::Complete { end }) => { got.push(start + end); i = end; }
                        Ok(Part::Header { end, .. } | Part::Element { end }) => {
                            prop_assert!(end > i);
                            i = end;
                        }
                        Err(_) => { failed = true; break 'reads; }
                    }
                }
                start = b;
            }
            prop_assert_eq!(failed, whole.is_err());
            if let Ok(w) = whole {
                prop_assert_eq!(got, w);
            }
        }

        /// Whole bulk strings and lines are read in one pass (`whole_line_or_bulk`), anything else by the
        /// state machine: with the pass on or off, a stream gives the same frames and
        /// fails at the same point, valid RESP or not, whole or cut in two.
        #[test]
        fn the_one_pass_read_agrees_with_the_state_machine(
            pieces in proptest::collection::vec(reply_piece(), 1..8),
            flip in proptest::option::of((any::<prop::sample::Index>(), any::<u8>())),
            split in any::<prop::sample::Index>(),
            max_line in prop_oneof![Just(1usize), Just(2), Just(12), Just(64 * 1024)],
        ) {
            let mut input: Vec<u8> = pieces.concat();
            if let Some((at, byte)) = flip {
                let at = at.index(input.len());
                input[at] = byte;
            }
            let split = split.index(input.len() + 1);
            let run = |one_pass: bool| {
                let mut s = Scanner::new(max_line);
                s.one_pass = one_pass;
                let mut got = vec![];
                let (a, b) = input.split_at(split);
                for (start, piece) in [(0, a), (split, b)] {
                    let mut i = 0;
                    while i < piece.len() {
                        match s.scan(piece, i) {
                            Ok(Scan::Complete { end }) => {
                                got.push(Ok((start + end, s.in_frame())));
                                i = end;
                            }
                            Ok(Scan::Incomplete) => break,
                            Err(e) => { got.push(Err(e)); return got; }
                        }
                    }
                }
                got
            };
            prop_assert_eq!(run(true), run(false), "{:?}", String::from_utf8_lossy(&input));
        }

        /// `skip_plain` skips the frames `scan` finds, up to its count, and leaves the
        /// scanner where `scan` goes on as if it had read them.
        #[test]
        fn skipping_plain_frames_agrees_with_scan(
            pieces in proptest::collection::vec(reply_piece(), 1..8),
            max in 0u64..10,
            max_line in prop_oneof![Just(1usize), Just(2), Just(64 * 1024)],
        ) {
            let input: Vec<u8> = pieces.concat();
            let scan_from = |s: &mut Scanner, mut i: usize| {
                let mut got = vec![];
                while i < input.len() {
                    match s.scan(&input, i) {
                        Ok(Scan::Complete { end }) => { got.push(Ok(end)); i = end; }
                        Ok(Scan::Incomplete) => break,
                        Err(e) => { got.push(Err(e)); break; }
                    }
                }
                got
            };
            let all = scan_from(&mut Scanner::new(max_line), 0);
            let mut s = Scanner::new(max_line);
            let (n, at) = s.skip_plain(&input, 0, max);
            prop_assert!(n <= max);
            let n = n as usize;
            prop_assert!(n <= all.len());
            if n > 0 {
                prop_assert_eq!(&all[n - 1], &Ok(at));
            }
            // Only bulk strings, status lines and integers were skipped.
            let mut start = 0;
            for end in all.iter().take(n) {
                let end = end.clone().unwrap_or_default();
                prop_assert!(matches!(input[start], b'$' | b'+' | b':'));
                start = end;
            }
            prop_assert_eq!(&scan_from(&mut s, at)[..], &all[n..]);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256), cuts in proptest::collection::vec(0usize..300, 0..4)) {
            let whole = ends(&bytes);
            let split = ends_split(&bytes, &cuts);
            // Either both fail, or both find the same frames.
            prop_assert_eq!(whole.is_ok(), split.is_ok());
            if let (Ok(a), Ok(b)) = (&whole, &split) {
                prop_assert_eq!(a, b);
            }
        }
    }
}
