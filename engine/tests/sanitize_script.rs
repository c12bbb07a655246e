//! `scripts/gpu-sanitize`'s bookkeeping, on a machine without a GPU: the script runs in a scratch
//! copy of the repo against a fake `compute-sanitizer` (first on PATH: it runs the target, then
//! writes the log and exit code a case asks for) and a fake test executable in `.gpu/tests`
//! (lists two tests, echoes its arguments and `MEMRA_TEST_SHARD`, passes or fails on request).
//! Checked: `--shards` deals a test whose name holds digits into exactly N processes; CUDA API
//! return codes raised inside libnccl are set apart and not counted; a memory-access report
//! counts even with libnccl frames; a failing test under the sanitizer's error exit code still
//! fails; a test that made no CUDA call says NOTHING CHECKED; `--only` runs just the named tests;
//! a pass without the tool's summary (never attached) is NOT CHECKED and fails; racecheck's
//! hazard summary counts; past `--deadline` nothing starts and the run fails; `--retry-killed`
//! runs a SIGKILLed unit again; racecheck alone gets `--racecheck-num-workers` (cores / jobs,
//! or `--racecheck-workers`); the memory guard kills a unit over `--max-rss-gb`, or the largest
//! under `--min-free-gb`, and says so, also for units another invocation listed in the shared
//! folder (one guard per machine);
//! `--detach` returns while the run goes on, and `scripts/sanitize-progress` follows and packs it;
//! and `scripts/sanitize-verdict` combines runs only at the builds it is told to accept.

use std::path::{Path, PathBuf};
use std::process::Command;

const FAKE_SANITIZER: &str = r#"#!/usr/bin/env bash
if [ "$1" = --version ]; then echo "Version 0.0 (fake)"; exit 0; fi
[ -z "${FAKE_ARGS:-}" ] || echo "$*" >> "$FAKE_ARGS"
while [ "$1" != --log-file ]; do shift; done
log=$2; shift 2
"$@"; rc=$?
if [ -n "${FAKE_LOG:-}" ]; then cp "$FAKE_LOG" "$log"; else echo "========= ERROR SUMMARY: 0 errors" > "$log"; fi
exit "${FAKE_EXIT:-$rc}"
"#;

const FAKE_TESTS: &str = r#"#!/usr/bin/env bash
if [ "$1" = --list ]; then printf 'gpu_alpha: test\ngpu_f32_beta9: test\n'; exit 0; fi
echo "args: $* shard=${MEMRA_TEST_SHARD:-none} sanitizer=${MEMRA_SANITIZER:-none}"
# Killed once, like the host's OOM killer would: the marker folder says it already happened
# (mkdir, so that of two units started together exactly one makes it and is killed).
if [ -n "${FAKE_KILL_ONCE:-}" ] && mkdir "$FAKE_KILL_ONCE" 2>/dev/null; then kill -9 $$; fi
# Holds FAKE_HOLD_MB of resident memory for up to a minute (a racecheck process that grows).
if [ -n "${FAKE_HOLD_MB:-}" ]; then python3 -c "import time; x = bytes([1]) * ($FAKE_HOLD_MB << 20); time.sleep(60)"; fi
[ -z "${FAKE_SLEEP:-}" ] || sleep "$FAKE_SLEEP"
if [ -n "${FAKE_TEST_FAIL:-}" ]; then echo "test result: FAILED. 0 passed; 1 failed"; exit 101; fi
echo "test result: ok. 1 passed; 0 failed"
"#;

const NCCL_CODES: &str = "========= COMPUTE-SANITIZER
========= Program hit cudaErrorPeerAccessAlreadyEnabled (error 704) due to \"peer access is already enabled\" on CUDA API call to cudaGetLastError.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame:  [0x4cb045] in libcuda.so.1
=========         Host Frame:  [0x1babc0] in libnccl.so.2
========= 
========= Program hit cudaErrorNoKernelImageForDevice (error 209) due to \"no kernel image is available for execution on the device\" on CUDA API call to cudaFuncGetAttributes.
=========         Host Frame:  [0x4cb045] in libcuda.so.1
=========         Host Frame:  [0x71065] in libnccl.so.2
========= 
========= ERROR SUMMARY: 2 errors
";

