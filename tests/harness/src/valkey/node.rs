//! One `valkey-server` process: starting it, talking to it, stopping it.

use std::fs::OpenOptions;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use redis::FromRedisValue;
use shardgate_crds::NodeRef;

/// The file, in a node's directory, that gets the node's stdout and stderr.
pub const LOG_FILE: &str = "valkey.log";

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Long enough for MIGRATE and SHUTDOWN on a loaded two-core machine.
const IO_TIMEOUT: Duration = Duration::from_secs(15);
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// One node of a [`ValkeyCluster`](super::ValkeyCluster).
///
/// The address can change ([`Restart::NewAddress`](super::Restart)), so it is behind
/// accessors; the position, port, id and directory never change.
#[derive(Debug)]
pub struct Node {
    /// (shard index, node index); node index 0 is the *initial* primary.
    pub pos: NodeRef,
    /// The port the node listens on (the cluster bus is on port + 10000).
    pub port: u16,
    /// The node's 40-hex-digit Valkey id; it survives restarts (it is in `nodes.conf`).
    pub node_id: String,
    /// The node's directory: `nodes.conf`, the AOF, and its log.
    pub dir: PathBuf,
    pub(crate) state: Mutex<NodeState>,
}

#[derive(Debug)]
pub(crate) struct NodeState {
    pub(crate) ip: Ipv4Addr,
    pub(crate) child: Option<Child>,
    /// Settings applied with `config_set`, replayed at every restart (there is no config file
    /// to rewrite: nodes are configured on the command line).
    pub(crate) runtime_config: Vec<(String, String)>,
}

