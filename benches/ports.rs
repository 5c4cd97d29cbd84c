//! Port lookups: the per-connection cost of finding a listener's node.
use criterion::{criterion_group, criterion_main, Criterion};
use shardgate_crds::{NodeRef, PortLayout};
use std::hint::black_box;

fn ports(c: &mut Criterion) {
    let layout = PortLayout::new(30000, 100, 2, None).expect("valid layout");
    c.bench_function("node_of(port)", |b| {
        b.iter(|| layout.node_of(black_box(30150)))
    });
    c.bench_function("port(node)", |b| {
        b.iter(|| layout.port(black_box(NodeRef::new(50, 1))))
    });
}

criterion_group!(benches, ports);
criterion_main!(benches);
