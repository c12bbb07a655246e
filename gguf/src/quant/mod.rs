//! Every ggml quant block format on the CPU.
//!
//! - [`dequantize_row`] / [`dequantize`]: bytes → f32. These are the oracle that GPU kernels are
//!   tested against, so each block function is written to read like the layout comment above it
//!   (ggml `ggml-common.h` / `dequantize_row_*` in `ggml-quants.c`; model-specs.md §1.4). The
//!   float operations are done in the same order as ggml and gguf-py, so results are bit-identical
//!   to `gguf.quants.dequantize` (checked by `tests/quant_golden.rs` and the real-file test).
//! - [`widen`]: a tensor re-encoded in a wider format, every value unchanged (Q4_0 / Q5_0 → Q8_0).
//! - [`quantize`]: f32 → bytes, for test fixtures. Simple round-to-nearest with a scale search
//!   that guarantees coverage (see `quantize_*` docs); not bit-identical to llama.cpp's quantizer.
//!
//! Supported types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL,
//! IQ4_XS (the same set as [`GgmlType::is_supported`]).

mod float;
mod iq4;
mod k;
mod legacy;
mod widen;

use crate::GgmlType;

pub use iq4::{KVALUES_IQ4NL, iq4xs_scale};
pub use k::{Q4K_SCALES_BYTES, q4k_scale_min};
pub use widen::{common_lossless_type, lossless_widening, widen};

/// Why a quant operation was refused. Every variant names the ggml type.
#[derive(Debug, Clone, PartialEq)]
pub enum QuantError {
    /// The type has no CPU implementation here (`op` is "dequantize" or "quantize").
    Unsupported { ty: GgmlType, op: &'static str },
    /// The element count is not a whole number of blocks.
    NotWholeBlocks { ty: GgmlType, n_elements: usize },
    /// The byte slice does not hold exactly the blocks for `n_elements`.
    SizeMismatch {
        ty: GgmlType,
        n_elements: usize,
        expected_bytes: usize,
        actual_bytes: usize,
    },
    /// A quantizer input is NaN/inf, or too large for the format's f16 scale or value field.
    Unrepresentable {
        ty: GgmlType,
        index: usize,
        value: f32,
    },
}

impl std::fmt::Display for QuantError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QuantError::Unsupported { ty, op } => {
                write!(f, "{ty}: {op} is not supported on the CPU")
            }
            QuantError::NotWholeBlocks { ty, n_elements } => write!(
                f,
                "{ty}: {n_elements} elements is not a whole number of {}-element blocks",
                ty.block_size()
            ),
            QuantError::SizeMismatch {
                ty,
                n_elements,
                expected_bytes,
                actual_bytes,
            } => write!(
                f,
                "{ty}: {n_elements} elements need {expected_bytes} bytes, got {actual_bytes}"
            ),
            QuantError::Unrepresentable { ty, index, value } => {
                write!(
                    f,
                    "{ty}: element {index} ({value}) cannot be quantized (non-finite or out of range)"
                )
            }
        }
    }
}

impl std::error::Error for QuantError {}

/// Whether this module can dequantize and quantize `ty`.
pub fn is_supported(ty: GgmlType) -> bool {
    ty.is_supported()
}

/// Bytes that `n_elements` of `ty` occupy, checking support and block divisibility.
pub fn byte_len(ty: GgmlType, n_elements: usize, op: &'static str) -> Result<usize, QuantError> {
    if !is_supported(ty) {
        return Err(QuantError::Unsupported { ty, op });
    }
    if !n_elements.is_multiple_of(ty.block_size() as usize) {
        return Err(QuantError::NotWholeBlocks { ty, n_elements });
    }
    (n_elements / ty.block_size() as usize)
        .checked_mul(ty.type_size() as usize)
        .ok_or(QuantError::NotWholeBlocks { ty, n_elements })
}

