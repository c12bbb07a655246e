//! OLMoE on the GPU (model-specs §4): the GQA decoder with pre-norms, full-width QK-norm, NEOX
//! RoPE and, in every layer, a routed-expert FFN (softmax router, top-k experts' SwiGLU FFNs,
//! weighted sum; no shared expert) and an untied LM head — from `specs/olmoe.toml`'s
//! capabilities.

use std::path::Path;

use memra_gguf::GgufFile;
use memra_reference::models::OlmoeHparams as Semantics;

use super::GpuOptions;
use super::decoder::{Decoder, DecoderConfig, DecoderSpec, FfnSpec, Glu, LayerSpec, MoeConfig, NormPlacement, embed_scale};
use super::gpu::{Result, err};
use super::spec::olmoe::{Olmoe, OlmoeHparams, OlmoeWeights};

pub fn load(path: &Path, opts: &GpuOptions) -> Result<Decoder> {
    let file = GgufFile::open(path).map_err(|e| err(e.to_string()))?;
    let hp = OlmoeHparams::from_gguf(&file).map_err(|e| err(e.to_string()))?;
    // Router normalization and scale as the CPU reference reads them (expert_weights_norm /
    // expert_weights_scale, absent in OLMoE files: no renormalization, no scale).
    let sem = Semantics::from_gguf(&file).map_err(|e| err(e.to_string()))?;
    let w = OlmoeWeights::from_gguf(&file, &hp).map_err(|e| err(e.to_string()))?;
    let n_embd = hp.n_embd as usize;
    let config = DecoderConfig {
        arch: Olmoe::ARCH,
        n_embd,
        n_head: hp.n_head as usize,
        n_kv: hp.n_head_kv as usize,
        head_dim: hp.head_dim as usize,
        n_rot: hp.n_rot as usize,
        n_ff: hp.n_ff as usize,
        n_ctx_train: hp.n_ctx_train as usize,
        eps: hp.rms_eps,
        qk_norm: Olmoe::QK_NORM,
        rope_mode: Olmoe::ROPE,
        norm: NormPlacement::from_token(Olmoe::NORM)?,
        // The experts' activation (fused into the expert kernel); there are no dense layers.
        glu: Glu::Swiglu,
        embed_scale: embed_scale(Olmoe::EMBEDDING_SCALE, n_embd)?,
        attn_scale: 1.0 / (hp.head_dim as f32).sqrt(),
        moe: Some(MoeConfig {
            n_expert: hp.n_expert as usize,
            n_used: hp.n_expert_used as usize,
            n_ff_exp: hp.n_ff as usize,
            gating: Olmoe::ROUTER,
            norm: sem.moe.router.norm,
            scale: sem.moe.router.scale,
        }),
        widen_qkv: Olmoe::WIDEN_STACKS,
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
            ffn: FfnSpec::Moe {
                ffn_gate_inp: l.ffn_gate_inp,
                ffn_gate_exps: l.ffn_gate_exps,
                ffn_up_exps: l.ffn_up_exps,
                ffn_down_exps: l.ffn_down_exps,
            },
            post_ffw_norm: None,
            rope_base: hp.rope_freq_base,
            rope_scale: sem.rope_freq_scale,
            window: None,
        })
        .collect();
    let spec = DecoderSpec { config, layers, token_embd: w.global.token_embd, output_norm: w.global.output_norm, output: Some(w.global.output) };
    Decoder::load(path, &file, spec, opts)
}
