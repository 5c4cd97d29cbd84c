//! `spec.tls`: nodes that speak only TLS. Where their pods find the Secret, the valkey.conf
//! lines that put them on TLS, how the operator itself dials them (with the same Secret),
//! and the reload of a Secret renewed in place ([`reload`]).

use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, ListParams};
use kube::ResourceExt;
use shardgate_admin_client::{Client, Dial, Reply, Tls};
use shardgate_crds::names::labels;
use shardgate_crds::valkey_cluster::ValkeyCluster;
use shardgate_crds::NodeRef;

use crate::configmap::CLIENT_PORT;
use crate::context::Context;
use crate::error::{Error, Result};
use crate::objects::{cluster_selector, namespace};
use crate::pods::Pods;

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

/// The settings of the Secret's files, and the files.
const FILES: [(&str, &str); 3] = [
    ("tls-cert-file", CERT),
    ("tls-key-file", KEY),
    ("tls-ca-cert-file", CA),
];

/// Where the pod finds one of the Secret's files (`CA`, `CERT`, `KEY`).
pub fn path(file: &str) -> String {
    format!("{DIR}/{file}")
}

/// The Secret's files, on the node's command line (as `--dir`: a path in the file would not
/// follow a relocated mount).
pub fn args() -> Vec<String> {
    FILES
        .into_iter()
        .flat_map(|(key, file)| [format!("--{key}"), path(file)])
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

/// Whether `vc` (with `spec.tls`) has node pods without the Secret: pods made by an
/// operator version that accepted `spec.tls` without acting on it, on plain RESP.
pub async fn nodes_on_plain(vc: &ValkeyCluster, ctx: &Context) -> Result<bool> {
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), &namespace(vc)?)
        .list(&ListParams::default().labels(&cluster_selector(vc)))
        .await?;
    Ok(on_plain(
        &pods.items,
        vc.metadata.creation_timestamp.as_ref(),
    ))
}

/// Whether any node pod of `pods` (one with a shard index) lacks the Secret's volume.
/// Only pods of this cluster count: not one being deleted, nor one made before the cluster
/// was (a deleted cluster of the same name whose pods are still going).
fn on_plain(pods: &[Pod], cluster_made: Option<&Time>) -> bool {
    let has_secret = |p: &Pod| {
        p.spec.as_ref().is_some_and(|s| {
            s.volumes
                .iter()
                .flatten()
                .any(|v| v.name == VOLUME && v.secret.is_some())
        })
    };
    let ours = |p: &&Pod| {
        p.metadata.deletion_timestamp.is_none()
            && match (cluster_made, p.metadata.creation_timestamp.as_ref()) {
                (Some(made), Some(pod)) => pod.0 >= made.0,
                _ => true,
            }
    };
    pods.iter()
        .filter(|p| p.labels().contains_key(labels::SHARD_INDEX))
        .filter(ours)
        .any(|p| !has_secret(p))
}

