//! Activations quantized to int8 blocks of 32 and weight products over them, the numerics of
//! the GPU's integer matvec path (XQ8; templates/memra/quantize_q8.cuh, matvec.cuh) and of
//! llama.cpp's quantized vec_dot: x is quantized once (per block of 32: `d = max|x| / 127`,
//! `q = round(x / d)` half away from zero, IEEE division), then each weight block's integer quant
//! values are dotted with q exactly in integers and scaled once per block or scale group.
//!
//! [`vec_dot_q8`] decodes the GGUF block layouts itself (straight from model-specs §1.4, not
//! through `memra_gguf::quant`), so its agreement with `dot(dequantize(w), dequantize(q8(x)))`
//! checks both. Types without an integer form here (F32, F16, BF16, Q4_1, Q5_1, Q5_K) are
//! dotted as dequantized weights × dequantized x.

use memra_gguf::GgmlType;
use memra_gguf::quant::{self, KVALUES_IQ4NL, QuantError, iq4xs_scale, q4k_scale_min};

/// Elements per q8 block.
pub const QK8: usize = 32;

/// One quantized row: `qs[i]` int8, block b's scale `d[b]` and `sum[b] = Σ qs` of the block.
#[derive(Clone, Debug, PartialEq)]
pub struct Q8Row {
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    pub sum: Vec<i32>,
}

/// Quantizes `x` (length a multiple of 32) block by block, exactly as quantize_q8.cuh.
/// Elements of `x` whose [`quantize_q8_blocks`] rounding lies within f32 rounding of a half
/// step, each with the value change (±d) of rounding it the other way. A kernel that quantizes
/// its own copy of x (computed in a different order, not bit-equal) may round these the other
/// way. The margin: 4e-6 of |x/d| (4× the relative difference of two f32 computations of one
/// RMS norm) plus 1e-5.
pub fn near_half_steps(x: &[f32]) -> Vec<(usize, f32)> {
    let mut out = Vec::new();
    for (b, blk) in x.chunks(QK8).enumerate() {
        let amax = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        if amax == 0.0 {
            continue;
        }
        let d = amax / 127.0;
        for (i, &v) in blk.iter().enumerate() {
            let t = (v / d) as f64;
            if (t - t.floor() - 0.5).abs() < 4e-6 * t.abs() + 1e-5 {
                out.push((QK8 * b + i, if t.round() > t { -d } else { d }));
            }
        }
    }
    out
}

/// The smallest `err` over every subset of `flips` rounded the other way: `base[m]` is matrix
/// m's product with the q8 round trip of x, `cols[m][j]` column `flips[j].0` of matrix m (so a
/// flip adds `cols[m][j] · flips[j].1` to `base[m]`). 2^flips.len() evaluations.
pub fn min_over_flips(base: &[Vec<f32>], cols: &[Vec<Vec<f32>>], flips: &[(usize, f32)], mut err: impl FnMut(&[Vec<f32>]) -> f64) -> f64 {
    assert!(flips.len() <= 16, "min_over_flips: {} flips", flips.len());
    (0..1usize << flips.len())
        .map(|mask| {
            let mut out = base.to_vec();
            for (j, (_, step)) in flips.iter().enumerate().filter(|(j, _)| mask >> j & 1 == 1) {
                for (o, c) in out.iter_mut().zip(cols) {
                    o.iter_mut().zip(&c[j]).for_each(|(v, w)| *v += w * step);
                }
            }
            err(&out)
        })
        .fold(f64::INFINITY, f64::min)
}

pub fn quantize_q8_blocks(x: &[f32]) -> Q8Row {
    assert!(
        x.len().is_multiple_of(QK8),
        "quantize_q8_blocks: length {} is not a multiple of {QK8}",
        x.len()
    );
    let mut r = Q8Row {
        qs: Vec::with_capacity(x.len()),
        d: Vec::with_capacity(x.len() / QK8),
        sum: Vec::with_capacity(x.len() / QK8),
    };
    for blk in x.chunks_exact(QK8) {
        let amax = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let mut s = 0i32;
        for &v in blk {
            let q = if amax == 0.0 {
                0
            } else {
                (v / d).round() as i8
            };
            r.qs.push(q);
            s += q as i32;
        }
        r.d.push(d);
        r.sum.push(s);
    }
    r
}

