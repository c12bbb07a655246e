//! Plain float types: F32 (4 bytes), F16 (IEEE binary16, 2 bytes), BF16 (the upper 16 bits of
//! an f32, 2 bytes). All little-endian, one element per "block".

use half::f16;

pub(super) fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.as_chunks::<4>().0.iter().zip(dst) {
        *y = f32::from_le_bytes(*b);
    }
}

pub(super) fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.as_chunks::<2>().0.iter().zip(dst) {
        *y = f16::from_bits(u16::from_le_bytes(*b)).to_f32();
    }
}

/// BF16 → f32 is exact: the 16 bits become the top half of the f32.
pub(super) fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.as_chunks::<2>().0.iter().zip(dst) {
        *y = f32::from_bits((u16::from_le_bytes(*b) as u32) << 16);
    }
}

/// Never fails (the caller has rejected non-finite values); `Result` matches the other quantizers.
pub(super) fn quantize_f32(src: &[f32], dst: &mut [u8]) -> Result<(), usize> {
    for (x, b) in src.iter().zip(dst.as_chunks_mut::<4>().0) {
        *b = x.to_le_bytes();
    }
    Ok(())
}

/// Round to nearest even; a finite value beyond f16's range is an error (index returned).
pub(super) fn quantize_f16(src: &[f32], dst: &mut [u8]) -> Result<(), usize> {
    for (i, (x, b)) in src.iter().zip(dst.as_chunks_mut::<2>().0).enumerate() {
        let h = f16::from_f32(*x);
        if !h.is_finite() {
            return Err(i);
        }
        *b = h.to_bits().to_le_bytes();
    }
    Ok(())
}

/// Round to nearest even on the dropped 16 bits, as ggml's `ggml_compute_fp32_to_bf16`
/// (inputs are finite here, so its NaN branch is not needed).
pub(super) fn quantize_bf16(src: &[f32], dst: &mut [u8]) -> Result<(), usize> {
    for (i, (x, b)) in src.iter().zip(dst.as_chunks_mut::<2>().0).enumerate() {
        let bits = x.to_bits();
        let rounded = ((bits as u64 + 0x7fff + ((bits >> 16) & 1) as u64) >> 16) as u16;
        if rounded & 0x7f80 == 0x7f80 {
            return Err(i); // rounded up to infinity
        }
        *b = rounded.to_le_bytes();
    }
    Ok(())
}
