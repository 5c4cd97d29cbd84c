//! Runs the `shardgate-proxy` binary as a child process: for tests of the command line,
//! signals and reloads, and for the demo. Killed on drop.

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// A running `shardgate-proxy`.
pub struct ProxyProcess {
    child: Child,
    log: PathBuf,
    _dir: TempDir,
    pub admin: Option<SocketAddr>,
}

/// A directory removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The name of the proxy's binary (and of its image: see `shardgate-kube-harness`).
pub const PROXY_PROGRAM: &str = "shardgate-proxy";

/// The proxy binary: `$SHARDGATE_PROXY_BIN`, else `shardgate-proxy` beside the running
/// executable or in its parent (cargo puts test binaries in `target/<profile>/deps`).
pub fn proxy_binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("SHARDGATE_PROXY_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().context("current_exe")?;
    for dir in exe.ancestors().skip(1).take(2) {
        let candidate = dir.join(PROXY_PROGRAM);
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    bail!(
        "shardgate-proxy binary not found next to {}; build it (cargo build -p shardgate-proxy) \
         or set SHARDGATE_PROXY_BIN",
        exe.display()
    )
}

impl ProxyProcess {
    /// Starts `bin` with `args`; stderr and stdout go to a log file.
    pub fn spawn(bin: &Path, args: &[String], admin: Option<SocketAddr>) -> Result<Self> {
        Self::spawn_with_env(bin, args, &[], admin)
    }

    /// As [`ProxyProcess::spawn`], with `env` set for the child (e.g. its `KUBECONFIG`).
    pub fn spawn_with_env(
        bin: &Path,
        args: &[String],
        env: &[(&str, &std::ffi::OsStr)],
        admin: Option<SocketAddr>,
    ) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!(
            "shardgate-proxy-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default()
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        let log = dir.join("proxy.log");
        let out = File::create(&log)?;
        let child = Command::new(bin)
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("spawn {}", bin.display()))?;
        Ok(ProxyProcess {
            child,
            log,
            _dir: TempDir(dir),
            admin,
        })
    }

    /// Everything the proxy logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until `log()` contains `needle`.
    pub fn wait_log(&self, needle: &str, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while !self.log().contains(needle) {
            if Instant::now() > deadline {
                bail!("proxy never logged {needle:?}; log:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Waits until `/readyz` answers 200.
    pub fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let admin = self.admin.context("proxy has no admin address")?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok((200, _)) = crate::http::get(admin, "/readyz") {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("proxy not ready after {timeout:?}; log:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends a signal by name (`TERM`, `INT`, ...).
    pub fn signal(&self, name: &str) -> Result<()> {
        let ok = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.pid().to_string())
            .status()?
            .success();
        if !ok {
            bail!("kill -{name} {} failed", self.pid());
        }
        Ok(())
    }

    /// Waits for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                bail!(
                    "proxy still running after {timeout:?}; log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether it still runs.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
