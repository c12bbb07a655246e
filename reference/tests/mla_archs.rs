//! The MLA architectures of the CPU reference come from `specs/*.toml` alone (build.rs writes
//! `MLA_ARCHS`; no file or registration per architecture):
//! 1. `MLA_ARCHS` holds exactly the specs whose `capabilities.attention` is `mla` / `mla_dsa`,
//!    with `dsa` = `mla_dsa` and the default gating that of the spec's router (and of its
//!    `expert_gating_func` default); `CPU_ARCHS` lists them after the GQA architectures.
//! 2. Every such spec's micro model (random weights, fresh seed per run, printed) loads through
//!    `CpuModel` as `CpuModel::Mla` of its architecture; prefill and token-by-token decode agree
//!    (DESIGN.md's logit verdict) with finite logits; a file without `expert_gating_func` gets
//!    the table's default gating.
//! 3. build.rs run on a folder of new specs gives each MLA spec its row (gating from the
//!    `expert_gating_func` default, else the router) and none to a GQA spec.

use std::path::{Path, PathBuf};

use memra_codegen::fixture;
use memra_codegen::spec::{ArchSpec, Attention, HParamDefault, HParamSource, Router, Value};
use memra_gguf::Gguf;
use memra_reference::models::{CPU_ARCHS, CpuCache, CpuModel, MLA_ARCHS, MlaArch, MlaModelHparams};
use memra_reference::moe::Gating;
use memra_reference::{Rng, logit_verdict_rows};

fn specs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs")
}

fn specs() -> Vec<ArchSpec> {
    let dir = specs_dir();
    memra_codegen::build::spec_archs(&dir)
        .unwrap_or_else(|e| panic!("{e}"))
        .iter()
        .map(|a| ArchSpec::load(&dir.join(format!("{a}.toml"))).unwrap_or_else(|e| panic!("{e}")))
        .collect()
}

fn mla_specs() -> Vec<ArchSpec> {
    specs()
        .into_iter()
        .filter(|s| s.caps.attention != Attention::Gqa)
        .collect()
}

/// The hparam the spec reads `<arch>.expert_gating_func` into, if any.
fn gating_hparam(spec: &ArchSpec) -> Option<&memra_codegen::spec::HParam> {
    spec.hparams
        .iter()
        .find(|h| matches!(&h.from, HParamSource::Key(k) if k == "expert_gating_func"))
}

#[test]
fn mla_table_is_the_mla_specs() {
    let mla = mla_specs();
    let names: Vec<&str> = mla.iter().map(|s| s.arch.as_str()).collect();
    let table: Vec<&str> = MLA_ARCHS.iter().map(|a| a.name).collect();
    assert_eq!(
        table, names,
        "MLA_ARCHS vs specs with attention mla / mla_dsa"
    );
    // The two MLA architectures memra shipped before the table was generated stay in it.
    for (name, dsa) in [("deepseek2", false), ("glm-dsa", true)] {
        assert_eq!(MlaArch::named(name).map(|a| a.dsa), Some(dsa), "{name}");
    }
    for spec in &mla {
        let arch = MlaArch::named(&spec.arch).unwrap();
        assert_eq!(
            arch.dsa,
            spec.caps.attention == Attention::MlaDsa,
            "{}",
            spec.arch
        );
        let by_router = match spec.caps.router {
            Router::Softmax => Gating::Softmax,
            Router::SigmoidBias => Gating::Sigmoid,
            Router::None => panic!("{}: an MLA spec without a router", spec.arch),
        };
        assert_eq!(
            arch.default_gating, by_router,
            "{}: gating vs router",
            spec.arch
        );
        if let Some(default) = gating_hparam(spec).and_then(|h| h.default.as_ref()) {
            let by_default = match default {
                HParamDefault::Value(Value::Int(1)) => Gating::Softmax,
                HParamDefault::Value(Value::Int(2)) => Gating::Sigmoid,
                other => panic!("{}: expert_gating_func default {other:?}", spec.arch),
            };
            assert_eq!(
                arch.default_gating, by_default,
                "{}: gating vs default",
                spec.arch
            );
        }
    }
    let (gqa, mla_names) = CPU_ARCHS.split_at(CPU_ARCHS.len() - MLA_ARCHS.len());
    assert_eq!(mla_names, &table[..], "CPU_ARCHS ends with MLA_ARCHS");
    let specs = specs();
    for arch in gqa {
        let spec = specs.iter().find(|s| s.arch == *arch);
        assert!(
            spec.is_some_and(|s| s.caps.attention == Attention::Gqa),
            "CPU_ARCHS: {arch} has no GQA spec"
        );
    }
}

/// `spec`'s micro model, without `expert_gating_func` when `drop_gating`.
fn micro(spec: &ArchSpec, seed: u64, drop_gating: bool) -> Gguf<Vec<u8>> {
    let mut dims = fixture::micro_dims(spec).unwrap_or_else(|e| panic!("{}: {e}", spec.arch));
    if drop_gating {
        let name = &gating_hparam(spec)
            .expect("MLA specs read expert_gating_func")
            .name;
        dims.values.retain(|(n, _)| n != name);
    }
    let bytes =
        fixture::model_from_dims(spec, dims, seed).unwrap_or_else(|e| panic!("{}: {e}", spec.arch));
    Gguf::parse(bytes).unwrap_or_else(|e| panic!("{}: {e}", spec.arch))
}

