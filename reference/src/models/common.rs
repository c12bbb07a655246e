//! Pieces shared by the whole-model forwards: metadata reading with file/key errors, the token
//! embedding and LM head, forward-input checks, the GQA attention block (qwen3, olmoe, gemma3),
//! dense and MoE FFN weights, and YaRN RoPE (deepseek2).

use memra_gguf::Gguf;

use super::{ModelError, load_f32, par_matmul};
use crate::attention::{AttnShape, Mask, attention};
use crate::moe::{FfnWeights, Gating, MoeConfig, MoeWeights, RouterConfig};
use crate::norm::rms_norm;
use crate::rope::{Rope, rope_tokens};

/// Reads `<arch>.<suffix>` keys of one file; every error names the file and the full key.
pub(crate) struct Meta<'g, B: AsRef<[u8]>> {
    pub gguf: &'g Gguf<B>,
    pub arch: &'static str,
}

impl<'g, B: AsRef<[u8]>> Meta<'g, B> {
    /// Checks `general.architecture` is `arch`.
    pub fn new(gguf: &'g Gguf<B>, arch: &'static str) -> Result<Self, ModelError> {
        let got = gguf.architecture()?;
        if got != arch {
            return Err(ModelError::new(
                gguf.path(),
                format!("general.architecture is \"{got}\", expected \"{arch}\""),
            ));
        }
        Ok(Meta { gguf, arch })
    }

