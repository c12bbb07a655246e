//! Lossless widening: re-encoding a tensor in a wider block format without changing any value,
//! so that neighbours of different types can share one buffer and one kernel (a decode step's
//! q/k/v in one launch, `widen = true` in a spec's stacked entry).
//!
//! Q4_0 and Q5_0 widen to Q8_0: all three are 32-element blocks with one f16 scale `d` and
//! element = code · d, with codes −8..7, −16..15 and −128..127, so each code is stored as an i8
//! under the same scale. Formats with a minimum (Q4_1, Q5_1) or super-block scales (K-quants,
//! IQ4) have no exact Q8_0 form and do not widen.

use super::{QuantError, byte_len};
use crate::GgmlType;

/// The type `ty` widens to without changing any value, if any.
pub fn lossless_widening(ty: GgmlType) -> Option<GgmlType> {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 => Some(GgmlType::Q8_0),
        _ => None,
    }
}

/// The type both `a` and `b` are exactly representable in, itself or by widening: `a` when they
/// are equal, else the wider of the two when one widens to the other, else their common widening.
pub fn common_lossless_type(a: GgmlType, b: GgmlType) -> Option<GgmlType> {
    let (wa, wb) = (lossless_widening(a), lossless_widening(b));
    if a == b {
        Some(a)
    } else if wa == Some(b) {
        Some(b)
    } else if wb == Some(a) {
        Some(a)
    } else if wa.is_some() && wa == wb {
        wa
    } else {
        None
    }
}

/// `src` (whole blocks of `from`, `n_elements` values) re-encoded as `to`: a copy when the types
/// are equal, else `to` must be `from`'s [`lossless_widening`]. Every value dequantizes to
/// exactly what it did.
pub fn widen(from: GgmlType, to: GgmlType, src: &[u8], n_elements: usize) -> Result<Vec<u8>, QuantError> {
    let expected_bytes = byte_len(from, n_elements, "widen")?;
    if src.len() != expected_bytes {
        return Err(QuantError::SizeMismatch { ty: from, n_elements, expected_bytes, actual_bytes: src.len() });
    }
    if from == to {
        return Ok(src.to_vec());
    }
    if lossless_widening(from) != Some(to) {
        return Err(QuantError::Unsupported { ty: from, op: "widen" });
    }
    let mut out = vec![0u8; byte_len(to, n_elements, "widen")?];
    let (dst, _) = out.as_chunks_mut::<34>();
    match from {
        GgmlType::Q4_0 => {
            let (blocks, _) = src.as_chunks::<18>();
            for (b, q8) in blocks.iter().zip(dst) {
                q8[..2].copy_from_slice(&b[..2]);
                for j in 0..16 {
                    q8[2 + j] = ((b[2 + j] & 0xF) as i8 - 8) as u8;
                    q8[18 + j] = ((b[2 + j] >> 4) as i8 - 8) as u8;
                }
            }
        }
        GgmlType::Q5_0 => {
            let (blocks, _) = src.as_chunks::<22>();
            for (b, q8) in blocks.iter().zip(dst) {
                q8[..2].copy_from_slice(&b[..2]);
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                for j in 0..16 {
                    let lo = (b[6 + j] & 0xF) | (((qh >> j) & 1) << 4) as u8;
                    let hi = (b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4) as u8;
                    q8[2 + j] = (lo as i8 - 16) as u8;
                    q8[18 + j] = (hi as i8 - 16) as u8;
                }
            }
        }
        _ => unreachable!("lossless_widening covers only these"),
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize;

    /// Random bytes are valid Q4_0 / Q5_0 blocks except for non-finite f16 scales: those are
    /// replaced, so that equal values compare equal.
    fn random_blocks(ty: GgmlType, n_blocks: usize, seed: u64) -> Vec<u8> {
        let size = ty.type_size() as usize;
        let mut s = seed;
        let mut bytes: Vec<u8> = (0..n_blocks * size)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (s >> 56) as u8
            })
            .collect();
        for b in bytes.chunks_mut(size) {
            if !half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).is_finite() {
                b[1] &= 0x3f; // exponent below all-ones
            }
        }
        bytes
    }

    #[test]
    fn q4_0_and_q5_0_widen_to_q8_0_with_every_value_unchanged() {
        for (ty, seed) in [(GgmlType::Q4_0, 1), (GgmlType::Q5_0, 2)] {
            let n = 64 * 32;
            let src = random_blocks(ty, 64, seed);
            let wide = widen(ty, GgmlType::Q8_0, &src, n).unwrap();
            assert_eq!(wide.len(), 64 * 34);
            let (a, b) = (dequantize(ty, &src, n).unwrap(), dequantize(GgmlType::Q8_0, &wide, n).unwrap());
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                assert!(x.to_bits() == y.to_bits() || (*x == 0.0 && *y == 0.0), "{ty} element {i}: {x} became {y}");
            }
        }
    }

    #[test]
    fn only_exact_widenings_are_offered_or_done() {
        use GgmlType::*;
        assert_eq!(common_lossless_type(Q5_0, Q8_0), Some(Q8_0));
        assert_eq!(common_lossless_type(Q8_0, Q4_0), Some(Q8_0));
        assert_eq!(common_lossless_type(Q4_0, Q5_0), Some(Q8_0));
        assert_eq!(common_lossless_type(Q4_K, Q4_K), Some(Q4_K));
        assert_eq!(common_lossless_type(Q4_K, Q6_K), None);
        assert_eq!(common_lossless_type(Q4_1, Q8_0), None);
        let src = random_blocks(Q4_1, 2, 3);
        assert!(matches!(widen(Q4_1, Q8_0, &src, 64), Err(QuantError::Unsupported { .. })));
        let src = random_blocks(Q5_0, 2, 4);
        assert!(matches!(widen(Q5_0, Q8_0, &src[..30], 64), Err(QuantError::SizeMismatch { .. })));
        assert_eq!(widen(Q5_0, Q5_0, &src, 64).unwrap(), src);
    }
}