#[test]
fn every_mla_spec_runs_through_cpu_model() {
    let mut rng = Rng::from_env_or_time("mla_archs");
    let seed = rng.seed();
    for spec in mla_specs() {
        let arch = spec.arch.as_str();
        let gguf = micro(&spec, seed, false);
        let model = CpuModel::from_gguf(&gguf).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert_eq!(model.arch(), arch);
        let CpuModel::Mla(m) = &model else {
            panic!("{arch}: not loaded as CpuModel::Mla");
        };
        let dsa = spec.caps.attention == Attention::MlaDsa;
        assert_eq!(m.hparams().indexer.is_some(), dsa, "{arch}: indexer");
        assert_eq!(
            m.indexer_layers().is_empty(),
            !dsa,
            "{arch}: indexer layers"
        );

        // Longer than the micro DSA top-k, so that sparse selection takes part.
        let n_vocab = model.n_vocab();
        let tokens: Vec<u32> = (0..9).map(|_| rng.below(n_vocab) as u32).collect();
        let mut cache = model.new_cache();
        assert!(matches!(cache, CpuCache::Mla(_)), "{arch}: cache kind");
        let prefill = model.forward(&mut cache, &tokens, true).unwrap();
        assert_eq!(cache.len(), tokens.len());
        assert_eq!(prefill.len(), tokens.len() * n_vocab);
        assert!(
            prefill.iter().all(|v| v.is_finite()),
            "{arch} (seed {seed}): non-finite logits"
        );
        let mut cache = model.new_cache();
        let mut decode = Vec::with_capacity(prefill.len());
        for &t in &tokens {
            decode.extend(model.forward(&mut cache, &[t], false).unwrap());
        }
        logit_verdict_rows(&prefill, &decode, n_vocab, arch)
            .unwrap_or_else(|e| panic!("{arch} (seed {seed}): prefill vs decode:\n{e}"));
        println!("{arch}: {} tokens, prefill = decode", tokens.len());

        let gating = |g: &Gguf<Vec<u8>>| {
            MlaModelHparams::from_gguf(g)
                .unwrap_or_else(|e| panic!("{arch}: {e}"))
                .moe
                .router
                .gating
        };
        let without = micro(&spec, seed, true);
        let key = format!("{arch}.expert_gating_func");
        assert!(without.get(&key).is_none(), "{key} was dropped");
        let want = MlaArch::named(arch).unwrap().default_gating;
        assert_eq!(
            gating(&without),
            want,
            "{arch}: gating of a file without {key}"
        );
    }
}

#[test]
fn a_non_mla_file_is_refused_by_the_mla_loader() {
    let spec = specs()
        .into_iter()
        .find(|s| s.caps.attention == Attention::Gqa)
        .unwrap();
    let gguf = micro(&spec, 1, false);
    let e = MlaModelHparams::from_gguf(&gguf).unwrap_err().to_string();
    assert!(
        e.contains(&format!("\"{}\" is not an MLA architecture", spec.arch)),
        "{e}"
    );
}

/// build.rs itself, run here on a specs folder of our own.
#[allow(dead_code)]
#[path = "../build.rs"]
mod build_script;

/// A new MLA spec needs nothing else: build.rs's table picks it up, its gating from the
/// `expert_gating_func` default, else from the router; a GQA spec is left out.
#[test]
fn a_new_mla_spec_is_a_new_table_row() {
    let dir = std::env::temp_dir().join(format!("memra-mla-archs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let deepseek2 = std::fs::read_to_string(specs_dir().join("deepseek2.toml")).unwrap();
    let renamed = |name: &str| {
        let text = deepseek2.replace("name = \"deepseek2\"", &format!("name = \"{name}\""));
        assert_ne!(
            text, deepseek2,
            "specs/deepseek2.toml: [arch] name not found"
        );
        text
    };
    // Sigmoid by its expert_gating_func default (2) although its router says softmax.
    let sigmoid_default = renamed("mla-fifth").replace(
        "type = \"u32\", default = 1, source = \"LLM_KV_EXPERT_GATING_FUNC",
        "type = \"u32\", default = 2, source = \"LLM_KV_EXPERT_GATING_FUNC",
    );
    // No default: the router (softmax) decides.
    let by_router = renamed("mla-sixth").replace(
        "type = \"u32\", default = 1, source = \"LLM_KV_EXPERT_GATING_FUNC",
        "type = \"u32\", source = \"LLM_KV_EXPERT_GATING_FUNC",
    );
    for (name, text) in [("mla-fifth", &sigmoid_default), ("mla-sixth", &by_router)] {
        assert_ne!(
            *text,
            renamed(name),
            "{name}: the expert_gating_func line was not found"
        );
        std::fs::write(dir.join(format!("{name}.toml")), text).unwrap();
    }
    std::fs::copy(specs_dir().join("qwen3.toml"), dir.join("qwen3.toml")).unwrap();
    let table = build_script::mla_table(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
    let table = table.unwrap_or_else(|e| panic!("{e}"));
    let rows: Vec<&str> = table.lines().filter(|l| l.contains("MlaArch {")).collect();
    assert_eq!(
        rows,
        [
            "    MlaArch { name: \"mla-fifth\", default_gating: Gating::Sigmoid, dsa: false },",
            "    MlaArch { name: \"mla-sixth\", default_gating: Gating::Softmax, dsa: false },",
        ],
        "{table}"
    );
}
