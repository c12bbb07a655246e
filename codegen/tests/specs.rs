//! Every committed spec parses, validates, resolves its preset and plans against the
//! templates catalogue.

use std::path::{Path, PathBuf};

use memra_codegen::dims;
use memra_codegen::families::Catalogue;
use memra_codegen::plan;
use memra_codegen::spec::ArchSpec;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("codegen/ has a parent")
        .to_path_buf()
}

#[test]
fn every_spec_validates_resolves_and_plans() {
    let catalogue = Catalogue::load(&root().join("templates/README.md")).unwrap();
    let archs = memra_codegen::build::spec_archs(&root().join("specs")).unwrap();
    assert!(archs.len() >= 4, "{archs:?}");
    for arch in archs {
        let spec = ArchSpec::load(&root().join(format!("specs/{arch}.toml")))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(spec.arch, arch);
        for p in &spec.presets {
            let d = dims::from_preset(&spec, Some(&p.name)).unwrap_or_else(|e| panic!("{e}"));
            let planned =
                plan::plan_arch(&spec, &d, &catalogue).unwrap_or_else(|e| panic!("{arch}: {e}"));
            assert!(
                !planned.variants.is_empty(),
                "{arch}/{}: nothing planned",
                p.name
            );
            for v in &planned.variants {
                println!("{arch}: {}", v.name());
            }
            for n in &planned.notes {
                println!("{arch}: note: {n}");
            }
        }
    }
}

/// `stack = true` plans one variant per run of equal-typed neighbours, and with `widen = true` of
/// neighbours exact in a common type: Gemma 3 270M's layers with a Q8_0 attn_v stack q + k + v as
/// Q8_0 (q and k re-encoded from Q5_0), the all-Q5_0 layers stack all three as they are (640 →
/// 1536 either way). No variant at a single q, k or v shape, nor a Q5_0 q + k, comes from that
/// entry; the per-tensor entries plan the widened q and k too.
#[test]
fn stacked_entries_plan_runs_of_equal_or_widened_types() {
    use memra_gguf::GgmlType::{Q4_0, Q4_K, Q5_0, Q6_K, Q8_0};
    let runs = |parts: &[(memra_gguf::GgmlType, u64)], widen| plan::stack_runs(parts, widen);
    assert_eq!(runs(&[(Q5_0, 640), (Q5_0, 640), (Q8_0, 640)], false), vec![(0..2, Q5_0), (2..3, Q8_0)]);
    assert_eq!(runs(&[(Q5_0, 640), (Q5_0, 640), (Q5_0, 640)], false), vec![(0..3, Q5_0)]);
    assert_eq!(runs(&[(Q5_0, 640), (Q8_0, 640), (Q5_0, 640)], false), vec![(0..1, Q5_0), (1..2, Q8_0), (2..3, Q5_0)]);
    assert_eq!(runs(&[(Q5_0, 640), (Q5_0, 512)], false), vec![(0..1, Q5_0), (1..2, Q5_0)]);
    assert!(runs(&[], false).is_empty());
    assert_eq!(runs(&[(Q5_0, 640), (Q5_0, 640), (Q8_0, 640)], true), vec![(0..3, Q8_0)]);
    assert_eq!(runs(&[(Q5_0, 640), (Q8_0, 640), (Q4_0, 640)], true), vec![(0..3, Q8_0)]);
    assert_eq!(runs(&[(Q5_0, 640), (Q5_0, 640), (Q5_0, 640)], true), vec![(0..3, Q5_0)]);
    assert_eq!(runs(&[(Q4_K, 640), (Q4_K, 640), (Q6_K, 640)], true), vec![(0..2, Q4_K), (2..3, Q6_K)]);
    assert_eq!(runs(&[(Q5_0, 640), (Q8_0, 512)], true), vec![(0..1, Q5_0), (1..2, Q8_0)]);
    let catalogue = Catalogue::load(&root().join("templates/README.md")).unwrap();
    let spec = ArchSpec::load(&root().join("specs/gemma3.toml")).unwrap();
    let d = dims::from_preset(&spec, None).unwrap();
    let names: Vec<String> = plan::plan_arch(&spec, &d, &catalogue).unwrap().variants.iter().map(|v| v.name()).collect();
    let fused: Vec<&String> = names.iter().filter(|n| n.starts_with("norm_matvec__") && n.ends_with("_none")).collect();
    for want in ["norm_matvec__k640_n1536__q5_0_none", "norm_matvec__k640_n1536__q8_0_none"] {
        assert!(fused.iter().any(|n| *n == want), "{want} not planned: {fused:?}");
    }
    for not in ["norm_matvec__k640_n1024__q5_0_none", "norm_matvec__k640_n1280__q5_0_none", "norm_matvec__k640_n256__q8_0_none"] {
        assert!(!fused.iter().any(|n| *n == not), "{not} planned: {fused:?}");
    }
    assert!(names.iter().any(|n| n.starts_with("matvec__k640_n1024__q8_0")), "the widened q's own matvec: {names:?}");
}

