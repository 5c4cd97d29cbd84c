//! Seed discovery: what the cluster says it is (`CLUSTER SHARDS`, asked with the shared
//! admin client), and which listener each node it names gets.
//!
//! - here: [`discover`], which asks candidate nodes in turn until one answers, and
//!   [`node_id`], which asks one node who it is (`CLUSTER MYID`).
//! - [`assignment`]: sticky (shard, node) indices across discoveries.
//!
//! The route sources that publish what discovery finds are [`crate::source::seed`] and the
//! Kubernetes source (which knows each node's place from its pod, and asks the nodes only
//! for their ids and roles).

pub mod assignment;

use std::net::SocketAddr;
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

/// Asks the node at `addr` for its id (`CLUSTER MYID`), with `timeout` to connect and as
/// long again to answer.
#[cfg_attr(not(feature = "kubernetes"), allow(dead_code))]
pub async fn node_id(
    addr: SocketAddr,
    timeout: Duration,
) -> Result<String, shardgate_admin_client::Error> {
    let timeouts = Timeouts {
        connect: timeout,
        reply: timeout,
    };
    Client::connect(addr, timeouts).await?.cluster_myid().await
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
