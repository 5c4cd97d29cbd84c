//! Child processes of the harness: the control plane's daemons and the pods' containers.
//!
//! Everything lives under one `<tmp>/shardgate-harness-<pid>-k<n>/` directory (the marker the
//! Valkey harness uses), and every process either has that path on its command line or runs
//! in it, so a process whose test is gone can be told from a live one and reaped by the next
//! run, and `scripts/test` can tell that none is left over.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::valkey::MARKER;

static NEXT_ROOT: AtomicU32 = AtomicU32::new(0);
static REAP: Once = Once::new();

/// Makes a fresh `<tmp>/shardgate-harness-<our pid>-k<n>` directory.
pub(crate) fn new_root_dir() -> Result<PathBuf> {
    loop {
        let n = NEXT_ROOT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("{MARKER}{}-k{n}", std::process::id()));
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            // Leftovers of an earlier process with our pid are not ours to reuse.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("creating {}", dir.display())),
        }
    }
}

/// Once per process: kills every harness process (any program) whose test process is gone,
/// and removes the directories of dead test processes.
pub(crate) fn reap_strays_once() {
    REAP.call_once(|| {
        for pid in stray_processes() {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
            return;
        };
        for entry in entries.filter_map(|e| e.ok()) {
            let name = entry.file_name().to_string_lossy().into_owned();
            if owner_pid(&name).is_some_and(|owner| !alive(owner)) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    });
}

/// Processes started by a harness (marker on the command line or in the working directory)
/// whose test process no longer exists.
pub fn stray_processes() -> Vec<u32> {
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter(|&pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|raw| String::from_utf8_lossy(&raw).replace('\0', " "))
                .unwrap_or_default();
            let cwd = std::fs::read_link(format!("/proc/{pid}/cwd"))
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default();
            [cmdline, cwd]
                .iter()
                .filter_map(|s| owner_pid(s))
                .any(|owner| owner != me && !alive(owner))
        })
        .collect()
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// The test process named by the first marker in `s`.
fn owner_pid(s: &str) -> Option<u32> {
    let rest = &s[s.find(MARKER)? + MARKER.len()..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_is_parsed_from_paths() {
        assert_eq!(owner_pid("/tmp/shardgate-harness-4242-k3/etcd"), Some(4242));
        assert_eq!(owner_pid("/tmp/other"), None);
    }
}
