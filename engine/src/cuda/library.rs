//! Finding libcuda and NVRTC before cudarc looks for them.
//!
//! cudarc (feature `dynamic-loading`) dlopens bare names — `libnvrtc.so`, `libnvrtc64_130.so`, …,
//! `libnvrtc.so.13` — and panics when none loads. We search the usual places ourselves, dlopen the
//! file we found by its full path with `RTLD_GLOBAL`, and keep it loaded for the whole process.
//! glibc answers a later `dlopen("libnvrtc.so.13")` with an already-resident object whose
//! DT_SONAME matches, so cudarc ends up with our library. Afterwards we ask `dladdr` which file
//! cudarc's symbols really come from and report it, so a stray copy on the loader path is visible.
//!
//! NVRTC itself dlopens `libnvrtc-builtins.so.<major>.<minor>` by soname when it compiles; the pip
//! wheel ships it beside libnvrtc but nothing puts that directory on the loader path, so we load
//! it first from the same directory.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};

use super::Error;

/// The CUDA libraries the engine loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CudaLib {
    /// libcuda: the driver API (needs a GPU and its driver).
    Driver,
    /// libnvrtc: the runtime compiler (works without a GPU).
    Nvrtc,
    /// libnccl: collectives between GPUs (multi-GPU runs only; `crate::parallel`). cudarc's own
    /// loader never tries the soname `libnccl.so.2`, so its symbols are resolved from our handle.
    Nccl,
}

impl CudaLib {
    fn file_names(self) -> &'static [&'static str] {
        match self {
            CudaLib::Driver => &["libcuda.so.1", "libcuda.so"],
            // The soname first: the unversioned name is a development symlink that may be absent.
            CudaLib::Nvrtc => &["libnvrtc.so.13", "libnvrtc.so"],
            CudaLib::Nccl => &["libnccl.so.2", "libnccl.so"],
        }
    }

    fn describe(self) -> &'static str {
        match self {
            CudaLib::Driver => "the CUDA driver library (libcuda)",
            CudaLib::Nvrtc => "NVRTC (libnvrtc)",
            CudaLib::Nccl => "NCCL (libnccl)",
        }
    }

    fn env_override(self) -> &'static str {
        match self {
            CudaLib::Driver => "MEMRA_LIBCUDA_PATH",
            CudaLib::Nvrtc => "MEMRA_NVRTC_PATH",
            CudaLib::Nccl => "MEMRA_NCCL_PATH",
        }
    }

    fn hint(self) -> &'static str {
        match self {
            CudaLib::Driver => {
                "This machine has no usable CUDA driver; CPU paths and `memra kernels --sm 90` work without one. \
                 Set MEMRA_LIBCUDA_PATH to libcuda.so.1 (or its directory) if it lives elsewhere."
            }
            CudaLib::Nvrtc => {
                "Set MEMRA_NVRTC_PATH to the directory holding libnvrtc.so.13 (or the file), or run \
                 `bash scripts/setup-python`, which installs the pip wheel nvidia-cuda-nvrtc into the memra venv."
            }
            CudaLib::Nccl => {
                "Multi-GPU runs need NCCL 2.x: set MEMRA_NCCL_PATH to the directory holding libnccl.so.2 (or the file), \
                 or install it (`pip install nvidia-nccl-cu12`, which torch also brings, or the libnccl2 package)."
            }
        }
    }
}

/// Where to look for one library, in order. Built from the environment by [`SearchPaths::from_env`];
/// tests build their own.
#[derive(Clone, Debug, Default)]
pub struct SearchPaths {
    /// Candidate files or directories; a directory is searched for the library's file names.
    /// Each entry carries a short note on where it came from (shown when nothing is found).
    pub candidates: Vec<(PathBuf, String)>,
    /// Patterns that matched nothing (e.g. a venv without python3.* inside); listed as tried.
    pub unmatched_patterns: Vec<String>,
    /// Finally let the system loader search its own path (ld.so.cache, default dirs) by soname.
    pub system_fallback: bool,
}

