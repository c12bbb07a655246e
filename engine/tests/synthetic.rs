//! `memra bench --synthetic`: CLI help and error paths (no GPU needed), and on the GPU a
//! synthetic GLM-5 (3 dense + 1 MoE layer at the real dims) that decodes past top_k with finite
//! logits, plus generated blocks equal to `synthetic::host_blocks` and decoding (memra-gguf) to
//! finite values.

use std::process::{Command, Output};

use memra_engine::synthetic::{self, describe, SyntheticWeights};
use memra_gguf::quant;
use memra_reference::Rng;

fn memra(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memra"))
        .args(args)
        .output()
        .expect("spawn memra")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn bench_help_lists_the_synthetic_options() {
    let o = memra(&["bench", "--help"]);
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    for opt in [
        "--synthetic <PRESET>",
        "--layers <LAYERS>",
        "--ctx <CTX>",
        "--decode-tokens",
    ] {
        assert!(
            t.contains(opt),
            "`{opt}` missing from memra bench --help:\n{t}"
        );
    }
}

#[test]
fn bad_synthetic_arguments_fail_with_a_message() {
    let cases: [(&[&str], &str); 5] = [
        (
            &["--synthetic", "glm-6"],
            "unknown synthetic preset 'glm-6' (known: glm-5)",
        ),
        (
            &["--synthetic", "glm-5", "--layers", "79"],
            "--layers 79: glm-5 has 1..=78 layers",
        ),
        (&["--synthetic", "glm-5", "--layers", "0"], "--layers"),
        // 64 heads do not split over 3 GPUs: refused before any GPU work.
        (
            &["--synthetic", "glm-5", "--layers", "1", "--gpus", "3"],
            "attention heads: 64 does not split into 3 equal parts",
        ),
        (&["--synthetic", "glm-5", "--gpus", "0"], "--gpus"),
    ];
    for (args, message) in cases {
        let o = memra(&[&["bench"], args].concat());
        let t = text(&o);
        assert!(!o.status.success(), "{args:?} succeeded: {t}");
        assert!(
            t.contains(message) && !t.contains("panicked"),
            "{args:?}: {t}"
        );
    }
}

/// `--list` prints the per-layer table without a GPU: 3 dense layers, then MoE layers whose
/// decode reads are a small part of their weights (8 + 1 of 256 experts).
#[test]
fn list_prints_the_layer_table() {
    let o = memra(&[
        "bench",
        "--synthetic",
        "glm-5",
        "--layers",
        "5",
        "--ctx",
        "4096",
        "--list",
    ]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("synthetic glm-5: 5 of 78 layers, 103 tensors"),
        "{t}"
    );
    let rows: Vec<Vec<&str>> = t
        .lines()
        .map(|l| l.split_whitespace().collect())
        .filter(|c: &Vec<&str>| c.len() == 5 && c[0].parse::<usize>().is_ok())
        .collect();
    assert_eq!(
        rows.iter().map(|r| r[1]).collect::<Vec<_>>(),
        ["dense", "dense", "dense", "moe", "moe"],
        "{t}"
    );
    let num = |s: &str| s.parse::<f64>().unwrap();
    let moe = &rows[3];
    assert!(
        num(moe[2]) > 5.0 && num(moe[3]) < 0.1 * num(moe[2]) * 1e3,
        "{t}"
    );
    assert!(t.contains("step reads"), "{t}");
}

/// Without a GPU the command says so (no panic); with one, a 1-layer model runs and reports.
#[test]
fn one_layer_bench_runs_or_says_why_not() {
    let o = memra(&[
        "bench",
        "--synthetic",
        "glm-5",
        "--layers",
        "1",
        "--ctx",
        "64",
        "--decode-tokens",
        "3",
    ]);
    let t = text(&o);
    assert!(!t.contains("panicked"), "{t}");
    if o.status.success() {
        assert!(
            t.contains("synthetic glm-5: 1 layers, ctx 64: decode step"),
            "{t}"
        );
    } else {
        assert!(t.contains("CUDA"), "{t}");
    }
}

/// Generated Q4_K / Q8_0 / f32 tensors of a real GLM-5 layer: the device bytes equal the host
/// mirror, decode to finite values of the intended scale; norms ≈ 1.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_synthetic_blocks_match_the_host_mirror_and_decode() {
    use memra_engine::models::gpu::WeightSource;
    let rng = Rng::from_env_or_time("gpu_synthetic_blocks");
    let seed = rng.seed();
    let desc = describe("glm-5", 4).unwrap();
    let file = desc.open().unwrap();
    let gpu = memra_engine::cuda::Gpu::new(0).expect("a CUDA GPU");
    let source = SyntheticWeights::new(&desc, seed);
    for name in [
        "blk.3.ffn_down_exps.weight",
        "blk.3.attn_q_b.weight",
        "blk.3.ffn_gate_inp.weight",
        "output.weight",
    ] {
        let t = file.tensor(name).unwrap();
        let dt = source.upload(&gpu, &t).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(dt.bytes() as u64, t.n_bytes, "{name}");
        let all = gpu.stream().clone_dtoh(&dt.data).unwrap();
        // First and last 64 rows' worth of blocks (the tail covers a partial last word).
        let bb = t.ggml_type.type_size() as usize;
        let n_blocks = all.len() / bb;
        let take = (64 * t.row_bytes() as usize / bb).min(n_blocks);
        let head = &all[..take * bb];
        let vals =
            quant::dequantize(t.ggml_type, head, take * t.ggml_type.block_size() as usize).unwrap();
        let bad = vals.iter().filter(|v| !v.is_finite()).count();
        let sd = (vals.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / vals.len() as f64).sqrt();
        let sigma = 1.0 / (t.row_len() as f64).sqrt();
        println!("{name}: {} {:?}, {} values checked, rms {sd:e} (1/sqrt(k) {sigma:e}), {bad} non-finite", t.ggml_type, t.dims.as_slice(), vals.len());
        assert_eq!(bad, 0, "{name}: seed {seed}");
        assert!(
            (0.3 * sigma..3.0 * sigma).contains(&sd),
            "{name}: rms {sd:e}, seed {seed}"
        );
        if let Some(host) = synthetic::host_blocks(
            t.ggml_type,
            t.row_len(),
            synthetic::tensor_seed(seed, name),
            n_blocks.min(take),
        ) {
            assert!(
                host == head,
                "{name}: device blocks differ from the host mirror, seed {seed}"
            );
        }
    }
    let norm = source
        .upload_f32(&gpu, &file.tensor("blk.3.attn_norm.weight").unwrap())
        .unwrap();
    let norm = gpu.stream().clone_dtoh(&norm).unwrap();
    assert!(
        norm.iter().all(|v| (0.9..=1.1).contains(v)),
        "norm weights outside 1 ± 0.1"
    );
    println!("VERDICT: synthetic blocks OK (seed {seed})");
}

