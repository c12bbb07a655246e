//! The build entry point end to end: specs + preset or MEMRA_MODEL GGUF -> rendered files,
//! with the model's dims as compile-time constants, generic twins, and stable writes.

use std::fs;
use std::path::{Path, PathBuf};

use memra_codegen::build::{self, BuildRequest, Generated};
use memra_codegen::dims;
use memra_codegen::fixture::{self, Fill};
use memra_codegen::spec::{ArchSpec, Value};
use memra_codegen::variant::ParamVal;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memra-codegen-{}-{name}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn request(archs: &[&str], model: Option<PathBuf>, out: &Path) -> BuildRequest {
    BuildRequest {
        specs_dir: root().join("specs"),
        templates_dir: root().join("templates"),
        out_dir: out.to_path_buf(),
        archs: archs.iter().map(|a| a.to_string()).collect(),
        model,
        shards: None,
    }
}

fn file<'a>(g: &'a Generated, rel: &str) -> &'a str {
    &g.files
        .iter()
        .find(|(r, _)| r == rel)
        .unwrap_or_else(|| panic!("{rel} not generated"))
        .1
}

fn specialized_sources(g: &Generated) -> String {
    g.variants
        .iter()
        .filter(|v| !v.is_generic())
        .map(|v| file(g, &format!("kernels/{}.cu", v.name())))
        .collect()
}

#[test]
fn glm_dsa_sources_bake_glm5_dims() {
    let g = build::generate(&request(
        &["glm-dsa"],
        None,
        &std::env::temp_dir().join("memra-codegen-unused"),
    ))
    .unwrap();
    let cu = specialized_sources(&g);
    for n in [6144, 2048, 512] {
        assert!(
            cu.contains(&format!("static constexpr int N = {n};")),
            "rmsnorm over {n} missing:\n{cu}"
        );
    }
    assert!(cu.contains("static constexpr int N_EMBD = 6144;"), "{cu}");
    assert!(
        cu.contains("static constexpr int N_FF = 12288;")
            && cu.contains("static constexpr int N_FF = 2048;")
    );
    assert!(
        cu.contains("static constexpr int N_VOCAB = 256;")
            && cu.contains("static constexpr int K = 8;"),
        "router top-8 of 256"
    );
    let rs = file(&g, "kernels.rs");
    for (name, v) in [
        ("N_EMBD", 6144),
        ("N_HEAD", 64),
        ("Q_LORA_RANK", 2048),
        ("KV_LORA_RANK", 512),
        ("QK_NOPE_HEAD_DIM", 192),
        ("ROPE_DIM", 64),
        ("V_HEAD_DIM", 256),
    ] {
        assert!(
            rs.contains(&format!("pub const {name}: u32 = {v};")),
            "{name} = {v} missing"
        );
    }
    assert!(rs.contains("(\"glm-dsa\", \"preset `glm-5`\")"), "{rs}");
}

#[test]
fn memra_model_gguf_specializes_to_the_files_dims() {
    let out = scratch("gemma-gguf");
    let s = ArchSpec::load(&root().join("specs/gemma3.toml")).unwrap();
    let d = dims::from_preset_with(
        &s,
        None,
        &[("block_count", Value::Int(2)), ("n_vocab", Value::Int(512))],
    )
    .unwrap();
    let model = out.join("gemma3-micro.gguf");
    fixture::writer_for(&s, &d, Fill::Zeros)
        .unwrap()
        .write_file(&model)
        .unwrap();

    // The feature is off: MEMRA_MODEL alone adds its architecture, with a warning.
    let g = build::generate(&request(&[], Some(model.clone()), &out.join("out"))).unwrap();
    assert!(
        g.warnings
            .iter()
            .any(|w| w.contains("`gemma3` model") && w.contains("model-gemma3 is off")),
        "{:?}",
        g.warnings
    );
    let cu = specialized_sources(&g);
    for needle in [
        "static constexpr int N = 640;",
        "static constexpr int HEAD_DIM = 256;",
        "static constexpr int N_HEAD = 4;",
        "static constexpr int N_KV = 1;",
        "static constexpr int N_ROT = 256;",
        "memra::RopeMode::Neox",
        "memra::QkNorm::PerHead",
    ] {
        assert!(cu.contains(needle), "{needle} missing:\n{cu}");
    }
    assert!(
        cu.contains("static constexpr int N_VOCAB = 512;"),
        "vocab comes from the file, not the preset"
    );
    assert!(
        !cu.contains("262144"),
        "nothing of the preset's vocabulary leaks in"
    );
    let rs = file(&g, "kernels.rs");
    assert!(
        rs.contains(&format!("(\"gemma3\", \"GGUF {}\")", model.display())),
        "{rs}"
    );
    assert!(
        rs.contains("pub const N_EMBD: u32 = 640;") && rs.contains("pub const N_HEAD_KV: u32 = 1;")
    );

    // A model of an arch without a spec fails with the list of specs.
    let mut w = memra_gguf::GgufWriter::new();
    w.add_meta("general.architecture", "llama");
    let bad = out.join("llama.gguf");
    w.write_file(&bad).unwrap();
    let e = build::generate(&request(&[], Some(bad), &out.join("out2")))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("llama.toml: no such spec (specs: deepseek2, gemma3, glm-dsa, olmoe, qwen3"),
        "{e}"
    );
}

