//! TLS-speaking nodes for the TLS port's passthrough tests: one `stunnel` process (Debian's
//! stunnel4) that terminates TLS on a loopback port per node and forwards to the node's plain
//! port, so that the cluster's own ports and bus stay plain (the tests were written when the
//! tests' valkey-server had no TLS; the operator's `spec.tls` tests use Valkey's). Killed on
//! drop.

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// A running stunnel with one service per `(accept, connect)` pair.
pub struct Stunnel {
    child: Child,
    dir: PathBuf,
    pub services: Vec<(SocketAddr, SocketAddr)>,
}

impl Stunnel {
    /// Starts stunnel serving `cert`/`key` on each `accept` address, forwarding to its
    /// `connect` address; waits until every accept port answers.
    pub fn start(cert: &Path, key: &Path, services: &[(SocketAddr, SocketAddr)]) -> Result<Self> {
        let bin = crate::tools::stunnel()?;
        let dir = crate::tls::unique_dir("shardgate-stunnel");
        std::fs::create_dir_all(&dir)?;
        let mut conf = format!(
            "foreground = yes\npid =\ndebug = 4\noutput = {}\n",
            dir.join("stunnel.log").display()
        );
        for (i, (accept, connect)) in services.iter().enumerate() {
            conf.push_str(&format!(
                "[node{i}]\naccept = {accept}\nconnect = {connect}\ncert = {}\nkey = {}\n",
                cert.display(),
                key.display()
            ));
        }
        let path = dir.join("stunnel.conf");
        std::fs::write(&path, conf)?;
        let child = Command::new(&bin)
            .arg(&path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("spawn {}", bin.display()))?;
        let mut s = Stunnel {
            child,
            dir,
            services: services.to_vec(),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        for (accept, _) in services {
            while TcpStream::connect_timeout(accept, Duration::from_millis(200)).is_err() {
                if let Ok(Some(status)) = s.child.try_wait() {
                    bail!("stunnel exited ({status}); log:\n{}", s.log());
                }
                if Instant::now() > deadline {
                    bail!("stunnel not listening on {accept}; log:\n{}", s.log());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(s)
    }

    /// What stunnel logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("stunnel.log")).unwrap_or_default()
    }
}

impl Drop for Stunnel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
