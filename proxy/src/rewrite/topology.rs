//! CLUSTER SLOTS and CLUSTER SHARDS.

use std::borrow::Cow;

use super::addresses::{port_text, AddressMap, Endpoint};
use super::Report;
use crate::resp::frame::Frame;

/// A map in either protocol: RESP3 `%` pairs, or a RESP2 flat `*` array of keys and values.
enum MapRef<'f, 'a> {
    Pairs(&'f mut Vec<(Frame<'a>, Frame<'a>)>),
    Flat(&'f mut Vec<Frame<'a>>),
}

impl<'f, 'a> MapRef<'f, 'a> {
    fn of(f: &'f mut Frame<'a>) -> Option<Self> {
        match f {
            Frame::Map(pairs) => Some(MapRef::Pairs(pairs)),
            Frame::Array(b'*', items) if items.len() % 2 == 0 => Some(MapRef::Flat(items)),
            _ => None,
        }
    }

    fn len(&self) -> usize {
        match self {
            MapRef::Pairs(p) => p.len(),
            MapRef::Flat(f) => f.len() / 2,
        }
    }

    fn key(&self, i: usize) -> Option<&[u8]> {
        match self {
            MapRef::Pairs(p) => p[i].0.as_bytes(),
            MapRef::Flat(f) => f[2 * i].as_bytes(),
        }
    }

    fn value(&self, i: usize) -> &Frame<'a> {
        match self {
            MapRef::Pairs(p) => &p[i].1,
            MapRef::Flat(f) => &f[2 * i + 1],
        }
    }

    fn value_mut(&mut self, i: usize) -> &mut Frame<'a> {
        match self {
            MapRef::Pairs(p) => &mut p[i].1,
            MapRef::Flat(f) => &mut f[2 * i + 1],
        }
    }

    fn index(&self, key: &[u8]) -> Option<usize> {
        (0..self.len()).find(|&i| self.key(i) == Some(key))
    }

    fn get(&self, key: &[u8]) -> Option<&Frame<'a>> {
        self.index(key).map(|i| self.value(i))
    }

    fn remove(&mut self, key: &[u8]) {
        if let Some(i) = self.index(key) {
            match self {
                MapRef::Pairs(p) => {
                    p.remove(i);
                }
                MapRef::Flat(f) => {
                    f.drain(2 * i..2 * i + 2);
                }
            }
        }
    }

    /// Renames `from` to `to` in place (its value and its place kept), if it is there.
    fn rename(&mut self, from: &[u8], to: &'static [u8]) {
        if let Some(i) = self.index(from) {
            let key = Frame::Bulk(Cow::Borrowed(to));
            match self {
                MapRef::Pairs(p) => p[i].0 = key,
                MapRef::Flat(f) => f[2 * i] = key,
            }
        }
    }

    fn set(&mut self, key: &[u8], value: Frame<'a>) {
        if let Some(i) = self.index(key) {
            *self.value_mut(i) = value;
        }
    }

    /// Sets `key`, adding it at the end if it is not there.
    fn upsert(&mut self, key: &'static [u8], value: Frame<'a>) {
        if let Some(i) = self.index(key) {
            *self.value_mut(i) = value;
            return;
        }
        let key = Frame::Bulk(Cow::Borrowed(key));
        match self {
            MapRef::Pairs(p) => p.push((key, value)),
            MapRef::Flat(f) => {
                f.push(key);
                f.push(value);
            }
        }
    }
}

fn bulk(s: &str) -> Frame<'static> {
    Frame::Bulk(Cow::Owned(s.as_bytes().to_vec()))
}

fn int(p: u16) -> Frame<'static> {
    Frame::Int(Cow::Owned(port_text(p)))
}

/// Whether an endpoint value is a special one that keeps its meaning (NULL, `""`, `"?"`).
fn special_endpoint(f: &Frame<'_>) -> bool {
    match f {
        Frame::Null(_) => true,
        other => matches!(other.as_bytes(), Some(b"") | Some(b"?")),
    }
}

