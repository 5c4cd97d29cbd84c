//! What a data plane costs, read from `/proc`: CPU time (utime + stime) and resident memory
//! of a process and its children (nginx's master and workers), so that every peer is
//! measured the same way, as a separate process.

use std::fs;

/// USER_HZ: the unit of utime and stime in `/proc/<pid>/stat` on Linux.
const TICKS_PER_SECOND: f64 = 100.0;

/// A process and, at each reading, its live children.
#[derive(Clone, Copy, Debug)]
pub struct ProcTree {
    pub root: u32,
}

impl ProcTree {
    /// The root and its direct children (nginx workers are children of the master).
    fn pids(&self) -> Vec<u32> {
        let mut pids = vec![self.root];
        let Ok(entries) = fs::read_dir("/proc") else {
            return pids;
        };
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            if stat_fields(pid).and_then(|f| f.get(1).and_then(|v| v.parse::<u32>().ok()))
                == Some(self.root)
            {
                pids.push(pid);
            }
        }
        pids
    }

    /// CPU seconds (user + system) used so far by the tree's live processes: the sum of
    /// their threads' on-CPU time in `/proc/<pid>/task/<tid>/schedstat` (nanoseconds; the
    /// quantity utime + stime count in 10 ms ticks), else utime + stime of `/proc/<pid>/stat`.
    pub fn cpu_seconds(&self) -> f64 {
        self.pids()
            .into_iter()
            .map(|pid| schedstat_seconds(pid).unwrap_or_else(|| stat_seconds(pid)))
            .sum()
    }

    /// Resident set size of the tree's live processes, in bytes (`VmRSS`).
    pub fn rss_bytes(&self) -> u64 {
        self.pids()
            .into_iter()
            .filter_map(|pid| fs::read_to_string(format!("/proc/{pid}/status")).ok())
            .filter_map(|status| {
                let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
                let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
                Some(kib * 1024)
            })
            .sum()
    }
}

/// On-CPU time of all of `pid`'s threads, if the kernel keeps schedstat.
fn schedstat_seconds(pid: u32) -> Option<f64> {
    let tasks = fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut ns = 0u64;
    for task in tasks.flatten() {
        // A thread may end between the listing and the read: it then counts for nothing.
        let Ok(text) = fs::read_to_string(task.path().join("schedstat")) else {
            continue;
        };
        ns += text.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(ns as f64 / 1e9)
}

/// utime + stime of `pid` (all its threads), in seconds.
fn stat_seconds(pid: u32) -> f64 {
    stat_fields(pid).map_or(0.0, |f| {
        // After "(comm)": state(0) ppid(1) ... utime(11) stime(12).
        let utime: u64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0);
        let stime: u64 = f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
        (utime + stime) as f64 / TICKS_PER_SECOND
    })
}

/// The fields of `/proc/<pid>/stat` after the command name, which may hold spaces.
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let close = stat.rfind(')')?;
    Some(
        stat.get(close + 2..)?
            .split(' ')
            .map(str::to_string)
            .collect(),
    )
}
