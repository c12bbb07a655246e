//! CPU-only: the attention families (attn_decode, attn_decode_rope, mla_decode) compile with NVRTC for sm_90,
//! specialized at real model dims and generic, with no spills and no stack frame; their Rust
//! argument structs match the kernels' PTX parameter lists. Skips (one SKIP line) without NVRTC.

mod dense_common;

use dense_common::{V, assert_compile_sm90_without_spills, headers, variant};
use memra_engine::cuda::{SmArch, library};
use memra_engine::kernels::launch::check_params;
use memra_engine::kernels::registry::KernelVariant;
use memra_engine::kernels::{attn_decode, attn_decode_rope, mla_decode};

/// gemma3-270M (4/1/256), Qwen3-8B (32/8/128), a group of 8 (64/8/128), MQA head_dim 64, each
/// with bf16 and f32 caches; attn_decode_rope at gemma3's, Qwen3-8B's and OLMoE's dims and every
/// generic RoPE × QK-norm choice; GLM-5 MLA (64 heads, 512 + 64); the generic variants.
fn all_variants() -> Vec<&'static KernelVariant> {
    let mut v = Vec::new();
    for cache in ["bf16", "f32"] {
        for (hd, nh, nkv) in [
            (256i64, 4i64, 1i64),
            (128, 32, 8),
            (128, 64, 8),
            (64, 16, 1),
        ] {
            v.push(variant(
                "attn_decode",
                &[
                    ("head_dim", V::I(hd)),
                    ("n_head", V::I(nh)),
                    ("n_kv", V::I(nkv)),
                    ("cache_t", V::S(cache)),
                ],
            ));
        }
        v.push(variant("attn_decode", &[("cache_t", V::S(cache))]));
        for (hd, nh, nkv, norm) in [(256i64, 4i64, 1i64, "per_head"), (128, 32, 8, "per_head"), (128, 16, 16, "full")] {
            let dims = [("head_dim", V::I(hd)), ("n_head", V::I(nh)), ("n_kv", V::I(nkv)), ("n_rot", V::I(hd))];
            let choices = [("rope_mode", V::S("neox")), ("qk_norm", V::S(norm)), ("cache_t", V::S(cache))];
            v.push(variant("attn_decode_rope", &[&dims[..], &choices[..]].concat()));
        }
        for mode in ["none", "interleaved", "neox"] {
            for norm in ["none", "per_head", "full"] {
                v.push(variant("attn_decode_rope", &[("rope_mode", V::S(mode)), ("qk_norm", V::S(norm)), ("cache_t", V::S(cache))]));
            }
        }
        v.push(variant(
            "mla_decode",
            &[
                ("n_head", V::I(64)),
                ("kv_lora", V::I(512)),
                ("rope", V::I(64)),
                ("cache_t", V::S(cache)),
            ],
        ));
        v.push(variant("mla_decode", &[("cache_t", V::S(cache))]));
    }
    v
}

#[test]
fn attention_templates_compile_for_sm90_without_spills() {
    if library::nvrtc_or_skip("attention_templates_compile_for_sm90_without_spills").is_none() {
        return;
    }
    assert_compile_sm90_without_spills(&all_variants(), |_, _| None);
}

#[test]
fn attention_args_structs_match_kernel_parameters() {
    if library::nvrtc_or_skip("attention_args_structs_match_kernel_parameters").is_none() {
        return;
    }
    let h = headers();
    let sm = SmArch(90);
    let check = |n: Result<usize, memra_engine::cuda::Error>| n.unwrap_or_else(|e| panic!("{e}"));
    check(check_params::<attn_decode::AttnDecodeArgs<'static, u16>>(
        &[
            variant(
                "attn_decode",
                &[
                    ("head_dim", V::I(256)),
                    ("n_head", V::I(4)),
                    ("n_kv", V::I(1)),
                ],
            ),
            variant("attn_decode", &[]),
        ],
        h,
        sm,
    ));
    check(check_params::<attn_decode::AttnDecodeArgs<'static, f32>>(
        &[variant("attn_decode", &[("cache_t", V::S("f32"))])],
        h,
        sm,
    ));
    check(check_params::<attn_decode_rope::AttnDecodeRopeArgs<'static, u16>>(
        &[
            variant(
                "attn_decode_rope",
                &[("head_dim", V::I(256)), ("n_head", V::I(4)), ("n_kv", V::I(1)), ("n_rot", V::I(256)), ("rope_mode", V::S("neox")), ("qk_norm", V::S("per_head"))],
            ),
            variant("attn_decode_rope", &[("rope_mode", V::S("interleaved")), ("qk_norm", V::S("full"))]),
        ],
        h,
        sm,
    ));
    check(check_params::<attn_decode_rope::AttnDecodeRopeArgs<'static, f32>>(
        &[variant("attn_decode_rope", &[("rope_mode", V::S("none")), ("qk_norm", V::S("none")), ("cache_t", V::S("f32"))])],
        h,
        sm,
    ));
    check(check_params::<mla_decode::MlaDecodeArgs<'static, u16>>(
        &[
            variant(
                "mla_decode",
                &[
                    ("n_head", V::I(64)),
                    ("kv_lora", V::I(512)),
                    ("rope", V::I(64)),
                ],
            ),
            variant("mla_decode", &[]),
        ],
        h,
        sm,
    ));
}

#[test]
fn attention_variants_are_named_like_planned_ones() {
    let v = variant(
        "attn_decode",
        &[
            ("head_dim", V::I(256)),
            ("n_head", V::I(4)),
            ("n_kv", V::I(1)),
        ],
    );
    assert!(v.name.starts_with("attn_decode__"), "{}", v.name);
    assert!(
        v.source
            .contains("static constexpr memra::CacheType CACHE_T = memra::CacheType::BF16;"),
        "{}",
        v.source
    );
    assert!(
        v.source.contains("static constexpr int HEAD_DIM = 256;"),
        "{}",
        v.source
    );
    let g = variant("mla_decode", &[]);
    assert!(g.name.starts_with("mla_decode__generic"), "{}", g.name);
    assert!(
        g.source.contains("static constexpr int N_HEAD = 0;"),
        "{}",
        g.source
    );
    assert!(
        g.source.contains("MEMRA_DEFINE_MLA_DECODE("),
        "{}",
        g.source
    );
}
