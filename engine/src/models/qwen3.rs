//! Qwen3 on the GPU (model-specs §3): the GQA decoder with pre-norms, per-head QK-norm, NEOX
//! RoPE, SwiGLU and an LM head that is `output.weight` when present, else the tied embedding —
//! all from `specs/qwen3.toml`'s capabilities.

use std::path::Path;

use memra_gguf::GgufFile;

use super::GpuOptions;
use super::decoder::{Decoder, DecoderConfig, DecoderSpec, FfnSpec, Glu, LayerSpec, NormPlacement, embed_scale};
use super::gpu::{Result, err};
use super::spec::qwen3::{Qwen3, Qwen3Hparams, Qwen3Weights};

pub fn load(path: &Path, opts: &GpuOptions) -> Result<Decoder> {
    let file = GgufFile::open(path).map_err(|e| err(e.to_string()))?;
    let hp = Qwen3Hparams::from_gguf(&file).map_err(|e| err(e.to_string()))?;
    let w = Qwen3Weights::from_gguf(&file, &hp).map_err(|e| err(e.to_string()))?;
    if hp.head_dim_v != hp.head_dim {
        return Err(err(format!("{}: key length {} != value length {} (the GPU attention needs them equal)", path.display(), hp.head_dim, hp.head_dim_v)));
    }
    let n_embd = hp.n_embd as usize;
    let config = DecoderConfig {
        arch: Qwen3::ARCH,
        n_embd,
        n_head: hp.n_head as usize,
        n_kv: hp.n_head_kv as usize,
        head_dim: hp.head_dim as usize,
        n_rot: hp.n_rot as usize,
        n_ff: hp.n_ff as usize,
        n_ctx_train: hp.n_ctx_train as usize,
        eps: hp.rms_eps,
        qk_norm: Qwen3::QK_NORM,
        rope_mode: Qwen3::ROPE,
        norm: NormPlacement::from_token(Qwen3::NORM)?,
        glu: Glu::from_token(Qwen3::FFN)?,
        embed_scale: embed_scale(Qwen3::EMBEDDING_SCALE, n_embd)?,
        // model-specs §3 step 5: softmax(q·k / sqrt(head_dim)).
        attn_scale: 1.0 / (hp.head_dim as f32).sqrt(),
        moe: None,
        widen_qkv: Qwen3::WIDEN_STACKS,
    };
    let layers = w
        .layers
        .iter()
        .map(|l| LayerSpec {
            attn_norm: l.attn_norm,
            attn_q: l.attn_q,
            attn_k: l.attn_k,
            attn_v: l.attn_v,
            attn_q_norm: Some(l.attn_q_norm),
            attn_k_norm: Some(l.attn_k_norm),
            attn_output: l.attn_output,
            post_attention_norm: None,
            ffn_norm: l.ffn_norm,
            ffn: FfnSpec::Dense { ffn_gate: l.ffn_gate, ffn_up: l.ffn_up, ffn_down: l.ffn_down },
            post_ffw_norm: None,
            rope_base: hp.rope_freq_base,
            rope_scale: 1.0,
            window: None,
        })
        .collect();
    let spec = DecoderSpec { config, layers, token_embd: w.global.token_embd, output_norm: w.global.output_norm, output: w.global.output };
    Decoder::load(path, &file, spec, opts)
}
