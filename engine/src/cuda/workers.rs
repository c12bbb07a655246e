//! Cold compiles in child processes. NVRTC 13.0 runs one compile at a time per process: on the
//! H200 host (16 cores) glm-dsa's 77 variants took 3.7 s one after another and 2.5–3.0 s on 4
//! or 16 threads, with the same ~2.7 CPU-seconds in all (the threads wait on each other, they
//! do not work). Processes do not share that lock, so a cold start-up with many misses hands
//! them to children of a worker executable, `memra nvrtc-worker`, which compile into the disk
//! cache (safe for concurrent writers) and report on stdout; the parent then reads the entries
//! back. Anything a worker did not deliver is compiled in this process, which also produces the
//! real error of a variant that fails.
//!
//! Only an executable that has the subcommand can serve: `memra` calls [`enable`] at start-up;
//! elsewhere (tests, other binaries using the library) compiles stay in-process.

use std::io::{BufRead as _, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Instant;

use super::cache::{CacheConfig, CompileJob, KernelCache};
use super::nvrtc::HeaderSet;
use super::{Error, SmArch};
use crate::kernels::registry::{self, KernelVariant};

/// The subcommand a worker executable runs (hidden from `memra --help`).
pub const SUBCOMMAND: &str = "nvrtc-worker";

/// `MEMRA_NVRTC_PROCS`: the most worker processes (0 or 1: compile in this process).
pub const PROCS_ENV: &str = "MEMRA_NVRTC_PROCS";

/// Most processes by default: each holds a few hundred MB while it compiles.
const DEFAULT_MAX_PROCS: usize = 16;

static WORKER_EXE: OnceLock<PathBuf> = OnceLock::new();

/// Lets cold compiles use child processes of this executable, which must dispatch
/// `<exe> nvrtc-worker ARGS…` to [`worker_main`].
pub fn enable() {
    if let Ok(exe) = std::env::current_exe() {
        let _ = WORKER_EXE.set(exe);
    }
}

/// How many processes to split the compiles of `variants[i]`, `i` in `misses`, over: `None`
/// (compile in this process) when workers are not enabled or turned off, when a worker could not
/// serve them (a memory-only cache or one that may not compile, headers or variants not from the
/// registry), or when they would not pay for their start (~0.1 s each: two variants at least).
pub fn processes_for(cache: &KernelCache, variants: &[&'static KernelVariant], misses: &[usize], headers: &HeaderSet) -> Option<usize> {
    WORKER_EXE.get()?;
    let cap = match std::env::var(PROCS_ENV).ok().filter(|v| !v.trim().is_empty()) {
        // Not a number: in this process, as with 0.
        Some(v) => v.trim().parse::<usize>().unwrap_or(0),
        None => std::thread::available_parallelism().map_or(1, |n| n.get()).min(DEFAULT_MAX_PROCS),
    };
    let procs = cap.min(misses.len() / 2);
    let from_registry = |i: &usize| registry::find(variants[*i].name).is_some_and(|r| std::ptr::eq(r, variants[*i]));
    let servable = cache.config().dir.is_some() && cache.config().allow_compile && is_registry_headers(headers) && misses.iter().all(from_registry);
    (procs >= 2 && servable).then_some(procs)
}

/// Whether `headers` are the registry's template headers, the only ones a worker has.
fn is_registry_headers(headers: &HeaderSet) -> bool {
    static DIGEST: OnceLock<[u8; 32]> = OnceLock::new();
    DIGEST.get_or_init(|| *HeaderSet::registry().digest()) == headers.digest()
}

/// One variant a worker compiled: its index in the caller's list and the seconds it took.
pub struct Delivered {
    pub index: usize,
    pub seconds: f64,
}

/// Compiles `variants[i]` for each `i` in `misses` in `procs` child processes
/// ([`processes_for`]) into `cache`'s directory; `tick` runs as each one is reported. Returns
/// what the workers reported compiled (the caller reads those entries back from the disk cache);
/// a worker that does not start or stops early delivers less.
pub fn compile(
    cache: &KernelCache,
    variants: &[&'static KernelVariant],
    misses: &[usize],
    arch: SmArch,
    procs: usize,
    tick: &(dyn Fn() + Sync),
) -> Vec<Delivered> {
    let (Some(exe), Some(dir)) = (WORKER_EXE.get(), cache.config().dir.as_ref()) else { return Vec::new() };
    // Dealt round-robin: a family's variants sit together in the registry and cost alike.
    let shares: Vec<Vec<usize>> = (0..procs).map(|p| misses.iter().copied().skip(p).step_by(procs).collect()).collect();
    let outcomes: Vec<(Vec<Delivered>, Option<String>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = shares
            .iter()
            .filter(|share| !share.is_empty())
            .map(|share| scope.spawn(move || run_worker(exe, dir, arch, variants, share, tick)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| (Vec::new(), Some("its reader thread panicked".into())))).collect()
    });
    // One line for all of them (a failed start or Ctrl-C would otherwise print one per worker).
    let short: Vec<&String> = outcomes.iter().filter_map(|(_, why)| why.as_ref()).collect();
    if let Some(first) = short.first() {
        eprintln!("warning: memra: {} of {} compile workers fell short ({first}); compiling the rest in this process", short.len(), outcomes.len());
    }
    outcomes.into_iter().flat_map(|(delivered, _)| delivered).collect()
}

/// Runs one worker over `share` and collects its `ok NAME SECONDS` lines as they come, with why
/// it fell short when it delivered neither a kernel nor a compile error for every name.
fn run_worker(
    exe: &Path,
    dir: &Path,
    arch: SmArch,
    variants: &[&'static KernelVariant],
    share: &[usize],
    tick: &(dyn Fn() + Sync),
) -> (Vec<Delivered>, Option<String>) {
    let mut cmd = Command::new(exe);
    cmd.arg(SUBCOMMAND).arg("--sm").arg(arch.0.to_string()).arg("--cache-dir").arg(dir);
    cmd.args(share.iter().map(|&i| variants[i].name));
    let mut child = match cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn() {
        Ok(child) => child,
        Err(e) => return (Vec::new(), Some(format!("cannot start {}: {e}", exe.display()))),
    };
    let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
    let mut delivered = Vec::new();
    let mut failed = 0;
    // stderr drained on its own thread: a worker blocked on a full stderr pipe would never close stdout.
    let err_text = std::thread::scope(|scope| {
        let err = scope.spawn(move || {
            let mut text = String::new();
            if let Some(mut e) = stderr {
                let _ = std::io::Read::read_to_string(&mut e, &mut text);
            }
            text
        });
        for line in stdout.map(|out| BufReader::new(out).lines().map_while(Result::ok)).into_iter().flatten() {
            let mut words = line.splitn(3, ' ');
            match (words.next(), words.next(), words.next()) {
                (Some("ok"), Some(name), Some(secs)) => {
                    if let Some(&index) = share.iter().find(|&&i| variants[i].name == name) {
                        delivered.push(Delivered { index, seconds: secs.trim().parse().unwrap_or(0.0) });
                        tick();
                    }
                }
                (Some("error"), Some(_), _) => failed += 1,
                _ => {}
            }
        }
        err.join().unwrap_or_default()
    });
    let status = child.wait();
    // A variant that fails to compile is reported with its full log by the in-process retry.
    let short = (delivered.len() + failed < share.len()).then(|| {
        let why = err_text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no message");
        let status = status.map_or_else(|e| e.to_string(), |s| s.to_string());
        format!("one delivered {} of {} kernels, {status}: {why}", delivered.len(), share.len())
    });
    (delivered, short)
}

/// Arguments of `memra nvrtc-worker` (internal: spawned by a cold start-up, see the module doc).
#[derive(clap::Args, Debug, Clone)]
pub struct WorkerArgs {
    /// Target GPU architecture (90 = sm_90).
    #[arg(long)]
    pub sm: String,
    /// The `kernels` cache directory to compile into.
    #[arg(long)]
    pub cache_dir: PathBuf,
    /// Variant names of this build's registry.
    pub variants: Vec<String>,
}

/// A worker: compiles each named variant into the disk cache, one at a time, printing
/// `ok NAME SECONDS` or `error NAME MESSAGE` per variant. Fails if any did not compile.
pub fn worker_main(args: &WorkerArgs) -> Result<(), Error> {
    let arch = SmArch::parse(&args.sm).ok_or_else(|| Error::Selection { detail: format!("{SUBCOMMAND}: --sm `{}` is not an architecture (90, sm_90)", args.sm) })?;
    let cache = KernelCache::new(CacheConfig::at(&args.cache_dir));
    let headers = HeaderSet::registry();
    let mut failed = 0;
    let mut out = std::io::stdout().lock();
    for name in &args.variants {
        let start = Instant::now();
        let result = match registry::find(name) {
            Some(v) => cache.get_or_compile(&CompileJob { name: v.name, source: v.source, headers: &headers, arch }).map(|_| ()),
            None => Err(Error::Selection { detail: format!("no kernel variant `{name}` in this build") }),
        };
        let line = match result {
            Ok(()) => format!("ok {name} {:.6}", start.elapsed().as_secs_f64()),
            Err(e) => {
                failed += 1;
                format!("error {name} {}", e.to_string().replace('\n', " "))
            }
        };
        // Flushed per line: the parent's progress line advances as each variant lands.
        let _ = writeln!(out, "{line}").and_then(|()| out.flush());
    }
    if failed > 0 {
        return Err(Error::Selection { detail: format!("{failed} of {} variants failed to compile", args.variants.len()) });
    }
    Ok(())
}
