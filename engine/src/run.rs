//! `memra run`: generate text from a prompt on the GPU (the forward of the file's architecture,
//! with this build's specialized kernels where the dims match) or, with `--cpu`, on the f32 CPU
//! reference forward. Without a model file it runs the embedded default: the micro model of the
//! built architecture (random weights, so the text is noise; it shows the whole path works).

use std::error::Error;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use memra_gguf::GgufFile;
use memra_reference::models::{CpuCache, CpuModel};

use crate::kernels::registry::Policy;
use crate::models::{self, GpuModel, GpuOptions};
use crate::sampling::{Sampler, SamplerConfig};
use crate::tokenizer::Tokenizer;

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The GGUF model file; without one, the embedded micro model of the built architecture.
    pub model: Option<PathBuf>,
    /// The prompt. Special tokens written in it (e.g. `<start_of_turn>`) are recognized.
    #[arg(short, long, default_value = "Once upon a time")]
    pub prompt: String,
    /// Number of tokens to generate (generation also stops at an end-of-generation token).
    #[arg(short = 'n', long = "n-predict", default_value_t = 64)]
    pub n_predict: usize,
    /// Keep generating past end-of-generation tokens, to `-n` or the context's end (timing runs).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Sampling temperature; 0 is greedy (argmax on the GPU).
    #[arg(long, default_value_t = 0.8)]
    pub temp: f32,
    /// Keep only the K most likely tokens (0: off).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches P (1: off).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Sampling seed (default: from the clock, printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Run the f32 CPU reference forward instead of the GPU (slow; for checking).
    #[arg(long)]
    pub cpu: bool,
    /// Context size in positions: the KV cache on the GPU, the limit on the CPU too (default and
    /// at most: the model's training context; at least 2).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Fail unless every kernel is a variant specialized for this model's dims.
    #[arg(long, conflicts_with = "generic")]
    pub require_specialized: bool,
    /// Use the generic kernel variants only (the baseline specialization is measured against).
    #[arg(long)]
    pub generic: bool,
    /// Launch every decode kernel separately instead of replaying a captured CUDA graph.
    #[arg(long)]
    pub no_graphs: bool,
    /// Run the dense FFN of a decode step as three launches (gate, up, activation) instead of
    /// one fused launch.
    #[arg(long)]
    pub no_fuse: bool,
    /// Run each decode step's residual add + RMSNorm as its own launch instead of inside the
    /// projection that follows it (q/k/v, the gated FFN, the LM head).
    #[arg(long)]
    pub no_fuse_norm: bool,
    /// Run each decode step's QK-norm + RoPE + KV-cache write as its own launch instead of in
    /// the attention launch's prologue.
    #[arg(long)]
    pub no_fuse_rope: bool,
    /// Combine each decode step's attention splits in the attention launch's last block instead
    /// of inside the output projection after it.
    #[arg(long)]
    pub no_fuse_combine: bool,
    /// Launch a captured decode step's kernels one after another instead of linking them by
    /// programmatic dependent launch (sm_90+: each kernel starts while the previous one
    /// finishes and loads its weights meanwhile).
    #[arg(long)]
    pub no_pdl: bool,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Split the model over GPUs 0..N with NCCL (glm-dsa: attention heads, experts, FFN and
    /// LM-head rows; engine/src/parallel).
    #[arg(long, default_value_t = 1, conflicts_with = "cpu", value_parser = clap::value_parser!(u32).range(1..))]
    pub gpus: u32,
}

include!(concat!(env!("OUT_DIR"), "/micro_models.rs"));

/// The forward a run uses.
enum Backend {
    Cpu(Box<CpuModel>, CpuCache, Vec<f32>),
    Gpu(Box<dyn GpuModel>),
}

impl Backend {
    fn forward(&mut self, tokens: &[u32]) -> Result<(), Box<dyn Error>> {
        match self {
            Backend::Cpu(model, cache, logits) => *logits = model.forward(cache, tokens, false)?,
            Backend::Gpu(model) => model.forward(tokens)?,
        }
        Ok(())
    }

