//! Seed discovery: what the cluster says it is (`CLUSTER SHARDS`, asked with the shared
//! admin client), and which listener each node it names gets.
//!
//! - here: [`discover`], which asks a few candidate nodes and chooses among their views, and
//!   [`node_id`], which asks one node who it is (`CLUSTER MYID`).
//! - [`views`]: several nodes' answers compared, and the one to route by chosen.
//! - [`assignment`]: sticky (shard, node) indices across discoveries.
//! - [`table`]: the route table of a view, each node at its port.
//!
//! The route sources that publish what discovery finds are [`crate::source::seed`] and the
//! Kubernetes source (which knows each node's place from its pod, and asks the nodes only
//! for their ids and roles).

pub mod assignment;
#[cfg(test)]
mod fixtures;
pub mod table;
pub mod views;

use std::net::SocketAddr;
use std::time::Duration;

use shardgate_admin_client::{Client, Dial, Timeouts};

pub use assignment::Assignment;
pub use views::{Answer, Choice, Refusal};

use crate::dial::{BackendTlsRx, Resolver};
use crate::model::Backend;

/// Why discovery failed.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("no seed answered CLUSTER SHARDS: {0}")]
    NoSeed(String),
    #[error(
        "no node that answered ({0}) serves any slot: cluster not formed, or nodes restarted empty"
    )]
    NoSlots(String),
    #[error("port layout: {0}")]
    Ports(#[from] shardgate_crds::PortError),
}

/// How discovery reaches a node: `timeout` to connect (and for the TLS handshake) and as
/// long again for each reply; over TLS with the files in force when `tls` is given (the
/// certificate's chain, and `--tls-backend-name` if given: an address is dialled before
/// the node there is known, so not each node's SNI name).
pub fn dial(timeout: Duration, tls: Option<&BackendTlsRx>) -> Dial {
    Dial {
        timeouts: Timeouts {
            connect: timeout,
            reply: timeout,
        },
        tls: tls.map(|t| t.borrow().admin.clone()),
    }
}

/// Asks the node at `addr` for its id (`CLUSTER MYID`).
#[cfg_attr(not(feature = "kubernetes"), allow(dead_code))]
pub async fn node_id(
    addr: SocketAddr,
    dial: &Dial,
) -> Result<String, shardgate_admin_client::Error> {
    Client::dial(addr, dial).await?.cluster_myid().await
}

/// How many answers discovery compares, at most (more only cost time: one confused node
/// is outvoted or outscored by two sound ones).
pub const ANSWERS: usize = 3;

/// Asks the nodes at `candidates` (resolved in order, seeds first) what the cluster is, a
/// few at a time until [`ANSWERS`] have answered or none is left, and chooses the view to
/// route by ([`views::choose`]). Each node is reached as `dial` says ([`dial`]).
pub async fn discover(
    resolver: &Resolver,
    candidates: &[Backend],
    dial: &Dial,
) -> Result<Choice, DiscoveryError> {
    let mut errors = vec![];
    let mut addrs: Vec<SocketAddr> = vec![];
    for seed in candidates {
        match resolver.resolve(seed).await {
            Ok(found) => {
                for a in found {
                    if !addrs.contains(&a) {
                        addrs.push(a);
                    }
                }
            }
            Err(e) => errors.push(e.to_string()),
        }
    }
    let mut answers: Vec<Answer> = vec![];
    let mut next = addrs.iter();
    while answers.len() < ANSWERS {
        let batch: Vec<SocketAddr> = next
            .by_ref()
            .take(ANSWERS - answers.len())
            .copied()
            .collect();
        if batch.is_empty() {
            break;
        }
        let mut asking = tokio::task::JoinSet::new();
        for (i, addr) in batch.iter().enumerate() {
            let addr = *addr;
            let dial = dial.clone();
            asking.spawn(async move { (i, addr, ask(addr, &dial).await) });
        }
        // In the order asked, whatever order they answer in: ties go to the seeds.
        let mut batch_answers = vec![];
        while let Some(done) = asking.join_next().await {
            match done {
                Ok((i, _, Ok(answer))) => batch_answers.push((i, answer)),
                Ok((_, addr, Err(e))) => errors.push(format!("{addr}: {e}")),
                Err(e) => errors.push(format!("discovery task: {e}")),
            }
        }
        batch_answers.sort_by_key(|(i, _)| *i);
        answers.extend(batch_answers.into_iter().map(|(_, a)| a));
    }
    if answers.is_empty() {
        return Err(DiscoveryError::NoSeed(errors.join("; ")));
    }
    let asked: Vec<String> = answers.iter().map(|a| a.addr.to_string()).collect();
    views::choose(answers).ok_or_else(|| DiscoveryError::NoSlots(asked.join(", ")))
}

/// One node's answer: who it is, its cluster state, `CLUSTER SHARDS` and `CLUSTER NODES`.
async fn ask(addr: SocketAddr, dial: &Dial) -> Result<Answer, shardgate_admin_client::Error> {
    let mut client = Client::dial(addr, dial).await?;
    let myself = client.cluster_myid().await?;
    let info = client.cluster_info().await?;
    let shards = client.cluster_shards().await?;
    let nodes = client.cluster_nodes().await?;
    Ok(Answer {
        addr,
        myself,
        state_ok: info.get("cluster_state").map(String::as_str) == Some("ok"),
        shards,
        nodes,
    })
}
