//! `memra bench --synthetic glm-5 [--layers N] [--ctx T] [--decode-tokens S]`: the real shapes
//! of a preset with random weights generated on the GPU (src/synthetic.rs), caches filled to
//! T positions with random rows (no prefill: `MlaDecoder::assume_cached`), then S decode steps
//! timed one by one (CUDA graphs on, each step synchronized, median reported).
//!
//! The step reads (weights it touches: attention, dense FFN or router + shared + the
//! n_expert_used routed experts, one embedding row, the LM head; cache rows) over the copy
//! bandwidth measured in the same run is the floor. The last layer is measured on its own as the
//! difference between the N-layer and the (N−1)-layer models' steps (same seed, same T): with
//! N > leading_dense_block_count that is one attention + MoE layer, issue #5's figure.

use serde_json::{json, Value};

use crate::synthetic::Description;

/// One layer's decode reads at the benchmarked context.
pub fn layer_rows(desc: &Description, ctx: usize) -> Vec<Value> {
    let dense = desc.dims.int("leading_dense_block_count").unwrap_or(0) as usize;
    (0..desc.n_layer)
        .map(|il| {
            json!({
                "layer": il,
                "ffn": if il < dense { "dense" } else { "moe" },
                "weight_bytes": desc.layer_bytes(Some(il)),
                "decode_weight_bytes": desc.decode_weight_bytes(il),
                "decode_cache_bytes": desc.decode_cache_bytes(il, ctx),
            })
        })
        .collect()
}

/// Bytes one decode step of `desc` reads at `ctx` cached positions.
pub fn step_bytes(desc: &Description, ctx: usize) -> u64 {
    desc.decode_global_bytes()
        + (0..desc.n_layer)
            .map(|il| desc.decode_weight_bytes(il) + desc.decode_cache_bytes(il, ctx))
            .sum::<u64>()
}

/// `--list`: the model's tensors per layer and what a decode step reads, no GPU needed.
pub fn plan_table(desc: &Description, ctx: usize) -> String {
    let gb = |b: u64| b as f64 / 1e9;
    let mut out = format!(
        "synthetic {}: {} of {} layers, {} tensors, {:.2} GB of weights\n",
        desc.preset,
        desc.n_layer,
        desc.full_layers,
        desc.dims.tensors.len(),
        gb(desc.total_bytes())
    );
    out += &format!(
        "{:<8} {:<6} {:>12} {:>16} {:>16}\n",
        "layer",
        "ffn",
        "weights GB",
        "decode reads MB",
        format!("cache MB @{ctx}")
    );
    for r in layer_rows(desc, ctx) {
        let n = |k: &str| r[k].as_u64().unwrap_or(0) as f64;
        out += &format!(
            "{:<8} {:<6} {:>12.3} {:>16.1} {:>16.1}\n",
            r["layer"].as_u64().unwrap_or(0),
            r["ffn"].as_str().unwrap_or("?"),
            n("weight_bytes") / 1e9,
            n("decode_weight_bytes") / 1e6,
            n("decode_cache_bytes") / 1e6
        );
    }
    out += &format!(
        "{:<8} {:<6} {:>12.3} {:>16.1}\nstep reads {:.1} MB\n",
        "global",
        "",
        gb(desc.layer_bytes(None)),
        desc.decode_global_bytes() as f64 / 1e6,
        step_bytes(desc, ctx) as f64 / 1e6
    );
    out
}

/// The measured figures of one synthetic model.
#[derive(Clone, Copy, Debug)]
pub struct Step {
    pub median_us: f64,
    pub min_us: f64,
    pub generate_s: f64,
    pub logits_finite: bool,
}

