//! matmul: prefill product `Y[t][n] (+)= Σ_k X[t][k]·W[n][k]` with W in its GGUF type, dequantized
//! tile by tile into bf16 for tensor cores (templates/memra/matmul.cuh). bf16 operands, f32
//! accumulation: results match an f32 reference to ~1e-3 relative, not to f32 rounding.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig};
use memra_gguf::GgmlType;

use crate::cuda::{Error, Kernel};
use crate::kernels::checks;
use crate::kernels::launch::{KernelArgs, launch};
use crate::kernels::matvec::{allow_smem, check_weight, qtype, unit_shape};

pub const FAMILY: &str = "matmul";
pub const THREADS: u32 = 256;

/// Kernel parameters in order: `(const unsigned char* w, const float* x, float* y, int t, int k,
/// int n, int ldx, int ldy, const int* offsets, long long expert_bytes, long long x_batch,
/// long long y_batch)`; `expert_bytes` 0: one product, else a stack of matrices: rows grouped
/// by `offsets` ([`matmul_grouped`]) when `x_batch` is 0, a strided batch
/// ([`matmul_batched`]) when it is not.
#[derive(KernelArgs)]
#[kernel_args(family = "matmul")]
pub struct MatmulArgs<'a> {
    pub w: CudaView<'a, u8>,
    pub x: CudaView<'a, f32>,
    pub y: CudaViewMut<'a, f32>,
    pub t: i32,
    pub k: i32,
    pub n: i32,
    pub ldx: i32,
    pub ldy: i32,
    pub offsets: CudaView<'a, i32>,
    pub expert_bytes: i64,
    pub x_batch: i64,
    pub y_batch: i64,
}