    /// The next token from the last logits (greedy stays on the device).
    fn next(&mut self, sampler: &mut Sampler, greedy: bool) -> Result<u32, Box<dyn Error>> {
        Ok(match self {
            Backend::Cpu(_, _, logits) => sampler.sample(logits),
            Backend::Gpu(model) if greedy => model.argmax()?,
            Backend::Gpu(model) => sampler.sample(&model.logits()?),
        })
    }

    fn len(&self) -> usize {
        match self {
            Backend::Cpu(_, cache, _) => cache.len(),
            Backend::Gpu(model) => model.len(),
        }
    }
}

/// The model file to run: the given one, or the embedded micro model written to the cache.
fn model_path(args: &RunArgs) -> Result<PathBuf, Box<dyn Error>> {
    if let Some(p) = &args.model {
        return Ok(p.clone());
    }
    let (arch, bytes) = MICRO_MODELS.first().ok_or("this build embeds no default model")?;
    let dir = crate::cuda::library::memra_cache_root().join("micro");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join(format!("{arch}-{}.gguf", env!("CARGO_PKG_VERSION")));
    if std::fs::read(&path).ok().as_deref() != Some(*bytes) {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, bytes).and_then(|_| std::fs::rename(&tmp, &path)).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    eprintln!(
        "memra: no model given: running the embedded default, a micro {arch} written from specs/{arch}.toml \
         with random weights (its text is noise); pass a GGUF file to run a real model"
    );
    Ok(path)
}