/// The `synthetic` object of the JSON (benches/results/SCHEMA.md).
pub fn to_json(
    desc: &Description,
    ctx: usize,
    steps: usize,
    seed: u64,
    copy_gbps: f64,
    full: Step,
    fewer: Option<Step>,
    prefill: (usize, Option<f64>),
) -> Value {
    let floor = |bytes: u64| bytes as f64 / (copy_gbps * 1e9) * 1e6;
    let bytes = step_bytes(desc, ctx);
    let last = desc.n_layer - 1;
    let last_layer = fewer.map(|f| {
        let b = desc.decode_weight_bytes(last) + desc.decode_cache_bytes(last, ctx);
        let us = full.median_us - f.median_us;
        json!({"layer": last, "us": us, "bytes": b, "floor_us": floor(b), "ratio_to_floor": us / floor(b)})
    });
    json!({
        "preset": desc.preset,
        "arch": desc.arch(),
        "layers": desc.n_layer,
        "ctx": ctx,
        "decode_steps": steps,
        "seed": seed,
        "weight_bytes": desc.total_bytes(),
        "generate_s": full.generate_s,
        "step_median_us": full.median_us,
        "step_min_us": full.min_us,
        "step_bytes": bytes,
        "step_floor_us": floor(bytes),
        "step_ratio_to_floor": full.median_us / floor(bytes),
        "per_layer_us": full.median_us / desc.n_layer as f64,
        "last_layer": last_layer,
        "logits_finite": full.logits_finite && fewer.is_none_or(|f| f.logits_finite),
        "prompt_tokens": prefill.0,
        "prefill_tok_s": prefill.1,
        "layer_bytes": layer_rows(desc, ctx),
    })
}

/// One GPU count of `memra bench --synthetic P --gpus N` (1, then N).
#[derive(Clone, Debug)]
pub struct GpuRun {
    pub gpus: usize,
    /// The N-layer model's decode steps; `None`: not measured (`note` says why).
    pub full: Option<Step>,
    /// The last layer's time (N layers minus N − 1), µs.
    pub last_layer_us: Option<f64>,
    /// Prompt tokens / s (`None` without `--prompt-tokens`).
    pub prefill_tok_s: Option<f64>,
    pub note: Option<String>,
}

/// The `synthetic_gpus` object of the JSON (benches/results/SCHEMA.md): per GPU count the
/// measured figures beside the bandwidth floor of one GPU's share (every GPU reads its shard at
/// copy bandwidth, in parallel; the collectives are not counted).
pub fn gpus_to_json(
    desc: &Description,
    ctx: usize,
    steps: usize,
    prompt_tokens: usize,
    seed: u64,
    copy_gbps: f64,
    runs: &[GpuRun],
) -> Result<Value, String> {
    let one_gpu = runs.iter().find(|r| r.gpus == 1).and_then(|r| r.full);
    let mut rows = Vec::new();
    for r in runs {
        let bytes = step_bytes(&desc.rank(r.gpus)?, ctx);
        let floor_us = bytes as f64 / (copy_gbps * 1e9) * 1e6;
        let step = r.full.map(|f| f.median_us);
        rows.push(json!({
            "gpus": r.gpus,
            "measured": r.full.is_some(),
            "note": r.note,
            "generate_s": r.full.map(|f| f.generate_s),
            "step_median_us": step,
            "step_min_us": r.full.map(|f| f.min_us),
            "decode_tok_s": step.map(|us| 1e6 / us),
            "per_layer_us": step.map(|us| us / desc.n_layer as f64),
            "last_layer_us": r.last_layer_us,
            "prefill_tok_s": r.prefill_tok_s,
            "speedup_vs_1_gpu": step.zip(one_gpu).map(|(us, one)| one.median_us / us),
            "step_bytes_per_gpu": bytes,
            "step_floor_us": floor_us,
            "decode_tok_s_floor": 1e6 / floor_us,
            "step_ratio_to_floor": step.map(|us| us / floor_us),
        }));
    }
    Ok(json!({
        "preset": desc.preset,
        "arch": desc.arch(),
        "layers": desc.n_layer,
        "ctx": ctx,
        "decode_steps": steps,
        "prompt_tokens": prompt_tokens,
        "seed": seed,
        "weight_bytes": desc.total_bytes(),
        "runs": rows,
    }))
}

