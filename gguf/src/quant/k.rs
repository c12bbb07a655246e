//! K-quants: 256-element super-blocks with per-sub-block scales (ggml `block_q4_K`, `block_q5_K`,
//! `block_q6_K`).
//!
//! Quantizers (fixtures only) pick every scale so that the sub-block's values lie inside its grid
//! of codes (f16 super-scales rounded up, 6/8-bit sub-scales rounded up with `ceil`), then take the
//! nearest code. So |error| ≤ half a step of the stored sub-block step d·sc, with no clamping.
//! Q4_K/Q5_K, like llama.cpp, always include 0 in a sub-block's range (the min is subtracted).

use super::legacy::nearest_code;
use super::{f16_at, f16_ceil, put_f16};

/// Bytes of the packed 6-bit scales/mins of Q4_K and Q5_K.
pub const Q4K_SCALES_BYTES: usize = 12;

/// Scale and min (6 bits each) of sub-block `j` (0..8) of a Q4_K/Q5_K block, as ggml's
/// `get_scale_min_k4`. Packing: bytes 0..4 hold sc0..3 in bits 0..5, bytes 4..8 hold m0..3 in
/// bits 0..5; bytes 8..12 hold sc4..7 (low nibble) and m4..7 (high nibble), whose top 2 bits sit
/// in bits 6..7 of bytes 0..4 (sc) and 4..8 (m).
#[inline(always)]
pub fn q4k_scale_min(j: usize, scales: &[u8; Q4K_SCALES_BYTES]) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        let sc = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4);
        let m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
        (sc, m)
    }
}

/// The inverse of [`q4k_scale_min`] for all 8 sub-blocks (values must be < 64).
fn pack_q4k_scales(sc: &[u8; 8], m: &[u8; 8]) -> [u8; Q4K_SCALES_BYTES] {
    let mut s = [0u8; Q4K_SCALES_BYTES];
    for j in 0..4 {
        s[j] = sc[j] | (sc[j + 4] >> 4) << 6;
        s[j + 4] = m[j] | (m[j + 4] >> 4) << 6;
        s[j + 8] = (sc[j + 4] & 0xF) | (m[j + 4] & 0xF) << 4;
    }
    s
}

/// Per sub-block multipliers (d·sc, dmin·m) exactly as ggml computes them.
#[inline(always)]
fn q4k_sub_scales(b: &[u8]) -> ([f32; 8], [f32; 8]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales: [u8; Q4K_SCALES_BYTES] = std::array::from_fn(|i| b[4 + i]);
    let mut dl = [0.0; 8];
    let mut ml = [0.0; 8];
    for j in 0..8 {
        let (sc, m) = q4k_scale_min(j, &scales);
        dl[j] = d * sc as f32;
        ml[j] = dmin * m as f32;
    }
    (dl, ml)
}

