//! NVRTC: generated CUDA source + in-memory template headers → CUBIN for one `sm_XX`.
//!
//! We load CUBIN rather than PTX so the driver does no JIT at load time, and the cubin is exactly
//! what ptxas reported registers and spills for. Works without a GPU.

use std::ffi::{CString, c_char};
use std::fmt::Write as _;

use cudarc::nvrtc::sys::{self, nvrtcProgram, nvrtcResult};
use sha2::{Digest, Sha256};

use super::{Error, SmArch, library};

/// NVRTC options for every kernel. Part of the cache key.
/// - `-std=c++17`: the templates use `if constexpr` and `constexpr` helpers.
/// - `-lineinfo`: source lines in the cubin for Nsight Compute; no effect on the generated code.
/// - `--ptxas-options=-v`: always on, so every cached entry carries its register/spill report and
///   `memra kernels --report` works from a warm cache; it only adds lines to the log.
/// - no `-default-device`: templates annotate every function (`__device__`, or `__host__ __device__`
///   for constexpr helpers) so they mean the same under `nvcc -fsyntax-only` as under NVRTC.
/// - no `-use_fast_math`: the templates pick fast intrinsics explicitly where accuracy allows.
/// - Hopper (`sm_90`) compiles for `sm_90a`, the arch-specific target with the warpgroup MMA
///   (wgmma) that mla_decode's tensor-core path uses there; an `sm_90a` cubin loads on compute
///   capability 9.0 only, the arch it is cached under anyway.
pub fn nvrtc_options(arch: SmArch) -> Vec<String> {
    let target = if arch == SmArch(90) { "sm_90a".to_string() } else { arch.to_string() };
    vec![
        format!("--gpu-architecture={target}"),
        "-std=c++17".to_string(),
        "-lineinfo".to_string(),
        "--ptxas-options=-v".to_string(),
    ]
}

/// The template headers handed to NVRTC in memory (`#include "memra/common.cuh"` resolves to
/// them), with a digest computed once and reused in every cache key.
pub struct HeaderSet {
    names: Vec<CString>,
    contents: Vec<CString>,
    texts: Vec<(String, String)>,
    digest: [u8; 32],
}

impl HeaderSet {
    pub fn new(headers: &[(&str, &str)]) -> HeaderSet {
        let mut hasher = Sha256::new();
        for (name, text) in headers {
            // Length-prefixed so ("ab","c") and ("a","bc") hash differently.
            hasher.update((name.len() as u64).to_le_bytes());
            hasher.update(name.as_bytes());
            hasher.update((text.len() as u64).to_le_bytes());
            hasher.update(text.as_bytes());
        }
        HeaderSet {
            names: headers.iter().map(|(n, _)| c_string(n)).collect(),
            contents: headers.iter().map(|(_, t)| c_string(t)).collect(),
            texts: headers.iter().map(|(n, t)| (n.to_string(), t.to_string())).collect(),
            digest: hasher.finalize().into(),
        }
    }

    /// The generated registry's headers.
    pub fn registry() -> HeaderSet {
        HeaderSet::new(crate::kernels::registry::TEMPLATE_HEADERS)
    }

    pub fn digest(&self) -> &[u8; 32] {
        &self.digest
    }
}

/// A compiled kernel module and the NVRTC log (which holds ptxas's `-v` report).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cubin {
    pub bytes: Vec<u8>,
    pub log: String,
}

impl Cubin {
    pub fn report(&self) -> PtxasReport {
        PtxasReport::parse(&self.log)
    }
}

/// What ptxas `-v` says about the (single) kernel of a module.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PtxasReport {
    pub registers: Option<u32>,
    pub spill_stores: Option<u64>,
    pub spill_loads: Option<u64>,
    pub stack_frame: Option<u64>,
    pub static_smem: Option<u64>,
}

impl PtxasReport {
    /// Parses lines such as `ptxas info : Used 40 registers, used 1 barriers, 380 bytes cmem[0]`
    /// and `0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads`.
    pub fn parse(log: &str) -> PtxasReport {
        let mut r = PtxasReport::default();
        for phrase in log.split([',', '\n']) {
            // Match on the phrase's last words: ptxas prefixes vary ("ptxas info    :", "ptxas         .").
            let words: Vec<&str> = phrase.split_whitespace().collect();
            let tail = |n: usize| words.len().checked_sub(n).map(|i| &words[i..]).unwrap_or(&[]);
            let number = |w: &str| w.parse::<u64>().ok();
            match (tail(3), tail(4), tail(5)) {
                (["Used", n, "registers"], _, _) => r.registers = r.registers.or(n.parse().ok()),
                (_, [n, "bytes", "spill", "stores"], _) => r.spill_stores = r.spill_stores.or(number(n)),
                (_, [n, "bytes", "spill", "loads"], _) => r.spill_loads = r.spill_loads.or(number(n)),
                (_, [n, "bytes", "stack", "frame"], _) => r.stack_frame = r.stack_frame.or(number(n)),
                ([n, "bytes", "smem"], _, _) => r.static_smem = r.static_smem.or(number(n)),
                _ => {}
            }
        }
        r
    }

