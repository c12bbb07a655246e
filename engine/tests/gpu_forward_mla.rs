//! The MLA GPU forwards (glm-dsa, deepseek2) against the CPU reference forward, under DESIGN.md's
//! logit verdict (argmax flips only on a near-tie ≤ 1.0, full-vocab max diff ≤ 8.0), on the micro
//! models (fixture::micro_model: one dense and two MoE layers, random weights in the preset's
//! types; glm-dsa: q LoRA, the DSA indexer on every layer, top_k 4, sigmoid router with the
//! selection bias; deepseek2: direct attn_q, YaRN RoPE with mscale, softmax router):
//! - prefill, 12 decode steps and GPU prefill vs GPU token-by-token decode, under each kernel
//!   policy, with and without CUDA graphs (the 20-token prompt is past top_k: sparse attention);
//! - glm-dsa with top_k 64: dense attention below 64 visible keys, then the sparse path from the
//!   65th on (graph re-capture at the switch), every step vs the CPU; a long prompt crossing
//!   attention split-count changes;
//! - `memra run` on the embedded micro model of this build, on the GPU.
//!
//! Each test needs a CUDA GPU and is ignored otherwise.

use std::path::{Path, PathBuf};
use std::process::Command;

use memra_codegen::fixture;
use memra_codegen::spec::ArchSpec;
use memra_engine::kernels::registry::Policy;
use memra_engine::models::{self, GpuModel, GpuOptions};
use memra_gguf::Gguf;
use memra_reference::compare::logit_verdict;
use memra_reference::models::{Deepseek2, Deepseek2Cache, GlmDsa, GlmDsaCache};
use memra_reference::Rng;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The micro model of `arch` written to a temp file.
fn micro(arch: &str, seed: u64) -> PathBuf {
    let spec = ArchSpec::load(&root().join(format!("specs/{arch}.toml")))
        .unwrap_or_else(|e| panic!("{e}"));
    let bytes = fixture::micro_model(&spec, seed).unwrap_or_else(|e| panic!("{e}"));
    let path = std::env::temp_dir().join(format!(
        "memra-micro-{arch}-{seed}-{}.gguf",
        std::process::id()
    ));
    std::fs::write(&path, bytes).unwrap();
    path
}

/// A copy of the GGUF at `path` with metadata `key` set to `value` (written beside it).
fn with_u32(path: &Path, key: &str, value: u32) -> PathBuf {
    let file = Gguf::parse(std::fs::read(path).unwrap()).unwrap();
    let mut w = memra_gguf::GgufWriter::new();
    for (k, v) in file.metadata() {
        if k == key {
            w.add_meta(k, value);
        } else {
            w.add_meta(k, v);
        }
    }
    for t in file.tensors().iter() {
        w.add_tensor_bytes(
            t.name,
            t.dims.as_slice(),
            t.ggml_type,
            file.tensor_data(t).to_vec(),
        )
        .unwrap();
    }
    let out = path.with_extension(format!("{key}-{value}.gguf"));
    std::fs::write(&out, w.to_bytes().unwrap()).unwrap();
    out
}

enum Cpu {
    GlmDsa(GlmDsa, GlmDsaCache),
    Deepseek2(Deepseek2, Deepseek2Cache),
}

impl Cpu {
    fn load(arch: &str, path: &Path) -> Cpu {
        let file = Gguf::parse(std::fs::read(path).unwrap()).unwrap();
        match arch {
            "glm-dsa" => {
                let m = GlmDsa::from_gguf(&file).unwrap();
                let c = m.new_cache();
                Cpu::GlmDsa(m, c)
            }
            "deepseek2" => {
                let m = Deepseek2::from_gguf(&file).unwrap();
                let c = m.new_cache();
                Cpu::Deepseek2(m, c)
            }
            other => panic!("no CPU forward wired for {other}"),
        }
    }

    fn forward(&mut self, tokens: &[u32]) -> Vec<f32> {
        match self {
            Cpu::GlmDsa(m, c) => m.forward(c, tokens, false).unwrap(),
            Cpu::Deepseek2(m, c) => m.forward(c, tokens, false).unwrap(),
        }
    }

