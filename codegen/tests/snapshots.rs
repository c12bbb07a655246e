//! Golden files of the generated code: `codegen/tests/snapshots/*.snap`, compared byte for
//! byte. After an intended change (a spec, a template's Cfg table, the renderer), rewrite them
//! with `MEMRA_BLESS=1 cargo test -p memra-codegen --test snapshots` and review the diff.

use std::fmt::Write;
use std::path::{Path, PathBuf};

use memra_codegen::build::{self, BuildRequest, Generated};
use memra_codegen::families::FieldKind;
use memra_codegen::render;
use memra_codegen::variant::{KernelVariant, Param, ParamVal};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn check(name: &str, actual: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/snapshots")
        .join(format!("{name}.snap"));
    if std::env::var_os("MEMRA_BLESS").is_some_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        println!("blessed {}", path.display());
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run with MEMRA_BLESS=1 to create it",
            path.display()
        )
    });
    if expected != actual {
        let (line, (want, got)) = expected
            .lines()
            .chain(std::iter::repeat("<end of file>"))
            .zip(actual.lines().chain(std::iter::repeat("<end of file>")))
            .enumerate()
            .find(|(_, (a, b))| a != b)
            .unwrap_or((0, ("", "")));
        panic!(
            "{} differs from the generated code at line {}:\n  golden:    {want}\n  generated: {got}\nIf the change is intended: MEMRA_BLESS=1 cargo test -p memra-codegen --test snapshots",
            path.display(),
            line + 1
        );
    }
}

fn generate(archs: &[&str]) -> Generated {
    let out = std::env::temp_dir().join(format!("memra-codegen-snap-{}", std::process::id()));
    build::generate(&BuildRequest {
        specs_dir: root().join("specs"),
        templates_dir: root().join("templates"),
        out_dir: out,
        archs: archs.iter().map(|a| a.to_string()).collect(),
        model: None,
        shards: None,
    })
    .unwrap()
}

fn file<'a>(g: &'a Generated, rel: &str) -> &'a str {
    &g.files.iter().find(|(r, _)| r == rel).unwrap().1
}

/// The specialized sources of one arch and its dims constants, in planning order.
fn arch_snapshot(arch: &str) -> String {
    let g = generate(&[arch]);
    let mut out = String::new();
    for v in g.variants.iter().filter(|v| !v.is_generic()) {
        let _ = writeln!(out, "==== kernels/{}.cu", v.name());
        out.push_str(file(&g, &format!("kernels/{}.cu", v.name())));
    }
    let rs = file(&g, "kernels.rs");
    let start = rs.find("pub mod specialized_dims").unwrap();
    let end = start + rs[start..].find("\n}\n").unwrap() + 3;
    out.push_str("==== kernels.rs (specialized_dims)\n");
    out.push_str(&rs[start..end]);
    out
}

/// The architectures with a spec: `specs/<arch>.toml`.
fn spec_archs() -> Vec<String> {
    let mut archs: Vec<String> = std::fs::read_dir(root().join("specs"))
        .unwrap()
        .filter_map(|e| {
            let path = e.unwrap().path();
            let stem = path.file_stem()?.to_str()?.to_string();
            (path.extension()? == "toml").then_some(stem)
        })
        .collect();
    archs.sort();
    archs
}

/// One golden file per spec, so a new architecture needs no test of its own: its first run
/// asks for `MEMRA_BLESS=1`, and a golden file whose spec is gone is an error.
#[test]
fn every_spec_matches_its_snapshot() {
    let archs = spec_archs();
    assert!(archs.len() >= 4, "specs/ lists {archs:?}");
    for arch in &archs {
        check(arch, &arch_snapshot(arch));
    }
    let snaps = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots");
    for e in std::fs::read_dir(&snaps).unwrap() {
        let path = e.unwrap().path();
        let stem = path.file_stem().unwrap().to_string_lossy().to_string();
        let fixed = ["generic", "registry"].contains(&stem.as_str());
        assert!(
            fixed || archs.contains(&stem),
            "{} has no spec specs/{stem}.toml: delete it if the architecture was removed",
            path.display()
        );
    }
}

#[test]
fn generic_snapshot() {
    let g = generate(&[]);
    let mut out = String::from("==== generic variants\n");
    for v in &g.variants {
        assert!(v.is_generic());
        let _ = writeln!(out, "{}", v.name());
    }
    for name in [
        "rmsnorm__generic",
        "embed__generic__q4_k",
        "qk_norm_rope__generic__interleaved_none_f32",
    ] {
        let _ = writeln!(out, "==== kernels/{name}.cu");
        out.push_str(file(&g, &format!("kernels/{name}.cu")));
    }
    check("generic", &out);
}

#[test]
fn registry_snapshot() {
    let p = |key: &str, value: ParamVal, kind: FieldKind, default: Option<i64>| Param {
        key: key.into(),
        value,
        kind,
        default: default.map(ParamVal::Int),
    };
    let variants = [
        KernelVariant {
            family: "rmsnorm".into(),
            archs: vec!["glm-dsa".into()],
            params: vec![
                p("n", ParamVal::Int(6144), FieldKind::Dim, None),
                p("threads", ParamVal::Int(256), FieldKind::Tune, Some(256)),
            ],
            served: Vec::new(),
        },
        // N at run time (`at_run_time`), asked for by two specs: ARCHS and SERVED rows.
        KernelVariant {
            family: "matmul".into(),
            archs: vec!["glm-dsa".into(), "deepseek2".into()],
            params: vec![
                p("k", ParamVal::Int(2048), FieldKind::Dim, None),
                p("qtype", ParamVal::Sym("q8_0".into()), FieldKind::Enum, None),
            ],
            served: vec![
                ("glm-dsa".into(), vec![("n".into(), 16384)]),
                ("deepseek2".into(), vec![("n".into(), 3072)]),
            ],
        },
        KernelVariant {
            family: "embed".into(),
            archs: vec![],
            params: vec![
                p("qtype", ParamVal::Sym("q4_k".into()), FieldKind::Enum, None),
                p("threads", ParamVal::Int(128), FieldKind::Tune, Some(128)),
            ],
            served: Vec::new(),
        },
        // A defaulted enum away from its default (the integer path) counts as tuned: the
        // tie-break between equal generic fits prefers the default, xq8 = 0.
        KernelVariant {
            family: "matvec".into(),
            archs: vec![],
            params: vec![
                p("qtype", ParamVal::Sym("q8_0".into()), FieldKind::Enum, None),
                p("xq8", ParamVal::Int(1), FieldKind::Enum, Some(0)),
            ],
            served: Vec::new(),
        },
        KernelVariant {
            family: "matvec".into(),
            archs: vec![],
            params: vec![
                p("qtype", ParamVal::Sym("q8_0".into()), FieldKind::Enum, None),
                p("xq8", ParamVal::Int(0), FieldKind::Enum, Some(0)),
            ],
            served: Vec::new(),
        },
    ];
    let headers = [(
        "memra/common.cuh".to_string(),
        Path::new("/templates/memra/common.cuh"),
    )];
    check(
        "registry",
        &render::render_registry(&variants, &headers, &[]),
    );
}
