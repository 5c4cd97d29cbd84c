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
