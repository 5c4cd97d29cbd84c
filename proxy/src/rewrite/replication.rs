//! ROLE and INFO's replication section: the replication addresses of primaries and
//! replicas, so that no internal address reaches an external client through any command.

use std::borrow::Cow;

use super::addresses::{parse_port, port_text, AddressMap};
use super::Report;
use crate::resp::frame::Frame;

/// Whether `f` has the exact shape of a ROLE reply of a primary (`[master, offset,
/// [[ip, port, offset], ...]]`) or of a replica (`[slave, ip, port, state, offset]`).
pub fn is_role(f: &Frame<'_>) -> bool {
    let Frame::Array(b'*', items) = f else {
        return false;
    };
    let bulk = |f: &Frame<'_>| matches!(f, Frame::Bulk(_));
    match items.first().and_then(Frame::as_bytes) {
        Some(b"master") => {
            items.len() == 3
                && items[1].as_int().is_some()
                && matches!(&items[2], Frame::Array(b'*', replicas) if replicas.iter().all(
                    |r| matches!(r, Frame::Array(b'*', fields) if fields.len() == 3 && fields.iter().all(bulk))
                ))
        }
        Some(b"slave") => {
            items.len() == 5
                && bulk(&items[1])
                && items[2].as_int().is_some()
                && bulk(&items[3])
                && items[4].as_int().is_some()
        }
        _ => false,
    }
}

/// Whether `f` has the exact shape of an INFO reply: a string (bulk, or RESP3 `txt:`
/// verbatim) of CRLF-ended lines, the first a `# Section` header, each line empty, a
/// header, or `key:value` with a key of `[A-Za-z0-9_.-]`.
pub fn is_info(f: &Frame<'_>) -> bool {
    let text = match f {
        Frame::Bulk(t) => &t[..],
        Frame::Verbatim(v) if v.starts_with(b"txt:") => &v[4..],
        _ => return false,
    };
    let Some(body) = text.strip_suffix(b"\r\n") else {
        return false;
    };
    if !body.starts_with(b"# ") {
        return false;
    }
    body.split(|&b| b == b'\n').all(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        line.is_empty()
            || line.starts_with(b"# ")
            || line.iter().position(|&b| b == b':').is_some_and(|c| {
                c > 0
                    && line[..c]
                        .iter()
                        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
            })
    })
}

/// `ROLE`: `[master, offset, [[ip, port, offset], ...]]` or `[slave, ip, port, state, offset]`.
pub fn role(map: &AddressMap, f: &mut Frame<'_>, report: &mut Report) {
    let Frame::Array(_, items) = f else { return };
    match items.first().and_then(Frame::as_bytes) {
        Some(b"master") => {
            let Some(Frame::Array(_, replicas)) = items.get_mut(2) else {
                return;
            };
            for r in replicas {
                let Frame::Array(_, fields) = r else { continue };
                if fields.len() < 2 {
                    continue;
                }
                let port = fields[1].as_bytes().and_then(parse_port);
                let ip = fields[0].as_bytes().unwrap_or_default().to_vec();
                match port.and_then(|p| map.endpoint_of_addr(&ip, p)) {
                    Some(ext) => {
                        fields[0] = Frame::Bulk(Cow::Owned(ext.host.as_bytes().to_vec()));
                        fields[1] = Frame::Bulk(Cow::Owned(port_text(ext.port)));
                        report.rewritten += 1;
                    }
                    None => report.unknown(format!(
                        "{}:{}",
                        String::from_utf8_lossy(&ip),
                        port.unwrap_or(0)
                    )),
                }
            }
        }
        Some(b"slave") if items.len() >= 3 => {
            let port = items[2].as_int().and_then(|p| u16::try_from(p).ok());
            let ip = items[1].as_bytes().unwrap_or_default().to_vec();
            match port.and_then(|p| map.endpoint_of_addr(&ip, p)) {
                Some(ext) => {
                    items[1] = Frame::Bulk(Cow::Owned(ext.host.as_bytes().to_vec()));
                    items[2] = Frame::Int(Cow::Owned(port_text(ext.port)));
                    report.rewritten += 1;
                }
                None => report.unknown(format!(
                    "{}:{}",
                    String::from_utf8_lossy(&ip),
                    port.unwrap_or(0)
                )),
            }
        }
        _ => {}
    }
}

