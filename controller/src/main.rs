//! `shardgate-controller`: the operator for `ValkeyCluster` resources.
//!
//! Not implemented yet: this binary only documents itself, so that the workspace layout of
//! the design is complete. It exits with an error rather than pretending to run.

use clap::Parser;

/// The shardgate operator: runs `ValkeyCluster` resources (group shardgate.io, v1alpha1) and
/// their `externalAccess` block (per-shard Services, announce flags, Gateway API TCPRoutes,
/// external endpoints in status, and the shardgate proxy's Deployment).
///
/// The reconciler is not implemented yet; see the project's README for what works today
/// (the proxy, `shardgate-proxy`).
#[derive(Parser, Debug)]
#[command(version, about, long_about)]
struct Args {}

fn main() -> anyhow::Result<()> {
    let _args = Args::parse();
    anyhow::bail!("shardgate-controller: the reconciler is not implemented yet (see README)")
}
