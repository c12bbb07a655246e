//! CPU-only: the matvec and matmul templates compile with NVRTC for sm_90 for every QType,
//! specialized at real model shapes and generic; specialized decode kernels have no spills and no
//! stack frame; the Rust argument structs match the kernels' PTX parameter lists. Skips (one SKIP
//! line) without NVRTC.

mod dense_common;

use dense_common::{V, headers, variant};
use memra_engine::cuda::{CacheConfig, KernelCache, SmArch, compile_variants, library};
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

fn matvec_variants() -> Vec<(&'static KernelVariant, bool)> {
    let mut v = Vec::new();
    for q in QTYPES {
        for (k, n) in shapes(q) {
            v.push((
                variant(
                    "matvec",
                    &[("k", V::I(k)), ("n", V::I(n)), ("qtype", V::S(q))],
                ),
                true,
            ));
        }
        // Batched decode: 8 vectors, 8 lanes per row group.
        v.push((
            variant(
                "matvec",
                &[
                    ("k", V::I(6144)),
                    ("n", V::I(2048)),
                    ("qtype", V::S(q)),
                    ("batch", V::I(8)),
                    ("lanes", V::I(8)),
                    ("rows_per_group", V::I(1)),
                ],
            ),
            true,
        ));
        v.push((variant("matvec", &[("qtype", V::S(q))]), false));
        v.push((
            variant(
                "matvec",
                &[
                    ("qtype", V::S(q)),
                    ("batch", V::I(8)),
                    ("lanes", V::I(8)),
                    ("rows_per_group", V::I(1)),
                ],
            ),
            false,
        ));
    }
    v
}

fn matmul_variants() -> Vec<&'static KernelVariant> {
    let mut v = Vec::new();
    for q in QTYPES {
        for (k, n) in [(6144, 2048), (4096, 12288)] {
            v.push(variant(
                "matmul",
                &[("k", V::I(k)), ("n", V::I(n)), ("qtype", V::S(q))],
            ));
        }
        v.push(variant("matmul", &[("qtype", V::S(q))]));
        v.push(variant("matmul", &[("qtype", V::S(q)), ("bm", V::I(64))]));
    }
    v
}

