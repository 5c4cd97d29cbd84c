//! Seed discovery: what the cluster says it is (`CLUSTER SHARDS`, asked with the shared
//! admin client), and which listener each node it names gets.
//!
//! - here: [`discover`], which asks candidate nodes in turn until one answers.
//! - [`assignment`]: sticky (shard, node) indices across discoveries.
//!
//! The route source that publishes what discovery finds is [`crate::source::seed`].

pub mod assignment;

use std::time::Duration;

use shardgate_admin_client::{Client, Timeouts};

pub use assignment::Assignment;
pub use shardgate_admin_client::ShardView;

use crate::dial::Resolver;
use crate::model::Backend;

/// Why discovery failed.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("no seed answered CLUSTER SHARDS: {0}")]
    NoSeed(String),
    #[error("port layout: {0}")]
    Ports(#[from] shardgate_crds::PortError),
}

/// Asks `candidates` in turn for `CLUSTER SHARDS`; the first non-empty answer wins. Each
/// node gets `timeout` to connect and as long again to answer.
pub async fn discover(
    resolver: &Resolver,
    candidates: &[Backend],
    timeout: Duration,
) -> Result<Vec<ShardView>, DiscoveryError> {
    let timeouts = Timeouts {
        connect: timeout,
        reply: timeout,
    };
    let mut errors = vec![];
    for seed in candidates {
        let addrs = match resolver.resolve(seed).await {
            Ok(a) => a,
            Err(e) => {
                errors.push(e.to_string());
                continue;
            }
        };
        for addr in addrs {
            let shards = match Client::connect(addr, timeouts).await {
                Ok(mut client) => client.cluster_shards().await,
                Err(e) => Err(e),
            };
            match shards {
                Ok(shards) if !shards.is_empty() => return Ok(shards),
                Ok(_) => errors.push(format!("{addr}: no shards (cluster not formed?)")),
                Err(e) => errors.push(e.to_string()),
            }
        }
    }
    Err(DiscoveryError::NoSeed(errors.join("; ")))
}
