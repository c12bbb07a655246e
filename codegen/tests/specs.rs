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
