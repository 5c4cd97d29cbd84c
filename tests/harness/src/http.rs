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

/// The proxy's labelled metric families and their label names, written out by hand: a
/// family shows in `/metrics` only once it has a child, so this is how a check for 0 knows
/// that a family it cannot see exists.
pub const PROXY_LABELLED_FAMILIES: &[(&str, &[&str])] = &[
    ("shardgate_proxy_connections_accepted", &["port"]),
    ("shardgate_proxy_connections_active", &["port"]),
    ("shardgate_proxy_connections_rejected", &["reason"]),
    ("shardgate_proxy_connections_closed", &["reason"]),
    ("shardgate_proxy_bytes", &["direction", "port"]),
    ("shardgate_proxy_backend_errors", &["kind", "port"]),
    ("shardgate_proxy_route_source_errors", &["source"]),
    ("shardgate_proxy_route_source_up", &["source"]),
    ("shardgate_proxy_route_source_fetches", &["source"]),
    ("shardgate_proxy_discovery_views_refused", &["reason"]),
    ("shardgate_proxy_rewritten_replies", &["kind"]),
    ("shardgate_proxy_rewrite_skipped", &["reason"]),
    ("shardgate_proxy_protocol_errors", &["reason"]),
    ("shardgate_proxy_tls_refused", &["reason"]),
    ("shardgate_proxy_tls_routed", &["target"]),
    ("shardgate_proxy_tls_handshakes", &["version"]),
    ("shardgate_proxy_tls_certificate_reloads", &["reason"]),
];

/// The value of a Prometheus sample, strictly: `sample` as in [`metric`]. A sample that is
/// not in `body` is 0 only when it is a labelled child its family has not created yet (a
/// counter never incremented for these labels): its family is declared (`# TYPE`) and the
/// children it has use the same label names, or, for a family without children (which
/// does not show at all), it is one of [`PROXY_LABELLED_FAMILIES`] with these label names.
/// A family that is unknown (a misnamed or unregistered metric), an unlabelled sample that
/// is missing, or label names the family does not use, are errors, so that a check for 0
/// cannot pass on a typo.
pub fn metric_value(body: &str, sample: &str) -> Result<f64> {
    if let Some(v) = metric(body, sample) {
        return Ok(v);
    }
    let (name, labels) = match sample.split_once('{') {
        Some((name, rest)) => (
            name,
            Some(
                rest.strip_suffix('}')
                    .with_context(|| format!("unterminated labels in {sample:?}"))?,
            ),
        ),
        None => (sample, None),
    };
    let family_of = |family: &str| {
        name.strip_prefix(family).is_some_and(|suffix| {
            [
                "", "_total", "_count", "_sum", "_bucket", "_created", "_info",
            ]
            .contains(&suffix)
        })
    };
    let Some(labels) = labels else {
        anyhow::bail!("{sample:?} has no sample in:\n{body}");
    };
    let want = label_names(labels);
    let declared = body.lines().find_map(|l| {
        let family = l.strip_prefix("# TYPE ")?.split(' ').next()?;
        family_of(family).then_some(family)
    });
    let Some(family) = declared else {
        let Some((family, names)) = PROXY_LABELLED_FAMILIES.iter().find(|(f, _)| family_of(f))
        else {
            let known: Vec<&str> = body
                .lines()
                .filter_map(|l| l.strip_prefix("# TYPE "))
                .collect();
            anyhow::bail!(
                "no metric family declares {name:?}, and it is not a labelled family of the \
                 proxy; the families shown are: {known:?}"
            );
        };
        anyhow::ensure!(
            want.iter().eq(names.iter()),
            "{sample:?} names labels {want:?}, but {family} has {names:?}"
        );
        return Ok(0.0);
    };
    for line in body.lines() {
        let Some(rest) = line.strip_prefix(name).and_then(|r| r.strip_prefix('{')) else {
            continue;
        };
        let have = rest.split_once('}').map(|(l, _)| label_names(l));
        anyhow::ensure!(
            have.as_ref() == Some(&want),
            "{sample:?} names labels {want:?}, but {family} has {line:?}"
        );
    }
    Ok(0.0)
}

