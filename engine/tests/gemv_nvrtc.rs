//! CPU-only: the matvec and matmul templates compile with NVRTC for sm_90 for every QType,
//! specialized at real model shapes and generic; specialized decode kernels have no spills and no
//! stack frame; the Rust argument structs match the kernels' PTX parameter lists. Skips (one SKIP
//! line) without NVRTC.

mod dense_common;

use dense_common::{assert_compile_sm90, headers, variant, V};
use memra_engine::cuda::{library, SmArch};
use memra_engine::kernels::launch::check_params;
use memra_engine::kernels::registry::KernelVariant;
use memra_engine::kernels::{matmul, matvec, quantize_q8};

const QTYPES: [&str; 13] = [
    "f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_nl",
    "iq4_xs",
];

fn block_256(q: &str) -> bool {
    matches!(q, "q4_k" | "q5_k" | "q6_k" | "iq4_xs")
}

/// (k, n) at model shapes: GLM-5 q_a 6144→2048 and o 16384→6144, gemma3-270M ffn_down 2048→640
/// and (32-element blocks) its vocab head 640→262144. Kept short: each compile takes ~1-3 s.
fn shapes(q: &str) -> Vec<(i64, i64)> {
    let mut s = vec![(6144, 2048), (16384, 6144), (2048, 640)];
    if !block_256(q) {
        s.push((640, 262144));
    }
    s
}

