//! Instructions per reply, counted by callgrind: the figure that settles a comparison when
//! criterion's timings swing between runs on a shared machine (for CLUSTER NODES they swung
//! from 0.68× to 1.63× between runs of the same code). A count leaves out cache misses and how
//! many instructions a cycle retires, so it stands beside the timings, not in their place.
//!
//! `SHARDGATE_REWRITE_COUNT=<cases> cargo bench -p shardgate-benches --bench rewrite` (the
//! cases a comma-separated list of groups, such as `cluster_nodes_resp2`, or of
//! `<group>/<param>`, such as `cluster_nodes_resp2/300`; empty for every case)
//! runs this binary again once per case and contender under `valgrind --tool=callgrind`,
//! collecting only inside [`measured`] (the untimed setup of the criterion run stays out),
//! and prints a markdown table: instructions per reply, and each baseline's count over
//! shardgate's (above 1: shardgate does less work). `request_side/stream` counts the other
//! direction, per command, beside a bare memchr count of its lines.
use std::env;
use std::fs;
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use bytes::BytesMut;

use super::{
    check, observed, redis_protocol, shardgate, Case, Frames, Topology, SHARDS, TOPOLOGY_GROUPS,
};

/// Set to run the counts (its value is the filter).
const FILTER: &str = "SHARDGATE_REWRITE_COUNT";
/// Set by the parent in each child: `<group>/<param>/<contender>`.
const ONE: &str = "SHARDGATE_REWRITE_COUNT_ONE";
/// Passes over the case inside [`measured`], after one outside it that warms the buffers.
const ITERATIONS: u64 = 3;
/// What callgrind collects in: the function below, whatever its monomorphised name.
const TOGGLE: &str = "--toggle-collect=*count::measured*";
const CONTENDERS: [&str; 3] = ["shardgate", "redis_protocol_owned", "redis_protocol_bytes"];
/// The request side's case, and its contenders: shardgate's observer, and memchr's count of
/// the lines as the floor.
const REQUESTS: &str = "request_side/stream";
const REQUEST_CONTENDERS: [&str; 2] = ["shardgate_observe", "memchr_lf_count"];

/// Runs the counts if the environment asks for them; false if it does not (criterion runs).
pub fn from_env() -> Result<bool> {
    if let Ok(spec) = env::var(ONE) {
        one(&spec)?;
        return Ok(true);
    }
    match env::var(FILTER) {
        Ok(filter) => all(&filter).map(|()| true),
        Err(_) => Ok(false),
    }
}

/// The cases of the criterion run, as `<group>/<param>`.
fn names() -> Vec<String> {
    let mut names = vec![
        "plain_get_set/stream".to_string(),
        "moved_storm/stream".to_string(),
        REQUESTS.to_string(),
    ];
    for (group, _, _) in TOPOLOGY_GROUPS {
        names.extend(SHARDS.iter().map(|n| format!("{group}/{n}")));
    }
    names
}

fn case(name: &str) -> Result<(Topology, Case)> {
    let (group, param) = name
        .split_once('/')
        .with_context(|| format!("{name}: not <group>/<param>"))?;
    if let Some(&(_, kind, resp3)) = TOPOLOGY_GROUPS.iter().find(|(g, _, _)| *g == group) {
        let shards = param
            .parse()
            .with_context(|| format!("{name}: {param} is not a shard count"))?;
        let topology = Topology::new(shards);
        let case = Case::topology(kind, resp3, &topology);
        return Ok((topology, case));
    }
    let topology = Topology::new(30);
    let case = match group {
        // The request side is the other direction of the plain stream's connection.
        "plain_get_set" | "request_side" => Case::plain(&topology),
        "moved_storm" => Case::moved(&topology),
        _ => bail!("{name}: no such case"),
    };
    Ok((topology, case))
}

/// The child: one contender on one case, [`ITERATIONS`] times inside [`measured`]. Prints
/// the number of replies (or commands) a pass takes, which the parent divides by.
fn one(spec: &str) -> Result<()> {
    let (name, contender) = spec
        .rsplit_once('/')
        .with_context(|| format!("{spec}: not <group>/<param>/<contender>"))?;
    let (topology, case) = case(name)?;
    // The same check as before criterion times anything: every contender's output is right.
    check(name, &case, &topology);
    let mut sent = 0;
    match contender {
        "shardgate" => {
            let (mut segments, mut out) = (Vec::new(), Vec::new());
            let mut pass =
                |conn| shardgate(&case, conn, &mut segments, &mut out, |o| sent += o.len());
            pass(observed(&case));
            // The request side's observations are criterion's untimed setup: made out here.
            let conns: Vec<_> = (0..ITERATIONS).map(|_| observed(&case)).collect();
            measured(|| {
                conns
                    .into_iter()
                    .for_each(|conn| drop(black_box(pass(conn))))
            });
        }
        "redis_protocol_owned" | "redis_protocol_bytes" => {
            let frames = if contender.ends_with("owned") {
                Frames::Owned
            } else {
                Frames::Bytes
            };
            let mut buf = BytesMut::new();
            let mut pass = || redis_protocol(&case, frames, &mut buf, |o| sent += o.len());
            pass();
            measured(|| (0..ITERATIONS).for_each(|_| pass()));
        }
        "shardgate_observe" => {
            drop(observed(&case));
            measured(|| (0..ITERATIONS).for_each(|_| drop(black_box(observed(&case)))));
        }
        "memchr_lf_count" => {
            let mut pass = || sent += memchr::memchr_iter(b'\n', black_box(&case.requests)).count();
            pass();
            measured(|| (0..ITERATIONS).for_each(|_| pass()));
        }
        _ => bail!("{spec}: no contender {contender}"),
    }
    black_box(sent);
    println!("replies={}", case.count);
    Ok(())
}

