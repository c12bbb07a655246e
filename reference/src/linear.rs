//! Matrix–vector and matrix–matrix products over weight rows (model-specs §1.5).
//!
//! A weight with GGUF `ne = {K, N}` is `N` rows of `K` floats: `w[n·K + k] = W[n][k]`, and
//! `y[n] = Σ_k W[n][k]·x[k]` (ggml `mul_mat(W, x)`), accumulated in f64.

/// `Σ a_i·b_i` in f64.
pub fn dot(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "dot: lengths differ");
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// `y[n] = Σ_k W[n][k]·x[k]`. `w`: `[n, k]` (GGUF ne `{k, n}`), `x`: `[k]`, returns `[n]`.
pub fn matvec(w: &[f32], k: usize, n: usize, x: &[f32]) -> Vec<f32> {
    assert_eq!(w.len(), k * n, "matvec: w.len() {} != k·n = {k}·{n}", w.len());
    assert_eq!(x.len(), k, "matvec: x.len() {} != k {k}", x.len());
    w.chunks_exact(k).map(|row| dot(row, x) as f32).collect()
}

/// [`matvec`] for each of `t` input rows: `x`: `[t, k]`, returns `[t, n]`.
pub fn matmul(w: &[f32], k: usize, n: usize, x: &[f32], t: usize) -> Vec<f32> {
    assert_eq!(x.len(), t * k, "matmul: x.len() {} != t·k = {t}·{k}", x.len());
    let mut y = Vec::with_capacity(t * n);
    for xt in x.chunks_exact(k) {
        y.extend(matvec(w, k, n, xt));
    }
    y
}
