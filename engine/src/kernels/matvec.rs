//! matvec: quantized weight × up to 8 f32 vectors for decode, `y[b][n] (+)= Σ_k W[n][k]·x[b][k]`
//! with W in its GGUF type (ne = [K, N]) (templates/memra/matvec.cuh).

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};
use memra_gguf::GgmlType;

use crate::cuda::{Error, Kernel};
use crate::kernels::checks;
use crate::kernels::launch::{KernelArgs, launch};
use crate::kernels::registry::KernelVariant;

pub const FAMILY: &str = "matvec";

/// Kernel parameters in order: `(const unsigned char* w, const float* x, float* y, int k, int n,
/// int batch, int ldx, int ldy)`.
#[derive(KernelArgs)]
#[kernel_args(family = "matvec")]
pub struct MatvecArgs<'a> {
    pub w: CudaView<'a, u8>,
    pub x: CudaView<'a, f32>,
    pub y: CudaViewMut<'a, f32>,
    pub k: i32,
    pub n: i32,
    pub batch: i32,
    pub ldx: i32,
    pub ldy: i32,
}

/// The tuning fields of a matvec variant (templates/README.md `## matvec`; absent = default).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatvecTuning {
    pub batch: u32,
    pub threads: u32,
    pub lanes: u32,
    pub rows_per_group: u32,
    pub stages: u32,
    pub accumulate: bool,
    /// `XQ8 = 1`: x is [`quantize_q8`](crate::kernels::quantize_q8) rows and the products run
    /// in int8 (`__dp4a`); only for [`int_dot`] types.
    pub xq8: bool,
    /// With `xq8`: `XQ8 = 2`, x stays f32 and each block quantizes it into shared memory itself
    /// (no quantize_q8 launch; matvec and moe_matvec). Same numerics as `XQ8 = 1`.
    pub fuse_x: bool,
}

impl MatvecTuning {
    /// Whether x arrives as quantize_q8 rows (`XQ8 = 1`); `XQ8 = 2` variants take f32 x.
    pub fn reads_q8_rows(&self) -> bool {
        self.xq8 && !self.fuse_x
    }
}

impl Default for MatvecTuning {
    fn default() -> Self {
        MatvecTuning {
            batch: 1,
            threads: 256,
            lanes: 32,
            rows_per_group: 2,
            stages: 3,
            accumulate: false,
            xq8: false,
            fuse_x: false,
        }
    }
}

/// What `qunit::Unit<Q>` in matvec.cuh says about a type: elements per unit, units per lane per
/// chunk, and the block (a pseudo-block of one unit for F32/F16/BF16) the unit lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnitShape {
    pub unit_elems: u32,
    pub units_per_lane: u32,
    pub block_elems: u32,
    pub block_bytes: u32,
}

/// Mirrors the `Unit<Q>` constants of matvec.cuh; `None` for types the kernels do not decode.
pub fn unit_shape(ty: GgmlType) -> Option<UnitShape> {
    use GgmlType::*;
    let (unit_elems, units_per_lane, block_elems, block_bytes) = match ty {
        F32 => (8, 2, 8, 32),
        F16 | BF16 => (8, 4, 8, 16),
        Q8_0 => (32, 1, 32, 34),
        Q4_0 => (32, 2, 32, 18),
        IQ4_NL => (32, 2, 32, 18),
        Q4_1 => (32, 2, 32, 20),
        Q5_0 => (32, 2, 32, 22),
        Q5_1 => (32, 2, 32, 24),
        Q4_K => (64, 1, 256, 144),
        Q5_K => (64, 1, 256, 176),
        Q6_K => (32, 2, 256, 210),
        IQ4_XS => (32, 2, 256, 136),
        _ => return None,
    };
    Some(UnitShape {
        unit_elems,
        units_per_lane,
        block_elems,
        block_bytes,
    })
}

/// Weight types the integer path (`XQ8 = 1`) decodes: `qunit::Unit<Q>::INT_DOT` in matvec.cuh
/// (and `memra_reference::q8::has_int_dot`).
pub fn int_dot(ty: GgmlType) -> bool {
    memra_codegen::families::INT_DOT_QTYPES.contains(&ty)
}

