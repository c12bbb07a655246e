//! quantize → dequantize round trips for every supported type, on seeded random data
//! (`MEMRA_SEED` replays a run; the seed is printed and in every failure message).
//!
//! Two checks per (sub-)block, both derived from the block layout and the quantizers' documented
//! scale choice (gguf/src/quant/*.rs), reading the stored scales back from the bytes:
//! 1. Nearest code: every element is within half the widest gap between adjacent representable
//!    values of its sub-block, plus its distance outside the representable range (clamping).
//! 2. Scale quality: each stored scale is no larger than the quantizer's target (the value that
//!    just covers the data), rounded up by at most one f16 step. This is what makes check 1 tight:
//!    a quantizer that picked an oversized scale would pass 1 but fail 2.

use memra_gguf::GgmlType;
use memra_gguf::quant::{KVALUES_IQ4NL, dequantize, iq4xs_scale, q4k_scale_min, quantize};

/// SplitMix64, seeded from MEMRA_SEED or the clock.
struct Rng(u64);

impl Rng {
    fn from_env_or_time(name: &str) -> (Self, u64) {
        let seed = std::env::var("MEMRA_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
                t.map(|d| d.as_nanos() as u64).unwrap_or(1) ^ name.len() as u64
            });
        eprintln!("[{name}] MEMRA_SEED={seed}");
        (Rng(seed), seed)
    }
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn symmetric(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    /// Roughly normal (sum of 4 uniforms).
    fn normal(&mut self) -> f32 {
        (0..4).map(|_| self.symmetric()).sum::<f32>() * 0.866
    }
}

const QUANT_TYPES: [GgmlType; 10] = {
    use GgmlType::*;
    [
        Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS,
    ]
};

/// One f16 rounding step above `v` (relative 2^-10 for normals, 2^-24 absolute for subnormals),
/// plus f32 rounding of the target computation.
fn f16_ceil_bound(v: f32) -> f32 {
    v.abs() * (1.0 + 2.0f32.powi(-9)) + 2.0f32.powi(-24)
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

fn absmax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |a, v| a.max(v.abs()))
}

/// The values element `e` of a block can take: range [lo, hi] and half the widest gap.
struct Cell {
    lo: f32,
    hi: f32,
    half_gap: f32,
}

fn uniform(step: f32, offset: f32, k_lo: i32, k_hi: i32) -> Cell {
    let (a, b) = (step * k_lo as f32 + offset, step * k_hi as f32 + offset);
    Cell {
        lo: a.min(b),
        hi: a.max(b),
        half_gap: step.abs() / 2.0,
    }
}

fn iq4(scale: f32) -> Cell {
    let (a, b) = (
        scale * KVALUES_IQ4NL[0] as f32,
        scale * KVALUES_IQ4NL[15] as f32,
    );
    let widest = KVALUES_IQ4NL
        .windows(2)
        .map(|w| w[1] as i32 - w[0] as i32)
        .max()
        .unwrap_or(0);
    Cell {
        lo: a.min(b),
        hi: a.max(b),
        half_gap: scale.abs() * widest as f32 / 2.0,
    }
}

/// Reads element e's representable values from a block's stored scales (ggml-common.h layouts).
fn cell(ty: GgmlType, b: &[u8], e: usize) -> Cell {
    use GgmlType::*;
    let scales_k = || -> [u8; 12] { std::array::from_fn(|i| b[4 + i]) };
    match ty {
        Q8_0 => uniform(f16_at(b, 0), 0.0, -128, 127),
        Q4_0 => uniform(f16_at(b, 0), 0.0, -8, 7),
        Q5_0 => uniform(f16_at(b, 0), 0.0, -16, 15),
        Q4_1 => uniform(f16_at(b, 0), f16_at(b, 2), 0, 15),
        Q5_1 => uniform(f16_at(b, 0), f16_at(b, 2), 0, 31),
        Q4_K | Q5_K => {
            let (sc, m) = q4k_scale_min(e / 32, &scales_k());
            let levels = if ty == Q4_K { 15 } else { 31 };
            uniform(
                f16_at(b, 0) * sc as f32,
                -(f16_at(b, 2) * m as f32),
                0,
                levels,
            )
        }
        Q6_K => uniform(
            f16_at(b, 208) * (b[192 + e / 16] as i8) as f32,
            0.0,
            -32,
            31,
        ),
        IQ4_NL => iq4(f16_at(b, 0)),
        IQ4_XS => {
            let scales_l = [b[4], b[5], b[6], b[7]];
            iq4(f16_at(b, 0)
                * iq4xs_scale(e / 32, u16::from_le_bytes([b[2], b[3]]), &scales_l) as f32)
        }
        _ => unreachable!("{ty} is not a block type"),
    }
}

