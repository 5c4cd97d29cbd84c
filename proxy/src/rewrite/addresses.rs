//! The address map: a node's internal address or Valkey id → the [`Endpoint`] (host and
//! port) external clients reach it at through the proxy.
//!
//! One map per kind of listener, built from the same route table:
//! - the per-port listeners ([`AddressMap::new`]): every node at the one advertised host,
//!   each on its own listener port;
//! - the TLS port ([`AddressMap::sni`]): every node at its own SNI name
//!   (`<prefix>-<s>-<n>.<domain>`), all on the one TLS port.
//!
//! [`UnknownAddresses`] is what happens to an address no route knows: a warning, at most one
//! per address per [`UnknownAddresses::EVERY`] with the count of those not logged, and a
//! refresh asked of a source that can look again.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use shardgate_crds::{node_hostname, Hostnames};

use crate::model::{Host, Route, Routes, SLOTS};
use crate::throttle::Throttle;

/// Where external clients reach one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// An IP address or a DNS name.
    pub host: Arc<str>,
    /// Whether `host` is an IP address (else a DNS name).
    pub host_is_ip: bool,
    /// Whether `host` is an IPv6 address, written `[host]:port`.
    pub host_is_ipv6: bool,
    pub port: u16,
}

impl Endpoint {
    pub fn new(host: Arc<str>, port: u16) -> Self {
        let ip = host.parse::<IpAddr>().ok();
        Endpoint {
            host,
            host_is_ip: ip.is_some(),
            host_is_ipv6: ip.is_some_and(|ip| ip.is_ipv6()),
            port,
        }
    }
}

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Internal → external, built from a route table.
#[derive(Debug, Clone, Default)]
pub struct AddressMap {
    /// Lowercase node id → endpoint. Both maps hash with foldhash, several times faster
    /// than SipHash on a 40-byte id (a NODES reply looks up every line's): their keys come
    /// from the route table, not from clients, so flooding resistance buys nothing.
    by_id: FastMap<Vec<u8>, Endpoint>,
    /// Lowercase host → (port, endpoint) of the nodes there (one, or a few on one host).
    by_addr: FastMap<Vec<u8>, Vec<(u16, Endpoint)>>,
    /// Whether the endpoints speak TLS (the SNI port): CLUSTER SHARDS then names the port as
    /// `tls-port` as well.
    tls: bool,
    /// Slot → index in `owners`, `u16::MAX` for none; empty when no route knows its slots.
    by_slot: Vec<u16>,
    owners: Vec<Endpoint>,
}

impl AddressMap {
    /// The per-port listeners: every node at `advertise` (the host, an IP or a DNS name,
    /// external clients reach the proxy at), on its own listener port.
    pub fn new(advertise: &str, routes: &Routes) -> Self {
        let host: Arc<str> = advertise.into();
        Self::build(routes, false, |port, _| Endpoint::new(host.clone(), port))
    }

    /// The TLS port: every node at its SNI name, all on `tls_port`.
    pub fn sni(names: &Hostnames, tls_port: u16, routes: &Routes) -> Self {
        Self::build(routes, true, |_, route| {
            Endpoint::new(
                node_hostname(&names.prefix, route.node, &names.domain).into(),
                tls_port,
            )
        })
    }

    /// A map with each route's endpoint given by `endpoint(listener port, route)`.
    pub fn build(routes: &Routes, tls: bool, endpoint: impl Fn(u16, &Route) -> Endpoint) -> Self {
        let mut map = AddressMap {
            tls,
            ..AddressMap::default()
        };
        for (&port, route) in routes {
            let ext = endpoint(port, route);
            if let Some(id) = &route.node_id {
                map.by_id
                    .insert(id.as_bytes().to_ascii_lowercase(), ext.clone());
            }
            let host = match &route.backend.host {
                Host::Ip(ip) => ip.to_string(),
                Host::Dns(name) => name.clone(),
            };
            map.add_addr(host.into_bytes(), route.backend.port, ext.clone());
            if let Some(tls) = &route.tls_backend {
                let host = match &tls.host {
                    Host::Ip(ip) => ip.to_string(),
                    Host::Dns(name) => name.clone(),
                };
                map.add_addr(host.into_bytes(), tls.port, ext.clone());
            }
            if !route.slots.is_empty() && map.owners.len() < usize::from(u16::MAX) {
                if map.by_slot.is_empty() {
                    map.by_slot = vec![u16::MAX; SLOTS];
                }
                let owner = map.owners.len() as u16;
                map.owners.push(ext.clone());
                for &(from, to) in &route.slots {
                    for slot in usize::from(from)..=usize::from(to).min(SLOTS - 1) {
                        map.by_slot[slot] = owner;
                    }
                }
            }
            if let Some(h) = &route.hostname {
                map.add_addr(h.as_bytes().to_ascii_lowercase(), route.backend.port, ext);
            }
        }
        map
    }

