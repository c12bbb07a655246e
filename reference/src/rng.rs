//! A tiny seeded PRNG (SplitMix64) for reproducible random test inputs.
//!
//! `Rng::from_env_or_time(name)` takes the seed from `MEMRA_SEED` (decimal or `0x` hex) or the
//! clock, and prints it so any failure can be replayed with `MEMRA_SEED=<seed>`.

use std::time::{SystemTime, UNIX_EPOCH};

/// SplitMix64 (Steele, Lea, Flood 2014): one u64 of state, full period 2^64.
#[derive(Clone, Debug)]
pub struct Rng {
    seed: u64,
    state: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng { seed, state: seed }
    }

    /// Seed from `MEMRA_SEED` if set, else from the clock; prints `[name] MEMRA_SEED=<seed>` to
    /// stderr (shown by `cargo test` when a test fails). Put `rng.seed()` in assert messages too.
    ///
    /// # Panics
    /// If `MEMRA_SEED` is set but is not a u64.
    pub fn from_env_or_time(name: &str) -> Self {
        let seed = match std::env::var("MEMRA_SEED") {
            Ok(text) => parse_seed(&text)
                .unwrap_or_else(|| panic!("MEMRA_SEED={text:?} is not a u64 (decimal or 0x hex)")),
            Err(_) => {
                let nanos = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(0);
                // Mix so that seeds taken in the same nanosecond by different tests differ.
                let mut h = Rng::new(nanos ^ name_hash(name));
                h.next_u64()
            }
        };
        eprintln!("[{name}] MEMRA_SEED={seed}");
        Rng::new(seed)
    }

    /// The seed this generator started from.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn uniform_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        // 24 bits so the result is exactly representable and strictly below 1.
        (self.next_u64() >> 40) as f32 * (1.0 / (1u32 << 24) as f32)
    }

    /// Uniform in [lo, hi).
    pub fn uniform_in(&mut self, lo: f32, hi: f32) -> f32 {
        (lo as f64 + (hi as f64 - lo as f64) * self.uniform_f64()) as f32
    }

    /// Uniform integer in [0, n); n must be > 0.
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0, "Rng::below(0)");
        // Multiply-shift: bias < n/2^64, irrelevant for tests.
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// Standard normal N(0, 1) by Box–Muller.
    pub fn normal(&mut self) -> f32 {
        let u1 = 1.0 - self.uniform_f64(); // (0, 1]: ln is finite
        let u2 = self.uniform_f64();
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }

    pub fn fill_uniform(&mut self, out: &mut [f32], lo: f32, hi: f32) {
        for v in out {
            *v = self.uniform_in(lo, hi);
        }
    }

    /// Fill with N(0, std²).
    pub fn fill_normal(&mut self, out: &mut [f32], std: f32) {
        for v in out {
            *v = self.normal() * std;
        }
    }

    pub fn uniform_vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        let mut v = vec![0.0; n];
        self.fill_uniform(&mut v, lo, hi);
        v
    }

    /// `n` samples of N(0, std²).
    pub fn normal_vec(&mut self, n: usize, std: f32) -> Vec<f32> {
        let mut v = vec![0.0; n];
        self.fill_normal(&mut v, std);
        v
    }
}

fn parse_seed(text: &str) -> Option<u64> {
    let t = text.trim();
    match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => t.parse().ok(),
    }
}

/// FNV-1a, to give each named test its own clock-derived seed.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_ranges_hold() {
        let mut a = Rng::new(42);
        let mut b = Rng::new(42);
        let mut c = Rng::new(43);
        let va: Vec<u64> = (0..8).map(|_| a.next_u64()).collect();
        let vb: Vec<u64> = (0..8).map(|_| b.next_u64()).collect();
        let vc: Vec<u64> = (0..8).map(|_| c.next_u64()).collect();
        assert_eq!(va, vb);
        assert_ne!(va, vc);
        for _ in 0..10_000 {
            let u = a.uniform();
            assert!((0.0..1.0).contains(&u), "uniform {u}");
            let w = a.uniform_in(-3.0, 2.0);
            assert!((-3.0..2.0).contains(&w), "uniform_in {w}");
            assert!(a.below(7) < 7);
        }
    }

    #[test]
    fn normal_has_unit_moments() {
        let mut rng = Rng::new(7);
        let n = 200_000;
        let xs: Vec<f64> = (0..n).map(|_| rng.normal() as f64).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        // 5-sigma bounds for n = 2e5: mean ± 0.011, var ± 0.016.
        assert!(mean.abs() < 0.011, "mean {mean}");
        assert!((var - 1.0).abs() < 0.016, "var {var}");
    }

    #[test]
    fn seed_parsing() {
        assert_eq!(parse_seed("123"), Some(123));
        assert_eq!(parse_seed("0xff"), Some(255));
        assert_eq!(parse_seed("nope"), None);
    }
}
