//! Qwen3 CPU reference forward (model-specs §3; llama.cpp `src/models/qwen3.cpp`).
//!
//! Per token: `x = E[tok]`; per layer: `h = rms(x)·attn_norm`; `q, k, v` projections; per-head
//! RMSNorm of q and k (`attn_q_norm`, `attn_k_norm`) before NEOX RoPE over `n_rot` dims; causal
//! GQA with scale `1/sqrt(head_dim)`; `x += Wo·attn`; `x += down(silu(gate h') ⊙ up h')` with
//! `h' = rms(x)·ffn_norm`. Then `logits = output · (rms(x)·output_norm)`, `output` falling back
//! to `token_embd` when the file ties the head.

use std::path::Path;

use memra_gguf::{Gguf, GgufFile};

use super::ModelError;
use super::common::{
    DenseFfn, GqaDims, GqaParams, Head, KvCache, LayerFfn, Meta, PreNormLayer, QkNorm,
    pre_norm_forward,
};
use crate::attention::AttnShape;
use crate::rope::{Rope, RopeMode};

/// Hyper-parameters from the `qwen3.*` keys (defaults as llama.cpp's loader).
#[derive(Clone, Debug, PartialEq)]
pub struct Qwen3Hparams {
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    pub n_rot: usize,
    pub n_ctx_train: usize,
    pub eps: f32,
    pub rope_base: f32,
    pub rope_freq_scale: f32,
}

impl Qwen3Hparams {
    pub fn from_gguf<B: AsRef<[u8]>>(gguf: &Gguf<B>) -> Result<Self, ModelError> {
        let m = Meta::new(gguf, "qwen3")?;
        let (n_embd, n_head) = (
            m.usize("embedding_length")?,
            m.usize("attention.head_count")?,
        );
        let gqa = GqaDims::read(&m, n_embd, n_head)?;
        Ok(Qwen3Hparams {
            n_vocab: m.n_vocab(n_embd)?,
            n_embd,
            n_layer: m.usize("block_count")?,
            n_ff: m.usize("feed_forward_length")?,
            n_head,
            n_head_kv: gqa.n_head_kv,
            head_dim_k: gqa.head_dim_k,
            head_dim_v: gqa.head_dim_v,
            n_rot: gqa.n_rot,
            n_ctx_train: m.usize("context_length")?,
            eps: m.f32("attention.layer_norm_rms_epsilon")?,
            rope_base: m.opt_f32("rope.freq_base")?.unwrap_or(10_000.0),
            rope_freq_scale: m.linear_rope_scale()?,
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

/// The Qwen3 model with f32 weights.
pub struct Qwen3 {
    pub hparams: Qwen3Hparams,
    head: Head,
    layers: Vec<PreNormLayer>,
}

/// KV cache of a [`Qwen3`].
pub type Qwen3Cache = KvCache;

impl Qwen3 {
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        Self::from_gguf(&GgufFile::open(path.as_ref())?)
    }

    pub fn from_gguf<B: AsRef<[u8]>>(gguf: &Gguf<B>) -> Result<Self, ModelError> {
        let hp = Qwen3Hparams::from_gguf(gguf)?;
        let e = hp.n_embd;
        let layers = (0..hp.n_layer)
            .map(|il| {
                let ffn = LayerFfn::Dense(DenseFfn::load(gguf, il, "", e, hp.n_ff)?);
                PreNormLayer::load(gguf, il, e, hp.shape(), QkNorm::PerHead, ffn)
            })
            .collect::<Result<_, ModelError>>()?;
        let head = Head::load(gguf, e, hp.n_vocab, false)?;
        Ok(Qwen3 {
            hparams: hp,
            head,
            layers,
        })
    }

    pub fn new_cache(&self) -> Qwen3Cache {
        KvCache::new(self.hparams.n_layer)
    }

    /// Runs `tokens` at positions `cache.len()..` (a prefill or decode steps), appending to
    /// `cache`. Returns logits `[n_out, n_vocab]`: every position if `all_logits`, else the last.
    pub fn forward(
        &self,
        cache: &mut Qwen3Cache,
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
            QkNorm::PerHead,
            hp.n_ctx_train,
            cache,
            tokens,
            all_logits,
        )
    }

    /// Whether the LM head is tied to `token_embd` (the file has no `output.weight`).
    pub fn tied_head(&self) -> bool {
        self.head.output.is_none()
    }
}
