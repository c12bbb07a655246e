//! RMSNorm, fused residual-add + RMSNorm, LayerNorm (model-specs §2 "Common numerics").
//!
//! Each function normalizes every row of `x`, a `[n_rows, dim]` matrix with `dim = w.len()`.

fn check_rows(x: &[f32], dim: usize, what: &str) -> usize {
    assert!(dim > 0, "{what}: weight is empty");
    assert!(
        x.len().is_multiple_of(dim),
        "{what}: x.len() {} is not a multiple of dim {dim}",
        x.len()
    );
    x.len() / dim
}

/// RMSNorm per row: `y = x / sqrt(mean(x²) + eps) · w` (§2; ggml `rms_norm` then `mul`).
/// `x`: `[n_rows, dim]`, `w`: `[dim]`. Sum of squares and scaling in f64.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let dim = w.len();
    check_rows(x, dim, "rms_norm");
    let mut out = vec![0.0f32; x.len()];
    for (row, out_row) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let mean_sq = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64;
        let inv = 1.0 / (mean_sq + eps as f64).sqrt();
        for i in 0..dim {
            out_row[i] = (row[i] as f64 * inv * w[i] as f64) as f32;
        }
    }
    out
}

/// Fused residual add + RMSNorm: `r' = residual + x`, `y = rms_norm(r', w, eps)`.
/// Returns `(r', y)`, both `[n_rows, dim]`. `r'` is rounded to f32 before the norm, as a
/// kernel that writes the residual stream back would do.
pub fn add_rms_norm(residual: &[f32], x: &[f32], w: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    assert_eq!(
        residual.len(),
        x.len(),
        "add_rms_norm: residual and x lengths differ"
    );
    let sum: Vec<f32> = residual.iter().zip(x).map(|(&r, &v)| r + v).collect();
    let normed = rms_norm(&sum, w, eps);
    (sum, normed)
}

/// LayerNorm per row with weight and bias: `y = (x − mean) / sqrt(var + eps) · w + b`,
/// `var = mean((x − mean)²)` (biased, as ggml `norm`; §2 LLM_NORM, used by the DSA indexer's
/// `k_norm`). `x`: `[n_rows, dim]`, `w`, `b`: `[dim]`.
pub fn layer_norm(x: &[f32], w: &[f32], b: &[f32], eps: f32) -> Vec<f32> {
    let dim = w.len();
    check_rows(x, dim, "layer_norm");
    assert_eq!(
        b.len(),
        dim,
        "layer_norm: bias length {} != weight length {dim}",
        b.len()
    );
    let mut out = vec![0.0f32; x.len()];
    for (row, out_row) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / dim as f64;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / dim as f64;
        let inv = 1.0 / (var + eps as f64).sqrt();
        for i in 0..dim {
            out_row[i] = ((row[i] as f64 - mean) * inv * w[i] as f64 + b[i] as f64) as f32;
        }
    }
    out
}