/// 3 dense + 1 MoE GLM-5 layers at the real dims: caches filled to 3000 positions (past the
/// indexer's top_k 2048: the sparse path), 6 decode steps with graphs, every logit finite; the
/// bench's figures for it printed.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_synthetic_glm5_decodes_with_finite_logits() {
    let rng = Rng::from_env_or_time("gpu_synthetic_glm5");
    let seed = rng.seed();
    let desc = describe("glm-5", 4).unwrap();
    let step = memra_engine::bench_synthetic::measure(&desc, 0, 3000, 6, seed)
        .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    println!("{step:?}");
    assert!(step.logits_finite, "non-finite logits, seed {seed}");
    assert!(step.median_us > 0.0);
    println!("VERDICT: synthetic GLM-5 4 layers decodes, finite logits (seed {seed})");
}

#[test]
fn generator_kernels_compile_for_sm90_without_spills() {
    use memra_engine::cuda::nvrtc::{compile_cubin, HeaderSet};
    use memra_engine::cuda::{library, SmArch};
    if library::nvrtc_or_skip("generator_kernels_compile_for_sm90_without_spills").is_none() {
        return;
    }
    let cubin = compile_cubin(
        "memra_synthetic.cu",
        synthetic::KERNELS,
        &HeaderSet::new(&[]),
        SmArch(90),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(!cubin.report().spills(), "{}", cubin.log);
    assert!(cubin.bytes.len() > 1000);
}
