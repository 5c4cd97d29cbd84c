//! CLUSTER NODES and CLUSTER REPLICAS: text lines `<id> <ip:port@cport[,hostname]> ...`.

use std::borrow::Cow;

use super::addresses::{parse_port, AddressMap};
use super::Report;
use crate::resp::frame::Frame;

/// `CLUSTER NODES`: a bulk string (RESP2) or a `txt:` verbatim string (RESP3) of node
/// lines, each ended by a newline. Each line's shape is checked as it is rewritten, in one
/// pass; `Err` (and nothing rewritten or reported) if the reply does not have that shape.
pub fn nodes(map: &AddressMap, f: &mut Frame<'_>, report: &mut Report) -> Result<(), NotNodes> {
    match f {
        Frame::Bulk(text) => {
            if let Some(new) = checked_rewrite(map, text, report)? {
                *text = Cow::Owned(new);
            }
        }
        Frame::Verbatim(v) if v.starts_with(b"txt:") => {
            if let Some(new) = checked_rewrite(map, &v[4..], report)? {
                let mut out = v[..4].to_vec();
                out.extend_from_slice(&new);
                *v = Cow::Owned(out);
            }
        }
        _ => return Err(NotNodes),
    }
    Ok(())
}

/// A reply that answered CLUSTER NODES without the shape of its reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotNodes;

/// The node lines of `text` with their addresses rewritten, `None` if none was, `Err` if
/// a line is not a node line (`report` is then as it was).
fn checked_rewrite(
    map: &AddressMap,
    text: &[u8],
    report: &mut Report,
) -> Result<Option<Vec<u8>>, NotNodes> {
    let before = (report.rewritten, report.unknown.len());
    // Sized at the first node line: a reply that is no NODES reply fails at its first line,
    // without an allocation of its size.
    let mut out = Vec::new();
    let mut start = 0;
    let ok = text.ends_with(b"\n")
        && memchr::memchr_iter(b'\n', text).all(|end| {
            let line = &text[start..end];
            start = end + 1;
            let Some(parts) = node_line(line) else {
                return false;
            };
            if out.capacity() == 0 {
                out.reserve(text.len() + 64);
            }
            rewrite_parts(map, line, &parts, &mut out, report);
            out.push(b'\n');
            true
        });
    if !ok {
        report.rewritten = before.0;
        report.unknown.truncate(before.1);
        return Err(NotNodes);
    }
    Ok((report.rewritten > before.0).then_some(out))
}

/// Whether `f` has the exact shape of a CLUSTER REPLICAS reply: an array of bulk strings,
/// each one node line without its newline.
pub fn is_replicas(f: &Frame<'_>) -> bool {
    let Frame::Array(b'*', items) = f else {
        return false;
    };
    items
        .iter()
        .all(|item| matches!(item, Frame::Bulk(line) if node_line(line).is_some()))
}

/// What the rewrite needs of a node line: its id and its address, split.
struct NodeLine<'a> {
    id: &'a [u8],
    address: Address<'a>,
    /// Where the address field ends: the rest of the line, from the space before the flags.
    rest: usize,
}

/// `ip:port@cport[,hostname]`, split.
struct Address<'a> {
    ip: &'a [u8],
    /// `None` if it is not a number within a u16.
    port: Option<u16>,
    /// `@cport`, the `@` included; empty if there is none.
    cport: &'a [u8],
    hostname: Option<&'a [u8]>,
}

