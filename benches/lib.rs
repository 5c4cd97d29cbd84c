//! shardgate's benchmarks live in this crate's `[[bench]]` targets:
//! - `rewrite`: the rewriting pipeline's throughput against decode-then-re-encode baselines
//!   on redis-protocol (`cargo bench -p shardgate-benches --bench rewrite`);
//! - `ports`: the port helpers' per-connection cost;
//! - `tls`: TLS termination against plain forwarding, with redis-benchmark as the load;
//! - `load` (`load/`): the load-comparison harness, shardgate beside Valkey direct, HAProxy,
//!   nginx and Traefik (`scripts/bench-load`; writes `docs/performance.{md,png,csv}`).
//!
//! The README's Performance section quotes the ratios of one run.
