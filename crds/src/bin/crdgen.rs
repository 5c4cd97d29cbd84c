//! Prints the ValkeyCluster CustomResourceDefinition as YAML, the checked-in
//! `deploy/crds/valkeyclusters.shardgate.io.yaml`:
//!
//! ```text
//! cargo run -p shardgate-crds --features resource --bin crdgen > deploy/crds/valkeyclusters.shardgate.io.yaml
//! ```

fn main() {
    print!("{}", shardgate_crds::valkey_cluster::crd_yaml());
}
