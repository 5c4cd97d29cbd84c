//! The legs to nodes that speak TLS (`--tls-backend tls`): from the node ports, from a
//! terminating TLS port, and discovery's. Verified against a CA bundle; the name checked is
//! the node's SNI name, one fixed name, or none (the chain only). The proxy shows a client
//! certificate when it has one, since Valkey asks every client for one by default.
//!
//! The files are read again when they change ([`crate::tls::certs::reload`]): a connection
//! dialled after a reload uses the new files, and one already up keeps its session.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::ClientConfig;
use rustls_pki_types::ServerName;
use shardgate_crds::{Hostnames, NodeRef};
use tokio::sync::watch;
use tokio_rustls::TlsConnector;

use crate::model::{Backend, Host};
use crate::tls::certs::{certificates, provider, roots, CertError, Contents, Reloadable, VERSIONS};

/// How the proxy talks to the nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendTlsConfig {
    /// Plain TCP (the nodes listen in plain text on a private network).
    Plain,
    /// TLS, verified against `ca`, checking `name`; with `identity`, the proxy shows that
    /// client certificate.
    Tls {
        ca: PathBuf,
        name: BackendName,
        identity: Option<Identity>,
    },
}

/// The name a node's certificate must carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendName {
    /// Each node's own SNI name (`<prefix>-<s>-<n>.<domain>`).
    Sni(Hostnames),
    /// One name, on every node's certificate.
    Fixed(String),
    /// None: the certificate must lead to the CA, whatever it names. For nodes dialled at
    /// addresses that no certificate names (pod IPs).
    ChainOnly,
}

/// A client certificate chain (PEM, leaf first) and its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The connector of a TLS leg to the nodes, built from [`BackendTlsConfig::Tls`].
#[derive(Clone)]
pub struct BackendTls {
    connector: TlsConnector,
    name: Name,
    /// The same CA, certificate and fixed name for the admin client (discovery's
    /// connections); with SNI names it checks the chain only.
    pub admin: shardgate_admin_client::Tls,
}

#[derive(Clone)]
enum Name {
    Sni(Hostnames),
    Fixed(ServerName<'static>),
    /// The address dialled stands in as the name: it is sent as SNI when it is a DNS name.
    Dialled,
}

/// The TLS settings in force, and their reloads.
pub type BackendTlsRx = watch::Receiver<Arc<BackendTls>>;

impl BackendTlsConfig {
    /// The files: the CA, then the certificate and key if there are.
    fn files(&self) -> Vec<&Path> {
        match self {
            BackendTlsConfig::Plain => vec![],
            BackendTlsConfig::Tls { ca, identity, .. } => std::iter::once(ca.as_path())
                .chain(
                    identity
                        .iter()
                        .flat_map(|i| [i.cert.as_path(), i.key.as_path()]),
                )
                .collect(),
        }
    }
}

impl Reloadable for BackendTlsConfig {
    type Built = BackendTls;

    fn read(&self) -> Result<Contents, CertError> {
        Contents::read(&self.files())
    }

