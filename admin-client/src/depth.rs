//! Bounds on replies: nesting depth and size, checked before redis-protocol decodes them.
//!
//! redis-protocol's decoders recurse once per nesting level, without a limit: a broken or
//! hostile node that sends `*1\r\n` twenty thousand times overflows the stack and aborts the
//! process. [`BoundedCodec`] wraps a codec and runs a [`Scanner`] over the buffered bytes
//! first. The scanner walks the frame without recursing and without allocating (its only
//! state is one counter per open aggregate, at most [`MAX_DEPTH`] of them), and it hands the
//! bytes to the inner decoder only once a whole frame is buffered and known to be within
//! bounds.
//!
//! The scanner knows the type prefixes of RESP2 and RESP3 (`* % ~ > | $ + - : , # ( ! = _`),
//! so it bounds either codec. It does not accept RESP3 streamed frames (`$?`, `*?`), which
//! Valkey never sends as replies.
//!
//! Three outcomes, as in mini-redis' `Frame::check`: a complete frame and its length, "need
//! more bytes" (a normal state that leads to another read, never an error), or an error.
//!
//! # Format
//!
//! ```text
//! +OK\r\n  -ERR x\r\n  :1\r\n  ,1.5\r\n  #t\r\n  (123\r\n  _\r\n     one line
//! $3\r\nfoo\r\n  !3\r\nerr\r\n  =7\r\ntxt:foo\r\n  $-1\r\n          length line + payload
//! *2\r\n...  ~2\r\n...  >2\r\n...   (n elements)                     aggregates
//! %1\r\n...  |1\r\n...             (2n elements; an attribute precedes the frame it annotates)
//! ```

use std::fmt;

use bytes::BytesMut;
use tokio_util::codec::{Decoder, Encoder};

/// The deepest nesting accepted. `CLUSTER SHARDS`, the deepest reply an admin client reads,
/// is 4 levels deep.
pub const MAX_DEPTH: usize = 64;

/// The largest reply accepted, in bytes. A 1000-node `CLUSTER SHARDS` is well under 1 MiB.
pub const MAX_REPLY: usize = 16 << 20;

/// The smallest encoded element (`:1\r\n` is 4 bytes, `_\r\n` and `+\r\n` are 3): used to
/// refuse an aggregate whose element count alone exceeds the size bound.
const MIN_ELEMENT: u64 = 3;

/// What a type byte says about the bytes that follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// One line: `+ - : , # ( _`.
    Line,
    /// A length line, then that many bytes and CRLF: `$ ! =`.
    Blob,
    /// A count line, then that many elements (twice as many for `%` maps and `|`
    /// attributes): `* ~ > % |`.
    Aggregate { pairs: bool, attribute: bool },
}

impl Kind {
    /// The kind a byte starts, if it can start a RESP2 or RESP3 frame (streamed chunks `;`
    /// and `.` are not accepted).
    fn of(byte: u8) -> Option<Kind> {
        Some(match byte {
            b'+' | b'-' | b':' | b',' | b'#' | b'(' | b'_' => Kind::Line,
            b'$' | b'!' | b'=' => Kind::Blob,
            b'*' | b'~' | b'>' => Kind::Aggregate {
                pairs: false,
                attribute: false,
            },
            b'%' => Kind::Aggregate {
                pairs: true,
                attribute: false,
            },
            b'|' => Kind::Aggregate {
                pairs: true,
                attribute: true,
            },
            _ => return None,
        })
    }
}

/// Why a reply was refused.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("reply nested deeper than {max} levels")]
    TooDeep { max: usize },
    #[error("reply larger than {max} bytes")]
    TooLarge { max: usize },
    #[error("malformed reply: {0}")]
    Malformed(String),
    #[error("cannot encode the command: {0}")]
    Encode(String),
    /// The peer closed the connection with part of a frame buffered.
    #[error("connection closed in the middle of a reply ({buffered} bytes buffered)")]
    Truncated { buffered: usize },
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// The bounds a [`Scanner`] enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The deepest nesting accepted: a top-level aggregate is depth 1.
    pub depth: usize,
    /// The largest frame accepted, in bytes.
    pub size: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            depth: MAX_DEPTH,
            size: MAX_REPLY,
        }
    }
}

