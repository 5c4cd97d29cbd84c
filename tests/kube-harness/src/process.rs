//! Child processes of the harness: the control plane's daemons and the pods' containers.
//!
//! Everything lives under one `<tmp>/shardgate-harness-<pid>-k<n>/` directory (the marker the
//! Valkey harness uses), and every process either has that path on its command line or runs
//! in it, so a process whose test is gone can be told from a live one and reaped by the next
//! run, and `scripts/test` can tell that none is left over.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

pub(crate) use shardgate_harness::procs::{new_root_dir, reap_strays_once};

/// A child process with its output in a log file; killed on drop.
pub struct Daemon {
    name: String,
    pid: u32,
    /// Behind a lock so that a shared daemon can be checked (`try_wait` needs `&mut`).
    child: Mutex<Child>,
    log: PathBuf,
}

impl Daemon {
    /// Starts `cmd` with stdout and stderr appended to `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: &Path) -> Result<Daemon> {
        let out = open_log(log)?;
        let err = out.try_clone().context("dup log file")?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {name} ({:?})", cmd.get_program()))?;
        Ok(Daemon {
            name: name.to_string(),
            pid: child.id(),
            child: Mutex::new(child),
            log: log.to_path_buf(),
        })
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    fn child(&self) -> std::sync::MutexGuard<'_, Child> {
        // A panic while holding this lock leaves the child as it was: still usable.
        self.child.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last `n` lines of the log, for error messages.
    pub fn log_tail(&self, n: usize) -> String {
        log_tail(&self.log, n)
    }

    /// An error if the process has exited, with the tail of its log.
    pub fn check_running(&self) -> Result<()> {
        let exited = self.child().try_wait().context("try_wait")?;
        if let Some(status) = exited {
            bail!(
                "{} exited ({status}); last lines of {}:\n{}",
                self.name,
                self.log.display(),
                self.log_tail(30)
            );
        }
        Ok(())
    }

    /// `Some(exit code)` (or -signal) once the process has exited.
    pub fn exited(&self) -> Option<i32> {
        use std::os::unix::process::ExitStatusExt;
        let status = self.child().try_wait();
        match status {
            Ok(Some(status)) => Some(
                status
                    .code()
                    .unwrap_or_else(|| 128 + status.signal().unwrap_or(0)),
            ),
            Ok(None) => None,
            Err(_) => Some(-1),
        }
    }

    /// SIGTERM, then SIGKILL after `grace`.
    pub fn stop(&self, grace: Duration) {
        if self.exited().is_some() {
            return;
        }
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if self.exited().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
    }

    /// SIGKILL, and reap.
    pub fn kill(&self) {
        let mut child = self.child();
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

pub(crate) fn open_log(path: &Path) -> Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))
}

pub(crate) fn log_tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
