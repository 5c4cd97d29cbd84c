//! Termination's certificate, key and optional client CA bundle: loaded from PEM files into a
//! rustls `ServerConfig` (ring provider, TLS 1.2 and 1.3 only), and reloaded when a file's
//! content changes; and the reload ([`reload`], [`Reloadable`]) that the TLS legs to the
//! nodes use too ([`crate::dial::tls`]).
//!
//! The config in force sits in a `watch` channel. Each handshake takes the latest one when
//! it starts, and a connection keeps the session it negotiated, so a reload drops nothing.
//! A new version that does not load (a key that does not match the certificate, a file
//! half written) is logged and counted, and the last good config stays. The files are
//! polled, like the route file, because a Kubernetes Secret volume swaps a symlink.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use rustls_pki_types::CertificateDer;
use shardgate_admin_client::pem;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::metrics::ReasonLabels;

/// The files of a terminating TLS port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertFiles {
    /// The certificate chain (PEM), leaf first.
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// With it, clients must present a certificate signed by one of these CAs (mTLS).
    pub client_ca: Option<PathBuf>,
}

/// Why a certificate, key or CA bundle did not load.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("{path}: cannot read: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {what}: {message}")]
    Pem {
        path: PathBuf,
        what: &'static str,
        message: String,
    },
    #[error("{path}: {what}: {source}")]
    Rustls {
        path: PathBuf,
        what: &'static str,
        source: rustls::Error,
    },
    #[error("{path}: client CA bundle: {message}")]
    ClientCa { path: PathBuf, message: String },
}

/// The crypto provider of every TLS config here: ring, as kube's rustls uses.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The protocol versions offered and accepted: TLS 1.3 and 1.2, nothing older.
pub const VERSIONS: &[&rustls::SupportedProtocolVersion] =
    &[&rustls::version::TLS13, &rustls::version::TLS12];