    pub fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch)
    }

    pub fn err(&self, message: impl Into<String>) -> ModelError {
        ModelError::new(self.gguf.path(), message)
    }

    /// A required integer key that must be positive.
    pub fn usize(&self, suffix: &str) -> Result<usize, ModelError> {
        let key = self.key(suffix);
        match self.gguf.get_usize(&key)? {
            0 => Err(self.err(format!("metadata key '{key}' is 0"))),
            v => Ok(v),
        }
    }

    pub fn opt_usize(&self, suffix: &str) -> Result<Option<usize>, ModelError> {
        match self.gguf.get_usize(&self.key(suffix)) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.is_missing_key() => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    pub fn f32(&self, suffix: &str) -> Result<f32, ModelError> {
        Ok(self.gguf.get_f32(&self.key(suffix))?)
    }

    pub fn opt_f32(&self, suffix: &str) -> Result<Option<f32>, ModelError> {
        match self.gguf.get_f32(&self.key(suffix)) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.is_missing_key() => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    pub fn opt_bool(&self, suffix: &str) -> Result<Option<bool>, ModelError> {
        match self.gguf.get_bool(&self.key(suffix)) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.is_missing_key() => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    pub fn opt_str(&self, suffix: &str) -> Result<Option<&'g str>, ModelError> {
        match self.gguf.get_str(&self.key(suffix)) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.is_missing_key() => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// `n_vocab` = ne[1] of `token_embd.weight`, after checking ne[0] is `n_embd`.
    pub fn n_vocab(&self, n_embd: usize) -> Result<usize, ModelError> {
        let embd = super::tensor_info(self.gguf, "token_embd.weight")?;
        if embd.dims.len() != 2 || embd.dims[0] != n_embd as u64 || embd.dims[1] == 0 {
            return Err(self.err(format!(
                "tensor 'token_embd.weight' has shape {:?}, expected [{n_embd}, n_vocab]",
                embd.dims
            )));
        }
        Ok(embd.dims[1] as usize)
    }

    /// `rope.scaling.type` linear or none (or absent): the linear `freq_scale`.
    pub fn linear_rope_scale(&self) -> Result<f32, ModelError> {
        let ty = self.opt_str("rope.scaling.type")?;
        let factor = match self.opt_f32("rope.scaling.factor")? {
            Some(f) => Some(f),
            None => self.opt_f32("rope.scale_linear")?,
        };
        match (ty, factor) {
            (Some("none"), _) | (None | Some("linear"), None) => Ok(1.0),
            (None | Some("linear"), Some(f)) if f > 0.0 => Ok(1.0 / f),
            (None | Some("linear"), Some(f)) => {
                Err(self.err(format!("rope scaling factor {f} must be positive")))
            }
            (Some(other), _) => Err(self.err(format!(
                "metadata key '{}' = \"{other}\" is not supported here (linear or none)",
                self.key("rope.scaling.type")
            ))),
        }
    }
}

/// GQA head geometry keys shared by qwen3 and olmoe (llama.cpp defaults).
pub(crate) struct GqaDims {
    pub n_head_kv: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    pub n_rot: usize,
}

impl GqaDims {
    pub(crate) fn read<B: AsRef<[u8]>>(
        m: &Meta<B>,
        n_embd: usize,
        n_head: usize,
    ) -> Result<Self, ModelError> {
        let n_head_kv = m.opt_usize("attention.head_count_kv")?.unwrap_or(n_head);
        if n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) {
            return Err(m.err(format!(
                "attention.head_count {n_head} is not a multiple of attention.head_count_kv {n_head_kv}"
            )));
        }
        let head_dim_k = m
            .opt_usize("attention.key_length")?
            .unwrap_or(n_embd / n_head);
        let head_dim_v = m.opt_usize("attention.value_length")?.unwrap_or(head_dim_k);
        let n_rot = m.opt_usize("rope.dimension_count")?.unwrap_or(head_dim_k);
        if head_dim_k == 0 || head_dim_v == 0 || n_rot % 2 != 0 || n_rot > head_dim_k {
            return Err(m.err(format!(
                "head dims k {head_dim_k} / v {head_dim_v} with rope.dimension_count {n_rot} are not usable"
            )));
        }
        Ok(GqaDims {
            n_head_kv,
            head_dim_k,
            head_dim_v,
            n_rot,
        })
    }
}

/// Loads `blk.{il}.{name}.weight` (or `.bias` when `name` ends in `.bias`).
pub(crate) fn layer_tensor<B: AsRef<[u8]>>(
    gguf: &Gguf<B>,
    il: usize,
    name: &str,
    dims: &[usize],
) -> Result<Vec<f32>, ModelError> {
    let full = if name.ends_with(".bias") || name.ends_with(".weight") {
        format!("blk.{il}.{name}")
    } else {
        format!("blk.{il}.{name}.weight")
    };
    load_f32(gguf, &full, dims)
}

/// Like [`layer_tensor`], `None` if the file lacks it.
pub(crate) fn opt_layer_tensor<B: AsRef<[u8]>>(
    gguf: &Gguf<B>,
    il: usize,
    name: &str,
    dims: &[usize],
) -> Result<Option<Vec<f32>>, ModelError> {
    let full = if name.ends_with(".bias") || name.ends_with(".weight") {
        format!("blk.{il}.{name}")
    } else {
        format!("blk.{il}.{name}.weight")
    };
    match gguf.tensor(&full) {
        Some(_) => load_f32(gguf, &full, dims).map(Some),
        None => Ok(None),
    }
}

/// Token embedding, final norm and LM head.
pub(crate) struct Head {
    pub token_embd: Vec<f32>,
    /// `output.weight`; `None` = tied to `token_embd`.
    pub output: Option<Vec<f32>>,
    pub output_norm: Vec<f32>,
    pub n_embd: usize,
    pub n_vocab: usize,
}

impl Head {
    /// `output.weight` is loaded when present; `require_output` makes its absence an error.
    pub fn load<B: AsRef<[u8]>>(
        gguf: &Gguf<B>,
        n_embd: usize,
        n_vocab: usize,
        require_output: bool,
    ) -> Result<Self, ModelError> {
        let token_embd = load_f32(gguf, "token_embd.weight", &[n_embd, n_vocab])?;
        let output = match gguf.tensor("output.weight") {
            Some(_) => Some(load_f32(gguf, "output.weight", &[n_embd, n_vocab])?),
            None if require_output => {
                return Err(ModelError::new(
                    gguf.path(),
                    "tensor 'output.weight' is missing",
                ));
            }
            None => None,
        };
        let output_norm = load_f32(gguf, "output_norm.weight", &[n_embd])?;
        Ok(Head {
            token_embd,
            output,
            output_norm,
            n_embd,
            n_vocab,
        })
    }

    /// `[t, n_embd]` rows of `token_embd` times `scale`.
    pub fn embed(&self, tokens: &[u32], scale: f32) -> Vec<f32> {
        let e = self.n_embd;
        let mut x = Vec::with_capacity(tokens.len() * e);
        for &tok in tokens {
            x.extend(
                self.token_embd[tok as usize * e..][..e]
                    .iter()
                    .map(|&v| v * scale),
            );
        }
        x
    }

    /// `head · rms(x)·output_norm` for every row of `x` (`all`) or the last one.
    pub fn logits(&self, x: &[f32], all: bool, eps: f32) -> Vec<f32> {
        let e = self.n_embd;
        let rows = if all { x } else { &x[x.len() - e..] };
        let normed = rms_norm(rows, &self.output_norm, eps);
        let head = self.output.as_deref().unwrap_or(&self.token_embd);
        par_matmul(head, e, self.n_vocab, &normed, rows.len() / e)
    }
}

/// Checks a forward call: tokens present and in range, the cache made for this model
/// (`cache_layers == n_layer`), and room in the context. Returns the first new position.
pub(crate) fn check_forward(
    tokens: &[u32],
    n_vocab: usize,
    cache_layers: usize,
    n_layer: usize,
    start: usize,
    n_ctx: usize,
) -> Result<(), ModelError> {
    if tokens.is_empty() {
        return Err(ModelError::new(None, "forward: no tokens"));
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
        return Err(ModelError::new(
            None,
            format!("token id {bad} is out of range (n_vocab {n_vocab})"),
        ));
    }
    if cache_layers != n_layer {
        return Err(ModelError::new(
            None,
            "forward: the cache was made for another model",
        ));
    }
    if start + tokens.len() > n_ctx {
        return Err(ModelError::new(
            None,
            format!(
                "context full: {start} cached + {} new positions > context_length {n_ctx}",
                tokens.len()
            ),
        ));
    }
    Ok(())
}

pub(crate) fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// KV cache of a GQA model: per layer, `[len, n_head_kv, head_dim]` K and V rows.
#[derive(Clone, Debug)]
pub struct KvCache {
    pub(crate) k: Vec<Vec<f32>>,
    pub(crate) v: Vec<Vec<f32>>,
    pub(crate) len: usize,
}

impl KvCache {
    pub(crate) fn new(n_layer: usize) -> Self {
        KvCache {
            k: vec![Vec::new(); n_layer],
            v: vec![Vec::new(); n_layer],
            len: 0,
        }
    }

    /// Positions stored so far; the next token gets this position.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Where the q/k RMSNorm of a GQA block applies (spec capability `qk_norm`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum QkNorm {
    /// Over each head vector (qwen3, gemma3).
    PerHead,
    /// Over the whole q (resp. k) projection (olmoe).
    Full,
}

/// Weights of a GQA attention block, GGUF names.
pub(crate) struct GqaWeights {
    pub attn_q: Vec<f32>,
    pub attn_k: Vec<f32>,
    pub attn_v: Vec<f32>,
    pub attn_q_norm: Vec<f32>,
    pub attn_k_norm: Vec<f32>,
    pub attn_output: Vec<f32>,
}

impl GqaWeights {
    pub fn load<B: AsRef<[u8]>>(
        gguf: &Gguf<B>,
        il: usize,
        n_embd: usize,
        shape: AttnShape,
        qk_norm: QkNorm,
    ) -> Result<Self, ModelError> {
        let q_dim = shape.n_head * shape.head_dim_k;
        let k_dim = shape.n_kv_head * shape.head_dim_k;
        let v_dim = shape.n_kv_head * shape.head_dim_v;
        let o_dim = shape.n_head * shape.head_dim_v;
        let (qn, kn) = match qk_norm {
            QkNorm::PerHead => (shape.head_dim_k, shape.head_dim_k),
            QkNorm::Full => (q_dim, k_dim),
        };
        let t = |name: &str, dims: &[usize]| layer_tensor(gguf, il, name, dims);
        Ok(GqaWeights {
            attn_q: t("attn_q", &[n_embd, q_dim])?,
            attn_k: t("attn_k", &[n_embd, k_dim])?,
            attn_v: t("attn_v", &[n_embd, v_dim])?,
            attn_q_norm: t("attn_q_norm", &[qn])?,
            attn_k_norm: t("attn_k_norm", &[kn])?,
            attn_output: t("attn_output", &[o_dim, n_embd])?,
        })
    }
}

/// Settings of one GQA attention call.
pub(crate) struct GqaParams<'a> {
    pub shape: AttnShape,
    pub n_embd: usize,
    pub eps: f32,
    pub rope: &'a Rope,
    /// Multiplies q after RoPE (gemma3's `f_attention_scale`); the softmax scale is `kq_scale`.
    pub q_scale: f32,
    pub kq_scale: f32,
    pub window: Option<usize>,
}