/// Bytes of a GPU q8 row of `k` elements: `k` int8, `k/32` (d, Σq) f32 pairs, padded to 16.
pub fn q8_row_bytes(k: usize) -> usize {
    (k + k / 4).div_ceil(16) * 16
}

impl Q8Row {
    /// `d[b]·qs[i]` per element (f32; exact in f64 as the product of two f32).
    pub fn dequantize(&self) -> Vec<f32> {
        self.qs
            .iter()
            .enumerate()
            .map(|(i, &q)| self.d[i / QK8] * q as f32)
            .collect()
    }

    /// The row in the GPU layout ([`q8_row_bytes`]; padding bytes zero).
    pub fn to_gpu_bytes(&self) -> Vec<u8> {
        let k = self.qs.len();
        let mut out = vec![0u8; q8_row_bytes(k)];
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = q as u8;
        }
        for b in 0..self.d.len() {
            out[k + 8 * b..][..4].copy_from_slice(&self.d[b].to_le_bytes());
            out[k + 8 * b + 4..][..4].copy_from_slice(&(self.sum[b] as f32).to_le_bytes());
        }
        out
    }
}

/// Types [`vec_dot_q8`] dots in integers (the GPU's XQ8 types).
pub fn has_int_dot(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, Q8_0 | Q4_0 | Q5_0 | Q4_K | Q6_K | IQ4_NL | IQ4_XS)
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    let h = u16::from_le_bytes([b[at], b[at + 1]]) as u32;
    let (s, e, m) = (h >> 15, (h >> 10) & 31, h & 1023);
    let v = match e {
        0 => m as f32 * (-24f32).exp2(),
        31 if m == 0 => f32::INFINITY,
        31 => f32::NAN,
        _ => (m | 1024) as f32 * (e as f32 - 25.0).exp2(),
    };
    if s == 1 { -v } else { v }
}

/// Σ_i v_i·q_i over `range` of one x block.
fn idot(v: &[i32; QK8], q: &[i8], range: std::ops::Range<usize>) -> i64 {
    range.map(|i| v[i] as i64 * q[i] as i64).sum()
}

/// One x block's share: integer values `v` (w_i = scale_g·v_i + min), scale groups of
/// `32 / scales.len()` elements.
fn block_term(v: &[i32; QK8], scales: &[f32], min: f32, q: &[i8], d: f32, sum: i32) -> f64 {
    let per = QK8 / scales.len();
    let mut t = 0.0f64;
    for (g, &s) in scales.iter().enumerate() {
        t += s as f64 * idot(v, q, g * per..(g + 1) * per) as f64;
    }
    t += min as f64 * sum as f64;
    d as f64 * t
}