    fn reset(&mut self) {
        match self {
            Cpu::GlmDsa(m, c) => *c = m.new_cache(),
            Cpu::Deepseek2(m, c) => *c = m.new_cache(),
        }
    }
}

fn load(arch: &str, path: &Path, policy: Policy, graphs: bool) -> Box<dyn GpuModel> {
    // `graphs` also stands for the fused dense / shared-expert FFN of decode steps, so both paths
    // are compared with the CPU.
    let opts = GpuOptions {
        policy,
        graphs,
        fuse_ffn: graphs,
        max_ctx: Some(1024),
        ..GpuOptions::default()
    };
    let m = models::load_gpu(path, arch, &opts).unwrap_or_else(|e| panic!("{e}"));
    for line in m.report() {
        println!("{line}");
    }
    m
}

fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// GPU vs CPU: prefill, decode steps, and GPU prefill vs GPU token-by-token decode, under each
/// kernel policy, with and without CUDA graphs.
fn micro_matches_the_cpu_reference(arch: &str) {
    let mut rng = Rng::from_env_or_time(&format!("gpu_{arch}_micro"));
    let seed = rng.seed();
    let path = micro(arch, seed);
    let mut cpu = Cpu::load(arch, &path);
    let prompt: Vec<u32> = (0..20)
        .map(|_| rng.below(fixture::MICRO_N_VOCAB) as u32)
        .collect();
    let steps = 12;
    for (policy, graphs) in [
        (Policy::Best, true),
        (Policy::GenericOnly, false),
        (Policy::Best, false),
        (Policy::GenericOnly, true),
    ] {
        let what = format!("{arch} seed {seed}, {policy:?}, graphs {graphs}");
        let mut gpu = load(arch, &path, policy, graphs);
        cpu.reset();
        let want = cpu.forward(&prompt);
        gpu.forward(&prompt).unwrap();
        logit_verdict(
            &want,
            &gpu.logits().unwrap(),
            &format!("{what}: prefill of {}", prompt.len()),
        )
        .unwrap();
        assert_eq!(
            gpu.argmax().unwrap() as usize,
            argmax(&gpu.logits().unwrap()),
            "{what}: device argmax vs host argmax"
        );
        let mut seq = prompt.clone();
        let mut next = argmax(&want) as u32;
        for step in 0..steps {
            seq.push(next);
            let want = cpu.forward(&[next]);
            gpu.forward(&[next]).unwrap();
            logit_verdict(
                &want,
                &gpu.logits().unwrap(),
                &format!("{what}: decode step {step} (position {})", seq.len() - 1),
            )
            .unwrap();
            next = argmax(&want) as u32;
        }
        assert_eq!(gpu.len(), seq.len());
        let batched = {
            let mut g = load(arch, &path, policy, graphs);
            g.forward(&seq).unwrap();
            g.logits().unwrap()
        };
        gpu.reset();
        for &tok in &seq {
            gpu.forward(&[tok]).unwrap();
        }
        logit_verdict(
            &batched,
            &gpu.logits().unwrap(),
            &format!(
                "{what}: GPU prefill vs token-by-token decode of {}",
                seq.len()
            ),
        )
        .unwrap();
        println!("{what}: prefill, {steps} decode steps and prefill-vs-decode pass");
    }
    let _ = std::fs::remove_file(&path);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_glm_dsa_micro_matches_the_cpu_reference() {
    micro_matches_the_cpu_reference("glm-dsa");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_deepseek2_micro_matches_the_cpu_reference() {
    micro_matches_the_cpu_reference("deepseek2");
}

/// glm-dsa with top_k 64: the decode steps from position 40 to 100 run dense attention (≤ 64
/// visible keys, where the DSA selection is every key) then the indexer + sparse path; both
/// graph settings; then a 600-token prompt (split-count changes) and 16 steps.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_glm_dsa_micro_dense_then_sparse_and_long_context() {
    let mut rng = Rng::from_env_or_time("gpu_glm_dsa_micro_top_k");
    let seed = rng.seed();
    let base = micro("glm-dsa", seed);
    let path = with_u32(&base, "glm-dsa.attention.indexer.top_k", 64);
    let mut cpu = Cpu::load("glm-dsa", &path);
    for graphs in [true, false] {
        let what = format!("glm-dsa top_k 64 seed {seed}, graphs {graphs}");
        let mut gpu = load("glm-dsa", &path, Policy::Best, graphs);
        cpu.reset();
        let prompt: Vec<u32> = (0..40)
            .map(|_| rng.below(fixture::MICRO_N_VOCAB) as u32)
            .collect();
        let want = cpu.forward(&prompt);
        gpu.forward(&prompt).unwrap();
        logit_verdict(
            &want,
            &gpu.logits().unwrap(),
            &format!("{what}: prefill of 40"),
        )
        .unwrap();
        let mut next = argmax(&want) as u32;
        for step in 0..60 {
            let want = cpu.forward(&[next]);
            gpu.forward(&[next]).unwrap();
            let at = 40 + step;
            let path = if at + 1 > 64 { "sparse" } else { "dense" };
            logit_verdict(
                &want,
                &gpu.logits().unwrap(),
                &format!("{what}: decode step {step} (position {at}, {path})"),
            )
            .unwrap();
            next = argmax(&want) as u32;
        }
        println!("{what}: dense decode up to 64 keys and sparse after pass");
    }
    let mut gpu = load("glm-dsa", &path, Policy::Best, true);
    cpu.reset();
    let prompt: Vec<u32> = (0..600)
        .map(|_| rng.below(fixture::MICRO_N_VOCAB) as u32)
        .collect();
    let want = cpu.forward(&prompt);
    gpu.forward(&prompt).unwrap();
    logit_verdict(
        &want,
        &gpu.logits().unwrap(),
        &format!("seed {seed}: prefill of 600 (top_k 64)"),
    )
    .unwrap();
    let mut next = argmax(&want) as u32;
    for step in 0..16 {
        let want = cpu.forward(&[next]);
        gpu.forward(&[next]).unwrap();
        logit_verdict(
            &want,
            &gpu.logits().unwrap(),
            &format!("seed {seed}: decode step {step} at {}", 600 + step),
        )
        .unwrap();
        next = argmax(&want) as u32;
    }
    let err = gpu
        .forward(&[fixture::MICRO_N_VOCAB as u32])
        .unwrap_err()
        .to_string();
    assert!(err.contains("out of range"), "{err}");
    println!("seed {seed}: 600-token prefill and 16 decode steps pass");
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(&base);
}

/// `memra run` with no model file runs this build's embedded micro model on the GPU (greedy)
/// and, with `--cpu`, on the CPU reference: both succeed and print the prompt and new text.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_memra_run_embedded_micro_model() {
    let prompt = "The capital of France is";
    let run = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_memra"))
            .args(["run", "-p", prompt, "-n", "8", "--temp", "0"])
            .args(extra)
            .output()
            .expect("spawn memra");
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        );
        println!("memra run {extra:?}: stdout {stdout:?}\nstderr: {stderr}");
        assert!(out.status.success(), "memra run {extra:?} failed: {stderr}");
        assert!(
            stdout.starts_with(prompt) && stdout.len() > prompt.len(),
            "memra run {extra:?}: no text after the prompt: {stdout:?}"
        );
        stdout
    };
    let gpu = run(&[]);
    let cpu = run(&["--cpu"]);
    if gpu != cpu {
        // Allowed on a near-tie of the random micro weights; the verdict tests above bound it.
        println!("GPU and CPU greedy texts differ: {gpu:?} vs {cpu:?}");
    }
}