/// Dequantizes `dst.len()` elements of type `ty` from `src`, which must hold exactly those blocks.
/// Works on any run of whole blocks (a row, several rows, a whole tensor).
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    let expected_bytes = byte_len(ty, dst.len(), "dequantize")?;
    if src.len() != expected_bytes {
        return Err(QuantError::SizeMismatch {
            ty,
            n_elements: dst.len(),
            expected_bytes,
            actual_bytes: src.len(),
        });
    }
    use GgmlType::*;
    match ty {
        F32 => float::dequantize_f32(src, dst),
        F16 => float::dequantize_f16(src, dst),
        BF16 => float::dequantize_bf16(src, dst),
        Q8_0 => for_each_block(src, dst, legacy::dequantize_q8_0),
        Q4_0 => for_each_block(src, dst, legacy::dequantize_q4_0),
        Q4_1 => for_each_block(src, dst, legacy::dequantize_q4_1),
        Q5_0 => for_each_block(src, dst, legacy::dequantize_q5_0),
        Q5_1 => for_each_block(src, dst, legacy::dequantize_q5_1),
        Q4_K => for_each_block(src, dst, k::dequantize_q4_k),
        Q5_K => for_each_block(src, dst, k::dequantize_q5_k),
        Q6_K => for_each_block(src, dst, k::dequantize_q6_k),
        IQ4_NL => for_each_block(src, dst, iq4::dequantize_iq4_nl),
        IQ4_XS => for_each_block(src, dst, iq4::dequantize_iq4_xs),
        _ => {
            return Err(QuantError::Unsupported {
                ty,
                op: "dequantize",
            });
        }
    }
    Ok(())
}

/// Dequantizes `n_elements` of type `ty` into a new vector.
pub fn dequantize(ty: GgmlType, src: &[u8], n_elements: usize) -> Result<Vec<f32>, QuantError> {
    let mut out = vec![0.0; n_elements];
    dequantize_row(ty, src, &mut out)?;
    Ok(out)
}

/// Quantizes `src` (a whole number of blocks of finite values) to `ty`'s block bytes.
pub fn quantize(ty: GgmlType, src: &[f32]) -> Result<Vec<u8>, QuantError> {
    let n_bytes = byte_len(ty, src.len(), "quantize")?;
    if let Some(index) = src.iter().position(|x| !x.is_finite()) {
        return Err(QuantError::Unrepresentable {
            ty,
            index,
            value: src[index],
        });
    }
    let mut out = vec![0u8; n_bytes];
    use GgmlType::*;
    // Block quantizers report an overflowing scale as Err(element index within the block).
    let result = match ty {
        F32 => float::quantize_f32(src, &mut out),
        F16 => float::quantize_f16(src, &mut out),
        BF16 => float::quantize_bf16(src, &mut out),
        Q8_0 => for_each_block_quantize(src, &mut out, legacy::quantize_q8_0),
        Q4_0 => for_each_block_quantize(src, &mut out, legacy::quantize_q4_0),
        Q4_1 => for_each_block_quantize(src, &mut out, legacy::quantize_q4_1),
        Q5_0 => for_each_block_quantize(src, &mut out, legacy::quantize_q5_0),
        Q5_1 => for_each_block_quantize(src, &mut out, legacy::quantize_q5_1),
        Q4_K => for_each_block_quantize(src, &mut out, k::quantize_q4_k),
        Q5_K => for_each_block_quantize(src, &mut out, k::quantize_q5_k),
        Q6_K => for_each_block_quantize(src, &mut out, k::quantize_q6_k),
        IQ4_NL => for_each_block_quantize(src, &mut out, iq4::quantize_iq4_nl),
        IQ4_XS => for_each_block_quantize(src, &mut out, iq4::quantize_iq4_xs),
        _ => return Err(QuantError::Unsupported { ty, op: "quantize" }),
    };
    result.map_err(|index| QuantError::Unrepresentable {
        ty,
        index,
        value: src[index],
    })?;
    Ok(out)
}

/// Runs a block dequantizer over whole blocks; callers have checked the lengths.
#[inline(always)]
fn for_each_block<const BYTES: usize, const N: usize>(
    src: &[u8],
    dst: &mut [f32],
    block: impl Fn(&[u8; BYTES], &mut [f32; N]),
) {
    let (blocks, _) = src.as_chunks::<BYTES>();
    let (outs, _) = dst.as_chunks_mut::<N>();
    for (b, y) in blocks.iter().zip(outs) {
        block(b, y);
    }
}

/// Runs a block quantizer over whole blocks; maps a block-relative failing index to a global one.
fn for_each_block_quantize<const BYTES: usize, const N: usize>(
    src: &[f32],
    dst: &mut [u8],
    block: impl Fn(&[f32; N], &mut [u8; BYTES]) -> Result<(), usize>,
) -> Result<(), usize> {
    let (xs, _) = src.as_chunks::<N>();
    let (outs, _) = dst.as_chunks_mut::<BYTES>();
    for (i, (x, b)) in xs.iter().zip(outs).enumerate() {
        block(x, b).map_err(|j| i * N + j)?;
    }
    Ok(())
}