/// Check 2: the stored scales are no larger than the documented target, rounded up once.
fn check_scales(ty: GgmlType, x: &[f32], b: &[u8]) -> Result<(), String> {
    use GgmlType::*;
    let amax = absmax(x);
    let at_most = |what: &str, got: f32, target: f32| {
        if got.abs() <= f16_ceil_bound(target) {
            Ok(())
        } else {
            Err(format!(
                "{what} = {got:e} exceeds target {target:e} (block amax {amax:e})"
            ))
        }
    };
    match ty {
        Q8_0 => at_most("d", f16_at(b, 0), amax / 127.0),
        Q4_0 => at_most("d", f16_at(b, 0), amax / 8.0),
        Q5_0 => at_most("d", f16_at(b, 0), amax / 16.0),
        IQ4_NL => at_most("d", f16_at(b, 0), amax / 127.0),
        Q4_1 | Q5_1 => {
            let levels = if ty == Q4_1 { 15.0 } else { 31.0 };
            let min = x.iter().copied().fold(f32::INFINITY, f32::min);
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let m = f16_at(b, 2);
            let one_f16_step = f16_ceil_bound(min) - min.abs();
            if m > min || m < min - one_f16_step {
                return Err(format!("m = {m:e} is not min {min:e} rounded down"));
            }
            at_most("d", f16_at(b, 0), (max - m) / levels)
        }
        Q4_K | Q5_K => {
            let levels = if ty == Q4_K { 15.0 } else { 31.0 };
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales: [u8; 12] = std::array::from_fn(|i| b[4 + i]);
            // Sub-block range always includes 0; the min is −dmin·m.
            let lo = |j: usize| {
                x[32 * j..32 * j + 32]
                    .iter()
                    .copied()
                    .fold(0.0f32, f32::min)
            };
            let hi = |j: usize| {
                x[32 * j..32 * j + 32]
                    .iter()
                    .copied()
                    .fold(f32::NEG_INFINITY, f32::max)
            };
            at_most(
                "dmin",
                dmin,
                (0..8).map(|j| -lo(j)).fold(0.0, f32::max) / 63.0,
            )?;
            // need_j = (hi_j + dmin·m_j) / levels with dmin·m_j < −lo_j + dmin (m_j is a ceil).
            let need = |j: usize| (hi(j) - lo(j) + dmin) / levels;
            at_most("d", d, (0..8).map(need).fold(0.0, f32::max) / 63.0)?;
            for j in 0..8 {
                let (sc, m) = q4k_scale_min(j, &scales);
                // In f64, where dmin·m is exact: in f32 the rounding of both sides (up to
                // ~4e-6·dmin at m near 63) could exceed the slack on some blocks.
                let offset = dmin as f64 * m as f64;
                if offset > -lo(j) as f64 + dmin as f64 * (1.0 + 1e-6) {
                    return Err(format!(
                        "sub-block {j}: min offset {offset:e} is more than one dmin below {:e}",
                        lo(j)
                    ));
                }
                at_most(&format!("sub-block {j} step"), d * sc as f32, need(j) + d)?;
            }
            Ok(())
        }
        Q6_K => {
            let d = f16_at(b, 208);
            let s = |j: usize| absmax(&x[16 * j..16 * j + 16]) / 31.0;
            at_most("d", d, (0..16).map(s).fold(0.0, f32::max) / 127.0)?;
            for j in 0..16 {
                at_most(
                    &format!("sub-block {j} step"),
                    d * (b[192 + j] as i8) as f32,
                    s(j) + d,
                )?;
            }
            Ok(())
        }
        IQ4_XS => {
            let d = f16_at(b, 0);
            let s = |ib: usize| absmax(&x[32 * ib..32 * ib + 32]) / 127.0;
            at_most("d", d, (0..8).map(s).fold(0.0, f32::max) / 31.0)?;
            let scales_l = [b[4], b[5], b[6], b[7]];
            for ib in 0..8 {
                let dl = d * iq4xs_scale(ib, u16::from_le_bytes([b[2], b[3]]), &scales_l) as f32;
                at_most(&format!("sub-block {ib} scale"), dl, s(ib) + d)?;
            }
            Ok(())
        }
        _ => unreachable!("{ty} is not a block type"),
    }
}

/// Quantizes and checks a whole vector, block by block.
fn check_round_trip(ty: GgmlType, x: &[f32], what: &str, seed: u64) {
    let ctx = format!("{ty}, {what}, MEMRA_SEED={seed}");
    let bytes = quantize(ty, x).unwrap_or_else(|e| panic!("{ctx}: {e}"));
    let y = dequantize(ty, &bytes, x.len()).unwrap_or_else(|e| panic!("{ctx}: {e}"));
    let (n, size) = (ty.block_size() as usize, ty.type_size() as usize);
    for (i, ((xb, yb), b)) in x
        .chunks(n)
        .zip(y.chunks(n))
        .zip(bytes.chunks(size))
        .enumerate()
    {
        check_scales(ty, xb, b).unwrap_or_else(|e| panic!("{ctx}: block {i}: {e}"));
        for (e, (&xv, &yv)) in xb.iter().zip(yb).enumerate() {
            let c = cell(ty, b, e);
            let outside = (c.lo - xv).max(xv - c.hi).max(0.0);
            let slack = 1e-6 * (c.lo.abs() + c.hi.abs() + xv.abs()) + 1e-30;
            let err = (xv - yv).abs();
            assert!(
                err <= c.half_gap + outside + slack,
                "{ctx}: block {i} element {e}: x {xv:e} -> {yv:e}, |err| {err:e} > half gap {:e} + outside {outside:e}",
                c.half_gap
            );
        }
    }
}