/// Makes nodes that present another certificate than the Secret's read their files again
/// (`CONFIG SET` of the paths it has: Valkey reloads its TLS settings even when they are
/// the same), so that a Secret renewed in place (cert-manager) reaches running nodes without
/// a restart. The operator presents the Secret's certificate too (`dial`), so that is the
/// one each node should present. A node whose files are not the new ones yet (the kubelet
/// syncs a Secret within a minute or so) keeps presenting the old certificate and is tried
/// again on the next look. Returns what changed; a node that does not answer is left to
/// formation.
///
/// Pods about to be replaced (`stale`: a new Secret's roll) are left to the roll, and nodes
/// this look already saw present the Secret's certificate (`current`: formation's
/// connections, [`crate::formation::NodeState::current_certificate`]) are not dialled again:
/// once every node is current, a look costs no connection of its own.
pub async fn reload(
    pods: &Pods,
    stale: &[NodeRef],
    current: impl Fn(NodeRef) -> bool,
    dial: &Dial,
    secret: &str,
) -> Reload {
    let mut reload = Reload::default();
    let Some(want) = dial.tls.as_ref().and_then(Tls::certificate) else {
        return reload;
    };
    let due = |n: &NodeRef| !stale.contains(n) && !current(*n);
    for (node, pod) in pods.nodes.iter().filter(|(n, _)| due(n)) {
        let Some(addr) = pod.addr.filter(|_| pod.ready && !pod.deleting) else {
            reload.unchecked.push(*node);
            continue;
        };
        let presents = |c: &Client| c.peer_certificate() == Some(want);
        let result = async {
            let mut c = Client::dial(addr, dial).await?;
            if presents(&c) {
                return Ok(None);
            }
            // The paths the node has, set again: the same paths, read afresh.
            let mut get = vec!["CONFIG", "GET"];
            get.extend(FILES.map(|(key, _)| key));
            let reply = c.command(&get).await?;
            let pairs: Vec<&[u8]> = match &reply {
                Reply::Array(items) => items
                    .iter()
                    .filter_map(|r| match r {
                        Reply::BulkString(b) => Some(b.as_ref()),
                        _ => None,
                    })
                    .collect(),
                _ => Vec::new(),
            };
            if pairs.len() != 2 * FILES.len() {
                return Err(shardgate_admin_client::Error::Shape {
                    addr: Some(addr),
                    message: format!("CONFIG GET of the TLS files: {reply:?}"),
                });
            }
            let set: Vec<&[u8]> = [b"CONFIG".as_slice(), b"SET"]
                .into_iter()
                .chain(pairs)
                .collect();
            c.command(&set).await?;
            // The new settings are for new connections.
            let now = Client::dial(addr, dial).await?;
            Ok::<_, shardgate_admin_client::Error>(Some(presents(&now)))
        };
        match result.await {
            Ok(Some(true)) => reload.changed.push(format!(
                "node {node} reloaded its certificate from Secret {secret}"
            )),
            Ok(Some(false)) => reload.behind.push(*node),
            Ok(None) => {}
            Err(e) => {
                tracing::debug!(%node, "certificate reload: {e}");
                reload.unchecked.push(*node);
            }
        }
    }
    reload
}

/// What [`reload`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Reload {
    /// A line per node that now presents the Secret's certificate.
    pub changed: Vec<String>,
    /// Nodes told to read their files that still present another certificate: their files
    /// are not the Secret's yet, or Valkey refused them (its log says why).
    pub behind: Vec<NodeRef>,
    /// Nodes not reached this look (no ready pod, no answer): behind or not, unknown.
    pub unchecked: Vec<NodeRef>,
}

/// Looks in a row with nodes [`Reload::behind`] before a Warning says so: five minutes at a
/// formed cluster's pace, past the minute or two the kubelet takes to write a Secret.
pub const BEHIND_LOOKS: u32 = 10;

/// `vc` as it runs when its nodes are on plain RESP ([`nodes_on_plain`]): without `tls`,
/// nor what only nodes on TLS use (the proxy's client certificate for them).
pub fn as_plain(vc: &ValkeyCluster) -> ValkeyCluster {
    let mut plain = vc.clone();
    plain.spec.tls = None;
    if let Some(proxy) = plain
        .spec
        .external_access
        .as_mut()
        .and_then(|ea| ea.proxy.as_mut())
    {
        proxy.client_secret_name = None;
    }
    plain
}

