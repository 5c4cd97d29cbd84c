//! Reading the server name (SNI) out of a TLS ClientHello, without terminating TLS.
//!
//! [`parse`] is pure: it looks at the bytes a client sent so far and says one of three things
//! ([`Parsed`]): here is the hello (with its SNI name, or without one), this is not a TLS
//! ClientHello, or more bytes are needed. It never reads past the ClientHello, keeps no state
//! between calls (the caller re-runs it on a longer buffer; hellos are small and capped) and
//! never panics on any input.
//!
//! # Format
//!
//! ```text
//! record:     type(1)=22 handshake | version(2)=3.x | length(2) | fragment
//! handshake:  type(1)=1 ClientHello | length(3) | body          (may span several records)
//! body:       version(2) random(32) session_id<0..32> cipher_suites<2..2^16-2>
//!             compression_methods<1..2^8-1> [extensions<0..2^16-1>]
//! extension:  type(2) | length(2) | data;  server_name is type 0:
//!             server_name_list<1..2^16-1> of { name_type(1)=0 host_name | host_name<1..2^16-1> }
//! ```
//!
//! The handshake message may be split over several records (RFC 8446 §5.1) and the records
//! over several reads; both are reassembled here.

use std::fmt;

/// Content type of a handshake record.
const HANDSHAKE: u8 = 22;
/// Handshake type of a ClientHello.
const CLIENT_HELLO: u8 = 1;
/// Extension type of server_name (RFC 6066).
const SERVER_NAME: u16 = 0;
/// The largest record fragment a peer may send (2^14, RFC 8446 §5.1), plus the expansion
/// allowed for TLS 1.2 compressed records, which a ClientHello never is but the limit is the
/// spec's.
const MAX_FRAGMENT: usize = (1 << 14) + 2048;
/// A DNS name is at most 253 characters (255 octets on the wire).
const MAX_NAME: usize = 255;

/// What the bytes seen so far are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed {
    /// A complete ClientHello. `sni` is its server name, `None` if it sent none. `len` is how
    /// many bytes of the input the records that carry the hello take.
    Hello { sni: Option<ServerName>, len: usize },
    /// Not a TLS ClientHello (or a malformed one): the connection is refused.
    NotTls(NotTls),
    /// A valid prefix of a ClientHello: read more. `need` is a lower bound on the total
    /// length the input must reach, when the headers seen already tell it.
    Incomplete { need: Option<usize> },
}

/// Why the bytes are not a usable ClientHello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotTls {
    /// The first record is not a TLS handshake record (plain text, HTTP, RESP, ...).
    NotHandshake,
    /// A handshake record, but its first message is not a ClientHello.
    NotClientHello,
    /// A ClientHello that breaks the format; the reason names the field.
    Malformed(&'static str),
}

impl fmt::Display for NotTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.detail())
    }
}

impl NotTls {
    /// A metric label.
    pub fn label(&self) -> &'static str {
        match self {
            NotTls::NotHandshake => "not_tls",
            NotTls::NotClientHello => "not_client_hello",
            NotTls::Malformed(_) => "malformed",
        }
    }

    /// What is wrong, for logs.
    pub fn detail(&self) -> &'static str {
        match self {
            NotTls::NotHandshake => "the first bytes are not a TLS handshake record",
            NotTls::NotClientHello => "the first handshake message is not a ClientHello",
            NotTls::Malformed(why) => why,
        }
    }
}

/// A server name from SNI: lowercase ASCII, without a trailing dot. Only names made of
/// letters, digits, `-`, `_` and `.` are accepted (RFC 6066 host names; `_` as seen in the wild).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ServerName(String);

impl ServerName {
    /// Checks and normalises a name.
    pub fn new(raw: &[u8]) -> Option<ServerName> {
        let raw = raw.strip_suffix(b".").unwrap_or(raw);
        let ok = !raw.is_empty()
            && raw.len() <= MAX_NAME
            && raw
                .iter()
                .all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        // From here on every byte is ASCII, so the conversion cannot fail.
        ok.then(|| ServerName(String::from_utf8_lossy(raw).to_ascii_lowercase()))
    }

