//! Finding and reaping `valkey-server` processes that outlived the test that started them.
//!
//! Every node's directory, which is on its command line (`--dir`), lives under
//! `<tmp>/shardgate-harness-<pid>-<n>/`, where `<pid>` is the test process. Nodes run with
//! `set-proc-title no` so that `/proc/<pid>/cmdline` keeps that marker. A node whose test
//! process is gone (killed by a timeout, say) is a stray: the first cluster start of every
//! process kills strays and removes their directories.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Once;

use anyhow::{Context, Result};

/// The prefix of every harness directory name.
pub const MARKER: &str = "shardgate-harness-";

static NEXT_ROOT: AtomicU32 = AtomicU32::new(0);
static REAP: Once = Once::new();

/// Makes a fresh `<tmp>/shardgate-harness-<our pid>-<n>` directory for one cluster.
pub(crate) fn new_root_dir() -> Result<PathBuf> {
    loop {
        let n = NEXT_ROOT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("{MARKER}{}-{n}", std::process::id()));
        // Leftovers of an earlier process with our pid are not ours to reuse.
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("creating {}", dir.display())),
        }
    }
}

/// Once per process: kills strays and removes the directories of dead test processes.
pub(crate) fn reap_strays_once() {
    REAP.call_once(|| {
        for pid in stray_processes() {
            let _ = std::process::Command::new("kill")
                .args(["-9", &pid.to_string()])
                .status();
        }
        remove_dead_dirs();
    });
}

/// `valkey-server` processes started by this harness whose test process no longer exists.
pub fn stray_processes() -> Vec<u32> {
    processes()
        .into_iter()
        .filter(|(_, argv)| is_valkey_server(argv))
        .filter(|(_, argv)| {
            owner_pid(argv).is_some_and(|owner| !Path::new(&format!("/proc/{owner}")).exists())
        })
        .map(|(pid, _)| pid)
        .collect()
}

/// Processes whose command line mentions `needle` (e.g. a cluster's root directory).
pub fn processes_mentioning(needle: &str) -> Vec<u32> {
    processes()
        .into_iter()
        .filter(|(_, argv)| argv.iter().any(|arg| arg.contains(needle)))
        .map(|(pid, _)| pid)
        .collect()
}

fn is_valkey_server(argv: &[String]) -> bool {
    argv.first()
        .is_some_and(|arg0| arg0.rsplit('/').next() == Some("valkey-server"))
}

/// The test process named by the first harness marker on a command line.
fn owner_pid(argv: &[String]) -> Option<u32> {
    argv.iter().find_map(|arg| {
        let rest = &arg[arg.find(MARKER)? + MARKER.len()..];
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().ok()
    })
}

/// Every process we can read, with its argument vector.
fn processes() -> Vec<(u32, Vec<String>)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let me = std::process::id();
    entries
        .filter_map(|entry| entry.ok())
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter_map(|pid| {
            // Processes can vanish between listing and reading; skip those.
            let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let argv = raw
                .split(|&b| b == 0)
                .filter(|arg| !arg.is_empty())
                .map(|arg| String::from_utf8_lossy(arg).into_owned())
                .collect::<Vec<_>>();
            (!argv.is_empty()).then_some((pid, argv))
        })
        .collect()
}

/// Removes `<tmp>/shardgate-harness-<pid>-<n>` directories whose process is gone.
fn remove_dead_dirs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.filter_map(|e| e.ok()) {
        let name = entry.file_name();
        let Some(owner) = name.to_str().and_then(|n| owner_pid(&[n.to_string()])) else {
            continue;
        };
        if !Path::new(&format!("/proc/{owner}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_is_parsed_from_the_dir_argument() {
        let argv: Vec<String> = [
            "/x/valkey-server",
            "--dir",
            "/tmp/shardgate-harness-4242-3/0-1",
        ]
        .map(String::from)
        .to_vec();
        assert!(is_valkey_server(&argv));
        assert_eq!(owner_pid(&argv), Some(4242));
        assert_eq!(owner_pid(&["--dir".into(), "/tmp/other".into()]), None);
        assert!(!is_valkey_server(&["valkey-cli".into()]));
    }
}
