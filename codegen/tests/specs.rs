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

/// `stack = true` plans one variant per run of equal-typed neighbours: Gemma 3 270M's layers
/// with a Q8_0 attn_v stack q + k (640 → 1280, Q5_0) and keep v alone; the all-Q5_0 layers stack
/// all three (640 → 1536). No variant at a single q, k or v shape comes from that entry.
#[test]
fn stacked_entries_plan_runs_of_equal_types() {
    use memra_gguf::GgmlType::{Q5_0, Q8_0};
    assert_eq!(plan::stack_runs(&[(Q5_0, 640), (Q5_0, 640), (Q8_0, 640)]), vec![0..2, 2..3]);
    assert_eq!(plan::stack_runs(&[(Q5_0, 640), (Q5_0, 640), (Q5_0, 640)]), vec![0..3]);
    assert_eq!(plan::stack_runs(&[(Q5_0, 640), (Q8_0, 640), (Q5_0, 640)]), vec![0..1, 1..2, 2..3]);
    assert_eq!(plan::stack_runs(&[(Q5_0, 640), (Q5_0, 512)]), vec![0..1, 1..2]);
    assert!(plan::stack_runs::<u8>(&[]).is_empty());
    let catalogue = Catalogue::load(&root().join("templates/README.md")).unwrap();
    let spec = ArchSpec::load(&root().join("specs/gemma3.toml")).unwrap();
    let d = dims::from_preset(&spec, None).unwrap();
    let names: Vec<String> = plan::plan_arch(&spec, &d, &catalogue)
        .unwrap()
        .variants
        .iter()
        .map(|v| v.name())
        .filter(|n| n.starts_with("norm_matvec__") && n.ends_with("_none"))
        .collect();
    for want in ["norm_matvec__k640_n1280__q5_0_none", "norm_matvec__k640_n1536__q5_0_none", "norm_matvec__k640_n256__q8_0_none"] {
        assert!(names.iter().any(|n| n == want), "{want} not planned: {names:?}");
    }
    assert!(!names.iter().any(|n| n == "norm_matvec__k640_n1024__q5_0_none"), "q planned alone: {names:?}");
}
