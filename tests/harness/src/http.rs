//! A minimal HTTP/1.0 GET, for the proxy's admin endpoints in tests (no client crate needed
//! for `/metrics`, `/readyz` and `/routes`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result};

/// `GET path` → (status code, body).
pub fn get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .with_context(|| format!("connect to admin {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)
        .with_context(|| format!("read GET {path} from {addr}"))?;
    let status = raw
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("no status line in {raw:?}"))?;
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// The value of a Prometheus sample, e.g. `metric(body, "shardgate_proxy_listeners")` or
/// with labels `metric(body, "shardgate_proxy_route_source_errors_total{source=\"file\"}")`.
pub fn metric(body: &str, sample: &str) -> Option<f64> {
    body.lines()
        .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' '))
        .and_then(|v| v.split(' ').next()?.parse().ok())
}