/// Q4_K, 144 bytes: `d: f16` at 0, `dmin: f16` at 2, `scales: [u8; 12]` at 4, `qs: [u8; 128]` at 16.
/// Eight sub-blocks of 32. Chunk g (0..4) of 64 elements uses bytes q = qs[32g..32g+32]:
/// element 64g + l = d·sc(2g)·(q[l] & 0xF) − dmin·m(2g);
/// element 64g + 32 + l = d·sc(2g+1)·(q[l] >> 4) − dmin·m(2g+1).
#[inline(always)]
pub(super) fn dequantize_q4_k(b: &[u8; 144], y: &mut [f32; 256]) {
    let (dl, ml) = q4k_sub_scales(b);
    let qs = &b[16..144];
    for g in 0..4 {
        let q = &qs[32 * g..32 * g + 32];
        let (d1, m1, d2, m2) = (dl[2 * g], ml[2 * g], dl[2 * g + 1], ml[2 * g + 1]);
        for l in 0..32 {
            y[64 * g + l] = d1 * (q[l] & 0xF) as f32 - m1;
            y[64 * g + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

/// Q5_K, 176 bytes: `d: f16` at 0, `dmin: f16` at 2, `scales: [u8; 12]` at 4, `qh: [u8; 32]` at 16,
/// `qs: [u8; 128]` at 48. As Q4_K, plus a 5th bit: in chunk g, element 64g + l adds 16 if
/// qh[l] bit 2g is set, element 64g + 32 + l adds 16 if qh[l] bit 2g+1 is set.
#[inline(always)]
pub(super) fn dequantize_q5_k(b: &[u8; 176], y: &mut [f32; 256]) {
    let (dl, ml) = q4k_sub_scales(b);
    let qh = &b[16..48];
    let qs = &b[48..176];
    for g in 0..4 {
        let q = &qs[32 * g..32 * g + 32];
        let (d1, m1, d2, m2) = (dl[2 * g], ml[2 * g], dl[2 * g + 1], ml[2 * g + 1]);
        for l in 0..32 {
            let lo = (q[l] & 0xF) | ((qh[l] >> (2 * g)) & 1) << 4;
            let hi = (q[l] >> 4) | ((qh[l] >> (2 * g + 1)) & 1) << 4;
            y[64 * g + l] = d1 * lo as f32 - m1;
            y[64 * g + 32 + l] = d2 * hi as f32 - m2;
        }
    }
}

/// Q6_K, 210 bytes: `ql: [u8; 128]` at 0, `qh: [u8; 64]` at 128, `scales: [i8; 16]` at 192,
/// `d: f16` at 208 (last). Element e has scale scales[e / 16] and a 6-bit code minus 32.
/// Two halves h of 128 elements use ql[64h..64h+64] and qh[32h..32h+32]; for l in 0..32:
///   element 128h + l      : ql[l] low nibble,      qh[l] bits 0..2
///   element 128h + l + 32 : ql[l + 32] low nibble, qh[l] bits 2..4
///   element 128h + l + 64 : ql[l] high nibble,     qh[l] bits 4..6
///   element 128h + l + 96 : ql[l + 32] high nibble, qh[l] bits 6..8
/// value = d·scale·(code − 32).
#[inline(always)]
pub(super) fn dequantize_q6_k(b: &[u8; 210], y: &mut [f32; 256]) {
    let d = f16_at(b, 208);
    let mut dl = [0.0f32; 16];
    for (i, v) in dl.iter_mut().enumerate() {
        *v = d * (b[192 + i] as i8) as f32;
    }
    for h in 0..2 {
        let ql = &b[64 * h..64 * h + 64];
        let qh = &b[128 + 32 * h..128 + 32 * h + 32];
        let y = &mut y[128 * h..128 * h + 128];
        let dl = &dl[8 * h..8 * h + 8];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | (qh[l] & 3) << 4) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4) as i32 - 32;
            let q3 = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) as i32 - 32;
            y[l] = dl[is] * q1 as f32;
            y[l + 32] = dl[is + 2] * q2 as f32;
            y[l + 64] = dl[is + 4] * q3 as f32;
            y[l + 96] = dl[is + 6] * q4 as f32;
        }
    }
}

/// Scales and codes for Q4_K (`LEVELS` = 15) and Q5_K (31).
///
/// 1. Per sub-block j: range [lo_j, hi_j] with lo_j = min(0, min x), hi_j = max x.
/// 2. dmin = f16 ≥ max_j(−lo_j) / 63; m_j = ceil(−lo_j / dmin) ≤ 63, so −dmin·m_j ≤ lo_j.
/// 3. need_j = (hi_j + dmin·m_j) / LEVELS; d = f16 ≥ max_j need_j / 63; sc_j = ceil(need_j / d),
///    so the grid −dmin·m_j + d·sc_j·{0..LEVELS} covers [lo_j, hi_j].
/// 4. code = nearest to (x + dmin·m_j) / (d·sc_j), clamped to 0..=LEVELS (a no-op up to rounding).
fn quantize_k_affine<const LEVELS: i32>(x: &[f32; 256]) -> Result<KAffine, usize> {
    let mut lo = [0.0f32; 8];
    let mut hi = [0.0f32; 8];
    for j in 0..8 {
        let sub = &x[32 * j..32 * j + 32];
        lo[j] = sub.iter().copied().fold(0.0, f32::min);
        hi[j] = sub.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    }
    let worst = |v: &[f32; 8], sign: f32| {
        (0..8)
            .max_by(|&a, &b| (sign * v[a]).total_cmp(&(sign * v[b])))
            .unwrap_or(0)
    };
    let jmin = worst(&lo, -1.0);
    let dmin = f16_ceil(-lo[jmin] / 63.0).ok_or(32 * jmin)?;
    let dminf = dmin.to_f32();
    let mut m = [0u8; 8];
    let mut need = [0.0f32; 8];
    for j in 0..8 {
        m[j] = ceil_code(-lo[j], dminf, 63);
        need[j] = (hi[j] + dminf * m[j] as f32) / LEVELS as f32;
    }
    let jmax = worst(&need, 1.0);
    let d = f16_ceil(need[jmax] / 63.0).ok_or(32 * jmax)?;
    let df = d.to_f32();
    let mut sc = [0u8; 8];
    let mut q = [0u8; 256];
    for j in 0..8 {
        sc[j] = ceil_code(need[j], df, 63);
        let (step, offset) = (df * sc[j] as f32, dminf * m[j] as f32);
        for l in 0..32 {
            q[32 * j + l] = nearest_code(x[32 * j + l] + offset, step, 0, LEVELS) as u8;
        }
    }
    Ok(KAffine { d, dmin, sc, m, q })
}

