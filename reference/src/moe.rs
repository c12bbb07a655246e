//! MoE routing and FFNs (model-specs §2 "MoE routing", "FFN PAR gated"; §4 olmoe; §6.5, §7.4
//! glm-dsa).
//!
//! Expert tensors follow GGUF ne `{in, out, n_expert}`, i.e. memory `[expert][out][in]` (§1.5).

use crate::act::{geglu, sigmoid, swiglu};
use crate::linear::matvec;

/// Router probability function (GGUF `{arch}.expert_gating_func`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Gating {
    /// 1: softmax over all experts (olmoe).
    Softmax,
    /// 2: elementwise sigmoid (deepseek V3, glm-dsa).
    Sigmoid,
}

/// Routing hyper-parameters.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct RouterConfig {
    pub gating: Gating,
    /// Experts per token (`expert_used_count`).
    pub n_used: usize,
    /// `expert_weights_norm`: divide the selected weights by their sum.
    pub norm: bool,
    /// `expert_weights_scale`; applied only when neither 0 nor 1.
    pub scale: f32,
}

/// Lower bound of the renorm denominator: 2^−14, the smallest normal f16 (llama.cpp
/// `build_moe_ffn` clamps `weights_sum` to 6.103515625e-5).
pub const RENORM_MIN_SUM: f64 = 6.103515625e-5;

/// Routes one token (§2 steps 2-6):
/// 1. `probs = softmax(logits)` or `sigmoid(logits)` (f64, rounded to f32);
/// 2. selection score `probs[i] + bias[i]` (f32 add, as ggml) if a bias (`exp_probs_b`) is given;
/// 3. the `n_used` highest selection scores, ties toward the lower expert index;
/// 4. weights = the **unbiased** `probs` of the selected experts;
/// 5. if `norm`: `w_i /= max(Σ w, 6.103515625e-5)`;
/// 6. if `scale ∉ {0, 1}`: `w_i *= scale`.
///
/// Returns `(expert, weight)` pairs in selection order (highest selection score first).
/// Group-limited selection (`expert_group_count > 1`) is not modelled (glm-dsa and olmoe use 1).
pub fn route(logits: &[f32], bias: Option<&[f32]>, cfg: &RouterConfig) -> Vec<(usize, f32)> {
    let n_expert = logits.len();
    assert!(
        cfg.n_used <= n_expert,
        "route: n_used {} > n_expert {n_expert}",
        cfg.n_used
    );
    let probs: Vec<f32> = match cfg.gating {
        Gating::Softmax => crate::act::softmax(logits),
        Gating::Sigmoid => logits.iter().map(|&l| sigmoid(l)).collect(),
    };
    let select: Vec<f32> = match bias {
        Some(b) => {
            assert_eq!(b.len(), n_expert, "route: bias.len() != n_expert");
            probs.iter().zip(b).map(|(&p, &b)| p + b).collect()
        }
        None => probs.clone(),
    };
    assert!(
        select.iter().all(|v| !v.is_nan()),
        "route: NaN router score"
    );
    let mut order: Vec<usize> = (0..n_expert).collect();
    order.sort_by(|&a, &b| {
        select[b]
            .partial_cmp(&select[a])
            .expect("no NaN")
            .then(a.cmp(&b))
    });
    order.truncate(cfg.n_used);

    let mut weights: Vec<f64> = order.iter().map(|&e| probs[e] as f64).collect();
    if cfg.norm {
        let sum = weights.iter().sum::<f64>().max(RENORM_MIN_SUM);
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    if cfg.scale != 0.0 && cfg.scale != 1.0 {
        weights.iter_mut().for_each(|w| *w *= cfg.scale as f64);
    }
    order
        .into_iter()
        .zip(weights)
        .map(|(e, w)| (e, w as f32))
        .collect()
}

/// Activation of a gated FFN.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FfnAct {
    /// SwiGLU (qwen3, olmoe, glm-dsa).
    Silu,
    /// GeGLU with tanh GELU (gemma3).
    GeluTanh,
}

/// A dense gated FFN, f32 rows, GGUF names.
#[derive(Copy, Clone, Debug)]
pub struct FfnWeights<'a> {
    /// ne `{n_embd, n_ff}`.
    pub ffn_gate: &'a [f32],
    /// ne `{n_embd, n_ff}`.
    pub ffn_up: &'a [f32],
    /// ne `{n_ff, n_embd}`.
    pub ffn_down: &'a [f32],
}

/// One token through a gated FFN: `down(act(gate·x) ⊙ (up·x))`, `x`: `[n_embd]`.
fn ffn_one(w: &FfnWeights, n_embd: usize, n_ff: usize, act: FfnAct, x: &[f32]) -> Vec<f32> {
    let g = matvec(w.ffn_gate, n_embd, n_ff, x);
    let u = matvec(w.ffn_up, n_embd, n_ff, x);
    let h = match act {
        FfnAct::Silu => swiglu(&g, &u),
        FfnAct::GeluTanh => geglu(&g, &u),
    };
    matvec(w.ffn_down, n_ff, n_embd, &h)
}

