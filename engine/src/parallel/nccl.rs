//! libnccl, loaded once per process from the places `cuda::library` searches (`CudaLib::Nccl`),
//! and the few entry points the engine calls, resolved from our own handle.
//!
//! cudarc's `nccl` feature supplies the C types (`ncclComm_t`, `ncclResult_t`, ...), but its
//! loader only tries names like `libnccl.so` and `libnccl.so.13`, never the soname
//! `libnccl.so.2` that the pip wheel and the libnccl2 package install, and it panics when none
//! loads. So every call here goes through a function table filled from the file we found.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::OnceLock;

use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t};
use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};

use super::Error;
use crate::cuda::library::{self, CudaLib, LoadedLib, SearchPaths};

/// NVLink SHARP (multicast) buffers cost GPU memory per communicator and have hung collectives
/// on the lent H200 hosts; the engine keeps them off unless the user chose otherwise.
pub const NVLS_VAR: &str = "NCCL_NVLS_ENABLE";

type GetVersion = unsafe extern "C" fn(*mut c_int) -> ncclResult_t;
type GetErrorString = unsafe extern "C" fn(ncclResult_t) -> *const c_char;
type GetLastError = unsafe extern "C" fn(ncclComm_t) -> *const c_char;
type CommInitAll = unsafe extern "C" fn(*mut ncclComm_t, c_int, *const c_int) -> ncclResult_t;
type CommDestroy = unsafe extern "C" fn(ncclComm_t) -> ncclResult_t;
type CommCount = unsafe extern "C" fn(ncclComm_t, *mut c_int) -> ncclResult_t;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclRedOp_t,
    ncclComm_t,
    cudarc::driver::sys::CUstream,
) -> ncclResult_t;
type AllGather = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclComm_t,
    cudarc::driver::sys::CUstream,
) -> ncclResult_t;
type Group = unsafe extern "C" fn() -> ncclResult_t;

/// The entry points, valid while `Nccl::_handle` keeps the library loaded (forever: a static).
pub(crate) struct Api {
    pub get_error_string: GetErrorString,
    pub get_last_error: Option<GetLastError>,
    pub comm_init_all: CommInitAll,
    pub comm_destroy: CommDestroy,
    pub comm_count: CommCount,
    pub all_reduce: AllReduce,
    pub all_gather: AllGather,
    pub group_start: Group,
    pub group_end: Group,
}

/// NCCL, loaded, with its version.
pub struct Nccl {
    pub lib: LoadedLib,
    /// `(major, minor, patch)` from `ncclGetVersion`.
    pub version: (u32, u32, u32),
    /// `NCCL_NVLS_ENABLE` as NCCL will read it.
    pub nvls: String,
    pub(crate) api: Api,
    _handle: Library,
}

impl Nccl {
    /// One line for logs: version, file, the NVLS setting.
    pub fn describe(&self) -> String {
        let (a, b, c) = self.version;
        format!(
            "NCCL {a}.{b}.{c} from {}, {NVLS_VAR}={}",
            self.lib.describe(),
            self.nvls
        )
    }

    /// A result code as NCCL words it (plus the communicator's last error when given and known).
    pub(crate) fn error_text(&self, rc: ncclResult_t, comm: Option<ncclComm_t>) -> String {
        // SAFETY: both return static NUL-terminated strings (or null, checked).
        unsafe {
            let mut s = cstr((self.api.get_error_string)(rc)).unwrap_or_else(|| format!("{rc:?}"));
            if let (Some(last), Some(comm)) = (self.api.get_last_error, comm)
                && let Some(detail) = cstr(last(comm)).filter(|d| !d.is_empty())
            {
                s.push_str(": ");
                s.push_str(&detail);
            }
            s
        }
    }

    /// `Ok` on ncclSuccess, else an error naming the call.
    pub(crate) fn check(
        &self,
        call: &'static str,
        rc: ncclResult_t,
        comm: Option<ncclComm_t>,
    ) -> Result<(), Error> {
        if rc == ncclResult_t::ncclSuccess {
            return Ok(());
        }
        Err(Error::Call {
            call,
            detail: self.error_text(rc, comm),
        })
    }
}

