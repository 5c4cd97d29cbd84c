//! Benchmarks live in this crate's `[[bench]]` targets; see `benches/README.md`.
