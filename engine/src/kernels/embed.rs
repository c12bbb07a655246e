//! embed: token embedding gather from a GGUF table (`token_embd`, ne = [n_embd, n_vocab]) in its
//! own type into f32 rows, times a scale (gemma3: sqrt(n_embd)) (templates/memra/embed.cuh).

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};
use memra_gguf::GgmlType;

use crate::cuda::{Error, Kernel};
use crate::kernels::checks;
use crate::kernels::launch::{KernelArgs, launch};

pub const FAMILY: &str = "embed";
pub const DEFAULT_THREADS: u32 = 128;

/// Kernel parameters in order: `(const int* tokens, const void* table, float* out, int n_tokens,
/// int n_embd, int n_vocab, float scale)`.
#[derive(KernelArgs)]
#[kernel_args(family = "embed")]
pub struct EmbedArgs<'a> {
    pub tokens: CudaView<'a, i32>,
    pub table: CudaView<'a, u8>,
    pub out: CudaViewMut<'a, f32>,
    pub n_tokens: i32,
    pub n_embd: i32,
    pub n_vocab: i32,
    pub scale: f32,
}

pub fn launch_config(threads: u32, n_tokens: usize) -> LaunchConfig {
    checks::config((checks::grid_dim(n_tokens, 1, checks::GRID_Y_MAX), 1), threads)
}

/// The table type the variant was built for.
pub fn qtype(kernel: &Kernel) -> Result<GgmlType, Error> {
    let token = checks::required_sym(kernel, "qtype")?;
    GgmlType::from_name(token).ok_or_else(|| checks::invalid(kernel, format!("qtype `{token}` is not a ggml type")))
}

/// `out[t, :] = row tokens[t] of table · scale`. `table` holds `n_vocab` rows of
/// `row_bytes(qtype, n_embd)` bytes; `out` is `[n_tokens, n_embd]`. Out-of-range tokens are
/// refused by the kernel with NaN rows; check them on the host where they come from.
#[allow(clippy::too_many_arguments)]
pub fn embed(
    kernel: &Kernel,
    tokens: &CudaView<'_, i32>,
    table: &CudaView<'_, u8>,
    out: &mut CudaViewMut<'_, f32>,
    n_tokens: usize,
    n_embd: usize,
    n_vocab: usize,
    scale: f32,
) -> Result<(), Error> {
    let threads = checks::threads(kernel, DEFAULT_THREADS)?;
    let ty = qtype(kernel)?;
    checks::check_dim(kernel, "n_embd", n_embd)?;
    let row_bytes = ty
        .row_bytes(n_embd as u64)
        .filter(|_| n_embd > 0)
        .ok_or_else(|| checks::invalid(kernel, format!("n_embd={n_embd} is not a positive multiple of {}'s block of {}", ty.name(), ty.block_size())))?;
    let table_bytes = (row_bytes as usize).checked_mul(n_vocab).ok_or_else(|| checks::invalid(kernel, "table size overflows"))?;
    checks::check_len(kernel, "tokens", tokens.len(), n_tokens)?;
    checks::check_len(kernel, "table (bytes)", table.len(), table_bytes)?;
    checks::check_len(kernel, "out", out.len(), n_tokens.checked_mul(n_embd).ok_or_else(|| checks::invalid(kernel, "out size overflows"))?)?;
    if n_tokens == 0 {
        return Ok(());
    }
    let mut args = EmbedArgs {
        tokens: tokens.slice(..),
        table: table.slice(..),
        out: out.slice_mut(..),
        n_tokens: checks::to_i32(kernel, "n_tokens", n_tokens)?,
        n_embd: checks::to_i32(kernel, "n_embd", n_embd)?,
        n_vocab: checks::to_i32(kernel, "n_vocab", n_vocab)?,
        scale,
    };
    // SAFETY: tokens holds n_tokens ints, table n_vocab rows of the variant's qtype at n_embd,
    // out n_tokens·n_embd floats (checked); the kernel only reads rows of tokens in [0, n_vocab)
    // and writes rows < n_tokens; the float4 stores are used only when out is 16-byte aligned.
    unsafe { launch(kernel, launch_config(threads, n_tokens), &mut args) }
}