/// Whether the variant reads x as q8 rows (`XQ8 = 1`): callers then quantize x once
/// ([`crate::kernels::quantize_q8::Q8Activation`]) and pass it to every such launch.
/// (`XQ8 = 2` variants take f32 x.)
pub fn reads_q8(kernel: &Kernel) -> Result<bool, Error> {
    Ok(tuning(kernel)?.reads_q8_rows())
}

/// [`reads_q8`] of a registry variant before it is loaded: a matvec or moe_matvec variant with
/// `XQ8 = 1` (norm_matvec's XQ8 quantizes inside the kernel: f32 x).
pub fn variant_reads_q8(v: &KernelVariant) -> bool {
    (v.family == FAMILY || v.family == crate::kernels::moe_matvec::FAMILY) && tuning_of(v).is_ok_and(|t| t.reads_q8_rows())
}

/// Extra dynamic shared memory of an `XQ8 = 2` variant at `k`: the whole q8 x of BATCH rows
/// ([`fused_x_row_bytes`] each); 0 otherwise.
pub fn fused_x_bytes(ty: GgmlType, t: &MatvecTuning, k: usize) -> Option<u32> {
    if !(t.xq8 && t.fuse_x) {
        return unit_shape(ty).map(|_| 0);
    }
    fused_x_row_bytes(ty, k)?.checked_mul(t.batch)
}

/// One x row of `k` in the q8 layout a `ty` unit reads from shared memory
/// (`MatvecGeometry::xf_row` in matvec.cuh), 16-byte aligned.
pub fn fused_x_row_bytes(ty: GgmlType, k: usize) -> Option<u32> {
    let u = unit_shape(ty)?;
    u32::try_from((k / u.unit_elems as usize * (u.unit_elems as usize + 16) + k / 4).div_ceil(16) * 16).ok()
}

/// Floats per x row the kernel reads at `k`: `k` (f32 x) or, with `xq8`, the q8 row
/// ([`crate::kernels::quantize_q8::row_floats`]).
pub fn x_row_floats(xq8: bool, k: usize) -> usize {
    if xq8 {
        crate::kernels::quantize_q8::row_floats(k)
    } else {
        k
    }
}

/// The element count K must be a multiple of: the quant block (32 or 256), 8 for float types.
pub fn k_multiple(ty: GgmlType) -> Option<usize> {
    unit_shape(ty).map(|u| u.block_elems as usize)
}

/// Launch geometry, mirroring `MatvecGeometry<Cfg>` in matvec.cuh.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatvecGeometry {
    /// Weight rows per thread block.
    pub rows_per_block: u32,
    pub threads: u32,
    pub smem_bytes: u32,
}

/// `baked_k`: the variant's compile-time K (None for a generic variant): a row shorter than one
/// chunk gets slots of its own size.
pub fn geometry(ty: GgmlType, t: &MatvecTuning, baked_k: Option<usize>) -> Option<MatvecGeometry> {
    let u = unit_shape(ty)?;
    let rows = t.threads / t.lanes * t.rows_per_group;
    let upc = t.lanes * u.units_per_lane;
    let chunk_bytes = upc / (u.block_elems / u.unit_elems) * u.block_bytes;
    let (slot_bytes, x_units) = match baked_k {
        Some(k) => {
            let row_bytes = u32::try_from(k / u.block_elems as usize * u.block_bytes as usize).ok()?;
            (row_bytes.min(chunk_bytes), u32::try_from(k / u.unit_elems as usize).ok()?.min(upc))
        }
        None => (chunk_bytes, upc),
    };
    let row_slot = slot_bytes.div_ceil(16) * 16 + 16;
    let xs_row = if t.xq8 && t.fuse_x {
        0
    } else if t.xq8 {
        upc * (u.unit_elems + 16) + upc * u.unit_elems / 4
    } else {
        x_units * (u.unit_elems + 4) * 4
    };
    let stage = rows * row_slot + t.batch * xs_row;
    Some(MatvecGeometry {
        rows_per_block: rows,
        threads: t.threads,
        smem_bytes: t.stages * stage + 16,
    })
}

