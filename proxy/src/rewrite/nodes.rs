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
    let ok = text.ends_with(b"\n") && {
        // The line in progress: where it and its current field start, the field's index,
        // and where its first two fields (the id and the address) end.
        let (mut line, mut start, mut field, mut ends) = (0, 0, 0, [0; 2]);
        separators(text, &mut |end| {
            if !node_field(field, &text[start..end]) {
                return false;
            }
            if field < 2 {
                ends[field] = end;
            }
            start = end + 1;
            if text[end] == b' ' {
                field += 1;
                return true;
            }
            // A newline: at least the eight fields up to the link state.
            if field < 7 {
                return false;
            }
            if out.capacity() == 0 {
                out.reserve(text.len() + 64);
            }
            let (id, addr) = (&text[line..ends[0]], &text[ends[0] + 1..ends[1]]);
            rewrite_fields(map, &text[line..end], id, addr, Some(&text[ends[1] + 1..end]), &mut out, report);
            out.push(b'\n');
            (line, field) = (start, 0);
            true
        })
    };
    if !ok {
        report.rewritten = before.0;
        report.unknown.truncate(before.1);
        return Err(NotNodes);
    }
    Ok((report.rewritten > before.0).then_some(out))
}

/// Calls `at` with the position of each space and newline in `text`, in order, until it
/// returns false; returns whether it never did. Eight bytes are tested at a time (SWAR):
/// the separators of a NODES reply are a few bytes apart, too close for a memchr call per
/// field to pay off.
fn separators(text: &[u8], at: &mut impl FnMut(usize) -> bool) -> bool {
    const LOW: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    const SPACES: u64 = 0x2020_2020_2020_2020;
    const NEWLINES: u64 = 0x0a0a_0a0a_0a0a_0a0a;
    // The high bit of each byte of `x` that is zero, and of no other (exact, unlike the
    // shorter `(x - 0x01..) & !x & 0x80..`, which may mark a byte after a zero one).
    let zeros = |x: u64| !(((x & LOW) + LOW) | x | LOW);
    let mut words = text.chunks_exact(8);
    let mut base = 0;
    for word in &mut words {
        let x = u64::from_le_bytes([
            word[0], word[1], word[2], word[3], word[4], word[5], word[6], word[7],
        ]);
        let mut found = zeros(x ^ SPACES) | zeros(x ^ NEWLINES);
        while found != 0 {
            if !at(base + found.trailing_zeros() as usize / 8) {
                return false;
            }
            found &= found - 1;
        }
        base += 8;
    }
    for (i, b) in words.remainder().iter().enumerate() {
        if matches!(b, b' ' | b'\n') && !at(base + i) {
            return false;
        }
    }
    true
}

/// Whether `f` has the exact shape of a CLUSTER REPLICAS reply: an array of bulk strings,
/// each one node line without its newline.
pub fn is_replicas(f: &Frame<'_>) -> bool {
    let Frame::Array(b'*', items) = f else {
        return false;
    };
    items
        .iter()
        .all(|item| matches!(item, Frame::Bulk(line) if is_node_line(line)))
}

