//! moe_router: router logits `[T, n_expert]` → top-k expert ids and routing weights per token
//! (templates/memra/moe_router.cuh; memra-reference `moe::route`).

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};

use crate::cuda::{Error, Kernel};
use crate::kernels::checks;
use crate::kernels::launch::{KernelArgs, launch};

pub const FAMILY: &str = "moe_router";
pub const DEFAULT_THREADS: u32 = 128;
/// Generic variants hold up to 16 experts per lane.
pub const MAX_EXPERTS: usize = 512;
/// One lane per selected expert.
pub const MAX_USED: usize = 32;

/// Kernel parameters in order: `(const float* logits, const float* bias, int* ids,
/// float* weights, int n_tokens, int n_expert, int n_used, int norm, float scale)`. `bias` is a
/// raw device address, 0 = no selection bias.
#[derive(KernelArgs)]
#[kernel_args(family = "moe_router")]
pub struct MoeRouterArgs<'a> {
    pub logits: CudaView<'a, f32>,
    pub bias: u64,
    pub ids: CudaViewMut<'a, i32>,
    pub weights: CudaViewMut<'a, f32>,
    pub n_tokens: i32,
    pub n_expert: i32,
    pub n_used: i32,
    pub norm: i32,
    pub scale: f32,
}

/// Router probability function the variant bakes (`memra::Gating`; GGUF `expert_gating_func`
/// 1 / 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    Softmax,
    Sigmoid,
}

pub fn gating(kernel: &Kernel) -> Result<Gating, Error> {
    match checks::required_sym(kernel, "gating")? {
        "softmax" => Ok(Gating::Softmax),
        "sigmoid" => Ok(Gating::Sigmoid),
        g => Err(checks::invalid(
            kernel,
            format!("gating `{g}` is neither softmax nor sigmoid"),
        )),
    }
}

pub fn launch_config(threads: u32, n_tokens: usize) -> LaunchConfig {
    checks::config(
        (checks::grid_dim(n_tokens, threads as usize / 32, 65535), 1),
        threads,
    )
}

/// Routes `n_tokens` tokens: `ids`, `weights` `[n_tokens, n_used]` in selection order (best
/// first). `bias` (`exp_probs_b`, `[n_expert]`) shifts the selection only; `norm` divides the
/// weights by their sum (at least 2^−14); `scale` multiplies them unless it is 0 or 1.
#[allow(clippy::too_many_arguments)]
pub fn moe_router(
    kernel: &Kernel,
    logits: &CudaView<'_, f32>,
    bias: Option<&CudaView<'_, f32>>,
    ids: &mut CudaViewMut<'_, i32>,
    weights: &mut CudaViewMut<'_, f32>,
    n_tokens: usize,
    n_expert: usize,
    n_used: usize,
    norm: bool,
    scale: f32,
) -> Result<(), Error> {
    let threads = checks::threads(kernel, DEFAULT_THREADS)?;
    checks::check_dim(kernel, "n_expert", n_expert)?;
    checks::check_dim(kernel, "n_used", n_used)?;
    let cap = checks::baked_int(kernel.variant(), "n_expert").map_or(MAX_EXPERTS, |v| v as usize);
    if n_expert == 0 || n_expert > cap {
        return Err(checks::invalid(
            kernel,
            format!("n_expert={n_expert} is not in 1..={cap}"),
        ));
    }
    if n_used == 0 || n_used > MAX_USED || n_used > n_expert {
        return Err(checks::invalid(
            kernel,
            format!("n_used={n_used} is not in 1..=min({MAX_USED}, n_expert={n_expert})"),
        ));
    }
    if !scale.is_finite() {
        return Err(checks::invalid(
            kernel,
            format!("scale={scale} is not finite"),
        ));
    }
    let too_big = || checks::invalid(kernel, "n_tokens·n_expert overflows");
    checks::check_len(
        kernel,
        "logits",
        logits.len(),
        n_tokens.checked_mul(n_expert).ok_or_else(too_big)?,
    )?;
    checks::check_len(kernel, "ids", ids.len(), n_tokens * n_used)?;
    checks::check_len(kernel, "weights", weights.len(), n_tokens * n_used)?;
    let bias_ptr = match bias {
        Some(b) => {
            checks::check_len(kernel, "bias", b.len(), n_expert)?;
            checks::device_addr(kernel, b)
        }
        None => 0,
    };
    if n_tokens == 0 {
        return Ok(());
    }
    let mut args = MoeRouterArgs {
        logits: logits.slice(..),
        bias: bias_ptr,
        ids: ids.slice_mut(..),
        weights: weights.slice_mut(..),
        n_tokens: checks::to_i32(kernel, "n_tokens", n_tokens)?,
        n_expert: checks::to_i32(kernel, "n_expert", n_expert)?,
        n_used: n_used as i32,
        norm: norm as i32,
        scale,
    };
    // SAFETY: logits hold n_tokens·n_expert floats, ids / weights n_tokens·n_used, bias (when
    // non-null) n_expert floats and outlives the launch on this stream (checked); n_expert and
    // n_used are within the variant's capacity (the kernel traps otherwise); block = THREADS.
    unsafe { launch(kernel, launch_config(threads, n_tokens), &mut args) }
}