/// Where callgrind collects: nothing outside it is counted.
#[inline(never)]
fn measured<R>(f: impl FnOnce() -> R) -> R {
    black_box(f())
}

/// The parent: every case matching `filter`, each contender in a callgrind child of its own.
fn all(filter: &str) -> Result<()> {
    let names = selected(filter)?;
    let exe = env::current_exe().context("the path of this benchmark binary")?;
    let dir = TempDir::new()?;
    println!("callgrind, {ITERATIONS} passes after one to warm up\n");
    if cfg!(debug_assertions) {
        // `cargo test` builds it so, to check that the counts run: they say nothing of speed.
        println!(
            "(an unoptimised build: run it with `cargo bench` for counts that mean something)\n"
        );
    }
    let (requests, replies): (Vec<&String>, Vec<&String>) =
        names.iter().partition(|n| n.as_str() == REQUESTS);
    if !replies.is_empty() {
        println!("instructions per reply\n");
        println!("| case | shardgate | redis_protocol_owned | redis_protocol_bytes | owned ÷ shardgate | bytes ÷ shardgate |");
        println!("|---|---|---|---|---|---|");
    }
    for name in replies {
        let [ours, owned, bytes] = counts(&exe, &dir.0, name, &CONTENDERS)?;
        println!(
            "| {name} | {ours:.0} | {owned:.0} | {bytes:.0} | {:.2}× | {:.2}× |",
            owned / ours,
            bytes / ours
        );
    }
    if !requests.is_empty() {
        println!("\ninstructions per command, the request side (which `shardgate` above observes untimed)\n");
        println!("| case | shardgate_observe | memchr_lf_count | shardgate ÷ memchr |");
        println!("|---|---|---|---|");
    }
    for name in requests {
        let [ours, memchr] = counts(&exe, &dir.0, name, &REQUEST_CONTENDERS)?;
        println!(
            "| {name} | {ours:.0} | {memchr:.0} | {:.2}× |",
            ours / memchr
        );
    }
    Ok(())
}

/// Each contender's instructions per reply (per command on the request side) on case
/// `name`, in order.
fn counts<const N: usize>(
    exe: &Path,
    dir: &Path,
    name: &str,
    contenders: &[&str; N],
) -> Result<[f64; N]> {
    let mut out = [0.0; N];
    for (count_of, contender) in out.iter_mut().zip(contenders) {
        *count_of = count(exe, dir, &format!("{name}/{contender}"))?;
    }
    Ok(out)
}

/// The cases `filter` names: all if it is empty, else each of its comma-separated items a
/// group or a `<group>/<param>`; an item that names nothing is an error, not ignored.
fn selected(filter: &str) -> Result<Vec<String>> {
    let all = names();
    if filter.is_empty() {
        return Ok(all);
    }
    let items: Vec<&str> = filter.split(',').collect();
    let named = |n: &str, item: &str| n == item || n.split('/').next() == Some(item);
    if let Some(item) = items.iter().find(|i| !all.iter().any(|n| named(n, i))) {
        bail!("{FILTER}: {item:?} names no case; the cases are {all:?}");
    }
    Ok(all
        .into_iter()
        .filter(|n| items.iter().any(|i| named(n, i)))
        .collect())
}

/// The callgrind profiles' directory, removed however the run ends.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Result<TempDir> {
        let dir = env::temp_dir().join(format!("shardgate-rewrite-count-{}", std::process::id()));
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(TempDir(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir_all(&self.0) {
            eprintln!("removing {}: {e}", self.0.display());
        }
    }
}

/// One child's instructions per reply (or per command).
fn count(exe: &Path, dir: &Path, spec: &str) -> Result<f64> {
    let file = dir.join(spec.replace('/', "-"));
    let output = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(TOGGLE)
        .arg(format!("--callgrind-out-file={}", file.display()))
        .arg(exe)
        .env(ONE, spec)
        .env_remove(FILTER)
        .output()
        .context("running valgrind (scripts/setup installs it; Debian's package `valgrind`)")?;
    if !output.status.success() {
        bail!(
            "{spec}: the callgrind run failed ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let replies: u64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("replies="))
        .with_context(|| format!("{spec}: the child printed no reply count:\n{stdout}"))?
        .parse()
        .with_context(|| format!("{spec}: the child's reply count"))?;
    let profile =
        fs::read_to_string(&file).with_context(|| format!("{spec}: reading {}", file.display()))?;
    let total: u64 = profile
        .lines()
        .find_map(|l| {
            l.strip_prefix("totals:")
                .or_else(|| l.strip_prefix("summary:"))
        })
        .with_context(|| format!("{spec}: no totals in {}", file.display()))?
        .trim()
        .parse()
        .with_context(|| format!("{spec}: the totals line of {}", file.display()))?;
    if total == 0 || replies == 0 {
        bail!("{spec}: callgrind counted {total} instructions over {replies} replies inside `measured` ({TOGGLE} matched nothing?)");
    }
    Ok(total as f64 / (ITERATIONS * replies) as f64)
}