/// Dense gated FFN (§2 "PAR"): `down(act(gate·x) ⊙ (up·x))` per token; `x`: `[t, n_embd]`,
/// returns `[t, n_embd]`.
pub fn ffn_gated(w: &FfnWeights, n_embd: usize, n_ff: usize, act: FfnAct, x: &[f32]) -> Vec<f32> {
    assert!(
        x.len().is_multiple_of(n_embd),
        "ffn_gated: x.len() not a multiple of n_embd"
    );
    x.chunks_exact(n_embd)
        .flat_map(|xt| ffn_one(w, n_embd, n_ff, act, xt))
        .collect()
}

/// MoE layer weights, f32 rows, GGUF names. A merged `ffn_gate_up_exps` must be split by the
/// caller (gate = first half of each expert's rows, §2).
#[derive(Copy, Clone, Debug)]
pub struct MoeWeights<'a> {
    /// ne `{n_embd, n_expert}`.
    pub ffn_gate_inp: &'a [f32],
    /// `exp_probs_b.bias`, `[n_expert]`: selection-only bias.
    pub exp_probs_b: Option<&'a [f32]>,
    /// ne `{n_embd, n_ff, n_expert}`.
    pub ffn_gate_exps: &'a [f32],
    /// ne `{n_embd, n_ff, n_expert}`.
    pub ffn_up_exps: &'a [f32],
    /// ne `{n_ff, n_embd, n_expert}`.
    pub ffn_down_exps: &'a [f32],
    /// `ffn_{gate,up,down}_shexp`, width `n_ff_shared`.
    pub shared: Option<FfnWeights<'a>>,
}

/// MoE layer hyper-parameters.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub n_embd: usize,
    /// Per-expert width (`expert_feed_forward_length`, or `feed_forward_length` for olmoe).
    pub n_ff: usize,
    pub n_expert: usize,
    /// Shared-expert width (`expert_shared_count × n_ff`); ignored without shared weights.
    pub n_ff_shared: usize,
    pub router: RouterConfig,
}

/// MoE FFN (§2 step 7, §6.5): per token,
/// `Σ_i w_i·down_i(silu(gate_i·x) ⊙ up_i·x) + shared(x)` with `(i, w_i)` from [`route`] on
/// `ffn_gate_inp·x`. `x`: `[t, n_embd]`, returns `[t, n_embd]`. The sum is f64.
pub fn moe_ffn(w: &MoeWeights, cfg: &MoeConfig, x: &[f32]) -> Vec<f32> {
    let MoeConfig {
        n_embd,
        n_ff,
        n_expert,
        ..
    } = *cfg;
    assert!(
        x.len().is_multiple_of(n_embd),
        "moe_ffn: x.len() not a multiple of n_embd"
    );
    assert_eq!(
        w.ffn_gate_inp.len(),
        n_embd * n_expert,
        "moe_ffn: ffn_gate_inp.len() != n_embd·n_expert"
    );
    let expert_len = n_embd * n_ff;
    for (name, t) in [
        ("ffn_gate_exps", w.ffn_gate_exps),
        ("ffn_up_exps", w.ffn_up_exps),
        ("ffn_down_exps", w.ffn_down_exps),
    ] {
        assert_eq!(
            t.len(),
            n_expert * expert_len,
            "moe_ffn: {name}.len() != n_expert·n_embd·n_ff"
        );
    }

    // Tokens are independent: split them over threads (same arithmetic per token).
    let per_token = 3 * n_embd * (n_ff * cfg.router.n_used + cfg.n_ff_shared);
    crate::models::par_rows(x.len() / n_embd, per_token, |first, rows| {
        moe_tokens(w, cfg, &x[first * n_embd..(first + rows) * n_embd])
    })
}

/// [`moe_ffn`] on a run of tokens.
fn moe_tokens(w: &MoeWeights, cfg: &MoeConfig, x: &[f32]) -> Vec<f32> {
    let MoeConfig {
        n_embd,
        n_ff,
        n_expert,
        ..
    } = *cfg;
    let expert_len = n_embd * n_ff;
    let mut out = Vec::with_capacity(x.len());
    for xt in x.chunks_exact(n_embd) {
        let logits = matvec(w.ffn_gate_inp, n_embd, n_expert, xt);
        let mut acc = vec![0.0f64; n_embd];
        for (e, weight) in route(&logits, w.exp_probs_b, &cfg.router) {
            let expert = FfnWeights {
                ffn_gate: &w.ffn_gate_exps[e * expert_len..][..expert_len],
                ffn_up: &w.ffn_up_exps[e * expert_len..][..expert_len],
                ffn_down: &w.ffn_down_exps[e * expert_len..][..expert_len],
            };
            let y = ffn_one(&expert, n_embd, n_ff, FfnAct::Silu, xt);
            for i in 0..n_embd {
                acc[i] += weight as f64 * y[i] as f64;
            }
        }
        if let Some(shared) = &w.shared {
            let y = ffn_one(shared, n_embd, cfg.n_ff_shared, FfnAct::Silu, xt);
            for i in 0..n_embd {
                acc[i] += y[i] as f64;
            }
        }
        out.extend(acc.into_iter().map(|v| v as f32));
    }
    out
}