impl SearchPaths {
    /// The usual places, most specific first.
    pub fn from_env(lib: CudaLib) -> SearchPaths {
        let mut s = SearchPaths { system_fallback: true, ..SearchPaths::default() };
        if let Some(p) = std::env::var_os(lib.env_override()).filter(|p| !p.is_empty()) {
            s.push(PathBuf::from(p), lib.env_override());
        }
        match lib {
            CudaLib::Driver => {
                s.push("/usr/local/nvidia/lib64".into(), "container driver mount");
                s.push("/usr/local/nvidia/lib".into(), "container driver mount");
                s.push_ld_library_path();
                s.push("/usr/lib/x86_64-linux-gnu".into(), "system");
                s.push("/usr/lib64".into(), "system");
                s.push("/usr/lib/wsl/lib".into(), "WSL");
                // Never CUDA_HOME/lib64/stubs: the stub libcuda loads but every call fails.
            }
            CudaLib::Nvrtc => {
                for var in ["CUDA_HOME", "CUDA_PATH"] {
                    if let Some(home) = std::env::var_os(var).filter(|p| !p.is_empty()) {
                        let home = PathBuf::from(home);
                        s.push(home.join("targets/x86_64-linux/lib"), var);
                        s.push(home.join("lib64"), var);
                    }
                }
                s.push("/usr/local/cuda/targets/x86_64-linux/lib".into(), "CUDA toolkit");
                s.push("/usr/local/cuda/lib64".into(), "CUDA toolkit");
                // pip wheels (nvidia-cuda-nvrtc).
                s.push_pip_wheels(&["nvidia/cu13/lib"]);
                s.push_ld_library_path();
                s.push("/usr/lib/x86_64-linux-gnu".into(), "system");
                s.push("/usr/lib64".into(), "system");
            }
            CudaLib::Nccl => {
                // The NVRTC places, plus the wheel nvidia-nccl-cu12/-cu13 (torch's NCCL) and conda.
                for var in ["CUDA_HOME", "CUDA_PATH"] {
                    if let Some(home) = std::env::var_os(var).filter(|p| !p.is_empty()) {
                        s.push(PathBuf::from(home).join("lib64"), var);
                    }
                }
                s.push("/usr/local/cuda/lib64".into(), "CUDA toolkit");
                s.push_pip_wheels(&["nvidia/nccl/lib", "nvidia/cu13/lib"]);
                if let Some(conda) = std::env::var_os("CONDA_PREFIX").filter(|p| !p.is_empty()) {
                    s.push(PathBuf::from(conda).join("lib"), "CONDA_PREFIX");
                }
                s.push_ld_library_path();
                s.push("/usr/lib/x86_64-linux-gnu".into(), "system (libnccl2 package)");
                s.push("/usr/lib64".into(), "system");
            }
        }
        s
    }

    /// Only these directories, no system search (tests; also a strict override).
    pub fn only(dirs: impl IntoIterator<Item = PathBuf>) -> SearchPaths {
        let mut s = SearchPaths::default();
        for d in dirs {
            s.push(d, "given");
        }
        s
    }

    fn push(&mut self, path: PathBuf, note: &str) {
        if !self.candidates.iter().any(|(p, _)| *p == path) {
            self.candidates.push((path, note.to_string()));
        }
    }

    fn push_ld_library_path(&mut self) {
        if let Some(v) = std::env::var_os("LD_LIBRARY_PATH") {
            for dir in std::env::split_paths(&v).filter(|d| !d.as_os_str().is_empty()) {
                self.push(dir, "LD_LIBRARY_PATH");
            }
        }
    }

    /// `subdirs` of the pip site-packages: the memra venv, an active venv, user and system ones.
    /// Globbing python3.* is cheap; starting Python is not.
    fn push_pip_wheels(&mut self, subdirs: &[&str]) {
        let memra_venv = memra_cache_root().join("venv");
        self.push_site_packages(&memra_venv, "memra venv (scripts/setup-python)", subdirs);
        if let Some(venv) = std::env::var_os("VIRTUAL_ENV").filter(|p| !p.is_empty()) {
            self.push_site_packages(Path::new(&venv), "VIRTUAL_ENV", subdirs);
        }
        if let Some(home) = std::env::var_os("HOME").filter(|p| !p.is_empty()) {
            self.push_site_packages(&Path::new(&home).join(".local"), "user site-packages", subdirs);
        }
        self.push_site_packages(Path::new("/usr/local"), "system site-packages", subdirs);
        self.push_site_packages(Path::new("/usr"), "system site-packages", subdirs);
    }

    /// `<prefix>/lib/python3.*/{site,dist}-packages/<subdir>` for each of `subdirs`.
    fn push_site_packages(&mut self, prefix: &Path, note: &str, subdirs: &[&str]) {
        let lib = prefix.join("lib");
        let mut found = false;
        if let Ok(entries) = std::fs::read_dir(&lib) {
            let mut pythons: Vec<PathBuf> = entries
                .filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
                .map(|e| e.path())
                .collect();
            pythons.sort();
            for py in pythons.iter().rev() {
                for pkgs in ["site-packages", "dist-packages"] {
                    for sub in subdirs {
                        let dir = py.join(pkgs).join(sub);
                        if dir.is_dir() {
                            self.push(dir, note);
                            found = true;
                        }
                    }
                }
            }
        }
        if !found {
            self.unmatched_patterns
                .push(format!("{}/python3.*/{{site,dist}}-packages/{{{}}} ({note})", lib.display(), subdirs.join(",")));
        }
    }
}