pub use gpu::{compare_gpus, measure, measure_gpus, measure_with, prefill_gpus};

mod gpu {
    use std::path::PathBuf;
    use std::time::Instant;

    use memra_reference::Rng;

    use std::sync::Arc;

    use super::{GpuRun, Step};
    use crate::kernels::registry::Policy;
    use crate::models::{glm_dsa, GpuModel, GpuOptions};
    use crate::parallel::sharded::{ShardedMla, Weights};
    use crate::synthetic::{describe, Description, SyntheticWeights};

    /// `memra bench --synthetic P --gpus N`: decode step and last-layer time of the N-layer model
    /// on 1 GPU and on N GPUs (same seed, same context): the table and the runs (for the JSON).
    pub fn compare_gpus(
        desc: &Description,
        gpus: usize,
        ctx: usize,
        steps: usize,
        prompt_tokens: usize,
        seed: u64,
        policy: Policy,
    ) -> Result<(String, Vec<GpuRun>), Box<dyn std::error::Error>> {
        let fewer = if desc.n_layer > 1 {
            Some(describe(&desc.preset, desc.n_layer - 1)?)
        } else {
            None
        };
        let mut runs = Vec::new();
        for g in [1, gpus] {
            eprintln!("memra bench: {} layers on {g} GPU(s)", desc.n_layer);
            let measured = measure_gpus(desc, g, 0, ctx, steps, seed, policy).and_then(|full| {
                let less = fewer.as_ref().map(|d| measure_gpus(d, g, 0, ctx, steps, seed, policy)).transpose()?;
                Ok((full, less))
            });
            let (full, less) = match measured {
                Ok(m) => m,
                // The whole model may not fit one GPU (78 GLM-5 layers are ≈ 420 GB): say so, go on.
                Err(e) if g == 1 => {
                    let note = Some(format!("not measured: {e}"));
                    runs.push(GpuRun { gpus: 1, full: None, last_layer_us: None, prefill_tok_s: None, note });
                    continue;
                }
                Err(e) => return Err(e),
            };
            if !full.logits_finite || less.is_some_and(|l| !l.logits_finite) {
                return Err(format!("synthetic model on {g} GPU(s): non-finite logits").into());
            }
            let prefill_tok_s = match prompt_tokens {
                0 => None,
                n => Some(prefill_gpus(desc, g, 0, n, seed, policy)?),
            };
            let last_layer_us = less.map(|l| full.median_us - l.median_us);
            runs.push(GpuRun { gpus: g, full: Some(full), last_layer_us, prefill_tok_s, note: None });
        }
        let base = runs[0].full.map_or(f64::NAN, |f| f.median_us);
        let mut out = format!(
            "\nsynthetic {}: {} layers, ctx {ctx}, {steps} decode steps (median); prefill of {prompt_tokens} tokens from position 0\n{:<5} {:>12} {:>10} {:>14} {:>16} {:>9} {:>16}\n",
            desc.preset, desc.n_layer, "gpus", "step_us", "tok/s", "us/layer(avg)", "last_layer_us", "speedup", "prefill_tok/s"
        );
        let mut notes = String::new();
        for r in &runs {
            let Some(full) = r.full else {
                notes += &format!("{} GPU: {}\n", r.gpus, r.note.as_deref().unwrap_or("not measured"));
                continue;
            };
            out += &format!(
                "{:<5} {:>12.1} {:>10.1} {:>14.1} {:>16.1} {:>8.2}x {:>16.1}\n",
                r.gpus,
                full.median_us,
                1e6 / full.median_us,
                full.median_us / desc.n_layer as f64,
                r.last_layer_us.unwrap_or(f64::NAN),
                base / full.median_us,
                r.prefill_tok_s.unwrap_or(f64::NAN)
            );
        }
        Ok((out + &notes, runs))
    }

