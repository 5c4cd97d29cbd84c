//! [`Tls`]: the settings of a TLS connection to a node, for clusters whose nodes speak TLS
//! only (`tls-port`, `port 0`).
//!
//! The node's certificate is checked against the cluster's CA, and its name is not: the
//! client dials nodes by IP, which a cluster's certificate rarely names, and Valkey's own
//! nodes check each other the same way (chain only, on the cluster bus and replication).
//! The client presents its own certificate when it has one, since Valkey asks every client
//! for one by default (`tls-auth-clients yes`).

use std::fmt;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::ring;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio_rustls::TlsConnector;

/// Why TLS settings could not be made from the given PEM.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM input holds no item of the kind needed, or cannot be read.
    #[error("{what}: {message}")]
    Pem { what: &'static str, message: String },

    /// rustls refused the CA, the certificate or the key.
    #[error("{what}: {source}")]
    Rustls {
        what: &'static str,
        source: rustls::Error,
    },
}

/// How to speak TLS to the nodes: cheap to clone (one shared rustls config).
#[derive(Clone)]
pub struct Tls {
    connector: TlsConnector,
    /// The client's own certificate (DER), if it has one.
    certificate: Option<Arc<[u8]>>,
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Tls")
    }
}

impl Tls {
    /// TLS settings from PEM: `ca`, the certificates the nodes' chains must lead to, and
    /// optionally `identity`, the client's certificate chain (leaf first) and its key.
    ///
    /// # Errors
    ///
    /// [`TlsError`] if `ca` holds no certificate, `identity` no certificate or no key, or
    /// rustls refuses one of them.
    pub fn from_pem(ca: &[u8], identity: Option<(&[u8], &[u8])>) -> Result<Tls, TlsError> {
        let mut roots = RootCertStore::empty();
        for cert in certificates("ca", ca)? {
            roots
                .add(cert)
                .map_err(|source| TlsError::Rustls { what: "ca", source })?;
        }
        let provider = Arc::new(ring::default_provider());
        let chain = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .map_err(|e| TlsError::Pem {
                what: "ca",
                message: e.to_string(),
            })?;
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|source| TlsError::Rustls {
                what: "protocol versions",
                source,
            })?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(ChainOnly(chain)));
        let mut certificate = None;
        let config = match identity {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain = certificates("certificate", cert)?;
                certificate = chain.first().map(|leaf| Arc::from(leaf.as_ref()));
                let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| TlsError::Pem {
                    what: "key",
                    message: e.to_string(),
                })?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|source| TlsError::Rustls {
                        what: "certificate and key",
                        source,
                    })?
            }
        };
        Ok(Tls {
            connector: TlsConnector::from(Arc::new(config)),
            certificate,
        })
    }

    /// The client's own certificate (the leaf, DER), if it has one.
    pub fn certificate(&self) -> Option<&[u8]> {
        self.certificate.as_deref()
    }

    pub(crate) fn connector(&self) -> &TlsConnector {
        &self.connector
    }
}

/// Every certificate in `pem`; at least one.
fn certificates(what: &'static str, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            what,
            message: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Pem {
            what,
            message: "no CERTIFICATE in the PEM".into(),
        });
    }
    Ok(certs)
}

/// webpki's verification, but for the name: a chain to the CA, valid now, for a server.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            // webpki checks the name last: a name error means everything else held.
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}
