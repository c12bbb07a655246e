//! Runs memra-codegen: `specs/<arch>.toml` for every enabled `model-<arch>` feature (and the
//! architecture of the GGUF named by `MEMRA_MODEL`, specialized to that file's dims) ->
//! `$OUT_DIR/kernels/*.cu` + `$OUT_DIR/kernels.rs`, which `src/kernels/registry.rs` includes.
//! Generic variants of every family are always generated.
//!
//! Also writes the embedded default models `memra run` uses when given no file: the micro model
//! (`memra_codegen::fixture::micro_model`, random weights, small vocabulary) of every enabled
//! architecture, gemma3 when none is, as `$OUT_DIR/micro/<arch>.gguf` + `$OUT_DIR/micro_models.rs`.

use std::path::Path;
use std::process::ExitCode;

use memra_codegen::build::{BuildRequest, emit};
use memra_codegen::fixture;
use memra_codegen::spec::ArchSpec;

fn main() -> ExitCode {
    println!("cargo:rerun-if-changed=build.rs");
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .expect("cargo sets CARGO_MANIFEST_DIR for build scripts");
    let Some(workspace_root) = Path::new(&manifest_dir).parent() else {
        eprintln!("memra build: engine/ has no parent directory; specs/ and templates/ live there");
        return ExitCode::FAILURE;
    };
    let req = match BuildRequest::from_cargo_env(workspace_root) {
        Ok(req) => req,
        Err(e) => {
            eprintln!("memra build: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = emit(&req) {
        eprintln!("memra build: {e}");
        return ExitCode::FAILURE;
    }
    if let Err(e) = embed_micro_models(&req) {
        eprintln!("memra build: embedded micro models: {e}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// Seed of the embedded models' random weights (fixed: the default run is reproducible).
const MICRO_SEED: u64 = 0x6d656d7261;

fn embed_micro_models(req: &BuildRequest) -> Result<(), String> {
    let mut archs = req.archs.clone();
    if archs.is_empty() {
        archs.push("gemma3".to_string());
    }
    let dir = req.out_dir.join("micro");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut table = String::from("/// (architecture, GGUF bytes) of the embedded micro models (build.rs).\npub static MICRO_MODELS: &[(&str, &[u8])] = &[\n");
    for arch in &archs {
        let spec_path = req.specs_dir.join(format!("{arch}.toml"));
        let spec = ArchSpec::load(&spec_path).map_err(|e| e.to_string())?;
        let bytes = fixture::micro_model(&spec, MICRO_SEED)?;
        let path = dir.join(format!("{arch}.gguf"));
        std::fs::write(&path, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        table.push_str(&format!("    ({arch:?}, include_bytes!({:?})),\n", path.display().to_string()));
    }
    table.push_str("];\n");
    let out = req.out_dir.join("micro_models.rs");
    std::fs::write(&out, table).map_err(|e| format!("{}: {e}", out.display()))
}
