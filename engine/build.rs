//! Runs memra-codegen: `specs/<arch>.toml` for every enabled `model-<arch>` feature (and the
//! architecture of the GGUF named by `MEMRA_MODEL`, specialized to that file's dims) ->
//! `$OUT_DIR/kernels/*.cu` + `$OUT_DIR/kernels.rs`, which `src/kernels/registry.rs` includes.
//! Generic variants of every family are always generated.

use std::path::Path;
use std::process::ExitCode;

use memra_codegen::build::{BuildRequest, emit};

fn main() -> ExitCode {
    println!("cargo:rerun-if-changed=build.rs");
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .expect("cargo sets CARGO_MANIFEST_DIR for build scripts");
    let Some(workspace_root) = Path::new(&manifest_dir).parent() else {
        eprintln!("memra build: engine/ has no parent directory; specs/ and templates/ live there");
        return ExitCode::FAILURE;
    };
    let result = BuildRequest::from_cargo_env(workspace_root).and_then(|req| emit(&req));
    match result {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("memra build: {e}");
            ExitCode::FAILURE
        }
    }
}