    #[cfg(any(test, feature = "test-util"))]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ServerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::ops::Deref for ServerName {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

/// Reads the ClientHello at the start of `input`. See the module doc.
pub fn parse(input: &[u8]) -> Parsed {
    match reassemble(input) {
        Ok((msg, len)) => match client_hello_sni(&msg) {
            Ok(sni) => Parsed::Hello { sni, len },
            Err(e) => Parsed::NotTls(e),
        },
        Err(Stop::NotTls(e)) => Parsed::NotTls(e),
        Err(Stop::Incomplete(need)) => Parsed::Incomplete { need },
    }
}

enum Stop {
    NotTls(NotTls),
    Incomplete(Option<usize>),
}

impl From<NotTls> for Stop {
    fn from(e: NotTls) -> Self {
        Stop::NotTls(e)
    }
}

/// Collects the handshake message that starts in the first record, across as many records
/// as it spans. Returns the message (type, length and body) and the bytes of input consumed.
fn reassemble(input: &[u8]) -> Result<(Vec<u8>, usize), Stop> {
    let mut msg: Vec<u8> = Vec::new();
    let mut at = 0;
    loop {
        // Record header, checked byte by byte so that a wrong first byte is refused at once.
        let header = input.get(at..).unwrap_or_default();
        if let Some(&t) = header.first() {
            if t != HANDSHAKE {
                return Err(if at == 0 {
                    NotTls::NotHandshake.into()
                } else {
                    NotTls::Malformed("a non-handshake record inside the ClientHello").into()
                });
            }
        }
        if let Some(&major) = header.get(1) {
            if major != 3 {
                return Err(NotTls::NotHandshake.into());
            }
        }
        if header.len() < 5 {
            return Err(Stop::Incomplete(Some(at + 5)));
        }
        let frag_len = usize::from(u16::from_be_bytes([header[3], header[4]]));
        if frag_len == 0 {
            return Err(NotTls::Malformed("an empty handshake record").into());
        }
        if frag_len > MAX_FRAGMENT {
            return Err(NotTls::Malformed("a record longer than 2^14 bytes").into());
        }
        let end = at + 5 + frag_len;
        let Some(fragment) = input.get(at + 5..end) else {
            // Take what this record has so far, to check the message header early.
            msg.extend_from_slice(input.get(at + 5..).unwrap_or_default());
            check_message_header(&msg)?;
            return Err(Stop::Incomplete(Some(end)));
        };
        msg.extend_from_slice(fragment);
        at = end;
        if let Some(total) = check_message_header(&msg)? {
            if msg.len() >= total {
                // Bytes of a following handshake message in the same record are not ours
                // to look at (a client does not send one before the server answers).
                msg.truncate(total);
                return Ok((msg, at));
            }
        }
    }
}

/// Checks the handshake message header, once its bytes are there. Returns the total message
/// length (header included) when known.
fn check_message_header(msg: &[u8]) -> Result<Option<usize>, Stop> {
    if let Some(&t) = msg.first() {
        if t != CLIENT_HELLO {
            return Err(NotTls::NotClientHello.into());
        }
    }
    if msg.len() < 4 {
        return Ok(None);
    }
    let len = (usize::from(msg[1]) << 16) | (usize::from(msg[2]) << 8) | usize::from(msg[3]);
    // The smallest body: version, random, three empty-ish vectors.
    if len < 2 + 32 + 1 + 2 + 2 + 1 + 1 {
        return Err(NotTls::Malformed("a ClientHello shorter than its fixed fields").into());
    }
    Ok(Some(4 + len))
}

/// A cursor over a byte slice that returns `Malformed` instead of panicking.
struct Reader<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8], what: &'static str) -> Self {
        Reader { buf, what }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], NotTls> {
        if self.buf.len() < n {
            return Err(NotTls::Malformed(self.what));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, NotTls> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, NotTls> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    /// A vector with a one-byte length.
    fn vec8(&mut self, what: &'static str) -> Result<&'a [u8], NotTls> {
        self.what = what;
        let n = usize::from(self.u8()?);
        self.take(n)
    }

    /// A vector with a two-byte length.
    fn vec16(&mut self, what: &'static str) -> Result<&'a [u8], NotTls> {
        self.what = what;
        let n = usize::from(self.u16()?);
        self.take(n)
    }

    fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

/// The SNI name of a complete ClientHello message (header included).
fn client_hello_sni(msg: &[u8]) -> Result<Option<ServerName>, NotTls> {
    let mut r = Reader::new(msg.get(4..).unwrap_or_default(), "ClientHello version");
    // legacy_version: not checked (rustls does not either; the record layer did).
    r.take(2)?;
    r.what = "ClientHello random";
    r.take(32)?;
    let session = r.vec8("ClientHello session_id")?;
    if session.len() > 32 {
        return Err(NotTls::Malformed("ClientHello session_id longer than 32"));
    }
    let suites = r.vec16("ClientHello cipher_suites")?;
    if suites.is_empty() || suites.len() % 2 != 0 {
        return Err(NotTls::Malformed("ClientHello cipher_suites"));
    }
    let compression = r.vec8("ClientHello compression_methods")?;
    if compression.is_empty() {
        return Err(NotTls::Malformed("ClientHello compression_methods"));
    }
    if r.is_empty() {
        // An SSLv3-style hello without extensions.
        return Ok(None);
    }
    let extensions = r.vec16("ClientHello extensions")?;
    if !r.is_empty() {
        return Err(NotTls::Malformed("bytes after the ClientHello extensions"));
    }
    let mut ext = Reader::new(extensions, "an extension header");
    let mut sni = None;
    let mut seen_sni = false;
    while !ext.is_empty() {
        ext.what = "an extension header";
        let kind = ext.u16()?;
        let data = ext.vec16("an extension's data")?;
        if kind != SERVER_NAME {
            continue;
        }
        if seen_sni {
            return Err(NotTls::Malformed("two server_name extensions"));
        }
        seen_sni = true;
        sni = server_name(data)?;
    }
    Ok(sni)
}

/// The host_name entry of a server_name extension.
fn server_name(data: &[u8]) -> Result<Option<ServerName>, NotTls> {
    let mut r = Reader::new(data, "server_name list");
    let list = r.vec16("server_name list")?;
    if !r.is_empty() || list.is_empty() {
        return Err(NotTls::Malformed("server_name list"));
    }
    let mut entries = Reader::new(list, "server_name entry");
    let mut found = None;
    while !entries.is_empty() {
        entries.what = "server_name entry";
        let kind = entries.u8()?;
        if kind != 0 {
            // No other name type is defined, so its encoding, and where the next entry
            // starts, is unknown: stop here (as rustls does).
            break;
        }
        let name = entries.vec16("server_name host_name")?;
        if found.is_some() {
            return Err(NotTls::Malformed("two host_name entries in server_name"));
        }
        found = Some(
            ServerName::new(name)
                .ok_or(NotTls::Malformed("server_name host_name is not a DNS name"))?,
        );
    }
    Ok(found)
}

/// Test helpers: ClientHellos built by hand and re-fragmented (for this crate's tests, the
/// fuzz test and the integration tests).
#[cfg(any(test, feature = "test-util"))]
pub mod testing {
    /// A minimal, valid ClientHello record with `sni` (or none) and `pad` bytes of padding
    /// extension.
    pub fn client_hello(sni: Option<&str>, pad: usize) -> Vec<u8> {
        let mut ext = Vec::new();
        if let Some(name) = sni {
            let n = name.as_bytes();
            let entry_len = 3 + n.len();
            ext.extend_from_slice(&0u16.to_be_bytes());
            ext.extend_from_slice(&((entry_len + 2) as u16).to_be_bytes());
            ext.extend_from_slice(&(entry_len as u16).to_be_bytes());
            ext.push(0);
            ext.extend_from_slice(&(n.len() as u16).to_be_bytes());
            ext.extend_from_slice(n);
        }
        if pad > 0 {
            ext.extend_from_slice(&21u16.to_be_bytes());
            ext.extend_from_slice(&(pad as u16).to_be_bytes());
            ext.extend(std::iter::repeat_n(0u8, pad));
        }
        let mut body = vec![3, 3];
        body.extend_from_slice(&[7u8; 32]);
        body.push(0);
        body.extend_from_slice(&[0, 2, 0x13, 0x01]);
        body.extend_from_slice(&[1, 0]);
        body.extend_from_slice(&(ext.len() as u16).to_be_bytes());
        body.extend_from_slice(&ext);
        let mut msg = vec![1];
        msg.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
        msg.extend_from_slice(&body);
        records(&msg, 1 << 14)
    }

    /// Wraps a handshake message in records of at most `max` fragment bytes each.
    pub fn records(msg: &[u8], max: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for chunk in msg.chunks(max.max(1)) {
            out.extend_from_slice(&[22, 3, 1]);
            out.extend_from_slice(&(chunk.len() as u16).to_be_bytes());
            out.extend_from_slice(chunk);
        }
        out
    }

    /// The handshake message inside well-formed `records` (the inverse of [`records`]).
    pub fn message(mut records: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        while records.len() >= 5 {
            let len = usize::from(u16::from_be_bytes([records[3], records[4]]));
            let end = (5 + len).min(records.len());
            out.extend_from_slice(&records[5..end]);
            records = &records[end..];
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

    fn sni(p: Parsed) -> Option<String> {
        match p {
            Parsed::Hello { sni, .. } => sni.map(|s| s.to_string()),
            other => panic!("expected a hello, got {other:?}"),
        }
    }

    #[test]
    fn reads_the_name() {
        let hello = client_hello(Some("VC-0-1.Example.Test."), 0);
        assert_eq!(sni(parse(&hello)).as_deref(), Some("vc-0-1.example.test"));
        assert_eq!(sni(parse(&client_hello(None, 10))), None);
        match parse(&hello) {
            Parsed::Hello { len, .. } => assert_eq!(len, hello.len()),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_prefix_is_incomplete() {
        let hello = client_hello(Some("vc.example.test"), 100);
        for cut in 0..hello.len() {
            assert!(
                matches!(parse(&hello[..cut]), Parsed::Incomplete { .. }),
                "cut at {cut}: {:?}",
                parse(&hello[..cut])
            );
        }
    }

    #[test]
    fn a_hello_over_many_records() {
        let one = client_hello(Some("vc-2.example.test"), 300);
        let msg = message(&one);
        for size in [1, 2, 3, 5, 64, 200] {
            let many = records(&msg, size);
            assert_eq!(sni(parse(&many)).as_deref(), Some("vc-2.example.test"));
        }
    }

    #[test]
    fn refuses_what_is_not_a_hello() {
        assert_eq!(
            parse(b"*1\r\n$4\r\nPING\r\n"),
            Parsed::NotTls(NotTls::NotHandshake)
        );
        assert_eq!(parse(b"G"), Parsed::NotTls(NotTls::NotHandshake));
        assert_eq!(parse(&[22, 2]), Parsed::NotTls(NotTls::NotHandshake));
        // A handshake record that carries a ServerHello.
        assert_eq!(
            parse(&[22, 3, 3, 0, 4, 2, 0, 0, 0]),
            Parsed::NotTls(NotTls::NotClientHello)
        );
        assert!(matches!(
            parse(&[22, 3, 3, 0, 0]),
            Parsed::NotTls(NotTls::Malformed(_))
        ));
        // Truncated length fields inside a complete message.
        let mut bad = client_hello(Some("vc.example.test"), 0);
        let n = bad.len();
        bad[n - 20] = 0xff;
        assert!(matches!(parse(&bad), Parsed::NotTls(NotTls::Malformed(_))));
    }

    #[test]
    fn names_must_be_host_names() {
        assert!(ServerName::new(b"a b").is_none());
        assert!(ServerName::new(b"").is_none());
        assert!(ServerName::new(b".").is_none());
        assert!(ServerName::new(&[b'a'; 300]).is_none());
        let hello = client_hello(Some("bad name"), 0);
        assert!(matches!(
            parse(&hello),
            Parsed::NotTls(NotTls::Malformed(_))
        ));
    }
}