impl<'a> MatmulArgs<'a> {
    /// The arguments of one product (`expert_bytes` 0); the stacked launches set their fields.
    #[allow(clippy::too_many_arguments)]
    fn one(
        kernel: &Kernel,
        w: &'a CudaView<'_, u8>,
        x: &'a CudaView<'_, f32>,
        y: &'a mut CudaViewMut<'_, f32>,
        t: usize,
        k: usize,
        n: usize,
        ldx: usize,
        ldy: usize,
    ) -> Result<MatmulArgs<'a>, Error> {
        Ok(MatmulArgs {
            w: w.slice(..),
            x: x.slice(..),
            y: y.slice_mut(..),
            t: checks::to_i32(kernel, "t", t)?,
            k: checks::to_i32(kernel, "k", k)?,
            n: checks::to_i32(kernel, "n", n)?,
            ldx: checks::to_i32(kernel, "ldx", ldx)?,
            ldy: checks::to_i32(kernel, "ldy", ldy)?,
            // Not read without a stack of experts; any valid pointer fills the slot.
            // SAFETY: reinterprets x's first 4 bytes as one i32 the kernel never reads.
            offsets: unsafe { x.transmute::<i32>(1) }.ok_or_else(|| checks::invalid(kernel, "x is empty"))?,
            expert_bytes: 0,
            x_batch: 0,
            y_batch: 0,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulTuning {
    /// Tokens per block tile: 64 or 128.
    pub bm: u32,
    /// Weight rows per block tile: 128 or 256 (F32 weights run 128: [`block_n`]).
    pub bn: u32,
    pub accumulate: bool,
}

impl Default for MatmulTuning {
    fn default() -> Self {
        MatmulTuning {
            bm: 128,
            bn: 256,
            accumulate: false,
        }
    }
}

pub fn tuning(kernel: &Kernel) -> Result<MatmulTuning, Error> {
    let v = kernel.variant();
    let bm = checks::baked_int(v, "bm").unwrap_or(128);
    if bm != 64 && bm != 128 {
        return Err(checks::invalid(kernel, format!("bm={bm} is not 64 or 128")));
    }
    let bn = checks::baked_int(v, "bn").unwrap_or(256);
    if bn != 128 && bn != 256 {
        return Err(checks::invalid(kernel, format!("bn={bn} is not 128 or 256")));
    }
    let threads = checks::baked_int(v, "threads").unwrap_or(THREADS as i64);
    if threads != THREADS as i64 {
        return Err(checks::invalid(
            kernel,
            format!("threads={threads}: matmul runs 256 threads"),
        ));
    }
    let accumulate = checks::baked_int(v, "accumulate").unwrap_or(0);
    if accumulate != 0 && accumulate != 1 {
        return Err(checks::invalid(
            kernel,
            format!("accumulate={accumulate} is not 0 or 1"),
        ));
    }
    Ok(MatmulTuning {
        bm: bm as u32,
        bn: bn as u32,
        accumulate: accumulate == 1,
    })
}

/// Weight rows per block tile as the kernel runs it (`MatmulGeometry::BN`): the tuning's, except
/// 128 for F32 weights, whose 256 rows would not fit shared memory twice.
pub fn block_n(ty: GgmlType, t: &MatmulTuning) -> u32 {
    if ty == GgmlType::F32 { 128 } else { t.bn }
}

/// Dynamic shared memory, mirroring `MatmulGeometry<Cfg>::SMEM` in matmul.cuh.
pub fn smem_bytes(ty: GgmlType, t: &MatmulTuning) -> Option<u32> {
    let u = unit_shape(ty)?;
    let bn = block_n(ty, t);
    let kr = match ty {
        GgmlType::F32 => 64,
        GgmlType::F16 | GgmlType::BF16 => if bn == 128 { 128 } else { 64 },
        _ if u.block_elems == 256 || bn == 128 => 256,
        _ => 128,
    };
    // An odd number of 16-byte chunks (bank groups), at least the super-tile + 16 bytes.
    let raw_row = ((kr / u.block_elems * u.block_bytes + 16).div_ceil(16) | 1) * 16;
    Some(2 * bn * raw_row + 2 * (t.bm + bn) * 128 + 1024)
}

/// The grid of `t` rows (a stack: its largest group) by `n` columns, one z layer per matrix of
/// the stack (1: one product).
pub fn launch_config(
    ty: GgmlType,
    tune: &MatmulTuning,
    t: usize,
    n: usize,
    matrices: u32,
) -> Option<LaunchConfig> {
    Some(LaunchConfig {
        grid_dim: (
            checks::grid_dim(n, block_n(ty, tune) as usize, i32::MAX as u32),
            checks::grid_dim(t, tune.bm as usize, checks::GRID_Y_MAX),
            matrices,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem_bytes(ty, tune)?,
    })
}

/// `y[i·ldy + j] (+)= Σ_l x[i·ldx + l]·W[j][l]` for `i < t`, `j < n`, `l < k` (bf16 products).
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    kernel: &Kernel,
    w: &CudaView<'_, u8>,
    x: &CudaView<'_, f32>,
    y: &mut CudaViewMut<'_, f32>,
    t: usize,
    k: usize,
    n: usize,
    ldx: usize,
    ldy: usize,
) -> Result<(), Error> {
    let (ty, tune) = check_common(kernel, k, n, ldx, ldy, t)?;
    check_weight(kernel, ty, w.len(), k, n)?;
    if t == 0 || n == 0 {
        return Ok(());
    }
    checks::check_len(kernel, "x", x.len(), (t - 1) * ldx + k)?;
    checks::check_len(kernel, "y", y.len(), (t - 1) * ldy + n)?;
    let mut args = MatmulArgs::one(kernel, w, x, y, t, k, n, ldx, ldy)?;
    // SAFETY: w holds n rows of row_bytes(qtype, k), x t rows of ldx ≥ k floats, y t rows of
    // ldy ≥ n floats (checked).
    unsafe { launch_checked(kernel, ty, &tune, &mut args, t, 1) }
}

/// The checks every entry point shares: the dims a specialized variant bakes in, the row
/// strides (x rows float4-loaded), `grid_rows` (the rows one matrix's grid covers) within
/// grid.y. Returns the variant's type and tuning.
fn check_common(kernel: &Kernel, k: usize, n: usize, ldx: usize, ldy: usize, grid_rows: usize) -> Result<(GgmlType, MatmulTuning), Error> {
    let (ty, tune) = (qtype(kernel)?, tuning(kernel)?);
    checks::check_dim(kernel, "k", k)?;
    checks::check_dim(kernel, "n", n)?;
    if grid_rows.div_ceil(tune.bm as usize) > checks::GRID_Y_MAX as usize {
        return Err(checks::invalid(kernel, format!("{grid_rows} rows need more than {} token tiles", checks::GRID_Y_MAX)));
    }
    if ldx < k || !ldx.is_multiple_of(4) || ldy < n {
        return Err(checks::invalid(kernel, format!("ldx={ldx} must be >= k={k} and a multiple of 4; ldy={ldy} must be >= n={n}")));
    }
    Ok((ty, tune))
}

/// Checks the 16-byte alignment of w and x (cp.async, float4 loads) and launches `args` over
/// (n / 128, `grid_rows` / BM, `z`) blocks with the variant's dynamic shared memory.
///
/// # Safety
/// Every buffer in `args` holds what its dims, strides and stack fields address (the entry
/// points check it); the grid geometry and shared memory are this function's.
unsafe fn launch_checked(kernel: &Kernel, ty: GgmlType, tune: &MatmulTuning, args: &mut MatmulArgs<'_>, grid_rows: usize, z: u32) -> Result<(), Error> {
    checks::check_aligned16(kernel, "w", &args.w)?;
    checks::check_aligned16(kernel, "x", &args.x)?;
    let cfg = launch_config(ty, tune, grid_rows, args.n as usize, z).expect("qtype checked by the caller");
    allow_smem(kernel, cfg.shared_mem_bytes)?;
    // SAFETY: the caller's contract, plus the grid covering n (BN per block) × grid_rows (BM
    // per block) × z and the dynamic shared memory matching MatmulGeometry (the kernel traps if
    // it is smaller).
    unsafe { launch(kernel, cfg, args) }
}

/// Expert row offsets for grouped launches ([`matmul_grouped`]): checked on the host (from 0,
/// never decreasing, 1 to 65535 experts) and copied to the device once, on the stream of the
/// kernels that read them, however many grouped launches follow.
pub struct ExpertOffsets<'a> {
    host: &'a [i32],
    dev: CudaView<'a, i32>,
}

impl<'a> ExpertOffsets<'a> {
    /// Copies `host` (`n_expert + 1` offsets) into the front of `dev` on `kernel`'s stream.
    pub fn upload(kernel: &Kernel, host: &'a [i32], dev: &'a mut CudaSlice<i32>) -> Result<ExpertOffsets<'a>, Error> {
        let n_expert = host.len().checked_sub(1).filter(|&e| e >= 1).ok_or_else(|| checks::invalid(kernel, "offsets needs n_expert + 1 ≥ 2 entries"))?;
        if n_expert > u16::MAX as usize {
            return Err(checks::invalid(kernel, format!("{n_expert} experts: grid.z holds at most 65535")));
        }
        if host[0] != 0 || host.windows(2).any(|p| p[1] < p[0]) {
            return Err(checks::invalid(kernel, "offsets must start at 0 and never decrease"));
        }
        checks::check_len(kernel, "offsets_dev", dev.len(), host.len())?;
        kernel
            .stream()
            .memcpy_htod(host, &mut dev.slice_mut(..host.len()))
            .map_err(|e| Error::driver("copying the expert offsets", e))?;
        let dev: &'a CudaSlice<i32> = dev;
        Ok(ExpertOffsets { host, dev: dev.slice(..host.len()) })
    }

    fn n_expert(&self) -> usize {
        self.host.len() - 1
    }

    /// Rows of all experts, and of the largest group (grid.y).
    fn rows(&self) -> (usize, usize) {
        let max = self.host.windows(2).map(|p| (p[1] - p[0]) as usize).max().unwrap_or(0);
        (*self.host.last().expect("n_expert ≥ 1") as usize, max)
    }
}

/// A stack of experts' products in one launch (MoE prefill grouped by expert): for each expert
/// `z < n_expert`, rows `offsets[z]..offsets[z + 1]` of `x` (`[rows][ldx]`) times expert `z`'s
/// weights (`w` holds `n_expert` experts of `n` rows of `row_bytes(k)`) into the same rows of
/// `y` (`[rows][ldy]`). Empty experts cost only their blocks' early exit. `kernel` runs on the
/// stream the offsets were copied on.
#[allow(clippy::too_many_arguments)]
pub fn matmul_grouped(
    kernel: &Kernel,
    w: &CudaView<'_, u8>,
    x: &CudaView<'_, f32>,
    y: &mut CudaViewMut<'_, f32>,
    offsets: &ExpertOffsets<'_>,
    k: usize,
    n: usize,
    ldx: usize,
    ldy: usize,
) -> Result<(), Error> {
    let (n_expert, (rows, max_rows)) = (offsets.n_expert(), offsets.rows());
    let (ty, tune) = check_common(kernel, k, n, ldx, ldy, max_rows)?;
    let expert_bytes = matrix_bytes(kernel, ty, k, n)?;
    checks::check_len(kernel, "w", w.len(), n_expert * expert_bytes)?;
    if rows == 0 || n == 0 {
        return Ok(());
    }
    checks::check_len(kernel, "x", x.len(), (rows - 1) * ldx + k)?;
    checks::check_len(kernel, "y", y.len(), (rows - 1) * ldy + n)?;
    let mut args = MatmulArgs::one(kernel, w, x, y, max_rows, k, n, ldx, ldy)?;
    (args.offsets, args.expert_bytes) = (offsets.dev.slice(..), expert_bytes as i64);
    // SAFETY: w holds n_expert experts of expert_bytes (a multiple of 16, so every expert's rows
    // stay 16-byte aligned), the device offsets hold the checked host ones (copied earlier on
    // this stream), x and y hold their last row; grid.y covers the largest group.
    unsafe { launch_checked(kernel, ty, &tune, &mut args, max_rows, n_expert as u32) }
}

/// A strided batch of products in one launch (MLA's per-head absorption of a prefill chunk):
/// for each `z < batches`, `t` rows of `x + z·x_batch` (row stride `ldx`) times matrix `z` of
/// `w` (`batches` matrices of `n` rows of `row_bytes(k)`) into `t` rows of `y + z·y_batch`
/// (row stride `ldy`); offsets in floats.
#[allow(clippy::too_many_arguments)]
pub fn matmul_batched(
    kernel: &Kernel,
    w: &CudaView<'_, u8>,
    x: &CudaView<'_, f32>,
    y: &mut CudaViewMut<'_, f32>,
    batches: usize,
    t: usize,
    k: usize,
    n: usize,
    (ldx, x_batch): (usize, usize),
    (ldy, y_batch): (usize, usize),
) -> Result<(), Error> {
    let (ty, tune) = check_common(kernel, k, n, ldx, ldy, t)?;
    if batches == 0 || batches > u16::MAX as usize {
        return Err(checks::invalid(kernel, format!("{batches} matrices: grid.z holds 1 to 65535")));
    }
    let expert_bytes = matrix_bytes(kernel, ty, k, n)?;
    checks::check_len(kernel, "w", w.len(), batches * expert_bytes)?;
    if x_batch == 0 || !x_batch.is_multiple_of(4) {
        return Err(checks::invalid(kernel, format!("x_batch={x_batch} must be a nonzero multiple of 4")));
    }
    if t == 0 || n == 0 {
        return Ok(());
    }
    checks::check_len(kernel, "x", x.len(), (batches - 1) * x_batch + (t - 1) * ldx + k)?;
    checks::check_len(kernel, "y", y.len(), (batches - 1) * y_batch + (t - 1) * ldy + n)?;
    let mut args = MatmulArgs::one(kernel, w, x, y, t, k, n, ldx, ldy)?;
    (args.expert_bytes, args.x_batch, args.y_batch) = (expert_bytes as i64, x_batch as i64, y_batch as i64);
    // SAFETY: w holds `batches` matrices of expert_bytes (a multiple of 16: each stays 16-byte
    // aligned), x and y hold the last row of the last matrix (checked); x_batch and ldx are
    // multiples of 4 floats, so every row stays 16-byte aligned for float4 loads.
    unsafe { launch_checked(kernel, ty, &tune, &mut args, t, batches as u32) }
}

/// Bytes of one `n × k` matrix of a stack; refused unless a multiple of 16 (cp.async keeps
/// every matrix's rows 16-byte aligned).
fn matrix_bytes(kernel: &Kernel, ty: GgmlType, k: usize, n: usize) -> Result<usize, Error> {
    let row_bytes = ty
        .row_bytes(k as u64)
        .ok_or_else(|| checks::invalid(kernel, format!("k={k} is not a whole number of {ty:?} blocks")))? as usize;
    let bytes = n.checked_mul(row_bytes).ok_or_else(|| checks::invalid(kernel, "matrix size overflows"))?;
    if !bytes.is_multiple_of(16) {
        return Err(checks::invalid(kernel, format!("a matrix's {bytes} bytes are not a multiple of 16 (cp.async)")));
    }
    Ok(bytes)
}

/// The thin `.cu` codegen emits for a matmul variant (tests and benches build their own shapes).
pub fn render_source(name: &str, ty: GgmlType, k: usize, n: usize, t: &MatmulTuning) -> String {
    format!(
        "#include \"memra/matmul.cuh\"\nstruct {name}_cfg {{\n    static constexpr int K = {k};\n    static constexpr int N = {n};\n    \
         static constexpr memra::QType QTYPE = memra::QType::{q};\n    static constexpr int BM = {bm};\n    \
         static constexpr int BN = {bn};\n    static constexpr int THREADS = {THREADS};\n    static constexpr int ACCUMULATE = {a};\n}};\nMEMRA_DEFINE_MATMUL({name}, {name}_cfg)\n",
        q = ty.name(),
        bm = t.bm,
        bn = t.bn,
        a = t.accumulate as i32
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smem_matches_the_template_formula_by_hand() {
        let tune = |bm, bn| MatmulTuning { bm, bn, accumulate: false };
        // Raw rows: the super-tile + 16 bytes, rounded up to an odd number of 16-byte chunks.
        // Q4_K: super-tile 256 = 1 block of 144 B → 176; bf16 tiles 2 · (BM + BN) · 128.
        assert_eq!(smem_bytes(GgmlType::Q4_K, &MatmulTuning::default()), Some(2 * 256 * 176 + 2 * 384 * 128 + 1024));
        // Q8_0: super-tile 128 (BN 256) = 4 blocks = 136 B → 176; 256 (BN 128) = 272 B → 304.
        assert_eq!(smem_bytes(GgmlType::Q8_0, &tune(64, 256)), Some(2 * 256 * 176 + 2 * 320 * 128 + 1024));
        assert_eq!(smem_bytes(GgmlType::Q8_0, &tune(64, 128)), Some(2 * 128 * 304 + 2 * 192 * 128 + 1024));
        // F32 runs 128 rows: super-tile 64 = 256 B → 272; BF16 at BN 256: 64 = 128 B → 144.
        assert_eq!(smem_bytes(GgmlType::F32, &MatmulTuning::default()), Some(2 * 128 * 272 + 2 * 256 * 128 + 1024));
        assert_eq!(smem_bytes(GgmlType::BF16, &MatmulTuning::default()), Some(2 * 256 * 144 + 2 * 384 * 128 + 1024));
        // Q5_K: 176 B → 208 (13 chunks); Q6_K, the widest block (210 B → 240), still fits 227 KiB.
        assert_eq!(smem_bytes(GgmlType::Q5_K, &MatmulTuning::default()), Some(2 * 256 * 208 + 2 * 384 * 128 + 1024));
        assert!(smem_bytes(GgmlType::Q6_K, &MatmulTuning::default()).unwrap() <= 232448);
    }
}