/// What keeps the proxy from using `proxy.clientSecretName`'s Secret `name`, if anything:
/// without it the kubelet starts no proxy pod, and a proxy that cannot load it does not
/// start. Read by name, as `spec.tls`'s is, and said in status rather than left to the
/// pods' events. Where the nodes check client certificates (`tls-auth-clients` is not
/// `no`), its certificate must be one of the cluster's CA for client use: otherwise every
/// handshake with a node fails, and only the proxy's log would say why.
pub async fn client_secret_problem(
    ctx: &Context,
    vc: &ValkeyCluster,
    ns: &str,
    name: &str,
) -> Result<Option<String>> {
    let secrets = Api::<Secret>::namespaced(ctx.client.clone(), ns);
    let why = match secrets.get_opt(name).await? {
        None => Some(format!("not found in namespace {ns}")),
        Some(secret) => match (identity_problem(&secret), &vc.spec.tls) {
            (Some(why), _) => Some(why),
            (None, Some(tls)) if clients_checked(vc) => {
                // The cluster's Secret missing or broken is said already (the operator
                // cannot dial the nodes).
                let cluster = secrets.get_opt(&tls.secret_name).await?;
                let ca = cluster.as_ref().and_then(|s| secret_key(s, CA, CA).ok());
                ca.and_then(|ca| chain_problem(&secret, ca, &tls.secret_name))
            }
            (None, _) => None,
        },
    };
    Ok(why.map(|why| format!("externalAccess.proxy.clientSecretName: Secret {name} {why}")))
}

/// Whether the nodes check the certificate a client shows: `tls-auth-clients` is `yes`
/// (Valkey's default) or `optional` (a certificate shown must pass). Read as the nodes read
/// `config` (`configmap::render`): the name in any case, the last such key in map order,
/// the value unquoted.
fn clients_checked(vc: &ValkeyCluster) -> bool {
    let value = vc
        .spec
        .config
        .iter()
        .rev()
        .find(|(k, _)| k.eq_ignore_ascii_case("tls-auth-clients"))
        .map(|(_, v)| v.trim());
    let unquoted = value.map(|v| {
        ['"', '\'']
            .iter()
            .find_map(|q| v.strip_prefix(*q).and_then(|v| v.strip_suffix(*q)))
            .unwrap_or(v)
    });
    !unquoted.is_some_and(|v| v.eq_ignore_ascii_case("no"))
}

/// How far ahead a certificate that is not valid yet is looked at again: a renewed one
/// starts "now" by the issuer's clock, which may be ahead of this one's.
const CLOCK_SKEW: std::time::Duration = std::time::Duration::from_secs(300);

/// Why `secret`'s certificate would not pass the nodes' check of a client (signed by the
/// CA `ca`, of the Secret `ca_secret`; in force; for client use), if it would not. The
/// check is rustls's for client certificates. Only what the nodes' OpenSSL refuses too is
/// said (another CA, a bad signature, out of its dates, not for client use): rustls is
/// stricter in other ways (v1 certificates, unknown critical extensions, some signature
/// algorithms), and saying so would hold back a working cluster's status. Those are
/// logged at debug.
fn chain_problem(secret: &Secret, ca: &[u8], ca_secret: &str) -> Option<String> {
    use rustls::pki_types::UnixTime;
    use rustls::CertificateError as E;
    use shardgate_admin_client::pem::certificates;

    let verify = |at: UnixTime| -> std::result::Result<(), rustls::Error> {
        let other = |e: String| rustls::Error::General(e);
        let mut roots = rustls::RootCertStore::empty();
        for c in certificates(ca).map_err(|e| other(format!("{CA}: {e}")))? {
            roots.add(c)?;
        }
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                .build()
                .map_err(|e| other(e.to_string()))?;
        let cert = secret_key(secret, CERT, CERT).map_err(other)?;
        let chain = certificates(cert).map_err(|e| other(e.to_string()))?;
        let Some((leaf, intermediates)) = chain.split_first() else {
            return Err(other("no certificate".into()));
        };
        verifier
            .verify_client_cert(leaf, intermediates, at)
            .map(|_| ())
    };
    let now = UnixTime::now();
    let refused = match verify(now) {
        Ok(()) => return None,
        Err(rustls::Error::InvalidCertificate(E::NotValidYet | E::NotValidYetContext { .. })) => {
            let later = std::time::Duration::from_secs(now.as_secs()) + CLOCK_SKEW;
            verify(UnixTime::since_unix_epoch(later)).err()?
        }
        Err(e) => e,
    };
    match &refused {
        rustls::Error::InvalidCertificate(
            E::UnknownIssuer
            | E::BadSignature
            | E::Expired
            | E::ExpiredContext { .. }
            | E::NotValidYet
            | E::NotValidYetContext { .. }
            | E::InvalidPurpose
            | E::InvalidPurposeContext { .. },
        ) => Some(format!(
            "has a {CERT} the nodes would refuse: not a client certificate of Secret \
             {ca_secret}'s {CA} ({refused})"
        )),
        _ => {
            tracing::debug!(
                ca_secret,
                "the proxy's client certificate: not checked against the CA ({refused})"
            );
            None
        }
    }
}