/// Reads the little-endian f16 at `at` as f32.
#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Writes `v` as a little-endian f16 at `at`.
fn put_f16(b: &mut [u8], at: usize, v: half::f16) {
    b[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
}

/// The smallest f16 that is >= `v` (f16 scales are rounded so the grid still covers the data).
/// `None` if that overflows f16.
fn f16_ceil(v: f32) -> Option<half::f16> {
    let h = half::f16::from_f32(v);
    let h = if h.to_f32() < v { f16_next_up(h) } else { h };
    h.is_finite().then_some(h)
}

/// The largest f16 that is <= `v`, or `None` on overflow.
fn f16_floor(v: f32) -> Option<half::f16> {
    f16_ceil(-v).map(|h| -h)
}

/// The f16 with the same sign as `v` and the smallest magnitude >= |v|, or `None` on overflow.
fn f16_away(v: f32) -> Option<half::f16> {
    if v >= 0.0 { f16_ceil(v) } else { f16_floor(v) }
}

/// Next f16 towards +inf (finite input).
fn f16_next_up(h: half::f16) -> half::f16 {
    let bits = h.to_bits();
    let next = if bits == 0x8000 {
        0x0001 // -0 → smallest positive subnormal
    } else if bits & 0x8000 != 0 {
        bits - 1 // negative: magnitude shrinks
    } else {
        bits + 1
    };
    half::f16::from_bits(next)
}

/// Index (in the block) and value of the element with the largest magnitude; the first wins ties.
fn signed_absmax(x: &[f32]) -> (usize, f32) {
    let mut best = (0, 0.0f32);
    for (i, &v) in x.iter().enumerate() {
        if v.abs() > best.1.abs() {
            best = (i, v);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_rounding_helpers_bracket_the_value() {
        for v in [
            0.1f32,
            -0.1,
            1.0 / 127.0,
            -3.3e-5,
            6.0e-8,
            1000.7,
            -1000.7,
            0.0,
        ] {
            let c = f16_ceil(v).unwrap().to_f32();
            let f = f16_floor(v).unwrap().to_f32();
            let a = f16_away(v).unwrap().to_f32();
            assert!(c >= v && f <= v, "{v}: floor {f} ceil {c}");
            assert!(
                a.abs() >= v.abs() && (a == 0.0 || a.signum() == v.signum()),
                "{v}: away {a}"
            );
            // Tight: one step further in is on the other side of v.
            if c != v {
                assert!(f16_next_up(f16_floor(v).unwrap()).to_f32() == c, "{v}");
            }
        }
        assert_eq!(f16_ceil(70000.0), None);
        assert_eq!(f16_floor(-70000.0), None);
    }

    #[test]
    fn errors_name_the_type() {
        let mut dst = [0.0f32; 32];
        let e = dequantize_row(GgmlType::Q4_K, &[0; 18], &mut dst).unwrap_err();
        assert_eq!(
            e,
            QuantError::NotWholeBlocks {
                ty: GgmlType::Q4_K,
                n_elements: 32
            }
        );
        assert!(e.to_string().starts_with("Q4_K: 32 elements"), "{e}");

        let e = dequantize_row(GgmlType::Q8_0, &[0; 33], &mut dst).unwrap_err();
        assert!(
            e.to_string().contains("Q8_0") && e.to_string().contains("34 bytes"),
            "{e}"
        );

        let e = dequantize_row(GgmlType::Q2_K, &[0; 84], &mut [0.0; 256]).unwrap_err();
        assert_eq!(
            e,
            QuantError::Unsupported {
                ty: GgmlType::Q2_K,
                op: "dequantize"
            }
        );
        assert!(e.to_string().contains("Q2_K"), "{e}");

        let e = quantize(GgmlType::Q8_0, &[f32::NAN; 32]).unwrap_err();
        assert!(
            matches!(
                e,
                QuantError::Unrepresentable {
                    ty: GgmlType::Q8_0,
                    index: 0,
                    ..
                }
            ),
            "{e}"
        );
        let e = quantize(GgmlType::IQ4_XS, &[0.0; 32]).unwrap_err();
        assert!(e.to_string().contains("IQ4_XS"), "{e}");
        let e = quantize(GgmlType::Q4_0, &[1.0e30; 32]).unwrap_err();
        assert!(
            matches!(
                e,
                QuantError::Unrepresentable {
                    ty: GgmlType::Q4_0,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn empty_input_is_fine() {
        for ty in GgmlType::all().filter(|t| t.is_supported()) {
            assert_eq!(dequantize(ty, &[], 0).unwrap(), Vec::<f32>::new());
            assert_eq!(quantize(ty, &[]).unwrap(), Vec::<u8>::new());
        }
    }
}
