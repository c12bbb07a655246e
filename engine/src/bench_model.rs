//! `memra bench --model FILE`: end-to-end prefill and decode throughput of a whole model on the
//! GPU, with the specialized kernels and with the generic ones, against the decode bandwidth
//! floor (weight bytes / copy bandwidth measured in the same run).

use std::path::Path;
use std::time::Instant;

use memra_gguf::GgufFile;
use memra_reference::Rng;
use serde_json::{Value, json};

use crate::kernels::registry::Policy;
use crate::models::{self, GpuModel, GpuOptions, StepRole};

/// The measured figures of one model under one kernel policy.
pub struct ModelRow {
    pub policy: &'static str,
    /// The decode step's fusions and overlap.
    pub setup: DecodeSetup,
    pub prefill_tokens: usize,
    pub prefill_tok_s: f64,
    pub decode_tokens: usize,
    pub decode_tok_s: f64,
    pub decode_step_us: f64,
    pub weight_bytes: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Prefill `prompt_tokens` random tokens (median of `reps` fresh prefills), then decode
/// `decode_tokens` greedily one at a time (each step waits for its token, as generation does).
/// `omit`: that role's launches left out of every decode step ([`GpuOptions::omit`]).
#[allow(clippy::too_many_arguments)]
pub fn measure(
    path: &Path,
    device: usize,
    policy: Policy,
    setup: DecodeSetup,
    prompt_tokens: usize,
    decode_tokens: usize,
    reps: usize,
    omit: Option<StepRole>,
) -> Result<ModelRow, Box<dyn std::error::Error>> {
    let arch = GgufFile::open(path)?.architecture()?.to_string();
    let max_ctx = prompt_tokens + decode_tokens + 1;
    let opts = GpuOptions { device, policy, max_ctx: Some(max_ctx), graphs: true, fuse_ffn: true, fuse_norm: setup.norm, fuse_rope: setup.rope, fuse_combine: setup.combine, pdl: setup.pdl, omit };
    let mut model: Box<dyn GpuModel> = models::load_gpu(path, &arch, &opts)?;
    for line in model.report() {
        eprintln!("  {line}");
    }
    let mut rng = Rng::from_env_or_time("memra bench --model");
    let prompt: Vec<u32> = (0..prompt_tokens).map(|_| rng.below(model.n_vocab()) as u32).collect();
    // With launches left out the argmax may read stale or NaN logits (-1): feed token 0 then.
    let n_vocab = model.n_vocab();
    let next = |model: &dyn GpuModel| -> Result<u32, Box<dyn std::error::Error>> {
        let t = model.argmax()?;
        Ok(if omit.is_some() && t as usize >= n_vocab { 0 } else { t })
    };
    // Warm-up: kernels loaded, graph captured, clocks up.
    model.forward(&prompt)?;
    for _ in 0..8 {
        let t = next(model.as_ref())?;
        model.forward(&[t])?;
    }
    model.sync()?;
    let mut prefill = Vec::new();
    for _ in 0..reps.max(1) {
        model.reset();
        let start = Instant::now();
        model.forward(&prompt)?;
        model.sync()?;
        prefill.push(start.elapsed().as_secs_f64());
    }
    let mut token = next(model.as_ref())?;
    let start = Instant::now();
    if setup.device_feed && omit.is_none() {
        // As `memra run` decodes greedily: each step fed by the previous one on the device,
        // the host reading the tokens a few steps behind.
        let steps = model.decode_greedy(token, decode_tokens, &mut |_| true)?;
        if steps != decode_tokens {
            return Err(format!("decode stopped after {steps} of {decode_tokens} steps").into());
        }
    } else {
        // Each step waits for the host to read its token and feed the next (a step with
        // launches left out may feed a stale token and position: the breakdown decodes so).
        for _ in 0..decode_tokens {
            model.forward(&[token])?;
            token = next(model.as_ref())?;
        }
    }
    model.sync()?;
    let decode = start.elapsed().as_secs_f64();
    let prefill_s = median(prefill);
    Ok(ModelRow {
        policy: match policy {
            Policy::GenericOnly => "generic",
            _ => "specialized",
        },
        setup,
        prefill_tokens: prompt_tokens,
        prefill_tok_s: prompt_tokens as f64 / prefill_s,
        decode_tokens,
        decode_tok_s: decode_tokens as f64 / decode,
        decode_step_us: decode * 1e6 / decode_tokens as f64,
        weight_bytes: model.weight_bytes(),
    })
}

/// `--breakdown`: the decode step (specialized kernels, every fusion, PDL) timed whole and with
/// each [`StepRole`]'s launches left out of the captured step; the difference is what the role
/// costs there, overlap with its neighbours included. Printed as a table.
pub fn breakdown(path: &Path, device: usize, prompt_tokens: usize, decode_tokens: usize) -> Result<(), Box<dyn std::error::Error>> {
    let step = |omit: Option<StepRole>| -> Result<f64, Box<dyn std::error::Error>> {
        eprintln!("memra bench: {} decode step without {}", path.display(), omit.map_or("nothing", StepRole::label));
        Ok(measure(path, device, Policy::Best, DecodeSetup::HOST_FED, prompt_tokens, decode_tokens, 1, omit)?.decode_step_us)
    };
    let whole = step(None)?;
    let mut rows = Vec::new();
    for role in StepRole::ALL {
        rows.push((role, step(Some(role))?));
    }
    println!("\ndecode step by role (specialized, every fusion, PDL, host-fed steps; each row leaves that role's launches out of the captured step):");
    println!("{:<14} {:>12} {:>14} {:>8}", "left out", "step us", "role costs us", "share");
    println!("{:<14} {:>12.1} {:>14} {:>8}", "nothing", whole, "-", "-");
    for (role, us) in &rows {
        println!("{:<14} {:>12.1} {:>14.1} {:>7.1}%", role.label(), us, whole - us, 100.0 * (whole - us) / whole);
    }
    let sum: f64 = rows.iter().map(|(_, us)| whole - us).sum();
    println!("{:<14} {:>12} {:>14.1} {:>7.1}%  (the rest: the host round trip, embed, overlap)", "sum of roles", "", sum, 100.0 * sum / whole);
    Ok(())
}

/// How a row's decode step runs: which launches are fused, and whether its kernels overlap (PDL).
#[derive(Clone, Copy, Debug)]
pub struct DecodeSetup {
    /// Residual add + RMSNorm inside the next projection (norm_matvec).
    pub norm: bool,
    /// QK-norm + RoPE + KV write inside the attention launch (attn_decode_rope).
    pub rope: bool,
    /// The attention's split combine inside the o-projection (combine_matvec).
    pub combine: bool,
    /// Programmatic dependent launch between the step's kernels (GpuOptions::pdl).
    pub pdl: bool,
    /// Greedy steps fed by the previous step's argmax on the device and enqueued ahead of the
    /// host (GpuModel::decode_greedy, as `memra run` decodes); false: each step waits for the
    /// host to read the last token and upload it.
    pub device_feed: bool,
}

impl DecodeSetup {
    pub const ALL: DecodeSetup = DecodeSetup { norm: true, rope: true, combine: true, pdl: true, device_feed: true };
    pub const HOST_FED: DecodeSetup = DecodeSetup { device_feed: false, ..DecodeSetup::ALL };