/// One GQA attention block for `t` tokens of normed input `h` (`[t, n_embd]`) at positions
/// `start..start+t`: projections, q/k RMSNorm, RoPE, append to the layer's cache, causal
/// attention (sliding window if set), `attn_output`. Returns `[t, n_embd]`, no residual.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gqa_block(
    w: &GqaWeights,
    p: &GqaParams,
    qk_norm: QkNorm,
    h: &[f32],
    positions: &[usize],
    k_cache: &mut Vec<f32>,
    v_cache: &mut Vec<f32>,
) -> Vec<f32> {
    let s = p.shape;
    let (e, t) = (p.n_embd, positions.len());
    let q_dim = s.n_head * s.head_dim_k;
    let k_dim = s.n_kv_head * s.head_dim_k;
    let v_dim = s.n_kv_head * s.head_dim_v;
    let mut q = par_matmul(&w.attn_q, e, q_dim, h, t);
    let mut k = par_matmul(&w.attn_k, e, k_dim, h, t);
    let v = par_matmul(&w.attn_v, e, v_dim, h, t);
    // Per head: each head vector is one norm row; full: each token's projection is one row.
    q = rms_norm(&q, &w.attn_q_norm, p.eps);
    k = rms_norm(&k, &w.attn_k_norm, p.eps);
    debug_assert!(qk_norm == QkNorm::Full || w.attn_q_norm.len() == s.head_dim_k);
    rope_tokens(&mut q, s.n_head, s.head_dim_k, positions, p.rope);
    rope_tokens(&mut k, s.n_kv_head, s.head_dim_k, positions, p.rope);
    if p.q_scale != 1.0 {
        for qv in &mut q {
            *qv *= p.q_scale;
        }
    }
    k_cache.extend_from_slice(&k);
    v_cache.extend_from_slice(&v);
    let t_kv = k_cache.len() / k_dim;
    let mask = Mask {
        q_pos: positions,
        window: p.window,
        allowed: None,
    };
    let attn = attention(&q, k_cache, v_cache, t_kv, s, &mask, p.kq_scale);
    par_matmul(&w.attn_output, s.n_head * s.head_dim_v, e, &attn, t)
}

