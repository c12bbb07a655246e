//! CPU-only: the tuning sweeps' candidates compile with NVRTC for sm_90 (`memra bench --sweep
//! matvec` / `--sweep moe_matvec` build them at run time on the GPU machine, where a compile
//! error would cost a device run). Every distinct matvec sweep tuning (f32 x, xq8, fused xq8,
//! batch 1 and 4) for Q4_K and the batch-1 ones for BF16 (the two unit shapes furthest apart),
//! and every moe_matvec sweep tuning of the routed swiglu and down cases. Registers and spills
//! are printed; spills fail only for the default tuning, since a spilling candidate is merely
//! slow and the sweep ranks it. Skips without NVRTC.

mod dense_common;

use dense_common::headers;
use memra_engine::bench::sweep;
use memra_engine::cuda::{CacheConfig, KernelCache, SmArch, compile_variants, library};
use memra_engine::kernels::matvec::MatvecTuning;
use memra_engine::kernels::registry::KernelVariant;
use memra_gguf::GgmlType;

fn compile(test: &str, list: Vec<(&'static KernelVariant, bool)>) {
    if library::nvrtc_or_skip(test).is_none() {
        return;
    }
    let variants: Vec<&'static KernelVariant> = list.iter().map(|(v, _)| *v).collect();
    let cache = KernelCache::new(CacheConfig::memory_only());
    let results = compile_variants(&cache, &variants, headers(), SmArch(90));
    let mut failures = Vec::new();
    for ((v, strict), r) in list.iter().zip(results) {
        match r {
            Err(e) => failures.push(format!("{}: {e}", v.name)),
            Ok(c) => {
                let rep = c.cubin.report();
                eprintln!(
                    "{:<80} regs {:>3}  spill st/ld {}/{}  stack {}",
                    v.name,
                    rep.registers.unwrap_or(0),
                    rep.spill_stores.unwrap_or(0),
                    rep.spill_loads.unwrap_or(0),
                    rep.stack_frame.unwrap_or(0)
                );
                if *strict && rep.spills() {
                    failures.push(format!("{}: the default tuning spills: {rep:?}", v.name));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} variants failed:\n{}",
        failures.len(),
        list.len(),
        failures.join("\n")
    );
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
