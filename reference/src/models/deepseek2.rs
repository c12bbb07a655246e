//! deepseek2 (DeepSeek-V2 / V2-Lite) CPU reference forward (model-specs §6; llama.cpp
//! `src/models/deepseek2.cpp`; specs/deepseek2.toml): MLA over the latent cache with a direct
//! `attn_q` when the file has no `attention.q_lora_rank` (V2-Lite) or the q LoRA otherwise,
//! interleaved RoPE with YaRN when `rope.scaling.type = yarn` (softmax scale
//! `mscale²/sqrt(nope + rope)`, `mscale = 1 + yarn_log_multiplier·ln(factor)`, §6.4), no DSA,
//! `leading_dense_block_count` dense SwiGLU layers, then MoE layers (softmax router unless
//! `expert_gating_func` says otherwise, top-`expert_used_count`, optional renorm and scale)
//! plus `expert_shared_count` shared experts. The body is [`super::mla_model`].

use std::path::Path;

use memra_gguf::{Gguf, GgufFile};

use super::mla_model::{MlaArch, MlaModel, MlaModelCache, MlaModelHparams};
use super::ModelError;
use crate::mla::MlaMode;
use crate::moe::Gating;

const ARCH: MlaArch = MlaArch {
    name: "deepseek2",
    // DeepSeek-V2 scores experts by softmax (HF scoring_func "softmax"); V3 files say 2.
    default_gating: Gating::Softmax,
    dsa: false,
};

pub type Deepseek2Hparams = MlaModelHparams;
pub type Deepseek2Cache = MlaModelCache;

/// The deepseek2 model with f32 weights.
pub struct Deepseek2 {
    inner: MlaModel,
}

impl Deepseek2 {
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        Self::from_gguf(&GgufFile::open(path.as_ref())?)
    }

    pub fn from_gguf<B: AsRef<[u8]>>(gguf: &Gguf<B>) -> Result<Self, ModelError> {
        Ok(Deepseek2 {
            inner: MlaModel::from_gguf(gguf, ARCH)?,
        })
    }

    /// The hyper-parameters as the forward reads them (router, YaRN, softmax scale, indexer),
    /// without loading any weight: the GPU forward shares these semantics.
    pub fn hparams_from_gguf<B: AsRef<[u8]>>(
        gguf: &Gguf<B>,
    ) -> Result<Deepseek2Hparams, ModelError> {
        MlaModelHparams::from_gguf(gguf, ARCH)
    }

    pub fn hparams(&self) -> &Deepseek2Hparams {
        &self.inner.hparams
    }

    pub fn new_cache(&self) -> Deepseek2Cache {
        self.inner.new_cache()
    }

    /// Runs `tokens` at positions `cache.len()..`, appending to `cache`. Returns logits
    /// `[n_out, n_vocab]`: every position if `all_logits`, else the last.
    pub fn forward(
        &self,
        cache: &mut Deepseek2Cache,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>, ModelError> {
        Ok(self.inner.forward_traced(cache, tokens, all_logits)?.0)
    }

    /// Test hook: naive or absorbed MLA (default absorbed, as llama.cpp).
    pub fn set_mla_mode(&mut self, mode: MlaMode) {
        self.inner.set_mla_mode(mode);
    }
}