    fn add_addr(&mut self, host: Vec<u8>, port: u16, ext: Endpoint) {
        let at = self.by_addr.entry(host).or_default();
        at.retain(|(p, _)| *p != port);
        at.push((port, ext));
    }

    /// The endpoint of the primary that served `slot` at the last discovery, if known. Only
    /// for redirects that name no host: the slot map is as old as the route table.
    pub fn endpoint_of_slot(&self, slot: u16) -> Option<&Endpoint> {
        let owner = *self.by_slot.get(usize::from(slot))?;
        self.owners.get(usize::from(owner))
    }

    /// Whether the endpoints speak TLS.
    pub fn is_tls(&self) -> bool {
        self.tls
    }

    /// The endpoint of the node with this Valkey id.
    pub fn endpoint_of_id(&self, id: &[u8]) -> Option<&Endpoint> {
        // Valkey writes ids in lowercase: looked up as they are first, without a copy (the
        // keys are lowercase, so an id with a capital finds none that way).
        self.by_id.get(id).or_else(|| {
            id.iter()
                .any(u8::is_ascii_uppercase)
                .then(|| self.by_id.get(&id.to_ascii_lowercase()))
                .flatten()
        })
    }

    /// The endpoint of the node at this internal address (an IP or a DNS name).
    pub fn endpoint_of_addr(&self, host: &[u8], port: u16) -> Option<&Endpoint> {
        let host = host
            .strip_prefix(b"[")
            .and_then(|h| h.strip_suffix(b"]"))
            .unwrap_or(host);
        let at = if host.iter().any(u8::is_ascii_uppercase) {
            self.by_addr.get(&host.to_ascii_lowercase())
        } else {
            self.by_addr.get(host)
        }?;
        at.iter().find(|(p, _)| *p == port).map(|(_, e)| e)
    }

    /// The external port of the node with this Valkey id.
    pub fn port_of_id(&self, id: &[u8]) -> Option<u16> {
        self.endpoint_of_id(id).map(|e| e.port)
    }

    /// The external port of the node at this internal address.
    pub fn port_of_addr(&self, host: &[u8], port: u16) -> Option<u16> {
        self.endpoint_of_addr(host, port).map(|e| e.port)
    }

    /// Looks a node up by id, then by each of the addresses given.
    pub fn find(
        &self,
        id: Option<&[u8]>,
        addrs: &[(Option<&[u8]>, Option<u16>)],
    ) -> Option<&Endpoint> {
        id.and_then(|i| self.endpoint_of_id(i)).or_else(|| {
            addrs.iter().find_map(|(h, p)| match (h, p) {
                (Some(h), Some(p)) if !h.is_empty() => self.endpoint_of_addr(h, *p),
                _ => None,
            })
        })
    }

    pub fn is_empty(&self) -> bool {
        self.by_addr.is_empty()
    }
}

/// A port as text.
pub(crate) fn port_text(p: u16) -> Vec<u8> {
    itoa::Buffer::new().format(p).as_bytes().to_vec()
}