fn read(path: &Path) -> Result<Vec<u8>, CertError> {
    std::fs::read(path).map_err(|source| CertError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// The certificates of a PEM bundle (at least one).
pub fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, CertError> {
    pem::certificates(pem).map_err(|e| CertError::Pem {
        path: path.to_path_buf(),
        what: "certificates",
        message: e.to_string(),
    })
}

/// A root store of the CA certificates of a PEM bundle.
pub fn roots(path: &Path, pem: &[u8]) -> Result<RootCertStore, CertError> {
    let mut roots = RootCertStore::empty();
    for cert in certificates(path, pem)? {
        roots.add(cert).map_err(|e| CertError::ClientCa {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    }
    Ok(roots)
}

/// The contents of the files, compared to notice a change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Contents(Vec<Vec<u8>>);

impl Contents {
    /// Reads every file of `paths`, in order.
    pub fn read(paths: &[&Path]) -> Result<Contents, CertError> {
        paths
            .iter()
            .map(|p| read(p))
            .collect::<Result<_, _>>()
            .map(Contents)
    }

    /// The content of the `i`th file.
    pub fn get(&self, i: usize) -> Option<&Vec<u8>> {
        self.0.get(i)
    }
}

/// Files that make a TLS config, read again when they change ([`reload`]).
pub trait Reloadable: Clone + Send + Sync + 'static {
    /// What the files make.
    type Built: Send + Sync + 'static;
    /// Reads every file.
    fn read(&self) -> Result<Contents, CertError>;
    /// Builds the config from the files' contents.
    fn build(&self, contents: &Contents) -> Result<Self::Built, CertError>;
    /// What the log names.
    fn describe(&self) -> String;

    /// Reads and builds.
    fn load(&self) -> Result<(Self::Built, Contents), CertError> {
        let contents = self.read()?;
        Ok((self.build(&contents)?, contents))
    }
}

impl Reloadable for CertFiles {
    type Built = ServerConfig;

    fn read(&self) -> Result<Contents, CertError> {
        let mut paths = vec![self.cert.as_path(), self.key.as_path()];
        paths.extend(self.client_ca.as_deref());
        Contents::read(&paths)
    }

    fn build(&self, contents: &Contents) -> Result<ServerConfig, CertError> {
        self.server_config(contents)
    }

    fn describe(&self) -> String {
        format!("TLS port certificate {}", self.cert.display())
    }
}

impl CertFiles {
    /// Builds the server config from the files' contents.
    fn server_config(&self, contents: &Contents) -> Result<ServerConfig, CertError> {
        let [cert_pem, key_pem, rest @ ..] = &contents.0[..] else {
            return Err(CertError::Pem {
                path: self.cert.clone(),
                what: "internal",
                message: "contents read without a certificate and a key".into(),
            });
        };
        let chain = certificates(&self.cert, cert_pem)?;
        let key = pem::private_key(key_pem).map_err(|e| CertError::Pem {
            path: self.key.clone(),
            what: "private key",
            message: e.to_string(),
        })?;
        let provider = provider();
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(VERSIONS)
            .map_err(|source| CertError::Rustls {
                path: self.cert.clone(),
                what: "protocol versions",
                source,
            })?;
        let builder = match (&self.client_ca, rest.first()) {
            (Some(path), Some(pem)) => {
                let roots = roots(path, pem)?;
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                        .build()
                        .map_err(|e| CertError::ClientCa {
                            path: path.clone(),
                            message: e.to_string(),
                        })?;
                builder.with_client_cert_verifier(verifier)
            }
            _ => builder.with_no_client_auth(),
        };
        builder
            .with_single_cert(chain, key)
            .map_err(|source| CertError::Rustls {
                path: self.key.clone(),
                what: "certificate and key",
                source,
            })
    }
}

/// The config in force, and its changes.
pub type ServerConfigRx = watch::Receiver<Arc<ServerConfig>>;

/// The files' contents if they changed (`known` says which contents are not news), once two
/// reads in a row agree. The files are read one after the other, so a Secret swapped between
/// two of them reads as one version's certificate with the other's key: a mix that would
/// fail to build and be reported, although the files were never wrong. Two equal reads
/// saw no swap (a swap between them would make them differ); a differing pair waits for the
/// next poll.
fn settled_change<R: Reloadable>(
    files: &R,
    known: impl Fn(&Contents) -> bool,
) -> Result<Option<Contents>, CertError> {
    let first = files.read()?;
    if known(&first) {
        return Ok(None);
    }
    let again = files.read()?;
    if again != first {
        tracing::debug!(
            "{}: changed while read, read again next time",
            files.describe()
        );
        return Ok(None);
    }
    Ok(Some(first))
}

/// Polls `files` every `interval` until `shutdown`, and publishes each version that loads,
/// counting each in `reloads` (`ok`, `error`).
pub async fn reload<R: Reloadable>(
    files: R,
    mut seen: Contents,
    tx: watch::Sender<Arc<R::Built>>,
    interval: Duration,
    reloads: Family<ReasonLabels, Counter>,
    shutdown: CancellationToken,
) {
    let count = |reason| {
        reloads.get_or_create(&ReasonLabels { reason }).inc();
    };
    // The last content that failed, so that a bad version is reported once.
    let mut failed: Option<Contents> = None;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        let (files2, seen2, failed2) = (files.clone(), seen.clone(), failed.clone());
        let read = tokio::task::spawn_blocking(move || {
            settled_change(&files2, |c| *c == seen2 || failed2.as_ref() == Some(c))
        })
        .await;
        let contents = match read {
            Ok(Ok(Some(c))) => c,
            Ok(Ok(None)) => continue,
            Ok(Err(e)) => {
                // A file mid-swap; it is read again next time.
                tracing::debug!("TLS files: {e}");
                continue;
            }
            Err(_) => continue,
        };
        match files.build(&contents) {
            Ok(config) => {
                tx.send_replace(Arc::new(config));
                seen = contents;
                failed = None;
                count("ok");
                tracing::info!("{} reloaded", files.describe());
            }
            Err(e) => {
                failed = Some(contents);
                count("error");
                tracing::error!(
                    "{} reload failed, keeping the one in force: {e}",
                    files.describe()
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use shardgate_harness::tls::{CertPair, TestPki};

    use super::*;

    type Swap = Box<dyn FnOnce() + Send>;

    /// The TLS port's files, with `between` run once after the certificate is read and
    /// before the key: a Secret swapped under the reader, which a poll meets by chance,
    /// made certain. The files, the swap and the build are the real ones.
    #[derive(Clone)]
    struct SwappedMidRead {
        files: CertFiles,
        between: Arc<Mutex<Option<Swap>>>,
    }

    impl Reloadable for SwappedMidRead {
        type Built = ServerConfig;

        fn read(&self) -> Result<Contents, CertError> {
            let cert = read(&self.files.cert)?;
            let swap = self.between.lock().ok().and_then(|mut s| s.take());
            if let Some(swap) = swap {
                swap();
            }
            Ok(Contents(vec![cert, read(&self.files.key)?]))
        }

        fn build(&self, contents: &Contents) -> Result<ServerConfig, CertError> {
            self.files.build(contents)
        }

        fn describe(&self) -> String {
            self.files.describe()
        }
    }

    fn count(reloads: &Family<ReasonLabels, Counter>, reason: &'static str) -> u64 {
        reloads.get_or_create(&ReasonLabels { reason }).get()
    }

    #[tokio::test]
    async fn a_swap_between_the_files_is_not_a_failed_reload() -> anyhow::Result<()> {
        let pki = TestPki::new("example.test")?;
        let old = pki.wildcard("old")?;
        let new = pki.wildcard("new")?;
        let files = CertFiles {
            cert: old.cert.clone(),
            key: old.key.clone(),
            client_ca: None,
        };
        let (config, seen) = files.load()?;
        let (tx, mut rx) = watch::channel(Arc::new(config));
        let (target, source): (CertPair, CertPair) = (old.clone(), new);
        let reloadable = SwappedMidRead {
            files,
            between: Arc::new(Mutex::new(Some(Box::new(move || {
                target.replace_with(&source).expect("rotate the files");
            })))),
        };
        let reloads = Family::<ReasonLabels, Counter>::default();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(reload(
            reloadable.clone(),
            seen,
            tx,
            Duration::from_millis(10),
            reloads.clone(),
            shutdown.clone(),
        ));
        tokio::time::timeout(Duration::from_secs(30), rx.changed()).await??;
        shutdown.cancel();
        task.await?;
        // The swap ran, so the first read was the mix of the old certificate and the new
        // key; the new pair was published, and nothing was reported as failed.
        assert!(reloadable.between.lock().is_ok_and(|s| s.is_none()));
        assert_eq!((count(&reloads, "ok"), count(&reloads, "error")), (1, 0));
        Ok(())
    }
}
