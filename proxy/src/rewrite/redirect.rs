//! `-MOVED <slot> <host>:<port>` and `-ASK <slot> <host>:<port>`.

use super::addresses::{parse_port, AddressMap};
use super::Report;

/// Appends the rewritten error line (without `-` and CRLF) to `out` and returns true, if
/// `line` is a redirect to a known node.
pub fn rewrite(map: &AddressMap, line: &[u8], report: &mut Report, out: &mut Vec<u8>) -> bool {
    write(map, line, report, out).is_some()
}

fn write(map: &AddressMap, line: &[u8], report: &mut Report, out: &mut Vec<u8>) -> Option<()> {
    let kind = if line.starts_with(b"MOVED ") {
        &b"MOVED"[..]
    } else if line.starts_with(b"ASK ") {
        &b"ASK"[..]
    } else {
        return None;
    };
    let mut parts = line[kind.len() + 1..].splitn(2, |&b| b == b' ');
    let slot = parts.next()?;
    let addr = parts.next()?;
    let colon = addr.iter().rposition(|&b| b == b':')?;
    let (host, port) = (&addr[..colon], parse_port(&addr[colon + 1..])?);
    let Some(ext) = map.endpoint_of_addr(host, port) else {
        report.unknown(String::from_utf8_lossy(addr));
        return None;
    };
    report.rewritten += 1;
    out.reserve(line.len() + ext.host.len());
    out.extend_from_slice(kind);
    out.push(b' ');
    out.extend_from_slice(slot);
    out.push(b' ');
    if ext.host_is_ipv6 {
        out.push(b'[');
        out.extend_from_slice(ext.host.as_bytes());
        out.push(b']');
    } else {
        out.extend_from_slice(ext.host.as_bytes());
    }
    out.push(b':');
    out.extend_from_slice(itoa::Buffer::new().format(ext.port).as_bytes());
    Some(())
}
