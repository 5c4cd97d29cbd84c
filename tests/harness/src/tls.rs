//! Test certificates, made at run time with rcgen (no key is checked in), and a rustls
//! client that dials 127.0.0.1 with any SNI name (there is no DNS here, and /etc/hosts is
//! not ours to edit).
//!
//! ```no_run
//! # async fn f() -> anyhow::Result<()> {
//! use shardgate_harness::tls::TestPki;
//! let pki = TestPki::new("example.test")?;
//! let server = pki.wildcard("proxy")?;            // *.example.test
//! let config = pki.client_config(None);
//! let addr = "127.0.0.1:6380".parse()?;
//! let mut tls = shardgate_harness::tls::connect(addr, "vc-0-1.example.test", config).await?;
//! let pong = shardgate_harness::tls::command(&mut tls, &["PING"]).await?;
//! # Ok(()) }
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

/// A certificate and its key, as PEM files.
#[derive(Debug, Clone)]
pub struct CertPair {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub cert_pem: String,
    pub key_pem: String,
}

impl CertPair {
    /// The leaf certificate in DER.
    pub fn cert_der(&self) -> Result<CertificateDer<'static>> {
        CertificateDer::from_pem_slice(self.cert_pem.as_bytes()).context("leaf PEM")
    }

    /// Overwrites this pair's files with `other`'s content (a certificate rotation as a
    /// Secret update would do it: the key first, then the certificate).
    pub fn replace_with(&self, other: &CertPair) -> Result<()> {
        write(&self.key, &other.key_pem)?;
        write(&self.cert, &other.cert_pem)
    }
}

/// A throwaway CA in its own directory (removed on drop), and the certificates it signs.
pub struct TestPki {
    dir: PathBuf,
    pub domain: String,
    issuer: Issuer<'static, KeyPair>,
    /// The CA certificate (PEM file): what clients trust.
    pub ca: PathBuf,
    pub ca_pem: String,
}

