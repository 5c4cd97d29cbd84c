//! Certificates and keys from PEM: the one reader for every TLS setting of shardgate (the
//! admin client's, the proxy's TLS port and its backend leg). Callers add where the PEM
//! came from to the error.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Why PEM input gave no certificate or key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PemError {
    /// The PEM could not be parsed.
    #[error("{0}")]
    Invalid(String),
    /// It parsed, but holds no block of the kind needed.
    #[error("no {0} block in the PEM")]
    Missing(&'static str),
}

/// Every certificate in `pem`, in order (a chain: leaf first); at least one.
pub fn certificates(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, PemError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| PemError::Invalid(e.to_string()))?;
    if certs.is_empty() {
        return Err(PemError::Missing("CERTIFICATE"));
    }
    Ok(certs)
}

/// The first private key in `pem` (PKCS#8, PKCS#1 or SEC1).
pub fn private_key(pem: &[u8]) -> Result<PrivateKeyDer<'static>, PemError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => PemError::Missing("PRIVATE KEY"),
        e => PemError::Invalid(e.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const CERT: &str = "-----BEGIN CERTIFICATE-----\nMAMCAQE=\n-----END CERTIFICATE-----\n";

    /// Blocks are taken in order; other blocks are passed over; none of the kind is
    /// named as missing; a broken block is invalid.
    #[test]
    fn blocks_of_the_kind_asked_for() {
        let two = format!("{CERT}-----BEGIN X-----\nAA==\n-----END X-----\n{CERT}");
        let certs = certificates(two.as_bytes()).unwrap();
        assert_eq!(certs.len(), 2);
        assert_eq!(certs[0].as_ref(), [0x30, 0x03, 0x02, 0x01, 0x01]);
        assert_eq!(certificates(b""), Err(PemError::Missing("CERTIFICATE")));
        assert_eq!(
            private_key(CERT.as_bytes()).unwrap_err(),
            PemError::Missing("PRIVATE KEY")
        );
        let broken = "-----BEGIN CERTIFICATE-----\nMAMCAQE=\n";
        assert!(matches!(
            certificates(broken.as_bytes()),
            Err(PemError::Invalid(_))
        ));
        let key = "-----BEGIN PRIVATE KEY-----\nMAMCAQE=\n-----END PRIVATE KEY-----\n";
        assert!(matches!(
            private_key(key.as_bytes()),
            Ok(PrivateKeyDer::Pkcs8(_))
        ));
    }
}
