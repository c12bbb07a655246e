//! The build-script entry point: specs + dims + catalogue -> `$OUT_DIR/kernels/*.cu` and
//! `$OUT_DIR/kernels.rs`, written only when their content changed (so cargo and the NVRTC
//! cache see stable files), plus the `cargo:rerun-if-*` lines.

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use memra_gguf::GgufFile;

use crate::dims::{self, DimsError, ModelDims};
use crate::families::{Catalogue, CatalogueError};
use crate::plan::{self, PlanError};
use crate::render;
use crate::source::SpecErrors;
use crate::spec::ArchSpec;
use crate::variant::KernelVariant;

/// The environment variable naming a GGUF whose header gives the dims at build time.
pub const MODEL_ENV: &str = "MEMRA_MODEL";

#[derive(Clone, Debug)]
pub struct BuildRequest {
    pub specs_dir: PathBuf,
    pub templates_dir: PathBuf,
    pub out_dir: PathBuf,
    /// Architectures to specialize for (from the enabled `model-*` features).
    pub archs: Vec<String>,
    /// `MEMRA_MODEL`: its architecture is specialized to its exact dims and types.
    pub model: Option<PathBuf>,
    /// `MEMRA_SHARDS`: GPU counts to plan per-rank shapes for, instead of each spec's
    /// `[parallel] shards` (`None`: the specs' lists).
    pub shards: Option<Vec<usize>>,
}

impl BuildRequest {
    /// The request a build script makes: dirs relative to `manifest_dir`'s parent (the
    /// workspace root), archs from `CARGO_FEATURE_MODEL_*`, model from `MEMRA_MODEL`.
    pub fn from_cargo_env(workspace_root: &Path) -> Result<BuildRequest, BuildError> {
        let out_dir = std::env::var_os("OUT_DIR").ok_or_else(|| {
            BuildError::Env("OUT_DIR is not set (not running under cargo?)".into())
        })?;
        let specs_dir = workspace_root.join("specs");
        let archs = enabled_archs(&specs_dir, |var| std::env::var_os(var).is_some())?;
        let model = std::env::var_os(MODEL_ENV)
            .filter(|v| !v.is_empty())
            .map(|v| {
                resolve_model_path(
                    Path::new(&v),
                    std::env::var_os("PWD").as_deref().map(Path::new),
                )
            });
        let shards = match std::env::var(crate::shard::SHARDS_ENV) {
            Ok(v) => Some(crate::shard::parse_shards(&v).map_err(BuildError::Env)?),
            Err(_) => None,
        };
        Ok(BuildRequest {
            specs_dir,
            templates_dir: workspace_root.join("templates"),
            out_dir: PathBuf::from(out_dir),
            archs,
            model,
            shards,
        })
    }
}

/// Build scripts run in the package directory, so a relative `MEMRA_MODEL` is taken relative to
/// the shell's `$PWD` (where the user typed `cargo build`) when the file exists there.
pub fn resolve_model_path(path: &Path, pwd: Option<&Path>) -> PathBuf {
    match pwd {
        Some(dir) if path.is_relative() && dir.join(path).is_file() => dir.join(path),
        _ => path.to_path_buf(),
    }
}

/// The archs whose `model-<arch>` feature is on, found by listing `specs/*.toml` (so a new
/// spec needs no change here). `feature_on` answers for `CARGO_FEATURE_MODEL_<ARCH>`.
pub fn enabled_archs(
    specs_dir: &Path,
    feature_on: impl Fn(&str) -> bool,
) -> Result<Vec<String>, BuildError> {
    let mut archs = Vec::new();
    for arch in spec_archs(specs_dir)? {
        let var = format!(
            "CARGO_FEATURE_MODEL_{}",
            arch.to_ascii_uppercase().replace('-', "_")
        );
        if feature_on(&var) {
            archs.push(arch);
        }
    }
    Ok(archs)
}

/// Every `<arch>` with a `specs/<arch>.toml`, sorted.
pub fn spec_archs(specs_dir: &Path) -> Result<Vec<String>, BuildError> {
    let entries = fs::read_dir(specs_dir)
        .map_err(|e| BuildError::Io(format!("{}: {e}", specs_dir.display())))?;
    let mut archs: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_suffix(".toml"))
                .map(str::to_string)
        })
        .collect();
    archs.sort();
    Ok(archs)
}