/// Dense gated FFN weights (`ffn_gate`, `ffn_up`, `ffn_down`, or the `_shexp` triple).
pub(crate) struct DenseFfn {
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
    pub n_ff: usize,
}

impl DenseFfn {
    /// `suffix` is `""` for `ffn_gate` etc. or `"_shexp"`.
    pub fn load<B: AsRef<[u8]>>(
        gguf: &Gguf<B>,
        il: usize,
        suffix: &str,
        n_embd: usize,
        n_ff: usize,
    ) -> Result<Self, ModelError> {
        let t = |name: &str, dims: &[usize]| layer_tensor(gguf, il, name, dims);
        Ok(DenseFfn {
            gate: t(&format!("ffn_gate{suffix}"), &[n_embd, n_ff])?,
            up: t(&format!("ffn_up{suffix}"), &[n_embd, n_ff])?,
            down: t(&format!("ffn_down{suffix}"), &[n_ff, n_embd])?,
            n_ff,
        })
    }

    pub fn weights(&self) -> FfnWeights<'_> {
        FfnWeights {
            ffn_gate: &self.gate,
            ffn_up: &self.up,
            ffn_down: &self.down,
        }
    }

    /// SwiGLU FFN over `[t, n_embd]` with the matmuls split over threads.
    pub fn swiglu(&self, n_embd: usize, h: &[f32]) -> Vec<f32> {
        let t = h.len() / n_embd;
        let g = par_matmul(&self.gate, n_embd, self.n_ff, h, t);
        let u = par_matmul(&self.up, n_embd, self.n_ff, h, t);
        par_matmul(
            &self.down,
            self.n_ff,
            n_embd,
            &crate::act::swiglu(&g, &u),
            t,
        )
    }
}

