//! The TLS workloads' certificate and client: one test CA, a `*.example.test` certificate that
//! every terminating data plane presents, and the SNI name that shardgate's TLS port routes
//! to the standalone Valkey (shard 0, node 0).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use rustls::{ClientConfig, ClientConnection, StreamOwned};
use rustls_pki_types::ServerName;
use shardgate_crds::node_hostname;
use shardgate_crds::ports::NodeRef;
use shardgate_harness::tls::TestPki;

/// shardgate's SNI names: `<prefix>-<shard>-<node>.<domain>`.
pub const SNI_PREFIX: &str = "vc";
pub const SNI_DOMAIN: &str = "example.test";

/// What a terminating data plane serves and what its clients trust.
pub struct TlsFiles {
    /// Kept alive: dropping it deletes the files.
    pki: TestPki,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The certificate and its key in one file, as HAProxy's `crt` takes them.
    pub pem: PathBuf,
    /// The name every client sends: shard 0, node 0.
    pub sni: String,
    client: Arc<ClientConfig>,
}

impl TlsFiles {
    pub fn new() -> Result<TlsFiles> {
        let pki = TestPki::new(SNI_DOMAIN)?;
        let pair = pki.wildcard("load")?;
        let pem = pki.dir().join("load.pem");
        std::fs::write(&pem, format!("{}{}", pair.cert_pem, pair.key_pem))
            .with_context(|| format!("writing {}", pem.display()))?;
        let client = pki.client_config(None);
        Ok(TlsFiles {
            cert: pair.cert,
            key: pair.key,
            pem,
            sni: node_hostname(SNI_PREFIX, NodeRef::new(0, 0), SNI_DOMAIN),
            client,
            pki,
        })
    }

    /// The CA certificate that clients trust (redis-benchmark's `--cacert`).
    pub fn ca(&self) -> &PathBuf {
        &self.pki.ca
    }

    /// A TLS connection to `addr` with the SNI name, handshake done, blocking.
    pub fn connect(&self, addr: SocketAddr) -> Result<StreamOwned<ClientConnection, TcpStream>> {
        let name = ServerName::try_from(self.sni.clone()).context("the SNI name")?;
        let conn = ClientConnection::new(self.client.clone(), name).context("a TLS client")?;
        let tcp = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
        tcp.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut tls = StreamOwned::new(conn, tcp);
        while tls.conn.is_handshaking() {
            tls.conn
                .complete_io(&mut tls.sock)
                .with_context(|| format!("TLS handshake with {addr}"))?;
        }
        Ok(tls)
    }
}

/// PING → +PONG over `s`.
pub fn ping(s: &mut (impl Read + Write)) -> Result<()> {
    s.write_all(b"PING\r\n")?;
    s.flush()?;
    let mut buf = [0u8; 7];
    s.read_exact(&mut buf)?;
    anyhow::ensure!(
        &buf == b"+PONG\r\n",
        "unexpected answer to PING: {:?}",
        String::from_utf8_lossy(&buf)
    );
    Ok(())
}
