//! The address map: a node's internal address or Valkey id → the [`Endpoint`] (host and
//! port) external clients reach it at through the proxy.
//!
//! One map per kind of listener, built from the same route table:
//! - the per-port listeners ([`AddressMap::new`]): every node at the one advertised host,
//!   each on its own listener port;
//! - the TLS port ([`AddressMap::sni`]): every node at its own SNI name
//!   (`<prefix>-<s>-<n>.<domain>`), all on the one TLS port.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use shardgate_crds::{node_hostname, Hostnames};

use crate::model::{Host, Route, Routes};

/// Hash slots in a cluster.
const SLOTS: usize = 16384;

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

/// Internal → external, built from a route table.
#[derive(Debug, Clone, Default)]
pub struct AddressMap {
    /// Lowercase node id → endpoint.
    by_id: HashMap<Vec<u8>, Endpoint>,
    /// Lowercase host → (port, endpoint) of the nodes there (one, or a few on one host).
    by_addr: HashMap<Vec<u8>, Vec<(u16, Endpoint)>>,
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
        // Valkey writes ids in lowercase: look up without a copy then.
        if id.iter().any(u8::is_ascii_uppercase) {
            self.by_id.get(&id.to_ascii_lowercase())
        } else {
            self.by_id.get(id)
        }
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
    std::str::from_utf8(b).ok()?.parse().ok()
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
}