/// Parses a decimal port.
pub(crate) fn parse_port(b: &[u8]) -> Option<u16> {
    // As `str::parse::<u16>` reads it (an optional `+`, then digits, within a u16), without
    // the UTF-8 check first: a NODES reply has a port on every line.
    let digits = b.strip_prefix(b"+").unwrap_or(b);
    if digits.is_empty() {
        return None;
    }
    digits.iter().try_fold(0u16, |n, &d| {
        let d = d.is_ascii_digit().then(|| u16::from(d - b'0'))?;
        n.checked_mul(10)?.checked_add(d)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Backend;
    use shardgate_crds::NodeRef;

    fn routes() -> Routes {
        (0..4u32)
            .map(|i| {
                let mut r = Route::new(
                    NodeRef::new(i / 2, i % 2),
                    format!("10.0.0.{}:6379", i + 1).parse::<Backend>().unwrap(),
                );
                r.node_id = Some(format!("{i:040}"));
                (30000 + i as u16, Arc::new(r))
            })
            .collect()
    }

    #[test]
    fn one_host_many_ports_or_many_names_one_port() {
        let plain = AddressMap::new("127.0.77.70", &routes());
        let e = plain.endpoint_of_addr(b"10.0.0.3", 6379).unwrap();
        assert_eq!(
            (&*e.host, e.host_is_ip, e.port),
            ("127.0.77.70", true, 30002)
        );
        assert!(!plain.is_tls());

        let names = Hostnames {
            prefix: "vc".into(),
            domain: "example.test".into(),
        };
        let sni = AddressMap::sni(&names, 6380, &routes());
        let e = sni.endpoint_of_id(format!("{:040}", 3).as_bytes()).unwrap();
        assert_eq!(
            (&*e.host, e.host_is_ip, e.port),
            ("vc-1-1.example.test", false, 6380)
        );
        assert!(sni.is_tls());
    }

    proptest::proptest! {
        /// Ports are read as `str::parse::<u16>` reads them, on any bytes.
        #[test]
        fn ports_are_read_as_str_parse_reads_them(b in proptest::collection::vec(proptest::sample::select(b"+-0123456789 a\xff".to_vec()), 0..8)) {
            let want = std::str::from_utf8(&b).ok().and_then(|s| s.parse::<u16>().ok());
            proptest::prop_assert_eq!(parse_port(&b), want);
        }

        #[test]
        fn numbers_around_the_limit(n in 0u32..70_000) {
            proptest::prop_assert_eq!(parse_port(n.to_string().as_bytes()), u16::try_from(n).ok());
        }
    }
}

/// Addresses in replies that no route knows: logged at most once per address per
/// [`EVERY`](Self::EVERY) (a client looping on a stale redirect would flood the log
/// otherwise), and a refresh asked of the route source, when it can refresh.
#[derive(Debug)]
pub struct UnknownAddresses {
    /// Wakes the route source; `None` for a source that does not refresh on request (a
    /// route file), so that the log does not claim a refresh.
    refresh: Option<Arc<Notify>>,
    logged: Throttle<String>,
}

impl UnknownAddresses {
    /// One warning per address per this long.
    pub const EVERY: Duration = Duration::from_secs(60);
    /// Addresses remembered at most; past it the oldest are forgotten (and may be logged
    /// again early), so that a reply naming many bogus addresses cannot grow the map.
    const REMEMBERED: usize = 1024;

    pub fn new(refresh: Option<Arc<Notify>>) -> Self {
        UnknownAddresses {
            refresh,
            logged: Throttle::new(Self::EVERY, Self::REMEMBERED),
        }
    }

    /// Asks the source to look again, if it can (a redirect was mapped by slot, say).
    pub fn refresh(&self) {
        if let Some(r) = &self.refresh {
            r.notify_one();
        }
    }

    /// Logs `unknown` (rate-limited) and asks for a refresh. Returns the addresses logged
    /// now, with the number of times each was met and not logged before.
    pub fn report(&self, unknown: &[String]) -> Vec<(String, u64)> {
        self.refresh();
        self.log_at(unknown, Instant::now())
    }

    fn log_at(&self, unknown: &[String], now: Instant) -> Vec<(String, u64)> {
        let due: Vec<(String, u64)> = unknown
            .iter()
            .filter_map(|addr| Some((addr.clone(), self.logged.due_at(addr, now)?)))
            .collect();
        for (addr, suppressed) in &due {
            if self.refresh.is_some() {
                tracing::warn!(address = %addr, suppressed, "a reply names an address no route knows; forwarded unchanged, refresh requested");
            } else {
                tracing::warn!(address = %addr, suppressed, "a reply names an address no route knows; forwarded unchanged");
            }
        }
        due
    }
}

#[cfg(test)]
mod unknown_tests {
    use super::*;

    #[tokio::test]
    async fn one_line_per_address_per_minute_with_a_count_of_the_rest() {
        let refresh = Arc::new(Notify::new());
        let log = UnknownAddresses::new(Some(refresh.clone()));
        let a = "10.0.0.9:6379".to_string();
        let b = "10.0.0.8:6379".to_string();
        assert_eq!(log.report(std::slice::from_ref(&a)), [(a.clone(), 0)]);
        // A refresh was asked for.
        tokio::time::timeout(Duration::from_millis(1), refresh.notified())
            .await
            .unwrap();
        for _ in 0..5 {
            assert_eq!(log.report(std::slice::from_ref(&a)), []);
        }
        // Another address is its own.
        assert_eq!(log.report(&[a.clone(), b.clone()]), [(b.clone(), 0)]);
        let later = Instant::now() + UnknownAddresses::EVERY;
        assert_eq!(
            log.log_at(std::slice::from_ref(&a), later),
            [(a.clone(), 6)]
        );
        // A route file's proxy asks no refresh, and its log says so.
        let quiet = UnknownAddresses::new(None);
        quiet.refresh();
        assert_eq!(quiet.report(std::slice::from_ref(&b)), [(b.clone(), 0)]);
    }
}