/// Whether a plain matvec launch of `ty` with tuning `t` takes the direct path (matvec.cuh,
/// `MatvecLaunch::DIRECT`): with 32 lanes, F32 / F16 / BF16 on f32 x and Q8_0 / Q4_K on
/// quantize_q8 rows (`xq8 = 1`) load their rows straight into registers, with no shared memory
/// and no pipeline (`stages` unused).
pub fn direct(ty: GgmlType, t: &MatvecTuning) -> bool {
    let float = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) && !t.xq8;
    let q8 = matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_K) && t.reads_q8_rows();
    (float || q8) && t.lanes == 32
}

/// The geometry a plain matvec launch uses (`MatvecLaunch::LAUNCH_SMEM`): [`geometry`], less
/// its shared memory on the [`direct`] path. (moe_matvec, norm_matvec and combine_matvec always
/// stage through shared memory: they take [`geometry`].)
pub fn launch_geometry(ty: GgmlType, t: &MatvecTuning, baked_k: Option<usize>) -> Option<MatvecGeometry> {
    let g = geometry(ty, t, baked_k)?;
    Some(if direct(ty, t) { MatvecGeometry { smem_bytes: 0, ..g } } else { g })
}

/// One block per tile of `rows_per_block` rows (grid = tiles).
pub fn launch_config(g: &MatvecGeometry, n: usize) -> LaunchConfig {
    launch_config_blocks(g, n, usize::MAX)
}

/// Tiles of `rows_per_block` rows that cover `n` rows.
pub fn tiles(g: &MatvecGeometry, n: usize) -> usize {
    n.div_ceil(g.rows_per_block as usize).max(1)
}

/// Blocks for `tiles` tiles when at most `max_blocks` run at once: as many waves as a grid of one
/// block per tile would take, spread evenly, so every block walks the same number of tiles (±1)
/// and the fewest blocks ramp their pipelines.
pub fn balanced_blocks(tiles: usize, max_blocks: usize) -> usize {
    let waves = tiles.div_ceil(max_blocks.max(1));
    tiles.div_ceil(waves.max(1)).max(1)
}

/// Grid of at most `max_blocks` blocks ([`balanced_blocks`]); the kernel walks the tiles with a
/// grid stride (matvec.cuh, launch geometry).
pub fn launch_config_blocks(g: &MatvecGeometry, n: usize, max_blocks: usize) -> LaunchConfig {
    let blocks = balanced_blocks(tiles(g, n), max_blocks).min(i32::MAX as usize);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (g.threads, 1, 1),
        shared_mem_bytes: g.smem_bytes,
    }
}

/// How many blocks a matvec launch uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GridPolicy {
    /// One block per tile of rows.
    PerTile,
    /// The blocks the device holds at once (SMs × blocks per SM for this kernel), balanced.
    Resident,
    /// At most this many blocks, balanced.
    AtMost(u32),
}

/// SMs × the kernel's resident blocks per SM at `geo` (asked once per kernel name).
pub fn resident_blocks(kernel: &Kernel, geo: &MatvecGeometry) -> Result<usize, Error> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static CACHE: OnceLock<Mutex<HashMap<(&'static str, u32, u32), usize>>> = OnceLock::new();
    let key = (kernel.name(), geo.threads, geo.smem_bytes);
    let cache = CACHE.get_or_init(Default::default);
    if let Some(&v) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(v);
    }
    use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
    let sms = kernel
        .stream()
        .context()
        .attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| Error::driver("cuDeviceGetAttribute(multiprocessor count)", e))?;
    let per_sm = kernel
        .function()
        .occupancy_max_active_blocks_per_multiprocessor(geo.threads, geo.smem_bytes as usize, None)
        .map_err(|e| {
            Error::driver(
                format!(
                    "cuOccupancyMaxActiveBlocksPerMultiprocessor for {}",
                    kernel.name()
                ),
                e,
            )
        })?;
    let v = (sms.max(1) as usize) * (per_sm.max(1) as usize);
    cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, v);
    Ok(v)
}

fn tune_int(
    variant: &KernelVariant,
    key: &str,
    default: u32,
    ok: impl Fn(i64) -> bool,
) -> Result<u32, String> {
    let v = checks::baked_int(variant, key).unwrap_or(default as i64);
    if !ok(v) {
        return Err(format!("{key}={v} is out of range"));
    }
    Ok(v as u32)
}

/// The variant's compile-time K, if it bakes one (specialized variants).
pub fn baked_k(kernel: &Kernel) -> Option<usize> {
    checks::baked_int(kernel.variant(), "k").and_then(|k| usize::try_from(k).ok()).filter(|&k| k > 0)
}