/// The `ip` and `hostname` keys of a node description: the advertised host under the key
/// that matches its kind; the other key, which would name an internal address, goes.
fn rewrite_ip_and_hostname(ext: &Endpoint, m: &mut MapRef<'_, '_>) {
    let host = &ext.host;
    let (keep, drop) = if ext.host_is_ip {
        (&b"ip"[..], &b"hostname"[..])
    } else {
        (&b"hostname"[..], &b"ip"[..])
    };
    if m.index(keep).is_some() {
        m.set(keep, bulk(host));
    }
    m.remove(drop);
}

/// Whether `f` has the exact shape of a CLUSTER SLOTS reply: an array of ranges
/// `[start, end, node, ...]`, each node `[endpoint, port, id?, metadata?]` with the endpoint
/// a string or NULL, the port and slots integers, and the metadata a map of strings.
pub fn is_slots(f: &Frame<'_>) -> bool {
    let Frame::Array(b'*', ranges) = f else {
        return false;
    };
    ranges.iter().all(|range| {
        let Frame::Array(b'*', items) = range else {
            return false;
        };
        items.len() >= 3
            && items[0].as_int().is_some()
            && items[1].as_int().is_some()
            && items[2..].iter().all(is_slots_node)
    })
}

fn is_slots_node(node: &Frame<'_>) -> bool {
    let Frame::Array(b'*', fields) = node else {
        return false;
    };
    (2..=4).contains(&fields.len())
        && matches!(fields[0], Frame::Bulk(_) | Frame::Null(_))
        && fields[1].as_int().is_some()
        && fields.get(2).is_none_or(|id| matches!(id, Frame::Bulk(_)))
        && fields
            .get(3)
            .is_none_or(|meta| is_string_map(meta, |_| true))
}

/// Whether `f` is a map (RESP3, or a RESP2 flat array) whose keys are all bulk strings and
/// whose values pass `value`.
fn is_string_map(f: &Frame<'_>, value: impl Fn(&Frame<'_>) -> bool) -> bool {
    match f {
        Frame::Map(pairs) => pairs
            .iter()
            .all(|(k, v)| matches!(k, Frame::Bulk(_)) && value(v)),
        Frame::Array(b'*', items) if items.len() % 2 == 0 => items
            .chunks(2)
            .all(|kv| matches!(kv[0], Frame::Bulk(_)) && value(&kv[1])),
        _ => false,
    }
}

/// Whether `f` has the exact shape of a CLUSTER SHARDS reply: an array of shard maps, each
/// with `slots` and `nodes`, each node a map of scalars with an `id`.
pub fn is_shards(f: &Frame<'_>) -> bool {
    let Frame::Array(b'*', shards) = f else {
        return false;
    };
    let scalar =
        |v: &Frame<'_>| !matches!(v, Frame::Array(..) | Frame::Map(_) | Frame::Attribute(..));
    shards.iter().all(|shard| {
        let slots_ok = matches!(map_get(shard, b"slots"), Some(Frame::Array(b'*', _)));
        let nodes_ok = match map_get(shard, b"nodes") {
            Some(Frame::Array(b'*', nodes)) => nodes.iter().all(|node| {
                is_string_map(node, scalar) && matches!(map_get(node, b"id"), Some(Frame::Bulk(_)))
            }),
            _ => false,
        };
        is_string_map(shard, |_| true) && slots_ok && nodes_ok
    })
}

/// The value of `key` in a map of either protocol.
fn map_get<'f, 'a>(f: &'f Frame<'a>, key: &[u8]) -> Option<&'f Frame<'a>> {
    match f {
        Frame::Map(pairs) => pairs
            .iter()
            .find(|(k, _)| k.as_bytes() == Some(key))
            .map(|(_, v)| v),
        Frame::Array(b'*', items) if items.len() % 2 == 0 => items
            .chunks(2)
            .find(|kv| kv[0].as_bytes() == Some(key))
            .map(|kv| &kv[1]),
        _ => None,
    }
}

