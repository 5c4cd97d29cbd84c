//! The backend leg of a terminating TLS port: plain TCP, or TLS to a node that speaks it
//! (verified against a CA bundle; the name checked is the node's SNI name, or one fixed name).

use std::path::PathBuf;
use std::sync::Arc;

use rustls::ClientConfig;
use rustls_pki_types::ServerName;
use tokio_rustls::TlsConnector;

use crate::tls::certs::{provider, roots, CertError, VERSIONS};

/// How the proxy talks to the nodes behind a terminating TLS port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendTlsConfig {
    /// Plain TCP (the nodes listen in plain text on a private network).
    Plain,
    /// TLS, verified against `ca`. `server_name`: the name checked on every node's
    /// certificate; `None`: each node's own SNI name (`<prefix>-<s>-<n>.<domain>`).
    Tls {
        ca: PathBuf,
        server_name: Option<String>,
    },
}

/// The connector of a TLS backend leg.
#[derive(Clone)]
pub struct BackendTls {
    pub connector: TlsConnector,
    /// A fixed name to verify, or `None` for each node's SNI name.
    pub server_name: Option<ServerName<'static>>,
}

impl BackendTls {
    /// Loads the CA bundle. `Ok(None)` for a plain backend leg.
    pub fn load(config: &BackendTlsConfig) -> Result<Option<BackendTls>, CertError> {
        let BackendTlsConfig::Tls { ca, server_name } = config else {
            return Ok(None);
        };
        let pem = std::fs::read(ca).map_err(|source| CertError::Read {
            path: ca.clone(),
            source,
        })?;
        let roots = roots(ca, &pem)?;
        let client = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(VERSIONS)
            .map_err(|source| CertError::Rustls {
                path: ca.clone(),
                what: "protocol versions",
                source,
            })?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let server_name = match server_name {
            Some(n) => Some(ServerName::try_from(n.clone()).map_err(|e| CertError::Pem {
                path: ca.clone(),
                what: "backend server name",
                message: format!("{n:?}: {e}"),
            })?),
            None => None,
        };
        Ok(Some(BackendTls {
            connector: TlsConnector::from(Arc::new(client)),
            server_name,
        }))
    }
}

impl BackendTls {
    /// The name checked on `node`'s certificate: the fixed name, else the node's SNI name.
    pub fn name_for(
        &self,
        names: &shardgate_crds::Hostnames,
        node: shardgate_crds::NodeRef,
        backend: &crate::model::Backend,
    ) -> Result<ServerName<'static>, super::DialError> {
        if let Some(n) = &self.server_name {
            return Ok(n.clone());
        }
        let host = shardgate_crds::node_hostname(&names.prefix, node, &names.domain);
        ServerName::try_from(host).map_err(|e| super::DialError::Tls {
            backend: backend.to_string(),
            name: "(invalid)".into(),
            source: std::io::Error::other(e.to_string()),
        })
    }
}
