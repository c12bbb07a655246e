//! Random MLA / indexer weights shared by the MLA and DSA tests.
#![allow(dead_code)]

use memra_reference::Rng;
use memra_reference::dsa::{IndexerConfig, IndexerDims, IndexerWeights};
use memra_reference::mla::{MlaConfig, MlaDims, MlaWeights};
use memra_reference::rope::{Rope, RopeMode};

/// Owned MLA block weights, each matrix N(0, 1/in_features) so activations stay O(1).
pub struct OwnedMla {
    pub attn_q_a: Vec<f32>,
    pub attn_q_a_norm: Vec<f32>,
    pub attn_q_b: Vec<f32>,
    pub attn_kv_a_mqa: Vec<f32>,
    pub attn_kv_a_norm: Vec<f32>,
    pub attn_k_b: Vec<f32>,
    pub attn_v_b: Vec<f32>,
    pub attn_output: Vec<f32>,
}

pub fn mat(rng: &mut Rng, k: usize, n: usize) -> Vec<f32> {
    rng.normal_vec(k * n, 1.0 / (k as f32).sqrt())
}

impl OwnedMla {
    pub fn random(rng: &mut Rng, cfg: &MlaConfig) -> Self {
        let MlaDims {
            n_head,
            kv_lora,
            nope,
            rope,
            v,
        } = cfg.dims;
        OwnedMla {
            attn_q_a: mat(rng, cfg.n_embd, cfg.q_lora),
            attn_q_a_norm: rng.uniform_vec(cfg.q_lora, 0.5, 1.5),
            attn_q_b: mat(rng, cfg.q_lora, n_head * (nope + rope)),
            attn_kv_a_mqa: mat(rng, cfg.n_embd, kv_lora + rope),
            attn_kv_a_norm: rng.uniform_vec(kv_lora, 0.5, 1.5),
            // [n_head][kv_lora][nope]: contracted over nope (query side) and kv_lora (cache side).
            attn_k_b: rng.normal_vec(n_head * kv_lora * nope, 1.0 / (nope as f32).sqrt()),
            attn_v_b: rng.normal_vec(n_head * v * kv_lora, 1.0 / (kv_lora as f32).sqrt()),
            attn_output: mat(rng, n_head * v, cfg.n_embd),
        }
    }

    pub fn view(&self) -> MlaWeights<'_> {
        MlaWeights {
            attn_q_a: &self.attn_q_a,
            attn_q_a_norm: &self.attn_q_a_norm,
            attn_q_b: &self.attn_q_b,
            attn_kv_a_mqa: &self.attn_kv_a_mqa,
            attn_kv_a_norm: &self.attn_kv_a_norm,
            attn_k_b: &self.attn_k_b,
            attn_v_b: &self.attn_v_b,
            attn_output: &self.attn_output,
        }
    }
}

/// GLM-5 head dims with fewer heads and a shrunk n_embd / q_lora.
pub fn small_glm5_config(n_head: usize) -> MlaConfig {
    MlaConfig {
        dims: MlaDims {
            n_head,
            ..MlaDims::GLM5
        },
        n_embd: 256,
        q_lora: 128,
        eps: 1e-5,
        rope: Rope::new(RopeMode::Norm, 64, 1e6),
        kq_scale: 1.0 / 16.0,
    }
}

pub struct OwnedIndexer {
    pub attn_q_b: Vec<f32>,
    pub attn_k: Vec<f32>,
    pub k_norm_weight: Vec<f32>,
    pub k_norm_bias: Vec<f32>,
    pub proj: Vec<f32>,
}

impl OwnedIndexer {
    pub fn random(rng: &mut Rng, cfg: &IndexerConfig) -> Self {
        let IndexerDims {
            n_head, head_dim, ..
        } = cfg.dims;
        OwnedIndexer {
            attn_q_b: mat(rng, cfg.q_lora, n_head * head_dim),
            attn_k: mat(rng, cfg.n_embd, head_dim),
            k_norm_weight: rng.uniform_vec(head_dim, 0.5, 1.5),
            k_norm_bias: rng.normal_vec(head_dim, 0.1),
            proj: mat(rng, cfg.n_embd, n_head),
        }
    }

    pub fn view(&self) -> IndexerWeights<'_> {
        IndexerWeights {
            attn_q_b: &self.attn_q_b,
            attn_k: &self.attn_k,
            k_norm_weight: &self.k_norm_weight,
            k_norm_bias: &self.k_norm_bias,
            proj: &self.proj,
        }
    }
}

/// GLM-5 indexer dims (32×128, rope 64, interleaved) at the shrunk block sizes.
pub fn small_glm5_indexer(mla: &MlaConfig, top_k: usize) -> IndexerConfig {
    IndexerConfig {
        n_embd: mla.n_embd,
        q_lora: mla.q_lora,
        top_k,
        ..IndexerConfig::glm5()
    }
}