/// An entry's `xq8` (the integer path) reaches only the weight types that have one: gemma3's LM
/// head entry over a BF16 or F16 `token_embd` plans the f32 path, over Q8_0 the integer one.
#[test]
fn xq8_applies_only_to_types_with_an_integer_path() {
    use memra_gguf::GgmlType;
    let catalogue = Catalogue::load(&root().join("templates/README.md")).unwrap();
    let spec = ArchSpec::load(&root().join("specs/gemma3.toml")).unwrap();
    for (ty, xq8) in [(GgmlType::Q8_0, 1), (GgmlType::BF16, 0), (GgmlType::F16, 0), (GgmlType::Q4_1, 0)] {
        let mut d = dims::from_preset(&spec, None).unwrap();
        let embd = d.tensors.iter_mut().find(|t| t.name == "token_embd.weight").expect("gemma3 has token_embd");
        embd.ggml_type = ty;
        let plan = plan::plan_arch(&spec, &d, &catalogue).unwrap_or_else(|e| panic!("{ty:?}: {e}"));
        let head = plan
            .variants
            .iter()
            .find(|v| v.family == "norm_matvec" && v.param("n").map(|n| n.to_string()) == Some("262144".into()))
            .unwrap_or_else(|| panic!("{ty:?}: no norm_matvec LM head planned"));
        assert_eq!(head.param("xq8").map(|v| v.to_string()), Some(xq8.to_string()), "{ty:?}: {}", head.name());
    }
}

/// `xq8_types` narrows an entry's integer path to the listed weight types: glm-dsa's attn_output
/// entry plans xq8 = 1 for a Q4_K or Q6_K attn_output and f32 x for Q8_0; a Q4_K attn_q_a (the
/// other, f32-x entry) stays f32.
#[test]
fn xq8_types_keeps_the_integer_path_to_the_listed_types() {
    use memra_gguf::GgmlType;
    let catalogue = Catalogue::load(&root().join("templates/README.md")).unwrap();
    let spec = ArchSpec::load(&root().join("specs/glm-dsa.toml")).unwrap();
    for (ty, xq8) in [(GgmlType::Q4_K, 1), (GgmlType::Q6_K, 1), (GgmlType::Q8_0, 0)] {
        let mut d = dims::from_preset(&spec, None).unwrap();
        for t in d.tensors.iter_mut().filter(|t| t.name.ends_with(".attn_output.weight") || t.name.ends_with(".attn_q_a.weight")) {
            t.ggml_type = ty;
        }
        let plan = plan::plan_arch(&spec, &d, &catalogue).unwrap_or_else(|e| panic!("{ty:?}: {e}"));
        let find = |k: &str, n: &str| {
            plan.variants
                .iter()
                .find(|v| v.family == "matvec" && v.param("k").map(|x| x.to_string()).as_deref() == Some(k) && v.param("n").map(|x| x.to_string()).as_deref() == Some(n))
                .unwrap_or_else(|| panic!("{ty:?}: no matvec {k}->{n}"))
        };
        let out = find("16384", "6144");
        assert_eq!(out.param("xq8").map(|v| v.to_string()), Some(xq8.to_string()), "{ty:?}: {}", out.name());
        let q_a = find("6144", "2048");
        assert_eq!(q_a.param("xq8").map(|v| v.to_string()), Some("0".to_string()), "{ty:?}: {}", q_a.name());
    }
}