/// Routing hparams shared by the MoE models.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct MoeHparams {
    pub n_expert: usize,
    pub n_expert_used: usize,
    /// Per-expert width.
    pub n_ff_exp: usize,
    /// Shared-expert width (`expert_shared_count × n_ff_exp`), 0 = none.
    pub n_ff_shexp: usize,
    pub router: RouterConfig,
}

impl MoeHparams {
    /// `expert_gating_func` (1 softmax, 2 sigmoid; `default` when absent).
    pub(crate) fn gating<B: AsRef<[u8]>>(
        meta: &Meta<B>,
        default: Gating,
    ) -> Result<Gating, ModelError> {
        match meta.opt_usize("expert_gating_func")? {
            None => Ok(default),
            Some(1) => Ok(Gating::Softmax),
            Some(2) => Ok(Gating::Sigmoid),
            Some(other) => Err(meta.err(format!(
                "metadata key '{}' = {other} is not supported (1 softmax, 2 sigmoid)",
                meta.key("expert_gating_func")
            ))),
        }
    }

    pub(crate) fn check<B: AsRef<[u8]>>(&self, meta: &Meta<B>) -> Result<(), ModelError> {
        if self.n_expert_used == 0 || self.n_expert_used > self.n_expert {
            return Err(meta.err(format!(
                "expert_used_count {} must be in 1..=expert_count {}",
                self.n_expert_used, self.n_expert
            )));
        }
        Ok(())
    }
}

/// One MoE layer's weights, GGUF names.
pub(crate) struct MoeLayer {
    pub ffn_gate_inp: Vec<f32>,
    pub exp_probs_b: Option<Vec<f32>>,
    pub ffn_gate_exps: Vec<f32>,
    pub ffn_up_exps: Vec<f32>,
    pub ffn_down_exps: Vec<f32>,
    pub shared: Option<DenseFfn>,
}

impl MoeLayer {
    /// `with_bias`: `exp_probs_b.bias` is loaded if present (required when `Some(true)`).
    pub fn load<B: AsRef<[u8]>>(
        gguf: &Gguf<B>,
        il: usize,
        n_embd: usize,
        hp: &MoeHparams,
        bias_required: bool,
    ) -> Result<Self, ModelError> {
        let (ne, nf) = (hp.n_expert, hp.n_ff_exp);
        let t = |name: &str, dims: &[usize]| layer_tensor(gguf, il, name, dims);
        let exp_probs_b = if bias_required {
            Some(t("exp_probs_b.bias", &[ne])?)
        } else {
            opt_layer_tensor(gguf, il, "exp_probs_b.bias", &[ne])?
        };
        Ok(MoeLayer {
            ffn_gate_inp: t("ffn_gate_inp", &[n_embd, ne])?,
            exp_probs_b,
            ffn_gate_exps: t("ffn_gate_exps", &[n_embd, nf, ne])?,
            ffn_up_exps: t("ffn_up_exps", &[n_embd, nf, ne])?,
            ffn_down_exps: t("ffn_down_exps", &[nf, n_embd, ne])?,
            shared: if hp.n_ff_shexp > 0 {
                Some(DenseFfn::load(gguf, il, "_shexp", n_embd, hp.n_ff_shexp)?)
            } else {
                None
            },
        })
    }

