//! The I/O shell around [`sni::parse`](super::sni::parse): reads a client's first bytes,
//! under a timeout and a byte cap, until they are a whole ClientHello, and hands the bytes
//! read on so that they can be replayed ([`PrefixedIo`](super::PrefixedIo)) or forwarded.

use std::fmt;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt};

use super::sni::{self, NotTls, Parsed, ServerName};

/// How much is read to find the SNI name, and for how long.
#[derive(Debug, Clone, Copy)]
pub struct DetectLimits {
    /// A client that has not sent a whole ClientHello after this long is closed.
    pub timeout: Duration,
    /// A ClientHello (all its records) larger than this is refused.
    pub max_bytes: usize,
}

impl Default for DetectLimits {
    fn default() -> Self {
        use shardgate_crds::settings::defaults;
        DetectLimits {
            timeout: defaults::TLS_HELLO_TIMEOUT,
            max_bytes: defaults::TLS_MAX_HELLO,
        }
    }
}

/// A ClientHello was read.
#[derive(Debug)]
pub struct Detected {
    /// Its server name, if it sent one.
    pub sni: Option<ServerName>,
    /// Every byte read from the client so far (the hello and anything after it).
    pub prefix: BytesMut,
}

/// Why no ClientHello was read. The `Display` text is the metric label.
#[derive(Debug, thiserror::Error)]
pub enum DetectError {
    #[error("no whole ClientHello in time")]
    Timeout,
    #[error("ClientHello too large")]
    TooLarge,
    #[error("{0}")]
    NotTls(NotTls),
    #[error("the client closed before a whole ClientHello")]
    Closed,
    #[error("read: {0}")]
    Io(#[source] std::io::Error),
}

impl DetectError {
    /// A metric label (`tls_refused_total{reason}`).
    pub fn label(&self) -> &'static str {
        match self {
            DetectError::NotTls(n) => n.label(),
            DetectError::Timeout => "timeout",
            DetectError::TooLarge => "too_large",
            DetectError::Closed => "closed",
            DetectError::Io(_) => "io",
        }
    }

    /// What happened, for logs.
    pub fn detail(&self, limits: &DetectLimits) -> String {
        match self {
            DetectError::Timeout => format!("no whole ClientHello within {:?}", limits.timeout),
            DetectError::TooLarge => {
                format!("ClientHello larger than {} bytes", limits.max_bytes)
            }
            DetectError::NotTls(e) => e.detail().to_string(),
            DetectError::Closed => "the client closed before a whole ClientHello".into(),
            DetectError::Io(e) => format!("read: {e}"),
        }
    }
}

/// Reads from `io` until its first bytes are a whole ClientHello. The bytes read are in
/// [`Detected::prefix`] (or lost, on error: the connection is refused anyway).
pub async fn detect<I>(io: &mut I, limits: DetectLimits) -> Result<Detected, DetectError>
where
    I: AsyncRead + Unpin,
{
    let mut buf = BytesMut::with_capacity(1024.min(limits.max_bytes.max(1)));
    let read = async {
        // What the headers already promise: parsing again before that much has arrived would
        // only repeat work (quadratic for a client that sends a byte at a time).
        let mut need = None;
        loop {
            let parsed = if need.is_some_and(|n| buf.len() < n) {
                Parsed::Incomplete { need }
            } else {
                sni::parse(&buf)
            };
            match parsed {
                Parsed::Hello { sni, .. } => return Ok(sni),
                Parsed::NotTls(e) => return Err(DetectError::NotTls(e)),
                Parsed::Incomplete { need: n } => {
                    need = n;
                    if buf.len() >= limits.max_bytes || need.is_some_and(|n| n > limits.max_bytes) {
                        return Err(DetectError::TooLarge);
                    }
                    // Never read past the cap.
                    let room = limits.max_bytes - buf.len();
                    if buf.capacity() == buf.len() {
                        buf.reserve(room.min(buf.len().max(1024)));
                    }
                    let mut limited = (&mut *io).take(room as u64);
                    let n = limited.read_buf(&mut buf).await.map_err(DetectError::Io)?;
                    if n == 0 {
                        return Err(DetectError::Closed);
                    }
                }
            }
        }
    };
    let sni = tokio::time::timeout(limits.timeout, read)
        .await
        .map_err(|_| DetectError::Timeout)??;
    Ok(Detected { sni, prefix: buf })
}

impl fmt::Display for Detected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.sni {
            Some(n) => write!(f, "ClientHello for {n}"),
            None => f.write_str("ClientHello without SNI"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::sni::testing::client_hello;
    use super::*;
    use tokio::io::AsyncWriteExt;

    fn limits() -> DetectLimits {
        DetectLimits {
            timeout: Duration::from_secs(5),
            max_bytes: 4096,
        }
    }

    #[tokio::test]
    async fn a_hello_dribbled_byte_by_byte() {
        let hello = client_hello(Some("vc-1-0.example.test"), 0);
        let (mut client, mut server) = tokio::io::duplex(64);
        let h = hello.clone();
        tokio::spawn(async move {
            for b in h {
                client.write_all(&[b]).await.unwrap();
                tokio::task::yield_now().await;
            }
            client.write_all(b"after").await.unwrap();
            // Keep the stream open.
            tokio::time::sleep(Duration::from_secs(5)).await;
        });
        let d = detect(&mut server, limits()).await.unwrap();
        assert_eq!(d.sni.as_deref(), Some("vc-1-0.example.test"));
        assert_eq!(&d.prefix[..hello.len()], &hello[..]);
    }

    #[tokio::test]
    async fn caps_and_closes() {
        let big = client_hello(Some("vc.example.test"), 8000);
        let (mut client, mut server) = tokio::io::duplex(1 << 16);
        client.write_all(&big).await.unwrap();
        let r = detect(&mut server, limits()).await;
        assert!(matches!(r, Err(DetectError::TooLarge)), "{r:?}");

        let small = client_hello(Some("vc.example.test"), 0);
        let (mut client, mut server) = tokio::io::duplex(1024);
        client.write_all(&small[..small.len() - 1]).await.unwrap();
        drop(client);
        assert!(matches!(
            detect(&mut server, limits()).await,
            Err(DetectError::Closed)
        ));
    }

    #[tokio::test]
    async fn a_silent_client_times_out() {
        let (mut client, mut server) = tokio::io::duplex(64);
        // Three bytes of a record header, then nothing.
        client.write_all(&[22, 3, 1]).await.unwrap();
        let short = DetectLimits {
            timeout: Duration::from_millis(50),
            ..limits()
        };
        assert!(matches!(
            detect(&mut server, short).await,
            Err(DetectError::Timeout)
        ));
    }
}