/// The variant's tuning (README defaults for fields it does not bake).
pub fn tuning(kernel: &Kernel) -> Result<MatvecTuning, Error> {
    tuning_of(kernel.variant()).map_err(|message| checks::invalid(kernel, message))
}

/// The tuning `variant` bakes, its defaults where it bakes none (Err: the field out of range).
/// `memra bench` reads it too, to render a variant in another weight type.
pub fn tuning_of(variant: &KernelVariant) -> Result<MatvecTuning, String> {
    let d = MatvecTuning::default();
    // XQ8 = 2 and FUSE_X = 1 are the same kernel (the enum and the tuning spelling of it).
    let xq8 = tune_int(variant, "xq8", 0, |v| (0..=2).contains(&v))?;
    let fuse_x = tune_int(variant, "fuse_x", 0, |v| v == 0 || v == 1)? == 1;
    if fuse_x && xq8 == 1 {
        return Err("fuse_x=1 takes f32 x: not with xq8=1".to_string());
    }
    Ok(MatvecTuning {
        batch: tune_int(variant, "batch", d.batch, |v| (1..=8).contains(&v))?,
        threads: tune_int(variant, "threads", d.threads, |v| v > 0 && v <= 1024 && v % 32 == 0)?,
        lanes: tune_int(variant, "lanes", d.lanes, |v| matches!(v, 8 | 16 | 32))?,
        rows_per_group: tune_int(variant, "rows_per_group", d.rows_per_group, |v| (1..=8).contains(&v))?,
        stages: tune_int(variant, "stages", d.stages, |v| (2..=6).contains(&v))?,
        accumulate: tune_int(variant, "accumulate", 0, |v| v == 0 || v == 1)? == 1,
        xq8: xq8 >= 1 || fuse_x,
        fuse_x: xq8 == 2 || fuse_x,
    })
}

/// The weight type the variant was built for.
pub fn qtype(kernel: &Kernel) -> Result<GgmlType, Error> {
    let token = checks::required_sym(kernel, "qtype")?;
    GgmlType::from_name(token)
        .ok_or_else(|| checks::invalid(kernel, format!("qtype `{token}` is not a ggml type")))
}

/// Most dynamic shared memory one block may use on sm_90 (227 KiB).
pub const MAX_DYNAMIC_SMEM: u32 = 232_448;

/// Raises the kernel's dynamic shared-memory limit to `bytes` (needed above 48 KiB).
pub(crate) fn allow_smem(kernel: &Kernel, bytes: u32) -> Result<(), Error> {
    kernel
        .function()
        .set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(|e| {
            Error::driver(
                format!(
                    "cuFuncSetAttribute(max dynamic smem {bytes}) for {}",
                    kernel.name()
                ),
                e,
            )
        })
}

/// An xq8 variant of a type without the integer path traps in the kernel: refuse it here.
pub(crate) fn check_xq8(kernel: &Kernel, ty: GgmlType, tune: &MatvecTuning) -> Result<(), Error> {
    if tune.xq8 && !int_dot(ty) {
        return Err(checks::invalid(
            kernel,
            format!("xq8=1 has no integer path for {} weights", ty.name()),
        ));
    }
    Ok(())
}

/// Checks shared by matvec and matmul: the weight type, K's multiple, and the weight's byte size.
/// The second weight of a paired launch (moe_matvec's swiglu/geglu modes, norm_matvec's GLUs):
/// `w_up` checked like `w` (`n` rows of `k`) when `paired`, refused when not (`mode` names the
/// choice in the errors: "glu swiglu"); unpaired launches pass `w` in the unread slot.
pub(crate) fn paired_weight<'a>(
    kernel: &Kernel,
    ty: GgmlType,
    w: &'a CudaView<'_, u8>,
    w_up: Option<&'a CudaView<'_, u8>>,
    (k, n): (usize, usize),
    (paired, mode): (bool, &str),
) -> Result<CudaView<'a, u8>, Error> {
    match (paired, w_up) {
        (true, Some(u)) => {
            check_weight(kernel, ty, u.len(), k, n)?;
            checks::check_aligned16(kernel, "w_up", u)?;
            Ok(u.slice(..))
        }
        (true, None) => Err(checks::invalid(kernel, format!("{mode} needs w_up"))),
        (false, Some(_)) => Err(checks::invalid(kernel, "w_up is only read with swiglu or geglu")),
        (false, None) => Ok(w.slice(..)),
    }
}

