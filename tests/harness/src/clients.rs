//! Real clients, as the end-to-end tests drive them: redis-cli and the redis crate's
//! async cluster client, plus keys spread over every slot.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use redis::cluster_async::ClusterConnection;

use crate::tools::redis_cli;
use crate::valkey::slot_tags;

/// Runs `redis-cli args...`; its trimmed stdout, or an error with its stderr.
pub fn cli(args: &[&str]) -> Result<String> {
    let out = std::process::Command::new(redis_cli()?)
        .args(args)
        .output()
        .context("running redis-cli")?;
    ensure!(
        out.status.success(),
        "redis-cli {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Runs `redis-cli args...` with `commands` on its stdin, one per line, as a user pipes a
/// script into it; its stdout lines, or an error with its stderr.
pub fn cli_script(args: &[&str], commands: &[String]) -> Result<Vec<String>> {
    use std::io::Write as _;
    let mut child = std::process::Command::new(redis_cli()?)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("running redis-cli")?;
    let mut script = commands.join("\n");
    script.push('\n');
    // Written from a thread: redis-cli answers while it reads, and a full stdout pipe would
    // otherwise stop both.
    let mut stdin = child.stdin.take().context("redis-cli's stdin")?;
    let writer = std::thread::spawn(move || stdin.write_all(script.as_bytes()));
    let out = child.wait_with_output().context("waiting for redis-cli")?;
    writer
        .join()
        .map_err(|_| anyhow::anyhow!("the stdin writer panicked"))?
        .context("writing redis-cli's stdin")?;
    ensure!(
        out.status.success(),
        "redis-cli {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect())
}

/// A cluster connection that knows only `127.0.0.1:<entry>`; patient enough to ride out a
/// failover (retries, short timeouts).
pub async fn cluster_client(entry: u16) -> Result<ClusterConnection> {
    cluster_client_at([std::net::SocketAddr::from(([127, 0, 0, 1], entry))]).await
}

/// A cluster connection that starts from `seeds`; as patient as [`cluster_client`].
pub async fn cluster_client_at(
    seeds: impl IntoIterator<Item = std::net::SocketAddr>,
) -> Result<ClusterConnection> {
    let urls: Vec<String> = seeds.into_iter().map(|a| format!("redis://{a}")).collect();
    redis::cluster::ClusterClientBuilder::new(urls.clone())
        .retries(30)
        .connection_timeout(Duration::from_secs(2))
        .response_timeout(Duration::from_secs(2))
        .build()?
        .get_async_connection()
        .await
        .with_context(|| format!("cluster client via {urls:?}"))
}

/// `n` keys in `n` slots spread evenly over all 16384, named `{tag}<suffix>:<i>`.
pub fn spread_keys(n: usize, suffix: &str) -> Vec<String> {
    let tags = slot_tags();
    (0..n)
        .map(|i| format!("{}{suffix}:{i}", tags[i * 16384 / n]))
        .collect()
}

/// redis-py's `RedisCluster` started at `seed` only: `n` SET then GET of keys over many
/// slots (a Python client, for a second client library's view). Returns the `host:port` of
/// every node it learned, sorted.
pub fn redis_py_set_get(seed: std::net::SocketAddr, n: usize) -> Result<Vec<String>> {
    const SCRIPT: &str = r#"
import sys
from redis.cluster import RedisCluster
rc = RedisCluster(host=sys.argv[1], port=int(sys.argv[2]), socket_timeout=5)
n = int(sys.argv[3])
keys = [f"py:{{{i % 997}}}:{i}" for i in range(n)]
for k in keys:
    assert rc.set(k, k[::-1])
bad = [k for k in keys if rc.get(k) != k[::-1].encode()]
print("nodes", " ".join(sorted(f"{x.host}:{x.port}" for x in rc.get_nodes())))
print("ok", n - len(bad))
sys.exit(1 if bad else 0)
"#;
    let out = std::process::Command::new(crate::tools::python_with_redis()?)
        .args([
            "-c",
            SCRIPT,
            &seed.ip().to_string(),
            &seed.port().to_string(),
            &n.to_string(),
        ])
        .output()
        .context("running python with redis-py")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success() && stdout.contains(&format!("ok {n}")),
        "redis-py: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let nodes = stdout
        .lines()
        .find_map(|l| l.strip_prefix("nodes "))
        .context("redis-py printed no nodes")?;
    Ok(nodes.split_whitespace().map(str::to_string).collect())
}

/// `redis-benchmark --cluster` from `seed`: `n` SETs and `n` GETs over random keys with 10
/// clients; its output, which must show both tests and no error.
pub fn redis_benchmark_cluster(seed: std::net::SocketAddr, n: usize) -> Result<String> {
    let out = std::process::Command::new(crate::tools::redis_benchmark()?)
        .args([
            "--cluster",
            "-h",
            &seed.ip().to_string(),
            "-p",
            &seed.port().to_string(),
            "-n",
            &n.to_string(),
            "-c",
            "10",
            "-t",
            "set,get",
            "-r",
            "100000",
            "-q",
        ])
        .output()
        .context("running redis-benchmark")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        out.status.success()
            && text.contains("SET:")
            && text.contains("GET:")
            && !text.to_lowercase().contains("error"),
        "redis-benchmark --cluster: {text}"
    );
    Ok(text)
}

/// Whether the peer closed `s` (EOF or reset) within `within`.
pub fn closed_within(s: &mut std::net::TcpStream, within: Duration) -> bool {
    use std::io::{ErrorKind, Read};
    if s.set_read_timeout(Some(within)).is_err() {
        return true;
    }
    let mut b = [0u8; 1];
    match s.read(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe),
    }
}

/// What [`watch_idle_timeout`] saw.
#[derive(Debug)]
pub struct IdleWatch {
    /// Whether the quiet connection was closed (within 60 s).
    pub quiet_closed: bool,
    /// When, counted from the start of its silence.
    pub quiet_after: Duration,
    /// Whether the busy connection was closed.
    pub busy_closed: bool,
    /// The busy connection's longest gap between two answered pings: a close of it is the
    /// timeout's only if this machine stalled it that long.
    pub busy_longest_silence: Duration,
}

impl IdleWatch {
    /// Panics unless the quiet connection was closed, not before `idle`, and the busy one
    /// was left open (or the machine stalled it for half the timeout or more).
    pub fn check(&self, idle: Duration) {
        let (after, longest) = (self.quiet_after, self.busy_longest_silence);
        assert!(
            self.quiet_closed,
            "the quiet connection is still open after {after:?}"
        );
        assert!(
            after >= idle,
            "the quiet connection was closed after {after:?}, before {idle:?}"
        );
        assert!(
            !self.busy_closed || longest >= idle / 2,
            "a busy connection was closed (its longest silence {longest:?})"
        );
    }
}

/// Watches an idle timeout of `idle`: `quiet` stays silent from now on, `busy` is pinged
/// with `ping` (false once it is closed) every 100 ms for three timeouts.
pub fn watch_idle_timeout(
    mut quiet: std::net::TcpStream,
    busy: &mut std::net::TcpStream,
    idle: Duration,
    mut ping: impl FnMut(&mut std::net::TcpStream) -> bool,
) -> IdleWatch {
    let since = std::time::Instant::now();
    let watcher = std::thread::spawn(move || {
        // 60 s: a limit only a timeout that never fires reaches.
        let closed = closed_within(&mut quiet, Duration::from_secs(60));
        (closed, since.elapsed())
    });
    let (mut longest, mut busy_closed) = (Duration::ZERO, false);
    let mut last = std::time::Instant::now();
    while since.elapsed() < 3 * idle {
        std::thread::sleep(Duration::from_millis(100));
        longest = longest.max(last.elapsed());
        if !ping(busy) {
            busy_closed = true;
            break;
        }
        last = std::time::Instant::now();
    }
    let (quiet_closed, quiet_after) = watcher.join().unwrap_or((false, Duration::ZERO));
    IdleWatch {
        quiet_closed,
        quiet_after,
        busy_closed,
        busy_longest_silence: longest,
    }
}
