//! A resumable RESP2/RESP3 frame scanner.
//!
//! It finds where each top-level frame ends without building it: lines are found with
//! `memchr`, bulk payloads are skipped by their length, and aggregates are a stack of
//! element counts. The state survives between calls, so when a frame is split over many
//! reads each byte is looked at once, never re-parsed from the frame's start (the decoders
//! of redis-protocol restart from the beginning, which is quadratic on a large reply that
//! arrives in small pieces).
//!
//! Memory is bounded: a line (header, simple string, error) longer than `max_line` and
//! aggregates nested deeper than [`MAX_DEPTH`] are errors, and the only bytes kept between
//! calls are the part of a line not yet terminated.

/// Aggregates nested deeper than this are refused (Valkey's replies nest a few levels).
pub const MAX_DEPTH: usize = 64;

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
    #[error("frame larger than {0} bytes")]
    FrameTooLarge(usize),
    /// Valkey's answer to such a line could not be foretold: the connection is closed
    /// rather than paired by guess.
    #[error("NUL byte in an inline command")]
    InlineNul,
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Expecting a type byte.
    Type,
    /// Inside a line that started with `ty`.
    Line { ty: u8 },
    /// Skipping a payload; `left` counts the trailing CRLF too.
    Payload { left: u64 },
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
pub struct Scanner {
    state: State,
    stack: Vec<Open>,
    /// The start of a line split across buffers.
    line: Vec<u8>,
    max_line: usize,
    /// Whether some bytes of a top-level frame have been seen.
    in_frame: bool,
    /// After an error the stream cannot be followed any more: every later call fails too.
    failed: Option<RespError>,
}

impl Default for Scanner {
    fn default() -> Self {
        Scanner::new(64 * 1024)
    }
}

impl Scanner {
    pub fn new(max_line: usize) -> Self {
        Scanner {
            state: State::Type,
            stack: Vec::new(),
            line: Vec::new(),
            max_line,
            in_frame: false,
            failed: None,
        }
    }

    /// Whether a top-level frame is in progress (its first byte has been seen).
    pub fn in_frame(&self) -> bool {
        self.in_frame
    }

    /// Scans `buf[from..]`, continuing the frame in progress, and stops at the end of the
    /// first top-level frame that completes.
    pub fn scan(&mut self, buf: &[u8], from: usize) -> Result<Scan, RespError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let r = self.scan_inner(buf, from);
        if let Err(e) = &r {
            self.failed = Some(e.clone());
        }
        r
    }

    fn scan_inner(&mut self, buf: &[u8], from: usize) -> Result<Scan, RespError> {
        let mut i = from;
        while i < buf.len() {
            match self.state {
                State::Type => {
                    let ty = buf[i];
                    i += 1;
                    self.in_frame = true;
                    self.state = State::Line { ty };
                    self.line.clear();
                    if !is_type(ty) {
                        return Err(RespError::Type(ty));
                    }
                }
                State::Line { ty } => {
                    let Some(nl) = memchr::memchr(b'\n', &buf[i..]) else {
                        self.push_line(&buf[i..])?;
                        return Ok(Scan::Incomplete);
                    };
                    let end = i + nl;
                    let done = if self.line.is_empty() {
                        self.line_done(ty, &buf[i..end])?
                    } else {
                        self.push_line(&buf[i..end])?;
                        let line = std::mem::take(&mut self.line);
                        let r = self.line_done(ty, &line);
                        self.line = line;
                        r?
                    };
                    i = end + 1;
                    if done {
                        return Ok(Scan::Complete { end: i });
                    }
                }
                State::Payload { left } => {
                    let avail = (buf.len() - i) as u64;
                    if avail < left {
                        // Check whichever terminator bytes are in this buffer.
                        check_terminator(&buf[i..], left)?;
                        self.state = State::Payload { left: left - avail };
                        return Ok(Scan::Incomplete);
                    }
                    let end = i + left as usize;
                    check_terminator(&buf[i..end], left)?;
                    i = end;
                    self.state = State::Type;
                    if self.element_done() {
                        return Ok(Scan::Complete { end: i });
                    }
                }
            }
        }
        Ok(Scan::Incomplete)
    }

    fn push_line(&mut self, part: &[u8]) -> Result<(), RespError> {
        if self.line.len() + part.len() > self.max_line {
            return Err(RespError::LineTooLong(self.max_line));
        }
        self.line.extend_from_slice(part);
        Ok(())
    }

    /// A line (without its LF) is complete. Returns whether a top-level frame ended.
    fn line_done(&mut self, ty: u8, line: &[u8]) -> Result<bool, RespError> {
        let Some((&b'\r', body)) = line.split_last() else {
            return Err(RespError::BareLf);
        };
        if body.len() > self.max_line {
            return Err(RespError::LineTooLong(self.max_line));
        }
        self.state = State::Type;
        match ty {
            b'+' | b'-' | b':' | b'_' | b'#' | b',' | b'(' => Ok(self.element_done()),
            b'$' | b'!' | b'=' => match parse_len(body)? {
                None => Ok(self.element_done()),
                Some(n) => {
                    self.state = State::Payload { left: n + 2 };
                    Ok(false)
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
                self.stack.push(Open {
                    left: n,
                    attribute: ty == b'|',
                });
                if n == 0 {
                    // An empty attribute: the annotated element follows.
                    self.stack.pop();
                }
                Ok(false)
            }
            _ => Err(RespError::Type(ty)),
        }
    }

    /// One element finished: pops finished aggregates. Returns whether the top-level frame
    /// is complete.
    fn element_done(&mut self) -> bool {
        loop {
            let Some(top) = self.stack.last_mut() else {
                self.in_frame = false;
                return true;
            };
            top.left -= 1;
            if top.left > 0 {
                return false;
            }
            let attribute = top.attribute;
            self.stack.pop();
            if attribute {
                // The attribute is done; the element it annotates is still to come.
                return false;
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
        digits if digits.len() <= 19 && digits.iter().all(u8::is_ascii_digit) => Ok(Some(
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
    use proptest::prelude::*;

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
        let long = [b"+".as_slice(), &vec![b'a'; 70_000], b"\r\n"].concat();
        assert_eq!(ends(&long), Err(RespError::LineTooLong(64 * 1024)));
        // Split over reads, the limit holds too.
        assert!(ends_split(&long, &[10, 40_000]).is_err());
    }

    proptest! {
        #[test]
        fn any_split_gives_the_same_frames(cuts in proptest::collection::vec(0usize..1000, 0..12)) {
            prop_assert_eq!(ends_split(SAMPLE, &cuts).unwrap(), ends(SAMPLE).unwrap());
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