/// What [`Scanner::scan`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scan {
    /// A whole frame of `len` bytes starts the buffer.
    Complete { len: usize },
    /// The frame so far is within bounds; more bytes are needed.
    Incomplete,
}

/// One open aggregate.
#[derive(Debug, Clone, Copy)]
struct Level {
    /// Elements still to come.
    remaining: u64,
    /// An attribute (`|`): when it ends, the frame it annotates follows, and that frame,
    /// not the attribute, is the element of the enclosing aggregate.
    attribute: bool,
}

/// Finds where the frame at the start of a buffer ends, within [`Limits`].
///
/// Resumable: between calls it keeps the offset of the first token it has not finished and
/// the open aggregates, never a borrow of the buffer, so each byte is looked at about once
/// however the frame arrives. The buffer given to the next call must start with the same
/// bytes (a read buffer that only grew). After `Complete` or an error the scanner is reset
/// for the next frame.
#[derive(Debug, Clone, Default)]
pub struct Scanner {
    limits: Limits,
    /// Start of the first token not yet scanned: a type byte and its line, and for the
    /// string types the payload too.
    pos: usize,
    /// Where the search for the current token's CRLF resumes (0: from the token's start).
    searched: usize,
    /// Open aggregates, innermost last; never longer than `limits.depth`.
    stack: Vec<Level>,
}

impl Scanner {
    pub fn new(limits: Limits) -> Self {
        Scanner {
            limits,
            ..Scanner::default()
        }
    }

    /// Scans the frame at the start of `buf`.
    ///
    /// # Errors
    ///
    /// [`FrameError::TooDeep`] as soon as an aggregate would open past the depth limit,
    /// [`FrameError::TooLarge`] as soon as the frame is known to exceed the size limit (a
    /// declared length is enough), [`FrameError::Malformed`] for a byte that cannot start a
    /// frame, a bad length, or a string payload not followed by CRLF.
    pub fn scan(&mut self, buf: &[u8]) -> Result<Scan, FrameError> {
        let result = self.walk(buf);
        if !matches!(result, Ok(Scan::Incomplete)) {
            self.reset();
        }
        result
    }

    /// Forgets a partly scanned frame.
    pub fn reset(&mut self) {
        self.pos = 0;
        self.searched = 0;
        self.stack.clear();
    }

    fn walk(&mut self, buf: &[u8]) -> Result<Scan, FrameError> {
        let too_large = FrameError::TooLarge {
            max: self.limits.size,
        };
        loop {
            let start = self.pos;
            let Some(&byte) = buf.get(start) else {
                return Ok(Scan::Incomplete);
            };
            // Refused at once, not after waiting for a CRLF that may never come.
            let Some(kind) = Kind::of(byte) else {
                return Err(FrameError::Malformed(format!(
                    "unexpected type byte '{}'",
                    byte.escape_ascii()
                )));
            };
            let from = self.searched.max(start + 1);
            let Some(cr) = find_crlf(buf, from) else {
                if buf.len() > self.limits.size {
                    return Err(too_large);
                }
                // The last byte may be the CR of the CRLF.
                self.searched = buf.len().saturating_sub(1).max(start + 1);
                return Ok(Scan::Incomplete);
            };
            let line = &buf[start + 1..cr];
            let mut next = cr + 2;
            let mut opens = None;
            match kind {
                Kind::Line => {}
                Kind::Blob => {
                    if let Some(len) = parse_len(line)? {
                        let end = (next as u64).saturating_add(len).saturating_add(2);
                        if end > self.limits.size as u64 {
                            return Err(too_large);
                        }
                        // Fits in usize: at most limits.size.
                        let end = end as usize;
                        if buf.len() < end {
                            // Come back to this token; its line is found again at once.
                            self.searched = cr;
                            return Ok(Scan::Incomplete);
                        }
                        if &buf[end - 2..end] != b"\r\n" {
                            return Err(FrameError::Malformed(
                                "string payload not followed by CRLF".into(),
                            ));
                        }
                        next = end;
                    }
                }
                Kind::Aggregate { pairs, attribute } => {
                    if let Some(len) = parse_len(line)? {
                        let items = if pairs { len.saturating_mul(2) } else { len };
                        if self.stack.len() >= self.limits.depth {
                            return Err(FrameError::TooDeep {
                                max: self.limits.depth,
                            });
                        }
                        let least = (next as u64).saturating_add(items.saturating_mul(MIN_ELEMENT));
                        if least > self.limits.size as u64 {
                            return Err(too_large);
                        }
                        opens = Some(Level {
                            remaining: items,
                            attribute,
                        });
                    }
                }
            }
            if next > self.limits.size {
                return Err(too_large);
            }
            self.pos = next;
            self.searched = 0;
            match opens {
                Some(level) if level.remaining > 0 => {
                    self.stack.push(level);
                    continue;
                }
                // An empty attribute: the annotated frame follows.
                Some(Level {
                    attribute: true, ..
                }) => continue,
                // A scalar, a null or an empty aggregate: one element done.
                _ => {}
            }
            if self.element_done() {
                return Ok(Scan::Complete { len: self.pos });
            }
        }
    }

