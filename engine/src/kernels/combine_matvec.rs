//! combine_matvec: a decode output projection with the attention's split combine fused in, one
//! token (templates/memra/combine_matvec.cuh). attn_decode / attn_decode_rope launched for
//! partials ([`crate::kernels::attn_decode::attn_decode_partials`]) leave every split's partials
//! in their workspace; each block of this kernel merges them into its x row in shared memory,
//! then runs matvec's streaming core: `y = W·x`. The attention's last-block combine and the wait
//! for it leave the decode step. matvec's units and geometry, norm_matvec's row in shared memory.

use cudarc::driver::{CudaView, CudaViewMut};

use crate::cuda::{Error, Kernel};
use crate::kernels::launch::{KernelArgs, launch};
use crate::kernels::matvec::{self, MatvecTuning};
use crate::kernels::{attn_decode, checks, norm_matvec};

pub const FAMILY: &str = "combine_matvec";

/// templates/README.md default of `MAX_SPLITS`.
pub const DEFAULT_MAX_SPLITS: usize = 32;

/// Kernel parameters in order: `(const unsigned char* w, const float* work, float* y, int k,
/// int n, int head_dim, int n_split)`.
#[derive(KernelArgs)]
#[kernel_args(family = "combine_matvec")]
pub struct CombineMatvecArgs<'a> {
    pub w: CudaView<'a, u8>,
    pub work: CudaView<'a, f32>,
    pub y: CudaViewMut<'a, f32>,
    pub k: i32,
    pub n: i32,
    pub head_dim: i32,
    pub n_split: i32,
}

/// The most splits the variant combines (`MAX_SPLITS`, host side): past it the attention
/// combines them itself and the projection is a plain matvec.
pub fn max_splits(kernel: &Kernel) -> Result<usize, Error> {
    let m = checks::baked_int(kernel.variant(), "max_splits").unwrap_or(DEFAULT_MAX_SPLITS as i64);
    usize::try_from(m).ok().filter(|&m| m >= 1).ok_or_else(|| checks::invalid(kernel, format!("max_splits={m} is not positive")))
}

/// The variant's tuning: matvec's fields with BATCH 1 and f32 x.
pub fn tuning(kernel: &Kernel) -> Result<MatvecTuning, Error> {
    Ok(MatvecTuning { batch: 1, accumulate: false, xq8: false, fuse_x: false, ..matvec::tuning(kernel)? })
}

/// `y = W·x` for one token, `x` the attention output of `k / head_dim` heads combined from the
/// `n_split` splits' partials in `work` (attn_decode's workspace of one sequence, as a launch
/// for partials leaves it): `w` `n` rows of the variant's qtype at `k`, `y` `n` floats.
/// Grid: resident.
#[allow(clippy::too_many_arguments)]
pub fn combine_matvec(
    kernel: &Kernel,
    w: &CudaView<'_, u8>,
    work: &CudaView<'_, f32>,
    y: &mut CudaViewMut<'_, f32>,
    k: usize,
    n: usize,
    head_dim: usize,
    n_split: usize,
) -> Result<(), Error> {
    let ty = matvec::qtype(kernel)?;
    let tune = tuning(kernel)?;
    checks::check_dim(kernel, "k", k)?;
    checks::check_dim(kernel, "n", n)?;
    checks::check_dim(kernel, "head_dim", head_dim)?;
    if head_dim == 0 || !head_dim.is_multiple_of(4) || !k.is_multiple_of(head_dim) {
        return Err(checks::invalid(kernel, format!("k={k} is not a whole number of heads of head_dim={head_dim} (a multiple of 4)")));
    }
    // As i32 before any size arithmetic: the kernel takes i32s, and the workspace size below
    // cannot overflow then.
    let (k_i, n_i) = (checks::to_i32(kernel, "k", k)?, checks::to_i32(kernel, "n", n)?);
    let (head_dim_i, n_split_i) = (checks::to_i32(kernel, "head_dim", head_dim)?, checks::to_i32(kernel, "n_split", n_split)?);
    if n_split == 0 {
        return Err(checks::invalid(kernel, "n_split=0: there are no partials to combine".to_string()));
    }
    matvec::check_weight(kernel, ty, w.len(), k, n)?;
    checks::check_aligned16(kernel, "w", w)?;
    checks::check_len(kernel, "work", work.len(), attn_decode::work_floats(1, k / head_dim, head_dim, n_split))?;
    checks::check_aligned16(kernel, "work", work)?;
    checks::check_len(kernel, "y", y.len(), n)?;
    let mut geo = matvec::geometry(ty, &tune, matvec::baked_k(kernel)).expect("qtype checked above");
    geo.smem_bytes = geo.smem_bytes.saturating_add(norm_matvec::xrow_bytes(ty, k, false).unwrap_or(u32::MAX));
    if geo.smem_bytes > matvec::MAX_DYNAMIC_SMEM {
        return Err(checks::invalid(
            kernel,
            format!("k={k}: {} bytes of shared memory (the combined row included) > {}", geo.smem_bytes, matvec::MAX_DYNAMIC_SMEM),
        ));
    }
    matvec::allow_smem(kernel, geo.smem_bytes)?;
    let max_blocks = matvec::resident_blocks(kernel, &geo)?;
    let config = matvec::launch_config_blocks(&geo, n, max_blocks);
    let mut args = CombineMatvecArgs {
        w: w.slice(..),
        work: work.slice(..),
        y: y.slice_mut(..),
        k: k_i,
        n: n_i,
        head_dim: head_dim_i,
        n_split: n_split_i,
    };
    // SAFETY: w holds n rows of row_bytes(qtype, k) bytes, 16-byte aligned; work the counters
    // and the partials of k / head_dim heads × n_split splits (16-byte aligned: float4 reads),
    // y n floats (checked above); head_dim divides k; any grid of 1..=tiles blocks covers the
    // rows and the dynamic shared memory is matvec's with BATCH 1 plus the row (the kernel traps
    // if smaller).
    unsafe { launch(kernel, config, &mut args) }
}