    /// Prefill tokens/s of `desc` on `gpus` GPUs (1: on `device`): `tokens` random prompt
    /// tokens in one forward (chunked as the decoder does) from position 0, synchronized; the
    /// median of 3 after one untimed forward of the same prompt (first launches, lazy module
    /// loading and the scratch of every path it takes), the caches reset before each.
    pub fn prefill_gpus(
        desc: &Description,
        gpus: usize,
        device: usize,
        tokens: usize,
        seed: u64,
        policy: Policy,
    ) -> Result<f64, Box<dyn std::error::Error>> {
        let opts = GpuOptions {
            device: if gpus <= 1 { device } else { 0 },
            policy,
            max_ctx: Some(tokens + 16),
            graphs: true,
            fuse_ffn: true,
            fuse_norm: true,
            fuse_rope: true,
            fuse_combine: true,
            pdl: true,
            omit: None,
        };
        let label = PathBuf::from(format!(
            "synthetic {} × {} layers (prefill)",
            desc.preset, desc.n_layer
        ));
        let mut model: Box<dyn GpuModel> = if gpus <= 1 {
            let file = desc.open()?;
            let source = SyntheticWeights::new(desc, seed);
            Box::new(glm_dsa::load_with(&label, &file, &source, &opts)?)
        } else {
            let d = Arc::new(describe(&desc.preset, desc.n_layer)?);
            Box::new(ShardedMla::load(Weights::Synthetic { desc: d, seed }, &label, gpus, &opts)?)
        };
        let mut rng = Rng::new(seed ^ 0x9e37);
        let n_vocab = model.n_vocab();
        let prompt: Vec<u32> = (0..tokens).map(|_| rng.below(n_vocab) as u32).collect();
        let mut secs = Vec::with_capacity(3);
        for i in 0..4 {
            model.reset();
            let t = Instant::now();
            model.forward(&prompt)?;
            model.sync()?;
            if i > 0 {
                secs.push(t.elapsed().as_secs_f64());
            }
        }
        secs.sort_by(f64::total_cmp);
        Ok(tokens as f64 / secs[1])
    }

    /// Generates `desc`'s weights, fills the caches to `ctx` positions and times `steps` decode
    /// steps (after 4 untimed ones: kernels warm, the graph captured).
    pub fn measure(
        desc: &Description,
        device: usize,
        ctx: usize,
        steps: usize,
        seed: u64,
    ) -> Result<Step, Box<dyn std::error::Error>> {
        measure_with(desc, device, ctx, steps, seed, Policy::Best)
    }

    /// [`measure`] under a kernel policy (`--require-specialized`, `--generic`).
    pub fn measure_with(
        desc: &Description,
        device: usize,
        ctx: usize,
        steps: usize,
        seed: u64,
        policy: Policy,
    ) -> Result<Step, Box<dyn std::error::Error>> {
        let file = desc.open()?;
        let source = SyntheticWeights::new(desc, seed);
        let opts = GpuOptions {
            device,
            policy,
            max_ctx: Some(ctx + steps + 8),
            graphs: true,
            fuse_ffn: true,
            fuse_norm: true,
            fuse_rope: true,
            fuse_combine: true,
            pdl: true,
            omit: None,
        };
        let label = PathBuf::from(format!(
            "synthetic {} × {} layers",
            desc.preset, desc.n_layer
        ));
        let start = Instant::now();
        let mut model = glm_dsa::load_with(&label, &file, &source, &opts)?;
        model.sync()?;
        let generate_s = start.elapsed().as_secs_f64();
        for line in model.report() {
            eprintln!("  {line}");
        }
        model.assume_cached(ctx, &mut |gpu, il, latent, keys| {
            source.fill_cache(gpu, il, latent, keys)
        })?;
        time_steps(&mut model, steps, seed, generate_s)
    }

