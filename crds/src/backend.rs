//! A Valkey node's address as the proxy dials it: an IP or a DNS name, and a port. The route
//! file, the proxy's `--seed` flags and its route table all name nodes this way.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

/// Where a backend lives: an IP address, or a DNS name resolved at connect time.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(untagged)]
pub enum Host {
    Ip(IpAddr),
    Dns(String),
}

/// A Valkey node's address as the proxy dials it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend {
    pub host: Host,
    pub port: u16,
}

/// Why a backend address does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    #[error("{0:?} has no port (expected host:port, e.g. 10.0.0.1:6379 or valkey-0:6379)")]
    NoPort(String),
    #[error("{0:?}: port must be a number between 1 and 65535")]
    BadPort(String),
    #[error("{0:?}: {1:?} is not a valid IP address or DNS name")]
    BadHost(String, String),
}

impl Backend {
    pub fn ip(addr: SocketAddr) -> Self {
        Backend {
            host: Host::Ip(addr.ip()),
            port: addr.port(),
        }
    }

    /// The socket address, if the host is an IP.
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        match self.host {
            Host::Ip(ip) => Some(SocketAddr::new(ip, self.port)),
            Host::Dns(_) => None,
        }
    }
}

impl FromStr for Backend {
    type Err = BackendError;

    /// `host:port`, `[v6]:port`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Ok(addr) = s.parse::<SocketAddr>() {
            if addr.port() == 0 {
                return Err(BackendError::BadPort(s.to_string()));
            }
            return Ok(Backend::ip(addr));
        }
        let (host, port) = s
            .rsplit_once(':')
            .ok_or_else(|| BackendError::NoPort(s.to_string()))?;
        let port = match port.parse::<u16>() {
            Ok(p) if p > 0 => p,
            _ => return Err(BackendError::BadPort(s.to_string())),
        };
        if host.contains(':') || host.starts_with('[') {
            // An IPv6 literal must be bracketed and then parses as a SocketAddr above.
            return Err(BackendError::BadHost(s.to_string(), host.to_string()));
        }
        if let Ok(ip) = host.parse::<IpAddr>() {
            return Ok(Backend {
                host: Host::Ip(ip),
                port,
            });
        }
        if !is_dns_name(host) {
            return Err(BackendError::BadHost(s.to_string(), host.to_string()));
        }
        Ok(Backend {
            host: Host::Dns(host.to_ascii_lowercase()),
            port,
        })
    }
}

/// RFC 1123 host name: labels of letters, digits and hyphens, not starting or ending with a
/// hyphen, at most 63 bytes each and 253 in all; an optional trailing dot.
fn is_dns_name(host: &str) -> bool {
    let h = host.strip_suffix('.').unwrap_or(host);
    !h.is_empty()
        && h.len() <= 253
        && h.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
        // An all-numeric name is a mistyped IP, not a host.
        && !h.bytes().all(|b| b.is_ascii_digit() || b == b'.')
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            Host::Ip(IpAddr::V6(ip)) => write!(f, "[{ip}]:{}", self.port),
            Host::Ip(ip) => write!(f, "{ip}:{}", self.port),
            Host::Dns(name) => write!(f, "{name}:{}", self.port),
        }
    }
}

impl serde::Serialize for Backend {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Backend {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ips_and_names() {
        let b: Backend = "10.0.0.1:6379".parse().unwrap();
        assert_eq!(b.socket_addr(), Some("10.0.0.1:6379".parse().unwrap()));
        let b: Backend = "[::1]:6379".parse().unwrap();
        assert_eq!(b.to_string(), "[::1]:6379");
        let b: Backend = "Valkey-0-1.valkey.ns.svc:6379".parse().unwrap();
        assert_eq!(b.host, Host::Dns("valkey-0-1.valkey.ns.svc".into()));
        assert_eq!(b.to_string(), "valkey-0-1.valkey.ns.svc:6379");
    }

    #[test]
    fn rejects_bad_addresses_with_a_reason() {
        for (bad, want) in [
            ("10.0.0.1", "has no port"),
            ("10.0.0.1:0", "port must be"),
            ("10.0.0.1:70000", "port must be"),
            ("host:port", "port must be"),
            ("::1:6379", "not a valid IP"),
            ("under_score:6379", "not a valid IP"),
            ("-bad:6379", "not a valid IP"),
            ("10.0.0.300:6379", "not a valid IP"),
            (":6379", "not a valid IP"),
        ] {
            let err = bad.parse::<Backend>().unwrap_err().to_string();
            assert!(err.contains(want), "{bad}: {err}");
        }
    }
}
