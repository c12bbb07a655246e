//! Gemma 3 on the GPU (model-specs §5): the GQA decoder with sandwich norms, per-head QK-norm,
//! NEOX RoPE with the local base on sliding-window layers, GeGLU, embeddings × sqrt(n_embd) and
//! the tied LM head — all from `specs/gemma3.toml`'s capabilities.

use std::path::Path;

use memra_gguf::GgufFile;
use memra_reference::models::Gemma3Hparams as Semantics;

use super::GpuOptions;
use super::decoder::{Decoder, DecoderConfig, DecoderSpec, FfnSpec, Glu, LayerSpec, NormPlacement, embed_scale};
use super::gpu::{Result, err};
use super::spec::gemma3::{Gemma3, Gemma3Hparams, Gemma3Weights};

pub fn load(path: &Path, opts: &GpuOptions) -> Result<Decoder> {
    let file = GgufFile::open(path).map_err(|e| err(e.to_string()))?;
    let hp = Gemma3Hparams::from_gguf(&file).map_err(|e| err(e.to_string()))?;
    // Per-layer RoPE base/scale, the window pattern and the attention scale as the CPU reference
    // reads them (one interpretation of the metadata for both paths).
    let sem = Semantics::from_gguf(&file).map_err(|e| err(e.to_string()))?;
    let w = Gemma3Weights::from_gguf(&file, &hp).map_err(|e| err(e.to_string()))?;
    if hp.head_dim_v != hp.head_dim {
        return Err(err(format!("{}: key length {} != value length {} (the GPU attention needs them equal)", path.display(), hp.head_dim, hp.head_dim_v)));
    }
    if sem.final_logit_softcap.is_some() {
        return Err(err(format!("{}: final logit soft-capping is not implemented on the GPU path (use --cpu)", path.display())));
    }
    let n_embd = hp.n_embd as usize;
    let config = DecoderConfig {
        arch: Gemma3::ARCH,
        n_embd,
        n_head: hp.n_head as usize,
        n_kv: hp.n_head_kv as usize,
        head_dim: hp.head_dim as usize,
        n_rot: hp.n_rot as usize,
        n_ff: hp.n_ff as usize,
        n_ctx_train: hp.n_ctx_train as usize,
        eps: hp.rms_eps,
        qk_norm: Gemma3::QK_NORM,
        rope_mode: Gemma3::ROPE,
        norm: NormPlacement::from_token(Gemma3::NORM)?,
        glu: Glu::from_token(Gemma3::FFN)?,
        embed_scale: embed_scale(Gemma3::EMBEDDING_SCALE, n_embd)?,
        attn_scale: sem.attn_scale,
        moe: None,
        widen_qkv: Gemma3::WIDEN_STACKS,
    };
    let layers = w
        .layers
        .iter()
        .enumerate()
        .map(|(il, l)| {
            let rope = sem.rope(il);
            LayerSpec {
                attn_norm: l.attn_norm,
                attn_q: l.attn_q,
                attn_k: l.attn_k,
                attn_v: l.attn_v,
                attn_q_norm: Some(l.attn_q_norm),
                attn_k_norm: Some(l.attn_k_norm),
                attn_output: l.attn_output,
                post_attention_norm: Some(l.post_attention_norm),
                ffn_norm: l.ffn_norm,
                ffn: FfnSpec::Dense { ffn_gate: l.ffn_gate, ffn_up: l.ffn_up, ffn_down: l.ffn_down },
                post_ffw_norm: Some(l.post_ffw_norm),
                rope_base: rope.base,
                rope_scale: rope.freq_scale,
                window: sem.window(il),
            }
        })
        .collect();
    let spec = DecoderSpec { config, layers, token_embd: w.global.token_embd, output_norm: w.global.output_norm, output: None };
    Decoder::load(path, &file, spec, opts)
}