/// One glm-dsa MoE layer at GLM-5's real per-layer dims (n_embd 6144, 64 MLA heads of 192 + 64,
/// latent 512, q LoRA 2048, indexer 32 × 128, experts 6144 → 2048 in Q4_K, Q8_0 elsewhere; 4
/// experts, 2 used, a 512-token vocabulary and top_k 256 to keep the file and the CPU reference
/// small): the build's specialized variants (`--features memra-engine/model-glm-dsa`; all but
/// dsa_topk's k = 2048, which gpu_dsa covers) against the CPU reference over a 300-token prompt
/// and 8 decode steps past top_k (the indexer + sparse path), with graphs.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_glm_dsa_glm5_layer_dims_past_top_k() {
    use memra_codegen::dims;
    use memra_codegen::spec::Value;
    let mut rng = Rng::from_env_or_time("gpu_glm_dsa_glm5_layer");
    let seed = rng.seed();
    let spec = ArchSpec::load(&root().join("specs/glm-dsa.toml")).unwrap_or_else(|e| panic!("{e}"));
    let overrides = [
        ("block_count", Value::Int(1)),
        ("nextn_predict_layers", Value::Int(0)),
        ("leading_dense_block_count", Value::Int(0)),
        ("n_expert", Value::Int(4)),
        ("indexer_top_k", Value::Int(256)),
        ("n_expert_used", Value::Int(2)),
        ("n_vocab", Value::Int(fixture::MICRO_N_VOCAB as i64)),
    ];
    let d = dims::from_preset_with(&spec, None, &overrides).unwrap_or_else(|e| panic!("{e}"));
    let started = std::time::Instant::now();
    let bytes = fixture::model_from_dims(&spec, d, seed).unwrap_or_else(|e| panic!("{e}"));
    let path = std::env::temp_dir().join(format!(
        "memra-glm5-layer-{seed}-{}.gguf",
        std::process::id()
    ));
    std::fs::write(&path, bytes).unwrap();
    println!(
        "seed {seed}: GLM-5-dims layer file written in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let mut cpu = Cpu::load("glm-dsa", &path);
    let opts = GpuOptions {
        policy: Policy::Best,
        graphs: true,
        max_ctx: Some(4096),
        ..GpuOptions::default()
    };
    let mut gpu = models::load_gpu(&path, "glm-dsa", &opts).unwrap_or_else(|e| panic!("{e}"));
    for line in gpu.report() {
        println!("{line}");
    }
    let prompt: Vec<u32> = (0..300)
        .map(|_| rng.below(fixture::MICRO_N_VOCAB) as u32)
        .collect();
    let t = std::time::Instant::now();
    let want = cpu.forward(&prompt);
    println!("CPU prefill of 300: {:.1} s", t.elapsed().as_secs_f64());
    gpu.forward(&prompt).unwrap();
    logit_verdict(
        &want,
        &gpu.logits().unwrap(),
        &format!("seed {seed}: GLM-5-dims prefill of 300"),
    )
    .unwrap();
    let mut next = argmax(&want) as u32;
    for step in 0..8 {
        let want = cpu.forward(&[next]);
        gpu.forward(&[next]).unwrap();
        logit_verdict(
            &want,
            &gpu.logits().unwrap(),
            &format!(
                "seed {seed}: GLM-5-dims decode step {step} at {}",
                300 + step
            ),
        )
        .unwrap();
        next = argmax(&want) as u32;
    }
    println!("seed {seed}: GLM-5-dims layer: 300-token prefill and 8 sparse decode steps (top_k 256) pass");
    let _ = std::fs::remove_file(&path);
}

