//! CPU-only: every attn_prefill variant the tests and specs use compiles with NVRTC for sm_90
//! (specialized at gemma3-270M 4/1/256, Qwen3-8B 32/8/128, OLMoE 16/16/128, a group of 8 at
//! 64/8/128 and MQA at head_dim 64; generic), bf16 and f32 caches, with no spills and no stack
//! frame; the Rust argument struct matches the kernel's PTX parameter list. Skips (one SKIP line)
//! without NVRTC.

mod dense_common;

use dense_common::{V, assert_compile_sm90_without_spills, headers, variant};
use memra_engine::cuda::{SmArch, library};
use memra_engine::kernels::attn_prefill::{self, AttnPrefillArgs};
use memra_engine::kernels::launch::check_params;
use memra_engine::kernels::registry::KernelVariant;

const SHAPES: [(i64, i64, i64); 5] = [
    (256, 4, 1),
    (128, 32, 8),
    (128, 16, 16),
    (128, 64, 8),
    (64, 16, 1),
];

fn all_variants() -> Vec<&'static KernelVariant> {
    let mut v = Vec::new();
    for cache in ["bf16", "f32"] {
        for (hd, nh, nkv) in SHAPES {
            v.push(variant(
                "attn_prefill",
                &[
                    ("head_dim", V::I(hd)),
                    ("n_head", V::I(nh)),
                    ("n_kv", V::I(nkv)),
                    ("cache_t", V::S(cache)),
                ],
            ));
        }
        v.push(variant("attn_prefill", &[("cache_t", V::S(cache))]));
    }
    v
}

#[test]
fn attn_prefill_compiles_for_sm90_without_spills() {
    let test = "attn_prefill_compiles_for_sm90_without_spills";
    if library::nvrtc_or_skip(test).is_none() {
        return;
    }
    // Four warps need ≤ 255 registers; 2 blocks per SM at hd 256 need ≤ 255 too, so this only
    // catches a launch-bound slip.
    assert_compile_sm90_without_spills(&all_variants(), |v, rep| {
        rep.registers
            .is_some_and(|r| r > 255)
            .then(|| format!("{}: {:?} registers", v.name, rep.registers))
    });
}

#[test]
fn attn_prefill_args_struct_matches_kernel_parameters() {
    let test = "attn_prefill_args_struct_matches_kernel_parameters";
    if library::nvrtc_or_skip(test).is_none() {
        return;
    }
    let (h, sm) = (headers(), SmArch(90));
    let n = check_params::<AttnPrefillArgs<'static, u16>>(
        &[
            variant(
                "attn_prefill",
                &[
                    ("head_dim", V::I(256)),
                    ("n_head", V::I(4)),
                    ("n_kv", V::I(1)),
                ],
            ),
            variant("attn_prefill", &[]),
        ],
        h,
        sm,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(n, 2, "variants checked");
    check_params::<AttnPrefillArgs<'static, f32>>(
        &[variant("attn_prefill", &[("cache_t", V::S("f32"))])],
        h,
        sm,
    )
    .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn attn_prefill_variants_are_named_and_rendered_like_planned_ones() {
    let v = variant(
        "attn_prefill",
        &[
            ("head_dim", V::I(128)),
            ("n_head", V::I(32)),
            ("n_kv", V::I(8)),
        ],
    );
    assert!(v.name.starts_with("attn_prefill__"), "{}", v.name);
    for needle in [
        "static constexpr int HEAD_DIM = 128;",
        "static constexpr memra::CacheType CACHE_T = memra::CacheType::BF16;",
        "static constexpr int THREADS = 128;",
        "MEMRA_DEFINE_ATTN_PREFILL(",
    ] {
        assert!(v.source.contains(needle), "no `{needle}` in {}", v.source);
    }
    let g = variant("attn_prefill", &[]);
    assert!(g.name.starts_with("attn_prefill__generic"), "{}", g.name);
    assert!(
        g.source.contains("static constexpr int N_KV = 0;"),
        "{}",
        g.source
    );
    assert_eq!(attn_prefill::THREADS, 128);
}
