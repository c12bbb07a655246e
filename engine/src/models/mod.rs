//! Model architectures: `spec` holds the typed hparams and weight structs generated from
//! `specs/<arch>.toml`; each architecture's GPU forward pass goes in `<arch>.rs` beside it, on
//! the shared building blocks of `gpu.rs`, and registers its loader in [`GPU_FORWARDS`].

pub mod decoder;
pub mod deepseek2;
pub mod gemma3;
pub mod glm_dsa;
pub mod gpu;
pub mod mla;
pub mod olmoe;
pub mod qwen3;
pub mod spec;
pub mod validate;

use std::path::Path;

pub use gpu::{GpuModelError, Result};

use crate::kernels::registry::Policy;

/// How a GPU model is set up.
#[derive(Clone, Debug)]
pub struct GpuOptions {
    pub device: usize,
    /// Specialized-or-generic choice for every kernel.
    pub policy: Policy,
    /// KV-cache positions (default and cap: the model's training context).
    pub max_ctx: Option<usize>,
    /// Replay decode steps as a captured CUDA graph.
    pub graphs: bool,
    /// Run a decode step's dense gated FFN (gate, up, activation) as one fused launch where
    /// the build has the variant.
    pub fuse_ffn: bool,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions { device: 0, policy: Policy::Best, max_ctx: None, graphs: true, fuse_ffn: true }
    }
}

/// A model loaded on the GPU: feed tokens, read the last position's logits.
pub trait GpuModel {
    /// Runs `tokens` at positions `len()..` (many tokens: batched prefill; one: a decode step),
    /// appending to the KV cache; the last token's logits stay on the device.
    fn forward(&mut self, tokens: &[u32]) -> Result<()>;
    /// The last position's logits (copied to the host; waits for the forward).
    fn logits(&self) -> Result<Vec<f32>>;
    /// The last position's greedy token (computed on the device; waits for the forward).
    fn argmax(&self) -> Result<u32>;
    /// Waits for all enqueued work.
    fn sync(&self) -> Result<()>;
    /// Positions in the KV cache.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// KV-cache capacity in positions.
    fn max_ctx(&self) -> usize;
    fn n_vocab(&self) -> usize;
    /// Bytes of weights on the device (what one decode step must read at least).
    fn weight_bytes(&self) -> usize;
    /// Forgets the cached positions (the next forward starts at position 0).
    fn reset(&mut self);
    /// What was loaded and which kernel variants were chosen (one line each).
    fn report(&self) -> &[String];
}

type Loader = fn(&Path, &GpuOptions) -> Result<Box<dyn GpuModel>>;

/// The architectures with a GPU forward, by GGUF `general.architecture`.
pub static GPU_FORWARDS: &[(&str, Loader)] = &[
    ("gemma3", |p, o| Ok(Box::new(gemma3::load(p, o)?))),
    ("qwen3", |p, o| Ok(Box::new(qwen3::load(p, o)?))),
    ("olmoe", |p, o| Ok(Box::new(olmoe::load(p, o)?))),
    ("glm-dsa", |p, o| Ok(Box::new(glm_dsa::load(p, o)?))),
    ("deepseek2", |p, o| Ok(Box::new(deepseek2::load(p, o)?))),
];

/// Loads the model at `path` on the GPU with the forward of its architecture, after
/// [`validate::validate_path`] has checked the whole header (before any GPU allocation).
pub fn load_gpu(path: &Path, arch: &str, opts: &GpuOptions) -> Result<Box<dyn GpuModel>> {
    match GPU_FORWARDS.iter().find(|(a, _)| *a == arch) {
        Some((_, load)) => {
            validate::validate_path(path).map_err(|e| gpu::err(e.to_string()))?;
            load(path, opts)
        }
        None => {
            let known: Vec<&str> = GPU_FORWARDS.iter().map(|(a, _)| *a).collect();
            Err(gpu::err(format!(
                "{}: architecture \"{arch}\" has no GPU forward yet (GPU forwards: {})",
                path.display(),
                known.join(", ")
            )))
        }
    }
}