impl TestPki {
    /// A new CA for `domain` (its name says so; it may sign anything).
    pub fn new(domain: &str) -> Result<TestPki> {
        let dir = unique_dir("shardgate-pki");
        std::fs::create_dir_all(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        let key = KeyPair::generate().context("CA key")?;
        let params = ca_params(format!("shardgate test CA for {domain}"))?;
        let cert = params.self_signed(&key).context("self-signing the CA")?;
        let ca = dir.join("ca.crt");
        let ca_pem = cert.pem();
        write(&ca, &ca_pem)?;
        Ok(TestPki {
            dir,
            domain: domain.to_string(),
            issuer: Issuer::new(params, key),
            ca,
            ca_pem,
        })
    }

    /// An intermediate CA that this one signed, as a `TestPki` of its own: what it signs
    /// chains to this CA through it. Its `ca_pem` is the intermediate's certificate, which a
    /// leaf's chain carries after the leaf; clients trust this CA's.
    pub fn intermediate(&self, name: &str) -> Result<TestPki> {
        let dir = unique_dir("shardgate-pki");
        std::fs::create_dir_all(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        let key = KeyPair::generate().context("intermediate CA key")?;
        let params = ca_params(format!(
            "shardgate test intermediate CA {name} for {}",
            self.domain
        ))?;
        let cert = params
            .signed_by(&key, &self.issuer)
            .with_context(|| format!("signing the intermediate CA {name}"))?;
        let ca = dir.join("ca.crt");
        let ca_pem = cert.pem();
        write(&ca, &ca_pem)?;
        Ok(TestPki {
            dir,
            domain: self.domain.clone(),
            issuer: Issuer::new(params, key),
            ca,
            ca_pem,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A server certificate for `names`, written as `<stem>.crt` / `<stem>.key`.
    /// `expired`: valid in 2000 only.
    pub fn server_cert(&self, stem: &str, names: &[String], expired: bool) -> Result<CertPair> {
        let usages = [ExtendedKeyUsagePurpose::ServerAuth];
        self.named_leaf(stem, names, &usages, expired)
    }

    /// A leaf certificate for `names` with these extended key usages.
    fn named_leaf(
        &self,
        stem: &str,
        names: &[String],
        usages: &[ExtendedKeyUsagePurpose],
        expired: bool,
    ) -> Result<CertPair> {
        let mut params = CertificateParams::new(names.to_vec())?;
        params.distinguished_name.push(DnType::CommonName, stem);
        params.extended_key_usages = usages.to_vec();
        if expired {
            params.not_before = rcgen::date_time_ymd(2000, 1, 1);
            params.not_after = rcgen::date_time_ymd(2000, 12, 31);
        }
        self.sign(stem, params)
    }

    /// `*.<domain>`: every SNI name of the TLS port (`<prefix>-<s>-<n>`, `<prefix>-<s>`,
    /// `<prefix>` are all one label under the domain).
    pub fn wildcard(&self, stem: &str) -> Result<CertPair> {
        self.server_cert(stem, &[format!("*.{}", self.domain)], false)
    }

    /// `*.<domain>`, expired.
    pub fn expired_wildcard(&self, stem: &str) -> Result<CertPair> {
        self.server_cert(stem, &[format!("*.{}", self.domain)], true)
    }

    /// A Valkey node's certificate for `names`: for server and client authentication both,
    /// since a node presents it both ways (to clients, and to the nodes and primaries it
    /// dials on the cluster bus and for replication).
    pub fn node_cert(&self, stem: &str, names: &[String]) -> Result<CertPair> {
        let usages = [
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        self.named_leaf(stem, names, &usages, false)
    }

    /// A client certificate (mTLS) with common name `cn`.
    pub fn client_cert(&self, stem: &str, cn: &str) -> Result<CertPair> {
        self.client_cert_with(stem, cn, true, None)
    }

    /// A certificate with common name `cn` and no names: for client use only (`client_use`)
    /// or with no extended key usage at all; valid from the start of one year to the end of
    /// another (`years`), or from now on.
    pub fn client_cert_with(
        &self,
        stem: &str,
        cn: &str,
        client_use: bool,
        years: Option<(i32, i32)>,
    ) -> Result<CertPair> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, cn);
        if client_use {
            params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        }
        if let Some((from, to)) = years {
            params.not_before = rcgen::date_time_ymd(from, 1, 1);
            params.not_after = rcgen::date_time_ymd(to, 12, 31);
        }
        self.sign(stem, params)
    }

    fn sign(&self, stem: &str, params: CertificateParams) -> Result<CertPair> {
        let key = KeyPair::generate().context("leaf key")?;
        let cert = params
            .signed_by(&key, &self.issuer)
            .with_context(|| format!("signing {stem}"))?;
        let pair = CertPair {
            cert: self.dir.join(format!("{stem}.crt")),
            key: self.dir.join(format!("{stem}.key")),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        };
        write(&pair.cert, &pair.cert_pem)?;
        write(&pair.key, &pair.key_pem)?;
        Ok(pair)
    }

    /// A rustls client config that trusts this CA (TLS 1.2 and 1.3, ring), with a client
    /// certificate if given.
    pub fn client_config(&self, client: Option<&CertPair>) -> Arc<ClientConfig> {
        client_config(&[&self.ca_pem], client, None)
    }
}

/// A CA's certificate parameters (it may sign anything), named `cn`.
fn ca_params(cn: String) -> Result<CertificateParams> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, cn);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    Ok(params)
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A client config trusting the CAs in `ca_pems`; `versions`: e.g. only TLS 1.2.
///
/// # Panics
/// On a CA or client certificate that does not parse (they come from [`TestPki`]).
pub fn client_config(
    ca_pems: &[&str],
    client: Option<&CertPair>,
    versions: Option<&[&'static rustls::SupportedProtocolVersion]>,
) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    for pem in ca_pems {
        for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
            roots
                .add(cert.expect("CA PEM"))
                .expect("CA certificate accepted");
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(
            versions.unwrap_or(&[&rustls::version::TLS13, &rustls::version::TLS12]),
        )
        .expect("protocol versions")
        .with_root_certificates(roots);
    let config = match client {
        Some(pair) => {
            let chain: Vec<CertificateDer<'static>> =
                CertificateDer::pem_slice_iter(pair.cert_pem.as_bytes())
                    .collect::<Result<_, _>>()
                    .expect("client certificate PEM");
            let key = PrivateKeyDer::from_pem_slice(pair.key_pem.as_bytes()).expect("client key");
            builder
                .with_client_auth_cert(chain, key)
                .expect("client certificate and key")
        }
        None => builder.with_no_client_auth(),
    };
    Arc::new(config)
}

/// Dials `addr` and completes a TLS handshake with SNI `sni` (and the certificate checked
/// against that name), within 10 s.
pub async fn connect(
    addr: SocketAddr,
    sni: &str,
    config: Arc<ClientConfig>,
) -> Result<TlsStream<TcpStream>> {
    let name = ServerName::try_from(sni.to_string()).context("SNI name")?;
    let attempt = async {
        let tcp = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connect {addr}"))?;
        tcp.set_nodelay(true)?;
        let tls = TlsConnector::from(config).connect(name, tcp).await?;
        anyhow::Ok(tls)
    };
    tokio::time::timeout(Duration::from_secs(10), attempt)
        .await
        .context("TLS connect timed out")?
}

/// Sends one command as RESP and reads one whole reply (within 10 s).
pub async fn command<S>(stream: &mut S, args: &[&str]) -> Result<redis::Value>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut req = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        req.extend_from_slice(format!("${}\r\n{a}\r\n", a.len()).as_bytes());
    }
    stream.write_all(&req).await?;
    stream.flush().await?;
    read_reply(stream).await
}

/// Reads one whole RESP reply.
pub async fn read_reply<S: AsyncRead + Unpin>(stream: &mut S) -> Result<redis::Value> {
    let mut buf = Vec::new();
    let read = async {
        loop {
            if !buf.is_empty() {
                if let Ok(v) = redis::parse_redis_value(&buf) {
                    return Ok(v);
                }
            }
            let mut chunk = [0u8; 16 * 1024];
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                bail!(
                    "connection closed after {} bytes: {:?}",
                    buf.len(),
                    String::from_utf8_lossy(&buf)
                );
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .context("no whole reply within 10s")?
}

/// A reply as text: simple and bulk strings, and errors as `ERR ...`.
pub fn text(v: &redis::Value) -> String {
    match v {
        redis::Value::SimpleString(s) => s.clone(),
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        redis::Value::ServerError(e) => format!("{} {}", e.code(), e.details().unwrap_or_default()),
        other => format!("{other:?}"),
    }
}

/// A fresh directory name under the temp dir: `<prefix>-<pid>-<counter>-<nanos>`.
pub fn unique_dir(prefix: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    std::env::temp_dir().join(format!(
        "{prefix}-{}-{}-{nanos}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}

fn write(path: &Path, content: &str) -> Result<()> {
    // Write then rename, so that a poller never reads half a file.
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, content).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
}
