//! The 32-element "legacy" formats: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (ggml `block_q*_*`).
//!
//! Nibble order, shared by Q4_0/Q4_1/Q5_0/Q5_1 (and IQ4_NL): byte `qs[j]` (j < 16) holds element j
//! in its low nibble and element j + 16 in its high nibble — halves, not interleaved pairs.
//! Q5 formats keep the 5th bit of element i in bit i of `qh`, read as one little-endian u32.
//!
//! Quantizers (fixtures only): one f16 scale per block, rounded *away* from zero (and the Q*_1
//! minimum rounded *down*) so that the block's extreme values stay inside the grid of codes;
//! each element then takes the nearest code. Error per element: at most half a step of the
//! stored scale, except where the grid is one code short on one side (Q4_0/Q5_0: codes −8..7 and
//! −16..15 put the largest-magnitude element on the −8/−16 end, so an element of the opposite
//! sign near the same magnitude is clamped, as in llama.cpp).

use super::{f16_at, f16_away, f16_ceil, f16_floor, put_f16, signed_absmax};

/// Q8_0, 34 bytes: `d: f16` at 0, `qs: [i8; 32]` at 2. Element j = qs[j] · d.
#[inline(always)]
pub(super) fn dequantize_q8_0(b: &[u8; 34], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = (b[2 + j] as i8) as f32 * d;
    }
}

/// Q4_0, 18 bytes: `d: f16` at 0, `qs: [u8; 16]` at 2.
/// Element j = ((qs[j] & 0xF) − 8) · d, element j + 16 = ((qs[j] >> 4) − 8) · d.
#[inline(always)]
pub(super) fn dequantize_q4_0(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0xF) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

/// Q4_1, 20 bytes: `d: f16` at 0, `m: f16` at 2, `qs: [u8; 16]` at 4.
/// Element j = (qs[j] & 0xF) · d + m, element j + 16 = (qs[j] >> 4) · d + m.
#[inline(always)]
pub(super) fn dequantize_q4_1(b: &[u8; 20], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0xF) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// Q5_0, 22 bytes: `d: f16` at 0, `qh: u32 LE` at 2, `qs: [u8; 16]` at 6.
/// Element j = (((qs[j] & 0xF) | bit j of qh << 4) − 16) · d;
/// element j + 16 = (((qs[j] >> 4) | bit (j + 16) of qh << 4) − 16) · d.
#[inline(always)]
pub(super) fn dequantize_q5_0(b: &[u8; 22], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let lo = (qs[j] & 0xF) as u32 | ((qh >> j) & 1) << 4;
        let hi = (qs[j] >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
        y[j] = (lo as i32 - 16) as f32 * d;
        y[j + 16] = (hi as i32 - 16) as f32 * d;
    }
}

/// Q5_1, 24 bytes: `d: f16` at 0, `m: f16` at 2, `qh: u32 LE` at 4, `qs: [u8; 16]` at 8.
/// As Q5_0 without the −16, plus m: element = q · d + m.
#[inline(always)]
pub(super) fn dequantize_q5_1(b: &[u8; 24], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let lo = (qs[j] & 0xF) as u32 | ((qh >> j) & 1) << 4;
        let hi = (qs[j] >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
        y[j] = lo as f32 * d + m;
        y[j + 16] = hi as f32 * d + m;
    }
}

/// Nearest integer code to `x / step`, clamped to `lo..=hi`; 0 when the step is 0.
pub(super) fn nearest_code(x: f32, step: f32, lo: i32, hi: i32) -> i32 {
    if step == 0.0 {
        return 0i32.clamp(lo, hi);
    }
    ((x / step).round() as i32).clamp(lo, hi)
}

/// Q8_0: d = f16 ≥ max|x| / 127, q = round(x / d) ∈ −127..=127. |error| ≤ d / 2.
pub(super) fn quantize_q8_0(x: &[f32; 32], b: &mut [u8; 34]) -> Result<(), usize> {
    let (imax, amax) = signed_absmax(x);
    let d = f16_ceil(amax.abs() / 127.0).ok_or(imax)?;
    put_f16(b, 0, d);
    let d = d.to_f32();
    for j in 0..32 {
        b[2 + j] = nearest_code(x[j], d, -127, 127) as i8 as u8;
    }
    Ok(())
}