/// Why a Secret's `tls.crt` and `tls.key` are not a certificate and its key, if they are
/// not. They are taken as the proxy takes them at start (rustls's `CertifiedKey`), which
/// refuses a key that is not the certificate's: the proxy would not start, and only its
/// log would say why.
fn identity_problem(secret: &Secret) -> Option<String> {
    use rustls::{Error as E, InconsistentKeys};
    let get = |k| secret_key(secret, k, &format!("{CERT} and {KEY}"));
    let checked = get(CERT).and_then(|cert| {
        let chain =
            shardgate_admin_client::pem::certificates(cert).map_err(|e| format!("{CERT}: {e}"))?;
        let key = get(KEY)?;
        let key =
            shardgate_admin_client::pem::private_key(key).map_err(|e| format!("{KEY}: {e}"))?;
        let provider = rustls::crypto::ring::default_provider();
        match rustls::sign::CertifiedKey::from_der(chain, key, &provider) {
            Ok(_) => Ok(()),
            Err(E::InconsistentKeys(InconsistentKeys::KeyMismatch)) => Err(format!(
                "has a {KEY} that is not the key of {CERT}'s (first) certificate"
            )),
            // A certificate webpki cannot parse; a key ring cannot load (a curve or size
            // it does not take).
            Err(E::InvalidCertificate(e)) => Err(format!(
                "has a {CERT} the proxy cannot use: its first certificate does not parse ({e:?})"
            )),
            Err(E::General(why)) => Err(format!("has a {KEY} the proxy cannot use: {why}")),
            Err(e) => Err(format!("has a {CERT} and {KEY} the proxy cannot use ({e})")),
        }
    });
    checked.err()
}

/// The TLS settings of a Secret: its CA, and its certificate and key as the client's.
fn from_secret(secret: &Secret) -> Result<Tls, String> {
    let get = |k| secret_key(secret, k, &format!("{CA}, {CERT} and {KEY}"));
    Tls::from_pem(get(CA)?, Some((get(CERT)?, get(KEY)?))).map_err(|e| e.to_string())
}

