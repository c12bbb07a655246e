//! Shared by the whole-model GPU tests (`gpu_forward.rs`, `gpu_forward_mla.rs`; included with
//! `#[path]`): micro model files, the CPU reference forward, and the GPU-vs-CPU loops under
//! DESIGN.md's logit verdict (argmax flips only on a near-tie ≤ 1.0, full-vocab max diff ≤ 8.0).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Instant;

use memra_codegen::fixture;
use memra_codegen::spec::ArchSpec;
use memra_engine::kernels::registry::Policy;
use memra_engine::models::{self, GpuModel, GpuOptions};
use memra_gguf::Gguf;
use memra_reference::compare::logit_verdict;
use memra_reference::models::{CpuCache, CpuModel};
use memra_reference::Rng;

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The micro model of `arch` (fixture::micro_model: every layer kind, random weights in the
/// preset's types, a small vocabulary) written to a temp file.
pub fn micro(arch: &str, seed: u64) -> PathBuf {
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
pub fn with_u32(path: &Path, key: &str, value: u32) -> PathBuf {
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

pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// The CPU reference forward of a model file, with its cache.
pub struct Cpu {
    model: CpuModel,
    cache: CpuCache,
}

impl Cpu {
    /// Loads `path`, which must be an `arch` file.
    pub fn load(arch: &str, path: &Path) -> Cpu {
        let file = Gguf::parse(std::fs::read(path).unwrap()).unwrap();
        let model = CpuModel::from_gguf(&file).unwrap();
        assert_eq!(model.arch(), arch, "{}: not an {arch} file", path.display());
        let cache = model.new_cache();
        Cpu { model, cache }
    }

    pub fn forward(&mut self, tokens: &[u32]) -> Vec<f32> {
        self.model.forward(&mut self.cache, tokens, false).unwrap()
    }

    pub fn reset(&mut self) {
        self.cache = self.model.new_cache();
    }
}

/// The GPU forward of `path` with a cache of `max_ctx` positions, its load report printed.
/// `graphs` also stands for the other fast paths (the fused dense / shared-expert FFN of decode
/// steps): without graphs, no fused FFN either, so both decode paths are compared with the CPU.
pub fn load_ctx(
    arch: &str,
    path: &Path,
    policy: Policy,
    graphs: bool,
    max_ctx: usize,
) -> Box<dyn GpuModel> {
    let opts = GpuOptions {
        policy,
        graphs,
        fuse_ffn: graphs,
        // Fused launches go with graphs, so every setting list covers fused and unfused steps.
        fuse_norm: graphs,
        fuse_rope: graphs,
        max_ctx: Some(max_ctx),
        ..GpuOptions::default()
    };
    let m = models::load_gpu(path, arch, &opts).unwrap_or_else(|e| panic!("{e}"));
    for line in m.report() {
        println!("{line}");
    }
    m
}

/// [`load_ctx`] with 1024 positions.
pub fn load(arch: &str, path: &Path, policy: Policy, graphs: bool) -> Box<dyn GpuModel> {
    load_ctx(arch, path, policy, graphs, 1024)
}

/// Runs `prompt` on both forwards and checks the GPU's last logits against the CPU's under the
/// verdict (`what`); returns the CPU's logits. `timed` prints each side's time.
pub fn check_prefill(
    cpu: &mut Cpu,
    gpu: &mut dyn GpuModel,
    prompt: &[u32],
    what: &str,
    timed: bool,
) -> Vec<f32> {
    let t = Instant::now();
    let want = cpu.forward(prompt);
    let cpu_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    gpu.forward(prompt).unwrap();
    let got = gpu.logits().unwrap();
    if timed {
        println!(
            "prefill of {}: CPU {cpu_s:.1} s, GPU {:.2} s",
            prompt.len(),
            t.elapsed().as_secs_f64()
        );
    }
    logit_verdict(&want, &got, what).unwrap();
    want
}

/// `steps` greedy decode steps after logits `want` (the CPU's argmax fed to both forwards), each
/// checked under the verdict; `what(step, position)` names a step, the first position is the
/// GPU's length. Returns the tokens fed. `timed` prints each step's times.
pub fn check_decode(
    cpu: &mut Cpu,
    gpu: &mut dyn GpuModel,
    want: &[f32],
    steps: usize,
    what: impl Fn(usize, usize) -> String,
    timed: bool,
) -> Vec<u32> {
    let pos0 = gpu.len();
    let mut fed = Vec::with_capacity(steps);
    let mut next = argmax(want) as u32;
    for step in 0..steps {
        fed.push(next);
        let t = Instant::now();
        let want = cpu.forward(&[next]);
        let cpu_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        gpu.forward(&[next]).unwrap();
        let got = gpu.logits().unwrap();
        if timed {
            println!(
                "decode step {step} at {}: CPU {cpu_s:.2} s, GPU {:.4} s",
                pos0 + step,
                t.elapsed().as_secs_f64()
            );
        }
        logit_verdict(&want, &got, &what(step, pos0 + step)).unwrap();
        next = argmax(&want) as u32;
    }
    fed
}

/// `n` random micro-vocabulary tokens.
pub fn random_prompt(rng: &mut Rng, n: usize) -> Vec<u32> {
    (0..n)
        .map(|_| rng.below(fixture::MICRO_N_VOCAB) as u32)
        .collect()
}

/// GPU vs CPU on the micro model of `arch` under each `(policy, graphs)` setting: a 20-token
/// prefill (and the device argmax vs the host's), 12 decode steps, and GPU prefill vs GPU
/// token-by-token decode of the whole sequence.
pub fn micro_matches_the_cpu_reference(arch: &str, settings: &[(Policy, bool)]) {
    let mut rng = Rng::from_env_or_time(&format!("gpu_{arch}_micro"));
    let seed = rng.seed();
    let path = micro(arch, seed);
    let mut cpu = Cpu::load(arch, &path);
    let prompt = random_prompt(&mut rng, 20);
    // The micro MoE models' prefills of this length (2 of 4 experts, codegen fixture
    // MICRO_VALUES) run expert-grouped (models::moe_grouped), decode steps on moe_matvec: the
    // prefill-vs-decode checks below compare the two paths.
    assert!(memra_engine::models::moe_grouped::use_grouped(prompt.len(), 2, 4));
    let steps = 12;
    for &(policy, graphs) in settings {
        if !crate::shard::mine() {
            continue;
        }
        let what = format!("{arch} seed {seed}, {policy:?}, graphs {graphs}");
        let mut gpu = load(arch, &path, policy, graphs);
        cpu.reset();
        let want = check_prefill(
            &mut cpu,
            gpu.as_mut(),
            &prompt,
            &format!("{what}: prefill of {}", prompt.len()),
            false,
        );
        assert_eq!(
            gpu.argmax().unwrap() as usize,
            argmax(&gpu.logits().unwrap()),
            "{what}: device argmax vs host argmax"
        );
        let mut seq = prompt.clone();
        seq.extend(check_decode(
            &mut cpu,
            gpu.as_mut(),
            &want,
            steps,
            |step, at| format!("{what}: decode step {step} (position {at})"),
            false,
        ));
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

/// `GpuModel::decode_greedy` on the micro model of `arch` under `policy` (graphs and the fused
/// launches with `graphs`): steps fed on the device and run ahead of the host hand over the same
/// tokens as host-fed steps (forward + argmax, bit-identical kernels, so equal tokens); a stop
/// after k tokens leaves `len()` at prompt + k and a later call continues as if uninterrupted
/// (the steps run ahead were taken back); steps past the context are refused, nothing changed.
pub fn check_greedy_feed(arch: &str, path: &Path, policy: Policy, graphs: bool, rng: &mut Rng) {
    let what = format!("{arch} {policy:?} graphs {graphs} (MEMRA_SEED={})", rng.seed());
    let mut gpu = load_ctx(arch, path, policy, graphs, 96);
    let prompt_len = 3 + rng.below(20);
    let prompt = random_prompt(rng, prompt_len);
    // Past two reads ahead, and not a whole number of reads.
    let n = 3 * models::GREEDY_READ + 1 + rng.below(models::GREEDY_READ - 1);
    gpu.forward(&prompt).unwrap();
    let first = gpu.argmax().unwrap();
    let mut want = Vec::new();
    let mut t = first;
    for _ in 0..n {
        gpu.forward(&[t]).unwrap();
        t = gpu.argmax().unwrap();
        want.push(t);
    }

    gpu.reset();
    gpu.forward(&prompt).unwrap();
    assert_eq!(gpu.argmax().unwrap(), first, "{what}: prefill again");
    let mut got = Vec::new();
    let steps = gpu.decode_greedy(first, n, &mut |t| {
        got.push(t);
        true
    });
    assert_eq!(steps.unwrap_or_else(|e| panic!("{what}: {e}")), n, "{what}");
    assert_eq!(got, want, "{what}: device-fed vs host-fed greedy tokens");
    assert_eq!(gpu.len(), prompt.len() + n, "{what}");

    for k in [1, 1 + rng.below(n - 1)] {
        gpu.reset();
        gpu.forward(&prompt).unwrap();
        let mut got = Vec::new();
        let steps = gpu
            .decode_greedy(first, n, &mut |t| {
                got.push(t);
                got.len() < k
            })
            .unwrap();
        assert_eq!((steps, &got[..]), (k, &want[..k]), "{what}: stop after {k}");
        assert_eq!(gpu.len(), prompt.len() + k, "{what}: stop after {k}");
        let mut rest = Vec::new();
        gpu.decode_greedy(want[k - 1], n - k, &mut |t| {
            rest.push(t);
            true
        })
        .unwrap();
        assert_eq!(rest, want[k..], "{what}: continued after a stop at {k}");
    }

    let (len, room) = (gpu.len(), gpu.max_ctx() - gpu.len());
    let err = gpu.decode_greedy(first, room + 1, &mut |_| true).unwrap_err().to_string();
    assert!(err.contains("context full"), "{what}: {err}");
    assert_eq!(gpu.len(), len, "{what}: a refused call changes nothing");
    let steps = gpu.decode_greedy(first, room, &mut |_| true).unwrap();
    assert_eq!((steps, gpu.len()), (room, gpu.max_ctx()), "{what}: up to the last position");
}
