//! CPU-only: the MoE families (moe_router, moe_matvec) compile with NVRTC for sm_90 — every
//! QType and mode generic, OLMoE and GLM-5 shapes specialized, the dense gated FFNs of Gemma 3
//! (geglu) and Qwen3 (swiglu) as one-expert variants — with no spills and no stack
//! frame, and their Rust argument structs match the kernels' PTX parameter lists. Skips (one
//! SKIP line) without NVRTC.

mod dense_common;

use dense_common::{V, assert_compile_sm90_without_spills, headers, variant};
use memra_engine::cuda::{SmArch, library};
use memra_engine::kernels::launch::check_params;
use memra_engine::kernels::registry::KernelVariant;
use memra_engine::kernels::{moe_matvec, moe_router};

const QTYPES: [&str; 13] = [
    "f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_nl",
    "iq4_xs",
];

/// (n_expert, n_used, gating): OLMoE softmax 64/8, GLM-5 sigmoid 256/8; generic of both gatings.
fn router_variants() -> Vec<&'static KernelVariant> {
    let mut v = vec![
        variant(
            "moe_router",
            &[
                ("n_expert", V::I(64)),
                ("n_used", V::I(8)),
                ("gating", V::S("softmax")),
            ],
        ),
        variant(
            "moe_router",
            &[
                ("n_expert", V::I(256)),
                ("n_used", V::I(8)),
                ("gating", V::S("sigmoid")),
            ],
        ),
    ];
    for g in ["softmax", "sigmoid"] {
        v.push(variant("moe_router", &[("gating", V::S(g))]));
    }
    v
}

/// Every QType × mode generic; OLMoE (2048 ↔ 1024) and GLM-5 (6144 ↔ 2048) gate/up (swiglu)
/// and down (down) specialized for Q4_K, Q8_0 and Q6_K, plus plain at GLM-5's gate shape; the
/// dense FFNs of specs/gemma3.toml (640 → 2048 q5_0 geglu) and specs/qwen3.toml (4096 → 12288
/// q8_0 swiglu).
fn matvec_variants() -> Vec<&'static KernelVariant> {
    let mut v = Vec::new();
    for q in QTYPES {
        for mode in ["plain", "swiglu", "geglu", "down"] {
            v.push(variant(
                "moe_matvec",
                &[("qtype", V::S(q)), ("mode", V::S(mode))],
            ));
        }
    }
    for q in ["q4_k", "q8_0", "q6_k"] {
        for (n_embd, n_ff) in [(2048i64, 1024i64), (6144, 2048)] {
            v.push(variant(
                "moe_matvec",
                &[
                    ("k", V::I(n_embd)),
                    ("n", V::I(n_ff)),
                    ("qtype", V::S(q)),
                    ("mode", V::S("swiglu")),
                ],
            ));
            v.push(variant(
                "moe_matvec",
                &[
                    ("k", V::I(n_ff)),
                    ("n", V::I(n_embd)),
                    ("qtype", V::S(q)),
                    ("mode", V::S("down")),
                ],
            ));
        }
    }
    v.push(variant(
        "moe_matvec",
        &[
            ("k", V::I(6144)),
            ("n", V::I(2048)),
            ("qtype", V::S("q4_k")),
            ("mode", V::S("plain")),
        ],
    ));
    for (k, n, q, mode) in [
        (640i64, 2048i64, "q5_0", "geglu"),
        (4096, 12288, "q8_0", "swiglu"),
    ] {
        v.push(variant(
            "moe_matvec",
            &[
                ("k", V::I(k)),
                ("n", V::I(n)),
                ("qtype", V::S(q)),
                ("mode", V::S(mode)),
            ],
        ));
    }
    v
}

fn assert_all_compile(test: &str, variants: Vec<&'static KernelVariant>) {
    if library::nvrtc_or_skip(test).is_none() {
        return;
    }
    assert_compile_sm90_without_spills(&variants, |_, _| None);
}

#[test]
fn moe_router_compiles_for_sm90_without_spills() {
    assert_all_compile(
        "moe_router_compiles_for_sm90_without_spills",
        router_variants(),
    );
}

#[test]
fn moe_matvec_compiles_for_sm90_without_spills() {
    assert_all_compile(
        "moe_matvec_compiles_for_sm90_without_spills",
        matvec_variants(),
    );
}

#[test]
fn moe_args_structs_match_kernel_parameters() {
    if library::nvrtc_or_skip("moe_args_structs_match_kernel_parameters").is_none() {
        return;
    }
    let (h, sm) = (headers(), SmArch(90));
    let r = router_variants();
    check_params::<moe_router::MoeRouterArgs<'static>>(&[r[1], r[2]], h, sm)
        .unwrap_or_else(|e| panic!("{e}"));
    let m = [
        variant(
            "moe_matvec",
            &[
                ("k", V::I(2048)),
                ("n", V::I(6144)),
                ("qtype", V::S("q4_k")),
                ("mode", V::S("down")),
            ],
        ),
        variant(
            "moe_matvec",
            &[("qtype", V::S("q8_0")), ("mode", V::S("swiglu"))],
        ),
        variant(
            "moe_matvec",
            &[
                ("k", V::I(640)),
                ("n", V::I(2048)),
                ("qtype", V::S("q5_0")),
                ("mode", V::S("geglu")),
            ],
        ),
    ];
    check_params::<moe_matvec::MoeMatvecArgs<'static>>(&m, h, sm).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn moe_variants_are_named_like_planned_ones() {
    let v = variant(
        "moe_matvec",
        &[
            ("k", V::I(6144)),
            ("n", V::I(2048)),
            ("qtype", V::S("q4_k")),
            ("mode", V::S("swiglu")),
        ],
    );
    assert!(v.name.starts_with("moe_matvec__"), "{}", v.name);
    assert!(
        v.source
            .contains("static constexpr memra::MoeMode MODE = memra::MoeMode::Swiglu;"),
        "{}",
        v.source
    );
    assert!(
        v.source.contains("MEMRA_DEFINE_MOE_MATVEC("),
        "{}",
        v.source
    );
    let geglu = variant(
        "moe_matvec",
        &[
            ("k", V::I(640)),
            ("n", V::I(2048)),
            ("qtype", V::S("q5_0")),
            ("mode", V::S("geglu")),
        ],
    );
    assert!(
        geglu
            .source
            .contains("static constexpr memra::MoeMode MODE = memra::MoeMode::Geglu;"),
        "{}",
        geglu.source
    );
    let g = variant("moe_router", &[("gating", V::S("sigmoid"))]);
    assert!(g.name.starts_with("moe_router__generic"), "{}", g.name);
    assert!(
        g.source.contains("static constexpr int N_EXPERT = 0;"),
        "{}",
        g.source
    );
    assert!(
        g.source
            .contains("static constexpr memra::Gating GATING = memra::Gating::Sigmoid;"),
        "{}",
        g.source
    );
}
