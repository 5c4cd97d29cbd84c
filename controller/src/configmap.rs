//! The ConfigMap with `valkey.conf`, and the hash of its text that the pods carry, so that a
//! config change rolls them.

use std::collections::BTreeMap;
use std::fmt::Write;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use kube::ResourceExt;
use serde_json::json;
use sha2::{Digest, Sha256};
use shardgate_crds::names::objects;
use shardgate_crds::validation::RESERVED_CONFIG_KEYS;
use shardgate_crds::valkey_cluster::ValkeyCluster;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::objects::{apply, build, cluster_labels, namespace, owner};

/// The client port every node listens on, inside its pod (the proxy's route source dials
/// the same one).
pub use shardgate_crds::ports::CLIENT_PORT;
/// The cluster bus port: the client port + 10000, as Valkey derives it.
pub const BUS_PORT: u16 = CLIENT_PORT + 10000;

/// What every node runs with, before the user's `spec.config`.
const BASE: &[(&str, &str)] = &[
    ("cluster-enabled", "yes"),
    ("cluster-config-file", "nodes.conf"),
    ("cluster-node-timeout", "5000"),
    ("appendonly", "yes"),
    ("protected-mode", "no"),
];

/// The text of `valkey.conf`: the port (with `spec.tls`, the TLS settings), then the base
/// settings and `spec.config` (sorted, so the text and its hash are stable); a user setting
/// replaces a base one of the same name.
pub fn render(vc: &ValkeyCluster) -> Result<String> {
    let mut settings: BTreeMap<String, String> = BASE
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    for (key, value) in &vc.spec.config {
        // Valkey reads names in any case; the API server's check matches them as written.
        let k = key.to_ascii_lowercase();
        if RESERVED_CONFIG_KEYS.contains(&k.as_str()) {
            return Err(Error::Invalid(format!(
                "spec.config.{key}: set by the operator (it must match the pods and the cluster)"
            )));
        }
        if key.is_empty() || key.contains(char::is_whitespace) || value.contains(['\n', '\r']) {
            return Err(Error::Invalid(format!(
                "spec.config.{key}: a key is one word and a value one line"
            )));
        }
        settings.insert(k, value.clone());
    }
    // Announce mode: what Valkey hands out, in the config (so that a change rolls the pods).
    if let Some(ea) = crate::external::announce_mode(vc) {
        settings.insert(
            "cluster-preferred-endpoint-type".into(),
            ea.preferred_endpoint_type.as_str().into(),
        );
    }
    // TLS: the client port speaks TLS only, and so do the bus and replication.
    let mut text = String::new();
    if vc.spec.tls.is_some() {
        for (k, v) in crate::tls::settings() {
            let _ = writeln!(text, "{k} {v}");
        }
    } else {
        let _ = writeln!(text, "port {CLIENT_PORT}");
    }
    for (k, v) in &settings {
        let _ = writeln!(text, "{k} {v}");
    }
    Ok(text)
}

/// A short, stable hash of the config text.
pub fn hash(text: &str) -> String {
    let digest = Sha256::digest(text.as_bytes());
    digest[..8].iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// Applies the ConfigMap; returns the config's hash.
pub async fn apply_config(vc: &ValkeyCluster, ctx: &Context) -> Result<String> {
    let text = render(vc)?;
    let cm: ConfigMap = build(
        "ConfigMap",
        json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": objects::config_map(&vc.name_any()),
                "labels": cluster_labels(vc),
                "ownerReferences": [owner(vc)?],
            },
            "data": { "valkey.conf": text },
        }),
    )?;
    apply(&Api::namespaced(ctx.client.clone(), &namespace(vc)?), &cm).await?;
    Ok(hash(&text))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The user's settings follow the base ones, their names lowercased as Valkey reads
    /// them; a name the operator writes is refused in any case (the API server's check sees
    /// only the exact one), and so is a value of more than one line.
    #[test]
    fn config_renders_the_user_settings_and_refuses_the_operators_own() {
        let text = render(&ValkeyCluster::test("vc").config("MaxMemory", "1gb")).unwrap();
        assert!(text.starts_with("port 6379\n"), "{text}");
        assert!(text.contains("\nmaxmemory 1gb\n"), "{text}");
        assert!(text.contains("\nappendonly yes\n"), "{text}");
        // On TLS: the client port, the bus and replication (the Secret's files are on the
        // command line); what the user says of client certificates stays.
        let tls = ValkeyCluster::test("vc")
            .tls("vc-tls")
            .config("tls-auth-clients", "optional");
        let text = render(&tls).unwrap();
        assert!(
            text.starts_with("port 0\ntls-port 6379\ntls-cluster yes\ntls-replication yes\n"),
            "{text}"
        );
        assert!(text.contains("\ntls-auth-clients optional\n"), "{text}");
        assert_eq!(text.matches("port ").count(), 2, "{text}");
        for key in ["tls-cluster", "TLS-Port"] {
            let vc = ValkeyCluster::test("vc").tls("vc-tls").config(key, "no");
            assert!(
                matches!(render(&vc), Err(Error::Invalid(_))),
                "{key} accepted"
            );
        }
        for (key, value) in [
            ("PORT", "7000"),
            ("Bind", "0.0.0.0"),
            ("maxmemory", "1gb\nport 7000"),
        ] {
            let vc = ValkeyCluster::test("vc").config(key, value);
            assert!(
                matches!(render(&vc), Err(Error::Invalid(_))),
                "{key}: {value:?} accepted"
            );
        }
    }
}