    /// [`crate::moe::moe_ffn`] over `[t, n_embd]`.
    pub fn forward(&self, hp: &MoeHparams, n_embd: usize, h: &[f32]) -> Vec<f32> {
        let w = MoeWeights {
            ffn_gate_inp: &self.ffn_gate_inp,
            exp_probs_b: self.exp_probs_b.as_deref(),
            ffn_gate_exps: &self.ffn_gate_exps,
            ffn_up_exps: &self.ffn_up_exps,
            ffn_down_exps: &self.ffn_down_exps,
            shared: self.shared.as_ref().map(DenseFfn::weights),
        };
        let cfg = MoeConfig {
            n_embd,
            n_ff: hp.n_ff_exp,
            n_expert: hp.n_expert,
            n_ff_shared: hp.n_ff_shexp,
            router: hp.router,
        };
        crate::moe::moe_ffn(&w, &cfg, h)
    }
}

/// The FFN of a pre-norm layer.
pub(crate) enum LayerFfn {
    /// SwiGLU (qwen3).
    Dense(DenseFfn),
    /// Routed experts (olmoe).
    Moe(MoeLayer, MoeHparams),
}

/// A pre-norm GQA layer: `x += attn(rms(x)·attn_norm)`, `x += ffn(rms(x)·ffn_norm)`.
pub(crate) struct PreNormLayer {
    pub attn_norm: Vec<f32>,
    pub attn: GqaWeights,
    pub ffn_norm: Vec<f32>,
    pub ffn: LayerFfn,
}

impl PreNormLayer {
    pub fn load<B: AsRef<[u8]>>(
        gguf: &Gguf<B>,
        il: usize,
        n_embd: usize,
        shape: AttnShape,
        qk_norm: QkNorm,
        ffn: LayerFfn,
    ) -> Result<Self, ModelError> {
        Ok(PreNormLayer {
            attn_norm: layer_tensor(gguf, il, "attn_norm", &[n_embd])?,
            attn: GqaWeights::load(gguf, il, n_embd, shape, qk_norm)?,
            ffn_norm: layer_tensor(gguf, il, "ffn_norm", &[n_embd])?,
            ffn,
        })
    }
}

/// Forward of a pre-norm GQA model (qwen3, olmoe) over `tokens` at positions `cache.len()..`:
/// embedding (unscaled), every layer, final norm and head. `n_ctx` bounds the cache.
#[allow(clippy::too_many_arguments)]
pub(crate) fn pre_norm_forward(
    head: &Head,
    layers: &[PreNormLayer],
    params: &GqaParams,
    qk_norm: QkNorm,
    n_ctx: usize,
    cache: &mut KvCache,
    tokens: &[u32],
    all_logits: bool,
) -> Result<Vec<f32>, ModelError> {
    let start = cache.len;
    check_forward(
        tokens,
        head.n_vocab,
        cache.k.len(),
        layers.len(),
        start,
        n_ctx,
    )?;
    let positions: Vec<usize> = (start..start + tokens.len()).collect();
    let e = params.n_embd;
    let mut x = head.embed(tokens, 1.0);
    for (il, w) in layers.iter().enumerate() {
        let h = rms_norm(&x, &w.attn_norm, params.eps);
        let a = gqa_block(
            &w.attn,
            params,
            qk_norm,
            &h,
            &positions,
            &mut cache.k[il],
            &mut cache.v[il],
        );
        add_in_place(&mut x, &a);
        let h = rms_norm(&x, &w.ffn_norm, params.eps);
        let f = match &w.ffn {
            LayerFfn::Dense(d) => d.swiglu(e, &h),
            LayerFfn::Moe(m, hp) => m.forward(hp, e, &h),
        };
        add_in_place(&mut x, &f);
    }
    cache.len = start + tokens.len();
    Ok(head.logits(&x, all_logits, params.eps))
}

/// YaRN RoPE (llama.cpp / ggml `rope_yarn`, model-specs §2): per rotated pair `i`,
/// `θ_extrap = pos·base^(−2i/n_rot)`, `θ_interp = freq_scale·θ_extrap`,
/// `θ = θ_interp·(1 − r_i) + θ_extrap·r_i` with the ramp
/// `r_i = ext_factor·(1 − clamp((i − low)/max(0.001, high − low), 0, 1))`, and
/// `low = max(0, floor(corr(beta_fast)))`, `high = min(n_rot − 1, ceil(corr(beta_slow)))`,
/// `corr(b) = n_rot·ln(n_ctx_orig / (2π·b)) / (2·ln base)`.
/// The magnitude factor is not applied: deepseek2 pre-divides `attn_factor` so that
/// cos/sin stay unscaled, and folds mscale² into the softmax scale instead (§6.4).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Yarn {
    pub n_rot: usize,
    pub base: f32,
    pub freq_scale: f32,
    pub ext_factor: f32,
    /// Correction dims `[low, high]`.
    pub corr_dims: [f32; 2],
    pub interleaved: bool,
}