unsafe fn cstr(p: *const c_char) -> Option<String> {
    // SAFETY: the caller passes NCCL's static strings or null.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// Sets `NCCL_NVLS_ENABLE=0` unless the user set it, returning the value NCCL will see. The
/// process environment is inherited by child processes, so they keep it too.
pub fn keep_nvls_off() -> String {
    match std::env::var(NVLS_VAR) {
        Ok(v) if !v.is_empty() => {
            if v != "0" {
                eprintln!(
                    "warning: {NVLS_VAR}={v} set by the user; memra runs with NVLink multicast off by default ({NVLS_VAR}=0)"
                );
            }
            v
        }
        _ => {
            // SAFETY: called once, from the OnceLock initialiser below, before NCCL (the only
            // reader besides child processes) is loaded; the engine's own threads do not touch
            // the environment.
            unsafe { std::env::set_var(NVLS_VAR, "0") };
            "0".to_string()
        }
    }
}

/// Sets `NCCL_RUNTIME_CONNECT=0` unless the user set it: NCCL then connects its channels in
/// `ncclCommInitAll` instead of inside the first collective, which for a decode step may be
/// inside a CUDA graph capture.
pub fn connect_at_init() {
    if std::env::var_os("NCCL_RUNTIME_CONNECT").is_none() {
        // SAFETY: as in `keep_nvls_off` (same call site, before NCCL is loaded).
        unsafe { std::env::set_var("NCCL_RUNTIME_CONNECT", "0") };
    }
}

/// Loads NCCL once per process (search from the environment, `MEMRA_NCCL_PATH` first) after
/// setting `NCCL_NVLS_ENABLE`. Never panics: absence is a `LibraryNotFound` listing every path
/// tried; a library without one of the entry points is refused by name.
pub fn nccl() -> Result<&'static Nccl, Error> {
    static NCCL: OnceLock<Result<Nccl, Error>> = OnceLock::new();
    NCCL.get_or_init(|| {
        let nvls = keep_nvls_off();
        connect_at_init();
        let lib = library::load(CudaLib::Nccl, &SearchPaths::from_env(CudaLib::Nccl))
            .map_err(Error::Cuda)?;
        // SAFETY: the same object is already resident (RTLD_GLOBAL); this only takes a reference.
        let handle = unsafe { Library::open(Some(lib.path.as_os_str()), RTLD_NOW | RTLD_GLOBAL) }
            .map_err(|e| Error::Call {
            call: "dlopen",
            detail: format!("{}: {e}", lib.path.display()),
        })?;
        let api = resolve(&handle, &lib)?;
        let get_version: GetVersion = symbol(&handle, &lib, "ncclGetVersion")?;
        let mut code: c_int = 0;
        // SAFETY: a valid out pointer.
        let rc = unsafe { get_version(&mut code) };
        if rc != ncclResult_t::ncclSuccess {
            return Err(Error::Call {
                call: "ncclGetVersion",
                detail: format!("{rc:?}"),
            });
        }
        let code = code.max(0) as u32;
        // NCCL ≥ 2.9 encodes major·10000 + minor·100 + patch (older ones ·1000 + ·100).
        let version = if code >= 10000 {
            (code / 10000, code / 100 % 100, code % 100)
        } else {
            (code / 1000, code / 100 % 10, code % 100)
        };
        if version.0 != 2 {
            return Err(Error::Call {
                call: "ncclGetVersion",
                detail: format!(
                    "{} is NCCL {}.{}.{}; memra needs NCCL 2.x",
                    lib.path.display(),
                    version.0,
                    version.1,
                    version.2
                ),
            });
        }
        Ok(Nccl {
            lib,
            version,
            nvls,
            api,
            _handle: handle,
        })
    })
    .as_ref()
    .map_err(Clone::clone)
}

fn symbol<F: Copy>(handle: &Library, lib: &LoadedLib, name: &str) -> Result<F, Error> {
    // SAFETY: F is the C signature of `name` in nccl.h (the aliases above).
    unsafe { handle.get::<F>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| Error::Call {
            call: "dlsym",
            detail: format!("{} has no {name}: {e}", lib.path.display()),
        })
}

fn resolve(handle: &Library, lib: &LoadedLib) -> Result<Api, Error> {
    Ok(Api {
        get_error_string: symbol(handle, lib, "ncclGetErrorString")?,
        // NCCL ≥ 2.13 only.
        get_last_error: symbol(handle, lib, "ncclGetLastError").ok(),
        comm_init_all: symbol(handle, lib, "ncclCommInitAll")?,
        comm_destroy: symbol(handle, lib, "ncclCommDestroy")?,
        comm_count: symbol(handle, lib, "ncclCommCount")?,
        all_reduce: symbol(handle, lib, "ncclAllReduce")?,
        all_gather: symbol(handle, lib, "ncclAllGather")?,
        group_start: symbol(handle, lib, "ncclGroupStart")?,
        group_end: symbol(handle, lib, "ncclGroupEnd")?,
    })
}

/// For tests and `memra` diagnostics: NCCL, or `None` after printing one `SKIP:` line saying why.
pub fn nccl_or_skip(test: &str) -> Option<&'static Nccl> {
    match nccl() {
        Ok(n) => Some(n),
        Err(e) => {
            eprintln!("SKIP: {test}: NCCL not usable: {e}");
            None
        }
    }
}