    pub fn spills(&self) -> bool {
        self.spill_stores.unwrap_or(0) > 0 || self.spill_loads.unwrap_or(0) > 0
    }
}

/// Compiles one kernel source to a CUBIN for `arch`.
pub fn compile_cubin(name: &str, source: &str, headers: &HeaderSet, arch: SmArch) -> Result<Cubin, Error> {
    let (bytes, log) = compile(name, source, headers, arch, Output::Cubin)?;
    Ok(Cubin { bytes, log })
}

/// Compiles one kernel source and returns its PTX text (used to read a kernel's parameter list
/// without a GPU).
pub fn compile_ptx(name: &str, source: &str, headers: &HeaderSet, arch: SmArch) -> Result<String, Error> {
    let (bytes, _) = compile(name, source, headers, arch, Output::Ptx)?;
    let text = bytes.split(|b| *b == 0).next().unwrap_or(&[]);
    Ok(String::from_utf8_lossy(text).into_owned())
}

#[derive(Clone, Copy)]
enum Output {
    Cubin,
    Ptx,
}

/// Destroys the program on every path out of `compile`.
struct Program(nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: self.0 came from a successful nvrtcCreateProgram and is destroyed once.
        unsafe {
            sys::nvrtcDestroyProgram(&mut self.0);
        }
    }
}

fn check(call: &'static str, rc: nvrtcResult) -> Result<(), Error> {
    if rc == nvrtcResult::NVRTC_SUCCESS { Ok(()) } else { Err(Error::Nvrtc { call, detail: format!("{rc:?}") }) }
}

