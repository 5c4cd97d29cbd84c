//! A complete frame as a tree over borrowed bytes, for the few replies that are rewritten
//! (topology replies). Everything else is never parsed into this form.
//!
//! Scalars keep their raw bytes, so that a frame re-encodes to exactly the bytes it was
//! parsed from; rewriters replace leaves with owned bytes.

use std::borrow::Cow;

use super::RespError;

/// Aggregates nested deeper than this are not parsed (the parser recurses): no topology
/// reply comes near it, and a deeper reply is forwarded as it came.
pub const MAX_DEPTH: usize = 64;

/// One RESP2/RESP3 value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame<'a> {
    /// `+`: simple string.
    Simple(Cow<'a, [u8]>),
    /// `-`: simple error.
    Error(Cow<'a, [u8]>),
    /// `:`: integer, as its digits.
    Int(Cow<'a, [u8]>),
    /// `$`: bulk string.
    Bulk(Cow<'a, [u8]>),
    /// `=`: verbatim string, with its 3-letter format and colon (`txt:...`).
    Verbatim(Cow<'a, [u8]>),
    /// `!`: blob error.
    BlobError(Cow<'a, [u8]>),
    /// `$-1`, `*-1` and `_`, each kept as it came.
    Null(NullKind),
    /// `#`, `,`, `(`: boolean, double, big number, as their raw line.
    Other(u8, Cow<'a, [u8]>),
    /// `*`, `~`, `>`: array, set, push.
    Array(u8, Vec<Frame<'a>>),
    /// `%`: map.
    Map(Vec<(Frame<'a>, Frame<'a>)>),
    /// `|`: an attribute map and the value it annotates.
    Attribute(Vec<(Frame<'a>, Frame<'a>)>, Box<Frame<'a>>),
}

/// Which spelling a null had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NullKind {
    Bulk,
    Array,
    Resp3,
}

impl<'a> Frame<'a> {
    /// A bulk string, or a simple string, or a verbatim string's text: the bytes of a string.
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Frame::Bulk(b) | Frame::Simple(b) => Some(b),
            Frame::Verbatim(b) => Some(b.get(4..).unwrap_or_default()),
            _ => None,
        }
    }

    /// An integer.
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Frame::Int(d) => std::str::from_utf8(d).ok()?.parse().ok(),
            _ => None,
        }
    }

    /// The elements of an array-like frame.
    #[cfg(any(test, feature = "test-util"))]
    pub fn items_mut(&mut self) -> Option<&mut Vec<Frame<'a>>> {
        match self {
            Frame::Array(_, items) => Some(items),
            _ => None,
        }
    }
}

/// Parses one complete frame from the start of `buf`; returns it and its length.
pub fn parse(buf: &[u8]) -> Result<(Frame<'_>, usize), RespError> {
    let mut p = Parser {
        buf,
        pos: 0,
        depth: 0,
    };
    let f = p.frame()?;
    Ok((f, p.pos))
}

struct Parser<'a> {
    buf: &'a [u8],
    pos: usize,
    depth: usize,
}

impl<'a> Parser<'a> {
    fn line(&mut self) -> Result<&'a [u8], RespError> {
        let rest = &self.buf[self.pos..];
        let nl = memchr::memchr(b'\n', rest).ok_or(RespError::Terminator)?;
        if nl == 0 || rest[nl - 1] != b'\r' {
            return Err(RespError::BareLf);
        }
        self.pos += nl + 1;
        Ok(&rest[..nl - 1])
    }

    fn len(line: &[u8]) -> Result<Option<usize>, RespError> {
        match line {
            b"-1" => Ok(None),
            d if !d.is_empty() && d.len() <= 18 && d.iter().all(u8::is_ascii_digit) => Ok(Some(
                d.iter().fold(0usize, |n, c| n * 10 + usize::from(c - b'0')),
            )),
            _ => Err(RespError::Length(
                String::from_utf8_lossy(line).into_owned(),
            )),
        }
    }

    fn payload(&mut self, n: usize) -> Result<&'a [u8], RespError> {
        let end = self.pos.checked_add(n).ok_or(RespError::Terminator)?;
        if self.buf.len() < end + 2 || &self.buf[end..end + 2] != b"\r\n" {
            return Err(RespError::Terminator);
        }
        let p = &self.buf[self.pos..end];
        self.pos = end + 2;
        Ok(p)
    }

    fn pairs(&mut self, n: usize) -> Result<Vec<(Frame<'a>, Frame<'a>)>, RespError> {
        let mut out = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            out.push((self.frame()?, self.frame()?));
        }
        Ok(out)
    }

    fn frame(&mut self) -> Result<Frame<'a>, RespError> {
        let ty = *self.buf.get(self.pos).ok_or(RespError::Terminator)?;
        self.pos += 1;
        let line = self.line()?;
        let b = Cow::Borrowed;
        Ok(match ty {
            b'+' => Frame::Simple(b(line)),
            b'-' => Frame::Error(b(line)),
            b':' => Frame::Int(b(line)),
            b'_' => Frame::Null(NullKind::Resp3),
            b'#' | b',' | b'(' => Frame::Other(ty, b(line)),
            b'$' | b'=' | b'!' => match Self::len(line)? {
                None => Frame::Null(NullKind::Bulk),
                Some(n) => {
                    let p = self.payload(n)?;
                    match ty {
                        b'$' => Frame::Bulk(b(p)),
                        b'=' => Frame::Verbatim(b(p)),
                        _ => Frame::BlobError(b(p)),
                    }
                }
            },
            b'*' | b'~' | b'>' | b'%' | b'|' => {
                let Some(n) = Self::len(line)? else {
                    return Ok(Frame::Null(NullKind::Array));
                };
                // As the scanner counts: an empty aggregate opens no level.
                self.depth += 1;
                if n > 0 && self.depth > MAX_DEPTH {
                    return Err(RespError::TooDeep);
                }
                let f = match ty {
                    b'%' => Frame::Map(self.pairs(n)?),
                    b'|' => {
                        let attrs = self.pairs(n)?;
                        Frame::Attribute(attrs, Box::new(self.frame()?))
                    }
                    _ => {
                        let mut items = Vec::with_capacity(n.min(1024));
                        for _ in 0..n {
                            items.push(self.frame()?);
                        }
                        Frame::Array(ty, items)
                    }
                };
                self.depth -= 1;
                f
            }
            other => return Err(RespError::Type(other)),
        })
    }
}