    fn build(&self, contents: &Contents) -> Result<BackendTls, CertError> {
        let BackendTlsConfig::Tls { ca, name, identity } = self else {
            return Err(internal(Path::new("-"), "no TLS to build for a plain leg"));
        };
        let (ca_pem, identity_pem) = match (contents.get(0), contents.get(1), contents.get(2)) {
            (Some(ca), Some(cert), Some(key)) if identity.is_some() => (ca, Some((cert, key))),
            (Some(ca), None, None) if identity.is_none() => (ca, None),
            _ => return Err(internal(ca, "contents read do not match the files")),
        };
        let identity_slices = identity_pem.map(|(c, k)| (c.as_slice(), k.as_slice()));
        // Discovery dials an address before it knows the node there: it can check one fixed
        // name, not each node's SNI name.
        let admin = match name {
            BackendName::Fixed(n) => {
                shardgate_admin_client::Tls::from_pem_named(ca_pem, identity_slices, n)
            }
            BackendName::Sni(_) | BackendName::ChainOnly => {
                shardgate_admin_client::Tls::from_pem(ca_pem, identity_slices)
            }
        }
        .map_err(|e| {
            // The file at fault.
            let what = match &e {
                shardgate_admin_client::TlsError::Pem { what, .. }
                | shardgate_admin_client::TlsError::Rustls { what, .. } => *what,
            };
            let path = match (what, identity) {
                ("key", Some(i)) => &i.key,
                ("ca" | "server name", _) | (_, None) => ca,
                (_, Some(i)) => &i.cert,
            };
            CertError::Pem {
                path: path.clone(),
                what: "backend TLS",
                message: e.to_string(),
            }
        })?;
        let (connector, name) = match name {
            // The admin client's verifier checks the chain only.
            BackendName::ChainOnly => (admin.connector().clone(), Name::Dialled),
            BackendName::Sni(names) => (
                webpki_connector(ca, ca_pem, identity, identity_pem)?,
                Name::Sni(names.clone()),
            ),
            // The admin client's verifier checks that one name, as webpki does.
            BackendName::Fixed(_) => match admin.server_name() {
                Some(fixed) => (admin.connector().clone(), Name::Fixed(fixed.clone())),
                None => return Err(internal(ca, "a fixed name without its check")),
            },
        };
        Ok(BackendTls {
            connector,
            name,
            admin,
        })
    }

    fn describe(&self) -> String {
        match self {
            BackendTlsConfig::Plain => "plain".into(),
            BackendTlsConfig::Tls { ca, .. } => format!("backend TLS (CA {})", ca.display()),
        }
    }
}

fn internal(path: &Path, message: &str) -> CertError {
    CertError::Pem {
        path: path.to_path_buf(),
        what: "internal",
        message: message.into(),
    }
}

/// A connector that checks names (webpki), showing `identity` if given.
fn webpki_connector(
    ca: &Path,
    ca_pem: &[u8],
    identity: &Option<Identity>,
    identity_pem: Option<(&Vec<u8>, &Vec<u8>)>,
) -> Result<TlsConnector, CertError> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(VERSIONS)
        .map_err(|source| CertError::Rustls {
            path: ca.to_path_buf(),
            what: "protocol versions",
            source,
        })?
        .with_root_certificates(roots(ca, ca_pem)?);
    let config = match (identity, identity_pem) {
        (Some(i), Some((cert, key))) => {
            let chain = certificates(&i.cert, cert)?;
            let key =
                shardgate_admin_client::pem::private_key(key).map_err(|e| CertError::Pem {
                    path: i.key.clone(),
                    what: "private key",
                    message: e.to_string(),
                })?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|source| CertError::Rustls {
                    path: i.key.clone(),
                    what: "client certificate and key",
                    source,
                })?
        }
        _ => builder.with_no_client_auth(),
    };
    Ok(TlsConnector::from(Arc::new(config)))
}

impl BackendTls {
    pub fn connector(&self) -> &TlsConnector {
        &self.connector
    }

    /// The name to check on `node`'s certificate, dialled at `backend`.
    pub fn name_for(
        &self,
        node: NodeRef,
        backend: &Backend,
    ) -> Result<ServerName<'static>, super::DialError> {
        let invalid = |e: rustls_pki_types::InvalidDnsNameError| super::DialError::Tls {
            backend: backend.to_string(),
            name: "(invalid)".into(),
            source: std::io::Error::other(e.to_string()),
        };
        match &self.name {
            Name::Fixed(n) => Ok(n.clone()),
            Name::Sni(names) => {
                let host = shardgate_crds::node_hostname(&names.prefix, node, &names.domain);
                ServerName::try_from(host).map_err(invalid)
            }
            Name::Dialled => match &backend.host {
                Host::Ip(ip) => Ok(ServerName::IpAddress((*ip).into())),
                Host::Dns(name) => ServerName::try_from(name.clone()).map_err(invalid),
            },
        }
    }
}
