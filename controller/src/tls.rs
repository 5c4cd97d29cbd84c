//! `spec.tls`: nodes that speak only TLS. Where their pods find the Secret, the valkey.conf
//! lines that put them on TLS, and how the operator itself dials them (with the same Secret).

use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use shardgate_admin_client::{Dial, Tls};
use shardgate_crds::valkey_cluster::ValkeyCluster;

use crate::configmap::CLIENT_PORT;
use crate::context::Context;
use crate::error::{Error, Result};
use crate::objects::namespace;

/// The pod volume of the Secret, and where it is mounted.
pub const VOLUME: &str = "tls";
pub const DIR: &str = "/tls";

/// The keys of the Secret (those of a `kubernetes.io/tls` Secret, and its CA).
pub const CA: &str = "ca.crt";
pub const CERT: &str = "tls.crt";
pub const KEY: &str = "tls.key";

/// valkey.conf on TLS: the client port speaks TLS only (`port 0`), and so do the cluster
/// bus and replication. Whether clients must present a certificate (`tls-auth-clients`, yes
/// by default) is the user's, in `spec.config`.
pub fn settings() -> [(&'static str, String); 4] {
    [
        ("port", "0".into()),
        ("tls-port", CLIENT_PORT.to_string()),
        ("tls-cluster", "yes".into()),
        ("tls-replication", "yes".into()),
    ]
}

/// The Secret's files, on the node's command line (as `--dir`: a path in the file would not
/// follow a relocated mount).
pub fn args() -> Vec<String> {
    [
        ("--tls-cert-file", CERT),
        ("--tls-key-file", KEY),
        ("--tls-ca-cert-file", CA),
    ]
    .into_iter()
    .flat_map(|(flag, file)| [flag.to_string(), format!("{DIR}/{file}")])
    .collect()
}

/// How the operator dials the cluster's nodes: plain, or over TLS with the CA and the
/// certificate of `spec.tls`'s Secret (read on every reconcile, so a rotated Secret is
/// used as soon as it is written).
pub async fn dial(vc: &ValkeyCluster, ctx: &Context) -> Result<Dial> {
    let timeouts = ctx.timeouts;
    let Some(spec) = &vc.spec.tls else {
        return Ok(timeouts.into());
    };
    let ns = namespace(vc)?;
    let name = &spec.secret_name;
    let secret = Api::<Secret>::namespaced(ctx.client.clone(), &ns)
        .get_opt(name)
        .await?
        .ok_or_else(|| Error::TlsSecret {
            secret: name.clone(),
            why: format!("not found in namespace {ns}"),
        })?;
    let tls = from_secret(&secret).map_err(|why| Error::TlsSecret {
        secret: name.clone(),
        why,
    })?;
    Ok(Dial {
        timeouts,
        tls: Some(tls),
    })
}

/// The TLS settings of a Secret: its CA, and its certificate and key as the client's.
fn from_secret(secret: &Secret) -> Result<Tls, String> {
    let data = secret.data.as_ref();
    let key = |k: &str| {
        data.and_then(|d| d.get(k))
            .map(|v| v.0.as_slice())
            .filter(|v| !v.is_empty())
            .ok_or_else(|| format!("has no {k} (it needs {CA}, {CERT} and {KEY})"))
    };
    Tls::from_pem(key(CA)?, Some((key(CERT)?, key(KEY)?))).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;

    /// A Secret without one of its keys, or with one that is not PEM, is refused with the
    /// key's name; a whole one makes TLS settings.
    #[test]
    fn a_secret_makes_tls_settings_or_says_what_it_lacks() {
        let pki = shardgate_harness::tls::TestPki::new("vc.test").unwrap();
        let node = pki.node_cert("node", &["vc.test".into()]).unwrap();
        let secret = |entries: &[(&str, &str)]| Secret {
            data: Some(
                entries
                    .iter()
                    .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
                    .collect(),
            ),
            ..Secret::default()
        };
        let whole = [
            (CA, pki.ca_pem.as_str()),
            (CERT, node.cert_pem.as_str()),
            (KEY, node.key_pem.as_str()),
        ];
        assert!(from_secret(&secret(&whole)).is_ok());
        let why = from_secret(&secret(&whole[1..])).unwrap_err();
        assert!(why.starts_with("has no ca.crt"), "{why}");
        let why = from_secret(&secret(&[whole[0], whole[1], (KEY, "")])).unwrap_err();
        assert!(why.starts_with("has no tls.key"), "{why}");
        let why = from_secret(&secret(&[whole[0], (CERT, "junk"), whole[2]])).unwrap_err();
        assert!(why.starts_with("certificate: "), "{why}");
        assert!(from_secret(&Secret::default()).is_err());
    }
}