/// Appends the encoding of `f` to `out`.
pub fn encode(f: &Frame<'_>, out: &mut Vec<u8>) {
    fn line(out: &mut Vec<u8>, ty: u8, body: &[u8]) {
        out.push(ty);
        out.extend_from_slice(body);
        out.extend_from_slice(b"\r\n");
    }
    fn blob(out: &mut Vec<u8>, ty: u8, body: &[u8]) {
        line(out, ty, itoa::Buffer::new().format(body.len()).as_bytes());
        out.extend_from_slice(body);
        out.extend_from_slice(b"\r\n");
    }
    fn count(out: &mut Vec<u8>, ty: u8, n: usize) {
        line(out, ty, itoa::Buffer::new().format(n).as_bytes());
    }
    match f {
        Frame::Simple(s) => line(out, b'+', s),
        Frame::Error(s) => line(out, b'-', s),
        Frame::Int(s) => line(out, b':', s),
        Frame::Other(ty, s) => line(out, *ty, s),
        Frame::Bulk(s) => blob(out, b'$', s),
        Frame::Verbatim(s) => blob(out, b'=', s),
        Frame::BlobError(s) => blob(out, b'!', s),
        Frame::Null(NullKind::Bulk) => out.extend_from_slice(b"$-1\r\n"),
        Frame::Null(NullKind::Array) => out.extend_from_slice(b"*-1\r\n"),
        Frame::Null(NullKind::Resp3) => out.extend_from_slice(b"_\r\n"),
        Frame::Array(ty, items) => {
            count(out, *ty, items.len());
            items.iter().for_each(|i| encode(i, out));
        }
        Frame::Map(pairs) => {
            count(out, b'%', pairs.len());
            for (k, v) in pairs {
                encode(k, out);
                encode(v, out);
            }
        }
        Frame::Attribute(pairs, value) => {
            count(out, b'|', pairs.len());
            for (k, v) in pairs {
                encode(k, out);
                encode(v, out);
            }
            encode(value, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_then_encode_is_the_identity() {
        let inputs: &[&[u8]] = &[
            b"+OK\r\n",
            b"-MOVED 1 a:1\r\n",
            b"$-1\r\n",
            b"*-1\r\n",
            b"_\r\n",
            b"*3\r\n:0\r\n:5460\r\n*4\r\n$10\r\n127.0.10.1\r\n:6379\r\n$2\r\nid\r\n%1\r\n$8\r\nhostname\r\n$0\r\n\r\n",
            b"=8\r\ntxt:ab\r\n\r\n",
            b"|1\r\n+key\r\n+val\r\n#t\r\n",
            b">2\r\n+a\r\n~1\r\n,1.5\r\n",
            b"!3\r\nERR\r\n",
        ];
        for input in inputs {
            let (f, len) = parse(input).unwrap();
            assert_eq!(len, input.len());
            let mut out = vec![];
            encode(&f, &mut out);
            assert_eq!(&out, input);
        }
    }

    #[test]
    fn the_parser_stops_at_its_depth_limit() {
        let mut deep = b"*1\r\n".repeat(MAX_DEPTH);
        deep.extend_from_slice(b"*0\r\n");
        assert!(parse(&deep).is_ok());
        let mut deeper = b"*1\r\n".repeat(MAX_DEPTH + 1);
        deeper.extend_from_slice(b":1\r\n");
        assert_eq!(parse(&deeper), Err(RespError::TooDeep));
    }

    #[test]
    fn truncated_frames_are_errors_not_panics() {
        let full = b"*2\r\n$3\r\nabc\r\n:1\r\n";
        for cut in 0..full.len() {
            assert!(parse(&full[..cut]).is_err(), "cut at {cut}");
        }
    }
}
