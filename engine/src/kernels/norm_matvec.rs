//! norm_matvec: a decode projection with the residual add and RMSNorm before it fused in, one
//! token (templates/memra/norm_matvec.cuh): `r = x + d` with `d = delta` or
//! `rmsnorm(delta)·delta_w` (or no add), `x_out = r` when asked, `h = rmsnorm(r)·norm_w`, then
//! `y = W·h` (glu none) or `y = act(Wg·h) ⊙ (Wu·h)` (swiglu / geglu). Every block normalizes
//! the row itself while its first weight chunks load: no add_rmsnorm launch between two decode
//! matvecs. matvec's streaming core, units and geometry.

use cudarc::driver::{CudaView, CudaViewMut, DevicePtrMut};

use crate::cuda::{Error, Kernel};
use crate::kernels::checks;
use crate::kernels::launch::{KernelArgs, launch};
use crate::kernels::matvec::{self, MatvecTuning};

pub const FAMILY: &str = "norm_matvec";

/// Kernel parameters in order: `(const unsigned char* w, const unsigned char* w_up,
/// const float* x, const float* delta, const float* delta_w, const float* norm_w, float* x_out,
/// float* y, int k, int n, int flags, float eps)`.
#[derive(KernelArgs)]
#[kernel_args(family = "norm_matvec")]
pub struct NormMatvecArgs<'a> {
    pub w: CudaView<'a, u8>,
    pub w_up: CudaView<'a, u8>,
    pub x: CudaView<'a, f32>,
    pub delta: CudaView<'a, f32>,
    pub delta_w: CudaView<'a, f32>,
    pub norm_w: CudaView<'a, f32>,
    /// Device address of `x_out`; 0 when the launch does not write it (flag clear).
    pub x_out: u64,
    pub y: CudaViewMut<'a, f32>,
    pub k: i32,
    pub n: i32,
    pub flags: i32,
    pub eps: f32,
}

/// `flags` bits (norm_matvec.cuh `NormFlags`).
const ADD: i32 = 1;
const DELTA_NORM: i32 = 2;
const WRITE_X: i32 = 4;

/// The variant's `GLU` (`memra::Glu`): a plain projection, or gate and up with an activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Glu {
    None,
    Swiglu,
    Geglu,
}

impl Glu {
    pub fn token(self) -> &'static str {
        match self {
            Glu::None => "none",
            Glu::Swiglu => "swiglu",
            Glu::Geglu => "geglu",
        }
    }

    /// From the variant's `glu` token.
    pub fn from_token(token: &str) -> Option<Glu> {
        [Glu::None, Glu::Swiglu, Glu::Geglu].into_iter().find(|g| g.token() == token)
    }

    fn is_paired(self) -> bool {
        self != Glu::None
    }
}

pub fn glu(kernel: &Kernel) -> Result<Glu, Error> {
    let g = checks::required_sym(kernel, "glu")?;
    Glu::from_token(g).ok_or_else(|| checks::invalid(kernel, format!("glu `{g}` is not none, swiglu or geglu")))
}

/// The variant's tuning: matvec's fields with BATCH 1; `XQ8 = 1` is matvec's fused integer
/// path (`xq8` and `fuse_x`: h quantized in shared memory).
pub fn tuning(kernel: &Kernel) -> Result<MatvecTuning, Error> {
    let t = matvec::tuning(kernel)?;
    let xq8 = checks::baked_int(kernel.variant(), "xq8").unwrap_or(0);
    if !(0..=1).contains(&xq8) {
        return Err(checks::invalid(kernel, format!("xq8={xq8} is out of range (0 or 1)")));
    }
    Ok(MatvecTuning { batch: 1, accumulate: false, xq8: xq8 == 1, fuse_x: xq8 == 1, ..t })
}

/// Bytes of the normalized row in shared memory at `k` (`NormMatvecGeometry::xrow_bytes`): f32
/// in padded units, or with `xq8` its q8 form followed by the k floats unpadded.
pub fn xrow_bytes(ty: memra_gguf::GgmlType, k: usize, xq8: bool) -> Option<u32> {
    let u = matvec::unit_shape(ty)?;
    if xq8 {
        return matvec::fused_x_row_bytes(ty, k)?.checked_add(u32::try_from((4 * k).div_ceil(16) * 16).ok()?);
    }
    let units = k / u.unit_elems as usize;
    u32::try_from((units * (u.unit_elems as usize + 4) * 4).div_ceil(16) * 16).ok()
}

/// What is added to the residual before the norm.
#[derive(Clone, Copy)]
pub struct Residual<'s, 'a> {
    /// The branch output added to `x`.
    pub delta: &'s CudaView<'a, f32>,
    /// RMS-normalize `delta` with these weights first (sandwich norms).
    pub delta_w: Option<&'s CudaView<'a, f32>>,
}

/// The weights of one launch: `w`, and `w_up` for a paired variant (same type and shape).
pub struct NormMatvecWeights<'s, 'a> {
    pub w: &'s CudaView<'a, u8>,
    pub w_up: Option<&'s CudaView<'a, u8>>,
}