    /// The feed column of the table.
    fn feed(self) -> &'static str {
        if self.device_feed { "device" } else { "host" }
    }

    /// The fusions' name in the table (PDL has its own column).
    fn fusions(self) -> String {
        let on: Vec<&str> = [(self.norm, "norm"), (self.rope, "rope"), (self.combine, "combine")].into_iter().filter_map(|(f, n)| f.then_some(n)).collect();
        if on.is_empty() { "none".into() } else { on.join("+") }
    }
}

/// Both policies with every fusion, PDL and device-fed steps, then the specialized kernels with
/// host-fed steps, without the combine fusion, without PDL, without the attention's RoPE and
/// combine fusions too, and without any fusion (each step's A/B in the same run), printed as a
/// table; returns the JSON entries
/// (benches/results/SCHEMA.md `models`).
pub fn run(path: &Path, device: usize, copy_gbps: f64, prompt_tokens: usize, decode_tokens: usize) -> Result<Vec<Value>, Box<dyn std::error::Error>> {
    let mut out = Vec::new();
    let mut rows = Vec::new();
    let settings = [
        (Policy::Best, DecodeSetup::ALL),
        (Policy::GenericOnly, DecodeSetup::ALL),
        (Policy::Best, DecodeSetup::HOST_FED),
        (Policy::Best, DecodeSetup { combine: false, ..DecodeSetup::HOST_FED }),
        (Policy::Best, DecodeSetup { pdl: false, ..DecodeSetup::HOST_FED }),
        (Policy::Best, DecodeSetup { rope: false, combine: false, pdl: false, ..DecodeSetup::HOST_FED }),
        (Policy::Best, DecodeSetup { norm: false, rope: false, combine: false, pdl: false, ..DecodeSetup::HOST_FED }),
    ];
    for (policy, setup) in settings {
        eprintln!("memra bench: {} with {:?} kernels, decode fusions: {}, PDL {}, {} feed", path.display(), policy, setup.fusions(), on_off(setup.pdl), setup.feed());
        rows.push(measure(path, device, policy, setup, prompt_tokens, decode_tokens, 3, None)?);
    }
    let name = path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
    println!("\nmodel {name}: prefill {prompt_tokens} tokens, decode {decode_tokens} greedy tokens (feed: device = steps fed on the GPU, read a few behind; host = one sync per token)");
    println!("{:<12} {:<17} {:<4} {:<6} {:>14} {:>14} {:>12} {:>16}", "kernels", "decode fusions", "pdl", "feed", "prefill tok/s", "decode tok/s", "step us", "decode floor us");
    for r in &rows {
        let floor_us = r.weight_bytes as f64 / (copy_gbps * 1e9) * 1e6;
        println!(
            "{:<12} {:<17} {:<4} {:<6} {:>14.0} {:>14.1} {:>12.1} {:>16.1}",
            r.policy,
            r.setup.fusions(),
            on_off(r.setup.pdl),
            r.setup.feed(),
            r.prefill_tok_s, r.decode_tok_s, r.decode_step_us, floor_us
        );
        out.push(json!({
            "model": name,
            "kernels": r.policy,
            "fuse_norm": r.setup.norm,
            "fuse_rope": r.setup.rope,
            "fuse_combine": r.setup.combine,
            "pdl": r.setup.pdl,
            "device_feed": r.setup.device_feed,
            "prefill_tokens": r.prefill_tokens,
            "prefill_tok_s": r.prefill_tok_s,
            "decode_tokens": r.decode_tokens,
            "decode_tok_s": r.decode_tok_s,
            "decode_step_us": r.decode_step_us,
            "weight_bytes": r.weight_bytes,
            "decode_floor_us": floor_us,
        }));
    }
    if let [s, g, h, c, p, n, u] = &rows[..] {
        println!(
            "specialized/generic: prefill {:.2}x, decode {:.2}x; decode device-fed / host-fed: {:.2}x; host-fed with the combine fusion / without: {:.2}x; host-fed with PDL / without: {:.2}x; without PDL, every fusion / without the RoPE and combine fusions: {:.2}x, / with none: {:.2}x",
            s.prefill_tok_s / g.prefill_tok_s,
            s.decode_tok_s / g.decode_tok_s,
            s.decode_tok_s / h.decode_tok_s,
            h.decode_tok_s / c.decode_tok_s,
            h.decode_tok_s / p.decode_tok_s,
            p.decode_tok_s / n.decode_tok_s,
            p.decode_tok_s / u.decode_tok_s
        );
    }
    Ok(out)
}

fn on_off(b: bool) -> &'static str {
    if b { "on" } else { "off" }
}
