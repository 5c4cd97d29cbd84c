//! Loopback addresses and ports for tests.
//!
//! Every Valkey node gets its own address `127.b.c.d`, as a pod gets its own IP, and all nodes
//! listen on the same port. Addresses must not collide between the threads of one test binary
//! nor between test binaries that cargo runs at the same time, so:
//! - `b` and the high nibble of `c` come from the process id (3840 blocks, one per process
//!   modulo pid collisions),
//! - the rest comes from a per-process atomic counter (4064 addresses per block),
//! - and before an address is handed out its ports are bound once, so that an address still in
//!   use (a leftover process, a pid collision) is skipped.
//!
//! `127.0.0.0/16` is never used: tests put proxies on `127.0.0.1` and `127.0.x.y` for x < 16.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::net::{Ipv4Addr, TcpListener};
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{bail, Result};

/// Addresses per process block: 16 values of `c`'s low nibble times `d` in 1..=254.
const PER_PROCESS: u32 = 16 * 254;
/// Process blocks: `b` in 16..=255 times `c`'s high nibble.
const BLOCKS: u32 = 240 * 16;

static NEXT: AtomicU32 = AtomicU32::new(0);

/// The `k`-th address of this process's block.
fn candidate(pid: u32, k: u32) -> Ipv4Addr {
    let block = pid % BLOCKS;
    let b = 16 + block / 16;
    let c_high = block % 16;
    let k = k % PER_PROCESS;
    let c = c_high * 16 + k / 254;
    let d = 1 + k % 254;
    Ipv4Addr::new(127, b as u8, c as u8, d as u8)
}

/// A fresh loopback address on which every port in `ports` can be bound right now (for a
/// Valkey node: its port and its cluster bus port, port + 10000).
pub fn node_ip(ports: &[u16]) -> Result<Ipv4Addr> {
    let pid = std::process::id();
    for _ in 0..PER_PROCESS {
        let ip = candidate(pid, NEXT.fetch_add(1, Ordering::Relaxed));
        if ports.iter().all(|&port| bindable(ip, port)) {
            return Ok(ip);
        }
    }
    bail!("no loopback address in this process's block has ports {ports:?} free")
}

/// Whether `ip:port` can be bound (and listened on) right now.
pub fn bindable(ip: Ipv4Addr, port: u16) -> bool {
    TcpListener::bind((ip, port)).is_ok()
}

/// A port that is free on `ip` right now, for a server a test starts.
///
/// Picked as [`free_port_range`] picks, not by the kernel: a port from the kernel's
/// ephemeral range may be handed to an outgoing connection between this call and the
/// server's bind (a kube-apiserver once failed to start so, "address already in use",
/// while etcd started).
///
/// # Panics
/// If no free port was found after many tries.
pub fn free_port(ip: Ipv4Addr) -> u16 {
    free_port_range(ip, 1)
}

/// The lowest port of a range `base..base + count` in which every port is free on `ip` right
/// now, for a proxy's per-node listeners.
///
/// Bases are picked pseudo-randomly in 20000..30000: below Linux's default ephemeral range
/// (32768 on), so that the kernel does not hand these ports to outgoing connections
/// meanwhile, and below the NodePort range (30000 on) that the Kubernetes harness serves.
///
/// # Panics
/// If `count` is 0 or too large, or no such range was found after many tries.
pub fn free_port_range(ip: Ipv4Addr, count: u16) -> u16 {
    const LOW: u32 = 20000;
    const HIGH: u32 = 30000;
    assert!(
        count > 0 && u32::from(count) < (HIGH - LOW) / 4,
        "free_port_range: count {count} must be between 1 and {}",
        (HIGH - LOW) / 4
    );
    let span = HIGH - LOW - u32::from(count);
    for attempt in 0..500u32 {
        let base = LOW + (random_u32(attempt) % span);
        let base = u16::try_from(base).expect("base is below 30000");
        if (base..base + count).all(|port| bindable(ip, port)) {
            return base;
        }
    }
    panic!("free_port_range: no {count} consecutive free ports on {ip} in {LOW}..{HIGH}")
}

/// Different in every call and every process, without a `rand` dependency: std's
/// `RandomState` is seeded randomly per process and per call.
fn random_u32(salt: u32) -> u32 {
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u32(salt);
    hasher.write_u32(std::process::id());
    (hasher.finish() >> 16) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn candidates_stay_out_of_the_proxy_range_and_are_distinct_per_process() {
        for pid in [1, 2, 239, 240, 3839, 3840, 4_194_303] {
            let all: HashSet<_> = (0..PER_PROCESS).map(|k| candidate(pid, k)).collect();
            assert_eq!(all.len(), PER_PROCESS as usize, "pid {pid}");
            for ip in &all {
                let [a, b, _, d] = ip.octets();
                assert_eq!(a, 127);
                assert!(b >= 16, "{ip}");
                assert!(d != 0 && d != 255, "{ip}");
            }
        }
        // Neighbouring pids get disjoint blocks.
        let a: HashSet<_> = (0..PER_PROCESS).map(|k| candidate(1000, k)).collect();
        let b: HashSet<_> = (0..PER_PROCESS).map(|k| candidate(1001, k)).collect();
        assert!(a.is_disjoint(&b));
    }

    #[test]
    fn node_ips_are_unique_across_threads() {
        let threads: Vec<_> = (0..8)
            .map(|_| {
                std::thread::spawn(|| {
                    (0..50)
                        .map(|_| node_ip(&[6379, 16379]).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut seen = HashSet::new();
        for t in threads {
            for ip in t.join().unwrap() {
                assert!(seen.insert(ip), "{ip} handed out twice");
            }
        }
    }

    #[test]
    fn free_ports_can_be_bound() {
        let ip = Ipv4Addr::new(127, 0, 0, 1);
        let port = free_port(ip);
        assert!(bindable(ip, port));
        let base = free_port_range(ip, 16);
        assert!((20000..32768 - 16).contains(&base));
        let listeners: Vec<_> = (base..base + 16)
            .map(|p| TcpListener::bind((ip, p)).unwrap())
            .collect();
        assert_eq!(listeners.len(), 16);
    }
}
