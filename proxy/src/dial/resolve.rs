//! Backends by name: resolved with hickory-resolver at connect time (its cache honours
//! the records' TTLs), then connected to.

use std::net::SocketAddr;
use std::time::Duration;

use hickory_resolver::config::ResolverConfig;
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::TokioResolver;
use tokio::net::TcpStream;

use super::DialError;
use crate::model::{Backend, Host};

/// Resolves backend names. Cheap to clone.
#[derive(Clone)]
pub struct Resolver {
    inner: TokioResolver,
}

impl Resolver {
    /// The system's configuration (`/etc/resolv.conf`, `/etc/hosts`). Without a readable
    /// resolv.conf it resolves from the hosts file only, rather than falling back to public
    /// name servers.
    pub fn system() -> Self {
        let builder = match TokioResolver::builder_tokio() {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!("no system DNS configuration ({e}); resolving from /etc/hosts only");
                TokioResolver::builder_with_config(
                    ResolverConfig::from_parts(None, vec![], vec![]),
                    TokioRuntimeProvider::default(),
                )
            }
        };
        let inner = match builder.build() {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("DNS resolver set-up failed ({e}); resolving from /etc/hosts only");
                #[allow(clippy::expect_used)]
                TokioResolver::builder_with_config(
                    ResolverConfig::from_parts(None, vec![], vec![]),
                    TokioRuntimeProvider::default(),
                )
                .build()
                .expect("a resolver without name servers always builds")
            }
        };
        Resolver { inner }
    }

    /// The backend's socket addresses: the IP itself, or the name's current records.
    pub async fn resolve(&self, backend: &Backend) -> Result<Vec<SocketAddr>, DialError> {
        match &backend.host {
            Host::Ip(ip) => Ok(vec![SocketAddr::new(*ip, backend.port)]),
            Host::Dns(name) => {
                // Boxed: the lookup's future is over a kilobyte, and every connection's
                // future would be sized for it (a dial to an IP address needs none).
                let lookup = Box::pin(self.inner.lookup_ip(name.as_str()))
                    .await
                    .map_err(|e| DialError::Resolve {
                        name: name.clone(),
                        message: e.to_string(),
                    })?;
                let addrs: Vec<SocketAddr> = lookup
                    .iter()
                    .map(|ip| SocketAddr::new(ip, backend.port))
                    .collect();
                if addrs.is_empty() {
                    return Err(DialError::NoAddress { name: name.clone() });
                }
                Ok(addrs)
            }
        }
    }

    /// Connects to the backend, trying each of its addresses in turn, within `timeout` in all.
    pub async fn dial(&self, backend: &Backend, timeout: Duration) -> Result<TcpStream, DialError> {
        let attempt = async {
            let addrs = self.resolve(backend).await?;
            let mut last = None;
            for addr in addrs {
                match super::connect(addr).await {
                    Ok(s) => return Ok(s),
                    Err(source) => last = Some(DialError::Connect { addr, source }),
                }
            }
            Err(last.unwrap_or_else(|| DialError::NoAddress {
                name: backend.to_string(),
            }))
        };
        tokio::time::timeout(timeout, attempt)
            .await
            .unwrap_or_else(|_| {
                Err(DialError::Timeout {
                    backend: backend.to_string(),
                    after: timeout,
                })
            })
    }
}
