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
    // The exact shape: a slot number in range, then one address.
    if slot.is_empty()
        || slot.len() > 5
        || !slot.iter().all(u8::is_ascii_digit)
        || parse_port(slot).is_none_or(|s| s > 16383)
    {
        return None;
    }
    let addr = parts.next()?;
    let colon = addr.iter().rposition(|&b| b == b':')?;
    let (host, port) = (&addr[..colon], parse_port(&addr[colon + 1..])?);
    // No host (unknown-endpoint mode) or `?` (hostname mode without one): "the host you
    // dialled", which through the proxy is right; only the port needs the slot's owner.
    let special = host.is_empty() || host == b"?";
    // Only MOVED names the slot's owner; ASK names the node importing it, which no slot map
    // knows.
    let ext = if special && kind == b"MOVED" {
        let owner = std::str::from_utf8(slot)
            .ok()
            .and_then(|s| s.parse().ok())
            .and_then(|s| map.endpoint_of_slot(s));
        // The slot map may be stale right when slots move: look again soon.
        report.refresh |= owner.is_some();
        owner
    } else {
        map.endpoint_of_addr(host, port)
    };
    let Some(ext) = ext else {
        report.unknown(String::from_utf8_lossy(addr));
        return None;
    };
    report.rewritten += 1;
    out.reserve(line.len() + ext.host.len());
    out.extend_from_slice(kind);
    out.push(b' ');
    out.extend_from_slice(slot);
    out.push(b' ');
    // Per-port listeners share one host, so "the host you dialled" stays right; on the TLS
    // port every node has a name of its own, which the client needs for SNI.
    if special && !map.is_tls() {
        out.extend_from_slice(host);
    } else if ext.host_is_ipv6 {
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