/// Issue #5's acceptance shape: glm-dsa at GLM-5's full per-layer dims — a dense layer then a
/// MoE layer with all 256 Q4_K experts, top-8 sigmoid routing with the selection bias, the
/// indexer with top_k 2048 — over a 2100-token prompt and 4 decode steps (the sparse path with
/// k = 2048 really selecting), GPU (this build's specialized variants, graphs) vs the CPU
/// reference under the verdict; prints the time of each phase. Heavy: a ~6 GB file, ~45 GB of
/// f32 weights on the host, minutes of CPU reference; run alone with MEMRA_GPU_FULL_GLM5=1
/// (SKIP line otherwise).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_glm_dsa_glm5_full_experts_past_2048() {
    use memra_codegen::dims;
    use memra_codegen::spec::Value;
    use std::time::Instant;
    if std::env::var_os("MEMRA_GPU_FULL_GLM5").is_none_or(|v| v != "1") {
        println!(
            "SKIP: set MEMRA_GPU_FULL_GLM5=1 to run (GLM-5 full dims, ~45 GB host RAM, minutes)"
        );
        return;
    }
    let mut rng = Rng::from_env_or_time("gpu_glm_dsa_glm5_full");
    let seed = rng.seed();
    let spec = ArchSpec::load(&root().join("specs/glm-dsa.toml")).unwrap_or_else(|e| panic!("{e}"));
    let overrides = [
        ("block_count", Value::Int(2)),
        ("nextn_predict_layers", Value::Int(0)),
        ("leading_dense_block_count", Value::Int(1)),
        ("n_vocab", Value::Int(fixture::MICRO_N_VOCAB as i64)),
    ];
    let d = dims::from_preset_with(&spec, None, &overrides).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (
            d.int("n_expert"),
            d.int("n_expert_used"),
            d.int("indexer_top_k")
        ),
        (Some(256), Some(8), Some(2048))
    );
    let phase = Instant::now();
    let bytes = fixture::model_from_dims(&spec, d, seed).unwrap_or_else(|e| panic!("{e}"));
    let path = std::env::temp_dir().join(format!(
        "memra-glm5-full-{seed}-{}.gguf",
        std::process::id()
    ));
    std::fs::write(&path, &bytes).unwrap();
    drop(bytes);
    println!(
        "seed {seed}: file written in {:.1} s",
        phase.elapsed().as_secs_f64()
    );
    let phase = Instant::now();
    let mut cpu = Cpu::load("glm-dsa", &path);
    println!(
        "CPU reference loaded in {:.1} s",
        phase.elapsed().as_secs_f64()
    );
    let phase = Instant::now();
    let opts = GpuOptions {
        policy: Policy::Best,
        graphs: true,
        max_ctx: Some(4096),
        ..GpuOptions::default()
    };
    let mut gpu = models::load_gpu(&path, "glm-dsa", &opts).unwrap_or_else(|e| panic!("{e}"));
    for line in gpu.report() {
        println!("{line}");
    }
    println!("GPU model loaded in {:.1} s", phase.elapsed().as_secs_f64());
    let prompt: Vec<u32> = (0..2100)
        .map(|_| rng.below(fixture::MICRO_N_VOCAB) as u32)
        .collect();
    let phase = Instant::now();
    let want = cpu.forward(&prompt);
    println!(
        "CPU prefill of 2100: {:.1} s",
        phase.elapsed().as_secs_f64()
    );
    let phase = Instant::now();
    gpu.forward(&prompt).unwrap();
    let got = gpu.logits().unwrap();
    println!(
        "GPU prefill of 2100: {:.2} s",
        phase.elapsed().as_secs_f64()
    );
    logit_verdict(
        &want,
        &got,
        &format!("seed {seed}: GLM-5 full dims, prefill of 2100"),
    )
    .unwrap();
    let mut next = argmax(&want) as u32;
    for step in 0..4 {
        let phase = Instant::now();
        let want = cpu.forward(&[next]);
        let cpu_s = phase.elapsed().as_secs_f64();
        let phase = Instant::now();
        gpu.forward(&[next]).unwrap();
        let got = gpu.logits().unwrap();
        println!(
            "decode step {step} at {}: CPU {cpu_s:.2} s, GPU {:.4} s",
            2100 + step,
            phase.elapsed().as_secs_f64()
        );
        logit_verdict(
            &want,
            &got,
            &format!(
                "seed {seed}: GLM-5 full dims, decode step {step} at {}",
                2100 + step
            ),
        )
        .unwrap();
        next = argmax(&want) as u32;
    }
    println!("seed {seed}: GLM-5 full dims (256 experts, top_k 2048): 2100-token prefill and 4 sparse decode steps pass");
    let _ = std::fs::remove_file(&path);
}
