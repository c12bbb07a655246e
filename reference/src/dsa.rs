//! DeepSeek Sparse Attention lightning indexer, glm-dsa flavour (model-specs §8.1, §8.2, §8.4),
//! exact top-k selection, and an MLA block restricted to the selected keys.
//!
//! Per query token t (at position p_t) and key token s (position s):
//! - `q(t) = indexer.attn_q_b · qr_t`, reshaped `[H_I, d_I]`; each head is `[rope | nope]`
//!   (**rope first**, the opposite of MLA) and the rope part is roped at `p_t`.
//! - `k(s) = LayerNorm(indexer.attn_k · x_s; k_norm weight, bias)`, `[d_I]`, one key shared by
//!   all indexer heads, same split, roped at `s`.
//! - `w(t) = indexer.proj · x_t · 1/sqrt(d_I·H_I)`, `[H_I]` (glm-dsa pre-scaling, §8.4 step 6).
//! - `score(t, s) = Σ_h w_h(t) · ReLU(q_h(t) · k(s))` for `s ≤ p_t`, −∞ otherwise.
//! - keep the `min(top_k, p_t + 1)` highest-scoring visible keys.
//!
//! Omitted on purpose: the Hadamard rotation of q and k (§8.2 step 4, §8.4 step 4) is
//! orthogonal, so `q·k` is unchanged in exact arithmetic (it only helps FP8); and the FP8
//! quantization of q and the key cache (§8.2 step 5). Both only perturb rounding.

use crate::attention::Mask;
use crate::linear::dot;
// `linear::matmul`'s arithmetic with the rows split over threads (GLM-5-dim prefills).
use crate::mla::{MlaCache, MlaConfig, MlaMode, MlaWeights, mla_attend_output, mla_project};
use crate::models::par_matmul;
use crate::norm::layer_norm;
use crate::rope::{Rope, RopeMode, rope_head};

/// Indexer geometry.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct IndexerDims {
    /// H_I (`attention.indexer.head_count`).
    pub n_head: usize,
    /// d_I (`attention.indexer.key_length`).
    pub head_dim: usize,
    /// Roped dims at the start of each head (= `rope.dimension_count`).
    pub rope: usize,
}

impl IndexerDims {
    /// GLM-5 (§7.1): 32 heads of 128, rope part 64.
    pub const GLM5: IndexerDims = IndexerDims {
        n_head: 32,
        head_dim: 128,
        rope: 64,
    };
}

/// Indexer weights, f32 rows, named as in GGUF (`blk.i.indexer.<name>`).
#[derive(Copy, Clone, Debug)]
pub struct IndexerWeights<'a> {
    /// `indexer.attn_q_b`, ne `{q_lora, n_head·head_dim}`.
    pub attn_q_b: &'a [f32],
    /// `indexer.attn_k`, ne `{n_embd, head_dim}`.
    pub attn_k: &'a [f32],
    /// `indexer.k_norm.weight`, `[head_dim]`.
    pub k_norm_weight: &'a [f32],
    /// `indexer.k_norm.bias`, `[head_dim]`.
    pub k_norm_bias: &'a [f32],
    /// `indexer.proj`, ne `{n_embd, n_head}`.
    pub proj: &'a [f32],
}

/// Indexer hyper-parameters.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct IndexerConfig {
    pub dims: IndexerDims,
    pub n_embd: usize,
    pub q_lora: usize,
    /// `n_rot` must equal `dims.rope`. GLM-5: NORM (interleaved); DeepSeek-V3.2: NEOX (§8.3).
    pub rope: Rope,
    /// LayerNorm eps of `k_norm` (1e-6 in the DeepSeek reference, §8.2 step 3).
    pub k_norm_eps: f32,
    /// `attention.indexer.top_k`.
    pub top_k: usize,
}

impl IndexerConfig {
    /// GLM-5 (§7.1, §7.2, §8.3): 32×128, rope 64 interleaved, base 1e6, top_k 2048.
    pub fn glm5() -> Self {
        IndexerConfig {
            dims: IndexerDims::GLM5,
            n_embd: 6144,
            q_lora: 2048,
            rope: Rope::new(RopeMode::Norm, 64, 1e6),
            k_norm_eps: 1e-6,
            top_k: 2048,
        }
    }
}

