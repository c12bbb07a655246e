//! `memra kernels` and `memra bench --list` without a GPU: the listings filter by architecture and
//! family, and a filter that matches nothing is an error naming what this build has, not an
//! empty table.

use std::process::{Command, Output};

fn memra(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memra")).args(args).output().expect("spawn memra")
}

#[test]
fn filters_list_variants_and_a_filter_matching_nothing_says_what_exists() {
    let out = memra(&["kernels", "--arch", "generic", "--family", "matvec"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<&str> = stdout.lines().filter(|l| l.starts_with("matvec__")).collect();
    assert!(!rows.is_empty() && rows.iter().all(|r| r.contains("generic")), "{stdout}");

    for args in [["--arch", "no-such-arch"], ["--family", "no_such_family"]] {
        let out = memra(&["kernels", args[0], args[1]]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {stderr}");
        assert!(stderr.contains(&format!("{} {}", args[0], args[1])) && stderr.contains("--arch generic"), "{stderr}");
        assert!(stderr.contains("matvec") && stderr.contains("--features model-<arch>"), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }

    let out = memra(&["bench", "--list", "--arch", "no-such-arch"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("no specialized variants to measure") && stderr.contains("--arch no-such-arch"), "{stderr}");
}

#[test]
fn load_times_a_start_up_on_the_gpu_and_says_why_it_cannot_without_one() {
    let out = memra(&["kernels", "--load", "--sm", "90"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("'--load' cannot be used with '--sm"), "{stderr}");

    if memra_engine::cuda::device::Gpu::device_count() > 0 {
        return; // the GPU case is timed by hand (README), not asserted here
    }
    let out = memra(&["kernels", "--arch", "generic", "--family", "rmsnorm", "--load"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("libcuda") || stderr.contains("device"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// Cold compiles in `memra nvrtc-worker` child processes (cuda::workers): every variant compiled
/// and reported as such, its entry in the disk cache (a second run hits them all); the same with
/// compiles kept in this process. NVRTC from the pip wheel (one SKIP line without it).
#[test]
fn cold_compiles_in_worker_processes_fill_the_cache() {
    if memra_engine::cuda::library::nvrtc_or_skip("cold_compiles_in_worker_processes_fill_the_cache").is_none() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("memra-workers-{}", std::process::id()));
    let run = |procs: &str, clear: bool| {
        let mut args = vec!["kernels", "--arch", "generic", "--family", "embed", "--compile", "--sm", "90", "--json"];
        if clear {
            args.push("--clear-cache");
        }
        let out = Command::new(env!("CARGO_BIN_EXE_memra")).args(&args).env("MEMRA_CACHE", &dir).env("MEMRA_NVRTC_PROCS", procs).output().expect("spawn memra");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("--json output");
        let by = |r: &serde_json::Value| format!("{} {}", r["cache"].as_str().unwrap_or(""), r["compiled_by"].as_str().unwrap_or("-"));
        (rows.iter().map(by).collect::<Vec<_>>(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    for procs in ["2", "1"] {
        let (cold, stderr) = run(procs, true);
        let want = if procs == "2" { "miss worker" } else { "miss this process" };
        assert!(cold.len() >= 4 && cold.iter().all(|c| c == want), "MEMRA_NVRTC_PROCS={procs}: {cold:?}");
        assert!(stderr.contains(&format!("{0}/{0}", cold.len())), "the progress line counts every compile once: {stderr}");
        assert_eq!(stderr.contains(" in 2 processes "), procs == "2", "MEMRA_NVRTC_PROCS={procs}: {stderr}");
        let cubins = std::fs::read_dir(dir.join("kernels").join(env!("CARGO_PKG_VERSION")).join("sm_90")).map_or(0, |d| d.count());
        assert_eq!(cubins, cold.len(), "MEMRA_NVRTC_PROCS={procs}: one cache entry per variant");
        let (warm, _) = run(procs, false);
        assert!(warm.iter().all(|c| c == "hit -"), "MEMRA_NVRTC_PROCS={procs}: {warm:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The worker itself: names it does not know are reported, and it fails.
#[test]
fn a_worker_reports_a_variant_it_does_not_have() {
    let dir = std::env::temp_dir().join(format!("memra-worker-bad-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_memra"))
        .args(["nvrtc-worker", "--sm", "90", "--cache-dir"])
        .arg(&dir)
        .arg("no_such_variant__n1")
        .output()
        .expect("spawn memra");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stdout}");
    assert!(stdout.starts_with("error no_such_variant__n1 ") && stdout.contains("no kernel variant"), "{stdout}");
    assert!(stderr.contains("1 of 1 variants failed") && !stderr.contains("panicked"), "{stderr}");
    let help = memra(&["--help"]);
    assert!(!String::from_utf8_lossy(&help.stdout).contains("nvrtc-worker"), "an internal subcommand stays out of --help");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Workers whose cache entries cannot be written (a file sits where the cache's version directory
/// should be): the parent says so, compiles in-process, keeps the kernels in memory, succeeds.
#[test]
fn worker_results_that_cannot_be_read_back_are_compiled_here() {
    if memra_engine::cuda::library::nvrtc_or_skip("worker_results_that_cannot_be_read_back_are_compiled_here").is_none() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("memra-workers-blocked-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("kernels")).unwrap();
    std::fs::write(dir.join("kernels").join(env!("CARGO_PKG_VERSION")), b"not a directory").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_memra"))
        .args(["kernels", "--arch", "generic", "--family", "embed", "--compile", "--sm", "90", "--json"])
        .env("MEMRA_CACHE", &dir)
        .env("MEMRA_NVRTC_PROCS", "2")
        .output()
        .expect("spawn memra");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("were not in the cache afterwards") && stderr.contains("not writable"), "{stderr}");
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("--json output");
    assert!(rows.len() >= 4 && rows.iter().all(|r| r["compiled_by"] == "this process"), "{rows:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