/// `params` of a variant at shape `(k, n)`, or generic (`None`).
fn with_shape(shape: Option<(i64, i64)>, params: &[(&'static str, V)]) -> Vec<(&'static str, V)> {
    let mut p = shape.map_or(vec![], |(k, n)| vec![("k", V::I(k)), ("n", V::I(n))]);
    p.extend_from_slice(params);
    p
}

/// A `family` variant at `shape` (specialized: must not spill) or generic (`None`: may spill).
fn at(
    family: &str,
    shape: Option<(i64, i64)>,
    params: &[(&'static str, V)],
) -> (&'static KernelVariant, bool) {
    (variant(family, &with_shape(shape, params)), shape.is_some())
}

/// Batched decode: 8 vectors, 8 lanes per row group.
fn batch8(q: &'static str, xq8: Option<i64>) -> Vec<(&'static str, V)> {
    let mut p = vec![
        ("qtype", V::S(q)),
        ("batch", V::I(8)),
        ("lanes", V::I(8)),
        ("rows_per_group", V::I(1)),
    ];
    p.extend(xq8.map(|x| ("xq8", V::I(x))));
    p
}

fn matvec_variants() -> Vec<(&'static KernelVariant, bool)> {
    let mut v = Vec::new();
    for q in QTYPES {
        let qt = [("qtype", V::S(q))];
        v.extend(shapes(q).into_iter().map(|s| at("matvec", Some(s), &qt)));
        v.push(at("matvec", Some((6144, 2048)), &batch8(q, None)));
        v.push(at("matvec", None, &qt));
        v.push(at("matvec", None, &batch8(q, None)));
    }
    v
}

fn matmul_variants() -> Vec<&'static KernelVariant> {
    let mut v = Vec::new();
    for q in QTYPES {
        for shape in [Some((6144, 2048)), Some((4096, 12288)), None] {
            v.push(variant("matmul", &with_shape(shape, &[("qtype", V::S(q))])));
        }
        v.push(variant("matmul", &[("qtype", V::S(q)), ("bm", V::I(64))]));
    }
    v
}

fn check(test: &str, variants: &[(&'static KernelVariant, bool)]) {
    if library::nvrtc_or_skip(test).is_none() {
        return;
    }
    assert_compile_sm90(variants, |_, _| None);
}

#[test]
fn matvec_templates_compile_for_sm90_without_spills() {
    check(
        "matvec_templates_compile_for_sm90_without_spills",
        &matvec_variants(),
    );
}

/// The integer path (XQ8 = 1): every integer type specialized at decode shapes (batch 1 and
/// batched 8) and generic, moe_matvec in every mode, quantize_q8; the types without the path
/// must still compile (their xq8 body is a trap) since generic variants cover every QType.
fn xq8_variants() -> Vec<(&'static KernelVariant, bool)> {
    let mut v = Vec::new();
    for q in QTYPES {
        let int = matvec::int_dot(memra_gguf::GgmlType::from_name(q).expect("a ggml type"));
        let xq8 = |x: i64| [("qtype", V::S(q)), ("xq8", V::I(x))];
        v.push(at("matvec", None, &xq8(1)));
        if !int {
            // The trap-only bodies still compile (generic variants cover every QType).
            v.push(at("matvec", None, &xq8(2)));
            continue;
        }
        for s in [(6144, 2048), (4096, 12288), (12288, 4096)] {
            v.push(at("matvec", Some(s), &xq8(1)));
        }
        v.push(at("matvec", Some((4096, 12288)), &batch8(q, Some(1))));
        // XQ8 = 2 (x quantized in the block): batch 1 and 4, specialized and generic.
        for batch in [1, 4] {
            for shape in [Some((6144, 12288)), None] {
                v.push(at(
                    "matvec",
                    shape,
                    &[("qtype", V::S(q)), ("batch", V::I(batch)), ("xq8", V::I(2))],
                ));
            }
        }
        for mode in ["plain", "swiglu", "geglu", "down"] {
            let kn = if mode == "down" {
                (2048, 6144)
            } else {
                (6144, 2048)
            };
            for shape in [Some(kn), None] {
                v.push(at(
                    "moe_matvec",
                    shape,
                    &[("qtype", V::S(q)), ("mode", V::S(mode)), ("xq8", V::I(1))],
                ));
            }
        }
    }
    v.push((variant("quantize_q8", &[]), true));
    v
}

#[test]
fn matvec_xq8_templates_compile_for_sm90_without_spills() {
    check(
        "matvec_xq8_templates_compile_for_sm90_without_spills",
        &xq8_variants(),
    );
}

#[test]
fn matmul_templates_compile_for_sm90_without_spills() {
    let variants: Vec<_> = matmul_variants().into_iter().map(|v| (v, true)).collect();
    check(
        "matmul_templates_compile_for_sm90_without_spills",
        &variants,
    );
}

#[test]
fn gemv_args_structs_match_kernel_parameters() {
    if library::nvrtc_or_skip("gemv_args_structs_match_kernel_parameters").is_none() {
        return;
    }
    let h = headers();
    let sm = SmArch(90);
    let mv = [
        variant(
            "matvec",
            &[("k", V::I(640)), ("n", V::I(1024)), ("qtype", V::S("q8_0"))],
        ),
        variant("matvec", &[("qtype", V::S("q4_k"))]),
    ];
    check_params::<matvec::MatvecArgs<'static>>(&mv, h, sm).unwrap_or_else(|e| panic!("{e}"));
    let xq8 = [variant(
        "matvec",
        &[("qtype", V::S("q4_k")), ("xq8", V::I(1))],
    )];
    check_params::<matvec::MatvecArgs<'static>>(&xq8, h, sm).unwrap_or_else(|e| panic!("{e}"));
    let q = [variant("quantize_q8", &[])];
    check_params::<quantize_q8::QuantizeQ8Args<'static>>(&q, h, sm)
        .unwrap_or_else(|e| panic!("{e}"));
    let mm = [
        variant(
            "matmul",
            &[("k", V::I(640)), ("n", V::I(1024)), ("qtype", V::S("q5_0"))],
        ),
        variant("matmul", &[("qtype", V::S("q6_k"))]),
    ];
    check_params::<matmul::MatmulArgs<'static>>(&mm, h, sm).unwrap_or_else(|e| panic!("{e}"));
}