/// `Σ_i w_i·x_i` for one GGUF weight row (`row`: its bytes, `x.qs.len()` elements) and a
/// quantized x, in f64: per x block the exact integer dot product times the block's scales.
pub fn vec_dot_q8(ty: GgmlType, row: &[u8], x: &Q8Row) -> Result<f64, QuantError> {
    let k = x.qs.len();
    let need = quant::byte_len(ty, k, "dequantize")?;
    if row.len() != need {
        return Err(QuantError::SizeMismatch {
            ty,
            n_elements: k,
            expected_bytes: need,
            actual_bytes: row.len(),
        });
    }
    let nb = k / QK8;
    let mut v = [0i32; QK8];
    let mut total = 0.0f64;
    let mut add = |j: usize, v: &[i32; QK8], scales: &[f32], min: f32| {
        total += block_term(v, scales, min, &x.qs[QK8 * j..][..QK8], x.d[j], x.sum[j]);
    };
    match ty {
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::IQ4_NL => {
            let bytes = ty.type_size() as usize;
            for (j, b) in row.chunks_exact(bytes).enumerate() {
                let d = f16_at(b, 0);
                for (i, vi) in v.iter_mut().enumerate() {
                    let nib = |qs: &[u8]| ((qs[i % 16] >> (4 * (i / 16))) & 0xF) as i32;
                    *vi = match ty {
                        GgmlType::Q8_0 => b[2 + i] as i8 as i32,
                        GgmlType::Q4_0 => nib(&b[2..]) - 8,
                        GgmlType::IQ4_NL => KVALUES_IQ4NL[nib(&b[2..]) as usize] as i32,
                        _ => {
                            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                            (nib(&b[6..]) | (((qh >> i) & 1) << 4) as i32) - 16
                        }
                    };
                }
                add(j, &v, &[d], 0.0);
            }
        }
        GgmlType::Q4_K => {
            for (sb, b) in row.chunks_exact(144).enumerate() {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let scales: &[u8; 12] = b[4..16].try_into().expect("12 scale bytes");
                for j in 0..8 {
                    let (sc, m) = q4k_scale_min(j, scales);
                    let qs = &b[16 + 32 * (j / 2)..][..32];
                    for (i, vi) in v.iter_mut().enumerate() {
                        *vi = ((qs[i] >> (4 * (j % 2))) & 0xF) as i32;
                    }
                    add(8 * sb + j, &v, &[d * sc as f32], -(dmin * m as f32));
                }
            }
        }
        GgmlType::Q6_K => {
            for (sb, b) in row.chunks_exact(210).enumerate() {
                let d = f16_at(b, 208);
                for j in 0..8 {
                    let (h, qq) = (j / 4, j % 4);
                    for (l, vi) in v.iter_mut().enumerate() {
                        let lo = (b[64 * h + 32 * (qq & 1) + l] >> (4 * (qq >> 1))) & 0xF;
                        let hi = (b[128 + 32 * h + l] >> (2 * qq)) & 3;
                        *vi = (lo | hi << 4) as i32 - 32;
                    }
                    let sc = |t: usize| d * (b[192 + 8 * h + 2 * qq + t] as i8) as f32;
                    add(8 * sb + j, &v, &[sc(0), sc(1)], 0.0);
                }
            }
        }
        GgmlType::IQ4_XS => {
            for (sb, b) in row.chunks_exact(136).enumerate() {
                let d = f16_at(b, 0);
                let scales_h = u16::from_le_bytes([b[2], b[3]]);
                let scales_l: &[u8; 4] = b[4..8].try_into().expect("4 scale bytes");
                for j in 0..8 {
                    let qs = &b[8 + 16 * j..][..16];
                    for (i, vi) in v.iter_mut().enumerate() {
                        *vi = KVALUES_IQ4NL[((qs[i % 16] >> (4 * (i / 16))) & 0xF) as usize] as i32;
                    }
                    add(
                        8 * sb + j,
                        &v,
                        &[d * iq4xs_scale(j, scales_h, scales_l) as f32],
                        0.0,
                    );
                }
            }
        }
        _ => {
            let w = quant::dequantize(ty, row, k)?;
            let xd = x.dequantize();
            return Ok(w.iter().zip(&xd).map(|(&a, &b)| a as f64 * b as f64).sum());
        }
    }
    debug_assert_eq!(nb, x.d.len());
    Ok(total)
}