fn compile(name: &str, source: &str, headers: &HeaderSet, arch: SmArch, output: Output) -> Result<(Vec<u8>, String), Error> {
    library::nvrtc()?;
    let src = c_string(source);
    let file_name = c_string(&format!("{name}.cu"));
    let header_ptrs: Vec<*const c_char> = headers.contents.iter().map(|c| c.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = headers.names.iter().map(|c| c.as_ptr()).collect();
    let options: Vec<CString> = nvrtc_options(arch).iter().map(|o| c_string(o)).collect();
    let option_ptrs: Vec<*const c_char> = options.iter().map(|c| c.as_ptr()).collect();

    let mut raw: nvrtcProgram = std::ptr::null_mut();
    // SAFETY: NVRTC is loaded (library::nvrtc above); every pointer refers to a NUL-terminated
    // string that outlives the call, and the two header arrays have the same length.
    check("nvrtcCreateProgram", unsafe {
        sys::nvrtcCreateProgram(
            &mut raw,
            src.as_ptr(),
            file_name.as_ptr(),
            header_ptrs.len() as i32,
            header_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
    })?;
    let program = Program(raw);
    // SAFETY: a live program and an array of option_ptrs.len() valid C strings.
    let compiled = unsafe { sys::nvrtcCompileProgram(program.0, option_ptrs.len() as i32, option_ptrs.as_ptr()) };
    let log = program_log(&program)?;
    if compiled != nvrtcResult::NVRTC_SUCCESS {
        return Err(Error::Compile { name: name.to_string(), arch, log: log.clone(), listing: listing(name, source, headers, &log) });
    }
    let mut size = 0usize;
    let bytes = match output {
        Output::Cubin => {
            // SAFETY: a successfully compiled program; the buffer has the size NVRTC reported.
            unsafe {
                check("nvrtcGetCUBINSize", sys::nvrtcGetCUBINSize(program.0, &mut size))?;
                let mut buf = vec![0u8; size];
                check("nvrtcGetCUBIN", sys::nvrtcGetCUBIN(program.0, buf.as_mut_ptr().cast()))?;
                buf
            }
        }
        Output::Ptx => {
            // SAFETY: as above.
            unsafe {
                check("nvrtcGetPTXSize", sys::nvrtcGetPTXSize(program.0, &mut size))?;
                let mut buf = vec![0u8; size];
                check("nvrtcGetPTX", sys::nvrtcGetPTX(program.0, buf.as_mut_ptr().cast()))?;
                buf
            }
        }
    };
    if bytes.is_empty() {
        return Err(Error::Nvrtc { call: "nvrtcGetCUBIN", detail: format!("{name}: empty output") });
    }
    Ok((bytes, log))
}

fn program_log(program: &Program) -> Result<String, Error> {
    let mut size = 0usize;
    // SAFETY: a live program; the buffer has the size NVRTC reported (including the NUL).
    unsafe {
        check("nvrtcGetProgramLogSize", sys::nvrtcGetProgramLogSize(program.0, &mut size))?;
        let mut buf = vec![0u8; size.max(1)];
        check("nvrtcGetProgramLog", sys::nvrtcGetProgramLog(program.0, buf.as_mut_ptr().cast()))?;
        let text = buf.split(|b| *b == 0).next().unwrap_or(&[]);
        Ok(String::from_utf8_lossy(text).into_owned())
    }
}

/// The source with line numbers, followed by every header the log mentions.
fn listing(name: &str, source: &str, headers: &HeaderSet, log: &str) -> String {
    let mut out = String::new();
    let mut number = |title: &str, text: &str| {
        let _ = writeln!(out, "--- {title} ---");
        for (i, line) in text.lines().enumerate() {
            let _ = writeln!(out, "{:>5} | {line}", i + 1);
        }
    };
    number(&format!("{name}.cu"), source);
    for (header, text) in &headers.texts {
        if log.contains(header.as_str()) {
            number(header, text);
        }
    }
    out
}

/// Interior NULs cannot appear in C sources; map them to spaces rather than fail obscurely
/// (NVRTC then reports a real syntax error if it mattered).
fn c_string(text: &str) -> CString {
    CString::new(text.replace('\0', " ")).unwrap_or_default()
}

/// The NVRTC version (major, minor), loading NVRTC if needed.
pub fn version() -> Result<(i32, i32), Error> {
    Ok(library::nvrtc()?.version)
}

/// The architectures this NVRTC can target, e.g. `[75, 80, 86, 89, 90, 100, 120]`.
pub fn supported_archs() -> Result<Vec<u32>, Error> {
    library::nvrtc()?;
    let mut n = 0i32;
    // SAFETY: NVRTC is loaded; the buffer has the length NVRTC reported.
    unsafe {
        check("nvrtcGetNumSupportedArchs", sys::nvrtcGetNumSupportedArchs(&mut n))?;
        let mut archs = vec![0i32; n.max(0) as usize];
        check("nvrtcGetSupportedArchs", sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()))?;
        Ok(archs.into_iter().map(|a| a as u32).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hopper_compiles_for_its_arch_specific_target() {
        assert!(nvrtc_options(SmArch(90)).contains(&"--gpu-architecture=sm_90a".to_string()));
        assert!(nvrtc_options(SmArch(80)).contains(&"--gpu-architecture=sm_80".to_string()));
        assert!(nvrtc_options(SmArch(100)).contains(&"--gpu-architecture=sm_100".to_string()));
    }

    #[test]
    fn ptxas_report_parses_registers_and_spills() {
        let log = "ptxas info    : 0 bytes gmem\n\
                   ptxas info    : Compiling entry function 'k' for 'sm_90'\n\
                   ptxas info    : Function properties for k\n\
                   ptxas         .     16 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads\n\
                   ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem, 380 bytes cmem[0]\n";
        let r = PtxasReport::parse(log);
        assert_eq!(r.registers, Some(255));
        assert_eq!(r.spill_stores, Some(12));
        assert_eq!(r.spill_loads, Some(8));
        assert_eq!(r.stack_frame, Some(16));
        assert_eq!(r.static_smem, Some(1024));
        assert!(r.spills());
        assert_eq!(PtxasReport::parse(""), PtxasReport::default());
    }

    #[test]
    fn header_digest_depends_on_names_and_contents() {
        let a = HeaderSet::new(&[("a.cuh", "x")]);
        let b = HeaderSet::new(&[("a.cuh", "y")]);
        let c = HeaderSet::new(&[("b.cuh", "x")]);
        let d = HeaderSet::new(&[("a.cuh", "x")]);
        assert_ne!(a.digest(), b.digest());
        assert_ne!(a.digest(), c.digest());
        assert_eq!(a.digest(), d.digest());
    }
}
