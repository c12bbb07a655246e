//! DeepSeek-V2-Lite class models (deepseek2) on the GPU (model-specs §6): the MLA decoder with a
//! direct `attn_q` (the spec's tensor list; no q LoRA), YaRN RoPE with its mscale in the softmax scale,
//! leading dense SwiGLU layers, then softmax-routed experts and shared experts — from
//! `specs/deepseek2.toml`'s capabilities and the file's metadata as the CPU reference reads it.

use std::path::Path;

use memra_gguf::GgufFile;
use memra_reference::models::MlaModelHparams;

use super::gpu::{err, Result};
use super::mla::{config_from, ffn_from, MlaDecoder, MlaLayerSpec, MlaSpec, QSpec};
use super::spec::deepseek2::{Deepseek2, Deepseek2Hparams, Deepseek2Weights};
use super::GpuOptions;

pub fn load(path: &Path, opts: &GpuOptions) -> Result<MlaDecoder> {
    let file = GgufFile::open(path).map_err(|e| err(e.to_string()))?;
    let hp = Deepseek2Hparams::from_gguf(&file).map_err(|e| err(e.to_string()))?;
    let w = Deepseek2Weights::from_gguf(&file, &hp).map_err(|e| err(e.to_string()))?;
    let sem = MlaModelHparams::from_gguf(&file).map_err(|e| err(e.to_string()))?;
    let config = config_from(Deepseek2::ARCH, Deepseek2::ROPE, &sem);
    let layers = w
        .layers
        .iter()
        .enumerate()
        .map(|(il, l)| {
            Ok(MlaLayerSpec {
                attn_norm: l.attn_norm,
                q: QSpec::Direct { attn_q: l.attn_q },
                attn_kv_a_mqa: l.attn_kv_a_mqa,
                attn_kv_a_norm: l.attn_kv_a_norm,
                attn_k_b: l.attn_k_b,
                attn_v_b: l.attn_v_b,
                attn_output: l.attn_output,
                indexer: None,
                ffn_norm: l.ffn_norm,
                ffn: ffn_from(
                    il,
                    [l.ffn_gate, l.ffn_up, l.ffn_down],
                    l.ffn_gate_inp,
                    None,
                    [l.ffn_gate_exps, l.ffn_up_exps, l.ffn_down_exps],
                    [l.ffn_gate_shexp, l.ffn_up_shexp, l.ffn_down_shexp],
                )?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let spec = MlaSpec {
        config,
        layers,
        token_embd: w.global.token_embd,
        output_norm: w.global.output_norm,
        output: Some(w.global.output),
    };
    MlaDecoder::load(path, &file, spec, opts)
}