/// Q4_0/Q5_0 shared quantizer: d = f16 away from zero of (largest-magnitude element) / −`half`,
/// so that element is code −`half`; codes −half..=half−1 are stored offset by +half.
fn quantize_symmetric<const HALF: i32>(x: &[f32; 32]) -> Result<(half::f16, [u8; 32]), usize> {
    let (imax, max) = signed_absmax(x);
    let d = f16_away(max / -(HALF as f32)).ok_or(imax)?;
    let step = d.to_f32();
    let mut q = [0u8; 32];
    for j in 0..32 {
        q[j] = (nearest_code(x[j], step, -HALF, HALF - 1) + HALF) as u8;
    }
    Ok((d, q))
}

pub(super) fn quantize_q4_0(x: &[f32; 32], b: &mut [u8; 18]) -> Result<(), usize> {
    let (d, q) = quantize_symmetric::<8>(x)?;
    put_f16(b, 0, d);
    pack_nibbles(&q, &mut b[2..18]);
    Ok(())
}

pub(super) fn quantize_q5_0(x: &[f32; 32], b: &mut [u8; 22]) -> Result<(), usize> {
    let (d, q) = quantize_symmetric::<16>(x)?;
    put_f16(b, 0, d);
    b[2..6].copy_from_slice(&pack_fifth_bits(&q).to_le_bytes());
    pack_nibbles(&q, &mut b[6..22]);
    Ok(())
}

/// Q4_1/Q5_1 shared quantizer: m = f16 ≤ min(x), d = f16 ≥ (max(x) − m) / `levels`,
/// q = round((x − m) / d) ∈ 0..=levels.
fn quantize_affine<const LEVELS: i32>(
    x: &[f32; 32],
) -> Result<(half::f16, half::f16, [u8; 32]), usize> {
    let (imin, min) =
        x.iter().copied().enumerate().fold(
            (0, f32::INFINITY),
            |a, (i, v)| if v < a.1 { (i, v) } else { a },
        );
    let (imax, max) = x
        .iter()
        .copied()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |a, (i, v)| if v > a.1 { (i, v) } else { a },
        );
    let m = f16_floor(min).ok_or(imin)?;
    let d = f16_ceil((max - m.to_f32()) / LEVELS as f32).ok_or(imax)?;
    let (step, base) = (d.to_f32(), m.to_f32());
    let mut q = [0u8; 32];
    for j in 0..32 {
        q[j] = nearest_code(x[j] - base, step, 0, LEVELS) as u8;
    }
    Ok((d, m, q))
}

pub(super) fn quantize_q4_1(x: &[f32; 32], b: &mut [u8; 20]) -> Result<(), usize> {
    let (d, m, q) = quantize_affine::<15>(x)?;
    put_f16(b, 0, d);
    put_f16(b, 2, m);
    pack_nibbles(&q, &mut b[4..20]);
    Ok(())
}

pub(super) fn quantize_q5_1(x: &[f32; 32], b: &mut [u8; 24]) -> Result<(), usize> {
    let (d, m, q) = quantize_affine::<31>(x)?;
    put_f16(b, 0, d);
    put_f16(b, 2, m);
    b[4..8].copy_from_slice(&pack_fifth_bits(&q).to_le_bytes());
    pack_nibbles(&q, &mut b[8..24]);
    Ok(())
}

/// Low 4 bits of codes j and j + 16 into byte j (low, high nibble).
pub(super) fn pack_nibbles(q: &[u8; 32], qs: &mut [u8]) {
    for j in 0..16 {
        qs[j] = (q[j] & 0xF) | (q[j + 16] & 0xF) << 4;
    }
}

/// Bit 4 of code i into bit i.
fn pack_fifth_bits(q: &[u8; 32]) -> u32 {
    q.iter()
        .enumerate()
        .fold(0u32, |acc, (i, &v)| acc | (((v >> 4) & 1) as u32) << i)
}