/// Named random vectors of `n` elements exercising different block statistics.
fn cases(rng: &mut Rng, n: usize) -> Vec<(&'static str, Vec<f32>)> {
    let mut v =
        |f: &mut dyn FnMut(&mut Rng, usize) -> f32| (0..n).map(|i| f(rng, i)).collect::<Vec<f32>>();
    vec![
        ("normal", v(&mut |r, _| r.normal())),
        (
            "wide dynamic range per block",
            v(&mut |r, i| r.normal() * 10f32.powi((i / 32 % 7) as i32 - 3)),
        ),
        (
            "all positive with offset",
            v(&mut |r, _| 5.0 + r.symmetric()),
        ),
        ("all negative", v(&mut |r, _| -0.5 - r.symmetric().abs())),
        (
            "sparse spikes",
            v(&mut |r, _| {
                if r.next_u64() % 17 == 0 {
                    40.0 * r.symmetric()
                } else {
                    0.01 * r.symmetric()
                }
            }),
        ),
        (
            "tiny (subnormal f16 scales)",
            v(&mut |r, _| 1e-6 * r.normal()),
        ),
        ("zeros", vec![0.0; n]),
        ("constant", vec![-0.375; n]),
    ]
}

#[test]
fn quantize_round_trips_within_derived_bounds() {
    let (mut rng, seed) = Rng::from_env_or_time("quantize_round_trips_within_derived_bounds");
    for ty in QUANT_TYPES {
        for (what, x) in cases(&mut rng, 4096) {
            check_round_trip(ty, &x, what, seed);
        }
    }
}

#[test]
fn zeros_and_exact_grid_values_are_exact() {
    for ty in QUANT_TYPES {
        let n = ty.block_size() as usize * 2;
        let y = dequantize(ty, &quantize(ty, &vec![0.0; n]).unwrap(), n).unwrap();
        assert!(
            y.iter().all(|&v| v == 0.0),
            "{ty}: zeros do not round-trip: {y:?}"
        );
    }
    // Q8_0 blocks of codes × 1/64 that include ±127/64: the scale is exactly 1/64, so exact.
    let x: Vec<f32> = (0..32)
        .map(|i| (8 * i - 127) as f32 / 64.0)
        .chain((0..32).map(|i| (127 - 5 * i) as f32 / 64.0))
        .collect();
    let y = dequantize(
        GgmlType::Q8_0,
        &quantize(GgmlType::Q8_0, &x).unwrap(),
        x.len(),
    )
    .unwrap();
    assert_eq!(x, y);
}

#[test]
fn plain_float_types_round_trip() {
    let (mut rng, seed) = Rng::from_env_or_time("plain_float_types_round_trip");
    let x: Vec<f32> = (0..4096)
        .map(|i| rng.normal() * 10f32.powi(i % 11 - 6))
        .collect(); // |x| < 3.5e4 fits F16
    let round = |ty| dequantize(ty, &quantize(ty, &x).unwrap(), x.len()).unwrap();
    assert_eq!(
        round(GgmlType::F32),
        x,
        "F32 must be lossless (MEMRA_SEED={seed})"
    );
    for (ty, mantissa_bits, min_step) in [
        (GgmlType::F16, 10, 2f32.powi(-24)),
        (GgmlType::BF16, 7, 2f32.powi(-133)),
    ] {
        for (xv, yv) in x.iter().zip(round(ty)) {
            // Round to nearest: half an ulp of the format.
            let half_ulp = (xv.abs() * 2f32.powi(-(mantissa_bits + 1))).max(min_step / 2.0);
            assert!(
                (xv - yv).abs() <= half_ulp,
                "{ty}: {xv:e} -> {yv:e} (MEMRA_SEED={seed})"
            );
        }
    }
    assert!(
        quantize(GgmlType::F16, &[70000.0]).is_err(),
        "F16 overflow must be an error"
    );
    assert!(
        quantize(GgmlType::BF16, &[f32::MAX]).is_err(),
        "BF16 rounding to inf must be an error"
    );
}

/// Round trips survive a second pass: quantizing dequantized values reproduces them within the
/// same bounds (a fixed point up to scale rounding).
#[test]
fn requantizing_dequantized_values_stays_within_bounds() {
    let (mut rng, seed) =
        Rng::from_env_or_time("requantizing_dequantized_values_stays_within_bounds");
    for ty in QUANT_TYPES {
        let x: Vec<f32> = (0..1024).map(|_| rng.normal()).collect();
        let y = dequantize(ty, &quantize(ty, &x).unwrap(), x.len()).unwrap();
        check_round_trip(ty, &y, "requantized", seed);
    }
}