/// Indexer queries `[t, n_head, head_dim]` from `qr` (`[t, q_lora]`, the MLA `attn_q_a_norm`
/// output) at `positions`, rope part (first `dims.rope` dims of each head) roped.
pub fn indexer_q(
    w: &IndexerWeights,
    cfg: &IndexerConfig,
    qr: &[f32],
    positions: &[usize],
) -> Vec<f32> {
    let IndexerDims {
        n_head,
        head_dim,
        rope,
    } = cfg.dims;
    assert_eq!(cfg.rope.n_rot, rope, "indexer_q: rope.n_rot != dims.rope");
    let mut q = par_matmul(
        w.attn_q_b,
        cfg.q_lora,
        n_head * head_dim,
        qr,
        positions.len(),
    );
    for (ti, &pos) in positions.iter().enumerate() {
        for h in 0..n_head {
            rope_head(
                &mut q[(ti * n_head + h) * head_dim..][..head_dim],
                pos,
                &cfg.rope,
            );
        }
    }
    q
}

/// Indexer keys `[t, head_dim]` from `x` (`[t, n_embd]`, the `attn_norm` output) at
/// `positions`: `LayerNorm(attn_k·x)`, then the rope part roped.
pub fn indexer_k(
    w: &IndexerWeights,
    cfg: &IndexerConfig,
    x: &[f32],
    positions: &[usize],
) -> Vec<f32> {
    let head_dim = cfg.dims.head_dim;
    assert_eq!(
        cfg.rope.n_rot, cfg.dims.rope,
        "indexer_k: rope.n_rot != dims.rope"
    );
    let raw = par_matmul(w.attn_k, cfg.n_embd, head_dim, x, positions.len());
    let mut k = layer_norm(&raw, w.k_norm_weight, w.k_norm_bias, cfg.k_norm_eps);
    for (ti, &pos) in positions.iter().enumerate() {
        rope_head(&mut k[ti * head_dim..][..head_dim], pos, &cfg.rope);
    }
    k
}

/// Head weights `[t, n_head]`: `proj·x · 1/sqrt(head_dim·n_head)`.
pub fn indexer_weights(w: &IndexerWeights, cfg: &IndexerConfig, x: &[f32], t: usize) -> Vec<f32> {
    let IndexerDims {
        n_head, head_dim, ..
    } = cfg.dims;
    let scale = 1.0 / ((head_dim * n_head) as f64).sqrt();
    par_matmul(w.proj, cfg.n_embd, n_head, x, t)
        .into_iter()
        .map(|v| (v as f64 * scale) as f32)
        .collect()
}

/// Index scores `[t_q, t_kv]`: `Σ_h weights[t][h]·ReLU(q[t][h]·k[s])` (f64) for `s ≤ q_pos[t]`,
/// `−∞` for later keys. `q`: `[t_q, n_head, head_dim]`, `weights`: `[t_q, n_head]`,
/// `k`: `[t_kv, head_dim]`.
pub fn indexer_scores(
    q: &[f32],
    weights: &[f32],
    k: &[f32],
    dims: IndexerDims,
    q_pos: &[usize],
) -> Vec<f32> {
    let IndexerDims {
        n_head, head_dim, ..
    } = dims;
    let t_q = q_pos.len();
    assert_eq!(
        q.len(),
        t_q * n_head * head_dim,
        "indexer_scores: q.len() != t_q·n_head·head_dim"
    );
    assert_eq!(
        weights.len(),
        t_q * n_head,
        "indexer_scores: weights.len() != t_q·n_head"
    );
    assert!(
        k.len().is_multiple_of(head_dim),
        "indexer_scores: k.len() not a multiple of head_dim"
    );
    let t_kv = k.len() / head_dim;
    for (t, &pos) in q_pos.iter().enumerate() {
        assert!(
            pos < t_kv,
            "indexer_scores: query {t} at position {pos} but {t_kv} keys"
        );
    }
    // Query rows are independent: split them over threads (same arithmetic per row).
    crate::models::par_rows(t_q, t_kv * n_head * head_dim, |first, rows| {
        let mut scores = vec![f32::NEG_INFINITY; rows * t_kv];
        for t in first..first + rows {
            for s in 0..=q_pos[t] {
                let ks = &k[s * head_dim..][..head_dim];
                let mut acc = 0.0f64;
                for h in 0..n_head {
                    let qk = dot(&q[(t * n_head + h) * head_dim..][..head_dim], ks);
                    acc += weights[t * n_head + h] as f64 * qk.max(0.0);
                }
                scores[(t - first) * t_kv + s] = acc as f32;
            }
        }
        scores
    })
}

