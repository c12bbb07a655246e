//! CPU-only: mla_rope compiles with NVRTC for sm_90 — specialized at GLM-5, DeepSeek-V2-Lite and
//! micro-model dims and generic, every RoPE mode, bf16 and f32 caches — with no spills and no
//! stack frame, and its Rust argument struct matches the kernel's PTX parameter list. Skips (one
//! SKIP line) without NVRTC.

mod dense_common;

use dense_common::{assert_compile_sm90_without_spills, headers, variant, V};
use memra_engine::cuda::{library, SmArch};
use memra_engine::kernels::launch::check_params;
use memra_engine::kernels::mla_rope;
use memra_engine::kernels::registry::KernelVariant;

/// `dims`: (n_head, nope, rope, kv_lora), or generic.
fn rope(
    dims: Option<(i64, i64, i64, i64)>,
    mode: &'static str,
    cache: &'static str,
) -> &'static KernelVariant {
    let mut p = vec![("rope_mode", V::S(mode)), ("cache_t", V::S(cache))];
    if let Some((h, nope, r, kvl)) = dims {
        p.extend([
            ("n_head", V::I(h)),
            ("nope", V::I(nope)),
            ("rope", V::I(r)),
            ("kv_lora", V::I(kvl)),
        ]);
    }
    variant(mla_rope::FAMILY, &p)
}

fn all_variants() -> Vec<&'static KernelVariant> {
    let mut v = Vec::new();
    for dims in [
        Some((64, 192, 64, 512)),
        Some((16, 128, 64, 512)),
        Some((4, 32, 16, 128)),
    ] {
        v.push(rope(dims, "interleaved", "bf16"));
    }
    for mode in ["none", "interleaved", "neox"] {
        for cache in ["bf16", "f32"] {
            v.push(rope(None, mode, cache));
        }
    }
    v
}

#[test]
fn mla_rope_compiles_for_sm90_without_spills() {
    if library::nvrtc_or_skip("mla_rope_compiles_for_sm90_without_spills").is_none() {
        return;
    }
    assert_compile_sm90_without_spills(&all_variants(), |_, _| None);
}

#[test]
fn mla_rope_args_struct_matches_the_kernel_parameters() {
    if library::nvrtc_or_skip("mla_rope_args_struct_matches_the_kernel_parameters").is_none() {
        return;
    }
    let n = check_params::<mla_rope::MlaRopeArgs<'static, u16>>(
        &[
            rope(Some((64, 192, 64, 512)), "interleaved", "bf16"),
            rope(None, "neox", "bf16"),
        ],
        headers(),
        SmArch(90),
    );
    n.unwrap_or_else(|e| panic!("{e}"));
    check_params::<mla_rope::MlaRopeArgs<'static, f32>>(
        &[rope(None, "interleaved", "f32")],
        headers(),
        SmArch(90),
    )
    .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn mla_rope_variants_bake_their_dims() {
    let v = rope(Some((64, 192, 64, 512)), "interleaved", "bf16");
    assert!(v.name.starts_with("mla_rope__"), "{}", v.name);
    assert!(
        v.source.contains("static constexpr int NOPE = 192;"),
        "{}",
        v.source
    );
    assert!(v.source.contains("MEMRA_DEFINE_MLA_ROPE("), "{}", v.source);
    let g = rope(None, "neox", "f32");
    assert!(g.name.starts_with("mla_rope__generic"), "{}", g.name);
    assert!(!g.source.contains("KV_LORA = 512"), "{}", g.source);
}
