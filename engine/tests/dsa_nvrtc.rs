//! CPU-only: the DeepSeek Sparse Attention families (dsa_indexer, dsa_topk, mla_sparse_decode,
//! dsa_index_key) compile with NVRTC for sm_90, specialized at GLM-5 dims and generic, bf16 and f32 caches,
//! with no spills and no stack frame; their Rust argument structs match the kernels' PTX
//! parameter lists. Skips (one SKIP line) without NVRTC.

mod dense_common;

use dense_common::{V, assert_compile_sm90_without_spills, headers, variant};
use memra_engine::cuda::{SmArch, library};
use memra_engine::kernels::launch::check_params;
use memra_engine::kernels::registry::KernelVariant;
use memra_engine::kernels::{dsa_index_key, dsa_indexer, dsa_topk, mla_sparse_decode};

fn indexer(cache: &'static str, baked: bool) -> &'static KernelVariant {
    if baked {
        variant(
            "dsa_indexer",
            &[
                ("n_idx_head", V::I(32)),
                ("idx_head_dim", V::I(128)),
                ("cache_t", V::S(cache)),
            ],
        )
    } else {
        variant("dsa_indexer", &[("cache_t", V::S(cache))])
    }
}

fn sparse(cache: &'static str, baked: bool) -> &'static KernelVariant {
    if baked {
        variant(
            "mla_sparse_decode",
            &[
                ("n_head", V::I(64)),
                ("kv_lora", V::I(512)),
                ("rope", V::I(64)),
                ("cache_t", V::S(cache)),
            ],
        )
    } else {
        variant("mla_sparse_decode", &[("cache_t", V::S(cache))])
    }
}

fn index_key(cache: &'static str, mode: &'static str, baked: bool) -> &'static KernelVariant {
    let mut p = vec![("cache_t", V::S(cache)), ("rope_mode", V::S(mode))];
    if baked {
        p.extend([("head_dim", V::I(128)), ("n_rot", V::I(64))]);
    }
    variant("dsa_index_key", &p)
}

fn all_variants() -> Vec<&'static KernelVariant> {
    let mut v = Vec::new();
    for cache in ["bf16", "f32"] {
        for baked in [true, false] {
            v.push(indexer(cache, baked));
            v.push(sparse(cache, baked));
        }
    }
    for (cache, mode) in [("bf16", "interleaved"), ("f32", "neox")] {
        v.push(index_key(cache, mode, true));
        v.push(index_key(cache, mode, false));
    }
    v.push(variant("dsa_topk", &[("k", V::I(2048))]));
    v.push(variant("dsa_topk", &[]));
    v.push(variant(
        "dsa_topk",
        &[("k", V::I(2048)), ("threads", V::I(256))],
    ));
    v
}

#[test]
fn dsa_templates_compile_for_sm90_without_spills() {
    if library::nvrtc_or_skip("dsa_templates_compile_for_sm90_without_spills").is_none() {
        return;
    }
    assert_compile_sm90_without_spills(&all_variants(), |_, _| None);
}

#[test]
fn dsa_args_structs_match_kernel_parameters() {
    if library::nvrtc_or_skip("dsa_args_structs_match_kernel_parameters").is_none() {
        return;
    }
    let h = headers();
    let sm = SmArch(90);
    let check = |n: Result<usize, memra_engine::cuda::Error>| n.unwrap_or_else(|e| panic!("{e}"));
    check(check_params::<dsa_indexer::DsaIndexerArgs<'static, u16>>(
        &[indexer("bf16", true), indexer("bf16", false)],
        h,
        sm,
    ));
    check(check_params::<dsa_indexer::DsaIndexerArgs<'static, f32>>(
        &[indexer("f32", false)],
        h,
        sm,
    ));
    check(check_params::<dsa_topk::DsaTopkArgs<'static>>(
        &[
            variant("dsa_topk", &[("k", V::I(2048))]),
            variant("dsa_topk", &[]),
        ],
        h,
        sm,
    ));
    check(
        check_params::<dsa_index_key::DsaIndexKeyArgs<'static, u16>>(
            &[
                index_key("bf16", "interleaved", true),
                index_key("bf16", "none", false),
            ],
            h,
            sm,
        ),
    );
    check(check_params::<
        mla_sparse_decode::MlaSparseDecodeArgs<'static, u16>,
    >(&[sparse("bf16", true), sparse("bf16", false)], h, sm));
}

#[test]
fn dsa_variants_are_named_like_planned_ones() {
    let v = indexer("bf16", true);
    assert!(v.name.starts_with("dsa_indexer__"), "{}", v.name);
    assert!(
        v.source.contains("static constexpr int N_IDX_HEAD = 32;"),
        "{}",
        v.source
    );
    assert!(
        v.source.contains("MEMRA_DEFINE_DSA_INDEXER("),
        "{}",
        v.source
    );
    let g = variant("dsa_topk", &[]);
    assert!(g.name.starts_with("dsa_topk__generic"), "{}", g.name);
    assert!(
        g.source.contains("static constexpr int THREADS = 1024;"),
        "{}",
        g.source
    );
    let s = sparse("bf16", false);
    assert!(
        s.source.contains("MEMRA_DEFINE_MLA_SPARSE_DECODE("),
        "{}",
        s.source
    );
}
