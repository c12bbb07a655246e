//! CPU-only: the variants this build added for the per-GPU shard shapes (specs/glm-dsa.toml
//! `[parallel] shards` or MEMRA_SHARDS; `memra_engine::parallel` module doc) are in the
//! registry and compile with NVRTC for sm_90 without spills or a stack frame. Skips (one SKIP
//! line) without NVRTC or without the glm-dsa feature.

mod dense_common;

use dense_common::{assert_compile_sm90_without_spills, workspace_root};
use memra_codegen::build::{self, BuildRequest};
use memra_engine::cuda::library;
use memra_engine::kernels::registry::{self, KernelVariant};
use memra_engine::parallel::planned_shards;

/// The registry's variants that only the shard counts add (codegen run with and without them).
fn shard_variants() -> Vec<&'static KernelVariant> {
    let root = workspace_root();
    let names = |shards: &[usize]| -> Vec<String> {
        let g = build::generate(&BuildRequest {
            specs_dir: root.join("specs"),
            templates_dir: root.join("templates"),
            out_dir: std::env::temp_dir().join("memra-shard-nvrtc-unused"),
            archs: vec!["glm-dsa".into()],
            model: None,
            shards: Some(shards.to_vec()),
        })
        .unwrap();
        g.variants.iter().map(|v| v.name()).collect()
    };
    let base = names(&[]);
    names(planned_shards())
        .into_iter()
        .filter(|n| !base.contains(n))
        .map(|n| {
            registry::find(&n)
                .unwrap_or_else(|| panic!("{n}: planned for the shards but not in the registry"))
        })
        .collect()
}

#[test]
fn shard_variants_compile_for_sm90_without_spills() {
    const TEST: &str = "shard_variants_compile_for_sm90_without_spills";
    if !cfg!(feature = "model-glm-dsa") {
        eprintln!("SKIP {TEST}: built without feature model-glm-dsa (no shard variants)");
        return;
    }
    if library::nvrtc_or_skip(TEST).is_none() {
        return;
    }
    let shards = planned_shards();
    let variants = shard_variants();
    eprintln!(
        "{} shard variants for {shards:?} GPUs",
        variants.len()
    );
    // 19 per GPU count at GLM-5 dims (codegen/tests/shards.rs), fewer when two counts share one.
    assert!(
        !variants.is_empty() && variants.len() <= 19 * shards.len(),
        "{} variants for {shards:?}",
        variants.len()
    );
    assert!(variants.iter().all(|v| !v.is_generic() && v.arch == Some("glm-dsa")));
    assert_compile_sm90_without_spills(&variants, |_, _| None);
}