/// The parts of `line` if it is a node line: `<id> <ip:port@cport[,hostname]> <flags>
/// <primary-id|-> <ping> <pong> <epoch> <link-state> [<slot>...]`, as
/// `clusterGenNodeDescription` writes it.
///
/// One pass, field after field, each checked as it is found (the address's separators by
/// memchr, over that field alone): a large cluster's reply has hundreds of lines, and this
/// check runs before every rewrite.
fn node_line(line: &[u8]) -> Option<NodeLine<'_>> {
    // The id: 40 hex digits, then a space.
    let id = line.get(..40).filter(|id| is_id(id))?;
    let mut at = space(line, 40)?;
    // The address: up to the next space; its first `@`, the last `:` before that and the
    // first `,` after it. Searched with memchr, not a byte loop with a branch per byte:
    // that loop was a third of this function's instructions.
    let field = at;
    at = field + memchr::memchr(b' ', &line[field..])?;
    let arobase = field + memchr::memchr(b'@', &line[field..at])?;
    let colon = field + memchr::memrchr(b':', &line[field..arobase])?;
    let comma = memchr::memchr(b',', &line[arobase..at]).map(|c| arobase + c);
    let (port, cport) = (
        &line[colon + 1..arobase],
        &line[arobase + 1..comma.unwrap_or(at)],
    );
    if !is_number(port) || !is_number(cport) {
        return None;
    }
    let parts = NodeLine {
        id,
        address: Address {
            ip: &line[field..colon],
            port: parse_port(port),
            cport: &line[arobase..comma.unwrap_or(at)],
            hostname: comma.map(|c| &line[c + 1..at]),
        },
        rest: at,
    };
    // The flags: not empty.
    at = word_end(line, at + 1)?;
    // The primary's id, or `-`; `at` is the space before it.
    let primary = line.get(at + 1..)?;
    at = if primary.starts_with(b"- ") {
        at + 3
    } else if primary.get(..40).is_some_and(is_id) {
        space(line, at + 41)?
    } else {
        return None;
    };
    // Ping sent, pong received, config epoch: numbers.
    for _ in 0..3 {
        let digits = line[at..].iter().take_while(|b| b.is_ascii_digit()).count();
        if digits == 0 {
            return None;
        }
        at = space(line, at + digits)?;
    }
    // The link state, then the slots if any: words of at least one byte.
    let after = [&b"connected"[..], b"disconnected"]
        .into_iter()
        .find_map(|state| line[at..].strip_prefix(state))?;
    match after {
        [] => Some(parts),
        [b' ', slots @ ..] => {
            let words = slots.first().is_some_and(|&b| b != b' ')
                && slots.last() != Some(&b' ')
                && !slots.windows(2).any(|w| w == b"  ");
            words.then_some(parts)
        }
        _ => None,
    }
}

/// The index after the space at `at`, if `line` has one there.
fn space(line: &[u8], at: usize) -> Option<usize> {
    (line.get(at) == Some(&b' ')).then_some(at + 1)
}

/// The index of the space that ends the word starting at `at`, if the word is not empty and
/// a space follows it.
fn word_end(line: &[u8], at: usize) -> Option<usize> {
    let len = memchr::memchr(b' ', line.get(at..)?)?;
    (len > 0).then_some(at + len)
}

/// A node id: 40 hex digits. Checked as a fixed-size array with no early exit, which the
/// compiler turns into a few vector compares.
fn is_id(f: &[u8]) -> bool {
    let Ok(id) = <&[u8; 40]>::try_from(f) else {
        return false;
    };
    id.iter().fold(true, |ok, &b| {
        // `b | 0x20` is in a..=f exactly for A..=F and a..=f.
        ok & (b.is_ascii_digit() | matches!(b | 0x20, b'a'..=b'f'))
    })
}

/// Decimal digits, at least one.
fn is_number(f: &[u8]) -> bool {
    !f.is_empty() && f.iter().fold(true, |ok, b| ok & b.is_ascii_digit())
}

/// `CLUSTER REPLICAS`: an array of lines without the trailing newline.
pub fn replicas(map: &AddressMap, f: &mut Frame<'_>, report: &mut Report) {
    let Frame::Array(_, items) = f else { return };
    for item in items {
        if let Frame::Bulk(line) = item {
            let before = report.rewritten;
            let mut out = Vec::with_capacity(line.len() + 64);
            rewrite_line(map, line, &mut out, report);
            if report.rewritten > before {
                *line = Cow::Owned(out);
            }
        }
    }
}

/// One line, not checked; appends it, rewritten or not, to `out`.
fn rewrite_line(map: &AddressMap, line: &[u8], out: &mut Vec<u8>, report: &mut Report) {
    // `<id> <addr> <rest>`, split at the first two spaces.
    let Some(s0) = memchr::memchr(b' ', line) else {
        out.extend_from_slice(line);
        return;
    };
    let addr = &line[s0 + 1..];
    let rest = s0 + 1 + memchr::memchr(b' ', addr).unwrap_or(addr.len());
    let parts = NodeLine {
        id: &line[..s0],
        address: split_address(&line[s0 + 1..rest]),
        rest,
    };
    rewrite_parts(map, line, &parts, out, report);
}

