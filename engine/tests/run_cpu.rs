//! `memra run` end to end: the binary with `--cpu` on the real Gemma 3 270M file generates a
//! few greedy tokens, streams them after the prompt and reports tokens/s; without `--cpu` it runs on
//! the GPU or, with no GPU, says why; with a bad file or bad settings it fails with a clear
//! message and no panic.
//! Needs the model (`MEMRA_GEMMA3_GGUF`, else the memra cache) for the generation check; prints
//! "SKIP: ..." without it.

use std::path::PathBuf;
use std::process::{Command, Output};

fn model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("MEMRA_GEMMA3_GGUF") {
        return PathBuf::from(p);
    }
    let cache = std::env::var_os("MEMRA_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/memra")
        });
    cache.join("models/gemma-3-270m-q4_k_m.gguf")
}

fn memra(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memra"))
        .args(args)
        .output()
        .expect("spawn memra")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn run_cpu_generates_greedy_text() {
    let path = model_path();
    if !path.exists() {
        println!(
            "SKIP: {} not found (set MEMRA_GEMMA3_GGUF or run scripts/fetch-gemma3-270m)",
            path.display()
        );
        return;
    }
    let prompt = "Water boils at a temperature of";
    let model = path.to_str().expect("UTF-8 model path");
    let out = memra(&[
        "run", model, "-p", prompt, "-n", "6", "--cpu", "--temp", "0",
    ]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    eprintln!("stdout: {stdout:?}\nstderr: {stderr}");
    assert!(out.status.success(), "memra run failed: {stderr}");
    let generated = stdout
        .strip_prefix(prompt)
        .unwrap_or_else(|| panic!("stdout does not start with the prompt: {stdout:?}"));
    assert!(
        generated.starts_with(" 100 degrees"),
        "generated {generated:?}"
    );
    assert!(
        stderr.contains("loading"),
        "no progress line while loading: {stderr}"
    );
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.contains("prefill")
            && last.contains("decode")
            && last.matches("tokens/s").count() == 2,
        "last stderr line should give prefill and decode tokens/s: {last:?}"
    );
}

#[test]
fn run_on_the_gpu_generates_or_says_why_not() {
    // With a GPU this generates greedily on the GPU forward; without one (CI) it must fail with
    // a message naming the CUDA library it looked for, never a panic.
    let path = model_path();
    if !path.exists() {
        println!("SKIP: {} not found", path.display());
        return;
    }
    let p = path.to_str().unwrap();
    let out = memra(&["run", p, "-p", "Water boils at a temperature of", "-n", "4", "--temp", "0", "--ctx", "256"]);
    let stderr = text(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    if out.status.success() {
        assert!(text(&out.stdout).starts_with("Water boils at a temperature of 100"), "{}", text(&out.stdout));
        assert!(stderr.contains("tokens/s") && stderr.contains("kernels:"), "{stderr}");
    } else {
        assert!(stderr.contains("libcuda") || stderr.contains("CUDA"), "{stderr}");
    }
}

#[test]
fn run_errors_name_the_file_and_setting() {
    let out = memra(&["run", "/nonexistent/model.gguf", "-p", "hi", "--cpu"]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("/nonexistent/model.gguf"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    let out = memra(&[
        "run",
        "/nonexistent/model.gguf",
        "-p",
        "hi",
        "--cpu",
        "--top-p",
        "2",
    ]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("top-p"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn run_without_a_model_runs_the_embedded_default_and_says_so() {
    let out = memra(&["run", "-n", "3", "--temp", "0", "--cpu", "-p", "Hello"]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("embedded default") && stderr.contains("random weights"), "{stderr}");
    assert!(text(&out.stdout).starts_with("Hello"), "{}", text(&out.stdout));
    assert!(stderr.lines().last().unwrap_or_default().contains("tokens/s"), "{stderr}");
}

#[test]
fn ctrl_c_stops_generation_cleanly() {
    let child = Command::new(env!("CARGO_BIN_EXE_memra"))
        // --ignore-eos: a micro model with random weights may sample an end token within 1.5 s.
        .args(["run", "--cpu", "--ignore-eos", "-n", "1000000", "-p", "Hello"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn memra");
    // Wait until generation has started (the prefill line is printed before the first token).
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let status = Command::new("kill").args(["-INT", &child.id().to_string()]).status().expect("kill");
    assert!(status.success());
    let out = child.wait_with_output().expect("wait");
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "exit {:?}: {stderr}", out.status);
    assert!(stderr.contains("interrupted (Ctrl-C)") && stderr.contains("tokens/s"), "{stderr}");
}

/// `--ignore-eos` generates exactly `-n` tokens, end tokens or not (within the context).
#[test]
fn ignore_eos_generates_n_tokens() {
    let out = memra(&["run", "--cpu", "--ignore-eos", "-n", "200", "--ctx", "256", "-p", "Hello"]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.lines().last().unwrap_or_default().ends_with("; 200 generated"), "{stderr}");
}

/// `--ctx` is the context on both paths: under 2 or over the model's context it is refused before
/// any load; on the CPU it bounds the prompt and the generation (the embedded default model).
#[test]
fn ctx_is_checked_and_bounds_the_cpu_generation() {
    for (ctx, want) in [("1", "at least 2 positions"), ("0", "at least 2 positions"), ("100000000", "is more than the model's context of")] {
        let out = memra(&["run", "--cpu", "-n", "3", "--ctx", ctx, "-p", "Hello"]);
        let stderr = text(&out.stderr);
        assert!(!out.status.success() && stderr.contains(&format!("--ctx {ctx}")) && stderr.contains(want), "--ctx {ctx}: {stderr}");
        assert!(!stderr.contains("panicked") && !stderr.contains("loading"), "refused before the load: {stderr}");
    }
    let out = memra(&["run", "--cpu", "-n", "50", "--temp", "0", "--ctx", "6", "-p", "Hello"]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    let number_before = |word: &str| -> usize {
        let at = last.find(word).unwrap_or_else(|| panic!("no '{word}' in {last:?}"));
        last[..at].split_whitespace().last().and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{last:?}"))
    };
    let (prompt, generated) = (number_before(" tokens in"), number_before(" generated"));
    // The last token is sampled from the logits of a full cache: it needs no position of its own.
    assert!(prompt < 6 && generated == 6 - prompt + 1, "--ctx 6: {last}");

    let long = "Hello world, again and again and again and again";
    let out = memra(&["run", "--cpu", "-n", "3", "--ctx", "3", "-p", long]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success() && stderr.contains("the context holds 3"), "{stderr}");
}