/// A library we loaded and keep loaded for the life of the process.
#[derive(Debug)]
pub struct LoadedLib {
    /// The file we dlopened (or the bare soname when the system loader found it).
    pub path: PathBuf,
    /// The file cudarc's symbols actually resolve to (from `dladdr`); differs from `path` only
    /// when another copy on the loader path won.
    pub resolved: Option<PathBuf>,
    /// Other files preloaded for it (libnvrtc-builtins).
    pub preloaded: Vec<PathBuf>,
    _handles: Vec<Library>,
}

/// NVRTC, loaded, with its version.
#[derive(Debug)]
pub struct NvrtcLib {
    pub lib: LoadedLib,
    pub version: (i32, i32),
}

/// Loads NVRTC once per process (search from the environment). Never panics: absence is an
/// [`Error::LibraryNotFound`] listing every path tried.
pub fn nvrtc() -> Result<&'static NvrtcLib, Error> {
    static NVRTC: OnceLock<Result<NvrtcLib, Error>> = OnceLock::new();
    NVRTC
        .get_or_init(|| {
            let lib = load(CudaLib::Nvrtc, &SearchPaths::from_env(CudaLib::Nvrtc))?;
            let version = nvrtc_version()?;
            Ok(NvrtcLib { lib, version })
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Loads libcuda once per process (search from the environment).
pub fn driver() -> Result<&'static LoadedLib, Error> {
    static DRIVER: OnceLock<Result<LoadedLib, Error>> = OnceLock::new();
    DRIVER
        .get_or_init(|| load(CudaLib::Driver, &SearchPaths::from_env(CudaLib::Driver)))
        .as_ref()
        .map_err(Clone::clone)
}

/// For CPU-only tests: NVRTC, or `None` after printing one `SKIP:` line saying why.
pub fn nvrtc_or_skip(test: &str) -> Option<&'static NvrtcLib> {
    match nvrtc() {
        Ok(lib) => Some(lib),
        Err(Error::LibraryNotFound { tried, .. }) => {
            eprintln!(
                "SKIP: {test}: NVRTC not found ({} paths tried; set MEMRA_NVRTC_PATH or run scripts/setup-python; `memra kernels --compile --sm 90` lists them)",
                tried.len()
            );
            None
        }
        Err(e) => {
            eprintln!("SKIP: {test}: NVRTC not usable: {e}");
            None
        }
    }
}

/// `${MEMRA_CACHE:-$HOME/.cache/memra}`.
pub fn memra_cache_root() -> PathBuf {
    if let Some(p) = std::env::var_os("MEMRA_CACHE").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let home = std::env::var_os("HOME").filter(|p| !p.is_empty()).map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    home.join(".cache/memra")
}

/// Searches `search` for `lib`, loads the first file that dlopens, and checks that cudarc can
/// now load it too. On failure nothing useful stays loaded and the error lists every path tried.
pub fn load(lib: CudaLib, search: &SearchPaths) -> Result<LoadedLib, Error> {
    let mut tried: Vec<String> = Vec::new();
    for (candidate, note) in &search.candidates {
        let files: Vec<PathBuf> = if candidate.is_dir() {
            lib.file_names().iter().map(|n| candidate.join(n)).collect()
        } else {
            vec![candidate.clone()]
        };
        for file in files {
            if !file.exists() {
                tried.push(format!("{} ({note}): not found", file.display()));
                continue;
            }
            let preloaded = match preload_companions(lib, &file) {
                Ok(p) => p,
                Err(e) => {
                    tried.push(format!("{} ({note}): {e}", file.display()));
                    continue;
                }
            };
            match open_global(file.as_os_str()) {
                Ok(handle) => {
                    let (preloaded_paths, mut handles): (Vec<PathBuf>, Vec<Library>) = preloaded.into_iter().unzip();
                    handles.push(handle);
                    return finish(lib, file, preloaded_paths, handles, &tried);
                }
                Err(e) => tried.push(format!("{} ({note}): dlopen failed: {e}", file.display())),
            }
        }
    }
    for pattern in &search.unmatched_patterns {
        tried.push(format!("{pattern}: no such directory"));
    }
    if search.system_fallback {
        for name in lib.file_names() {
            match open_global(std::ffi::OsStr::new(name)) {
                Ok(handle) => return finish(lib, PathBuf::from(name), Vec::new(), vec![handle], &tried),
                Err(_) => tried.push(format!("{name} (system loader search): not found")),
            }
        }
    }
    Err(Error::LibraryNotFound { what: lib.describe().to_string(), tried, hint: lib.hint().to_string() })
}