pub(crate) fn check_weight(
    kernel: &Kernel,
    ty: GgmlType,
    w_len: usize,
    k: usize,
    n: usize,
) -> Result<usize, Error> {
    let multiple = k_multiple(ty).ok_or_else(|| {
        checks::invalid(kernel, format!("{} weights are not supported", ty.name()))
    })?;
    if k == 0 || !k.is_multiple_of(multiple) {
        return Err(checks::invalid(
            kernel,
            format!(
                "k={k} is not a positive multiple of {multiple} ({})",
                ty.name()
            ),
        ));
    }
    let u = unit_shape(ty).expect("k_multiple implies a unit shape");
    let row_bytes = k / u.block_elems as usize * u.block_bytes as usize;
    let need = row_bytes
        .checked_mul(n)
        .ok_or_else(|| checks::invalid(kernel, "weight size overflows"))?;
    checks::check_len(kernel, "w (bytes)", w_len, need)?;
    Ok(row_bytes)
}

/// `y[b·ldy + j] (+)= Σ_i W[j][i]·x[b·ldx + i]` for `b < batch`, `j < n`, `i < k`.
/// `w`: `n` rows of the variant's qtype at `k`; all buffers 16-byte aligned except `y`.
/// Grid: [`GridPolicy::Resident`].
///
/// An `xq8` variant ([`MatvecTuning::xq8`]) takes x as q8 rows: `x` is the output of
/// [`quantize_q8`](crate::kernels::quantize_q8::quantize_q8) (rows of `ldx` floats, `ldx ≥`
/// [`quantize_q8::row_floats(k)`](crate::kernels::quantize_q8::row_floats)); one quantized x
/// serves every xq8 matvec that reads the same activations (q/k/v, gate/up).
#[allow(clippy::too_many_arguments)]
pub fn matvec(
    kernel: &Kernel,
    w: &CudaView<'_, u8>,
    x: &CudaView<'_, f32>,
    y: &mut CudaViewMut<'_, f32>,
    k: usize,
    n: usize,
    batch: usize,
    ldx: usize,
    ldy: usize,
) -> Result<(), Error> {
    matvec_with(kernel, w, x, y, k, n, batch, ldx, ldy, GridPolicy::Resident)
}

/// [`matvec`] with an explicit grid policy (benchmarks compare them).
#[allow(clippy::too_many_arguments)]
pub fn matvec_with(
    kernel: &Kernel,
    w: &CudaView<'_, u8>,
    x: &CudaView<'_, f32>,
    y: &mut CudaViewMut<'_, f32>,
    k: usize,
    n: usize,
    batch: usize,
    ldx: usize,
    ldy: usize,
    grid: GridPolicy,
) -> Result<(), Error> {
    let ty = qtype(kernel)?;
    let tune = tuning(kernel)?;
    checks::check_dim(kernel, "k", k)?;
    checks::check_dim(kernel, "n", n)?;
    check_weight(kernel, ty, w.len(), k, n)?;
    if batch == 0 || batch > tune.batch as usize {
        return Err(checks::invalid(
            kernel,
            format!("batch={batch} is not in 1..={}", tune.batch),
        ));
    }
    check_xq8(kernel, ty, &tune)?;
    let xk = x_row_floats(tune.reads_q8_rows(), k);
    if ldx < xk || !ldx.is_multiple_of(4) || ldy < n {
        return Err(checks::invalid(
            kernel,
            format!(
                "ldx={ldx} must be >= {xk} (x row floats at k={k}) and a multiple of 4; ldy={ldy} must be >= n={n}"
            ),
        ));
    }
    checks::check_len(kernel, "x", x.len(), (batch - 1) * ldx + xk)?;
    checks::check_len(kernel, "y", y.len(), (batch - 1) * ldy + n)?;
    checks::check_aligned16(kernel, "w", w)?;
    checks::check_aligned16(kernel, "x", x)?;
    if n == 0 {
        return Ok(());
    }
    let mut geo = launch_geometry(ty, &tune, baked_k(kernel)).expect("qtype checked above");
    geo.smem_bytes += fused_x_bytes(ty, &tune, k).unwrap_or(u32::MAX);
    if geo.smem_bytes > MAX_DYNAMIC_SMEM {
        return Err(checks::invalid(
            kernel,
            format!(
                "k={k}: {} bytes of shared memory (x quantized in the block for batch {}) > {MAX_DYNAMIC_SMEM}",
                geo.smem_bytes, tune.batch
            ),
        ));
    }
    allow_smem(kernel, geo.smem_bytes)?;
    let max_blocks = match grid {
        GridPolicy::PerTile => usize::MAX,
        GridPolicy::Resident => resident_blocks(kernel, &geo)?,
        GridPolicy::AtMost(b) => b.max(1) as usize,
    };
    let mut args = MatvecArgs {
        w: w.slice(..),
        x: x.slice(..),
        y: y.slice_mut(..),
        k: checks::to_i32(kernel, "k", k)?,
        n: checks::to_i32(kernel, "n", n)?,
        batch: batch as i32,
        ldx: checks::to_i32(kernel, "ldx", ldx)?,
        ldy: checks::to_i32(kernel, "ldy", ldy)?,
    };
    // SAFETY: w holds n rows of row_bytes(qtype, k) bytes, x batch rows of ldx ≥ k floats, y batch
    // rows of ldy ≥ n floats (checked above); w and x are 16-byte aligned for cp.async; any grid
    // of 1..=tiles blocks covers the n rows (the kernel strides over tiles) and the dynamic shared
    // memory matches MatvecGeometry (the kernel traps if it is smaller).
    unsafe { launch(kernel, launch_config_blocks(&geo, n, max_blocks), &mut args) }
}