    /// Counts one finished element; true when that finishes the top-level frame.
    fn element_done(&mut self) -> bool {
        while let Some(level) = self.stack.last_mut() {
            level.remaining -= 1;
            if level.remaining > 0 {
                return false;
            }
            let attribute = level.attribute;
            self.stack.pop();
            if attribute {
                return false;
            }
        }
        true
    }
}

/// The index of the first CRLF at or after `from`.
fn find_crlf(buf: &[u8], from: usize) -> Option<usize> {
    buf.get(from..)?
        .windows(2)
        .position(|w| w == b"\r\n")
        .map(|i| from + i)
}

/// A length line: digits, or `-1` (a RESP2 null) as `None`.
fn parse_len(line: &[u8]) -> Result<Option<u64>, FrameError> {
    if line == b"-1" {
        return Ok(None);
    }
    if line == b"?" {
        return Err(FrameError::Malformed(
            "streamed RESP3 frames are not supported".into(),
        ));
    }
    let digits = !line.is_empty() && line.len() <= 19 && line.iter().all(u8::is_ascii_digit);
    let len = digits
        .then(|| std::str::from_utf8(line).ok()?.parse::<u64>().ok())
        .flatten();
    match len {
        Some(len) => Ok(Some(len)),
        None => {
            let shown = &line[..line.len().min(32)];
            Err(FrameError::Malformed(format!(
                "invalid length \"{}\"",
                shown.escape_ascii()
            )))
        }
    }
}

/// A codec whose decoder only sees frames within [`Limits`].
#[derive(Debug, Default)]
pub struct BoundedCodec<C> {
    inner: C,
    scanner: Scanner,
}

impl<C> BoundedCodec<C> {
    /// Wraps `inner` with the default limits ([`MAX_DEPTH`], [`MAX_REPLY`]).
    pub fn new(inner: C) -> Self {
        Self::with_limits(inner, Limits::default())
    }

    pub fn with_limits(inner: C, limits: Limits) -> Self {
        BoundedCodec {
            inner,
            scanner: Scanner::new(limits),
        }
    }
}

