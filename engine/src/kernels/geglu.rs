//! geglu: `out = gelu_tanh(gate) · up` (gemma3 FFN) over rows of `n_ff` f32
//! (templates/memra/geglu.cuh). Geometry and checks are swiglu's.

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};

use crate::cuda::{Error, Kernel};
use crate::kernels::launch::{KernelArgs, launch};
use crate::kernels::swiglu::{self, GluLayout};

pub const FAMILY: &str = "geglu";
pub const DEFAULT_THREADS: u32 = 256;

/// Kernel parameters in order: `(const float* gate, const float* up, float* out, int n_rows,
/// int n_ff, int gate_stride, int up_stride)`.
#[derive(KernelArgs)]
#[kernel_args(family = "geglu")]
pub struct GegluArgs<'a> {
    pub gate: CudaView<'a, f32>,
    pub up: CudaView<'a, f32>,
    pub out: CudaViewMut<'a, f32>,
    pub n_rows: i32,
    pub n_ff: i32,
    pub gate_stride: i32,
    pub up_stride: i32,
}

pub fn launch_config(threads: u32, n_rows: usize, n_ff: usize) -> LaunchConfig {
    swiglu::launch_config(threads, n_rows, n_ff)
}

/// `out[r, i] = gelu_tanh(gate[r·gs + i]) · up[r·us + i]`; `out` packed `[n_rows, n_ff]`.
pub fn geglu(
    kernel: &Kernel,
    gate: &CudaView<'_, f32>,
    up: &CudaView<'_, f32>,
    out: &mut CudaViewMut<'_, f32>,
    n_rows: usize,
    n_ff: usize,
    layout: GluLayout,
) -> Result<(), Error> {
    let c = swiglu::check(kernel, gate, up, out, n_rows, n_ff, layout)?;
    if n_rows == 0 {
        return Ok(());
    }
    let mut args = GegluArgs {
        gate: gate.slice(..),
        up: up.slice(..),
        out: out.slice_mut(..),
        n_rows: c.n_rows,
        n_ff: c.n_ff,
        gate_stride: c.gate_stride,
        up_stride: c.up_stride,
    };
    // SAFETY: as swiglu: buffer extents checked against n_rows, n_ff and the strides.
    unsafe { launch(kernel, launch_config(c.threads, n_rows, n_ff), &mut args) }
}
