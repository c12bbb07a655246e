//! quantize_q8: f32 rows → q8 rows (int8 blocks of 32 with an f32 scale and the block's Σq),
//! the x of matvec / moe_matvec variants with `xq8` (templates/memra/quantize_q8.cuh).
//!
//! Reuse: quantize an activation once ([`quantize_q8`] into a buffer of [`row_floats`]`(k)`
//! floats per row) and pass that buffer as `x` (with `ldx = row_floats(k)`) to every xq8 launch
//! that reads it — q, k and v or gate and up of a decode step.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, LaunchConfig};

use crate::cuda::{Error, Kernel};
use crate::kernels::checks::{self, GRID_Y_MAX};
use crate::kernels::launch::{KernelArgs, launch};

pub const FAMILY: &str = "quantize_q8";
/// templates/README.md default of `THREADS`.
pub const DEFAULT_THREADS: u32 = 256;
/// Elements per q8 block.
pub const BLOCK: usize = 32;

/// Kernel parameters in order: `(const float* x, float* xq, int k, int rows, int ldx, int ldq)`.
#[derive(KernelArgs)]
#[kernel_args(family = "quantize_q8")]
pub struct QuantizeQ8Args<'a> {
    pub x: CudaView<'a, f32>,
    pub xq: CudaViewMut<'a, f32>,
    pub k: i32,
    pub rows: i32,
    pub ldx: i32,
    pub ldq: i32,
}

/// Bytes of a q8 row of `k` elements: `k` int8, `k/32` (d, Σq) f32 pairs, padded to 16
/// (`memra_reference::q8::q8_row_bytes`).
pub fn row_bytes(k: usize) -> usize {
    (k + k / 4).div_ceil(16) * 16
}

/// [`row_bytes`] in floats: the densest `ldq` (and the xq8 kernels' `ldx`).
pub fn row_floats(k: usize) -> usize {
    row_bytes(k) / 4
}

pub fn launch_config(threads: u32, k: usize, rows: usize) -> LaunchConfig {
    let warps = (threads / 32).max(1) as usize;
    checks::config(
        (
            checks::grid_dim(k / BLOCK, warps, i32::MAX as u32),
            checks::grid_dim(rows, 1, GRID_Y_MAX),
        ),
        threads,
    )
}

/// Quantizes `rows` rows of `x` (`[rows][ldx]`, `k` used) into `xq` (`[rows][ldq]` floats of
/// q8 rows). `k` a multiple of 32; `ldq ≥ row_floats(k)`, a multiple of 4; xq 16-byte aligned
/// (the xq8 kernels copy it with cp.async).
#[allow(clippy::too_many_arguments)]
pub fn quantize_q8(
    kernel: &Kernel,
    x: &CudaView<'_, f32>,
    xq: &mut CudaViewMut<'_, f32>,
    k: usize,
    rows: usize,
    ldx: usize,
    ldq: usize,
) -> Result<(), Error> {
    let threads = checks::threads(kernel, DEFAULT_THREADS)?;
    if k == 0 || !k.is_multiple_of(BLOCK) {
        return Err(checks::invalid(
            kernel,
            format!("k={k} is not a positive multiple of {BLOCK}"),
        ));
    }
    if ldx < k || ldq < row_floats(k) || !ldq.is_multiple_of(4) {
        return Err(checks::invalid(
            kernel,
            format!(
                "ldx={ldx} must be >= k={k}; ldq={ldq} must be >= {} and a multiple of 4",
                row_floats(k)
            ),
        ));
    }
    if rows == 0 {
        return Ok(());
    }
    let overflow = || checks::invalid(kernel, "sizes overflow");
    checks::check_len(
        kernel,
        "x",
        x.len(),
        (rows - 1).checked_mul(ldx).ok_or_else(overflow)? + k,
    )?;
    checks::check_len(
        kernel,
        "xq",
        xq.len(),
        (rows - 1).checked_mul(ldq).ok_or_else(overflow)? + row_floats(k),
    )?;
    checks::check_aligned16(kernel, "xq", xq)?;
    let mut args = QuantizeQ8Args {
        x: x.slice(..),
        xq: xq.slice_mut(..),
        k: checks::to_i32(kernel, "k", k)?,
        rows: checks::to_i32(kernel, "rows", rows)?,
        ldx: checks::to_i32(kernel, "ldx", ldx)?,
        ldq: checks::to_i32(kernel, "ldq", ldq)?,
    };
    // SAFETY: x holds rows of ldx ≥ k floats and xq rows of ldq ≥ row_floats(k) floats (checked);
    // the kernel reads x[r][0..k) and writes xq row r's first k + k/4 bytes for r < rows; any
    // grid is correct (grid strides), the block size is the variant's THREADS.
    unsafe { launch(kernel, launch_config(threads, k, rows), &mut args) }
}

/// A device buffer of q8 rows for one activation of up to `rows` rows of `k`: quantize once
/// ([`Q8Activation::quantize`]), then pass [`Q8Activation::view`] as `x` with `ldx =`
/// [`Q8Activation::ld`] to every xq8 matvec / moe_matvec reading that activation. Allocated
/// once (outside CUDA graph capture); `quantize` only launches, so it can be captured.
pub struct Q8Activation {
    buf: CudaSlice<f32>,
    k: usize,
    rows: usize,
}

impl Q8Activation {
    pub fn new(stream: &Arc<CudaStream>, k: usize, rows: usize) -> Result<Q8Activation, Error> {
        let n = rows.max(1) * row_floats(k);
        let buf = stream.alloc_zeros::<f32>(n).map_err(|e| {
            Error::driver(
                format!("cuMemAlloc of a q8 activation ({rows} rows of k={k}, {n} floats)"),
                e,
            )
        })?;
        Ok(Q8Activation { buf, k, rows })
    }

    /// Quantizes `rows` rows of `x` (`[rows][ldx]`) with the quantize_q8 `kernel`.
    pub fn quantize(
        &mut self,
        kernel: &Kernel,
        x: &CudaView<'_, f32>,
        rows: usize,
        ldx: usize,
    ) -> Result<(), Error> {
        if rows > self.rows {
            return Err(checks::invalid(
                kernel,
                format!("{rows} rows > the {} this q8 activation holds", self.rows),
            ));
        }
        let ld = self.ld();
        quantize_q8(
            kernel,
            x,
            &mut self.buf.slice_mut(..),
            self.k,
            rows,
            ldx,
            ld,
        )
    }

    pub fn view(&self) -> CudaView<'_, f32> {
        self.buf.slice(..)
    }

    /// Row stride in floats (the xq8 kernels' `ldx`).
    pub fn ld(&self) -> usize {
        row_floats(self.k)
    }

    pub fn k(&self) -> usize {
        self.k
    }
}

/// The thin `.cu` for a quantize_q8 variant (tests and benches).
pub fn render_source(name: &str, threads: u32) -> String {
    format!(
        "#include \"memra/quantize_q8.cuh\"\nstruct {name}_cfg {{\n    static constexpr int THREADS = {threads};\n}};\nMEMRA_DEFINE_QUANTIZE_Q8({name}, {name}_cfg)\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_layout_matches_the_reference() {
        for k in [32, 64, 96, 640, 2048, 6144, 12288] {
            assert_eq!(row_bytes(k), memra_reference::q8::q8_row_bytes(k), "k={k}");
            assert_eq!(row_bytes(k) % 16, 0);
            assert!(row_bytes(k) >= k + k / 4);
        }
        // 3 blocks: 96 + 24 = 120 → 128 bytes (the odd last block's pair has 8 bytes of padding).
        assert_eq!(row_bytes(96), 128);
    }
}