const ACCESS_ERROR: &str = "========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 4 bytes
=========     at some_kernel+0x10
=========         Host Frame:  [0x1babc0] in libnccl.so.2
========= 
========= ERROR SUMMARY: 1 error
";

struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write_exe(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

fn scratch(name: &str) -> Scratch {
    let root = std::env::temp_dir().join(format!("memra-sanitize-script-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu-sanitize");
    write_exe(&root.join("scripts/gpu-sanitize"), &std::fs::read_to_string(script).unwrap());
    write_exe(&root.join("bin/compute-sanitizer"), FAKE_SANITIZER);
    write_exe(&root.join(".gpu/tests/fake"), FAKE_TESTS);
    Scratch(root)
}

/// A `/proc/meminfo` stand-in for the memory guard: `total` and `available` in kB.
fn meminfo(s: &Scratch, total: u64, available: u64) -> (&'static str, String) {
    let p = s.0.join(format!("meminfo-{total}-{available}"));
    std::fs::write(&p, format!("MemTotal: {total} kB\nMemFree: 0 kB\nMemAvailable: {available} kB\n")).unwrap();
    ("MEMRA_SANITIZE_MEMINFO", p.display().to_string())
}

/// Runs the script in `s` with `args` and the fake's `env`; (exit success, stdout). The memory
/// guard reads a host with 100 of 100 GB available unless `env` names another meminfo.
fn run(s: &Scratch, args: &[&str], env: &[(&str, String)]) -> (bool, String) {
    let path = format!("{}:{}", s.0.join("bin").display(), std::env::var("PATH").unwrap_or_default());
    let roomy = meminfo(s, 100 << 20, 100 << 20);
    let mut cmd = Command::new("bash");
    cmd.arg(s.0.join("scripts/gpu-sanitize"))
        .args(["--per-test", "--out"])
        .arg(s.0.join("out"))
        .args(args)
        .env("PATH", path)
        .env_remove("OUT")
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env(roomy.0, roomy.1)
        .env("MEMRA_SANITIZE_UNITS", s.0.join("units"));
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run bash scripts/gpu-sanitize");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    println!("{text}");
    (out.status.success(), text)
}

fn log_file(s: &Scratch, name: &str, text: &str) -> (&'static str, String) {
    let p = s.0.join(name);
    std::fs::write(&p, text).unwrap();
    ("FAKE_LOG", p.display().to_string())
}

#[test]
fn shards_deal_a_digit_named_test_into_exactly_n_processes() {
    let s = scratch("shards");
    let (ok, out) = run(&s, &["--tools", "memcheck", "--shards", "gpu_f32_beta9=3"], &[]);
    assert!(ok, "{out}");
    for i in 0..3 {
        let unit = format!("fake__gpu_f32_beta9__{i}of3");
        assert!(out.contains(&format!("memcheck {unit}: ok")), "{unit} missing:\n{out}");
        let stdout = std::fs::read_to_string(s.0.join(format!("out/memcheck/{unit}.log.stdout"))).unwrap();
        assert!(stdout.contains(&format!("shard={i}/3")) && stdout.contains("gpu_f32_beta9 --exact"), "{stdout}");
        assert!(stdout.contains("sanitizer=memcheck"), "the tests are told which tool runs them:\n{stdout}");
    }
    assert!(out.contains("memcheck fake__gpu_alpha: ok"), "{out}");
    assert!(out.contains("processes per tool: 4"), "{out}");
    let unsharded = std::fs::read_to_string(s.0.join("out/memcheck/fake__gpu_alpha.log.stdout")).unwrap();
    assert!(unsharded.contains("shard=none"), "{unsharded}");

    // N:i+j picks shards: here 0 and 2 of 3.
    let (ok, out) = run(&s, &["--tools", "synccheck", "--shards", "gpu_f32_beta9=3:0+2", "--only", "gpu_f32_beta9"], &[]);
    assert!(ok, "{out}");
    assert!(out.contains("fake__gpu_f32_beta9__0of3: ok") && out.contains("fake__gpu_f32_beta9__2of3: ok"), "{out}");
    assert!(!out.contains("1of3") && out.contains("processes per tool: 2"), "{out}");
}

#[test]
fn nccl_api_return_codes_are_set_apart_and_access_errors_are_not() {
    let s = scratch("nccl");
    let nccl = log_file(&s, "nccl.log", NCCL_CODES);
    let (ok, out) = run(&s, &["--tools", "memcheck", "--exes", "fake"], &[nccl.clone(), ("FAKE_EXIT", "86".into())]);
    assert!(ok, "{out}");
    assert!(out.contains("ok (summary seen; +2 CUDA API return codes raised inside libnccl, not counted)"), "{out}");
    assert!(out.contains("errors: memcheck 0;"), "{out}");

    let access = log_file(&s, "access.log", ACCESS_ERROR);
    let (ok, out) = run(&s, &["--tools", "memcheck"], &[access, ("FAKE_EXIT", "86".into())]);
    assert!(!ok, "a memory-access report must fail the run:\n{out}");
    assert!(out.contains("fake__gpu_alpha: 1 error(s)") && out.contains("errors: memcheck 2;"), "{out}");

    // NCCL codes alone do not hide a failing test behind the sanitizer's exit code.
    let (ok, out) = run(&s, &["--tools", "memcheck"], &[nccl, ("FAKE_EXIT", "86".into()), ("FAKE_TEST_FAIL", "1".into())]);
    assert!(!ok, "{out}");
    assert!(out.contains("fake__gpu_alpha: TEST FAILED") && out.contains("test failures: 2"), "{out}");
}

#[test]
fn a_test_without_a_cuda_call_says_nothing_was_checked() {
    let s = scratch("skip");
    let skipped = log_file(&s, "skip.log", "========= Target application terminated before first instrumented API call\n");
    let (ok, out) = run(&s, &["--tools", "racecheck"], &[skipped]);
    assert!(ok, "{out}");
    assert!(out.contains("racecheck fake__gpu_alpha: NOTHING CHECKED"), "{out}");
}

/// Session 11: the opt-in full-dims GLM-5 test builds its model on the CPU for minutes before
/// its first CUDA call, and the tool gave up waiting ("No attachable process found") while the
/// test ran on unchecked. A pass is ok only with the tool's summary in the log; racecheck's own
/// summary counts its hazards; every unit asks the tool to wait for the first CUDA call.
#[test]
fn a_pass_without_the_sanitizers_summary_is_not_checked() {
    let s = scratch("attach");
    let lost = log_file(
        &s,
        "lost.log",
        "========= COMPUTE-SANITIZER\n========= Error: No attachable process found. compute-sanitizer timed-out.\n========= Default timeout can be adjusted with --launch-timeout. Awaiting target completion.\n",
    );
    let (ok, out) = run(&s, &["--tools", "memcheck", "--only", "gpu_alpha"], &[lost]);
    assert!(!ok, "a run the tool never attached to must fail:\n{out}");
    assert!(out.contains("memcheck fake__gpu_alpha: NOT CHECKED (the sanitizer did not attach"), "{out}");
    assert!(out.contains("test failures: 1"), "{out}");

    let empty = log_file(&s, "empty.log", "========= COMPUTE-SANITIZER\n");
    let (ok, out) = run(&s, &["--tools", "initcheck", "--only", "gpu_alpha"], &[empty]);
    assert!(!ok && out.contains("initcheck fake__gpu_alpha: NOT CHECKED (no sanitizer summary"), "{out}");

    let clean = log_file(&s, "race-clean.log", "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n");
    let (ok, out) = run(&s, &["--tools", "racecheck", "--only", "gpu_alpha"], &[clean]);
    assert!(ok && out.contains("racecheck fake__gpu_alpha: ok (summary seen)"), "{out}");

    let hazards = log_file(&s, "race-warn.log", "========= RACECHECK SUMMARY: 3 hazards displayed (0 errors, 3 warnings)\n");
    let (ok, out) = run(&s, &["--tools", "racecheck", "--only", "gpu_alpha"], &[hazards]);
    assert!(!ok && out.contains("racecheck fake__gpu_alpha: 3 error(s)"), "{out}");

    let args = s.0.join("args.txt");
    let (ok, out) = run(&s, &["--tools", "synccheck", "--only", "gpu_alpha"], &[("FAKE_ARGS", args.display().to_string())]);
    assert!(ok, "{out}");
    let text = std::fs::read_to_string(&args).unwrap();
    assert!(text.contains("--launch-timeout 86400 "), "{text}");
}

#[test]
fn only_runs_the_named_tests() {
    let s = scratch("only");
    let (ok, out) = run(&s, &["--tools", "synccheck", "--only", "gpu_f32_beta9"], &[]);
    assert!(ok, "{out}");
    assert!(out.contains("synccheck fake__gpu_f32_beta9: ok") && !out.contains("gpu_alpha"), "{out}");
    assert!(out.contains("processes per tool: 1"), "{out}");
}

#[test]
fn past_the_deadline_nothing_starts_and_the_run_fails() {
    let s = scratch("deadline");
    let (ok, out) = run(&s, &["--tools", "initcheck", "--jobs", "2", "--deadline", "1"], &[]);
    assert!(!ok, "units that never ran must fail the run:\n{out}");
    assert!(out.contains("initcheck fake__gpu_alpha: NOT STARTED (deadline)"), "{out}");
    assert!(out.contains("test failures: 2"), "{out}");
    assert!(!s.0.join("out/initcheck/fake__gpu_alpha.log.stdout").exists(), "a unit past the deadline ran");
}

#[test]
fn a_unit_killed_by_sigkill_runs_again_once() {
    let s = scratch("retry");
    let marker = ("FAKE_KILL_ONCE", s.0.join("killed-once").display().to_string());
    // Without the option the kill is a failure.
    let (ok, out) = run(&s, &["--tools", "memcheck", "--only", "gpu_alpha"], std::slice::from_ref(&marker));
    assert!(!ok && out.contains("fake__gpu_alpha: TEST FAILED (rc=137"), "{out}");
    std::fs::remove_dir(s.0.join("killed-once")).unwrap();
    let (ok, out) = run(&s, &["--tools", "memcheck", "--jobs", "2", "--retry-killed"], &[marker]);
    assert!(ok, "{out}");
    assert!(out.contains("1 unit(s) were killed (SIGKILL); running them again with 1 job(s)"), "{out}");
    let summary = std::fs::read_to_string(s.0.join("out/summary.txt")).unwrap();
    assert!(summary.contains("memcheck fake__gpu_alpha: ok") && summary.contains("test failures: 0"), "{summary}");
}

#[test]
fn racecheck_gets_a_share_of_the_cores_as_workers() {
    let s = scratch("workers");
    let args = s.0.join("args.txt");
    let env = [("FAKE_ARGS", args.display().to_string())];
    let (ok, out) = run(&s, &["--tools", "racecheck,memcheck", "--jobs", "2", "--only", "gpu_alpha"], &env);
    assert!(ok, "{out}");
    let cores: usize = String::from_utf8(Command::new("nproc").output().unwrap().stdout).unwrap().trim().parse().unwrap();
    let text = std::fs::read_to_string(&args).unwrap();
    let race: Vec<&str> = text.lines().filter(|l| l.contains("--tool racecheck")).collect();
    let mem: Vec<&str> = text.lines().filter(|l| l.contains("--tool memcheck")).collect();
    assert_eq!((race.len(), mem.len()), (1, 1), "{text}");
    assert!(race[0].contains(&format!("--racecheck-num-workers {}", (cores / 2).max(1))), "{text}");
    assert!(!mem[0].contains("racecheck-num-workers"), "{text}");

    std::fs::remove_file(&args).unwrap();
    let (ok, out) = run(&s, &["--tools", "racecheck", "--racecheck-workers", "3", "--only", "gpu_alpha"], &env);
    assert!(ok, "{out}");
    let text = std::fs::read_to_string(&args).unwrap();
    assert!(text.contains("--racecheck-num-workers 3 "), "{text}");

    // --sanitizer-args reach the tool, word by word, ahead of the log file and the test.
    std::fs::remove_file(&args).unwrap();
    let extra = ["--tools", "racecheck", "--only", "gpu_alpha", "--sanitizer-args", "--force-synchronization-limit 1"];
    let (ok, out) = run(&s, &extra, &env);
    assert!(ok, "{out}");
    let text = std::fs::read_to_string(&args).unwrap();
    assert!(text.contains(" --force-synchronization-limit 1 --log-file "), "{text}");
}

/// `--detach` returns at once while the run goes on in its own session (it must outlive the
/// device command that started it); `scripts/sanitize-progress` shows the running unit, then its
/// line, and `--tar` packs the lines, run.log and the tails of units that did not end ok.
#[test]
fn a_detached_run_goes_on_and_progress_packs_it() {
    let s = scratch("detach");
    let progress = |args: &[&str]| {
        let out = Command::new("python3")
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/sanitize-progress"))
            .args(args)
            .env("MEMRA_SANITIZE_UNITS", s.0.join("units"))
            .output()
            .expect("python3 scripts/sanitize-progress");
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
    };
    let wait_for = |what: &dyn Fn() -> bool, secs: u64| {
        let t = std::time::Instant::now();
        while !what() && t.elapsed().as_secs() < secs {
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        what()
    };
    let dir = s.0.join("out");
    let d = dir.display().to_string();
    let t0 = std::time::Instant::now();
    let env = [("FAKE_SLEEP", "3".to_string()), ("FAKE_TEST_FAIL", "1".to_string())];
    let (ok, out) = run(&s, &["--tools", "memcheck", "--only", "gpu_alpha", "--detach"], &env);
    assert!(ok && out.contains("gpu-sanitize: detached"), "{out}");
    assert!(t0.elapsed().as_secs() < 3, "--detach waited for the run: {:?}", t0.elapsed());
    assert!(wait_for(&|| progress(&[&d]).contains("running memcheck fake__gpu_alpha: "), 10), "{}", progress(&[&d]));
    let summary = dir.join("summary.txt");
    let ended = || std::fs::read_to_string(&summary).is_ok_and(|t| t.contains("gpu-sanitize: errors:"));
    assert!(wait_for(&ended, 30), "the detached run did not finish");
    let tar = s.0.join("res.tgz");
    let shown = progress(&["--tar", &tar.display().to_string(), &d]);
    assert!(shown.contains("memcheck fake__gpu_alpha: TEST FAILED") && !shown.contains("running "), "{shown}");
    assert!(shown.contains("gpu-sanitize: errors: memcheck 0; test failures: 1"), "{shown}");
    let listing = Command::new("tar").arg("tzf").arg(&tar).output().unwrap();
    let listing = String::from_utf8_lossy(&listing.stdout);
    for name in ["out/run.log", "out/summary.txt", "out/memcheck/fake__gpu_alpha.log.line", "out/memcheck/fake__gpu_alpha.log.stdout.tail"] {
        assert!(listing.lines().any(|l| l == name), "{name} not in the tar:\n{listing}");
    }
    assert!(progress(&["/nonexistent/dir"]).contains("no such folder: /nonexistent/dir"));
}

/// Past --print-limit the sanitizer adds "ERROR SUMMARY: M errors were not printed": the count is
/// the first line's N, not N + M (session 9's NCCL initcheck log read 49,092 for 24,646). Only
/// initcheck and synccheck leave NCCL's own kernels out, by name.
#[test]
fn errors_past_the_print_limit_count_once_and_nccl_kernels_are_left_out_of_initcheck_and_synccheck() {
    let s = scratch("printlimit");
    let many = log_file(&s, "many.log", "========= ERROR SUMMARY: 300 errors\n========= ERROR SUMMARY: 100 errors were not printed. Use --print-limit option to adjust the number of printed errors\n");
    let args = s.0.join("args.txt");
    let env = [many, ("FAKE_EXIT", "86".into()), ("FAKE_ARGS", args.display().to_string())];
    let (ok, out) = run(&s, &["--tools", "initcheck,synccheck", "--only", "gpu_alpha"], &env);
    assert!(!ok, "{out}");
    assert!(out.contains("initcheck fake__gpu_alpha: 300 error(s)") && out.contains("synccheck fake__gpu_alpha: 300 error(s)"), "{out}");
    let text = std::fs::read_to_string(&args).unwrap();
    let init: Vec<&str> = text.lines().filter(|l| l.contains("--tool initcheck")).collect();
    let sync: Vec<&str> = text.lines().filter(|l| l.contains("--tool synccheck")).collect();
    assert_eq!((init.len(), sync.len()), (1, 1), "{text}");
    assert!(init[0].contains("--kernel-name-exclude kns=ncclDevKernel "), "{text}");
    assert!(sync[0].contains("--kernel-name-exclude kns=ncclDevKernel "), "{text}");

    std::fs::remove_file(&args).unwrap();
    let (ok, out) = run(&s, &["--tools", "memcheck,racecheck", "--only", "gpu_alpha"], &env[2..]);
    assert!(ok, "{out}");
    let text = std::fs::read_to_string(&args).unwrap();
    assert_eq!(text.lines().count(), 2, "{text}");
    assert!(!text.contains("kernel-name-exclude"), "memcheck and racecheck check NCCL's kernels too:\n{text}");
}

/// `scripts/sanitize-verdict` on its own (python3): a pair is clean when an accepted build ran it
/// whole or in every shard of one split; `SHA:EXE` accepts a build for that executable only; an
/// error count at an accepted build fails the verdict; `--todo` prints what is left to run;
/// `--recheck` counts a test's passes only with the tool's summary seen.
#[test]
fn the_verdict_combines_runs_only_where_accepted() {
    let s = scratch("verdict");
    let units = s.0.join("units.txt");
    std::fs::write(&units, "# suite\nexa t1\nexb t2\n").unwrap();
    let old = s.0.join("old.txt");
    let mut text = String::from("# build: aaaaaaa\n");
    for tool in ["memcheck", "racecheck", "initcheck", "synccheck"] {
        text += &format!("{tool} exa__t1: ok; test result: ok. 1 passed; 0 failed; 3s\n");
        text += &format!("{tool} exb__t2: ok; test result: ok. 1 passed; 0 failed; 3s\n");
    }
    std::fs::write(&old, text).unwrap();
    let new = s.0.join("new.txt");
    let mut text = String::from("# build: bbbbbbbcafe\n");
    for tool in ["memcheck", "initcheck", "synccheck"] {
        text += &format!("{tool} exb__t2: ok; 2s\n");
    }
    text += "racecheck exb__t2__0of2: ok; 9s\n";
    std::fs::write(&new, &text).unwrap();
    let verdict = |at: &[&str], files: &[&Path]| {
        let mut cmd = Command::new("python3");
        cmd.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/sanitize-verdict")).arg("--units").arg(&units);
        for a in at {
            // OLD=NEW items are --same, flags go as they are, the rest are --at.
            match a {
                _ if a.starts_with("--") => cmd.arg(a),
                _ => cmd.args([if a.contains('=') { "--same" } else { "--at" }, a]),
            };
        }
        let out = cmd.args(files).output().expect("python3 scripts/sanitize-verdict");
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        println!("{text}");
        (out.status.success(), text)
    };
    // exa's passes at the old build count for exa; exb's racecheck has one shard of two.
    let (ok, out) = verdict(&["bbbbbbb", "aaaaaaa:exa"], &[&old, &new]);
    assert!(!ok && out.contains("not clean at the accepted builds: 1") && out.contains("racecheck exb t2"), "{out}");
    assert!(out.contains("clean at bbbbbbb: 3") && out.contains("clean at aaaaaaa (exa): 4"), "{out}");
    // --todo: the missing shard only; without the old build, exa's four tools whole.
    let (_, out) = verdict(&["--todo", "bbbbbbb", "aaaaaaa:exa"], &[&old, &new]);
    assert!(out.contains("scripts/gpu-sanitize --per-test --tools racecheck --exes exb --only t2 --shards t2=2:1\n"), "{out}");
    assert_eq!(out.matches("scripts/gpu-sanitize").count(), 1, "{out}");
    let (_, out) = verdict(&["--todo", "bbbbbbb"], &[&old, &new]);
    assert!(out.contains("--tools memcheck --exes exa --only t1\n"), "{out}");
    assert!(out.contains("--tools racecheck --exes exa,exb --only t1,t2 --shards t2=2:1\n"), "{out}");
    // The second shard completes the split.
    std::fs::write(&new, text.clone() + "racecheck exb__t2__1of2: ok; 9s\n").unwrap();
    let (ok, out) = verdict(&["bbbbbbb", "aaaaaaa:exa"], &[&old, &new]);
    assert!(ok && out.contains("sanitize-verdict: CLEAN"), "{out}");
    // Without the old build, exa was never run.
    let (ok, out) = verdict(&["bbbbbbb"], &[&old, &new]);
    assert!(!ok && out.contains("memcheck exa t1 (never run)"), "{out}");
    // An error count at an accepted build fails even where another line passed.
    std::fs::write(&new, text + "racecheck exb__t2__1of2: ok; 9s\nmemcheck exb__t2: 2 error(s); 5s\n").unwrap();
    let (ok, out) = verdict(&["bbbbbbb", "aaaaaaa:exa"], &[&old, &new]);
    assert!(!ok && out.contains("lines reporting errors at an accepted build: 1"), "{out}");

    // Shards from two builds combine only where --same says their sources are identical.
    let mut text = String::from("# build: ccccccc\n");
    for tool in ["memcheck", "initcheck", "synccheck"] {
        text += &format!("{tool} exb__t2: ok; 2s\n");
    }
    text += "racecheck exb__t2__0of2: ok; 9s\n# build: ddddddd\nracecheck exb__t2__1of2: ok; 9s\n";
    std::fs::write(&new, &text).unwrap();
    let (ok, out) = verdict(&["ddddddd", "ccccccc", "aaaaaaa:exa"], &[&old, &new]);
    assert!(!ok && out.contains("racecheck exb t2"), "{out}");
    let (ok, out) = verdict(&["ddddddd", "aaaaaaa:exa", "ccccccc=ddddddd:exb"], &[&old, &new]);
    assert!(ok && out.contains("clean at ddddddd: 4"), "{out}");
    let (ok, _) = verdict(&["ddddddd", "aaaaaaa:exa", "ccccccc=ddddddd:exa"], &[&old, &new]);
    assert!(!ok, "--same for another executable must not combine exb's shards");

    // A test that skipped itself checked nothing: listed, and the verdict is not clean.
    std::fs::write(&new, text.replace("memcheck exb__t2: ok; 2s", "memcheck exb__t2: NOTHING CHECKED: the test made no CUDA call (skipped itself); 1s")).unwrap();
    let (ok, out) = verdict(&["ddddddd", "aaaaaaa:exa", "ccccccc=ddddddd"], &[&old, &new]);
    assert!(!ok && out.contains("skipped themselves (no CUDA call: a model file or opt-in absent): 1"), "{out}");

    // --recheck: a test's passes count only with the tool's summary seen.
    std::fs::write(&new, &text).unwrap();
    let (ok, out) = verdict(&["ddddddd", "aaaaaaa:exa", "ccccccc=ddddddd:exb", "--recheck=t1"], &[&old, &new]);
    assert!(!ok && out.contains("not clean at the accepted builds: 4"), "{out}");
    assert!(out.contains("memcheck exa t1 (aaaaaaa: UNPROVEN ok)"), "{out}");
    std::fs::write(&new, text.clone() + "# build: aaaaaaa\nmemcheck exa__t1: ok (summary seen); 3s\n").unwrap();
    let (ok, out) = verdict(&["ddddddd", "aaaaaaa:exa", "ccccccc=ddddddd:exb", "--recheck=t1"], &[&old, &new]);
    assert!(!ok && out.contains("not clean at the accepted builds: 3") && !out.contains("memcheck exa t1"), "{out}");
}

/// The memory guard: a unit over `--max-rss-gb` is killed (its whole session: the fake test's
/// python child too) and said to be, the run fails, and `--retry-killed` would run it again;
/// when the host's available memory is under `--min-free-gb` the largest running unit goes first.
/// Every unit the guard sampled reports its peak.
#[test]
fn the_memory_guard_kills_a_unit_that_grows_and_says_why() {
    let s = scratch("guard");
    let hold = ("FAKE_HOLD_MB", "120".to_string());
    let t0 = std::time::Instant::now();
    let (ok, out) = run(&s, &["--tools", "racecheck", "--only", "gpu_alpha", "--max-rss-gb", "0.05"], std::slice::from_ref(&hold));
    assert!(!ok, "{out}");
    assert!(out.contains("racecheck fake__gpu_alpha: KILLED (host memory: held 0.1 GB, over --max-rss-gb 0.05)"), "{out}");
    assert!(out.contains("; peak host memory 0.1 GB") && out.contains("test failures: 1"), "{out}");
    assert!(t0.elapsed().as_secs() < 40, "the unit ran its whole minute: {:?}", t0.elapsed());
    assert!(s.0.join("out/racecheck/fake__gpu_alpha.log.killed").exists(), "a guard kill is a --retry-killed candidate");

    // Under the floor (1 MB of 1 GB available, floor 0.5 GB): both units, the larger first.
    let low = meminfo(&s, 1 << 20, 1 << 10);
    let (ok, out) = run(&s, &["--tools", "memcheck", "--jobs", "2", "--min-free-gb", "0.5"], &[low, hold]);
    assert!(!ok, "{out}");
    for unit in ["fake__gpu_alpha", "fake__gpu_f32_beta9"] {
        assert!(out.contains(&format!("memcheck {unit}: KILLED (host memory: held ")), "{unit}:\n{out}");
    }
    assert!(out.contains("when the host had 0.0 GB available, under --min-free-gb 0.5"), "{out}");

    // A unit in its own session still times out (timeout leads the session).
    let (ok, out) = run(&s, &["--tools", "memcheck", "--only", "gpu_alpha", "--timeout", "2"], &[("FAKE_HOLD_MB", "1".into())]);
    assert!(!ok && out.contains("memcheck fake__gpu_alpha: TIMEOUT after 2s"), "{out}");

    // One guard per machine: a unit that another invocation listed in the shared folder (here a
    // `sleep` in its own session, capped at 1 kB) is weighed and killed by this run's guard.
    let mut foreign = Command::new("setsid").args(["sleep", "30"]).spawn().expect("setsid sleep");
    let foreign_log = s.0.join("foreign.log");
    std::fs::create_dir_all(s.0.join("units")).unwrap();
    std::fs::write(s.0.join("units/1.999"), format!("{} {} 1 0.000001\n", foreign.id(), foreign_log.display())).unwrap();
    let (ok, out) = run(&s, &["--tools", "memcheck", "--only", "gpu_alpha", "--timeout", "3"], &[("FAKE_HOLD_MB", "1".into())]);
    assert!(!ok && out.contains("TIMEOUT after 3s"), "{out}");
    let status = foreign.wait().unwrap();
    assert!(status.code().is_none(), "the other invocation's unit was not killed: {status:?}");
    let why = std::fs::read_to_string(s.0.join("foreign.log.memkill")).unwrap();
    assert!(why.contains("over --max-rss-gb 0.000001"), "{why}");

    // Room to spare: nothing is killed and the default floor is a tenth of the host.
    let (ok, out) = run(&s, &["--tools", "memcheck", "--only", "gpu_alpha"], &[]);
    assert!(ok && out.contains("under 10.0 GB available"), "{out}");
    let (ok, out) = run(&s, &["--tools", "memcheck", "--min-free-gb", "lots"], &[]);
    assert!(!ok && out.contains("take a number of GB, not 'lots'"), "{out}");
}