impl<C> Decoder for BoundedCodec<C>
where
    C: Decoder,
    C::Error: fmt::Display,
{
    type Item = C::Item;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<C::Item>, FrameError> {
        let len = match self.scanner.scan(src)? {
            Scan::Incomplete => return Ok(None),
            Scan::Complete { len } => len,
        };
        let before = src.len();
        match self.inner.decode(src) {
            Ok(Some(item)) if before - src.len() == len => Ok(Some(item)),
            Ok(Some(_)) => Err(FrameError::Malformed(format!(
                "the decoder read {} bytes of a {len}-byte frame",
                before - src.len()
            ))),
            Ok(None) => Err(FrameError::Malformed(format!(
                "the decoder found a {len}-byte frame incomplete"
            ))),
            Err(e) => Err(FrameError::Malformed(e.to_string())),
        }
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<C::Item>, FrameError> {
        match self.decode(src)? {
            Some(item) => Ok(Some(item)),
            None if src.is_empty() => Ok(None),
            None => Err(FrameError::Truncated {
                buffered: src.len(),
            }),
        }
    }
}

impl<T, C> Encoder<T> for BoundedCodec<C>
where
    C: Encoder<T>,
    C::Error: fmt::Display,
{
    type Error = FrameError;

    fn encode(&mut self, item: T, dst: &mut BytesMut) -> Result<(), FrameError> {
        self.inner
            .encode(item, dst)
            .map_err(|e| FrameError::Encode(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use redis_protocol::codec::Resp2;
    use redis_protocol::resp2::types::BytesFrame;

    fn scan(buf: &[u8]) -> Result<Scan, FrameError> {
        Scanner::default().scan(buf)
    }

    fn small(depth: usize, size: usize) -> Scanner {
        Scanner::new(Limits { depth, size })
    }

    /// `*1\r\n` `levels` times, then `:1\r\n`: a frame nested `levels` deep.
    fn nested(levels: usize) -> Vec<u8> {
        let mut b = b"*1\r\n".repeat(levels);
        b.extend_from_slice(b":1\r\n");
        b
    }

    #[test]
    fn complete_frames_report_their_length() {
        for frame in [
            &b"+OK\r\n"[..],
            b"-ERR Unknown node x\r\n",
            b":42\r\n",
            b"$3\r\nfoo\r\n",
            b"$0\r\n\r\n",
            b"$-1\r\n",
            b"*-1\r\n",
            b"*0\r\n",
            b"*2\r\n:1\r\n*1\r\n$1\r\nx\r\n",
            // RESP3: a map, a set, a push, an attribute before its frame (also an empty one
            // inside an array), verbatim text.
            b"%1\r\n+k\r\n_\r\n",
            b"~2\r\n#t\r\n,1.5\r\n",
            b">2\r\n+a\r\n(12\r\n",
            b"|1\r\n+a\r\n:1\r\n:7\r\n",
            b"*1\r\n|0\r\n!3\r\nerr\r\n",
            b"=7\r\ntxt:foo\r\n",
        ] {
            let len = frame.len();
            assert_eq!(scan(frame).unwrap(), Scan::Complete { len }, "{frame:?}");
            // Bytes after the frame are the next frame's.
            let two = [frame, b":2\r\n"].concat();
            assert_eq!(scan(&two).unwrap(), Scan::Complete { len }, "{frame:?}");
        }
        // An attribute is not the frame: the frame it annotates must follow.
        assert_eq!(scan(b"|1\r\n+a\r\n:1\r\n").unwrap(), Scan::Incomplete);
    }

    #[test]
    fn every_strict_prefix_is_incomplete() {
        let frame = b"*3\r\n$5\r\nslots\r\n*2\r\n:0\r\n:5460\r\n%1\r\n+id\r\n$-1\r\n";
        for cut in 0..frame.len() {
            assert_eq!(
                scan(&frame[..cut]).unwrap(),
                Scan::Incomplete,
                "cut at {cut}"
            );
        }
        assert_eq!(scan(frame).unwrap(), Scan::Complete { len: frame.len() });
    }

    #[test]
    fn resumes_byte_by_byte() {
        let frame = b"*2\r\n$10\r\n127.0.10.1\r\n*1\r\n:6379\r\n";
        let mut scanner = Scanner::default();
        for cut in 1..frame.len() {
            assert_eq!(scanner.scan(&frame[..cut]).unwrap(), Scan::Incomplete);
        }
        assert_eq!(
            scanner.scan(frame).unwrap(),
            Scan::Complete { len: frame.len() }
        );
        // Reset for the next frame.
        assert_eq!(scanner.scan(b"+OK\r\n").unwrap(), Scan::Complete { len: 5 });
    }

    #[test]
    fn depth_is_bounded() {
        assert_eq!(
            scan(&nested(MAX_DEPTH)).unwrap(),
            Scan::Complete {
                len: nested(MAX_DEPTH).len()
            }
        );
        let err = scan(&nested(MAX_DEPTH + 1)).unwrap_err();
        assert_eq!(err.to_string(), "reply nested deeper than 64 levels");
        // Refused as soon as the limit is passed, without waiting for the rest.
        let err = scan(&b"*1\r\n".repeat(20_000)).unwrap_err();
        assert!(err.to_string().contains("nested deeper than"), "{err}");
        // Empty aggregates and maps count as levels too.
        let mut b = b"%1\r\n+k\r\n".repeat(3);
        b.extend_from_slice(b"*0\r\n");
        assert!(matches!(
            small(3, 1 << 10).scan(&b),
            Err(FrameError::TooDeep { max: 3 })
        ));
        assert!(small(4, 1 << 10).scan(&b).is_ok());
    }

    #[test]
    fn size_is_bounded_as_soon_as_it_is_known() {
        // A declared length is enough, before any payload arrives.
        let err = scan(b"$99999999999\r\n").unwrap_err();
        assert_eq!(err.to_string(), "reply larger than 16777216 bytes");
        assert!(matches!(
            scan(b"*9999999999\r\n"),
            Err(FrameError::TooLarge { .. })
        ));
        assert!(matches!(
            scan(b"%9999999999999999999\r\n"),
            Err(FrameError::TooLarge { .. })
        ));
        // A line that never ends.
        let mut s = small(8, 64);
        assert_eq!(s.scan(&[b'+'; 64]).unwrap(), Scan::Incomplete);
        assert!(matches!(
            s.scan(&[b'+'; 65]),
            Err(FrameError::TooLarge { max: 64 })
        ));
        // Exactly at the limit is fine.
        assert_eq!(
            small(8, 9).scan(b"$3\r\nfoo\r\n").unwrap(),
            Scan::Complete { len: 9 }
        );
        assert!(small(8, 8).scan(b"$3\r\nfoo\r\n").is_err());
    }

    #[test]
    fn malformed_input_is_an_error() {
        for bytes in [
            &b"?\r\n"[..],
            b"*x\r\n",
            b"*-2\r\n",
            b"$+3\r\nfoo\r\n",
            b"$3\r\nfooXY",
            b"$?\r\n",
            b"*1\r\nhello\r\n",
            // No CRLF needed to refuse a byte that cannot start a frame.
            b"hello",
        ] {
            assert!(
                matches!(scan(bytes), Err(FrameError::Malformed(_))),
                "{bytes:?}"
            );
        }
    }

    #[test]
    fn the_codec_decodes_bounded_frames_and_refuses_deep_ones() {
        let mut codec = BoundedCodec::new(Resp2::default());
        let mut buf = BytesMut::from(&b"*2\r\n$2\r\nid\r\n:7\r\n+"[..]);
        let frame = codec.decode(&mut buf).unwrap().unwrap();
        assert_eq!(
            frame,
            BytesFrame::Array(vec![
                BytesFrame::BulkString("id".into()),
                BytesFrame::Integer(7)
            ])
        );
        assert_eq!(&buf[..], b"+");
        assert!(codec.decode(&mut buf).unwrap().is_none());
        // EOF in the middle of a frame.
        assert!(matches!(
            codec.decode_eof(&mut buf),
            Err(FrameError::Truncated { buffered: 1 })
        ));
        assert!(codec.decode_eof(&mut BytesMut::new()).unwrap().is_none());

        let mut deep = BytesMut::from(&nested(20_000)[..]);
        let err = BoundedCodec::new(Resp2::default())
            .decode(&mut deep)
            .unwrap_err();
        assert!(err.to_string().contains("nested deeper than"), "{err}");
        // What RESP2 does not know, the inner decoder refuses.
        let err = BoundedCodec::new(Resp2::default())
            .decode(&mut BytesMut::from(&b"%0\r\n"[..]))
            .unwrap_err();
        assert!(matches!(err, FrameError::Malformed(_)), "{err}");
    }

    // === properties ===

    /// Well-formed RESP2 frames, encoded by hand (so the test does not trust the encoder).
    fn resp2() -> impl Strategy<Value = Vec<u8>> {
        let line = "[a-zA-Z0-9 .:_-]{0,12}";
        let leaf = prop_oneof![
            line.prop_map(|s| format!("+{s}\r\n").into_bytes()),
            line.prop_map(|s| format!("-ERR {s}\r\n").into_bytes()),
            any::<i64>().prop_map(|i| format!(":{i}\r\n").into_bytes()),
            proptest::collection::vec(any::<u8>(), 0..40).prop_map(|b| {
                let mut out = format!("${}\r\n", b.len()).into_bytes();
                out.extend_from_slice(&b);
                out.extend_from_slice(b"\r\n");
                out
            }),
            Just(b"$-1\r\n".to_vec()),
            Just(b"*-1\r\n".to_vec()),
        ];
        leaf.prop_recursive(6, 64, 8, |inner| {
            proptest::collection::vec(inner, 0..8).prop_map(|items| {
                let mut out = format!("*{}\r\n", items.len()).into_bytes();
                items.iter().for_each(|i| out.extend_from_slice(i));
                out
            })
        })
    }

    /// Well-formed RESP3 frames (no streaming; map keys and set members are scalars so that
    /// redis-protocol can hash them).
    fn resp3() -> impl Strategy<Value = Vec<u8>> {
        let line = "[a-zA-Z0-9 ]{0,8}";
        let scalar = prop_oneof![
            line.prop_map(|s| format!("+{s}\r\n").into_bytes()),
            line.prop_map(|s| format!("-ERR {s}\r\n").into_bytes()),
            any::<i64>().prop_map(|i| format!(":{i}\r\n").into_bytes()),
            any::<bool>().prop_map(|b| if b {
                b"#t\r\n".to_vec()
            } else {
                b"#f\r\n".to_vec()
            }),
            Just(b",1.5\r\n".to_vec()),
            Just(b"(3492890328409238509324850943850943825024385\r\n".to_vec()),
            line.prop_map(|s| format!("${}\r\n{s}\r\n", s.len()).into_bytes()),
            line.prop_map(|s| format!("!{}\r\n{s}\r\n", s.len()).into_bytes()),
            line.prop_map(|s| format!("={}\r\ntxt:{s}\r\n", s.len() + 4).into_bytes()),
        ];
        let leaf = prop_oneof![scalar.clone(), Just(b"_\r\n".to_vec())];
        let key = scalar;
        leaf.prop_recursive(5, 48, 6, move |inner| {
            let kv = (key.clone(), inner.clone());
            prop_oneof![
                (
                    prop::sample::select(vec!['*', '>']),
                    proptest::collection::vec(inner.clone(), 0..6)
                )
                    .prop_map(|(t, items)| {
                        let mut out = format!("{t}{}\r\n", items.len()).into_bytes();
                        items.iter().for_each(|i| out.extend_from_slice(i));
                        out
                    }),
                proptest::collection::vec(kv.clone(), 0..4).prop_map(|pairs| {
                    let mut out = format!("%{}\r\n", pairs.len()).into_bytes();
                    for (k, v) in &pairs {
                        out.extend_from_slice(k);
                        out.extend_from_slice(v);
                    }
                    out
                }),
                proptest::collection::vec(kv, 1..3).prop_flat_map(move |pairs| {
                    let mut out = format!("|{}\r\n", pairs.len()).into_bytes();
                    for (k, v) in &pairs {
                        out.extend_from_slice(k);
                        out.extend_from_slice(v);
                    }
                    inner.clone().prop_map(move |frame| {
                        let mut out = out.clone();
                        out.extend_from_slice(&frame);
                        out
                    })
                }),
            ]
        })
    }

    /// Bytes made of RESP pieces, so that frames, near-frames and deep prefixes are common.
    fn resp_like() -> impl Strategy<Value = Vec<u8>> {
        let piece = prop_oneof![
            prop::sample::select(vec![
                &b"*1\r\n"[..],
                b"*2\r\n",
                b"*0\r\n",
                b"*-1\r\n",
                b"%1\r\n",
                b"|1\r\n",
                b"~1\r\n",
                b"$3\r\n",
                b"$-1\r\n",
                b"$0\r\n",
                b"abc",
                b"\r\n",
                b"\r",
                b":12\r\n",
                b"+OK\r\n",
                b"_\r\n",
                b"-1",
                b"*",
                b"$",
            ])
            .prop_map(<[u8]>::to_vec),
            any::<u8>().prop_map(|b| vec![b]),
        ];
        proptest::collection::vec(piece, 0..48).prop_map(|p| p.concat())
    }

    /// Checks `bytes` in one piece and in chunks, through the scanner and the codec.
    fn never_panics(bytes: &[u8], cuts: &[prop::sample::Index]) -> Result<(), TestCaseError> {
        if let Ok(Scan::Complete { len }) = scan(bytes) {
            prop_assert!(len <= bytes.len());
            // Bounded by the scan, so safe to hand to the recursive decoder.
            if let Ok(Some((_, amt))) = redis_protocol::resp2::decode::decode(bytes) {
                prop_assert_eq!(amt, len);
            }
        }
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c.index(bytes.len() + 1)).collect();
        cuts.sort_unstable();
        let mut scanner = small(4, 128);
        for cut in cuts.into_iter().chain([bytes.len()]) {
            if !matches!(scanner.scan(&bytes[..cut]), Ok(Scan::Incomplete)) {
                break;
            }
        }
        let limits = Limits {
            depth: 4,
            size: 128,
        };
        let mut codec = BoundedCodec::with_limits(Resp2::default(), limits);
        let mut buf = BytesMut::from(bytes);
        while let Ok(Some(_)) = codec.decode(&mut buf) {}
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Well-formed frames with bytes flipped, dropped or inserted.
        #[test]
        fn mutated_frames_never_panic(
            frame in resp2(),
            edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0..3u8), 1..4),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..4),
        ) {
            let mut bytes = frame;
            for (at, byte, op) in edits {
                let i = at.index(bytes.len() + 1);
                match op {
                    0 if i < bytes.len() => bytes[i] = byte,
                    1 if i < bytes.len() => { bytes.remove(i); }
                    _ => bytes.insert(i, byte),
                }
            }
            never_panics(&bytes, &cuts)?;
        }

        /// RESP-like garbage.
        #[test]
        fn resp_like_bytes_never_panic(
            bytes in resp_like(),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..4),
        ) {
            never_panics(&bytes, &cuts)?;
        }

        /// Arbitrary bytes never panic, in one piece or fed in chunks; and whatever the
        /// scanner calls complete, the decoder reads to the same end or refuses.
        #[test]
        fn arbitrary_bytes_never_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..256),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..4),
        ) {
            never_panics(&bytes, &cuts)?;
        }

        /// Deep garbage is refused, never handed on (this would overflow the stack if the
        /// decoder ever saw it).
        #[test]
        fn deep_prefixes_are_refused(levels in (MAX_DEPTH + 1)..5_000usize, tail in proptest::collection::vec(any::<u8>(), 0..16)) {
            let mut bytes = b"*1\r\n".repeat(levels);
            bytes.extend_from_slice(&tail);
            let mut codec = BoundedCodec::new(Resp2::default());
            let result = codec.decode(&mut BytesMut::from(&bytes[..]));
            prop_assert!(result.is_err());
        }

        /// On well-formed RESP2 the scanner ends frames where redis-protocol does, the codec
        /// yields the decoder's frame, and how the bytes arrive changes nothing.
        #[test]
        fn agrees_with_redis_protocol_on_resp2(
            frame in resp2(),
            trailing in proptest::collection::vec(any::<u8>(), 0..8),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..6),
        ) {
            let (expected, amt) = redis_protocol::resp2::decode::decode(&frame).unwrap().unwrap();
            prop_assert_eq!(amt, frame.len());
            let mut bytes = frame.clone();
            bytes.extend_from_slice(&trailing);
            prop_assert_eq!(scan(&bytes).unwrap(), Scan::Complete { len: frame.len() });

            let mut cuts: Vec<usize> = cuts.iter().map(|c| c.index(bytes.len() + 1)).collect();
            cuts.sort_unstable();
            let mut codec = BoundedCodec::new(Resp2::default());
            let mut buf = BytesMut::new();
            let mut got = None;
            let mut fed = 0;
            for cut in cuts.into_iter().chain([bytes.len()]) {
                buf.extend_from_slice(&bytes[fed..cut]);
                fed = cut;
                if let Some(f) = codec.decode(&mut buf).unwrap() {
                    got = Some(f);
                    break;
                }
            }
            let got = got.expect("a whole frame was fed");
            prop_assert_eq!(got.to_owned_frame(), expected);
        }

        /// Same for RESP3, against redis-protocol's RESP3 decoder.
        #[test]
        fn agrees_with_redis_protocol_on_resp3(frame in resp3()) {
            prop_assert_eq!(scan(&frame).unwrap(), Scan::Complete { len: frame.len() });
            match redis_protocol::resp3::decode::complete::decode(&frame) {
                Ok(Some((_, amt))) => prop_assert_eq!(amt, frame.len()),
                Ok(None) => prop_assert!(false, "redis-protocol found the frame incomplete"),
                // redis-protocol refuses attributes on nulls and on attributes; the generator
                // makes both, and only attributes contain '|' here.
                Err(e) => prop_assert!(frame.contains(&b'|'), "{e}"),
            }
        }
    }
}
