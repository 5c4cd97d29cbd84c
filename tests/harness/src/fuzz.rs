//! The pieces every time-bounded mutation fuzzer here shares (they stand in for cargo-fuzz,
//! which needs a nightly toolchain): a small seeded RNG, and the run's length and seed from
//! the environment, so that a failure can be replayed.
//!
//! `SHARDGATE_FUZZ_SECONDS` sets how long a fuzzer runs, `SHARDGATE_FUZZ_SEED` its seed.

use std::time::{Duration, Instant};

/// xorshift64*: fast, seedable, good enough to pick mutations.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }
}

/// How long to fuzz and from which seed.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    pub seconds: u64,
    pub seed: u64,
}

impl Run {
    /// From the environment, else `default_seconds` and a seed from the clock.
    pub fn from_env(default_seconds: u64) -> Run {
        let var = |name| std::env::var(name).ok().and_then(|s| s.parse().ok());
        let seed = var("SHARDGATE_FUZZ_SEED").unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
        Run {
            seconds: var("SHARDGATE_FUZZ_SECONDS").unwrap_or(default_seconds),
            // xorshift must not start at zero.
            seed: seed | 1,
        }
    }

    pub fn deadline(&self) -> Instant {
        Instant::now() + Duration::from_secs(self.seconds)
    }

    pub fn rng(&self) -> Rng {
        Rng(self.seed)
    }
}
