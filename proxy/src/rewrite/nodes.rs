//! CLUSTER NODES and CLUSTER REPLICAS: text lines `<id> <ip:port@cport[,hostname]> ...`.

use std::borrow::Cow;

use super::addresses::{parse_port, AddressMap};
use super::Report;
use crate::resp::frame::Frame;

/// `CLUSTER NODES`: a bulk string (RESP2) or a `txt:` verbatim string (RESP3).
pub fn nodes(map: &AddressMap, f: &mut Frame<'_>, report: &mut Report) {
    match f {
        Frame::Bulk(text) => {
            if let Some(new) = rewrite_text(map, text, report) {
                *text = Cow::Owned(new);
            }
        }
        Frame::Verbatim(v) if v.len() >= 4 => {
            if let Some(new) = rewrite_text(map, &v[4..], report) {
                let mut out = v[..4].to_vec();
                out.extend_from_slice(&new);
                *v = Cow::Owned(out);
            }
        }
        _ => {}
    }
}

/// Whether `f` has the exact shape of a CLUSTER NODES reply: a string (RESP2 bulk or RESP3
/// `txt:` verbatim) of node lines, each ended by a newline.
pub fn is_nodes(f: &Frame<'_>) -> bool {
    let text = match f {
        Frame::Bulk(t) => &t[..],
        Frame::Verbatim(v) if v.starts_with(b"txt:") => &v[4..],
        _ => return false,
    };
    let Some(body) = text.strip_suffix(b"\n") else {
        return false;
    };
    body.split(|&b| b == b'\n').all(is_node_line)
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
    // Field by field, found with memchr, with no allocation: a large cluster's reply has
    // hundreds of lines, and this check runs before every rewrite.
    let mut rest = line;
    let mut next = || -> Option<&[u8]> {
        if rest.is_empty() {
            return None;
        }
        let end = memchr::memchr(b' ', rest).unwrap_or(rest.len());
        let field = &rest[..end];
        rest = rest.get(end + 1..).unwrap_or_default();
        Some(field)
    };
    let id = |f: &[u8]| f.len() == 40 && f.iter().all(u8::is_ascii_hexdigit);
    let number = |f: &[u8]| !f.is_empty() && f.iter().all(u8::is_ascii_digit);
    let address = |f: &[u8]| {
        let Some(at) = memchr::memchr(b'@', f) else {
            return false;
        };
        let (hostport, tail) = (&f[..at], &f[at + 1..]);
        let cport = &tail[..memchr::memchr(b',', tail).unwrap_or(tail.len())];
        memchr::memrchr(b':', hostport).is_some_and(|c| number(&hostport[c + 1..])) && number(cport)
    };
    let shaped = next().is_some_and(id)
        && next().is_some_and(address)
        && next().is_some_and(|flags| !flags.is_empty())
        && next().is_some_and(|primary| primary == b"-" || id(primary))
        && next().is_some_and(number)
        && next().is_some_and(number)
        && next().is_some_and(number)
        && next().is_some_and(|link| matches!(link, b"connected" | b"disconnected"));
    // The slots, if any: no empty field (two spaces, or a trailing one).
    shaped && std::iter::from_fn(next).all(|f| !f.is_empty()) && !line.ends_with(b" ")
}

/// `CLUSTER REPLICAS`: an array of lines without the trailing newline.
pub fn replicas(map: &AddressMap, f: &mut Frame<'_>, report: &mut Report) {
    let Frame::Array(_, items) = f else { return };
    for item in items {
        nodes(map, item, report);
    }
}

fn rewrite_text(map: &AddressMap, text: &[u8], report: &mut Report) -> Option<Vec<u8>> {
    let before = report.rewritten;
    let mut out = Vec::with_capacity(text.len() + 64);
    for (n, line) in text.split(|&b| b == b'\n').enumerate() {
        if n > 0 {
            out.push(b'\n');
        }
        rewrite_line(map, line, &mut out, report);
    }
    (report.rewritten > before).then_some(out)
}

/// One line; appends it, rewritten or not, to `out`.
fn rewrite_line(map: &AddressMap, line: &[u8], out: &mut Vec<u8>, report: &mut Report) {
    let mut fields = line.splitn(3, |&b| b == b' ');
    let (Some(id), Some(addr)) = (fields.next(), fields.next()) else {
        out.extend_from_slice(line);
        return;
    };
    let rest = fields.next();
    // ip:port@cport[,hostname]
    let (hostport, tail) = match addr.iter().position(|&b| b == b'@') {
        Some(at) => (&addr[..at], &addr[at..]),
        None => (addr, &b""[..]),
    };
    let (cport, hostname) = match tail.iter().position(|&b| b == b',') {
        Some(c) => (&tail[..c], Some(&tail[c + 1..])),
        None => (tail, None),
    };
    let colon = hostport.iter().rposition(|&b| b == b':');
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
