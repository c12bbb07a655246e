//! The compiled-kernel cache, CPU only (NVRTC from the pip wheel; one SKIP line without it):
//! hits, damaged entries, concurrent writers, unwritable dirs, MEMRA_NO_NVRTC.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use memra_engine::cuda::cache::{CacheConfig, CacheOutcome, CompileJob, KernelCache};
use memra_engine::cuda::nvrtc::HeaderSet;
use memra_engine::cuda::{Error, SmArch, compile_variants, library};
use memra_engine::kernels::registry::KernelVariant;

static TINY: KernelVariant = KernelVariant {
    name: "cache_demo__n4",
    family: "cache_demo",
    arch: None,
    params: &[],
    source: "extern \"C\" __global__ void cache_demo__n4(float* y) { if (threadIdx.x < 4) y[threadIdx.x] *= 2.0f; }\n",
};

static OTHER: KernelVariant = KernelVariant {
    name: "cache_demo__n8",
    family: "cache_demo",
    arch: None,
    params: &[],
    source: "extern \"C\" __global__ void cache_demo__n8(float* y) { if (threadIdx.x < 8) y[threadIdx.x] += 1.0f; }\n",
};

/// A fresh directory per test (removed on drop).
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        let dir = std::env::temp_dir().join(format!("memra-cache-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn job<'a>(v: &'a KernelVariant, headers: &'a HeaderSet) -> CompileJob<'a> {
    CompileJob { name: v.name, source: v.source, headers, arch: SmArch(90) }
}

fn have_nvrtc(test: &str) -> bool {
    library::nvrtc_or_skip(test).is_some()
}

#[test]
fn second_compile_hits_memory_then_disk() {
    if !have_nvrtc("second_compile_hits_memory_then_disk") {
        return;
    }
    let dir = TempDir::new("hit");
    let headers = HeaderSet::new(&[]);
    let cache = KernelCache::new(CacheConfig::at(&dir.0));
    let (first, outcome) = cache.get_or_compile(&job(&TINY, &headers)).unwrap();
    assert_eq!(outcome, CacheOutcome::Compiled);
    let (again, outcome) = cache.get_or_compile(&job(&TINY, &headers)).unwrap();
    assert_eq!(outcome, CacheOutcome::Memory);
    assert_eq!(first, again);

    let key = cache.key(&job(&TINY, &headers)).unwrap();
    let path = cache.entry_path(&job(&TINY, &headers), &key).unwrap();
    let expected_dir = dir.0.join(env!("CARGO_PKG_VERSION")).join("sm_90");
    assert_eq!(path.parent(), Some(expected_dir.as_path()));
    let file = path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(file.starts_with("cache_demo__n4-") && file.ends_with(".cubin") && file.len() == "cache_demo__n4-".len() + 16 + 6, "{file}");

    let fresh = KernelCache::new(CacheConfig::at(&dir.0));
    let (from_disk, outcome) = fresh.get_or_compile(&job(&TINY, &headers)).unwrap();
    assert_eq!(outcome, CacheOutcome::Disk);
    assert_eq!(*from_disk, *first, "the disk entry round-trips the cubin and its log");
    assert!(from_disk.report().registers.is_some(), "the ptxas report survives the cache");
    assert!(cache.warnings().is_empty() && fresh.warnings().is_empty());
}

#[test]
fn key_changes_with_source_headers_and_arch() {
    if !have_nvrtc("key_changes_with_source_headers_and_arch") {
        return;
    }
    let cache = KernelCache::new(CacheConfig::memory_only());
    let (h0, h1) = (HeaderSet::new(&[]), HeaderSet::new(&[("x.cuh", "// unused")]));
    let base = cache.key(&job(&TINY, &h0)).unwrap();
    assert_eq!(base, cache.key(&job(&TINY, &h0)).unwrap(), "the key is deterministic");
    assert_ne!(base, cache.key(&job(&TINY, &h1)).unwrap(), "headers are part of the key");
    assert_ne!(base, cache.key(&CompileJob { arch: SmArch(80), ..job(&TINY, &h0) }).unwrap(), "arch is part of the key");
    assert_ne!(base, cache.key(&CompileJob { source: OTHER.source, ..job(&TINY, &h0) }).unwrap(), "source is part of the key");
}

/// Damages the entry with `damage`, then checks that a fresh handle warns once, rebuilds, and
/// leaves a valid entry behind.
fn damaged_entry_is_rebuilt(tag: &str, damage: impl Fn(&Path), reason: &str) {
    let dir = TempDir::new(tag);
    let headers = HeaderSet::new(&[]);
    let warm = KernelCache::new(CacheConfig::at(&dir.0));
    let (good, _) = warm.get_or_compile(&job(&TINY, &headers)).unwrap();
    let path = warm.entry_path(&job(&TINY, &headers), &warm.key(&job(&TINY, &headers)).unwrap()).unwrap();
    damage(&path);

    let cache = KernelCache::new(CacheConfig::at(&dir.0));
    let (rebuilt, outcome) = cache.get_or_compile(&job(&TINY, &headers)).unwrap();
    assert_eq!(outcome, CacheOutcome::Compiled, "{tag}: a damaged entry is a miss");
    assert_eq!(rebuilt.bytes, good.bytes, "{tag}: NVRTC output is deterministic");
    let warnings = cache.warnings();
    assert_eq!(warnings.len(), 1, "{tag}: exactly one warning: {warnings:?}");
    assert!(warnings[0].contains(reason) && warnings[0].contains(&path.display().to_string()), "{tag}: {warnings:?}");

    let after = KernelCache::new(CacheConfig::at(&dir.0));
    assert_eq!(after.get_or_compile(&job(&TINY, &headers)).unwrap().1, CacheOutcome::Disk, "{tag}: rebuilt entry is valid");
    assert!(after.warnings().is_empty());
}

#[test]
fn corrupted_truncated_and_foreign_entries_are_rebuilt() {
    if !have_nvrtc("corrupted_truncated_and_foreign_entries_are_rebuilt") {
        return;
    }
    damaged_entry_is_rebuilt(
        "corrupt",
        |p| {
            let mut bytes = std::fs::read(p).unwrap();
            let mid = bytes.len() / 2;
            bytes[mid] ^= 0x5a;
            std::fs::write(p, bytes).unwrap();
        },
        "checksum mismatch",
    );
    damaged_entry_is_rebuilt(
        "truncated",
        |p| {
            let bytes = std::fs::read(p).unwrap();
            std::fs::write(p, &bytes[..bytes.len() - 100]).unwrap();
        },
        "truncated",
    );
    damaged_entry_is_rebuilt("empty", |p| std::fs::write(p, b"").unwrap(), "not a memra cache entry");
    damaged_entry_is_rebuilt(
        "other-key",
        |p| {
            // A valid entry of another kernel under this kernel's file name.
            let elsewhere = TempDir::new("other-key-src");
            let headers = HeaderSet::new(&[]);
            let cache = KernelCache::new(CacheConfig::at(&elsewhere.0));
            cache.get_or_compile(&job(&OTHER, &headers)).unwrap();
            let key = cache.key(&job(&OTHER, &headers)).unwrap();
            std::fs::copy(cache.entry_path(&job(&OTHER, &headers), &key).unwrap(), p).unwrap();
        },
        "belongs to another key",
    );
    damaged_entry_is_rebuilt(
        "huge-length",
        |p| {
            // A header claiming a cubin longer than any file.
            let mut bytes = std::fs::read(p).unwrap();
            bytes[40..48].copy_from_slice(&u64::MAX.to_le_bytes());
            std::fs::write(p, bytes).unwrap();
        },
        "truncated",
    );
    damaged_entry_is_rebuilt(
        "foreign",
        |p| {
            // A bare cubin, as another tool would write it.
            let bytes = std::fs::read(p).unwrap();
            std::fs::write(p, &bytes[84..]).unwrap();
        },
        "not a memra cache entry",
    );
}

#[test]
fn concurrent_compiles_with_separate_handles_all_succeed() {
    if !have_nvrtc("concurrent_compiles_with_separate_handles_all_succeed") {
        return;
    }
    let dir = TempDir::new("race");
    let threads = 4;
    let barrier = Arc::new(Barrier::new(threads));
    let results: Vec<(Vec<u8>, CacheOutcome)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let barrier = barrier.clone();
                let root = dir.0.clone();
                s.spawn(move || {
                    let headers = HeaderSet::new(&[]);
                    let cache = KernelCache::new(CacheConfig::at(root));
                    barrier.wait();
                    let (cubin, outcome) = cache.get_or_compile(&job(&TINY, &headers)).expect("every writer succeeds");
                    assert!(cache.warnings().is_empty(), "{:?}", cache.warnings());
                    (cubin.bytes.clone(), outcome)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(results.iter().all(|(bytes, _)| *bytes == results[0].0));
    eprintln!("outcomes: {:?}", results.iter().map(|r| r.1).collect::<Vec<_>>());
    let arch_dir = dir.0.join(env!("CARGO_PKG_VERSION")).join("sm_90");
    let names: Vec<String> = std::fs::read_dir(&arch_dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names.len(), 1, "one entry and no temp files left: {names:?}");
    let headers = HeaderSet::new(&[]);
    let after = KernelCache::new(CacheConfig::at(&dir.0));
    assert_eq!(after.get_or_compile(&job(&TINY, &headers)).unwrap().1, CacheOutcome::Disk);
}

/// Set in the child processes of `separate_processes_compiling_at_once_all_succeed`.
const CHILD_DIR_ENV: &str = "MEMRA_CACHE_TEST_CHILD_DIR";
const CHILD_GO_ENV: &str = "MEMRA_CACHE_TEST_CHILD_GO";

/// The child side of the test below: a no-op unless started by it. Waits for the go file so
/// that every child compiles at the same moment, then compiles both kernels into the shared dir.
#[test]
fn cache_child_process() {
    let (Some(dir), Some(go)) = (std::env::var_os(CHILD_DIR_ENV), std::env::var_os(CHILD_GO_ENV)) else {
        return;
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    while !Path::new(&go).exists() {
        assert!(Instant::now() < deadline, "the parent never created the go file");
        std::thread::sleep(Duration::from_millis(1));
    }
    let cache = KernelCache::new(CacheConfig::at(PathBuf::from(dir)));
    let headers = HeaderSet::new(&[]);
    let results = compile_variants(&cache, &[&TINY, &OTHER], &headers, SmArch(90));
    let outcomes: Vec<String> =
        results.iter().map(|r| format!("{:?}", r.as_ref().expect("every process compiles").outcome)).collect();
    assert!(cache.warnings().is_empty(), "{:?}", cache.warnings());
    println!("CHILD-OK {}", outcomes.join(","));
}

#[test]
fn separate_processes_compiling_at_once_all_succeed() {
    if !have_nvrtc("separate_processes_compiling_at_once_all_succeed") {
        return;
    }
    let dir = TempDir::new("processes");
    let cache_dir = dir.0.join("kernels");
    let go = dir.0.join("go");
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..3)
        .map(|_| {
            Command::new(&exe)
                .args(["cache_child_process", "--exact", "--nocapture", "--test-threads", "1"])
                .env(CHILD_DIR_ENV, &cache_dir)
                .env(CHILD_GO_ENV, &go)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("start a child test process")
        })
        .collect();
    // Let the children load NVRTC and reach the wait before releasing them together.
    std::thread::sleep(Duration::from_millis(500));
    std::fs::write(&go, b"").unwrap();
    for child in children {
        let out = child.wait_with_output().unwrap();
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && stdout.contains("CHILD-OK"), "child failed ({}):\n{stdout}\n{stderr}", out.status);
        eprintln!("{}", stdout.lines().find(|l| l.contains("CHILD-OK")).unwrap_or_default());
    }
    let arch_dir = cache_dir.join(env!("CARGO_PKG_VERSION")).join("sm_90");
    let mut names: Vec<String> =
        std::fs::read_dir(&arch_dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(names.len(), 2, "one entry per kernel and no temp files left: {names:?}");
    let headers = HeaderSet::new(&[]);
    let after = KernelCache::new(CacheConfig::at(&cache_dir));
    for v in [&TINY, &OTHER] {
        assert_eq!(after.get_or_compile(&job(v, &headers)).unwrap().1, CacheOutcome::Disk, "{}", v.name);
    }
    assert!(after.warnings().is_empty(), "{:?}", after.warnings());
}

#[test]
fn clear_cache_command_removes_the_cache_dir() {
    let dir = TempDir::new("clear-cli");
    let entry_dir = dir.0.join("kernels").join("0.0.0").join("sm_90");
    std::fs::create_dir_all(&entry_dir).unwrap();
    std::fs::write(entry_dir.join("k-0123456789abcdef.cubin"), b"stale").unwrap();
    let memra = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_memra")).args(args).env("MEMRA_CACHE", &dir.0).output().unwrap()
    };
    let out = memra(&["kernels", "--clear-cache"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("removed kernel cache") && stderr.contains(&dir.0.join("kernels").display().to_string()), "{stderr}");
    assert!(!dir.0.join("kernels").exists());
    let out = memra(&["kernels", "--clear-cache"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("already empty"));
}

#[test]
fn unwritable_cache_dir_falls_back_to_memory_with_one_warning() {
    if !have_nvrtc("unwritable_cache_dir_falls_back_to_memory_with_one_warning") {
        return;
    }
    // A regular file where the cache dir's parent should be: unwritable even for root.
    let tmp = TempDir::new("unwritable");
    let blocker = tmp.0.join("not-a-dir");
    std::fs::write(&blocker, b"").unwrap();
    let cache = KernelCache::new(CacheConfig::at(blocker.join("kernels")));
    let headers = HeaderSet::new(&[]);
    let results = compile_variants(&cache, &[&TINY, &OTHER], &headers, SmArch(90));
    for r in &results {
        assert_eq!(r.as_ref().expect("compiles despite the cache").outcome, CacheOutcome::Compiled);
    }
    let warnings = cache.warnings();
    assert_eq!(warnings.len(), 1, "one warning for the whole run: {warnings:?}");
    assert!(warnings[0].contains("not writable") && warnings[0].contains(&blocker.display().to_string()), "{warnings:?}");
    let (_, outcome) = cache.get_or_compile(&job(&TINY, &headers)).unwrap();
    assert_eq!(outcome, CacheOutcome::Memory, "kept in memory for the rest of the run");
    assert_eq!(cache.warnings().len(), 1);
}

#[test]
fn read_only_cache_dir_still_serves_hits() {
    if !have_nvrtc("read_only_cache_dir_still_serves_hits") {
        return;
    }
    use std::os::unix::fs::PermissionsExt as _;
    let dir = TempDir::new("readonly");
    let headers = HeaderSet::new(&[]);
    KernelCache::new(CacheConfig::at(&dir.0)).get_or_compile(&job(&TINY, &headers)).unwrap();
    let arch_dir = dir.0.join(env!("CARGO_PKG_VERSION")).join("sm_90");
    std::fs::set_permissions(&arch_dir, std::fs::Permissions::from_mode(0o555)).unwrap();
    let probe = arch_dir.join("probe");
    let root_ignores_modes = std::fs::write(&probe, b"").is_ok();
    let _ = std::fs::remove_file(&probe);

    let cache = KernelCache::new(CacheConfig::at(&dir.0));
    assert_eq!(cache.get_or_compile(&job(&TINY, &headers)).unwrap().1, CacheOutcome::Disk);
    let (_, outcome) = cache.get_or_compile(&job(&OTHER, &headers)).unwrap();
    assert_eq!(outcome, CacheOutcome::Compiled);
    if root_ignores_modes {
        eprintln!("note: running as root, so mode 0555 does not stop writes; the unwritable case is covered by the test above");
        assert!(cache.warnings().is_empty());
    } else {
        assert_eq!(cache.warnings().len(), 1, "{:?}", cache.warnings());
    }
    std::fs::set_permissions(&arch_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn no_nvrtc_mode_fails_on_a_miss_and_serves_hits() {
    if !have_nvrtc("no_nvrtc_mode_fails_on_a_miss_and_serves_hits") {
        return;
    }
    let dir = TempDir::new("no-nvrtc");
    let headers = HeaderSet::new(&[]);
    let strict = KernelCache::new(CacheConfig { allow_compile: false, ..CacheConfig::at(&dir.0) });
    let err = strict.get_or_compile(&job(&TINY, &headers)).unwrap_err();
    assert!(matches!(err, Error::CompileForbidden { .. }), "{err}");
    assert!(err.to_string().contains("MEMRA_NO_NVRTC=1"), "{err}");
    KernelCache::new(CacheConfig::at(&dir.0)).get_or_compile(&job(&TINY, &headers)).unwrap();
    assert_eq!(strict.get_or_compile(&job(&TINY, &headers)).unwrap().1, CacheOutcome::Disk);
}

#[test]
fn parallel_batch_reports_hits_and_misses_in_order() {
    if !have_nvrtc("parallel_batch_reports_hits_and_misses_in_order") {
        return;
    }
    let dir = TempDir::new("batch");
    let headers = HeaderSet::new(&[]);
    let cache = KernelCache::new(CacheConfig::at(&dir.0));
    cache.get_or_compile(&job(&TINY, &headers)).unwrap();
    let fresh = KernelCache::new(CacheConfig::at(&dir.0));
    let results = compile_variants(&fresh, &[&OTHER, &TINY], &headers, SmArch(90));
    let got: Vec<(&str, CacheOutcome)> = results.iter().map(|r| r.as_ref().map(|c| (c.variant.name, c.outcome)).unwrap()).collect();
    assert_eq!(got, [("cache_demo__n8", CacheOutcome::Compiled), ("cache_demo__n4", CacheOutcome::Disk)]);
}

/// Many misses compiled in parallel come back in the caller's order, each under its own name.
#[test]
fn many_misses_come_back_in_order() {
    if !have_nvrtc("many_misses_come_back_in_order") {
        return;
    }
    let variants: Vec<&'static KernelVariant> = (0..9)
        .map(|i| {
            let name: &'static str = Box::leak(format!("many_demo_{i}").into_boxed_str());
            let source = Box::leak(format!("extern \"C\" __global__ void {name}(float* y) {{ y[threadIdx.x] += {i}.0f; }}\n").into_boxed_str());
            &*Box::leak(Box::new(KernelVariant { name, family: "cache_demo", arch: None, params: &[], source }))
        })
        .collect();
    let dir = TempDir::new("many");
    let cache = KernelCache::new(CacheConfig::at(&dir.0));
    let results = compile_variants(&cache, &variants, &HeaderSet::new(&[]), SmArch(90));
    let got: Vec<&str> = results.iter().map(|r| r.as_ref().map(|c| c.variant.name).unwrap()).collect();
    let want: Vec<&str> = variants.iter().map(|v| v.name).collect();
    assert_eq!(got, want);
    for r in &results {
        let c = r.as_ref().unwrap();
        assert_eq!(c.outcome, CacheOutcome::Compiled);
        let symbol = c.variant.name.as_bytes();
        assert!(c.cubin.bytes.windows(symbol.len()).any(|w| w == symbol), "{}'s cubin lacks its entry point", c.variant.name);
    }
}

#[test]
fn clear_removes_every_entry() {
    if !have_nvrtc("clear_removes_every_entry") {
        return;
    }
    let dir = TempDir::new("clear");
    let root = dir.0.join("kernels");
    let headers = HeaderSet::new(&[]);
    let cache = KernelCache::new(CacheConfig::at(&root));
    cache.get_or_compile(&job(&TINY, &headers)).unwrap();
    assert_eq!(cache.clear().unwrap(), Some(root.clone()));
    assert!(!root.exists());
    assert_eq!(cache.get_or_compile(&job(&TINY, &headers)).unwrap().1, CacheOutcome::Compiled, "memory is cleared too");
    assert_eq!(KernelCache::new(CacheConfig::at(dir.0.join("never"))).clear().unwrap(), None);
}
