//! The CUDA side of the runtime: find the libraries, compile generated CUDA with NVRTC into a
//! disk cache, load CUBINs into a context. Stage order: `library` → `nvrtc` → `cache` → `module`
//! (compile many, load) → `device` (`Gpu`: context + stream + loaded kernels).
//!
//! Everything up to `module::compile_variants` works without a GPU (NVRTC only).

pub mod cache;
pub mod device;
pub mod graph;
pub mod library;
pub mod module;
pub mod nvrtc;
pub mod workers;

use std::fmt;
use std::path::PathBuf;

/// The cudarc this crate links (device buffers: `cudarc::driver::CudaSlice`).
pub use cudarc;

pub use cache::{CacheConfig, CacheOutcome, KernelCache};
pub use device::Gpu;
pub use module::{CompiledVariant, Kernel, Kernels, compile_variants};
pub use nvrtc::{Cubin, HeaderSet, PtxasReport, compile_cubin};

/// A GPU architecture as NVRTC names it: `SmArch(90)` = `sm_90`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SmArch(pub u32);

impl SmArch {
    /// Accepts `90`, `sm_90` and `9.0`.
    pub fn parse(text: &str) -> Option<SmArch> {
        let t = text.trim();
        let t = t.strip_prefix("sm_").unwrap_or(t);
        if let Some((major, minor)) = t.split_once('.') {
            let (major, minor): (u32, u32) = (major.parse().ok()?, minor.parse().ok()?);
            return (minor < 10).then_some(SmArch(major * 10 + minor));
        }
        t.parse().ok().filter(|v| *v >= 10).map(SmArch)
    }
}

impl fmt::Display for SmArch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sm_{}", self.0)
    }
}

/// Everything the CUDA runtime can fail with. `Clone` so a failed library search can be cached
/// and returned to every caller.
#[derive(Clone, Debug)]
pub enum Error {
    /// A CUDA library was not found; `tried` lists each path and why it was rejected.
    LibraryNotFound { what: String, tried: Vec<String>, hint: String },
    /// An NVRTC call other than compilation failed.
    Nvrtc { call: &'static str, detail: String },
    /// NVRTC rejected a kernel: its log plus the numbered source.
    Compile { name: String, arch: SmArch, log: String, listing: String },
    /// The cache misses and `MEMRA_NO_NVRTC=1` forbids compiling.
    CompileForbidden { name: String, arch: SmArch, path: Option<PathBuf> },
    /// A CUDA driver call failed.
    Driver { call: String, detail: String },
    /// A kernel asked for by name is not among the loaded ones.
    NoSuchKernel { name: String, loaded: Vec<String> },
    /// Launching a kernel with an argument struct of another family.
    WrongArgs { kernel: String, kernel_family: String, args_family: String },
    /// A kernel's parameter list differs from its Rust argument struct.
    ParamMismatch { variant: String, detail: String },
    /// No variant fits a request (or the only fit is generic and a specialized one was required).
    Selection { detail: String },
    /// A family wrapper refused its arguments (buffer too small, dim differs from the baked one, …).
    InvalidArgs { kernel: String, detail: String },
    /// A file-system error with the path it concerns.
    Io { path: PathBuf, detail: String },
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, err: impl fmt::Display) -> Error {
        Error::Io { path: path.into(), detail: err.to_string() }
    }

    pub(crate) fn driver(call: impl Into<String>, err: impl fmt::Debug) -> Error {
        Error::Driver { call: call.into(), detail: format!("{err:?}") }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::LibraryNotFound { what, tried, hint } => {
                writeln!(f, "could not load {what}; tried:")?;
                for t in tried {
                    writeln!(f, "  {t}")?;
                }
                write!(f, "{hint}")
            }
            Error::Nvrtc { call, detail } => write!(f, "NVRTC {call} failed: {detail}"),
            Error::Compile { name, arch, log, listing } => {
                write!(f, "NVRTC failed to compile {name} for {arch}:\n{}\n{listing}", log.trim_end())
            }
            Error::CompileForbidden { name, arch, path } => {
                let at = path.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "memory only".into());
                write!(f, "kernel {name} for {arch} is not in the cache ({at}) and MEMRA_NO_NVRTC=1 forbids compiling it")
            }
            Error::Driver { call, detail } => write!(f, "CUDA driver call {call} failed: {detail}"),
            Error::NoSuchKernel { name, loaded } => {
                write!(f, "kernel {name} is not loaded ({} loaded", loaded.len())?;
                if !loaded.is_empty() {
                    write!(f, ": {}", loaded.join(", "))?;
                }
                write!(f, ")")
            }
            Error::WrongArgs { kernel, kernel_family, args_family } => write!(
                f,
                "kernel {kernel} belongs to family {kernel_family} but was launched with {args_family} arguments"
            ),
            Error::ParamMismatch { variant, detail } => {
                write!(f, "kernel {variant}: parameter list differs from its Rust argument struct: {detail}")
            }
            Error::Selection { detail } => write!(f, "{detail}"),
            Error::InvalidArgs { kernel, detail } => write!(f, "kernel {kernel}: {detail}"),
            Error::Io { path, detail } => write!(f, "{}: {detail}", path.display()),
        }
    }
}

impl std::error::Error for Error {}