fn finish(
    lib: CudaLib,
    path: PathBuf,
    preloaded: Vec<PathBuf>,
    handles: Vec<Library>,
    tried: &[String],
) -> Result<LoadedLib, Error> {
    // SAFETY: is_culib_present only dlopens candidate names and drops the handles.
    let present = unsafe {
        match lib {
            CudaLib::Driver => cudarc::driver::sys::is_culib_present(),
            CudaLib::Nvrtc => cudarc::nvrtc::sys::is_culib_present(),
            // Not through cudarc's loader (see `CudaLib::Nccl`): our handle is the one used.
            CudaLib::Nccl => true,
        }
    };
    if !present {
        let mut tried = tried.to_vec();
        tried.push(format!("{}: loaded, but cudarc's loader still finds no library by soname", path.display()));
        return Err(Error::LibraryNotFound { what: lib.describe().to_string(), tried, hint: lib.hint().to_string() });
    }
    let resolved = resolved_path(lib);
    Ok(LoadedLib { path, resolved, preloaded, _handles: handles })
}

/// libnvrtc-builtins beside a pip/toolkit libnvrtc (not the `.alt.` build).
fn companion_paths(lib: CudaLib, file: &Path) -> Vec<PathBuf> {
    if lib != CudaLib::Nvrtc {
        return Vec::new();
    }
    let Some(dir) = file.parent() else { return Vec::new() };
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            name.starts_with("libnvrtc-builtins.so.") && !name.contains(".alt.")
        })
        .collect();
    // The most specific name (libnvrtc-builtins.so.13.0) is the soname NVRTC asks for.
    found.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    found.truncate(1);
    found
}

fn preload_companions(lib: CudaLib, file: &Path) -> Result<Vec<(PathBuf, Library)>, String> {
    companion_paths(lib, file)
        .into_iter()
        .map(|p| match open_global(p.as_os_str()) {
            Ok(h) => Ok((p, h)),
            Err(e) => Err(format!("preloading {} failed: {e}", p.display())),
        })
        .collect()
}

fn open_global(name: &std::ffi::OsStr) -> Result<Library, libloading::Error> {
    // SAFETY: loading a CUDA library runs its initialisers, which have no preconditions on us.
    unsafe { Library::open(Some(name), RTLD_NOW | RTLD_GLOBAL) }
}

fn nvrtc_version() -> Result<(i32, i32), Error> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: cudarc's loader was just checked (is_culib_present); both pointers are valid.
    let rc = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if rc != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(Error::Nvrtc { call: "nvrtcVersion", detail: format!("{rc:?}") });
    }
    Ok((major, minor))
}

#[repr(C)]
struct DlInfo {
    dli_fname: *const c_char,
    dli_fbase: *mut c_void,
    dli_sname: *const c_char,
    dli_saddr: *mut c_void,
}

unsafe extern "C" {
    fn dladdr(addr: *const c_void, info: *mut DlInfo) -> c_int;
}

/// The file that cudarc's copy of a well-known symbol lives in.
fn resolved_path(lib: CudaLib) -> Option<PathBuf> {
    let symbol: &[u8] = match lib {
        CudaLib::Driver => b"cuInit\0",
        CudaLib::Nvrtc => b"nvrtcVersion\0",
        CudaLib::Nccl => return None,
    };
    // SAFETY: is_culib_present() returned true, so culib() finds a library and does not panic;
    // the symbol is only used as an address for dladdr, never called.
    unsafe {
        let culib = match lib {
            CudaLib::Driver => cudarc::driver::sys::culib(),
            CudaLib::Nvrtc => cudarc::nvrtc::sys::culib(),
            CudaLib::Nccl => return None,
        };
        let sym = culib.get::<*const c_void>(symbol).ok()?;
        let addr: *const c_void = *sym;
        let mut info = DlInfo {
            dli_fname: std::ptr::null(),
            dli_fbase: std::ptr::null_mut(),
            dli_sname: std::ptr::null(),
            dli_saddr: std::ptr::null_mut(),
        };
        if dladdr(addr, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        let name = CStr::from_ptr(info.dli_fname).to_string_lossy().into_owned();
        Some(PathBuf::from(name))
    }
}

impl LoadedLib {
    /// One line for logs: where it came from, and a warning if cudarc resolved another copy.
    pub fn describe(&self) -> String {
        let mut s = self.path.display().to_string();
        if let Some(resolved) = &self.resolved {
            let same = std::fs::canonicalize(resolved).ok() == std::fs::canonicalize(&self.path).ok()
                || resolved == &self.path;
            if !same {
                let _ = write!(s, " (warning: cudarc resolved {})", resolved.display());
            }
        }
        s
    }
}