/// `ip:port@cport[,hostname]`, split as far as it has those parts.
fn split_address(addr: &[u8]) -> Address<'_> {
    let (hostport, tail) = match memchr::memchr(b'@', addr) {
        Some(at) => (&addr[..at], &addr[at..]),
        None => (addr, &b""[..]),
    };
    let (cport, hostname) = match memchr::memchr(b',', tail) {
        Some(c) => (&tail[..c], Some(&tail[c + 1..])),
        None => (tail, None),
    };
    let (ip, port) = match memchr::memrchr(b':', hostport) {
        Some(c) => (&hostport[..c], parse_port(&hostport[c + 1..])),
        None => (hostport, None),
    };
    Address {
        ip,
        port,
        cport,
        hostname,
    }
}

/// `line` with its address rewritten, if the map knows the node, appended to `out`.
fn rewrite_parts(
    map: &AddressMap,
    line: &[u8],
    parts: &NodeLine<'_>,
    out: &mut Vec<u8>,
    report: &mut Report,
) {
    let NodeLine {
        id,
        ref address,
        rest,
    } = *parts;
    let Address {
        ip,
        port,
        cport,
        hostname,
    } = *address;
    // `:0@0`: a node with no address yet keeps saying so.
    if ip.is_empty() && port == Some(0) {
        out.extend_from_slice(line);
        return;
    }
    let Some(ext) = map.find(Some(id), &[(Some(ip), port), (hostname, port)]) else {
        report.unknown(format!(
            "{}:{} (node {})",
            String::from_utf8_lossy(ip),
            port.unwrap_or(0),
            String::from_utf8_lossy(id)
        ));
        out.extend_from_slice(line);
        return;
    };
    report.rewritten += 1;
    out.extend_from_slice(id);
    out.push(b' ');
    // The address field holds an IP; a proxy reached by name puts the name there too, which
    // is what clients dial, and in the hostname slot.
    out.extend_from_slice(ext.host.as_bytes());
    out.push(b':');
    out.extend_from_slice(itoa::Buffer::new().format(ext.port).as_bytes());
    out.extend_from_slice(cport);
    if !ext.host_is_ip {
        out.push(b',');
        out.extend_from_slice(ext.host.as_bytes());
    }
    // The rest from its space on, if there is a rest.
    out.extend_from_slice(&line[rest..]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The check as first written (split into a vector of fields): the reference the
    /// one-pass version must agree with.
    fn reference(line: &[u8]) -> bool {
        let fields: Vec<&[u8]> = line.split(|&b| b == b' ').collect();
        let id = |f: &[u8]| f.len() == 40 && f.iter().all(u8::is_ascii_hexdigit);
        let number = |f: &[u8]| !f.is_empty() && f.iter().all(u8::is_ascii_digit);
        let address = |f: &[u8]| {
            let Some(at) = f.iter().position(|&b| b == b'@') else {
                return false;
            };
            let (hostport, tail) = (&f[..at], &f[at + 1..]);
            let cport = tail.split(|&b| b == b',').next().unwrap_or_default();
            hostport
                .iter()
                .rposition(|&b| b == b':')
                .is_some_and(|c| number(&hostport[c + 1..]))
                && number(cport)
        };
        fields.len() >= 8
            && id(fields[0])
            && address(fields[1])
            && !fields[2].is_empty()
            && (fields[3] == b"-" || id(fields[3]))
            && fields[4..7].iter().all(|f| number(f))
            && matches!(fields[7], b"connected" | b"disconnected")
            && fields[8..].iter().all(|f| !f.is_empty())
    }

    fn is_node_line(line: &[u8]) -> bool {
        node_line(line).is_some()
    }

    /// Replaces (op 0), removes (1) or inserts (2) a byte at each index.
    fn edit(bytes: &mut Vec<u8>, edits: Vec<(prop::sample::Index, u8, u8)>) {
        for (at, byte, op) in edits {
            let i = at.index(bytes.len() + 1);
            match op {
                0 if i < bytes.len() => bytes[i] = byte,
                1 if i < bytes.len() => {
                    bytes.remove(i);
                }
                _ => bytes.insert(i, byte),
            }
        }
    }

    /// A map that knows PRIMARY's node (by its id), not REPLICA's.
    fn map_of_primary() -> AddressMap {
        use crate::model::{Backend, Route, Routes};
        use shardgate_crds::NodeRef;
        use std::sync::Arc;
        let mut route = Route::new(
            NodeRef::new(0, 0),
            "127.0.0.1:30001".parse::<Backend>().unwrap(),
        );
        route.node_id = Some(PRIMARY[..40].to_string());
        let routes: Routes = [(31000, Arc::new(route))].into_iter().collect();
        AddressMap::new("proxy.example.test", &routes)
    }

    const PRIMARY: &str = "e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 127.0.0.1:30001@31001,vc-0-0 myself,master - 0 0 1 connected 0-5460";
    const REPLICA: &str = "67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1 10.0.0.2:6379@16379 slave e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 0 1796001046000 1 connected";
    /// A replica whose link is down, with a capital in its id and its primary's, and a node
    /// with no address yet (`:0@0`).
    const DOWN: &str = "67ED2db8d677e59ec4a4cefb06858cf2a1a89fa1 :0@0 slave,fail E7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 0 1796001046000 1 disconnected";

    #[test]
    fn node_lines_as_valkey_writes_them_and_near_misses() {
        let disconnected = REPLICA.replace(" connected", " disconnected");
        for line in [PRIMARY, REPLICA, &disconnected, DOWN] {
            assert!(is_node_line(line.as_bytes()), "{line}");
            assert!(reference(line.as_bytes()), "{line}");
        }
        let misses = [
            "",
            " ",
            &format!("{PRIMARY} "),
            &PRIMARY.replacen(' ', "  ", 1),
            &REPLICA.replace(" connected", ""),
            // A slot list that starts with a space: an empty first slot field.
            &PRIMARY.replace("connected 0", "connected  "),
            &PRIMARY.replace(" - 0 ", " -0 "),
            &REPLICA.replace("connected", "up"),
            &REPLICA.replace("connected", "disconnectedx"),
            &REPLICA.replace(" connected", " dis connected"),
            &REPLICA.replace(":6379@", "6379@"),
            &REPLICA.replace("@16379", ""),
            &REPLICA.replace(" 0 ", " x "),
            "value stored by a user 127.0.0.1:6379@16379 not a node line at all",
        ];
        for line in misses {
            assert!(!is_node_line(line.as_bytes()), "{line:?}");
            assert!(!reference(line.as_bytes()), "{line:?}");
        }
    }

    proptest! {
        /// Replies of real lines with bytes replaced, removed or added, through a map that
        /// knows one of their nodes: accepted as the reference accepts each line; then
        /// rewritten as each line is on its own, else with the report left as it was.
        #[test]
        fn a_reply_is_rewritten_as_its_lines_are(
            lines in prop::collection::vec(prop::sample::select(vec![PRIMARY, REPLICA, DOWN]), 1..4),
            edits in prop::collection::vec((any::<prop::sample::Index>(), prop::sample::select(vec![b' ', b'\n', b'@', b':', b'0', b'x']), 0u8..3), 0..3),
        ) {
            let mut text = lines.join("\n").into_bytes();
            text.push(b'\n');
            edit(&mut text, edits);
            let map = map_of_primary();
            let accepted = text.strip_suffix(b"\n").is_some_and(|body| body.split(|&b| b == b'\n').all(reference));
            let mut report = Report::default();
            report.unknown("from an earlier reply");
            let got = checked_rewrite(&map, &text, &mut report);
            if !accepted {
                prop_assert_eq!(got, Err(NotNodes));
                prop_assert_eq!((report.rewritten, report.unknown.len()), (0, 1));
                return Ok(());
            }
            let mut want = (vec![], Report::default());
            want.1.unknown("from an earlier reply");
            for line in text.strip_suffix(b"\n").unwrap_or_default().split(|&b| b == b'\n') {
                rewrite_line(&map, line, &mut want.0, &mut want.1);
                want.0.push(b'\n');
            }
            let rewritten = want.1.rewritten > 0;
            prop_assert_eq!(got, Ok(rewritten.then_some(want.0)));
            prop_assert_eq!((report.rewritten, report.unknown), (want.1.rewritten, want.1.unknown));
        }

        /// Real lines with bytes replaced, removed or added: the one-pass check says what
        /// the reference says.
        #[test]
        fn agrees_with_the_reference(
            base in prop::sample::select(vec![PRIMARY, REPLICA, DOWN]),
            edits in prop::collection::vec((any::<prop::sample::Index>(), prop::sample::select(vec![b' ', b'@', b':', b',', b'-', b'a', b'0', b'x']), 0u8..3), 0..4),
        ) {
            let mut line = base.as_bytes().to_vec();
            edit(&mut line, edits);
            prop_assert_eq!(is_node_line(&line), reference(&line), "{}", line.escape_ascii());
        }
    }
}