/// The labelled samples in `body` whose family [`PROXY_LABELLED_FAMILIES`] lacks or lists
/// with other label names: a check that the hand-written list follows the proxy.
pub fn unlisted_label_sets(body: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in body.lines().filter(|l| !l.starts_with('#')) {
        let Some((name, rest)) = line.split_once('{') else {
            continue;
        };
        let have = label_names(rest.split_once('}').map_or("", |(l, _)| l));
        let listed = PROXY_LABELLED_FAMILIES.iter().any(|(family, names)| {
            name.strip_prefix(family)
                .is_some_and(|suffix| ["", "_total"].contains(&suffix))
                && have.iter().eq(names.iter())
        });
        if !listed {
            out.push(line.to_string());
        }
    }
    out
}

/// The label names of `k="v",k2="v2"`, sorted.
fn label_names(labels: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = labels;
    while let Some((name, after)) = rest.split_once("=\"") {
        names.push(name.trim_start_matches(',').trim().to_string());
        // The value ends at the first quote that is not escaped.
        let mut end = None;
        let mut escaped = false;
        for (i, c) in after.char_indices() {
            match c {
                '\\' if !escaped => escaped = true,
                '"' if !escaped => {
                    end = Some(i);
                    break;
                }
                _ => escaped = false,
            }
        }
        let Some(end) = end else { break };
        rest = &after[end + 1..];
    }
    names.sort();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    const BODY: &str = "\
# HELP shardgate_proxy_rewrite_unknown_addresses Addresses no route knows.
# TYPE shardgate_proxy_rewrite_unknown_addresses counter
shardgate_proxy_rewrite_unknown_addresses_total 0
# TYPE shardgate_proxy_rewritten_replies counter
shardgate_proxy_rewritten_replies_total{kind=\"moved\"} 3
# TYPE shardgate_proxy_protocol_errors counter
# TYPE shardgate_proxy_listeners gauge
shardgate_proxy_listeners 6
# EOF
";

    #[test]
    fn a_sample_present_is_its_value() {
        let v = |s| metric_value(BODY, s).unwrap();
        assert_eq!(v("shardgate_proxy_rewrite_unknown_addresses_total"), 0.0);
        assert_eq!(
            v("shardgate_proxy_rewritten_replies_total{kind=\"moved\"}"),
            3.0
        );
        assert_eq!(v("shardgate_proxy_listeners"), 6.0);
    }

    #[test]
    fn a_child_not_created_yet_is_zero() {
        let v = |s| metric_value(BODY, s).unwrap();
        assert_eq!(
            v("shardgate_proxy_rewritten_replies_total{kind=\"ask\"}"),
            0.0
        );
        assert_eq!(
            v("shardgate_proxy_protocol_errors_total{reason=\"backend\"}"),
            0.0
        );
        // A family without children does not show at all.
        assert_eq!(
            v("shardgate_proxy_bytes_total{port=\"1\",direction=\"to_client\"}"),
            0.0
        );
    }

    #[test]
    fn a_misnamed_or_missing_metric_is_an_error() {
        for bad in [
            // Not a family at all.
            "shardgate_proxy_rewrite_unknown_address_total",
            "shardgate_proxy_rewritten_reply_total{kind=\"ask\"}",
            // A label name its children do not use.
            "shardgate_proxy_rewritten_replies_total{type=\"ask\"}",
            // An unlabelled sample that is not there.
            "shardgate_proxy_protocol_errors_total",
            // A family without children, with label names it does not have.
            "shardgate_proxy_bytes_total{port=\"1\"}",
            "shardgate_proxy_backend_errors_total{kind=\"tls\"}",
        ] {
            assert!(metric_value(BODY, bad).is_err(), "{bad}");
        }
    }
}
