//! The harness's processes and directories, and reaping what a killed test left behind.
//!
//! Every harness directory (a Valkey cluster's, the control plane's, a standalone server's)
//! is `<tmp>/shardgate-harness-<pid>-<tag><n>/`, where `<pid>` is the test process, and every
//! process the harness starts has such a path on its command line or runs inside one
//! (Valkey nodes run with `set-proc-title no` so that their command line keeps it). So a
//! process whose test process is gone can be told from a live one: the first start of a
//! harness in each process kills such strays and removes their directories, and
//! `scripts/test` checks that none is left after the suite.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Once;

use anyhow::{Context, Result};

/// The prefix of every harness directory name.
pub const MARKER: &str = "shardgate-harness-";

static NEXT_ROOT: AtomicU32 = AtomicU32::new(0);
static REAP: Once = Once::new();

/// Makes a fresh `<tmp>/shardgate-harness-<our pid>-<tag><n>` directory.
pub fn new_root_dir(tag: &str) -> Result<PathBuf> {
    loop {
        let n = NEXT_ROOT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("{MARKER}{}-{tag}{n}", std::process::id()));
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            // Leftovers of an earlier process with our pid are not ours to reuse.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("creating {}", dir.display())),
        }
    }
}

/// Once per process: kills strays and removes the directories of dead test processes.
pub fn reap_strays_once() {
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
    processes()
        .into_iter()
        .filter(|(pid, cmdline)| {
            let cwd = std::fs::read_link(format!("/proc/{pid}/cwd"))
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default();
            [cmdline.as_str(), cwd.as_str()]
                .iter()
                .filter_map(|s| owner_pid(s))
                .any(|owner| owner != std::process::id() && !alive(owner))
        })
        .map(|(pid, _)| pid)
        .collect()
}

/// Processes whose command line mentions `needle` (e.g. a cluster's root directory).
pub fn processes_mentioning(needle: &str) -> Vec<u32> {
    processes()
        .into_iter()
        .filter(|(_, cmdline)| cmdline.contains(needle))
        .map(|(pid, _)| pid)
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

/// Every other process we can read, with its command line (arguments joined by spaces).
fn processes() -> Vec<(u32, String)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let me = std::process::id();
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter_map(|pid| {
            // Processes can vanish between listing and reading; skip those.
            let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ");
            (!cmdline.trim().is_empty()).then_some((pid, cmdline))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_is_parsed_from_a_harness_path() {
        assert_eq!(
            owner_pid("/x/valkey-server --dir /tmp/shardgate-harness-4242-3/0-1"),
            Some(4242)
        );
        assert_eq!(owner_pid("/tmp/shardgate-harness-77-k0/pods/x"), Some(77));
        assert_eq!(owner_pid("--dir /tmp/other"), None);
    }
}
