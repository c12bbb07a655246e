//! `memra run`: generate text from a prompt. Only the CPU reference path (`--cpu`, gemma3)
//! exists so far; the GPU forward comes later.

use std::error::Error;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use memra_gguf::GgufFile;
use memra_reference::models::Gemma3;

use crate::sampling::{Sampler, SamplerConfig};
use crate::tokenizer::Tokenizer;

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The GGUF model file.
    pub model: PathBuf,
    /// The prompt. Special tokens written in it (e.g. `<start_of_turn>`) are recognized.
    #[arg(short, long)]
    pub prompt: String,
    /// Number of tokens to generate (generation also stops at an end-of-generation token).
    #[arg(short = 'n', long = "n-predict", default_value_t = 64)]
    pub n_predict: usize,
    /// Sampling temperature; 0 is greedy.
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
}

pub fn run(args: &RunArgs) -> Result<(), Box<dyn Error>> {
    if !args.cpu {
        return Err(
            "the GPU forward is not built yet; add --cpu to run the CPU reference forward \
                    (e.g. memra run MODEL.gguf -p \"...\" --cpu)"
                .into(),
        );
    }
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let config = SamplerConfig {
        temperature: args.temp,
        top_k: args.top_k,
        top_p: args.top_p,
        seed,
    };
    let mut sampler = Sampler::new(config)?;

    let path = &args.model;
    eprintln!(
        "memra: loading {} on the CPU (dequantizing every weight to f32) ...",
        path.display()
    );
    let load_start = Instant::now();
    let gguf = GgufFile::open(path)?;
    let arch = gguf.architecture()?.to_string();
    if arch != "gemma3" {
        return Err(format!(
            "{}: architecture \"{arch}\" has no CPU reference forward yet (only gemma3)",
            path.display()
        )
        .into());
    }
    let tokenizer = Tokenizer::from_gguf(&gguf)?;
    let model = Gemma3::from_gguf(&gguf)?;
    drop(gguf);
    let hp = &model.hparams;
    eprintln!(
        "memra: loaded {arch} ({} layers, n_embd {}, vocab {}, tokenizer {}) in {:.1} s; \
         temp {} top-k {} top-p {} seed {seed}",
        hp.n_layer,
        hp.n_embd,
        hp.n_vocab,
        tokenizer.describe(),
        load_start.elapsed().as_secs_f64(),
        config.temperature,
        config.top_k,
        config.top_p,
    );

    let prompt = tokenizer.encode(&args.prompt, true, true)?;
    if prompt.is_empty() {
        return Err("the prompt encodes to no tokens and the model adds no BOS".into());
    }
    if prompt.len() >= hp.n_ctx_train {
        return Err(format!(
            "the prompt has {} tokens; the context holds {}",
            prompt.len(),
            hp.n_ctx_train
        )
        .into());
    }

    let mut out = std::io::stdout().lock();
    write!(out, "{}", args.prompt)?;
    out.flush()?;

    let mut cache = model.new_cache();
    let prefill_start = Instant::now();
    let mut logits = model.forward(&mut cache, &prompt, false)?;
    let prefill_time = prefill_start.elapsed();

    let mut decoder = tokenizer.stream_decoder(false);
    let mut decode_time = Duration::ZERO;
    let mut decode_steps = 0usize;
    let mut generated = 0usize;
    while generated < args.n_predict {
        let token = sampler.sample(&logits);
        if tokenizer.is_eog(token) {
            break;
        }
        generated += 1;
        write!(out, "{}", decoder.push(token)?)?;
        out.flush()?;
        if generated == args.n_predict || cache.len() >= hp.n_ctx_train {
            break;
        }
        let step = Instant::now();
        logits = model.forward(&mut cache, &[token], false)?;
        decode_time += step.elapsed();
        decode_steps += 1;
    }
    writeln!(out, "{}", decoder.finish())?;
    out.flush()?;

    let rate = |n: usize, t: Duration| {
        if t.as_secs_f64() > 0.0 {
            n as f64 / t.as_secs_f64()
        } else {
            0.0
        }
    };
    eprintln!(
        "memra: prefill {} tokens in {:.2} s ({:.2} tokens/s); decode {} tokens in {:.2} s ({:.2} tokens/s); {} generated",
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