#[test]
fn every_specialized_variant_has_a_generic_twin() {
    let g = build::generate(&request(
        &["glm-dsa", "qwen3", "olmoe", "gemma3"],
        None,
        &std::env::temp_dir().join("memra-codegen-unused"),
    ))
    .unwrap();
    let generic: Vec<_> = g.variants.iter().filter(|v| v.is_generic()).collect();
    assert!(!generic.is_empty());
    for v in g.variants.iter().filter(|v| !v.is_generic()) {
        let non_dims: Vec<_> = v
            .params
            .iter()
            .filter(|p| p.kind != memra_codegen::families::FieldKind::Dim)
            .collect();
        let twin = generic
            .iter()
            .find(|gv| gv.family == v.family && gv.params.iter().collect::<Vec<_>>() == non_dims);
        assert!(twin.is_some(), "{} has no generic twin", v.name());
    }
    // Generic variants bake no dim and exist for every QType of the contract.
    assert!(generic.iter().all(|v| {
        v.params
            .iter()
            .all(|p| p.kind != memra_codegen::families::FieldKind::Dim)
    }));
    let embeds: Vec<_> = generic.iter().filter(|v| v.family == "embed").collect();
    assert_eq!(embeds.len(), 13, "one generic embed per QType");
    assert!(
        embeds
            .iter()
            .any(|v| v.param("qtype") == Some(&ParamVal::Sym("iq4_xs".into())))
    );
    // Shared variants are generated once and remember every arch that asked.
    let names: Vec<String> = g.variants.iter().map(|v| v.name()).collect();
    let mut dedup = names.clone();
    dedup.sort();
    dedup.dedup();
    assert_eq!(dedup.len(), names.len(), "duplicate variant names");
    let rms2048 = g
        .variants
        .iter()
        .find(|v| v.name() == "rmsnorm__n2048")
        .unwrap();
    assert_eq!(
        rms2048.archs,
        ["glm-dsa", "olmoe"],
        "GLM q_a_norm and OLMoE n_embd share one variant"
    );
    assert!(
        file(&g, "kernels/rmsnorm__n2048.cu").starts_with(
            "// @generated by memra-codegen from specs/glm-dsa.toml, specs/olmoe.toml"
        )
    );
}

#[test]
fn writes_only_what_changed_and_removes_stale_variants() {
    let out = scratch("writes");
    let g = build::generate(&request(&["qwen3"], None, &out)).unwrap();
    let first = build::write_generated(&out, &g).unwrap();
    assert_eq!(first.written, g.files.len());
    let registry = out.join("kernels.rs");
    let stamp = fs::metadata(&registry).unwrap().modified().unwrap();
    let again = build::write_generated(&out, &g).unwrap();
    assert_eq!(again.written, 0, "identical content is not rewritten");
    assert_eq!(fs::metadata(&registry).unwrap().modified().unwrap(), stamp);

    fs::write(out.join("kernels/rmsnorm__n1.cu"), "stale").unwrap();
    let g2 = build::generate(&request(&[], None, &out)).unwrap();
    let third = build::write_generated(&out, &g2).unwrap();
    assert!(!out.join("kernels/rmsnorm__n1.cu").exists());
    assert!(
        !out.join("kernels/rmsnorm__n4096.cu").exists(),
        "qwen3 variants go when the feature goes"
    );
    assert!(third.removed >= 2, "{}", third.removed);
    assert!(out.join("kernels/rmsnorm__generic.cu").exists());
    let _ = fs::remove_dir_all(&out);
}

#[test]
fn relative_memra_model_paths_resolve_against_the_shells_directory() {
    let dir = scratch("pwd");
    fs::write(dir.join("m.gguf"), b"x").unwrap();
    assert_eq!(
        build::resolve_model_path(Path::new("m.gguf"), Some(&dir)),
        dir.join("m.gguf")
    );
    assert_eq!(
        build::resolve_model_path(Path::new("other.gguf"), Some(&dir)),
        Path::new("other.gguf")
    );
    assert_eq!(
        build::resolve_model_path(Path::new("/abs/m.gguf"), Some(&dir)),
        Path::new("/abs/m.gguf")
    );
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn features_map_to_archs_by_listing_specs() {
    let archs = build::enabled_archs(&root().join("specs"), |var| {
        var == "CARGO_FEATURE_MODEL_GLM_DSA" || var == "CARGO_FEATURE_MODEL_QWEN3"
    })
    .unwrap();
    assert_eq!(archs, ["glm-dsa", "qwen3"]);
    assert!(
        build::enabled_archs(&root().join("specs"), |_| false)
            .unwrap()
            .is_empty()
    );
}

/// A `static constexpr` int / bool data member in a template becomes a device global in every
/// module that instantiates its struct, and each global slows the module's load (templates/README.md).
#[test]
fn template_constants_are_enumerators_not_static_constexpr_members() {
    let mut found = Vec::new();
    for entry in fs::read_dir(root().join("templates/memra")).unwrap() {
        let path = entry.unwrap().path();
        let text = fs::read_to_string(&path).unwrap();
        for (i, line) in text.lines().enumerate() {
            // `static constexpr int NAME =` (or `,` / `;`) anywhere on the line; functions have `(`.
            let data_member = ["static constexpr int ", "static constexpr bool "].iter().any(|p| {
                line.match_indices(p).any(|(at, _)| {
                    let rest = &line[at + p.len()..];
                    let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                    !name.is_empty() && rest[name.len()..].trim_start().starts_with(['=', ',', ';'])
                })
            });
            if data_member {
                found.push(format!("{}:{}: {}", path.file_name().unwrap().to_string_lossy(), i + 1, line.trim()));
            }
        }
    }
    assert!(found.is_empty(), "use `enum : int {{ NAME = ... }};` instead:\n{}", found.join("\n"));
}
