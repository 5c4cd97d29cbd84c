//! A throwaway PKI for one control plane: a CA, the API server's serving certificate, a
//! service-account signing key and an admin bearer token, written as files the binaries read.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// The files of a [`Pki`], all under one directory.
pub struct Pki {
    /// The CA certificate (PEM): trust anchor for clients, and `--client-ca-file`.
    pub ca_cert: PathBuf,
    /// The CA certificate's PEM text (for kubeconfigs and the `kube-root-ca.crt` content).
    pub ca_pem: String,
    /// The CA certificate in DER, for a `kube::Config`.
    pub ca_der: Vec<u8>,
    /// The CA key (PEM), for the controller manager's CSR signer.
    pub ca_key: PathBuf,
    /// The API server's certificate and key (PEM): valid for 127.0.0.1 and localhost.
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    /// The service-account signing key (PEM, ECDSA P-256) and its public half.
    pub sa_key: PathBuf,
    pub sa_pub: PathBuf,
    /// The `--token-auth-file` of the API server, with [`Pki::admin_token`] in `system:masters`.
    pub token_file: PathBuf,
    pub admin_token: String,
}

impl Pki {
    /// Generates everything into `dir` (which must exist).
    pub fn generate(dir: &Path) -> Result<Pki> {
        let ca_key = KeyPair::generate().context("CA key")?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "shardgate-test-ca");
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = ca_params
            .self_signed(&ca_key)
            .context("self-signing the CA")?;
        let ca_pem = ca.pem();
        let ca_key_pem = ca_key.serialize_pem();
        let issuer = Issuer::new(ca_params, ca_key);

        let server_key = KeyPair::generate().context("server key")?;
        // The names a client inside or outside the "cluster" may use for the API server.
        let mut server_params = CertificateParams::new(vec![
            "127.0.0.1".to_string(),
            "localhost".to_string(),
            "kubernetes".to_string(),
            "kubernetes.default".to_string(),
            "kubernetes.default.svc".to_string(),
            "kubernetes.default.svc.cluster.local".to_string(),
        ])?;
        server_params
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        server_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server = server_params
            .signed_by(&server_key, &issuer)
            .context("signing the server certificate")?;

        let sa_key = KeyPair::generate().context("service-account key")?;
        let admin_token = random_hex(16)?;

        let pki = Pki {
            ca_cert: dir.join("ca.crt"),
            ca_pem: ca_pem.clone(),
            ca_der: ca.der().to_vec(),
            ca_key: dir.join("ca.key"),
            server_cert: dir.join("apiserver.crt"),
            server_key: dir.join("apiserver.key"),
            sa_key: dir.join("sa.key"),
            sa_pub: dir.join("sa.pub"),
            token_file: dir.join("tokens.csv"),
            admin_token: admin_token.clone(),
        };
        write(&pki.ca_cert, &ca_pem)?;
        write(&pki.ca_key, &ca_key_pem)?;
        write(&pki.server_cert, &server.pem())?;
        write(&pki.server_key, &server_key.serialize_pem())?;
        write(&pki.sa_key, &sa_key.serialize_pem())?;
        write(&pki.sa_pub, &sa_key.public_key_pem())?;
        write(
            &pki.token_file,
            &format!("{admin_token},shardgate-admin,shardgate-admin,\"system:masters\"\n"),
        )?;
        Ok(pki)
    }
}

fn write(path: &Path, content: &str) -> Result<()> {
    std::fs::write(path, content).with_context(|| format!("writing {}", path.display()))
}

/// `n` random bytes from the kernel, as hex.
pub(crate) fn random_hex(n: usize) -> Result<String> {
    use std::io::Read;
    let mut buf = vec![0u8; n];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .context("reading /dev/urandom")?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}
