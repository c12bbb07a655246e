//! Shared by the tests of the CUDA library search (`nvrtc_compile.rs`: NVRTC, the driver;
//! `gpu_parallel.rs`: NCCL): scratch folders and the errors a missing or broken library gives.
#![allow(dead_code)]

use std::path::PathBuf;

use memra_engine::cuda::library::{self, CudaLib, SearchPaths};

/// A fresh empty folder under the temp dir, named after `tag` and this process.
pub fn empty_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memra-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `lib` searched for only in an empty folder: the error names `file` there as not found and
/// `env_var` (how to fix it); then, with a file of that name that is not a library, the error
/// names it as one that failed to dlopen.
pub fn assert_missing_then_unloadable(lib: CudaLib, tag: &str, file: &str, env_var: &str) {
    let dir = empty_dir(tag);
    let error = || {
        library::load(lib, &SearchPaths::only([dir.clone()]))
            .unwrap_err()
            .to_string()
    };
    let err = error();
    let not_found = format!("{} (given): not found", dir.join(file).display());
    assert!(err.contains(&not_found), "{err}");
    assert!(err.contains(env_var), "the error says how to fix it: {err}");
    std::fs::write(dir.join(file), b"not an ELF file").unwrap();
    let err = error();
    let bad = format!("{} (given): dlopen failed", dir.join(file).display());
    assert!(err.contains(&bad), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
