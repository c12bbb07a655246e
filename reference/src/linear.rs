//! Matrix–vector and matrix–matrix products over weight rows (model-specs §1.5).
//!
//! A weight with GGUF `ne = {K, N}` is `N` rows of `K` floats: `w[n·K + k] = W[n][k]`, and
//! `y[n] = Σ_k W[n][k]·x[k]` (ggml `mul_mat(W, x)`), accumulated in f64.

use memra_gguf::GgmlType;
use memra_gguf::quant::{self, QuantError};

/// `Σ a_i·b_i` in f64. Summed in 8 interleaved partial sums (lane `i % 8`), then the lanes
/// in order: a fixed, deterministic order that lets the compiler vectorize (a single running
/// sum cannot be reordered). Each product of two f32 is exact in f64.
pub fn dot(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "dot: lengths differ");
    let mut lanes = [0.0f64; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let (a_tail, b_tail) = (a8.remainder(), b8.remainder());
    for (x, y) in a8.zip(b8) {
        for i in 0..8 {
            lanes[i] += x[i] as f64 * y[i] as f64;
        }
    }
    for i in 0..a_tail.len() {
        lanes[i] += a_tail[i] as f64 * b_tail[i] as f64;
    }
    lanes.iter().sum()
}

/// `y[n] = Σ_k W[n][k]·x[k]`. `w`: `[n, k]` (GGUF ne `{k, n}`), `x`: `[k]`, returns `[n]`.
pub fn matvec(w: &[f32], k: usize, n: usize, x: &[f32]) -> Vec<f32> {
    assert_eq!(
        w.len(),
        k * n,
        "matvec: w.len() {} != k·n = {k}·{n}",
        w.len()
    );
    assert_eq!(x.len(), k, "matvec: x.len() {} != k {k}", x.len());
    w.chunks_exact(k).map(|row| dot(row, x) as f32).collect()
}

/// [`matvec`] for each of `t` input rows: `x`: `[t, k]`, returns `[t, n]`.
pub fn matmul(w: &[f32], k: usize, n: usize, x: &[f32], t: usize) -> Vec<f32> {
    assert_eq!(
        x.len(),
        t * k,
        "matmul: x.len() {} != t·k = {t}·{k}",
        x.len()
    );
    let mut y = Vec::with_capacity(t * n);
    for xt in x.chunks_exact(k) {
        y.extend(matvec(w, k, n, xt));
    }
    y
}

/// Bytes of one `k`-element row of `ty`, and a check that `data` holds exactly `n` such rows.
fn gguf_row_bytes(ty: GgmlType, data: &[u8], k: usize, n: usize) -> Result<usize, QuantError> {
    let row_bytes = quant::byte_len(ty, k, "dequantize")?;
    let expected_bytes = row_bytes * n;
    if data.len() != expected_bytes {
        return Err(QuantError::SizeMismatch {
            ty,
            n_elements: k * n,
            expected_bytes,
            actual_bytes: data.len(),
        });
    }
    Ok(row_bytes)
}

/// Dequantizes a whole GGUF matrix (ne `{k, n}`, type `ty`) to `[n, k]` f32 rows.
pub fn dequantize_matrix(
    ty: GgmlType,
    data: &[u8],
    k: usize,
    n: usize,
) -> Result<Vec<f32>, QuantError> {
    let row_bytes = gguf_row_bytes(ty, data, k, n)?;
    let mut w = vec![0.0f32; k * n];
    for (src, dst) in data
        .chunks_exact(row_bytes.max(1))
        .zip(w.chunks_exact_mut(k))
    {
        quant::dequantize_row(ty, src, dst)?;
    }
    Ok(w)
}

/// [`matvec`] with a GGUF-typed weight: `data` is the tensor's bytes (ne `{k, n}`, type `ty`),
/// dequantized row by row with `memra_gguf::quant::dequantize_row`. Errors if `ty` is not
/// supported, `k` is not a whole number of blocks, or `data` is not exactly `n` rows.
pub fn matvec_gguf(
    ty: GgmlType,
    data: &[u8],
    k: usize,
    n: usize,
    x: &[f32],
) -> Result<Vec<f32>, QuantError> {
    matmul_gguf(ty, data, k, n, x, 1)
}

/// Columns `cols` of the dequantized GGUF weight (ne `{k, n}`): one vector of `n` values per
/// column, in `cols`' order (streamed row by row: no dequantized copy of the whole tensor).
pub fn columns_gguf(ty: GgmlType, data: &[u8], k: usize, n: usize, cols: &[usize]) -> Result<Vec<Vec<f32>>, QuantError> {
    let row_bytes = ty.row_bytes(k as u64).unwrap_or(0) as usize;
    if row_bytes * n != data.len() {
        return Err(QuantError::SizeMismatch { ty, n_elements: k * n, expected_bytes: row_bytes * n, actual_bytes: data.len() });
    }
    let mut out = vec![Vec::with_capacity(n); cols.len()];
    let mut row = vec![0.0f32; k];
    for r in 0..n {
        quant::dequantize_row(ty, &data[r * row_bytes..(r + 1) * row_bytes], &mut row)?;
        for (o, &c) in out.iter_mut().zip(cols) {
            o.push(row[c]);
        }
    }
    Ok(out)
}

/// [`matmul`] with a GGUF-typed weight (see [`matvec_gguf`]): `x`: `[t, k]`, returns `[t, n]`.
/// Each weight row is dequantized once and applied to all `t` inputs.
pub fn matmul_gguf(
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
        "matmul_gguf: x.len() {} != t·k = {t}·{k}",
        x.len()
    );
    let row_bytes = gguf_row_bytes(ty, data, k, n)?;
    let mut row = vec![0.0f32; k];
    let mut y = vec![0.0f32; t * n];
    for r in 0..n {
        quant::dequantize_row(ty, &data[r * row_bytes..][..row_bytes], &mut row)?;
        for (ti, xt) in x.chunks_exact(k).enumerate() {
            y[ti * n + r] = dot(&row, xt) as f32;
        }
    }
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_gguf_reads_columns_of_the_rows() {
        // F32, k = 8, n = 2: row r holds 10·r + c.
        let w: Vec<f32> = (0..2).flat_map(|r| (0..8).map(move |c| (10 * r + c) as f32)).collect();
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(columns_gguf(GgmlType::F32, &bytes, 8, 2, &[7, 0]).unwrap(), vec![vec![7.0, 17.0], vec![0.0, 10.0]]);
        assert!(columns_gguf(GgmlType::F32, &bytes[..60], 8, 2, &[0]).is_err());
    }
}
