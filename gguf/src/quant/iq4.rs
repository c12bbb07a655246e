//! Non-linear 4-bit formats IQ4_NL and IQ4_XS: each 4-bit code indexes [`KVALUES_IQ4NL`], which is
//! multiplied by a scale (ggml `block_iq4_nl`, `block_iq4_xs`, `kvalues_iq4nl`).
//!
//! Quantizers (fixtures only): the scale maps the largest-magnitude element of a (sub-)block onto
//! −127 (the table's widest end), rounded away from zero so it stays inside the grid; every element
//! then takes the code whose dequantized value is nearest (searching all 16). Error: at most half
//! the widest table gap (24/2 = 12) times |scale|, or 127 − 113 = 14 times |scale| for an element
//! of the opposite sign beyond the table's +113 end. No least-squares scale refinement (llama.cpp
//! does one), so errors are somewhat larger than llama.cpp's.

use super::{f16_at, f16_away, f16_ceil, put_f16, signed_absmax};

/// The 16 values a 4-bit IQ4 code stands for (ggml `kvalues_iq4nl`).
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// IQ4_NL, 18 bytes: `d: f16` at 0, `qs: [u8; 16]` at 2, Q4_0 nibble order.
/// Element j = d·kvalues[qs[j] & 0xF], element j + 16 = d·kvalues[qs[j] >> 4].
#[inline(always)]
pub(super) fn dequantize_iq4_nl(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = d * KVALUES_IQ4NL[(qs[j] & 0xF) as usize] as f32;
        y[j + 16] = d * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
    }
}

/// Signed 6-bit scale (ls − 32, in −32..=31) of sub-block `ib` (0..8) of an IQ4_XS block:
/// low 4 bits from nibble ib%2 of scales_l[ib/2], high 2 bits from bits 2ib..2ib+2 of scales_h.
#[inline(always)]
pub fn iq4xs_scale(ib: usize, scales_h: u16, scales_l: &[u8; 4]) -> i32 {
    let lo = (scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF;
    let hi = ((scales_h >> (2 * ib)) & 3) as u8;
    (lo | hi << 4) as i32 - 32
}

/// IQ4_XS, 136 bytes: `d: f16` at 0, `scales_h: u16 LE` at 2, `scales_l: [u8; 4]` at 4,
/// `qs: [u8; 128]` at 8. Eight sub-blocks of 32 with dl = d·(ls − 32) (see [`iq4xs_scale`]);
/// sub-block ib uses q = qs[16ib..16ib+16]: element 32ib + j = dl·kvalues[q[j] & 0xF],
/// element 32ib + 16 + j = dl·kvalues[q[j] >> 4].
#[inline(always)]
pub(super) fn dequantize_iq4_xs(b: &[u8; 136], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let scales_h = u16::from_le_bytes([b[2], b[3]]);
    let scales_l = [b[4], b[5], b[6], b[7]];
    for ib in 0..8 {
        let dl = d * iq4xs_scale(ib, scales_h, &scales_l) as f32;
        let q = &b[8 + 16 * ib..8 + 16 * ib + 16];
        let y = &mut y[32 * ib..32 * ib + 32];
        for j in 0..16 {
            y[j] = dl * KVALUES_IQ4NL[(q[j] & 0xF) as usize] as f32;
            y[j + 16] = dl * KVALUES_IQ4NL[(q[j] >> 4) as usize] as f32;
        }
    }
}

/// The code whose value `scale·kvalue` is nearest to x.
fn nearest_kvalue(x: f32, scale: f32) -> u8 {
    let err = |k: usize| (x - scale * KVALUES_IQ4NL[k] as f32).abs();
    (0..16)
        .min_by(|&a, &b| err(a).total_cmp(&err(b)))
        .unwrap_or(0) as u8
}

pub(super) fn quantize_iq4_nl(x: &[f32; 32], b: &mut [u8; 18]) -> Result<(), usize> {
    let (imax, max) = signed_absmax(x);
    let d = f16_away(max / -127.0).ok_or(imax)?;
    put_f16(b, 0, d);
    let d = d.to_f32();
    for j in 0..16 {
        b[2 + j] = nearest_kvalue(x[j], d) | nearest_kvalue(x[j + 16], d) << 4;
    }
    Ok(())
}

/// IQ4_XS: per sub-block s_ib = (largest-magnitude element) / −127; d = f16 ≥ max|s| / 31;
/// ls − 32 = s_ib / d rounded away from zero (so |dl| ≥ |s_ib|), in −31..=31.
pub(super) fn quantize_iq4_xs(x: &[f32; 256], b: &mut [u8; 136]) -> Result<(), usize> {
    let mut s = [0.0f32; 8];
    for (ib, v) in s.iter_mut().enumerate() {
        *v = signed_absmax(&x[32 * ib..32 * ib + 32]).1 / -127.0;
    }
    let ibmax = (0..8)
        .max_by(|&a, &c| s[a].abs().total_cmp(&s[c].abs()))
        .unwrap_or(0);
    let d = f16_ceil(s[ibmax].abs() / 31.0).ok_or(32 * ibmax)?;
    let df = d.to_f32();
    let mut scales_h = 0u16;
    let mut scales_l = [0u8; 4];
    for ib in 0..8 {
        let l = if df == 0.0 {
            0.0
        } else {
            (s[ib].abs() / df).ceil().min(31.0).copysign(s[ib])
        };
        let ls = (l as i32 + 32) as u8;
        scales_l[ib / 2] |= (ls & 0xF) << (4 * (ib % 2));
        scales_h |= ((ls >> 4) as u16) << (2 * ib);
        let dl = df * (ls as i32 - 32) as f32;
        for j in 0..16 {
            let (lo, hi) = (x[32 * ib + j], x[32 * ib + 16 + j]);
            b[8 + 16 * ib + j] = nearest_kvalue(lo, dl) | nearest_kvalue(hi, dl) << 4;
        }
    }
    put_f16(b, 0, d);
    b[2..4].copy_from_slice(&scales_h.to_le_bytes());
    b[4..8].copy_from_slice(&scales_l);
    Ok(())
}
