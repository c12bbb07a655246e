//! Softmax, activations and gated-FFN products (model-specs §2). Evaluated in f64, stored f32.

/// Numerically stable softmax of one row: `p_i = exp(x_i − max) / Σ_j exp(x_j − max)`.
/// −∞ entries get probability 0. A row that is all −∞ (nothing visible) returns all zeros
/// rather than NaN; callers that mask must not rely on NaN here.
pub fn softmax(x: &[f32]) -> Vec<f32> {
    softmax_f64(&x.iter().map(|&v| v as f64).collect::<Vec<_>>())
        .into_iter()
        .map(|p| p as f32)
        .collect()
}

/// [`softmax`] over each row of `x`: `[n_rows, dim]`.
///
/// # Panics
/// If `x.len()` is not a multiple of `dim`.
pub fn softmax_rows(x: &[f32], dim: usize) -> Vec<f32> {
    assert!(
        dim > 0 && x.len().is_multiple_of(dim),
        "softmax_rows: x.len() {} not a multiple of dim {dim}",
        x.len()
    );
    x.chunks_exact(dim).flat_map(softmax).collect()
}

/// f64 softmax used by the attention references.
pub(crate) fn softmax_f64(x: &[f64]) -> Vec<f64> {
    let max = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return vec![0.0; x.len()];
    }
    let e: Vec<f64> = x.iter().map(|&v| (v - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.into_iter().map(|v| v / sum).collect()
}

/// GELU, tanh approximation, exact formula (§2 ggml_gelu; HF `gelu_pytorch_tanh`):
/// `0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³)))`. Not ggml's f16 lookup table.
pub fn gelu_tanh(x: f32) -> f32 {
    let x = x as f64;
    let sqrt_2_over_pi = (2.0 / std::f64::consts::PI).sqrt();
    (0.5 * x * (1.0 + (sqrt_2_over_pi * (x + 0.044715 * x * x * x)).tanh())) as f32
}

/// SiLU: `x · sigmoid(x) = x / (1 + exp(−x))`.
pub fn silu(x: f32) -> f32 {
    let x = x as f64;
    (x / (1.0 + (-x).exp())) as f32
}

/// Logistic sigmoid `1 / (1 + exp(−x))` (MoE gating func 2, §2).
pub fn sigmoid(x: f32) -> f32 {
    (1.0 / (1.0 + (-(x as f64)).exp())) as f32
}

/// `max(x, 0)`.
pub fn relu(x: f32) -> f32 {
    x.max(0.0)
}

/// SwiGLU: `silu(g) ⊙ u` elementwise (§2 FFN "PAR" gated, SiLU).
pub fn swiglu(g: &[f32], u: &[f32]) -> Vec<f32> {
    assert_eq!(g.len(), u.len(), "swiglu: gate and up lengths differ");
    g.iter()
        .zip(u)
        .map(|(&g, &u)| (silu(g) as f64 * u as f64) as f32)
        .collect()
}

/// GeGLU: `gelu_tanh(g) ⊙ u` elementwise (§5.1 gemma3 FFN).
pub fn geglu(g: &[f32], u: &[f32]) -> Vec<f32> {
    assert_eq!(g.len(), u.len(), "geglu: gate and up lengths differ");
    g.iter()
        .zip(u)
        .map(|(&g, &u)| (gelu_tanh(g) as f64 * u as f64) as f32)
        .collect()
}
