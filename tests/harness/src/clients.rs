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
