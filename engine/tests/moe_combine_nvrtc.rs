//! CPU-only: moe_combine (the end of expert-grouped MoE prefill) compiles with NVRTC for sm_90 —
//! generic, OLMoE (2048) and GLM-5 (6144) widths, a 64-thread tuning — with no spills and no
//! stack frame, and `MoeCombineArgs` matches the kernel's PTX parameter list. Skips (one SKIP
//! line) without NVRTC.

mod dense_common;

use dense_common::{assert_compile_sm90_without_spills, headers, variant, V};
use memra_engine::cuda::{library, SmArch};
use memra_engine::kernels::launch::check_params;
use memra_engine::kernels::moe_combine;
use memra_engine::kernels::registry::KernelVariant;

fn variants() -> Vec<&'static KernelVariant> {
    vec![
        variant("moe_combine", &[]),
        variant("moe_combine", &[("n", V::I(2048))]),
        variant("moe_combine", &[("n", V::I(6144))]),
        variant("moe_combine", &[("n", V::I(6144)), ("threads", V::I(64))]),
    ]
}

#[test]
fn moe_combine_compiles_for_sm90_without_spills() {
    if library::nvrtc_or_skip("moe_combine_compiles_for_sm90_without_spills").is_none() {
        return;
    }
    assert_compile_sm90_without_spills(&variants(), |_, _| None);
}

#[test]
fn moe_combine_args_struct_matches_kernel_parameters() {
    if library::nvrtc_or_skip("moe_combine_args_struct_matches_kernel_parameters").is_none() {
        return;
    }
    let v = variants();
    check_params::<moe_combine::MoeCombineArgs<'static>>(&v, headers(), SmArch(90))
        .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn moe_combine_generic_variant_is_in_the_registry() {
    // Every build carries the generic variant the grouped prefill falls back to.
    let found = memra_engine::kernels::registry::family(moe_combine::FAMILY)
        .iter()
        .any(|v| v.arch.is_none() && v.name == "moe_combine__generic");
    assert!(found, "no moe_combine__generic in the registry");
}
