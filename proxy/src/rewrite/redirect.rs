//! `-MOVED <slot> <host>:<port>` and `-ASK <slot> <host>:<port>`.

use super::addresses::{parse_port, AddressMap};
use super::Report;

/// The rewritten error line (without `-` and CRLF), if it is a redirect to a known node.
pub fn rewrite(map: &AddressMap, line: &[u8], report: &mut Report) -> Option<Vec<u8>> {
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
    let mut out = Vec::with_capacity(line.len() + 16);
    out.extend_from_slice(kind);
    out.push(b' ');
    out.extend_from_slice(slot);
    out.push(b' ');
    if ext.host_is_ip && ext.host.contains(':') {
        out.push(b'[');
        out.extend_from_slice(ext.host.as_bytes());
        out.push(b']');
    } else {
        out.extend_from_slice(ext.host.as_bytes());
    }
    out.push(b':');
    out.extend_from_slice(itoa::Buffer::new().format(ext.port).as_bytes());
    Some(out)
}