/// Indices of the `min(k, scores.len())` largest scores, returned in **ascending index order**
/// (a set). Ties are broken toward the lower index: index `i` is kept iff fewer than `k`
/// indices `j` have `scores[j] > scores[i]`, or `scores[j] == scores[i]` and `j < i`
/// (−0 and +0 compare equal).
///
/// # Panics
/// If a score is NaN.
pub fn top_k(scores: &[f32], k: usize) -> Vec<usize> {
    assert!(scores.iter().all(|v| !v.is_nan()), "top_k: NaN score");
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    if k == 0 {
        return Vec::new();
    }
    if k < idx.len() {
        // Total order: score descending, then index ascending.
        idx.select_nth_unstable_by(k - 1, |&a, &b| {
            scores[b]
                .partial_cmp(&scores[a])
                .expect("no NaN")
                .then(a.cmp(&b))
        });
        idx.truncate(k);
    }
    idx.sort_unstable();
    idx
}

/// Per query `t`: [`top_k`] over its visible keys `scores[t][0..=q_pos[t]]` (`scores`:
/// `[t_q, t_kv]`). Every list has `min(top_k, q_pos[t] + 1)` entries.
pub fn select_top_k(
    scores: &[f32],
    q_pos: &[usize],
    t_kv: usize,
    top_k_count: usize,
) -> Vec<Vec<usize>> {
    assert_eq!(
        scores.len(),
        q_pos.len() * t_kv,
        "select_top_k: scores.len() != t_q·t_kv"
    );
    q_pos
        .iter()
        .enumerate()
        .map(|(t, &p)| {
            assert!(
                p < t_kv,
                "select_top_k: query {t} at position {p} but {t_kv} keys"
            );
            top_k(&scores[t * t_kv..][..=p], top_k_count)
        })
        .collect()
}

/// The indexer's key cache, `[len, head_dim]`; row `s` has position `s`.
#[derive(Clone, Debug, Default)]
pub struct IndexerCache {
    pub k: Vec<f32>,
}

/// MLA block with DSA (§8.4): project the `t` new tokens `x` (`[t, n_embd]`, `attn_norm`
/// output) at positions `cache.len()..`, append to both caches, score every visible key with
/// the indexer, keep the top-k per query, run MLA over those keys only, `attn_output`.
/// Returns (`[t, n_embd]`, the selected kv rows per query in ascending order).
#[allow(clippy::too_many_arguments)]
pub fn dsa_mla_block(
    mla_w: &MlaWeights,
    mla_cfg: &MlaConfig,
    idx_w: &IndexerWeights,
    idx_cfg: &IndexerConfig,
    x: &[f32],
    cache: &mut MlaCache,
    idx_cache: &mut IndexerCache,
    mode: MlaMode,
) -> (Vec<f32>, Vec<Vec<usize>>) {
    let t = x.len() / mla_cfg.n_embd;
    assert_eq!(
        x.len(),
        t * mla_cfg.n_embd,
        "dsa_mla_block: x.len() not a multiple of n_embd"
    );
    assert_eq!(
        idx_cfg.n_embd, mla_cfg.n_embd,
        "dsa_mla_block: indexer and MLA n_embd differ"
    );
    assert_eq!(
        idx_cfg.q_lora, mla_cfg.q_lora,
        "dsa_mla_block: indexer and MLA q_lora differ"
    );
    assert_eq!(
        idx_cache.k.len(),
        cache.len() * idx_cfg.dims.head_dim,
        "dsa_mla_block: caches hold different token counts"
    );
    let positions: Vec<usize> = (cache.len()..cache.len() + t).collect();

    let proj = mla_project(mla_w, mla_cfg, x, &positions);
    cache.append(&proj);
    let iq = indexer_q(idx_w, idx_cfg, &proj.qr, &positions);
    idx_cache.k.extend(indexer_k(idx_w, idx_cfg, x, &positions));
    let iw = indexer_weights(idx_w, idx_cfg, x, t);
    let scores = indexer_scores(&iq, &iw, &idx_cache.k, idx_cfg.dims, &positions);
    let selected = select_top_k(&scores, &positions, cache.len(), idx_cfg.top_k);

    let mask = Mask {
        q_pos: &positions,
        window: None,
        allowed: Some(&selected),
    };
    let out = mla_attend_output(mla_w, mla_cfg, &proj.q, cache, &mask, mode);
    (out, selected)
}
