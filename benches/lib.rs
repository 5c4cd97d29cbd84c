//! shardgate's benchmarks live in this crate's `[[bench]]` targets:
//! - `rewrite`: the rewriting pipeline's throughput against decode-then-re-encode baselines
//!   on redis-protocol (`cargo bench -p shardgate-benches --bench rewrite`);
//! - `ports`: the port helpers' per-connection cost.
//!
//! The README's Performance section quotes the ratios of one run.
