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
