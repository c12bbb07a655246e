//! CPU-only: every H-dense kernel family compiles with NVRTC for sm_90, specialized at real model
//! dims and generic; specialized variants have no spills and no stack frame; every Rust argument
//! struct matches its kernel's PTX parameter list. Skips (one SKIP line) without NVRTC.

mod dense_common;

use dense_common::{V, assert_compile_sm90, headers, variant};
use memra_engine::cuda::{SmArch, library};
use memra_engine::kernels::launch::check_params;
use memra_engine::kernels::registry::KernelVariant;
use memra_engine::kernels::{add_rmsnorm, argmax, embed, geglu, qk_norm_rope, rmsnorm, swiglu, topk};

const QTYPES: [&str; 13] = ["f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"];

/// Specialized variants at model dims (GLM-5 6144, Qwen3-8B 4096/hd128/32q/8kv/ff 12288,
/// Qwen3-4B 2560/9728, olmoe 2048/ff 1024/16 heads full QK-norm, gemma3-270M 640/hd256/4q/1kv/
/// ff 2048/vocab 262144) and every generic variant.
fn all_variants() -> Vec<&'static KernelVariant> {
    let mut v = Vec::new();
    for q in QTYPES {
        let block_256 = matches!(q, "q4_k" | "q5_k" | "q6_k" | "iq4_xs");
        for n in if block_256 { vec![6144, 4096, 2560, 2048] } else { vec![6144, 4096, 640] } {
            v.push(variant("embed", &[("n_embd", V::I(n)), ("qtype", V::S(q))]));
        }
        v.push(variant("embed", &[("qtype", V::S(q))]));
    }
    for n in [6144, 4096, 2560, 2048, 1024, 640, 512, 256, 128] {
        v.push(variant("rmsnorm", &[("n", V::I(n))]));
    }
    v.push(variant("rmsnorm", &[]));
    for dn in [0, 1] {
        for n in [6144, 4096, 2560, 2048, 640] {
            v.push(variant("add_rmsnorm", &[("n", V::I(n)), ("delta_norm", V::I(dn))]));
        }
        v.push(variant("add_rmsnorm", &[("delta_norm", V::I(dn))]));
    }
    let attn: [(i64, i64, i64, i64, &str, &str); 6] = [
        (128, 32, 8, 128, "neox", "per_head"),    // qwen3-8B
        (128, 32, 8, 128, "neox", "per_head"),    // qwen3-4B (same heads)
        (256, 4, 1, 256, "neox", "per_head"),     // gemma3-270M
        (128, 16, 16, 128, "neox", "full"),       // olmoe
        (128, 8, 8, 64, "interleaved", "none"),   // partial interleaved rope
        (64, 16, 4, 64, "interleaved", "per_head"),
    ];
    for (hd, nh, nkv, nrot, mode, norm) in attn {
        for cache in ["bf16", "f32"] {
            v.push(variant(
                "qk_norm_rope",
                &[("head_dim", V::I(hd)), ("n_head", V::I(nh)), ("n_kv", V::I(nkv)), ("n_rot", V::I(nrot)), ("rope_mode", V::S(mode)), ("qk_norm", V::S(norm)), ("cache_t", V::S(cache))],
            ));
        }
    }
    for mode in ["none", "interleaved", "neox"] {
        for norm in ["none", "per_head", "full"] {
            for cache in ["bf16", "f32"] {
                v.push(variant("qk_norm_rope", &[("rope_mode", V::S(mode)), ("qk_norm", V::S(norm)), ("cache_t", V::S(cache))]));
            }
        }
    }
    for n in [12288, 9728, 2048, 1024] {
        v.push(variant("swiglu", &[("n_ff", V::I(n))]));
    }
    v.push(variant("swiglu", &[]));
    for n in [2048, 10240] {
        v.push(variant("geglu", &[("n_ff", V::I(n))]));
    }
    v.push(variant("geglu", &[]));
    for n in [262144, 151936, 154880, 50304] {
        v.push(variant("argmax", &[("n_vocab", V::I(n))]));
        v.push(variant("topk", &[("n_vocab", V::I(n)), ("k", V::I(64))]));
        v.push(variant("topk", &[("n_vocab", V::I(n)), ("k", V::I(40))]));
    }
    // The router top-k of glm-dsa / olmoe: one warp (their specs' `threads = 32`).
    for n in [256, 64] {
        v.push(variant("topk", &[("n_vocab", V::I(n)), ("k", V::I(8)), ("threads", V::I(32))]));
    }
    v.push(variant("argmax", &[]));
    v.push(variant("topk", &[]));
    v.dedup_by_key(|v| v.name);
    v
}