/// A Q4_K/Q5_K block before bit packing: super-scales, 6-bit sub-scales and mins, codes.
struct KAffine {
    d: half::f16,
    dmin: half::f16,
    sc: [u8; 8],
    m: [u8; 8],
    q: [u8; 256],
}

/// ceil(v / unit) clamped to 0..=max; 0 when unit is 0 (then v is 0 too).
fn ceil_code(v: f32, unit: f32, max: u8) -> u8 {
    if unit == 0.0 {
        0
    } else {
        (v / unit).ceil().clamp(0.0, max as f32) as u8
    }
}

pub(super) fn quantize_q4_k(x: &[f32; 256], b: &mut [u8; 144]) -> Result<(), usize> {
    let KAffine { d, dmin, sc, m, q } = quantize_k_affine::<15>(x)?;
    put_f16(b, 0, d);
    put_f16(b, 2, dmin);
    b[4..16].copy_from_slice(&pack_q4k_scales(&sc, &m));
    let qs = &mut b[16..144];
    for g in 0..4 {
        for l in 0..32 {
            qs[32 * g + l] = q[64 * g + l] | q[64 * g + 32 + l] << 4;
        }
    }
    Ok(())
}

pub(super) fn quantize_q5_k(x: &[f32; 256], b: &mut [u8; 176]) -> Result<(), usize> {
    let KAffine { d, dmin, sc, m, q } = quantize_k_affine::<31>(x)?;
    put_f16(b, 0, d);
    put_f16(b, 2, dmin);
    b[4..16].copy_from_slice(&pack_q4k_scales(&sc, &m));
    let (qh, qs) = b[16..176].split_at_mut(32);
    qh.fill(0);
    for g in 0..4 {
        for l in 0..32 {
            let (lo, hi) = (q[64 * g + l], q[64 * g + 32 + l]);
            qs[32 * g + l] = (lo & 0xF) | (hi & 0xF) << 4;
            qh[l] |= (lo >> 4) << (2 * g) | (hi >> 4) << (2 * g + 1);
        }
    }
    Ok(())
}

/// Q6_K: per 16-element sub-block s_j = max|x| / 31 (codes −31..=31 of the −32..=31 range);
/// d = f16 ≥ max_j s_j / 127; sc_j = ceil(s_j / d) ≤ 127; code = nearest x / (d·sc_j).
pub(super) fn quantize_q6_k(x: &[f32; 256], b: &mut [u8; 210]) -> Result<(), usize> {
    let mut s = [0.0f32; 16];
    for (j, v) in s.iter_mut().enumerate() {
        *v = x[16 * j..16 * j + 16]
            .iter()
            .fold(0.0f32, |a, v| a.max(v.abs()))
            / 31.0;
    }
    let jmax = (0..16).max_by(|&a, &c| s[a].total_cmp(&s[c])).unwrap_or(0);
    let d = f16_ceil(s[jmax] / 127.0).ok_or(16 * jmax)?;
    let df = d.to_f32();
    let mut q = [0u8; 256];
    for j in 0..16 {
        let sc = ceil_code(s[j], df, 127);
        b[192 + j] = sc; // non-negative, so the i8 and u8 bits agree
        let step = df * sc as f32;
        for l in 0..16 {
            q[16 * j + l] = (nearest_code(x[16 * j + l], step, -32, 31) + 32) as u8;
        }
    }
    for h in 0..2 {
        for l in 0..32 {
            let e = |k: usize| q[128 * h + l + 32 * k];
            b[64 * h + l] = (e(0) & 0xF) | (e(2) & 0xF) << 4;
            b[64 * h + l + 32] = (e(1) & 0xF) | (e(3) & 0xF) << 4;
            b[128 + 32 * h + l] =
                (e(0) >> 4) | (e(1) >> 4) << 2 | (e(2) >> 4) << 4 | (e(3) >> 4) << 6;
        }
    }
    put_f16(b, 208, d);
    Ok(())
}
