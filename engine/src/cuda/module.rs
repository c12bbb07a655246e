//! Many variants at once: probe the cache, compile the misses in parallel (rayon) with a progress
//! line on stderr, then (with a GPU) load each CUBIN and look up its `extern "C"` entry point,
//! which is the variant's name.

use std::collections::HashMap;
use std::io::{IsTerminal as _, Write as _};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream};
use cudarc::nvrtc::Ptx;
use rayon::prelude::*;

use super::cache::{CacheOutcome, CompileJob, KernelCache};
use super::workers;
use super::nvrtc::{Cubin, HeaderSet};
use super::{Error, SmArch};
use crate::kernels::registry::KernelVariant;

/// One variant's cubin and where it came from.
#[derive(Clone, Debug)]
pub struct CompiledVariant {
    pub variant: &'static KernelVariant,
    pub cubin: Arc<Cubin>,
    pub outcome: CacheOutcome,
    /// Time spent getting it (cache read or NVRTC compile), seconds.
    pub seconds: f64,
    /// Compiled by a worker process (`cuda::workers`), not in this one.
    pub by_worker: bool,
}

/// Gets every variant's cubin for `arch`, compiling cache misses in parallel. Results keep the
/// order of `variants`; one failure does not stop the others. Needs no GPU.
pub fn compile_variants(
    cache: &KernelCache,
    variants: &[&'static KernelVariant],
    headers: &HeaderSet,
    arch: SmArch,
) -> Vec<Result<CompiledVariant, Error>> {
    let job = |v: &'static KernelVariant| CompileJob { name: v.name, source: v.source, headers, arch };
    // Probes run in parallel too: each hashes its key and checks its entry's payload, which
    // dominates a warm start once there are dozens of variants.
    let mut results: Vec<Option<Result<CompiledVariant, Error>>> = variants
        .par_iter()
        .map(|&variant| {
            let start = Instant::now();
            match cache.lookup(&job(variant)) {
                Ok(Some((cubin, outcome))) => Some(Ok(CompiledVariant { variant, cubin, outcome, seconds: start.elapsed().as_secs_f64(), by_worker: false })),
                Ok(None) => None,
                Err(e) => Some(Err(e)),
            }
        })
        .collect();
    let mut misses: Vec<usize> = (0..results.len()).filter(|&i| results[i].is_none()).collect();
    if !misses.is_empty() {
        let procs = workers::processes_for(cache, variants, &misses, headers);
        // Under MEMRA_NO_NVRTC=1 the misses fail at once; no progress line for compiles that never happen.
        let progress = Progress::start(misses.len(), arch, procs, cache.config().allow_compile);
        if let Some(procs) = procs {
            let asked = misses.len();
            // Compiled by child processes into the disk cache: read back, reported as compiled.
            let mut unread = Vec::new();
            for d in workers::compile(cache, variants, &misses, arch, procs, &|| progress.tick()) {
                let variant = variants[d.index];
                match cache.lookup(&job(variant)) {
                    Ok(Some((cubin, _))) => {
                        results[d.index] = Some(Ok(CompiledVariant { variant, cubin, outcome: CacheOutcome::Compiled, seconds: d.seconds, by_worker: true }));
                    }
                    _ => unread.push(variant.name),
                }
            }
            if let Some(first) = unread.first() {
                // E.g. a worker that found another NVRTC (its version is part of the cache key).
                eprintln!(
                    "warning: memra: {} kernels compiled by workers were not in the cache afterwards (first: {first}); compiling them in this process",
                    unread.len()
                );
            }
            // What no worker delivered is compiled below (a failing variant's error comes from there).
            misses.retain(|&i| results[i].is_none());
            progress.done.store(asked - misses.len(), Ordering::Relaxed);
        }
        let compiled: Vec<(usize, Result<CompiledVariant, Error>)> = misses
            .par_iter()
            .map(|&i| {
                let variant = variants[i];
                let start = Instant::now();
                let result = cache.get_or_compile(&job(variant)).map(|(cubin, outcome)| CompiledVariant {
                    variant,
                    cubin,
                    outcome,
                    seconds: start.elapsed().as_secs_f64(),
                    by_worker: false,
                });
                progress.tick();
                (i, result)
            })
            .collect();
        progress.finish();
        for (i, result) in compiled {
            results[i] = Some(result);
        }
    }
    results.into_iter().map(|r| r.expect("every variant was probed or compiled")).collect()
}

/// `compiling 37 kernels for sm_90 in 16 processes … 12/37`, redrawn in place on a terminal; on a pipe only the
/// first and last lines, so logs stay short.
struct Progress {
    total: usize,
    done: AtomicUsize,
    arch: SmArch,
    /// Worker processes (cuda::workers), if the compiles run in them.
    procs: Option<usize>,
    tty: bool,
    shown: bool,
    start: Instant,
}

impl Progress {
    fn start(total: usize, arch: SmArch, procs: Option<usize>, shown: bool) -> Progress {
        let tty = std::io::stderr().is_terminal();
        let p = Progress { total, done: AtomicUsize::new(0), arch, procs, tty, shown, start: Instant::now() };
        p.draw(0, false);
        p
    }

    fn tick(&self) {
        let done = self.done.fetch_add(1, Ordering::Relaxed) + 1;
        if self.tty && done < self.total {
            self.draw(done, false);
        }
    }

    fn finish(&self) {
        self.draw(self.done.load(Ordering::Relaxed), true);
    }

    fn draw(&self, done: usize, last: bool) {
        if !self.shown {
            return;
        }
        let mut err = std::io::stderr().lock();
        let s = if self.total == 1 { "" } else { "s" };
        let how = self.procs.map(|p| format!(" in {p} processes")).unwrap_or_default();
        let line = format!("compiling {} kernel{s} for {}{how} … {done}/{}", self.total, self.arch, self.total);
        let _ = match (self.tty, last) {
            (true, false) => write!(err, "\r{line}"),
            (true, true) => writeln!(err, "\r{line} ({:.1} s)", self.start.elapsed().as_secs_f64()),
            (false, false) => writeln!(err, "{line}"),
            (false, true) => writeln!(err, "{line} ({:.1} s)", self.start.elapsed().as_secs_f64()),
        };
    }
}

/// A loaded kernel: the variant it came from, its function and the stream it launches on.
#[derive(Debug)]
pub struct Kernel {
    variant: &'static KernelVariant,
    function: CudaFunction,
    stream: Arc<CudaStream>,
}

impl Kernel {
    pub fn name(&self) -> &'static str {
        self.variant.name
    }

    pub fn variant(&self) -> &'static KernelVariant {
        self.variant
    }

    pub fn function(&self) -> &CudaFunction {
        &self.function
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

/// Loaded kernels by name.
#[derive(Debug, Default)]
pub struct Kernels {
    by_name: HashMap<&'static str, Kernel>,
}

impl Kernels {
    pub fn get(&self, name: &str) -> Result<&Kernel, Error> {
        self.by_name.get(name).ok_or_else(|| {
            let mut loaded: Vec<String> = self.by_name.keys().map(|k| k.to_string()).collect();
            loaded.sort();
            Error::NoSuchKernel { name: name.to_string(), loaded }
        })
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Kernel> {
        self.by_name.values()
    }

    pub fn remove(&mut self, name: &str) -> Option<Kernel> {
        self.by_name.remove(name)
    }

    /// Adds kernels loaded elsewhere (e.g. a second `Gpu::load` call).
    pub fn extend(&mut self, other: Kernels) {
        self.by_name.extend(other.by_name);
    }
}

/// Loads compiled variants into `ctx`; each kernel launches on `stream`.
pub fn load_modules(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>, compiled: &[CompiledVariant]) -> Result<Kernels, Error> {
    // One thread: loading from 16 threads measured no faster on the H200 (the driver serializes).
    let mut by_name = HashMap::with_capacity(compiled.len());
    for c in compiled {
        let name = c.variant.name;
        let module = ctx
            .load_module(Ptx::from_binary(c.cubin.bytes.clone()))
            .map_err(|e| Error::driver(format!("cuModuleLoadData({name})"), e))?;
        let function = module.load_function(name).map_err(|e| Error::driver(format!("cuModuleGetFunction({name})"), e))?;
        by_name.insert(name, Kernel { variant: c.variant, function, stream: stream.clone() });
    }
    Ok(Kernels { by_name })
}

/// The first error of a batch, mentioning how many others failed (all are printed to stderr).
pub(crate) fn first_error(results: Vec<Result<CompiledVariant, Error>>) -> Result<Vec<CompiledVariant>, Error> {
    let (ok, errors): (Vec<_>, Vec<_>) = results.into_iter().partition(|r| r.is_ok());
    let mut errors: Vec<Error> = errors.into_iter().filter_map(|r| r.err()).collect();
    if errors.is_empty() {
        return Ok(ok.into_iter().filter_map(|r| r.ok()).collect());
    }
    for e in errors.iter().skip(1) {
        eprintln!("error: {e}");
    }
    if errors.len() > 1 {
        eprintln!("error: {} kernels failed; the first one follows", errors.len());
    }
    Err(errors.swap_remove(0))
}