    /// [`measure_with`] with the model split over GPUs `0..gpus` (parallel::sharded; 1 = on
    /// `device`).
    pub fn measure_gpus(
        desc: &Description,
        gpus: usize,
        device: usize,
        ctx: usize,
        steps: usize,
        seed: u64,
        policy: Policy,
    ) -> Result<Step, Box<dyn std::error::Error>> {
        if gpus <= 1 {
            return measure_with(desc, device, ctx, steps, seed, policy);
        }
        let opts = GpuOptions {
            device: 0,
            policy,
            max_ctx: Some(ctx + steps + 8),
            graphs: true,
            fuse_ffn: true,
            fuse_norm: true,
            fuse_rope: true,
            fuse_combine: true,
            pdl: true,
            omit: None,
        };
        let label = PathBuf::from(format!(
            "synthetic {} × {} layers on {gpus} GPUs",
            desc.preset, desc.n_layer
        ));
        let start = Instant::now();
        let weights = Weights::Synthetic { desc: Arc::new(describe(&desc.preset, desc.n_layer)?), seed };
        let mut model = ShardedMla::load(weights, &label, gpus, &opts)?;
        model.sync()?;
        let generate_s = start.elapsed().as_secs_f64();
        for line in model.report() {
            eprintln!("  {line}");
        }
        model.assume_cached(ctx)?;
        time_steps(&mut model, steps, seed, generate_s)
    }

