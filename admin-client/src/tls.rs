//! [`Tls`]: the settings of a TLS connection to a node, for clusters whose nodes speak TLS
//! only (`tls-port`, `port 0`).
//!
//! The node's certificate is checked against the cluster's CA, and its name is not: the
//! client dials nodes by IP, which a cluster's certificate rarely names, and Valkey's own
//! nodes check each other the same way (chain only, on the cluster bus and replication).
//! Where every node carries one name, [`Tls::from_pem_named`] checks it as well.
//! The client presents its own certificate when it has one, since Valkey asks every client
//! for one by default (`tls-auth-clients yes`).

use std::fmt;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{verify_server_cert_signed_by_trust_anchor, WebPkiServerVerifier};
use rustls::crypto::{
    ring, verify_tls12_signature, verify_tls13_signature, WebPkiSupportedAlgorithms,
};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
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
    /// The name checked on the nodes' certificates, if one is.
    name: Option<ServerName<'static>>,
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
        Self::build(ca, identity, None)
    }

    /// As [`Tls::from_pem`], and every node's certificate must name `name` (sent as SNI
    /// when it is a DNS name), as webpki checks a server's: for nodes that all carry one
    /// name.
    ///
    /// # Errors
    ///
    /// As [`Tls::from_pem`], and [`TlsError::Pem`] (`what` is `"server name"`) if `name`
    /// is not a DNS name or an IP address.
    pub fn from_pem_named(
        ca: &[u8],
        identity: Option<(&[u8], &[u8])>,
        name: &str,
    ) -> Result<Tls, TlsError> {
        Self::build(ca, identity, Some(name))
    }

    fn build(
        ca: &[u8],
        identity: Option<(&[u8], &[u8])>,
        name: Option<&str>,
    ) -> Result<Tls, TlsError> {
        let provider = Arc::new(ring::default_provider());
        let chain_only = ChainOnly::new(ca, provider.signature_verification_algorithms)?;
        let (verifier, name): (Arc<dyn ServerCertVerifier>, _) = match name {
            None => (Arc::new(chain_only), None),
            Some(n) => {
                let server_name =
                    ServerName::try_from(n.to_string()).map_err(|e| TlsError::Pem {
                        what: "server name",
                        message: format!("{n:?}: {e}"),
                    })?;
                let verifier = WebPkiServerVerifier::builder_with_provider(
                    chain_only.roots.clone(),
                    provider.clone(),
                )
                .build()
                .map_err(|e| TlsError::Pem {
                    what: "ca",
                    message: e.to_string(),
                })?;
                (verifier as Arc<dyn ServerCertVerifier>, Some(server_name))
            }
        };
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|source| TlsError::Rustls {
                what: "protocol versions",
                source,
            })?
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        let mut certificate = None;
        let config = match identity {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain = certificates("certificate", cert)?;
                certificate = chain.first().map(|leaf| Arc::from(leaf.as_ref()));
                let key = crate::pem::private_key(key).map_err(|e| TlsError::Pem {
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
            name,
        })
    }

    /// The name every node's certificate must carry ([`Tls::from_pem_named`]); `None`:
    /// the chain is checked, not the name.
    pub fn server_name(&self) -> Option<&ServerName<'static>> {
        self.name.as_ref()
    }

    /// The client's own certificate (the leaf, DER), if it has one.
    pub fn certificate(&self) -> Option<&[u8]> {
        self.certificate.as_deref()
    }

    /// The connector: the proxy's TLS legs to the nodes use it too.
    pub fn connector(&self) -> &TlsConnector {
        &self.connector
    }
}

/// Every certificate in `pem`; at least one.
fn certificates(what: &'static str, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    crate::pem::certificates(pem).map_err(|e| TlsError::Pem {
        what,
        message: e.to_string(),
    })
}

/// webpki's verification of a server's certificate, but for the name: a chain to one of
/// `roots`, valid now, for server authentication.
#[derive(Debug)]
struct ChainOnly {
    roots: Arc<RootCertStore>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ChainOnly {
    /// Trusting the certificates of the PEM bundle `ca`.
    fn new(ca: &[u8], algorithms: WebPkiSupportedAlgorithms) -> Result<ChainOnly, TlsError> {
        let mut roots = RootCertStore::empty();
        for cert in certificates("ca", ca)? {
            roots
                .add(cert)
                .map_err(|source| TlsError::Rustls { what: "ca", source })?;
        }
        Ok(ChainOnly {
            roots: Arc::new(roots),
            algorithms,
        })
    }
}

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = ParsedCertificate::try_from(end_entity)?;
        verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.algorithms.all,
        )?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::{CertificateError, Error};
    use shardgate_harness::tls::{CertPair, TestPki};

    /// A certificate that chains to the CA and is for servers passes whatever it names;
    /// one expired, one for clients only, or one of another CA does not.
    #[test]
    fn the_chain_counts_and_the_name_does_not() {
        let pki = TestPki::new("vc.test").unwrap();
        let algorithms = ring::default_provider().signature_verification_algorithms;
        let verifier = ChainOnly::new(pki.ca_pem.as_bytes(), algorithms).unwrap();
        let dialled = ServerName::IpAddress(std::net::Ipv4Addr::new(127, 0, 0, 1).into());
        let check = |pair: &CertPair| {
            let der = pair.cert_der().unwrap();
            verifier.verify_server_cert(&der, &[], &dialled, &[], UnixTime::now())
        };
        let node = pki.node_cert("node", &["other.example".into()]).unwrap();
        assert!(check(&node).is_ok());
        let server = pki
            .server_cert("server", &["vc.test".into()], false)
            .unwrap();
        assert!(check(&server).is_ok());
        let expired = pki
            .server_cert("expired", &["vc.test".into()], true)
            .unwrap();
        assert!(
            matches!(
                check(&expired),
                Err(Error::InvalidCertificate(
                    CertificateError::Expired | CertificateError::ExpiredContext { .. }
                ))
            ),
            "{:?}",
            check(&expired)
        );
        let client_only = pki.client_cert("app", "app").unwrap();
        assert!(check(&client_only).is_err(), "a client certificate served");
        let other = TestPki::new("other.test").unwrap();
        let stranger = other.node_cert("node", &["vc.test".into()]).unwrap();
        assert!(
            matches!(
                check(&stranger),
                Err(Error::InvalidCertificate(CertificateError::UnknownIssuer))
            ),
            "{:?}",
            check(&stranger)
        );
    }
}