/// `y[t][n] = Σ_k W[n][k]·x[t][k]` with each x row quantized by [`quantize_q8_blocks`] and the
/// products by [`vec_dot_q8`] (the GPU XQ8 path's oracle). `x`: `[t, k]`, returns `[t, n]`.
pub fn matmul_gguf_q8(
    ty: GgmlType,
    data: &[u8],
    k: usize,
    n: usize,
    x: &[f32],
    t: usize,
) -> Result<Vec<f32>, QuantError> {
    assert_eq!(
        x.len(),
        t * k,
        "matmul_gguf_q8: x.len() {} != t·k = {t}·{k}",
        x.len()
    );
    let row_bytes = quant::byte_len(ty, k, "dequantize")?;
    if data.len() != row_bytes * n {
        return Err(QuantError::SizeMismatch {
            ty,
            n_elements: k * n,
            expected_bytes: row_bytes * n,
            actual_bytes: data.len(),
        });
    }
    let xq: Vec<Q8Row> = x.chunks_exact(k).map(quantize_q8_blocks).collect();
    let mut y = vec![0.0f32; t * n];
    for r in 0..n {
        let row = &data[r * row_bytes..][..row_bytes];
        for (ti, xr) in xq.iter().enumerate() {
            y[ti * n + r] = vec_dot_q8(ty, row, xr)? as f32;
        }
    }
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Rng;
    use crate::linear::dot;

    #[test]
    fn quantize_rounds_each_block_to_127_steps() {
        let mut rng = Rng::from_env_or_time("quantize_rounds_each_block_to_127_steps");
        let mut x = rng.normal_vec(32 * 9, 3.0);
        x[32..64].fill(0.0); // an all-zero block: d = 0, q = 0
        let q = quantize_q8_blocks(&x);
        let back = q.dequantize();
        for b in 0..9 {
            let blk = &x[32 * b..][..32];
            let amax = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert_eq!(
                q.d[b],
                amax / 127.0,
                "block {b} (MEMRA_SEED={})",
                rng.seed()
            );
            assert_eq!(
                q.sum[b],
                q.qs[32 * b..][..32].iter().map(|&v| v as i32).sum::<i32>()
            );
            if amax > 0.0 {
                assert!(q.qs[32 * b..][..32].iter().any(|v| v.unsigned_abs() == 127));
            }
            for i in 0..32 {
                let err = (back[32 * b + i] - blk[i]).abs();
                assert!(
                    err <= 0.5 * q.d[b] * 1.0001,
                    "block {b} elem {i}: {err} > d/2 (MEMRA_SEED={})",
                    rng.seed()
                );
            }
        }
        assert_eq!(q.d[1], 0.0);
        assert!(q.qs[32..64].iter().all(|&v| v == 0));
        let bytes = q.to_gpu_bytes();
        assert_eq!(bytes.len(), q8_row_bytes(288));
        assert_eq!(bytes.len() % 16, 0);
        assert_eq!(&bytes[288 + 8..288 + 12], &0.0f32.to_le_bytes());
    }

    #[test]
    fn integer_vec_dot_equals_dequantized_dot_for_every_type() {
        use GgmlType::*;
        let mut rng =
            Rng::from_env_or_time("integer_vec_dot_equals_dequantized_dot_for_every_type");
        let k = 512;
        for ty in [
            F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS,
        ] {
            for _ in 0..4 {
                let w = quant::quantize(ty, &rng.normal_vec(k, 1.0)).unwrap();
                let xq = quantize_q8_blocks(&rng.normal_vec(k, 1.0));
                let wd = quant::dequantize(ty, &w, k).unwrap();
                let xd = xq.dequantize();
                let want = dot(&wd, &xd);
                let mag: f64 = wd
                    .iter()
                    .zip(&xd)
                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                    .sum();
                let got = vec_dot_q8(ty, &w, &xq).unwrap();
                // Both are f64 sums of the same real numbers up to one f32 rounding per weight
                // (dequantize rounds d·sc·q − dmin·m to f32; the integer form keeps q exact).
                assert!(
                    (got - want).abs() <= 1e-6 * mag,
                    "{ty:?}: {got} vs {want} (Σ|terms| {mag}, MEMRA_SEED={})",
                    rng.seed()
                );
            }
        }
        let w = quant::quantize(Q4_K, &rng.normal_vec(k, 1.0)).unwrap();
        assert!(
            vec_dot_q8(
                Q4_K,
                &w[..100],
                &quantize_q8_blocks(&rng.normal_vec(k, 1.0))
            )
            .is_err()
        );
    }

    #[test]
    fn near_half_steps_finds_the_ties_and_their_other_rounding() {
        // amax 127 → d = 1: 2.5 rounds to 3 (other way −1), −3.5 to −4 (other way +1); 2.4 and
        // 2.5 + 1e-3 are clear of the margin.
        let mut x = vec![0.0f32; 32];
        x[..5].copy_from_slice(&[127.0, 2.5, 2.4, -3.5, 2.501]);
        assert_eq!(near_half_steps(&x), vec![(1, -1.0), (3, 1.0)]);
        // The second block's indices count from the row's start; a zero block has none.
        let mut y = vec![0.0f32; 64];
        y[32] = 127.0;
        y[40] = 10.5;
        assert_eq!(near_half_steps(&y), vec![(40, -1.0)]);
    }

    #[test]
    fn min_over_flips_tries_every_subset() {
        // Two flips of one matrix: outputs base, base + c0·s0, base + c1·s1, base + both.
        let base = vec![vec![1.0f32, 2.0]];
        let cols = vec![vec![vec![1.0f32, 0.0], vec![0.0f32, 1.0]]];
        let flips = [(0, -1.0f32), (5, 2.0f32)];
        let target = [0.0f32, 4.0]; // only both flips reach it
        let dist = |o: &[Vec<f32>]| o[0].iter().zip(&target).map(|(a, b)| ((a - b) as f64).abs()).sum::<f64>();
        assert_eq!(min_over_flips(&base, &cols, &flips, dist), 0.0);
        assert_eq!(min_over_flips(&base, &cols, &[], dist), 3.0);
    }
}