fn compile_and_report(variants: &[(&'static KernelVariant, bool)]) -> Vec<String> {
    let list: Vec<&'static KernelVariant> = variants.iter().map(|(v, _)| *v).collect();
    let cache = KernelCache::new(CacheConfig::memory_only());
    let results = compile_variants(&cache, &list, headers(), SmArch(90));
    let mut failures = Vec::new();
    for ((v, strict), r) in variants.iter().zip(results) {
        match r {
            Err(e) => failures.push(format!("{}: {e}", v.name)),
            Ok(c) => {
                let rep = c.cubin.report();
                eprintln!(
                    "{:<72} regs {:>3}  spill st/ld {}/{}  stack {}",
                    v.name,
                    rep.registers.unwrap_or(0),
                    rep.spill_stores.unwrap_or(0),
                    rep.spill_loads.unwrap_or(0),
                    rep.stack_frame.unwrap_or(0)
                );
                if rep.registers.is_none() {
                    failures.push(format!("{}: no ptxas report in the NVRTC log", v.name));
                }
                if *strict && (rep.spills() || rep.stack_frame.unwrap_or(0) > 0) {
                    failures.push(format!(
                        "{}: specialized variant spills or has a stack frame: {rep:?}",
                        v.name
                    ));
                }
            }
        }
    }
    failures
}

#[test]
fn matvec_templates_compile_for_sm90_without_spills() {
    if library::nvrtc_or_skip("matvec_templates_compile_for_sm90_without_spills").is_none() {
        return;
    }
    let variants = matvec_variants();
    let failures = compile_and_report(&variants);
    assert!(
        failures.is_empty(),
        "{} of {} variants failed:\n{}",
        failures.len(),
        variants.len(),
        failures.join("\n")
    );
}

/// The integer path (XQ8 = 1): every integer type specialized at decode shapes (batch 1 and
/// batched 8) and generic, moe_matvec in every mode, quantize_q8; the types without the path
/// must still compile (their xq8 body is a trap) since generic variants cover every QType.
fn xq8_variants() -> Vec<(&'static KernelVariant, bool)> {
    let mut v = Vec::new();
    for q in QTYPES {
        let int = matvec::int_dot(memra_gguf::GgmlType::from_name(q).expect("a ggml type"));
        v.push((
            variant("matvec", &[("qtype", V::S(q)), ("xq8", V::I(1))]),
            false,
        ));
        if !int {
            // The trap-only bodies still compile (generic variants cover every QType).
            v.push((
                variant("matvec", &[("qtype", V::S(q)), ("xq8", V::I(2))]),
                false,
            ));
            continue;
        }
        for (k, n) in [(6144, 2048), (4096, 12288), (12288, 4096)] {
            v.push((
                variant(
                    "matvec",
                    &[
                        ("k", V::I(k)),
                        ("n", V::I(n)),
                        ("qtype", V::S(q)),
                        ("xq8", V::I(1)),
                    ],
                ),
                true,
            ));
        }
        v.push((
            variant(
                "matvec",
                &[
                    ("k", V::I(4096)),
                    ("n", V::I(12288)),
                    ("qtype", V::S(q)),
                    ("batch", V::I(8)),
                    ("lanes", V::I(8)),
                    ("rows_per_group", V::I(1)),
                    ("xq8", V::I(1)),
                ],
            ),
            true,
        ));
        // XQ8 = 2 (x quantized in the block): batch 1 and 4, specialized and generic.
        for batch in [1, 4] {
            v.push((
                variant(
                    "matvec",
                    &[
                        ("k", V::I(6144)),
                        ("n", V::I(12288)),
                        ("qtype", V::S(q)),
                        ("batch", V::I(batch)),
                        ("xq8", V::I(2)),
                    ],
                ),
                true,
            ));
            v.push((
                variant(
                    "matvec",
                    &[("qtype", V::S(q)), ("batch", V::I(batch)), ("xq8", V::I(2))],
                ),
                false,
            ));
        }
        for mode in ["plain", "swiglu", "geglu", "down"] {
            let (k, n) = if mode == "down" {
                (2048, 6144)
            } else {
                (6144, 2048)
            };
            v.push((
                variant(
                    "moe_matvec",
                    &[
                        ("k", V::I(k)),
                        ("n", V::I(n)),
                        ("qtype", V::S(q)),
                        ("mode", V::S(mode)),
                        ("xq8", V::I(1)),
                    ],
                ),
                true,
            ));
            v.push((
                variant(
                    "moe_matvec",
                    &[("qtype", V::S(q)), ("mode", V::S(mode)), ("xq8", V::I(1))],
                ),
                false,
            ));
        }
    }
    v.push((variant("quantize_q8", &[]), true));
    v
}

#[test]
fn matvec_xq8_templates_compile_for_sm90_without_spills() {
    if library::nvrtc_or_skip("matvec_xq8_templates_compile_for_sm90_without_spills").is_none() {
        return;
    }
    let variants = xq8_variants();
    let failures = compile_and_report(&variants);
    assert!(
        failures.is_empty(),
        "{} of {} variants failed:\n{}",
        failures.len(),
        variants.len(),
        failures.join("\n")
    );
}

#[test]
fn matmul_templates_compile_for_sm90_without_spills() {
    if library::nvrtc_or_skip("matmul_templates_compile_for_sm90_without_spills").is_none() {
        return;
    }
    let variants: Vec<(&'static KernelVariant, bool)> =
        matmul_variants().into_iter().map(|v| (v, true)).collect();
    let failures = compile_and_report(&variants);
    assert!(
        failures.is_empty(),
        "{} of {} variants failed:\n{}",
        failures.len(),
        variants.len(),
        failures.join("\n")
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