#[test]
fn dense_templates_compile_for_sm90_without_spills() {
    if library::nvrtc_or_skip("dense_templates_compile_for_sm90_without_spills").is_none() {
        return;
    }
    // Specialized variants must neither spill nor keep a stack frame; generic ones must not spill.
    let variants: Vec<_> = all_variants().into_iter().map(|v| (v, !v.is_generic())).collect();
    assert_compile_sm90(&variants, |v, rep| rep.spills().then(|| format!("{}: spills {rep:?}", v.name)));
}

#[test]
fn dense_args_structs_match_kernel_parameters() {
    if library::nvrtc_or_skip("dense_args_structs_match_kernel_parameters").is_none() {
        return;
    }
    let h = headers();
    let sm = SmArch(90);
    let check = |n: Result<usize, memra_engine::cuda::Error>| n.unwrap_or_else(|e| panic!("{e}"));
    check(check_params::<rmsnorm::RmsnormArgs<'static>>(&[variant("rmsnorm", &[("n", V::I(640))]), variant("rmsnorm", &[])], h, sm));
    check(check_params::<add_rmsnorm::AddRmsnormArgs<'static>>(
        &[variant("add_rmsnorm", &[("n", V::I(640)), ("delta_norm", V::I(1))]), variant("add_rmsnorm", &[])],
        h,
        sm,
    ));
    check(check_params::<embed::EmbedArgs<'static>>(&[variant("embed", &[("n_embd", V::I(640)), ("qtype", V::S("q8_0"))]), variant("embed", &[("qtype", V::S("q4_k"))])], h, sm));
    check(check_params::<qk_norm_rope::QkNormRopeArgs<'static, u16>>(
        &[
            variant("qk_norm_rope", &[("head_dim", V::I(256)), ("n_head", V::I(4)), ("n_kv", V::I(1)), ("n_rot", V::I(256)), ("rope_mode", V::S("neox")), ("qk_norm", V::S("per_head"))]),
            variant("qk_norm_rope", &[("rope_mode", V::S("interleaved")), ("qk_norm", V::S("full")), ("cache_t", V::S("f32"))]),
        ],
        h,
        sm,
    ));
    check(check_params::<swiglu::SwigluArgs<'static>>(&[variant("swiglu", &[("n_ff", V::I(12288))]), variant("swiglu", &[])], h, sm));
    check(check_params::<geglu::GegluArgs<'static>>(&[variant("geglu", &[("n_ff", V::I(2048))]), variant("geglu", &[])], h, sm));
    check(check_params::<argmax::ArgmaxArgs<'static>>(&[variant("argmax", &[("n_vocab", V::I(262144))]), variant("argmax", &[])], h, sm));
    check(check_params::<topk::TopkArgs<'static>>(&[variant("topk", &[("n_vocab", V::I(262144)), ("k", V::I(64))]), variant("topk", &[])], h, sm));
}

#[test]
fn adhoc_variants_are_named_like_planned_ones() {
    assert_eq!(variant("rmsnorm", &[("n", V::I(6144))]).name, "rmsnorm__n6144");
    assert_eq!(variant("rmsnorm", &[]).name, "rmsnorm__generic");
    let v = variant("embed", &[("n_embd", V::I(640)), ("qtype", V::S("q8_0"))]);
    assert_eq!(v.name, "embed__n_embd640__q8_0");
    assert!(v.source.contains("MEMRA_DEFINE_EMBED(embed__n_embd640__q8_0, embed__n_embd640__q8_0_cfg)"), "{}", v.source);
    assert!(v.source.contains("static constexpr memra::QType QTYPE = memra::QType::Q8_0;"), "{}", v.source);
    assert!(v.source.contains("static constexpr int THREADS = 128;"), "{}", v.source);
}