/// No generic variant takes the integer path on a type without one (it would trap): with an
/// `xq8` tuning in some spec, its generic values reach only the int-path types.
#[test]
fn no_generic_variant_pairs_xq8_with_a_type_without_an_integer_path() {
    use memra_codegen::families::has_int_path;
    let catalogue = Catalogue::load(&root().join("templates/README.md")).unwrap();
    let mut specialized = Vec::new();
    for arch in ["glm-dsa", "deepseek2", "gemma3", "qwen3"] {
        let spec = ArchSpec::load(&root().join(format!("specs/{arch}.toml"))).unwrap();
        let d = dims::from_preset(&spec, None).unwrap();
        specialized.extend(plan::plan_arch(&spec, &d, &catalogue).unwrap().variants);
    }
    assert!(specialized.iter().any(|v| v.param("xq8").is_some_and(|x| x.to_string() != "0")), "no spec plans xq8 any more: pick another");
    let (generic, _) = plan::plan_generic(&catalogue, &specialized);
    let mut int_path = 0;
    let on = |v: &memra_codegen::KernelVariant, key: &str| v.param(key).is_some_and(|x| x.to_string() != "0");
    for v in generic.iter().filter(|v| on(v, "xq8") || on(v, "fuse_x")) {
        let q = v.param("qtype").map(|q| q.to_string()).unwrap_or_default();
        assert!(has_int_path(&q), "{}: xq8 on {q}", v.name());
        int_path += 1;
    }
    assert!(int_path > 0, "no generic xq8 variant at all");
}

/// `at_run_time = ["n"]`: the entry's variants bake every other dim and record, per architecture,
/// the shapes they serve; the errors name the entry's key. GLM-5's prefill matmuls: one variant
/// per (K, type), every tensor's N among its served shapes, none baking N.
#[test]
fn at_run_time_dims_are_served_not_baked() {
    let catalogue = Catalogue::load(&root().join("templates/README.md")).unwrap();
    let spec = ArchSpec::load(&root().join("specs/glm-dsa.toml")).unwrap();
    let d = dims::from_preset(&spec, None).unwrap();
    let plan = plan::plan_arch(&spec, &d, &catalogue).unwrap();
    let matmuls: Vec<_> = plan.variants.iter().filter(|v| v.family == "matmul").collect();
    assert!(!matmuls.is_empty());
    for v in &matmuls {
        assert!(v.param("n").is_none(), "{} bakes n", v.name());
        assert!(v.param("k").is_some(), "{} does not bake k", v.name());
        assert!(!v.served.is_empty() && v.served.iter().all(|(a, s)| a == "glm-dsa" && s.len() == 1 && s[0].0 == "n"), "{}: {:?}", v.name(), v.served);
    }
    // attn_output (16384 -> 6144, Q8_0) and the Q4_K experts are among the shapes served.
    let serves = |name: &str, n: i64| matmuls.iter().any(|v| v.name() == name && v.served.iter().any(|(_, s)| s[0].1 == n));
    assert!(serves("matmul__k16384__q8_0", 6144));
    assert!(serves("matmul__k6144__q4_k", 2048));
    let names: std::collections::HashSet<String> = matmuls.iter().map(|v| v.name()).collect();
    assert_eq!(names.len(), matmuls.len(), "a name planned twice");

    // Mistakes: a key that is no dim of the family, one that is not a dim, one without a value,
    // and every dim at run time.
    let text = std::fs::read_to_string(root().join("specs/glm-dsa.toml")).unwrap();
    let entry = "at_run_time = [\"n\"]";
    assert!(text.contains(entry));
    for (with, message) in [
        ("at_run_time = [\"m\"]", "`matmul` has no dim `m`"),
        ("at_run_time = [\"qtype\"]", "`qtype` of `matmul` is not a dim"),
        ("at_run_time = [\"n\", \"k\"]", "leaves no dim of `matmul` baked"),
        ("at_run_time = [3]", "expected a dim key of the family"),
    ] {
        let broken = text.replacen(entry, with, 1);
        let err = match ArchSpec::parse(Path::new("specs/glm-dsa.toml"), &broken) {
            Err(e) => e.to_string(),
            Ok(spec) => plan::plan_arch(&spec, &d, &catalogue).err().map(|e| e.to_string()).unwrap_or_default(),
        };
        assert!(err.contains(message) && err.contains("specs/glm-dsa.toml:"), "{with}: {err}");
    }
    let broken = text.replacen("n = \"ne1\"\nat_run_time", "at_run_time", 1);
    let spec = ArchSpec::parse(Path::new("specs/glm-dsa.toml"), &broken).unwrap();
    let err = plan::plan_arch(&spec, &d, &catalogue).unwrap_err().to_string();
    assert!(err.contains("`n` is passed at run time but has no value"), "{err}");
}