impl Yarn {
    /// llama.cpp defaults: beta_fast 32, beta_slow 1, ext_factor 1 for YaRN files.
    pub fn new(n_rot: usize, base: f32, freq_scale: f32, n_ctx_orig: usize) -> Self {
        let corr = |beta: f64| {
            n_rot as f64 * (n_ctx_orig as f64 / (beta * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * (base as f64).ln())
        };
        let low = corr(32.0).floor().max(0.0);
        let high = corr(1.0).ceil().min(n_rot as f64 - 1.0);
        Yarn {
            n_rot,
            base,
            freq_scale,
            ext_factor: 1.0,
            corr_dims: [low as f32, high as f32],
            interleaved: true,
        }
    }

    pub fn theta(&self, pos: usize, i: usize) -> f64 {
        let extrap = pos as f64 * (self.base as f64).powf(-2.0 * i as f64 / self.n_rot as f64);
        let interp = self.freq_scale as f64 * extrap;
        if self.ext_factor == 0.0 {
            return interp;
        }
        let [low, high] = self.corr_dims.map(|v| v as f64);
        let y = (i as f64 - low) / (high - low).max(0.001);
        let ramp = (1.0 - y.clamp(0.0, 1.0)) * self.ext_factor as f64;
        interp * (1.0 - ramp) + extrap * ramp
    }

    /// Rotates the first `n_rot` dims of `x` (one head) for `pos`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.n_rot / 2;
        for i in 0..half {
            let (a, b) = if self.interleaved {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + half)
            };
            let (sin, cos) = self.theta(pos, i).sin_cos();
            let (x0, x1) = (x[a] as f64, x[b] as f64);
            x[a] = (x0 * cos - x1 * sin) as f32;
            x[b] = (x0 * sin + x1 * cos) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rope::{RopeMode, rope_head};

    #[test]
    fn yarn_without_extrapolation_is_plain_rope() {
        let mut y = Yarn::new(16, 10_000.0, 0.25, 4096);
        y.ext_factor = 0.0;
        let plain = Rope {
            mode: RopeMode::Norm,
            n_rot: 16,
            base: 10_000.0,
            freq_scale: 0.25,
        };
        let x: Vec<f32> = (0..20).map(|i| (i as f32 * 0.37).sin()).collect();
        let (mut a, mut b) = (x.clone(), x.clone());
        y.apply(&mut a, 37);
        rope_head(&mut b, 37, &plain);
        assert_eq!(a, b);
        assert_eq!(&a[16..], &x[16..], "dims past n_rot pass through");
    }

    #[test]
    fn yarn_ramp_extrapolates_high_frequencies_and_interpolates_low_ones() {
        // DeepSeek-V2-Lite: 64 rope dims, base 1e4, factor 40 over 4096 positions.
        let y = Yarn::new(64, 10_000.0, 1.0 / 40.0, 4096);
        let [low, high] = y.corr_dims;
        assert!(0.0 < low && low < high && high < 63.0, "{low} {high}");
        let extrap = |i: usize| 100.0 * 10_000f64.powf(-2.0 * i as f64 / 64.0);
        // Pair 0 rotates fastest: kept as trained. The last pair: interpolated (÷ 40).
        assert!((y.theta(100, 0) - extrap(0)).abs() < 1e-9);
        // (freq_scale is the f32 nearest 1/40.)
        let interp = y.theta(100, 31) / (extrap(31) / 40.0);
        assert!((interp - 1.0).abs() < 1e-6, "{interp}");
        let mid = ((low + high) / 2.0) as usize;
        let t = y.theta(100, mid);
        assert!(extrap(mid) / 40.0 < t && t < extrap(mid), "pair {mid}: {t}");
    }
}
