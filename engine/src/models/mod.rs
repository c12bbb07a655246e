//! Model architectures: `spec` holds the typed hparams and weight structs generated from
//! `specs/<arch>.toml`; each architecture's GPU forward pass goes in `<arch>.rs` beside it
//! (`pub fn load(&Path, &GpuOptions)`), on the shared building blocks of `gpu.rs` / `decoder.rs`
//! / `mla.rs`; build.rs declares the module and its [`GPU_FORWARDS`] entry.

pub mod decoder;
pub mod gpu;
pub mod mla;
pub mod moe_grouped;
pub mod spec;
pub mod validate;

use std::path::Path;

pub use gpu::{GREEDY_READ, GpuModelError, Result};

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
    /// Fuse each decode step's residual add + RMSNorm into the projection after it
    /// (norm_matvec: q/k/v, the dense gated FFN, the LM head) instead of add_rmsnorm launches.
    pub fuse_norm: bool,
    /// Run a decode step's QK-norm + RoPE + KV-cache write inside its attention launch
    /// (attn_decode_rope) instead of a qk_norm_rope launch before it.
    pub fuse_rope: bool,
    /// Combine a decode step's attention splits inside the output projection (combine_matvec:
    /// the attention leaves its partials) instead of in the attention's last block, up to the
    /// variant's `max_splits`.
    pub fuse_combine: bool,
    /// Link a captured decode step's kernels by programmatic dependent launch (sm_90+, graphs
    /// only): each kernel starts while the previous one finishes, and the projections and the
    /// attention load their weights and first cache rows before waiting for it.
    pub pdl: bool,
    /// Leave this role's launches out of every decode step (the outputs are then wrong: for
    /// `memra bench --model --breakdown`, which times the step without each role). Only the
    /// GQA decoder's fused decode step of a dense model takes it; other stacks refuse it.
    pub omit: Option<StepRole>,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions { device: 0, policy: Policy::Best, max_ctx: None, graphs: true, fuse_ffn: true, fuse_norm: true, fuse_rope: true, fuse_combine: true, pdl: true, omit: None }
    }
}

/// What a decode step's launches do, as `memra bench --model --breakdown` groups them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepRole {
    /// The q/k/v projections (with the residual add + RMSNorm before them).
    Qkv,
    /// QK-norm + RoPE + KV-cache write + attention (one attn_decode_rope launch per layer).
    Attention,
    /// The attention output projection.
    OutProj,
    /// Gate and up with the activation (and the residual add + RMSNorm before them).
    GateUp,
    Down,
    /// The LM head (with the final residual add + RMSNorm).
    LmHead,
    Argmax,
}

impl StepRole {
    pub const ALL: [StepRole; 7] = [StepRole::Qkv, StepRole::Attention, StepRole::OutProj, StepRole::GateUp, StepRole::Down, StepRole::LmHead, StepRole::Argmax];

    pub fn label(self) -> &'static str {
        match self {
            StepRole::Qkv => "q/k/v",
            StepRole::Attention => "attention",
            StepRole::OutProj => "o-projection",
            StepRole::GateUp => "gate/up",
            StepRole::Down => "down",
            StepRole::LmHead => "LM head",
            StepRole::Argmax => "argmax",
        }
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
    /// Greedy decoding: up to `n` steps, the first on `first` at position `len()`, each later
    /// one on the previous step's greedy token; every step's token goes to `on_token` in order,
    /// and `false` from it ends decoding there (that token is not fed back). Returns the steps
    /// taken, which is how far `len()` advanced. The last logits are then unspecified: a stack
    /// may have run steps ahead and taken them back. Refuses `n` steps past the context.
    fn decode_greedy(&mut self, first: u32, n: usize, on_token: &mut dyn FnMut(u32) -> bool) -> Result<usize> {
        let mut token = first;
        for step in 0..n {
            self.forward(&[token])?;
            token = self.argmax()?;
            if !on_token(token) {
                return Ok(step + 1);
            }
        }
        Ok(n)
    }
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

// One `pub mod <arch>` per forward file `models/<arch>.rs` beside this one and its
// `GPU_FORWARDS` entry, generated by build.rs from specs/ (adding an architecture: a spec and
// its forward file).
include!(concat!(env!("OUT_DIR"), "/gpu_forwards.rs"));

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
