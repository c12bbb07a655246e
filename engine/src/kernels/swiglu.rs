//! swiglu / geglu: `out = act(gate) · up` over rows of `n_ff` f32 (templates/memra/swiglu.cuh,
//! geglu.cuh). One argument struct per family, one wrapper serving both.

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};

use crate::cuda::{Error, Kernel};
use crate::kernels::checks::{self, GRID_Y_MAX};
use crate::kernels::launch::{KernelArgs, launch};

pub const FAMILY: &str = "swiglu";
pub const DEFAULT_THREADS: u32 = 256;

/// Kernel parameters in order: `(const float* gate, const float* up, float* out, int n_rows,
/// int n_ff, int gate_stride, int up_stride)`.
#[derive(KernelArgs)]
#[kernel_args(family = "swiglu")]
pub struct SwigluArgs<'a> {
    pub gate: CudaView<'a, f32>,
    pub up: CudaView<'a, f32>,
    pub out: CudaViewMut<'a, f32>,
    pub n_rows: i32,
    pub n_ff: i32,
    pub gate_stride: i32,
    pub up_stride: i32,
}

pub fn launch_config(threads: u32, n_rows: usize, n_ff: usize) -> LaunchConfig {
    checks::config((checks::grid_dim(n_ff, 4 * threads as usize, i32::MAX as u32), checks::grid_dim(n_rows, 1, GRID_Y_MAX)), threads)
}

/// Where gate and up rows live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GluLayout {
    /// Floats between the starts of consecutive gate rows (`n_ff` packed, `2·n_ff` merged).
    pub gate_stride: usize,
    pub up_stride: usize,
}

impl GluLayout {
    /// Two packed `[n_rows, n_ff]` arrays.
    pub fn separate(n_ff: usize) -> GluLayout {
        GluLayout { gate_stride: n_ff, up_stride: n_ff }
    }
}

/// Validates and builds the common launch; `family` picks the args struct.
pub(crate) struct Checked {
    pub threads: u32,
    pub n_rows: i32,
    pub n_ff: i32,
    pub gate_stride: i32,
    pub up_stride: i32,
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn check(
    kernel: &Kernel,
    gate: &CudaView<'_, f32>,
    up: &CudaView<'_, f32>,
    out: &CudaViewMut<'_, f32>,
    n_rows: usize,
    n_ff: usize,
    layout: GluLayout,
) -> Result<Checked, Error> {
    let threads = checks::threads(kernel, DEFAULT_THREADS)?;
    if n_ff == 0 {
        return Err(checks::invalid(kernel, "n_ff = 0"));
    }
    checks::check_dim(kernel, "n_ff", n_ff)?;
    for (what, stride) in [("gate_stride", layout.gate_stride), ("up_stride", layout.up_stride)] {
        if stride < n_ff {
            return Err(checks::invalid(kernel, format!("{what}={stride} < n_ff={n_ff}: rows would overlap")));
        }
    }
    if n_rows > 0 {
        let need = |stride: usize| (n_rows - 1).checked_mul(stride).and_then(|v| v.checked_add(n_ff));
        let overflow = || checks::invalid(kernel, "row extent overflows");
        checks::check_len(kernel, "gate", gate.len(), need(layout.gate_stride).ok_or_else(overflow)?)?;
        checks::check_len(kernel, "up", up.len(), need(layout.up_stride).ok_or_else(overflow)?)?;
        checks::check_len(kernel, "out", out.len(), n_rows.checked_mul(n_ff).ok_or_else(overflow)?)?;
    }
    Ok(Checked {
        threads,
        n_rows: checks::to_i32(kernel, "n_rows", n_rows)?,
        n_ff: checks::to_i32(kernel, "n_ff", n_ff)?,
        gate_stride: checks::to_i32(kernel, "gate_stride", layout.gate_stride)?,
        up_stride: checks::to_i32(kernel, "up_stride", layout.up_stride)?,
    })
}

/// `out[r, i] = silu(gate[r·gs + i]) · up[r·us + i]`; `out` packed `[n_rows, n_ff]`.
/// Unaligned buffers or strides take the kernel's scalar path.
pub fn swiglu(
    kernel: &Kernel,
    gate: &CudaView<'_, f32>,
    up: &CudaView<'_, f32>,
    out: &mut CudaViewMut<'_, f32>,
    n_rows: usize,
    n_ff: usize,
    layout: GluLayout,
) -> Result<(), Error> {
    let c = check(kernel, gate, up, out, n_rows, n_ff, layout)?;
    if n_rows == 0 {
        return Ok(());
    }
    let mut args = SwigluArgs {
        gate: gate.slice(..),
        up: up.slice(..),
        out: out.slice_mut(..),
        n_rows: c.n_rows,
        n_ff: c.n_ff,
        gate_stride: c.gate_stride,
        up_stride: c.up_stride,
    };
    // SAFETY: gate / up hold (n_rows−1)·stride + n_ff floats and out n_rows·n_ff (checked);
    // the kernel reads exactly those and writes out rows < n_rows of the baked n_ff = n_ff.
    unsafe { launch(kernel, launch_config(c.threads, n_rows, n_ff), &mut args) }
}