/// The `XQ8` Cfg value of a tuning (0, 1, or 2 = fused).
pub fn xq8_value(t: &MatvecTuning) -> i32 {
    match (t.xq8, t.fuse_x) {
        (false, _) => 0,
        (true, false) => 1,
        (true, true) => 2,
    }
}

/// The thin `.cu` codegen emits for a matvec variant (tests and benches build their own shapes).
pub fn render_source(name: &str, ty: GgmlType, k: usize, n: usize, t: &MatvecTuning) -> String {
    format!(
        "#include \"memra/matvec.cuh\"\nstruct {name}_cfg {{\n    static constexpr int K = {k};\n    static constexpr int N = {n};\n    \
         static constexpr memra::QType QTYPE = memra::QType::{q};\n    static constexpr int BATCH = {b};\n    \
         static constexpr int THREADS = {th};\n    static constexpr int LANES = {l};\n    static constexpr int ROWS_PER_GROUP = {r};\n    \
         static constexpr int STAGES = {s};\n    static constexpr int ACCUMULATE = {a};\n    static constexpr int XQ8 = {xq};\n}};\nMEMRA_DEFINE_MATVEC({name}, {name}_cfg)\n",
        q = ty.name(),
        b = t.batch,
        th = t.threads,
        l = t.lanes,
        r = t.rows_per_group,
        s = t.stages,
        a = t.accumulate as i32,
        xq = xq8_value(t)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn direct_path_launches_without_shared_memory() {
        let d = MatvecTuning::default();
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
            let g = launch_geometry(ty, &d, Some(6144)).unwrap();
            assert_eq!((g.rows_per_block, g.smem_bytes), (16, 0), "{ty:?}");
            // 8 lanes (batched tunings) keep the staged pipeline, as does every quantized type.
            let t8 = MatvecTuning { lanes: 8, ..d };
            assert_eq!(launch_geometry(ty, &t8, None), geometry(ty, &t8, None));
        }
        assert_eq!(launch_geometry(GgmlType::Q8_0, &d, None), geometry(GgmlType::Q8_0, &d, None));
        assert!(geometry(GgmlType::Q8_0, &d, None).unwrap().smem_bytes > 0);
        // The integer path on quantize_q8 rows: Q8_0 and Q4_K load directly, Q6_K stages; x
        // quantized in the block (fuse_x) always stages.
        let xq8 = MatvecTuning { xq8: true, ..d };
        for (ty, smem0) in [(GgmlType::Q8_0, true), (GgmlType::Q4_K, true), (GgmlType::Q6_K, false)] {
            assert_eq!(launch_geometry(ty, &xq8, None).unwrap().smem_bytes == 0, smem0, "{ty:?}");
        }
        let fused = MatvecTuning { fuse_x: true, ..xq8 };
        assert!(launch_geometry(GgmlType::Q8_0, &fused, None).unwrap().smem_bytes > 0);
    }

    #[test]
    fn geometry_matches_the_template_formula_by_hand() {
        // Q4_K, defaults: 8 groups × 2 rows = 16 rows; chunk 32 units of 64 = 8 blocks = 1152 B,
        // slot 1168; x chunk 32 × 68 × 4 = 8704 B; 3 stages.
        let g = geometry(GgmlType::Q4_K, &MatvecTuning::default(), None).unwrap();
        assert_eq!(g.rows_per_block, 16);
        assert_eq!(g.smem_bytes, 3 * (16 * 1168 + 8704) + 16);
        // Q8_0: 32 blocks × 34 = 1088 B → slot 1104; x 32 × 36 × 4 = 4608.
        let g = geometry(
            GgmlType::Q8_0,
            &MatvecTuning {
                batch: 8,
                lanes: 8,
                rows_per_group: 1,
                ..Default::default()
            },
            None,
        )
        .unwrap();
        assert_eq!(g.rows_per_block, 32);
        // lanes 8: 8 blocks = 272 B → slot 288; x 8 × 36 × 4 = 1152 per row, 8 rows.
        assert_eq!(g.smem_bytes, 3 * (32 * 288 + 8 * 1152) + 16);
        assert!(geometry(GgmlType::Q2_K, &MatvecTuning::default(), None).is_none());
        // Baked K = 640 of Q5_0 (UPL 2: chunks of 2048 elements): slots of the row's 440 bytes
        // (→ 464) and x staged for its 20 units; K past a chunk changes nothing.
        let q5 = |k| geometry(GgmlType::Q5_0, &MatvecTuning::default(), k).unwrap().smem_bytes;
        assert_eq!(q5(Some(640)), 3 * (16 * 464 + 20 * 36 * 4) + 16);
        assert_eq!(q5(Some(4096)), q5(None));
        // XQ8 Q4_K: x chunk = 32 units × (64 + 16) B int8 + 2048 / 32 (d, Σq) pairs × 8 B.
        let g = geometry(
            GgmlType::Q4_K,
            &MatvecTuning {
                xq8: true,
                ..Default::default()
            },
            None,
        )
        .unwrap();
        assert_eq!(g.smem_bytes, 3 * (16 * 1168 + 32 * 80 + 64 * 8) + 16);
    }

    #[test]
    fn balanced_grids_keep_the_wave_count_and_even_out_tiles() {
        // Fewer tiles than resident blocks: one block per tile.
        assert_eq!(balanced_blocks(128, 264), 128);
        // One tile more than fits: two waves either way, 2 tiles per block on 133 blocks.
        assert_eq!(balanced_blocks(265, 264), 133);
        // 768 tiles on 264 resident blocks: 3 waves → 256 blocks of exactly 3 tiles.
        assert_eq!(balanced_blocks(768, 264), 256);
        for (t, m) in [(1, 1), (7, 3), (1000, 132), (9681, 264), (5, usize::MAX)] {
            let b = balanced_blocks(t, m);
            assert!(b >= 1 && b <= t && b <= m, "t={t} m={m} b={b}");
            assert_eq!(
                t.div_ceil(b),
                t.div_ceil(m.min(t)),
                "same waves: t={t} m={m} b={b}"
            );
        }
        let g = geometry(GgmlType::Q4_K, &MatvecTuning::default(), None).unwrap();
        assert_eq!(launch_config(&g, 12288).grid_dim.0, 768);
        assert_eq!(launch_config_blocks(&g, 12288, 264).grid_dim.0, 256);
    }

    #[test]
    fn every_contract_qtype_has_a_unit() {
        use GgmlType::*;
        for ty in [
            F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS,
        ] {
            let u = unit_shape(ty).unwrap();
            assert_eq!(u.block_elems % u.unit_elems, 0, "{ty:?}");
            if u.block_elems > 8 {
                assert_eq!(
                    (u.block_elems, u.block_bytes as u64),
                    (ty.block_size() as u32, ty.type_size()),
                    "{ty:?}"
                );
            }
        }
    }
}
