//! Rotary position embedding, NORM (interleaved) and NEOX, with partial rotary dims
//! (model-specs §2 "RoPE"; ggml `rope_yarn` / `rotate_pairs` without YaRN).
//!
//! For pair `i < n_rot/2`: `θ_i = freq_scale · pos · base^(−2i/n_rot)` and
//! `(y0, y1) = (x0·cos θ_i − x1·sin θ_i, x0·sin θ_i + x1·cos θ_i)`, where the pair is
//! `(x[2i], x[2i+1])` in NORM mode and `(x[i], x[i + n_rot/2])` in NEOX mode. Dims `≥ n_rot`
//! pass through. θ, cos and sin are computed in f64; ggml builds θ by repeated f32
//! multiplication and evaluates f32 sin/cos, so kernels deviate slightly at large positions.
//! YaRN (ext_factor ≠ 0) is not modelled.

/// Which dims form a rotated pair.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RopeMode {
    /// ggml mode 0 (GPT-J, "interleaved"): pairs `(x[2i], x[2i+1])`. deepseek2, glm-dsa.
    Norm,
    /// ggml mode 2: pairs `(x[i], x[i + n_rot/2])`. qwen3, olmoe, gemma3.
    Neox,
}

/// RoPE parameters. `freq_scale` is linear scaling, `1/factor` (1.0 = none).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Rope {
    pub mode: RopeMode,
    /// Rotated dims at the start of each head vector; even, ≤ head_dim.
    pub n_rot: usize,
    pub base: f32,
    pub freq_scale: f32,
}

impl Rope {
    /// No scaling (`freq_scale = 1`).
    pub fn new(mode: RopeMode, n_rot: usize, base: f32) -> Self {
        Rope {
            mode,
            n_rot,
            base,
            freq_scale: 1.0,
        }
    }

    /// `θ_i = freq_scale · pos · base^(−2i/n_rot)` in f64.
    pub fn theta(&self, pos: usize, i: usize) -> f64 {
        self.freq_scale as f64
            * pos as f64
            * (self.base as f64).powf(-2.0 * i as f64 / self.n_rot as f64)
    }
}

/// Rotates the first `rope.n_rot` dims of one head vector `x` in place for position `pos`;
/// the rest of `x` passes through.
///
/// # Panics
/// If `n_rot` is odd or larger than `x.len()`.
pub fn rope_head(x: &mut [f32], pos: usize, rope: &Rope) {
    let n_rot = rope.n_rot;
    assert!(n_rot.is_multiple_of(2), "rope: n_rot {n_rot} is odd");
    assert!(
        n_rot <= x.len(),
        "rope: n_rot {n_rot} > head vector length {}",
        x.len()
    );
    let half = n_rot / 2;
    for i in 0..half {
        let (a, b) = match rope.mode {
            RopeMode::Norm => (2 * i, 2 * i + 1),
            RopeMode::Neox => (i, i + half),
        };
        let (sin, cos) = rope.theta(pos, i).sin_cos();
        let (x0, x1) = (x[a] as f64, x[b] as f64);
        x[a] = (x0 * cos - x1 * sin) as f32;
        x[b] = (x0 * sin + x1 * cos) as f32;
    }
}

/// [`rope_head`] on every head of one token: `x` is `[n_heads, head_dim]`.
pub fn rope_heads(x: &mut [f32], n_heads: usize, head_dim: usize, pos: usize, rope: &Rope) {
    assert_eq!(
        x.len(),
        n_heads * head_dim,
        "rope_heads: x.len() != n_heads·head_dim"
    );
    for head in x.chunks_exact_mut(head_dim) {
        rope_head(head, pos, rope);
    }
}

/// [`rope_heads`] on `n_tokens` tokens: `x` is `[n_tokens, n_heads, head_dim]`, token `t` at
/// `positions[t]`.
pub fn rope_tokens(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    positions: &[usize],
    rope: &Rope,
) {
    let per_token = n_heads * head_dim;
    assert_eq!(
        x.len(),
        positions.len() * per_token,
        "rope_tokens: x.len() != n_tokens·n_heads·head_dim"
    );
    for (tok, &pos) in x.chunks_exact_mut(per_token).zip(positions) {
        rope_heads(tok, n_heads, head_dim, pos, rope);
    }
}