/// `<id> <ip:port@cport[,hostname]> <flags> <primary-id|-> <ping> <pong> <epoch>
/// <link-state> [<slot>...]`, as `clusterGenNodeDescription` writes it.
fn is_node_line(line: &[u8]) -> bool {
    // One pass over the bytes with no allocation, the spaces found by memchr and each field
    // checked as its space is found: a large cluster's reply has hundreds of lines, and
    // this check runs before every rewrite.
    let mut field = 0;
    let mut start = 0;
    for space in memchr::memchr_iter(b' ', line) {
        if !node_field(field, &line[start..space]) {
            return false;
        }
        field += 1;
        start = space + 1;
    }
    // At least the eight fields up to the link state; none empty (a trailing space leaves an
    // empty last one).
    field >= 7 && node_field(field, &line[start..])
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

/// Field `k` of a node line, as `clusterGenNodeDescription` writes it.
fn node_field(k: usize, f: &[u8]) -> bool {
    match k {
        0 => is_id(f),
        // ip:port@cport[,hostname]
        1 => {
            let Some(at) = memchr::memchr(b'@', f) else {
                return false;
            };
            let (hostport, tail) = (&f[..at], &f[at + 1..]);
            let cport = &tail[..memchr::memchr(b',', tail).unwrap_or(tail.len())];
            memchr::memrchr(b':', hostport).is_some_and(|c| is_number(&hostport[c + 1..]))
                && is_number(cport)
        }
        // The flags.
        2 => !f.is_empty(),
        // The primary's id, or `-`.
        3 => f == b"-" || is_id(f),
        // Ping sent, pong received, config epoch.
        4..=6 => is_number(f),
        7 => matches!(f, b"connected" | b"disconnected"),
        // The slots.
        _ => !f.is_empty(),
    }
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

/// One line; appends it, rewritten or not, to `out`.
fn rewrite_line(map: &AddressMap, line: &[u8], out: &mut Vec<u8>, report: &mut Report) {
    // `<id> <addr> <rest>`, split at the first two spaces.
    let Some(s0) = memchr::memchr(b' ', line) else {
        out.extend_from_slice(line);
        return;
    };
    let (id, after) = (&line[..s0], &line[s0 + 1..]);
    let (addr, rest) = match memchr::memchr(b' ', after) {
        Some(s1) => (&after[..s1], Some(&after[s1 + 1..])),
        None => (after, None),
    };
    rewrite_fields(map, line, id, addr, rest, out, report);
}

/// One line split into its id, its address and the rest; appends it, rewritten or not, to
/// `out`.
fn rewrite_fields(
    map: &AddressMap,
    line: &[u8],
    id: &[u8],
    addr: &[u8],
    rest: Option<&[u8]>,
    out: &mut Vec<u8>,
    report: &mut Report,
) {
    // ip:port@cport[,hostname]
    let (hostport, tail) = match memchr::memchr(b'@', addr) {
        Some(at) => (&addr[..at], &addr[at..]),
        None => (addr, &b""[..]),
    };
    let (cport, hostname) = match memchr::memchr(b',', tail) {
        Some(c) => (&tail[..c], Some(&tail[c + 1..])),
        None => (tail, None),
    };
    let colon = memchr::memrchr(b':', hostport);
    let (ip, port) = match colon {
        Some(c) => (&hostport[..c], parse_port(&hostport[c + 1..])),
        None => (hostport, None),
    };
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
    if let Some(rest) = rest {
        out.push(b' ');
        out.extend_from_slice(rest);
    }
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
        let mut route = Route::new(NodeRef::new(0, 0), "127.0.0.1:30001".parse::<Backend>().unwrap());
        route.node_id = Some(PRIMARY[..40].to_string());
        let routes: Routes = [(31000, Arc::new(route))].into_iter().collect();
        AddressMap::new("proxy.example.test", &routes)
    }

    const PRIMARY: &str = "e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 127.0.0.1:30001@31001,vc-0-0 myself,master - 0 0 1 connected 0-5460";
    const REPLICA: &str = "67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1 10.0.0.2:6379@16379 slave e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 0 1796001046000 1 connected";

    #[test]
    fn node_lines_as_valkey_writes_them_and_near_misses() {
        for line in [PRIMARY, REPLICA] {
            assert!(is_node_line(line.as_bytes()), "{line}");
        }
        let misses = [
            "",
            " ",
            &format!("{PRIMARY} "),
            &PRIMARY.replacen(' ', "  ", 1),
            &REPLICA.replace(" connected", ""),
            &REPLICA.replace("connected", "up"),
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
        #[test]
        fn separators_are_the_spaces_and_newlines(text in prop::collection::vec(prop::sample::select(vec![b' ', b'\n', b'a', 0x20 ^ 0x80, 0x0a ^ 0x80, 0, 0xff, 0x21, 0x1f]), 0..40)) {
            let want: Vec<usize> = (0..text.len()).filter(|&i| matches!(text[i], b' ' | b'\n')).collect();
            let mut got = vec![];
            let all = separators(&text, &mut |i| {
                got.push(i);
                true
            });
            prop_assert!(all);
            prop_assert_eq!(got, want);
        }

        /// Replies of real lines with bytes replaced, removed or added, through a map that
        /// knows one of their nodes: accepted as the reference accepts each line; then
        /// rewritten as each line is on its own, else with the report left as it was.
        #[test]
        fn a_reply_is_rewritten_as_its_lines_are(
            lines in prop::collection::vec(prop::sample::select(vec![PRIMARY, REPLICA]), 1..4),
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
            base in prop::sample::select(vec![PRIMARY, REPLICA]),
            edits in prop::collection::vec((any::<prop::sample::Index>(), prop::sample::select(vec![b' ', b'@', b':', b',', b'-', b'a', b'0', b'x']), 0u8..3), 0..4),
        ) {
            let mut line = base.as_bytes().to_vec();
            edit(&mut line, edits);
            prop_assert_eq!(is_node_line(&line), reference(&line), "{}", line.escape_ascii());
        }
    }
}