#[derive(Debug)]
pub enum BuildError {
    Spec(SpecErrors),
    Dims(DimsError),
    Plan(PlanError),
    Catalogue(CatalogueError),
    Model(String),
    Io(String),
    Env(String),
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BuildError::Spec(e) => write!(f, "invalid spec:\n{e}"),
            BuildError::Dims(e) => write!(f, "cannot resolve model dims: {e}"),
            BuildError::Plan(e) => write!(f, "cannot plan kernels:\n{e}"),
            BuildError::Catalogue(e) => write!(f, "invalid templates/README.md: {e}"),
            BuildError::Model(e) => write!(f, "{MODEL_ENV}: {e}"),
            BuildError::Io(e) => write!(f, "{e}"),
            BuildError::Env(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for BuildError {}

/// Everything one build generates, in memory.
#[derive(Clone, Debug)]
pub struct Generated {
    /// All variants: specialized first (request order), then generic.
    pub variants: Vec<KernelVariant>,
    /// (file name relative to `$OUT_DIR`, contents); `kernels.rs` last.
    pub files: Vec<(String, String)>,
    /// The dims each architecture was specialized for.
    pub specialized: Vec<ModelDims>,
    /// (architecture, GPU counts) whose per-rank shapes were planned too (`crate::shard`).
    pub sharded: Vec<(String, Vec<usize>)>,
    /// Pending kernel families (informational).
    pub notes: Vec<String>,
    /// Things worth a `cargo:warning` (families without a Cfg table yet, MEMRA_MODEL notes).
    pub warnings: Vec<String>,
}

/// Loads `specs/<arch>.toml`.
pub fn load_spec(specs_dir: &Path, arch: &str) -> Result<ArchSpec, BuildError> {
    let path = specs_dir.join(format!("{arch}.toml"));
    if !path.is_file() {
        let known = spec_archs(specs_dir).unwrap_or_default();
        return Err(BuildError::Io(format!(
            "{}: no such spec (specs: {})",
            path.display(),
            known.join(", ")
        )));
    }
    let spec = ArchSpec::load(&path).map_err(BuildError::Spec)?;
    if spec.arch != arch {
        return Err(BuildError::Io(format!(
            "{}: [arch] name is `{}`; the file must be named {}.toml",
            path.display(),
            spec.arch,
            spec.arch
        )));
    }
    Ok(spec)
}

/// Resolves dims for each requested arch and renders every file, without touching disk
/// beyond reading specs, templates and the model header.
pub fn generate(req: &BuildRequest) -> Result<Generated, BuildError> {
    let catalogue =
        Catalogue::load(&req.templates_dir.join("README.md")).map_err(BuildError::Catalogue)?;
    let model = match &req.model {
        Some(path) => {
            let file = GgufFile::open(path).map_err(|e| BuildError::Model(e.to_string()))?;
            let arch = file
                .architecture()
                .map_err(|e| BuildError::Model(e.to_string()))?
                .to_string();
            Some((arch, file))
        }
        None => None,
    };
    let mut archs = req.archs.clone();
    let mut notes = Vec::new();
    let mut warnings = Vec::new();
    if let Some((arch, _)) = &model
        && !archs.contains(arch)
    {
        warnings.push(format!("{MODEL_ENV} is a `{arch}` model: specializing for it although feature model-{arch} is off"));
        archs.push(arch.clone());
    }

    let mut specialized = Vec::new();
    let mut specialized_dims = Vec::new();
    let mut sharded = Vec::new();
    for arch in &archs {
        let spec = load_spec(&req.specs_dir, arch)?;
        let dims: ModelDims = match &model {
            Some((a, file)) if a == arch => {
                dims::from_gguf(&spec, file).map_err(BuildError::Dims)?
            }
            _ => dims::from_preset(&spec, None).map_err(BuildError::Dims)?,
        };
        let plan = plan::plan_arch(&spec, &dims, &catalogue).map_err(BuildError::Plan)?;
        notes.extend(plan.notes);
        warnings.extend(plan.warnings);
        for v in plan.variants {
            plan::push_unique(&mut specialized, v);
        }
        let counts = plan_shards(&spec, &dims, req.shards.as_deref(), &catalogue, &mut specialized, &mut warnings)?;
        if !counts.is_empty() {
            notes.push(format!("{arch}: per-rank shapes planned for {counts:?} GPUs"));
            sharded.push((arch.clone(), counts));
        }
        specialized_dims.push(dims);
    }
    let (generic, generic_warnings) = plan::plan_generic(&catalogue, &specialized);
    warnings.extend(generic_warnings);

    let mut variants = specialized;
    variants.extend(generic);
    let mut files = Vec::new();
    for v in &variants {
        let family = catalogue
            .family(&v.family)
            .ok_or_else(|| BuildError::Io(format!("internal: family `{}` vanished", v.family)))?;
        let text =
            render::render_cuda(v, family).map_err(|e| BuildError::Io(format!("internal: {e}")))?;
        files.push((format!("kernels/{}.cu", v.name()), text));
    }
    let headers = template_headers(&req.templates_dir)?;
    let header_refs: Vec<(String, &Path)> = headers
        .iter()
        .map(|(n, p)| (n.clone(), p.as_path()))
        .collect();
    let mut registry = render::render_registry(&variants, &header_refs, &specialized_dims);
    registry.push_str(&render::render_shards(&sharded));
    files.push(("kernels.rs".into(), registry));
    Ok(Generated {
        variants,
        files,
        specialized: specialized_dims,
        sharded,
        notes,
        warnings,
    })
}

/// Plans `spec` once more at each shard count's per-rank dims (`crate::shard::rank_dims`) into
/// `specialized` (names de-duplicate: only the shapes a rank changes add variants). `over`
/// replaces the spec's `[parallel] shards` (`MEMRA_SHARDS`) and applies only to specs that
/// have the table (architectures without a multi-GPU forward are not split). A count the
/// dims do not split into is a warning, not an error: `--gpus N` refuses it at run time.
/// Returns the counts planned.
pub fn plan_shards(
    spec: &ArchSpec,
    dims: &ModelDims,
    over: Option<&[usize]>,
    catalogue: &Catalogue,
    specialized: &mut Vec<KernelVariant>,
    warnings: &mut Vec<String>,
) -> Result<Vec<usize>, BuildError> {
    let Some(own) = spec.parallel.as_ref().map(|p| &p.shards) else {
        return Ok(Vec::new());
    };
    let counts = over.map_or_else(|| own.clone(), |o| crate::shard::normalize(o.to_vec()));
    let mut planned = Vec::new();
    for n in counts {
        let rank = match crate::shard::rank_dims(spec, dims, n) {
            Ok(d) => d,
            Err(e) => {
                warnings.push(format!("{}: no {n}-GPU shard variants ({}): {e}", spec.arch, dims.origin));
                continue;
            }
        };
        let plan = plan::plan_arch(spec, &rank, catalogue).map_err(BuildError::Plan)?;
        for v in plan.variants {
            plan::push_unique(specialized, v);
        }
        planned.push(n);
    }
    Ok(planned)
}

/// `templates/memra/*.cuh` as (include name, absolute path), sorted by name.
pub fn template_headers(templates_dir: &Path) -> Result<Vec<(String, PathBuf)>, BuildError> {
    let dir = templates_dir.join("memra");
    let entries =
        fs::read_dir(&dir).map_err(|e| BuildError::Io(format!("{}: {e}", dir.display())))?;
    let mut out = Vec::new();
    for e in entries.filter_map(|e| e.ok()) {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.ends_with(".cuh") {
            let abs = fs::canonicalize(e.path())
                .map_err(|err| BuildError::Io(format!("{}: {err}", e.path().display())))?;
            out.push((format!("memra/{name}"), abs));
        }
    }
    out.sort();
    Ok(out)
}

/// Writes `contents` unless the file already holds exactly that. Returns whether it wrote.
pub fn write_if_different(path: &Path, contents: &str) -> io::Result<bool> {
    if fs::read(path)
        .map(|old| old == contents.as_bytes())
        .unwrap_or(false)
    {
        return Ok(false);
    }
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    fs::write(path, contents)?;
    Ok(true)
}

/// What `emit` did.
#[derive(Clone, Debug)]
pub struct EmitReport {
    pub variants: usize,
    pub written: usize,
    pub removed: usize,
    pub notes: Vec<String>,
    pub warnings: Vec<String>,
}

/// The build-script entry point: prints the `cargo:rerun-if-*` lines, generates, writes
/// changed files, removes `.cu` files of variants no longer planned, and prints warnings as
/// `cargo:warning`s (notes go to the build log).
pub fn emit(req: &BuildRequest) -> Result<EmitReport, BuildError> {
    println!("cargo:rerun-if-changed={}", req.specs_dir.display());
    println!("cargo:rerun-if-changed={}", req.templates_dir.display());
    println!("cargo:rerun-if-env-changed={MODEL_ENV}");
    println!("cargo:rerun-if-env-changed={}", crate::shard::SHARDS_ENV);
    if let Some(model) = &req.model {
        println!("cargo:rerun-if-changed={}", model.display());
    }
    let generated = generate(req)?;
    let report = write_generated(&req.out_dir, &generated)?;
    for n in &report.notes {
        println!("memra-codegen: {n}");
    }
    for w in &report.warnings {
        println!("cargo:warning={w}");
    }
    Ok(report)
}

/// Writes `generated` under `out_dir`; separate from `emit` so tests can run it.
pub fn write_generated(out_dir: &Path, generated: &Generated) -> Result<EmitReport, BuildError> {
    let io_err = |p: &Path, e: io::Error| BuildError::Io(format!("{}: {e}", p.display()));
    let mut written = 0;
    for (rel, text) in &generated.files {
        let path = out_dir.join(rel);
        if write_if_different(&path, text).map_err(|e| io_err(&path, e))? {
            written += 1;
        }
    }
    let kernels_dir = out_dir.join("kernels");
    let mut removed = 0;
    if let Ok(entries) = fs::read_dir(&kernels_dir) {
        for e in entries.filter_map(|e| e.ok()) {
            let rel = format!("kernels/{}", e.file_name().to_string_lossy());
            if rel.ends_with(".cu") && !generated.files.iter().any(|(r, _)| r == &rel) {
                fs::remove_file(e.path()).map_err(|err| io_err(&e.path(), err))?;
                removed += 1;
            }
        }
    }
    Ok(EmitReport {
        variants: generated.variants.len(),
        written,
        removed,
        notes: generated.notes.clone(),
        warnings: generated.warnings.clone(),
    })
}
