//! redis-benchmark (Debian's redis-tools) as the load: one test per run, so that the data
//! plane's CPU over the run belongs to that test alone.

use std::net::SocketAddr;
use std::process::Command;

use anyhow::{bail, Context, Result};

/// One redis-benchmark invocation.
#[derive(Clone, Debug)]
pub struct Run {
    /// `get` or `set`.
    pub test: &'static str,
    pub clients: u32,
    pub requests: u64,
    pub pipeline: u32,
    pub value_size: usize,
    /// `--cluster`: ask the entry node for the topology and spread keys over the shards.
    pub cluster: bool,
}

/// What redis-benchmark reported.
pub struct Report {
    pub rps: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

pub fn run(addr: SocketAddr, r: &Run) -> Result<Report> {
    let bin = shardgate_harness::tools::redis_benchmark()?;
    let mut cmd = Command::new(bin);
    cmd.args(["-h", &addr.ip().to_string(), "-p", &addr.port().to_string()])
        .args(["-c", &r.clients.to_string(), "-n", &r.requests.to_string()])
        .args([
            "-P",
            &r.pipeline.to_string(),
            "-d",
            &r.value_size.to_string(),
        ])
        .args(["-t", r.test, "--csv"]);
    if r.cluster {
        // Keys spread over every shard: the cluster mode needs a key space to hash.
        cmd.args(["--cluster", "-r", "100000"]);
    }
    let out = cmd.output().context("running redis-benchmark")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "redis-benchmark {r:?} against {addr} failed: {text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    parse_csv(&text).with_context(|| {
        format!(
            "redis-benchmark {r:?} against {addr}: no result in\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// The first data row of `--csv` output, by its header's column names.
fn parse_csv(text: &str) -> Result<Report> {
    let mut lines = text.lines().map(|l| {
        l.split(',')
            .map(|c| c.trim_matches('"'))
            .collect::<Vec<_>>()
    });
    let header = lines
        .find(|cols| cols.first() == Some(&"test"))
        .context("no header")?;
    let row = lines.next().context("no data row")?;
    let col = |name: &str| -> Result<f64> {
        let i = header
            .iter()
            .position(|h| *h == name)
            .with_context(|| format!("no column {name}"))?;
        let v = row
            .get(i)
            .with_context(|| format!("short row for {name}"))?;
        v.parse().with_context(|| format!("{name} = {v:?}"))
    };
    Ok(Report {
        rps: col("rps")?,
        p50_ms: col("p50_latency_ms")?,
        p99_ms: col("p99_latency_ms")?,
    })
}