/// `INFO`: `slaveN:ip=..,port=..,...` and `master_host:` / `master_port:` lines.
pub fn info(map: &AddressMap, f: &mut Frame<'_>, report: &mut Report) {
    let (text, prefix): (&mut Cow<'_, [u8]>, usize) = match f {
        Frame::Bulk(t) => (t, 0),
        Frame::Verbatim(t) if t.len() >= 4 => (t, 4),
        _ => return,
    };
    let before = report.rewritten;
    let body = &text[prefix..];
    let lines: Vec<&[u8]> = body.split(|&b| b == b'\n').collect();
    let value = |key: &[u8]| {
        lines.iter().find_map(|l| {
            let l = l.strip_suffix(b"\r").unwrap_or(l);
            l.strip_prefix(key)
        })
    };
    // The primary a replica follows: both lines must resolve, or neither changes.
    let primary = match (
        value(b"master_host:"),
        value(b"master_port:").and_then(parse_port),
    ) {
        (Some(h), Some(p)) => match map.endpoint_of_addr(h, p) {
            Some(ext) => Some(ext),
            None => {
                report.unknown(format!("{}:{p}", String::from_utf8_lossy(h)));
                None
            }
        },
        _ => None,
    };
    let mut out = text[..prefix].to_vec();
    for (n, line) in lines.iter().enumerate() {
        if n > 0 {
            out.push(b'\n');
        }
        let (l, cr) = match line.strip_suffix(b"\r") {
            Some(l) => (l, &b"\r"[..]),
            None => (*line, &b""[..]),
        };
        if let (Some(ext), true) = (primary, l.starts_with(b"master_host:")) {
            out.extend_from_slice(b"master_host:");
            out.extend_from_slice(ext.host.as_bytes());
        } else if let (Some(ext), true) = (primary, l.starts_with(b"master_port:")) {
            out.extend_from_slice(b"master_port:");
            out.extend_from_slice(&port_text(ext.port));
        } else if is_replica_line(l) {
            replica_line(map, l, &mut out, report);
        } else {
            out.extend_from_slice(l);
        }
        out.extend_from_slice(cr);
    }
    if primary.is_some() {
        report.rewritten += 1;
    }
    if report.rewritten > before {
        *text = Cow::Owned(out);
    }
}

/// `slave0:ip=...`.
fn is_replica_line(l: &[u8]) -> bool {
    l.strip_prefix(b"slave")
        .and_then(|r| r.iter().position(|&b| b == b':').map(|c| (r, c)))
        .is_some_and(|(r, c)| {
            c > 0 && r[..c].iter().all(u8::is_ascii_digit) && r[c + 1..].starts_with(b"ip=")
        })
}

fn replica_line(map: &AddressMap, l: &[u8], out: &mut Vec<u8>, report: &mut Report) {
    let Some(colon) = l.iter().position(|&b| b == b':') else {
        out.extend_from_slice(l);
        return;
    };
    let (name, fields) = (&l[..=colon], &l[colon + 1..]);
    let get = |k: &[u8]| fields.split(|&b| b == b',').find_map(|f| f.strip_prefix(k));
    let (Some(ip), Some(port)) = (get(b"ip="), get(b"port=").and_then(parse_port)) else {
        out.extend_from_slice(l);
        return;
    };
    let Some(ext) = map.endpoint_of_addr(ip, port) else {
        report.unknown(format!("{}:{port}", String::from_utf8_lossy(ip)));
        out.extend_from_slice(l);
        return;
    };
    report.rewritten += 1;
    out.extend_from_slice(name);
    for (n, field) in fields.split(|&b| b == b',').enumerate() {
        if n > 0 {
            out.push(b',');
        }
        if field.starts_with(b"ip=") {
            out.extend_from_slice(b"ip=");
            out.extend_from_slice(ext.host.as_bytes());
        } else if field.starts_with(b"port=") {
            out.extend_from_slice(b"port=");
            out.extend_from_slice(&port_text(ext.port));
        } else {
            out.extend_from_slice(field);
        }
    }
}
