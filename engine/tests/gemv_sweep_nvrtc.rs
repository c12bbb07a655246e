//! CPU-only: the tuning sweeps' candidates compile with NVRTC for sm_90 (`memra bench --sweep
//! matvec` / `--sweep moe_matvec` build them at run time on the GPU machine, where a compile
//! error would cost a device run). Every distinct matvec sweep tuning (f32 x, xq8, fused xq8,
//! batch 1 and 4) for Q4_K and the batch-1 ones for BF16 (the two unit shapes furthest apart),
//! and every moe_matvec sweep tuning of the routed swiglu and down cases. Registers and spills
//! are printed; spills (or a stack frame) fail only for the default tuning, since a spilling
//! candidate is merely slow and the sweep ranks it. Skips without NVRTC.

mod dense_common;

use dense_common::assert_compile_sm90;
use memra_engine::bench::sweep;
use memra_engine::cuda::library;
use memra_engine::kernels::matvec::MatvecTuning;
use memra_engine::kernels::registry::KernelVariant;
use memra_gguf::GgmlType;

/// Compiles the candidates for sm_90 (see [`assert_compile_sm90`]): those paired with `true`
/// (the default tunings) must not spill; skips without NVRTC.
fn compile(test: &str, list: Vec<(&'static KernelVariant, bool)>) {
    if library::nvrtc_or_skip(test).is_none() {
        return;
    }
    assert_compile_sm90(&list, |_, _| None);
}

#[test]
fn matvec_sweep_candidates_compile_for_sm90() {
    // One specialized variant per (type, batch, tuning): the first shape that has it.
    let mut seen = Vec::new();
    let mut list = Vec::new();
    let types = [GgmlType::Q4_K, GgmlType::BF16];
    for case in sweep::plan()
        .into_iter()
        .filter(|c| types.contains(&c.ty) && (c.ty == GgmlType::Q4_K || c.batch == 1))
    {
        for (t, spec, _) in &case.candidates {
            if !seen.contains(&(case.ty, *t)) {
                seen.push((case.ty, *t));
                let default = MatvecTuning {
                    batch: t.batch,
                    ..MatvecTuning::default()
                };
                list.push((*spec, *t == default));
            }
        }
    }
    compile("matvec_sweep_candidates_compile_for_sm90", list);
}

#[test]
fn moe_sweep_candidates_compile_for_sm90() {
    // The routed swiglu and down cases: every tuning, both modes' row sources.
    let list = sweep::moe::plan()
        .into_iter()
        .filter(|c| c.shape.n_expert > 1)
        .flat_map(|c| {
            c.candidates
                .into_iter()
                .map(|(t, v)| (v, t == MatvecTuning::default()))
        })
        .collect();
    compile("moe_sweep_candidates_compile_for_sm90", list);
}