impl Node {
    pub(crate) fn new(pos: NodeRef, ip: Ipv4Addr, port: u16, dir: PathBuf, child: Child) -> Self {
        Node {
            pos,
            port,
            node_id: String::new(),
            dir,
            state: Mutex::new(NodeState {
                ip,
                child: Some(child),
                runtime_config: Vec::new(),
            }),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, NodeState> {
        // A panic elsewhere (a failed assertion in a test thread) must not stop cleanup.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The node's current loopback address.
    pub fn ip(&self) -> Ipv4Addr {
        self.lock().ip
    }

    /// `ip():port`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((self.ip(), self.port))
    }

    /// Whether the process is alive (it has not been killed or stopped, and has not exited).
    pub fn is_running(&self) -> bool {
        let mut state = self.lock();
        match state.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// How the process ended, if it exited without the harness killing or stopping it (a
    /// crash, or a `SHUTDOWN` sent by a test).
    pub fn unexpected_exit(&self) -> Option<std::process::ExitStatus> {
        let mut state = self.lock();
        state.child.as_mut()?.try_wait().ok().flatten()
    }

    /// The process id, while the node runs.
    pub fn pid(&self) -> Option<u32> {
        let mut state = self.lock();
        let child = state.child.as_mut()?;
        matches!(child.try_wait(), Ok(None)).then(|| child.id())
    }

    /// The node's log file (stdout and stderr of every run, appended).
    pub fn log_path(&self) -> PathBuf {
        self.dir.join(LOG_FILE)
    }

    /// The last `lines` lines of the node's log.
    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.log_path(), lines)
    }

    /// A new blocking connection to the node (RESP2, with timeouts).
    pub fn connection(&self) -> Result<redis::Connection> {
        connect(self.pos, self.ip(), self.port)
    }

    /// Runs one command, e.g. `node.query::<String>(&["CLUSTER", "NODES"])`, on a new
    /// connection; errors name the node and the command.
    pub fn query<T: FromRedisValue>(&self, args: &[&str]) -> Result<T> {
        let mut cmd = redis::Cmd::new();
        for arg in args {
            cmd.arg(*arg);
        }
        self.query_cmd(&cmd)
            .with_context(|| format!("{} on node {} ({})", args.join(" "), self.pos, self.addr()))
    }

    /// Runs a prepared command on a new connection.
    pub fn query_cmd<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T> {
        let mut con = self.connection()?;
        Ok(cmd.query(&mut con)?)
    }

    /// One field of `INFO <section>`, e.g. `info_field("cluster", "cluster_state")`.
    pub fn info_field(&self, section: &str, field: &str) -> Result<Option<String>> {
        let info: String = if section == "cluster" {
            self.query(&["CLUSTER", "INFO"])?
        } else {
            self.query(&["INFO", section])?
        };
        Ok(info_value(&info, field))
    }

    /// `ROLE`'s first element: `master` or `slave`.
    pub fn role(&self) -> Result<String> {
        let role: Vec<redis::Value> = self.query(&["ROLE"])?;
        let first = role
            .first()
            .with_context(|| format!("empty ROLE reply from node {}", self.pos))?;
        Ok(String::from_redis_value(first.clone())?)
    }
}

/// `field:value` lines, as in `INFO` and `CLUSTER INFO`.
fn info_value(info: &str, field: &str) -> Option<String> {
    info.lines().find_map(|line| {
        let (k, v) = line.trim_end().split_once(':')?;
        (k == field).then(|| v.to_string())
    })
}

pub(crate) fn connect(pos: NodeRef, ip: Ipv4Addr, port: u16) -> Result<redis::Connection> {
    let client = redis::Client::open(format!("redis://{ip}:{port}/"))
        .with_context(|| format!("client for node {pos} ({ip}:{port})"))?;
    let con = client
        .get_connection_with_timeout(CONNECT_TIMEOUT)
        .with_context(|| format!("connecting to node {pos} ({ip}:{port})"))?;
    con.set_read_timeout(Some(IO_TIMEOUT))?;
    con.set_write_timeout(Some(IO_TIMEOUT))?;
    Ok(con)
}

/// Starts `valkey-server` with `config` as `--key value` arguments (later ones win), in `dir`,
/// appending stdout and stderr to its log.
pub(crate) fn spawn(exe: &Path, dir: &Path, config: &[(String, String)]) -> Result<Child> {
    let log_path = dir.join(LOG_FILE);
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("opening {}", log_path.display()))?;
    let mut cmd = Command::new(exe);
    cmd.current_dir(dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    for (key, value) in config {
        cmd.arg(format!("--{key}")).arg(value);
    }
    cmd.spawn()
        .with_context(|| format!("starting {} in {}", exe.display(), dir.display()))
}

/// Waits until the node answers PING (not LOADING), or fails with the log's tail if it exits
/// or does not answer in time.
pub(crate) fn wait_ready(node: &Node) -> Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        {
            let mut state = node.lock();
            let Some(child) = state.child.as_mut() else {
                bail!("node {} is not running", node.pos);
            };
            if let Some(status) = child.try_wait()? {
                state.child = None;
                bail!(
                    "valkey-server of node {} ({}:{}) exited ({status}) while starting; log tail:\n{}",
                    node.pos,
                    state.ip,
                    node.port,
                    node.log_tail(30)
                );
            }
        }
        let last_error = match node.query::<String>(&["PING"]) {
            Ok(_) => return Ok(()),
            Err(e) => format!("{e:#}"),
        };
        if Instant::now() > deadline {
            bail!(
                "node {} ({}) did not answer PING within {READY_TIMEOUT:?} (last error: {last_error}); \
                 log tail:\n{}",
                node.pos,
                node.addr(),
                node.log_tail(30)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGKILL, then reap. Does nothing if the node is not running.
pub(crate) fn kill(state: &mut NodeState) {
    if let Some(mut child) = state.child.take() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Waits up to `timeout` for the process to exit; true if it did (and it is reaped).
pub(crate) fn wait_exit(state: &mut NodeState, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        match state.child.as_mut().map(Child::try_wait) {
            None => return true,
            Some(Ok(Some(_)) | Err(_)) => {
                state.child = None;
                return true;
            }
            Some(Ok(None)) if Instant::now() > deadline => return false,
            Some(Ok(None)) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

pub(crate) fn log_tail(path: &Path, lines: usize) -> String {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}