/// `CLUSTER SLOTS`: `[[start, end, [endpoint, port, id, metadata], ...], ...]`.
pub fn slots(map: &AddressMap, f: &mut Frame<'_>, report: &mut Report) {
    let Frame::Array(_, ranges) = f else { return };
    for range in ranges {
        let Frame::Array(_, items) = range else {
            continue;
        };
        for node in items.iter_mut().skip(2) {
            let Frame::Array(_, fields) = node else {
                continue;
            };
            if fields.len() < 2 {
                continue;
            }
            let port = fields[1].as_int().and_then(|p| u16::try_from(p).ok());
            let id = fields.get(2).and_then(Frame::as_bytes).map(<[u8]>::to_vec);
            let meta_ip = fields
                .get_mut(3)
                .and_then(MapRef::of)
                .and_then(|m| m.get(b"ip").and_then(Frame::as_bytes).map(<[u8]>::to_vec));
            let endpoint = fields[0].as_bytes().map(<[u8]>::to_vec);
            let Some(ext) = map.find(
                id.as_deref(),
                &[(endpoint.as_deref(), port), (meta_ip.as_deref(), port)],
            ) else {
                report.unknown(describe(id.as_deref(), endpoint.as_deref(), port));
                continue;
            };
            let ext = ext.clone();
            if !special_endpoint(&fields[0]) {
                fields[0] = bulk(&ext.host);
            }
            fields[1] = int(ext.port);
            if let Some(mut meta) = fields.get_mut(3).and_then(MapRef::of) {
                rewrite_ip_and_hostname(&ext, &mut meta);
            }
            report.rewritten += 1;
        }
    }
}

/// `CLUSTER SHARDS`: `[{slots, nodes: [{id, port, ip, endpoint, hostname?, ...}], id}]`.
pub fn shards(map: &AddressMap, f: &mut Frame<'_>, report: &mut Report) {
    let Frame::Array(_, shards) = f else { return };
    for shard in shards {
        let Some(mut shard) = MapRef::of(shard) else {
            continue;
        };
        let Some(i) = shard.index(b"nodes") else {
            continue;
        };
        let Frame::Array(_, nodes) = shard.value_mut(i) else {
            continue;
        };
        for node in nodes {
            let Some(mut m) = MapRef::of(node) else {
                continue;
            };
            let text = |m: &MapRef<'_, '_>, k: &[u8]| {
                m.get(k).and_then(Frame::as_bytes).map(<[u8]>::to_vec)
            };
            let port = m
                .get(b"port")
                .or_else(|| m.get(b"tls-port"))
                .and_then(Frame::as_int)
                .and_then(|p| u16::try_from(p).ok());
            let id = text(&m, b"id");
            let ip = text(&m, b"ip");
            let endpoint = text(&m, b"endpoint");
            let hostname = text(&m, b"hostname");
            let Some(ext) = map.find(
                id.as_deref(),
                &[
                    (ip.as_deref(), port),
                    (endpoint.as_deref(), port),
                    (hostname.as_deref(), port),
                ],
            ) else {
                report.unknown(describe(id.as_deref(), ip.as_deref(), port));
                continue;
            };
            let ext = ext.clone();
            m.set(b"port", int(ext.port));
            if map.is_tls() {
                // The SNI port: a TLS client reads `tls-port`, so it names the same port.
                m.upsert(b"tls-port", int(ext.port));
            } else if m.index(b"port").is_some() {
                // The node's TLS port is internal, and this listener forwards its plain port.
                m.remove(b"tls-port");
            } else {
                // A node that speaks TLS only, reached over TLS by the proxy (or a TLS
                // terminator before it): the client on this listener speaks plain, so it
                // reads `port`, in the place Valkey put `tls-port`.
                m.rename(b"tls-port", b"port");
                m.set(b"port", int(ext.port));
            }
            if let Some(e) = m.index(b"endpoint") {
                if !special_endpoint(m.value(e)) {
                    m.set(b"endpoint", bulk(&ext.host));
                }
            }
            rewrite_ip_and_hostname(&ext, &mut m);
            report.rewritten += 1;
        }
    }
}

fn describe(id: Option<&[u8]>, host: Option<&[u8]>, port: Option<u16>) -> String {
    format!(
        "{}:{} (node {})",
        host.map(String::from_utf8_lossy).unwrap_or_default(),
        port.map_or(String::from("?"), |p| p.to_string()),
        id.map(String::from_utf8_lossy).unwrap_or_default()
    )
}
