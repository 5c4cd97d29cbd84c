//! The address map: a node's internal address or Valkey id → its external port on the proxy,
//! and the host external clients dial.

use std::collections::HashMap;
use std::net::IpAddr;

use crate::route::{Host, Routes};

/// Internal → external, built from a route table and the advertised host.
#[derive(Debug, Clone, Default)]
pub struct AddressMap {
    host: String,
    host_is_ip: bool,
    by_id: HashMap<Vec<u8>, u16>,
    by_addr: HashMap<(Vec<u8>, u16), u16>,
}

impl AddressMap {
    /// `advertise`: the host (IP or DNS name) external clients reach the proxy at.
    pub fn new(advertise: &str, routes: &Routes) -> Self {
        let mut map = AddressMap {
            host: advertise.to_string(),
            host_is_ip: advertise.parse::<IpAddr>().is_ok(),
            ..AddressMap::default()
        };
        for (&port, route) in routes {
            if let Some(id) = &route.node_id {
                map.by_id.insert(id.as_bytes().to_ascii_lowercase(), port);
            }
            let host = match &route.backend.host {
                Host::Ip(ip) => ip.to_string(),
                Host::Dns(name) => name.clone(),
            };
            map.by_addr
                .insert((host.into_bytes(), route.backend.port), port);
            if let Some(h) = &route.hostname {
                map.by_addr.insert(
                    (h.as_bytes().to_ascii_lowercase(), route.backend.port),
                    port,
                );
            }
        }
        map
    }

    /// The host external clients dial.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// Whether that host is an IP address (else a DNS name).
    pub fn host_is_ip(&self) -> bool {
        self.host_is_ip
    }

    /// The external port of the node with this Valkey id.
    pub fn port_of_id(&self, id: &[u8]) -> Option<u16> {
        self.by_id.get(&id.to_ascii_lowercase()).copied()
    }

    /// The external port of the node at this internal address (an IP or a DNS name).
    pub fn port_of_addr(&self, host: &[u8], port: u16) -> Option<u16> {
        let host = host
            .strip_prefix(b"[")
            .and_then(|h| h.strip_suffix(b"]"))
            .unwrap_or(host);
        let key = (host.to_ascii_lowercase(), port);
        self.by_addr.get(&key).copied()
    }

    /// Looks a node up by id, then by each of the addresses given.
    pub fn find(&self, id: Option<&[u8]>, addrs: &[(Option<&[u8]>, Option<u16>)]) -> Option<u16> {
        id.and_then(|i| self.port_of_id(i)).or_else(|| {
            addrs.iter().find_map(|(h, p)| match (h, p) {
                (Some(h), Some(p)) if !h.is_empty() => self.port_of_addr(h, *p),
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
