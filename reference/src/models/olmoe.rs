//! OLMoE CPU reference forward (model-specs §4; llama.cpp `src/models/olmoe.cpp`,
//! `build_moe_ffn`).
//!
//! Per token: `x = E[tok]`; per layer: `h = rms(x)·attn_norm`; `q = rms(Wq h)·attn_q_norm` over
//! the whole projection (all heads at once), `k` likewise, `v` plain; NEOX RoPE; causal
//! attention with scale `1/sqrt(head_dim)`; `x += Wo·attn`; then `h' = rms(x)·ffn_norm` and
//! `x += Σ_i w_i·down_i(silu(gate_i h') ⊙ up_i h')` over the top-`expert_used_count` experts of
//! `softmax(ffn_gate_inp·h')`, weights **not** renormalized (unless `expert_weights_norm` says
//! so), no shared expert. Then `logits = output · (rms(x)·output_norm)`.

use std::path::Path;

use memra_gguf::{Gguf, GgufFile};

use super::ModelError;
use super::common::{
    GqaDims, GqaParams, Head, KvCache, LayerFfn, Meta, MoeHparams, MoeLayer, PreNormLayer, QkNorm,
    pre_norm_forward,
};
use crate::attention::AttnShape;
use crate::moe::{Gating, RouterConfig};
use crate::rope::{Rope, RopeMode};

/// Hyper-parameters from the `olmoe.*` keys.
#[derive(Clone, Debug, PartialEq)]
pub struct OlmoeHparams {
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    pub n_rot: usize,
    pub n_ctx_train: usize,
    pub eps: f32,
    pub rope_base: f32,
    pub rope_freq_scale: f32,
    /// `feed_forward_length` is the per-expert width for olmoe.
    pub moe: MoeHparams,
}

impl OlmoeHparams {
    pub fn from_gguf<B: AsRef<[u8]>>(gguf: &Gguf<B>) -> Result<Self, ModelError> {
        let m = Meta::new(gguf, "olmoe")?;
        let (n_embd, n_head) = (
            m.usize("embedding_length")?,
            m.usize("attention.head_count")?,
        );
        let gqa = GqaDims::read(&m, n_embd, n_head)?;
        let n_expert_used = m.usize("expert_used_count")?;
        let moe = MoeHparams {
            n_expert: m.usize("expert_count")?,
            n_expert_used,
            n_ff_exp: m.usize("feed_forward_length")?,
            n_ff_shexp: 0,
            router: RouterConfig {
                gating: MoeHparams::gating(&m, Gating::Softmax)?,
                n_used: n_expert_used,
                // olmoe.cpp calls build_moe_ffn with norm_w = false and no scale (§4 step 5).
                norm: m.opt_bool("expert_weights_norm")?.unwrap_or(false),
                scale: m.opt_f32("expert_weights_scale")?.unwrap_or(1.0),
            },
        };
        moe.check(&m)?;
        Ok(OlmoeHparams {
            n_vocab: m.n_vocab(n_embd)?,
            n_embd,
            n_layer: m.usize("block_count")?,
            n_head,
            n_head_kv: gqa.n_head_kv,
            head_dim_k: gqa.head_dim_k,
            head_dim_v: gqa.head_dim_v,
            n_rot: gqa.n_rot,
            n_ctx_train: m.usize("context_length")?,
            eps: m.f32("attention.layer_norm_rms_epsilon")?,
            rope_base: m.opt_f32("rope.freq_base")?.unwrap_or(10_000.0),
            rope_freq_scale: m.linear_rope_scale()?,
            moe,
        })
    }

    pub fn shape(&self) -> AttnShape {
        AttnShape {
            n_head: self.n_head,
            n_kv_head: self.n_head_kv,
            head_dim_k: self.head_dim_k,
            head_dim_v: self.head_dim_v,
        }
    }

    pub fn rope(&self) -> Rope {
        Rope {
            mode: RopeMode::Neox,
            n_rot: self.n_rot,
            base: self.rope_base,
            freq_scale: self.rope_freq_scale,
        }
    }
}

/// The OLMoE model with f32 weights.
pub struct Olmoe {
    pub hparams: OlmoeHparams,
    head: Head,
    layers: Vec<PreNormLayer>,
}

/// KV cache of an [`Olmoe`].
pub type OlmoeCache = KvCache;

impl Olmoe {
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        Self::from_gguf(&GgufFile::open(path.as_ref())?)
    }

    pub fn from_gguf<B: AsRef<[u8]>>(gguf: &Gguf<B>) -> Result<Self, ModelError> {
        let hp = OlmoeHparams::from_gguf(gguf)?;
        let e = hp.n_embd;
        let layers = (0..hp.n_layer)
            .map(|il| {
                let ffn = LayerFfn::Moe(MoeLayer::load(gguf, il, e, &hp.moe, false)?, hp.moe);
                PreNormLayer::load(gguf, il, e, hp.shape(), QkNorm::Full, ffn)
            })
            .collect::<Result<_, ModelError>>()?;
        // §4: untied `output`, but accept a tied file as llama.cpp does.
        let head = Head::load(gguf, e, hp.n_vocab, false)?;
        Ok(Olmoe {
            hparams: hp,
            head,
            layers,
        })
    }

    pub fn new_cache(&self) -> OlmoeCache {
        KvCache::new(self.hparams.n_layer)
    }

    /// Runs `tokens` at positions `cache.len()..`, appending to `cache`. Returns logits
    /// `[n_out, n_vocab]`: every position if `all_logits`, else the last.
    pub fn forward(
        &self,
        cache: &mut OlmoeCache,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>, ModelError> {
        let hp = &self.hparams;
        let rope = hp.rope();
        let params = GqaParams {
            shape: hp.shape(),
            n_embd: hp.n_embd,
            eps: hp.eps,
            rope: &rope,
            q_scale: 1.0,
            kq_scale: 1.0 / (hp.head_dim_k as f32).sqrt(),
            window: None,
        };
        pre_norm_forward(
            &self.head,
            &self.layers,
            &params,
            QkNorm::Full,
            hp.n_ctx_train,
            cache,
            tokens,
            all_logits,
        )
    }
}