pub fn run(args: &RunArgs) -> Result<(), Box<dyn Error>> {
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let config = SamplerConfig { temperature: args.temp, top_k: args.top_k, top_p: args.top_p, seed };
    let mut sampler = Sampler::new(config)?;
    let greedy = args.temp <= 0.0;

    let path = &model_path(args)?;
    let load_start = Instant::now();
    let gguf = GgufFile::open(path)?;
    let arch = gguf.architecture()?.to_string();
    let tokenizer = Tokenizer::from_gguf(&gguf)?;
    // --ctx is checked before any weight is loaded, against the file's context where it has one
    // (the loaders fall back to the spec's default otherwise; checked again after the load).
    let ctx_key = format!("{arch}.context_length");
    let ctx_too_big = |c: usize, n: usize, from: &str| format!("--ctx {c} is more than the model's context of {n} positions ({from})");
    if let Some(c) = args.ctx {
        if c < 2 {
            return Err(format!("--ctx {c}: the context must hold at least 2 positions (a prompt token and a generated one)").into());
        }
        if let Ok(n) = gguf.get_usize(&ctx_key)
            && c > n
        {
            return Err(ctx_too_big(c, n, &format!("{ctx_key} in {}", path.display())).into());
        }
    }
    let (mut backend, max_ctx) = if args.cpu {
        eprintln!("memra: loading {} on the CPU (dequantizing every weight to f32) ...", path.display());
        let model = CpuModel::from_gguf(&gguf)?;
        let (n_ctx, cache) = (model.n_ctx(), model.new_cache());
        (Backend::Cpu(Box::new(model), cache, Vec::new()), args.ctx.unwrap_or(n_ctx).min(n_ctx))
    } else {
        drop(gguf);
        match args.gpus {
            1 => eprintln!("memra: loading {} on GPU {} ...", path.display(), args.device),
            n => eprintln!("memra: loading {} on GPUs 0..{n} ...", path.display()),
        }
        let policy = match (args.require_specialized, args.generic) {
            (true, _) => Policy::RequireSpecialized,
            (_, true) => Policy::GenericOnly,
            _ => Policy::Best,
        };
        let opts = GpuOptions { device: args.device, policy, max_ctx: args.ctx, graphs: !args.no_graphs, fuse_ffn: !args.no_fuse, fuse_norm: !args.no_fuse_norm, fuse_rope: !args.no_fuse_rope, fuse_combine: !args.no_fuse_combine, pdl: !args.no_pdl, omit: None };
        let model = match args.gpus {
            1 => models::load_gpu(path, &arch, &opts)?,
            n => crate::parallel::sharded::load_file(path, &arch, n as usize, &opts)?,
        };
        for line in model.report() {
            eprintln!("memra: {line}");
        }
        let n_ctx = model.max_ctx();
        (Backend::Gpu(model), n_ctx)
    };
    // The GPU loaders cap --ctx at the model's context: a cap is refused, not applied silently.
    if let Some(c) = args.ctx.filter(|&c| c > max_ctx) {
        return Err(ctx_too_big(c, max_ctx, "the model's hparams").into());
    }
    eprintln!(
        "memra: {arch} ready in {:.1} s (tokenizer {}); temp {} top-k {} top-p {} seed {seed}",
        load_start.elapsed().as_secs_f64(),
        tokenizer.describe(),
        config.temperature,
        config.top_k,
        config.top_p,
    );

    let prompt = tokenizer.encode(&args.prompt, true, true)?;
    if prompt.is_empty() {
        return Err("the prompt encodes to no tokens and the model adds no BOS".into());
    }
    if prompt.len() >= max_ctx {
        return Err(format!("the prompt has {} tokens; the context holds {max_ctx}", prompt.len()).into());
    }

    let mut out = std::io::stdout().lock();
    write!(out, "{}", args.prompt)?;
    out.flush()?;

    // Ctrl-C stops generation after the current token; the summary line still prints.
    let interrupted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let flag = interrupted.clone();
        if let Err(e) = ctrlc::set_handler(move || flag.store(true, std::sync::atomic::Ordering::SeqCst)) {
            eprintln!("memra: note: Ctrl-C will not stop generation cleanly ({e})");
        }
    }
    let stopped = || interrupted.load(std::sync::atomic::Ordering::SeqCst);

    let prefill_start = Instant::now();
    backend.forward(&prompt)?;
    let mut token = backend.next(&mut sampler, greedy)?;
    let prefill_time = prefill_start.elapsed();

    let mut decoder = tokenizer.stream_decoder(false);
    let mut decode_time = Duration::ZERO;
    let mut decode_steps = 0usize;
    let mut generated = 0usize;
    // Generation; `emit` borrows the output and the stream decoder until the block ends.
    {
        // Prints `token` unless generation ends before it; says whether to feed it back.
        let mut emit = |token: u32| -> Result<bool, Box<dyn Error>> {
            if generated == args.n_predict || (!args.ignore_eos && tokenizer.is_eog(token)) || stopped() {
                return Ok(false);
            }
            generated += 1;
            write!(out, "{}", decoder.push(token)?)?;
            out.flush()?;
            Ok(generated < args.n_predict)
        };
        if emit(token)? {
            let steps = (args.n_predict - 1).min(max_ctx - backend.len());
            match &mut backend {
                // Greedy on the GPU: steps feed each other on the device and run ahead of the printing.
                Backend::Gpu(model) if greedy => {
                    let start = Instant::now();
                    let mut failed = None;
                    decode_steps = model.decode_greedy(token, steps, &mut |t| {
                        emit(t).unwrap_or_else(|e| {
                            failed = Some(e);
                            false
                        })
                    })?;
                    decode_time = start.elapsed();
                    if let Some(e) = failed {
                        return Err(e);
                    }
                }
                _ => {
                    for _ in 0..steps {
                        let step = Instant::now();
                        backend.forward(&[token])?;
                        token = backend.next(&mut sampler, greedy)?;
                        decode_time += step.elapsed();
                        decode_steps += 1;
                        if !emit(token)? {
                            break;
                        }
                    }
                }
            }
        }
    }
    writeln!(out, "{}", decoder.finish())?;
    out.flush()?;
    if stopped() {
        eprintln!("memra: interrupted (Ctrl-C) after {generated} tokens");
    }

    let rate = |n: usize, t: Duration| if t.as_secs_f64() > 0.0 { n as f64 / t.as_secs_f64() } else { 0.0 };
    eprintln!(
        "memra: prefill {} tokens in {:.3} s ({:.1} tokens/s); decode {} tokens in {:.3} s ({:.1} tokens/s); {} generated",
        prompt.len(),
        prefill_time.as_secs_f64(),
        rate(prompt.len(), prefill_time),
        decode_steps,
        decode_time.as_secs_f64(),
        rate(decode_steps, decode_time),
        generated,
    );
    Ok(())
}
