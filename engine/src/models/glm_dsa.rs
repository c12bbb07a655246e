//! GLM-5 class models (glm-dsa) on the GPU (model-specs §7, §8): the MLA decoder with a q LoRA,
//! the DSA indexer on the layers that carry its tensors (top-k sparse attention past top_k
//! visible keys), leading dense SwiGLU layers, then sigmoid-routed experts with the selection
//! bias and a shared expert — from `specs/glm-dsa.toml`'s capabilities and the file's metadata
//! as the CPU reference reads it. The nextn (MTP) block is not run.

use std::path::Path;

use memra_gguf::{Gguf, GgufFile};
use memra_reference::models::MlaModelHparams;

use super::gpu::{err, Result, WeightSource};
use super::mla::{config_from, ffn_from, IndexerSpec, MlaDecoder, MlaLayerSpec, MlaSpec, QSpec};
use super::spec::glm_dsa::{GlmDsa, GlmDsaHparams, GlmDsaWeights};
use super::GpuOptions;

pub fn load(path: &Path, opts: &GpuOptions) -> Result<MlaDecoder> {
    let file = GgufFile::open(path).map_err(|e| err(e.to_string()))?;
    load_with(path, &file, &file, opts)
}

/// [`load`] with the weights from `source` (e.g. `crate::synthetic`'s random blocks) and the
/// metadata and tensor table from `file`.
pub fn load_with<B: AsRef<[u8]>>(
    path: &Path,
    file: &Gguf<B>,
    source: &dyn WeightSource,
    opts: &GpuOptions,
) -> Result<MlaDecoder> {
    MlaDecoder::load(path, source, mla_spec(path, file)?, opts)
}

/// The file's weights and semantics as an [`MlaSpec`] (also what each rank of a multi-GPU
/// model starts from, `crate::parallel::sharded`).
pub fn mla_spec<'f, B: AsRef<[u8]>>(path: &Path, file: &'f Gguf<B>) -> Result<MlaSpec<'f>> {
    let hp = GlmDsaHparams::from_gguf(file).map_err(|e| err(e.to_string()))?;
    let w = GlmDsaWeights::from_gguf(file, &hp).map_err(|e| err(e.to_string()))?;
    let sem = MlaModelHparams::from_gguf(file).map_err(|e| err(e.to_string()))?;
    let config = config_from(GlmDsa::ARCH, GlmDsa::ROPE, &sem);
    let mut layers = Vec::with_capacity(w.layers.len());
    for (il, l) in w.layers.iter().enumerate() {
        let indexer = match (
            l.indexer_attn_q_b,
            l.indexer_attn_k,
            l.indexer_k_norm,
            l.indexer_k_norm_bias,
            l.indexer_proj,
        ) {
            (Some(attn_q_b), Some(attn_k), Some(k_norm), Some(k_norm_bias), Some(proj)) => {
                Some(IndexerSpec {
                    attn_q_b,
                    attn_k,
                    k_norm,
                    k_norm_bias,
                    proj,
                })
            }
            (None, None, None, None, None) => None,
            _ => {
                return Err(err(format!(
                    "{}: layer {il} has some indexer tensors but not all five",
                    path.display()
                )))
            }
        };
        layers.push(MlaLayerSpec {
            attn_norm: l.attn_norm,
            q: QSpec::Lora {
                attn_q_a: l.attn_q_a,
                attn_q_a_norm: l.attn_q_a_norm,
                attn_q_b: l.attn_q_b,
            },
            attn_kv_a_mqa: l.attn_kv_a_mqa,
            attn_kv_a_norm: l.attn_kv_a_norm,
            attn_k_b: l.attn_k_b,
            attn_v_b: l.attn_v_b,
            attn_output: l.attn_output,
            indexer,
            ffn_norm: l.ffn_norm,
            ffn: ffn_from(
                il,
                [l.ffn_gate, l.ffn_up, l.ffn_down],
                l.ffn_gate_inp,
                l.exp_probs_b_bias,
                [l.ffn_gate_exps, l.ffn_up_exps, l.ffn_down_exps],
                [l.ffn_gate_shexp, l.ffn_up_shexp, l.ffn_down_shexp],
            )?,
        });
    }
    Ok(MlaSpec {
        config,
        layers,
        token_embd: w.global.token_embd,
        output_norm: w.global.output_norm,
        output: Some(w.global.output),
    })
}
