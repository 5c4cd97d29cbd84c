//! redis-benchmark (Debian's redis-tools) as the load: one test per run, so that the data
//! plane's CPU over the run belongs to that test alone.

use std::net::SocketAddr;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::tls::TlsFiles;

/// What redis-benchmark reported.
pub use shardgate_harness::tools::BenchmarkReport as Report;

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
    /// Over TLS (`--tls` with the SNI name and the CA): to the data plane's TLS listener.
    pub tls: bool,
}

/// `r` against `addr`; a TLS run trusts and names what `tls` holds.
pub fn run(addr: SocketAddr, r: &Run, tls: Option<&TlsFiles>) -> Result<Report> {
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
    if r.tls {
        let tls = tls.context("a TLS run without the run's certificate")?;
        cmd.args(["--tls", "--sni", &tls.sni, "--cacert"])
            .arg(tls.ca());
    }
    let out = cmd.output().context("running redis-benchmark")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "redis-benchmark {r:?} against {addr} failed: {text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    shardgate_harness::tools::parse_benchmark_csv(&text).with_context(|| {
        format!(
            "redis-benchmark {r:?} against {addr}: no result in\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}
