//! Shared by `gpu_dense.rs` (GPU tests) and `dense_nvrtc.rs` (CPU compile checks) for the H-dense
//! kernel families: ad-hoc variants rendered by codegen's own renderer for shapes no spec plans,
//! the template headers read from `templates/`, and host-side helpers.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use memra_codegen::families::{Catalogue, FieldKind, FieldType};
use memra_codegen::render::render_cuda;
use memra_codegen::variant::{KernelVariant as PlannedVariant, Param as PlannedParam, ParamVal};
use memra_engine::cuda::{
    CacheConfig, HeaderSet, KernelCache, PtxasReport, SmArch, compile_variants,
};
use memra_engine::kernels::registry::{KernelVariant, Param};

pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("engine/ has a parent")
        .to_path_buf()
}

fn catalogue() -> &'static Catalogue {
    static CAT: OnceLock<Catalogue> = OnceLock::new();
    CAT.get_or_init(|| {
        let path = workspace_root().join("templates/README.md");
        Catalogue::load(&path).unwrap_or_else(|e| panic!("{e}"))
    })
}

/// Every `templates/memra/*.cuh` under the name the thin `.cu` files include.
pub fn headers() -> &'static HeaderSet {
    static HEADERS: OnceLock<HeaderSet> = OnceLock::new();
    HEADERS.get_or_init(|| {
        let dir = workspace_root().join("templates/memra");
        let mut files: Vec<(String, String)> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "cuh"))
            .map(|p| {
                let name = format!("memra/{}", p.file_name().unwrap().to_string_lossy());
                let text =
                    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                (name, text)
            })
            .collect();
        files.sort();
        let refs: Vec<(&str, &str)> = files
            .iter()
            .map(|(n, t)| (n.as_str(), t.as_str()))
            .collect();
        HeaderSet::new(&refs)
    })
}

/// A parameter value for [`variant`]: an integer or an enum token.
#[derive(Clone, Copy, Debug)]
pub enum V {
    I(i64),
    S(&'static str),
}

fn leak<T>(v: Vec<T>) -> &'static [T] {
    Box::leak(v.into_boxed_slice())
}

fn leak_str(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

/// The variant codegen renders for `family` with `params`: given dims are baked (a specialized
/// variant; none given = the generic one), enum/tune fields not given take the README default.
/// Same text as a planned variant of that shape, so the NVRTC cache entries are shared.
pub fn variant(family: &str, params: &[(&str, V)]) -> &'static KernelVariant {
    static MADE: OnceLock<Mutex<HashMap<String, &'static KernelVariant>>> = OnceLock::new();
    let key = format!("{family}{params:?}");
    let mut made = MADE.get_or_init(Default::default).lock().unwrap();
    if let Some(v) = made.get(&key) {
        return v;
    }
    let fam = catalogue()
        .family(family)
        .unwrap_or_else(|| panic!("templates/README.md has no family `{family}`"));
    for (k, _) in params {
        assert!(fam.field(k).is_some(), "{family} has no Cfg field `{k}`");
    }
    let to_val = |ty: FieldType, text: &str| match ty {
        FieldType::Int => ParamVal::Int(
            text.parse()
                .unwrap_or_else(|_| panic!("{family}: default `{text}` is not an int")),
        ),
        _ => ParamVal::Sym(text.to_string()),
    };
    let mut planned = Vec::new();
    let mut specialized = false;
    for f in &fam.fields {
        let k = f.key();
        let value = match (
            params.iter().find(|(p, _)| *p == k).map(|(_, v)| *v),
            f.kind,
            &f.default,
        ) {
            (Some(V::I(i)), _, _) => ParamVal::Int(i),
            (Some(V::S(s)), _, _) => ParamVal::Sym(s.to_string()),
            (None, FieldKind::Dim, _) => continue,
            (None, _, Some(d)) => to_val(f.ty, d),
            (None, _, None) => panic!("{family}: `{k}` has no default; give it"),
        };
        specialized |= f.kind == FieldKind::Dim;
        let default = f.default.as_deref().map(|d| to_val(f.ty, d));
        planned.push(PlannedParam {
            key: k,
            value,
            kind: f.kind,
            default,
        });
    }
    let pv = PlannedVariant {
        family: family.to_string(),
        archs: if specialized {
            vec!["test".into()]
        } else {
            vec![]
        },
        params: planned,
        served: Vec::new(),
    };
    let source = render_cuda(&pv, fam).unwrap_or_else(|e| panic!("{e}"));
    let params: Vec<(&'static str, Param)> = pv
        .params
        .iter()
        .map(|p| {
            let v = match &p.value {
                ParamVal::Int(i) => Param::Int(*i),
                ParamVal::Sym(s) => Param::Sym(leak_str(s.clone())),
            };
            (leak_str(p.key.clone()), v)
        })
        .collect();
    let v: &'static KernelVariant = Box::leak(Box::new(KernelVariant {
        name: leak_str(pv.name()),
        family: leak_str(family.to_string()),
        arch: specialized.then_some("test"),
        params: leak(params),
        source: leak_str(source),
    }));
    made.insert(key, v);
    v
}

/// bf16 bits -> f32.
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Compiles `variants` for sm_90 with NVRTC (no GPU needed), prints each one's ptxas report, and
/// asserts that every variant compiled, has a report, neither spills nor keeps a stack frame, and
/// passes `extra` (a message for a report it rejects).
pub fn assert_compile_sm90_without_spills(
    variants: &[&'static KernelVariant],
    extra: impl Fn(&KernelVariant, &PtxasReport) -> Option<String>,
) {
    let strict: Vec<_> = variants.iter().map(|&v| (v, true)).collect();
    assert_compile_sm90(&strict, extra);
}

/// [`assert_compile_sm90_without_spills`] where only the variants paired with `true` must not
/// spill nor keep a stack frame (the others must still compile and report).
pub fn assert_compile_sm90(
    variants: &[(&'static KernelVariant, bool)],
    extra: impl Fn(&KernelVariant, &PtxasReport) -> Option<String>,
) {
    let list: Vec<&'static KernelVariant> = variants.iter().map(|(v, _)| *v).collect();
    let cache = KernelCache::new(CacheConfig::memory_only());
    let results = compile_variants(&cache, &list, headers(), SmArch(90));
    let mut failures = Vec::new();
    for ((v, strict), r) in variants.iter().zip(results) {
        match r {
            Err(e) => failures.push(format!("{}: {e}", v.name)),
            Ok(c) => {
                let rep = c.cubin.report();
                eprintln!(
                    "{:<60} regs {:>3}  spill st/ld {}/{}  stack {}  smem {}",
                    v.name,
                    rep.registers.unwrap_or(0),
                    rep.spill_stores.unwrap_or(0),
                    rep.spill_loads.unwrap_or(0),
                    rep.stack_frame.unwrap_or(0),
                    rep.static_smem.unwrap_or(0)
                );
                if rep.registers.is_none() {
                    failures.push(format!("{}: no ptxas report in the NVRTC log", v.name));
                }
                if *strict && (rep.spills() || rep.stack_frame.unwrap_or(0) > 0) {
                    failures.push(format!("{}: spills or has a stack frame: {rep:?}", v.name));
                }
                failures.extend(extra(v, &rep));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} variants failed:\n{}",
        failures.len(),
        variants.len(),
        failures.join("\n")
    );
}