/// `y = W·rmsnorm(x + d)·norm_w` (see the module doc) for one token: `w` `n` rows of the
/// variant's qtype at `k`; `x`, `norm_w`, `x_out` (when given, the updated residual `x + d`;
/// not `x`'s buffer) and the residual's vectors `k` floats; `y` `n` floats. Grid: resident.
#[allow(clippy::too_many_arguments)]
pub fn norm_matvec(
    kernel: &Kernel,
    weights: &NormMatvecWeights<'_, '_>,
    x: &CudaView<'_, f32>,
    add: Option<Residual<'_, '_>>,
    norm_w: &CudaView<'_, f32>,
    x_out: Option<&mut CudaViewMut<'_, f32>>,
    y: &mut CudaViewMut<'_, f32>,
    k: usize,
    n: usize,
    eps: f32,
) -> Result<(), Error> {
    let ty = matvec::qtype(kernel)?;
    let glu = glu(kernel)?;
    let tune = tuning(kernel)?;
    checks::check_dim(kernel, "k", k)?;
    checks::check_dim(kernel, "n", n)?;
    if glu.is_paired() && tune.rows_per_group % 2 != 0 {
        return Err(checks::invalid(kernel, format!("glu {} needs an even rows_per_group", glu.token())));
    }
    matvec::check_weight(kernel, ty, weights.w.len(), k, n)?;
    checks::check_aligned16(kernel, "w", weights.w)?;
    let w_up = matvec::paired_weight(kernel, ty, weights.w, weights.w_up, (k, n), (glu.is_paired(), &format!("glu {}", glu.token())))?;
    checks::check_len(kernel, "x", x.len(), k)?;
    checks::check_len(kernel, "norm_w", norm_w.len(), k)?;
    checks::check_len(kernel, "y", y.len(), n)?;
    let mut flags = 0;
    let (delta, delta_w) = match add {
        Some(r) => {
            checks::check_len(kernel, "delta", r.delta.len(), k)?;
            flags |= ADD;
            let dw = match r.delta_w {
                Some(dw) => {
                    checks::check_len(kernel, "delta_w", dw.len(), k)?;
                    flags |= DELTA_NORM;
                    dw.slice(..)
                }
                None => norm_w.slice(..),
            };
            (r.delta.slice(..), dw)
        }
        None => (x.slice(..), norm_w.slice(..)),
    };
    let (x_out, _x_out_guard) = match x_out {
        Some(o) => {
            checks::check_len(kernel, "x_out", o.len(), k)?;
            let bytes = 4 * k as u64;
            let out = checks::device_addr(kernel, o);
            let overlaps = |b: u64| out < b + bytes && b < out + bytes;
            if overlaps(checks::device_addr(kernel, x)) || (flags & ADD != 0 && overlaps(checks::device_addr(kernel, &delta))) {
                return Err(checks::invalid(kernel, "x_out must be a buffer of its own (other blocks still read x and delta)"));
            }
            flags |= WRITE_X;
            let (ptr, guard) = o.device_ptr_mut(kernel.stream());
            (ptr, Some(guard))
        }
        None => (0, None),
    };
    let mut geo = matvec::geometry(ty, &tune, matvec::baked_k(kernel)).expect("qtype checked above");
    if tune.xq8 && !matvec::int_dot(ty) {
        return Err(checks::invalid(kernel, format!("xq8 needs a weight type with an integer path, not {ty:?}")));
    }
    geo.smem_bytes = geo.smem_bytes.saturating_add(xrow_bytes(ty, k, tune.xq8).unwrap_or(u32::MAX));
    if geo.smem_bytes > matvec::MAX_DYNAMIC_SMEM {
        return Err(checks::invalid(
            kernel,
            format!("k={k}: {} bytes of shared memory (the normalized row included) > {}", geo.smem_bytes, matvec::MAX_DYNAMIC_SMEM),
        ));
    }
    matvec::allow_smem(kernel, geo.smem_bytes)?;
    let tile_rows = if glu.is_paired() { 2 * n } else { n };
    let max_blocks = matvec::resident_blocks(kernel, &geo)?;
    let config = matvec::launch_config_blocks(&geo, tile_rows, max_blocks);
    let mut args = NormMatvecArgs {
        w: weights.w.slice(..),
        w_up,
        x: x.slice(..),
        delta,
        delta_w,
        norm_w: norm_w.slice(..),
        x_out,
        y: y.slice_mut(..),
        k: checks::to_i32(kernel, "k", k)?,
        n: checks::to_i32(kernel, "n", n)?,
        flags,
        eps,
    };
    // SAFETY: x_out (WRITE_X) is the address of a live buffer of k floats whose guard lives
    // past the launch; w (and w_up when paired) hold n rows of row_bytes(qtype, k) bytes, 16-byte aligned;
    // x, norm_w and every flagged vector k floats, y n floats (checked above); x_out is not x or
    // delta (checked); any grid of 1..=tiles blocks covers the tile rows and the dynamic shared
    // memory is matvec's with BATCH 1 plus the normalized row (the kernel traps if smaller).
    unsafe { launch(kernel, config, &mut args) }
}
