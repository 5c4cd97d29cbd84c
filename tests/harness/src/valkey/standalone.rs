//! One standalone (non-cluster) `valkey-server` on 127.0.0.1, for tests that need a real
//! backend but no cluster: `localhost` names only that loopback address.

use std::net::{Ipv4Addr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::server::local_settings;
use crate::addr::free_port;
use crate::tools::valkey_server;

/// A running standalone server; killed and its directory removed on drop.
pub struct Standalone {
    child: Child,
    pub port: u16,
    pub dir: PathBuf,
}

impl Standalone {
    pub fn start() -> Result<Standalone> {
        Standalone::spawn(|port| vec!["--port".into(), port.to_string()])
    }

    /// A server that speaks only TLS on its port (`port 0`), with this certificate, key
    /// and CA (which client certificates must lead to: `tls-auth-clients yes`).
    pub fn start_tls(cert: &Path, key: &Path, ca: &Path) -> Result<Standalone> {
        Standalone::spawn(|port| {
            let mut args: Vec<String> = ["--port", "0", "--tls-port"].map(String::from).into();
            args.push(port.to_string());
            for (flag, path) in [
                ("--tls-cert-file", cert),
                ("--tls-key-file", key),
                ("--tls-ca-cert-file", ca),
            ] {
                args.extend([flag.to_string(), path.display().to_string()]);
            }
            args
        })
    }

    /// The server's process id (for its CPU time in `/proc/<pid>/stat`).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Starts a server on a free port of 127.0.0.1, with the arguments `port_args` makes
    /// of it.
    fn spawn(port_args: impl FnOnce(u16) -> Vec<String>) -> Result<Standalone> {
        crate::procs::reap_strays_once();
        let port = free_port(Ipv4Addr::LOCALHOST);
        // Under a harness directory, so that a stray is reaped like a cluster node.
        let dir = crate::procs::new_root_dir("")?;
        let child = Command::new(valkey_server()?)
            .args(port_args(port))
            .args(["--save", "", "--appendonly", "no"])
            .args(
                local_settings(Ipv4Addr::LOCALHOST)
                    .into_iter()
                    .flat_map(|(k, v)| [format!("--{k}"), v]),
            )
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("spawning a standalone valkey-server")?;
        let mut server = Standalone { child, port, dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_err() {
            if Instant::now() > deadline || !matches!(server.child.try_wait(), Ok(None)) {
                bail!("standalone valkey-server did not start on 127.0.0.1:{port}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(server)
    }
}

impl Drop for Standalone {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
