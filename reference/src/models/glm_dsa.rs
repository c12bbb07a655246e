//! glm-dsa (GLM-5 class) CPU reference forward (model-specs §7; llama.cpp
//! `src/models/glm-dsa.cpp`): MLA with a q LoRA (`attn_q_a` → `attn_q_a_norm` → `attn_q_b`),
//! the DSA lightning indexer keeping the top `attention.indexer.top_k` keys per query (exactly
//! dense MLA while at most top-k keys are visible, §8.4), `leading_dense_block_count` dense
//! SwiGLU layers, then MoE layers routed by sigmoid with the `exp_probs_b` selection bias,
//! renormalized and scaled by `expert_weights_scale`, plus a shared expert. The nextn (MTP)
//! blocks are loaded when present and not run. The body is [`super::mla_model`].

use std::path::Path;

use memra_gguf::{Gguf, GgufFile};

use super::mla_model::{DsaSelections, MlaArch, MlaModel, MlaModelCache, MlaModelHparams};
use super::ModelError;
use crate::mla::MlaMode;
use crate::moe::Gating;

const ARCH: MlaArch = MlaArch {
    name: "glm-dsa",
    // The glm-dsa loader defaults to sigmoid (model-specs §7.2).
    default_gating: Gating::Sigmoid,
    dsa: true,
};

pub type GlmDsaHparams = MlaModelHparams;
pub type GlmDsaCache = MlaModelCache;

/// The glm-dsa model with f32 weights.
pub struct GlmDsa {
    inner: MlaModel,
}

impl GlmDsa {
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        Self::from_gguf(&GgufFile::open(path.as_ref())?)
    }

    pub fn from_gguf<B: AsRef<[u8]>>(gguf: &Gguf<B>) -> Result<Self, ModelError> {
        let inner = MlaModel::from_gguf(gguf, ARCH)?;
        if inner.hparams.q_lora.is_none() {
            return Err(ModelError::new(
                gguf.path(),
                "glm-dsa needs 'glm-dsa.attention.q_lora_rank' (the indexer reads the q latent)",
            ));
        }
        Ok(GlmDsa { inner })
    }

    /// The hyper-parameters as the forward reads them (router, YaRN, softmax scale, indexer),
    /// without loading any weight: the GPU forward shares these semantics.
    pub fn hparams_from_gguf<B: AsRef<[u8]>>(gguf: &Gguf<B>) -> Result<GlmDsaHparams, ModelError> {
        MlaModelHparams::from_gguf(gguf, ARCH)
    }

    pub fn hparams(&self) -> &GlmDsaHparams {
        &self.inner.hparams
    }

    pub fn new_cache(&self) -> GlmDsaCache {
        self.inner.new_cache()
    }

    /// Runs `tokens` at positions `cache.len()..`, appending to `cache`. Returns logits
    /// `[n_out, n_vocab]`: every position if `all_logits`, else the last.
    pub fn forward(
        &self,
        cache: &mut GlmDsaCache,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>, ModelError> {
        Ok(self.inner.forward_traced(cache, tokens, all_logits)?.0)
    }

    /// [`GlmDsa::forward`] that also returns, per indexer layer, the kv rows each query kept.
    pub fn forward_traced(
        &self,
        cache: &mut GlmDsaCache,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<(Vec<f32>, DsaSelections), ModelError> {
        self.inner.forward_traced(cache, tokens, all_logits)
    }

    /// Test hook: `true` runs plain causal MLA on every layer (no top-k restriction).
    pub fn set_dense_attention(&mut self, dense: bool) {
        self.inner.set_dense_attention(dense);
    }

    /// Layers that carry indexer tensors.
    pub fn indexer_layers(&self) -> Vec<usize> {
        self.inner.indexer_layers()
    }

    /// MTP (nextn) blocks found in the file and loaded (never run).
    pub fn n_nextn_loaded(&self) -> usize {
        self.inner.n_nextn_loaded()
    }

    /// Test hook: naive or absorbed MLA (default absorbed, as llama.cpp).
    pub fn set_mla_mode(&mut self, mode: MlaMode) {
        self.inner.set_mla_mode(mode);
    }
}