/// A Secret's non-empty value of `key`, else why not (the Secret needs the keys `needs`).
fn secret_key<'a>(secret: &'a Secret, key: &str, needs: &str) -> Result<&'a [u8], String> {
    secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(|v| v.0.as_slice())
        .filter(|v| !v.is_empty())
        .ok_or_else(|| format!("has no {key} (it needs {needs})"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;

    /// A cluster kept on plain RESP is valid without `tls`: what needs it goes too.
    #[test]
    fn a_cluster_on_plain_drops_what_needs_tls() {
        let mut ea = shardgate_crds::external_access::ExternalAccess::proxy(31000);
        if let Some(p) = ea.proxy.as_mut() {
            p.client_secret_name = Some("vc-proxy-client".into());
        }
        let vc = ValkeyCluster::test("vc").tls("vc-tls").external(ea);
        assert_eq!(vc.spec.validate(), Ok(()));
        let plain = as_plain(&vc);
        assert_eq!(plain.spec.tls, None);
        assert_eq!(plain.spec.validate(), Ok(()));
    }

    /// The proxy's own certificate Secret: both keys, each PEM of its kind.
    #[test]
    fn a_client_secret_needs_a_certificate_and_its_key() {
        let pki = shardgate_harness::tls::TestPki::new("vc.test").unwrap();
        let app = pki.client_cert("app", "app").unwrap();
        let secret = |pairs: &[(&str, &str)]| {
            let data = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
                .collect();
            Secret {
                data: Some(data),
                ..Secret::default()
            }
        };
        let good = secret(&[(CERT, &app.cert_pem), (KEY, &app.key_pem)]);
        assert_eq!(identity_problem(&good), None);
        assert_eq!(
            identity_problem(&secret(&[(CERT, &app.cert_pem)])),
            Some("has no tls.key (it needs tls.crt and tls.key)".into())
        );
        assert_eq!(
            identity_problem(&Secret::default()),
            Some("has no tls.crt (it needs tls.crt and tls.key)".into())
        );
        let swapped = secret(&[(CERT, &app.key_pem), (KEY, &app.cert_pem)]);
        let why = identity_problem(&swapped).unwrap();
        assert!(why.starts_with("tls.crt: no CERTIFICATE block"), "{why}");
        let no_key = secret(&[(CERT, &app.cert_pem), (KEY, &app.cert_pem)]);
        let why = identity_problem(&no_key).unwrap();
        assert!(why.starts_with("tls.key: no PRIVATE KEY block"), "{why}");
        // Another certificate's key: rustls, and so the proxy, refuses the pair.
        let other = pki.client_cert("other", "other").unwrap();
        let mismatched = secret(&[(CERT, &app.cert_pem), (KEY, &other.key_pem)]);
        assert_eq!(
            identity_problem(&mismatched),
            Some("has a tls.key that is not the key of tls.crt's (first) certificate".into())
        );
        // The chain's first certificate is the one the key must match; a CA after it is
        // carried along.
        let chain = format!("{}{}", app.cert_pem, pki.ca_pem);
        assert_eq!(
            identity_problem(&secret(&[(CERT, &chain), (KEY, &app.key_pem)])),
            None
        );
        let reversed = format!("{}{}", pki.ca_pem, app.cert_pem);
        let why = identity_problem(&secret(&[(CERT, &reversed), (KEY, &app.key_pem)]));
        assert!(why.is_some_and(|w| w.contains("not the key")));
        // PEM blocks of the right kinds whose DER is not a certificate, not a key.
        let junk = |kind: &str| format!("-----BEGIN {kind}-----\nMAMCAQE=\n-----END {kind}-----\n");
        let why = identity_problem(&secret(&[
            (CERT, &app.cert_pem),
            (KEY, &junk("PRIVATE KEY")),
        ]));
        assert!(
            why.as_deref()
                .is_some_and(|w| w.starts_with("has a tls.key the proxy cannot use: ")),
            "{why:?}"
        );
        let why = identity_problem(&secret(&[
            (CERT, &junk("CERTIFICATE")),
            (KEY, &app.key_pem),
        ]));
        assert!(
            why.as_deref().is_some_and(|w| w.starts_with(
                "has a tls.crt the proxy cannot use: its first certificate does not parse"
            )),
            "{why:?}"
        );
    }

    /// The proxy's certificate passes the nodes' check only when the cluster's CA signed it,
    /// for client use, and it is in force; unless the nodes do not check.
    #[test]
    fn a_client_certificate_must_be_the_clusters_for_client_use() {
        use shardgate_harness::tls::{CertPair, TestPki};
        let pki = TestPki::new("vc.test").unwrap();
        let other = TestPki::new("other.test").unwrap();
        let secret = |pair: &CertPair| Secret {
            data: Some(
                [(CERT, &pair.cert_pem), (KEY, &pair.key_pem)]
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
                    .collect(),
            ),
            ..Secret::default()
        };
        let ca = pki.ca_pem.as_bytes();
        let problem = |pair: CertPair| chain_problem(&secret(&pair), ca, "vc-tls");
        assert_eq!(problem(pki.client_cert("app", "app").unwrap()), None);
        assert_eq!(
            problem(pki.node_cert("node", &["vc.test".into()]).unwrap()),
            None
        );
        // No extended key usage at all: any use, for the nodes too.
        let any_use = pki.client_cert_with("any", "app", false, None).unwrap();
        assert_eq!(problem(any_use), None);
        let refused = [
            (other.client_cert("app", "app").unwrap(), "UnknownIssuer"),
            (
                pki.server_cert("server", &["vc.test".into()], false)
                    .unwrap(),
                "does not allow extended key usage for client authentication",
            ),
            (
                pki.client_cert_with("old", "app", true, Some((2000, 2000)))
                    .unwrap(),
                "certificate expired",
            ),
            (
                pki.client_cert_with("early", "app", true, Some((2100, 2101)))
                    .unwrap(),
                "not valid yet",
            ),
        ];
        for (pair, why) in refused {
            let got = problem(pair).unwrap_or_default();
            assert!(
                got.starts_with(
                    "has a tls.crt the nodes would refuse: not a client certificate of \
                     Secret vc-tls's ca.crt ("
                ) && got.contains(why),
                "{why}: {got}"
            );
        }
        // Signed by an intermediate CA: passes when tls.crt carries the intermediate after
        // the leaf (as cert-manager writes it), not with the leaf alone.
        let intermediate = pki.intermediate("issuing").unwrap();
        let leaf = intermediate.client_cert("app", "app").unwrap();
        let with_chain = CertPair {
            cert_pem: format!("{}{}", leaf.cert_pem, intermediate.ca_pem),
            ..leaf.clone()
        };
        assert_eq!(problem(with_chain), None);
        let alone = problem(leaf).unwrap_or_default();
        assert!(alone.contains("UnknownIssuer"), "{alone}");
        let unchecked = ValkeyCluster::test("vc")
            .tls("vc-tls")
            .config("TLS-Auth-Clients", "no");
        assert!(!clients_checked(&unchecked));
        let optional = ValkeyCluster::test("vc")
            .tls("vc-tls")
            .config("tls-auth-clients", "optional");
        assert!(clients_checked(&optional));
        let quoted = ValkeyCluster::test("vc")
            .tls("vc-tls")
            .config("tls-auth-clients", " 'No' ");
        assert!(!clients_checked(&quoted));
        assert!(clients_checked(&ValkeyCluster::test("vc").tls("vc-tls")));
    }

    /// Node pods without the Secret's volume are on plain RESP; the proxy's pods (no shard
    /// index), pods being deleted and pods older than the cluster do not count.
    #[test]
    fn pods_without_the_secret_are_on_plain() {
        let made = |t: &str| Time(t.parse().unwrap());
        let pod_at = |shard: Option<&str>, secret: bool, created: &str, deleting: bool| -> Pod {
            let mut labels = serde_json::Map::new();
            if let Some(s) = shard {
                labels.insert(labels::SHARD_INDEX.into(), s.into());
            }
            let volumes = if secret {
                serde_json::json!([{ "name": VOLUME, "secret": { "secretName": "s" } }])
            } else {
                serde_json::json!([{ "name": "data", "emptyDir": {} }])
            };
            let mut metadata = serde_json::json!({
                "name": "p", "labels": labels, "creationTimestamp": created,
            });
            if deleting {
                metadata["deletionTimestamp"] = created.into();
            }
            serde_json::from_value(serde_json::json!({
                "metadata": metadata,
                "spec": { "containers": [], "volumes": volumes },
            }))
            .unwrap()
        };
        let pod = |shard, secret| pod_at(shard, secret, "2026-12-02T10:00:00Z", false);
        let cluster = made("2026-12-02T09:00:00Z");
        let on = |pods: &[Pod]| on_plain(pods, Some(&cluster));
        assert!(!on(&[]));
        assert!(!on(&[pod(Some("0"), true), pod(Some("1"), true)]));
        assert!(!on(&[pod(Some("0"), true), pod(None, false)]));
        assert!(on(&[pod(Some("0"), true), pod(Some("1"), false)]));
        assert!(on_plain(&[pod(Some("1"), false)], None));
        // A plain pod going away, or one of a cluster of the same name deleted before.
        let going = pod_at(Some("1"), false, "2026-12-02T10:00:00Z", true);
        assert!(!on(&[pod(Some("0"), true), going]));
        let older = pod_at(Some("1"), false, "2026-12-02T08:59:59Z", false);
        assert!(!on(&[pod(Some("0"), true), older]));
    }

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

    /// Against a real node on TLS: while its files hold another certificate than the
    /// Secret's, a reload changes nothing (and says nothing); once its files are the
    /// Secret's (as the kubelet writes a renewed Secret), a reload makes it present the new
    /// certificate to new clients, without a restart; then there is nothing more to do.
    #[tokio::test]
    async fn a_node_reloads_its_files_once_they_are_the_secrets() {
        use crate::pods::NodePod;
        use shardgate_crds::NodeRef;
        use shardgate_harness::valkey::Standalone;

        let pki = shardgate_harness::tls::TestPki::new("vc.test").unwrap();
        let old = pki.node_cert("old", &["vc.test".into()]).unwrap();
        let renewed = pki.node_cert("renewed", &["vc.test".into()]).unwrap();
        let server = tokio::task::spawn_blocking({
            let (cert, key, ca) = (old.cert.clone(), old.key.clone(), pki.ca.clone());
            move || Standalone::start_tls(&cert, &key, &ca)
        })
        .await
        .unwrap()
        .expect("a TLS valkey-server (run scripts/setup)");
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], server.port));
        let node = NodeRef::new(0, 0);
        let mut pods = Pods::default();
        pods.nodes.insert(
            node,
            NodePod {
                name: "vc-0-0-0".into(),
                addr: Some(addr),
                ready: true,
                ..NodePod::default()
            },
        );
        // The operator, with the renewed Secret.
        let identity = (renewed.cert_pem.as_bytes(), renewed.key_pem.as_bytes());
        let dial = Dial {
            tls: Some(Tls::from_pem(pki.ca_pem.as_bytes(), Some(identity)).unwrap()),
            ..Dial::default()
        };
        let presented = || async {
            let c = Client::dial(addr, &dial).await.unwrap();
            c.peer_certificate().map(<[u8]>::to_vec)
        };
        let der = |pair: &shardgate_harness::tls::CertPair| Some(pair.cert_der().unwrap().to_vec());

        let nothing = Reload::default();
        let behind = Reload {
            behind: vec![node],
            ..Reload::default()
        };
        let no = |_| false;
        assert_eq!(reload(&pods, &[], no, &dial, "vc-tls").await, behind);
        // A node this look already saw present the Secret's certificate is not asked
        // again (here it does not, so asking would find it behind).
        assert_eq!(reload(&pods, &[], |_| true, &dial, "vc-tls").await, nothing);
        assert_eq!(
            presented().await,
            der(&old),
            "its files are still the old ones"
        );

        old.replace_with(&renewed).unwrap();
        let changed = reload(&pods, &[], no, &dial, "vc-tls").await;
        assert_eq!(
            changed.changed,
            ["node 0-0 reloaded its certificate from Secret vc-tls"]
        );
        assert!(changed.behind.is_empty());
        assert_eq!(presented().await, der(&renewed));
        assert_eq!(reload(&pods, &[], no, &dial, "vc-tls").await, nothing);
        // A node whose pod is not ready is not reached: neither behind nor current.
        let mut not_ready = pods.clone();
        if let Some(p) = not_ready.nodes.get_mut(&node) {
            p.ready = false;
        }
        let unchecked = Reload {
            unchecked: vec![node],
            ..Reload::default()
        };
        assert_eq!(
            reload(&not_ready, &[], no, &dial, "vc-tls").await,
            unchecked
        );
        // A pod the roll replaces next is left to it.
        assert_eq!(reload(&pods, &[node], no, &dial, "vc-tls").await, nothing);
        // A plain cluster has nothing to reload.
        assert_eq!(
            reload(&pods, &[], no, &Dial::default(), "vc-tls").await,
            nothing
        );
    }
}