    /// `steps` timed decode steps of random tokens after 4 untimed ones (kernels warm, the
    /// graph captured), each synchronized.
    fn time_steps(
        model: &mut dyn GpuModel,
        steps: usize,
        seed: u64,
        generate_s: f64,
    ) -> Result<Step, Box<dyn std::error::Error>> {
        let mut rng = Rng::new(seed);
        let n_vocab = model.n_vocab();
        let mut times = Vec::with_capacity(steps);
        for i in 0..steps + 4 {
            let token = rng.below(n_vocab) as u32;
            let t = Instant::now();
            model.forward(&[token])?;
            model.sync()?;
            if i >= 4 {
                times.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        let logits = model.logits()?;
        times.sort_by(f64::total_cmp);
        Ok(Step {
            median_us: times[times.len() / 2],
            min_us: times[0],
            generate_s,
            logits_finite: logits.iter().all(|v| v.is_finite()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::describe;

    /// A `--synthetic` run file is recognised and validated by bench/report.rs.
    #[test]
    fn synthetic_documents_validate() {
        use crate::bench::report::{doc_kind, validate, Doc};
        let d = describe("glm-5", 4).unwrap();
        let s = Step {
            median_us: 900.0,
            min_us: 850.0,
            generate_s: 1.5,
            logits_finite: true,
        };
        let mut doc = json!({"schema": 1, "device": "NVIDIA H200", "sm": "sm_90", "driver": "CUDA 13.0",
            "date": "2026-11-30T05:00:00Z", "commit": "abc", "memra_version": "0.1.0",
            "copy_bytes": 2u64 << 30, "copy_gbps": 4000.0,
            "synthetic": to_json(&d, 32768, 64, 7, 4000.0, s, Some(Step { median_us: 700.0, ..s }), (512, Some(9000.0)))});
        assert_eq!(doc_kind(&doc), Doc::Synthetic);
        validate(&doc, Doc::Synthetic).unwrap_or_else(|e| panic!("{e:?}"));
        doc["synthetic"]["last_layer"] = Value::Null;
        validate(&doc, Doc::Synthetic).unwrap_or_else(|e| panic!("{e:?}"));
        doc["synthetic"]["layer_bytes"][0]["ffn"] = json!("sparse");
        doc["synthetic"]
            .as_object_mut()
            .unwrap()
            .remove("step_bytes");
        let errs = validate(&doc, Doc::Synthetic).expect_err("accepted a bad synthetic doc");
        assert!(errs.iter().any(|e| e.contains("step_bytes")), "{errs:?}");
        assert!(
            errs.iter().any(|e| e.contains("layer_bytes[0].ffn")),
            "{errs:?}"
        );
    }

    /// Every key of the `synthetic` object is documented in SCHEMA.md's section and vice versa.
    #[test]
    fn json_keys_are_the_documented_ones() {
        let d = describe("glm-5", 4).unwrap();
        let s = Step {
            median_us: 900.0,
            min_us: 850.0,
            generate_s: 1.5,
            logits_finite: true,
        };
        let v = to_json(
            &d,
            32768,
            64,
            7,
            4000.0,
            s,
            Some(Step {
                median_us: 700.0,
                ..s
            }),
            (1024, Some(3100.0)),
        );
        let schema = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../benches/results/SCHEMA.md"
        ))
        .unwrap();
        let section = schema
            .split("## `memra bench --synthetic")
            .nth(1)
            .expect("SCHEMA.md has no --synthetic section");
        let section = section.split("\n## ").next().unwrap();
        // The first cell of each table row: `key`, `key`, … or `object`.`key` (backticks dropped).
        let documented: Vec<String> = section
            .lines()
            .filter_map(|l| l.strip_prefix("| `"))
            .flat_map(|l| {
                let cell = l.split(" |").next().unwrap_or("").replace('`', "");
                cell.split(", ").map(str::to_string).collect::<Vec<_>>()
            })
            .collect();
        let mut keys: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        keys.extend(
            v["last_layer"]
                .as_object()
                .unwrap()
                .keys()
                .map(|k| format!("last_layer.{k}")),
        );
        keys.extend(
            v["layer_bytes"][0]
                .as_object()
                .unwrap()
                .keys()
                .map(|k| format!("layer_bytes[].{k}")),
        );
        for k in &keys {
            assert!(
                documented.contains(k),
                "key `{k}` not documented in SCHEMA.md"
            );
        }
        for k in &documented {
            assert!(
                keys.iter().any(|x| x == k),
                "SCHEMA.md documents `{k}`, the JSON has no such key"
            );
        }
        // The step reads: 3 dense + 1 MoE layer's weights and caches, one embedding row, the head.
        assert_eq!(v["step_bytes"].as_u64().unwrap(), step_bytes(&d, 32768));
        assert_eq!(v["last_layer"]["layer"], 3);
        assert_eq!(v["last_layer"]["us"].as_f64().unwrap(), 200.0);
        let b = d.decode_weight_bytes(3) + d.decode_cache_bytes(3, 32768);
        let ratio = v["last_layer"]["ratio_to_floor"].as_f64().unwrap();
        assert!(
            (ratio - 200.0 / (b as f64 / 4e12 * 1e6)).abs() < 1e-9,
            "{ratio}"
        );
        assert_eq!(v["layer_bytes"][3]["ffn"], "moe");
        assert_eq!(v["layer_bytes"][2]["ffn"], "dense");
    }

    fn gpu_runs() -> Vec<GpuRun> {
        let s = |median_us| Step { median_us, min_us: median_us - 10.0, generate_s: 2.0, logits_finite: true };
        vec![
            GpuRun { gpus: 1, full: Some(s(900.0)), last_layer_us: Some(350.0), prefill_tok_s: Some(1200.0), note: None },
            GpuRun { gpus: 2, full: Some(s(600.0)), last_layer_us: Some(220.0), prefill_tok_s: Some(2000.0), note: None },
        ]
    }

    /// `--gpus N --json`: per GPU count the measured figures and one GPU's share of the floor;
    /// the document validates, every key is documented in SCHEMA.md and vice versa.
    #[test]
    fn gpus_json_has_both_counts_and_the_per_gpu_floor() {
        use crate::bench::report::{doc_kind, validate, Doc};
        let d = describe("glm-5", 4).unwrap();
        let v = gpus_to_json(&d, 32768, 64, 512, 7, 4000.0, &gpu_runs()).unwrap();
        let runs = v["runs"].as_array().unwrap();
        assert_eq!((runs[0]["gpus"].as_u64(), runs[1]["gpus"].as_u64()), (Some(1), Some(2)));
        let f = |r: &Value, k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k}: {}", r[k]));
        assert_eq!(f(&runs[0], "decode_tok_s"), 1e6 / 900.0);
        assert_eq!(f(&runs[1], "per_layer_us"), 150.0);
        assert_eq!(f(&runs[1], "speedup_vs_1_gpu"), 1.5);
        assert_eq!(f(&runs[1], "prefill_tok_s"), 2000.0);
        // 1 GPU: the whole step's reads; 2 GPUs: one rank's (heads, FFN, LM head and the
        // selected experts halved; the latent cache, indexer and router replicated).
        let (b1, b2) = (runs[0]["step_bytes_per_gpu"].as_u64().unwrap(), runs[1]["step_bytes_per_gpu"].as_u64().unwrap());
        assert_eq!(b1, step_bytes(&d, 32768));
        assert_eq!(b2, step_bytes(&d.rank(2).unwrap(), 32768));
        assert!(b2 < b1 && 2 * b2 > b1, "replicated parts keep one GPU's share above half: {b2} of {b1}");
        assert!((f(&runs[1], "step_floor_us") - b2 as f64 / 4e3 * 1e-3).abs() < 1e-6);
        assert!((f(&runs[1], "step_ratio_to_floor") - 600.0 / f(&runs[1], "step_floor_us")).abs() < 1e-9);

        let mut doc = json!({"schema": 1, "device": "NVIDIA H200", "sm": "sm_90", "driver": "CUDA 13.0",
            "date": "2026-11-30T05:00:00Z", "commit": "abc", "memra_version": "0.1.0",
            "copy_bytes": 2u64 << 30, "copy_gbps": 4000.0, "synthetic_gpus": v.clone()});
        assert_eq!(doc_kind(&doc), Doc::SyntheticGpus);
        validate(&doc, Doc::SyntheticGpus).unwrap_or_else(|e| panic!("{e:?}"));
        // A 1-GPU run that did not fit: nulls and a note.
        let mut runs = gpu_runs();
        runs[0] = GpuRun { gpus: 1, full: None, last_layer_us: None, prefill_tok_s: None, note: Some("not measured: out of memory".into()) };
        doc["synthetic_gpus"] = gpus_to_json(&d, 32768, 64, 0, 7, 4000.0, &runs).unwrap();
        validate(&doc, Doc::SyntheticGpus).unwrap_or_else(|e| panic!("{e:?}"));
        assert!(doc["synthetic_gpus"]["runs"][1]["speedup_vs_1_gpu"].is_null());
        doc["synthetic_gpus"]["runs"][0]["note"] = Value::Null;
        doc["synthetic_gpus"]["runs"][1]["step_median_us"] = Value::Null;
        let errs = validate(&doc, Doc::SyntheticGpus).expect_err("accepted a bad document");
        assert!(errs.iter().any(|e| e.contains("runs[0]: not measured and no `note`")), "{errs:?}");
        assert!(errs.iter().any(|e| e.contains("runs[1]: `measured` disagrees")), "{errs:?}");
        assert!(gpus_to_json(&d, 32768, 64, 0, 7, 4000.0, &[GpuRun { gpus: 3, ..gpu_runs().remove(1) }])
            .unwrap_err()
            .contains("3 equal parts"));

        let schema = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../benches/results/SCHEMA.md")).unwrap();
        let section = schema.split("## `memra bench --synthetic PRESET --gpus N").nth(1).expect("SCHEMA.md has no --gpus section");
        let section = section.split("\n## ").next().unwrap();
        let documented: Vec<String> = section
            .lines()
            .filter_map(|l| l.strip_prefix("| `"))
            .flat_map(|l| l.split(" |").next().unwrap_or("").replace('`', "").split(", ").map(str::to_string).collect::<Vec<_>>())
            .collect();
        let mut keys: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        keys.extend(v["runs"][0].as_object().unwrap().keys().map(|k| format!("runs[].{k}")));
        keys.sort();
        let mut want = documented.clone();
        want.sort();
        assert_eq!(keys, want, "JSON keys vs SCHEMA.md");
    }
}
