//! moe_matvec: decode products over stacked GGUF expert tensors (ne = [K, N, n_expert]) that
//! read only the selected experts (templates/memra/moe_matvec.cuh): plain `y[s] = W[e_s]·x[b]`,
//! swiglu `y[s] = silu(Wg[e_s]·x[b]) ⊙ (Wu[e_s]·x[b])`, geglu the same with gelu_tanh, down `y[b] (+)= Σ_j wt[s]·W[e_s]·x[s]`
//! with `s = b·n_used + j`, `e_s = ids[s]`. matvec's streaming core, units and geometry.
//! A dense gated FFN (gate + up + activation in one launch) is the one-expert case:
//! `n_expert = n_used = 1`, `ids = [0]`, `w` / `w_up` the 2-D ffn_gate / ffn_up tensors.

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};
use memra_gguf::GgmlType;

use crate::cuda::{Error, Kernel};
use crate::kernels::checks::{self, GRID_Y_MAX};
use crate::kernels::launch::{KernelArgs, launch};
use crate::kernels::matvec::{self, GridPolicy, MatvecTuning};

pub const FAMILY: &str = "moe_matvec";

/// Kernel parameters in order: `(const unsigned char* w, const unsigned char* w_up,
/// const int* ids, const float* weights, const float* x, float* y, int k, int n, int n_tokens,
/// int n_used, int n_expert, int ldx, int ldy)`.
#[derive(KernelArgs)]
#[kernel_args(family = "moe_matvec")]
pub struct MoeMatvecArgs<'a> {
    pub w: CudaView<'a, u8>,
    pub w_up: CudaView<'a, u8>,
    pub ids: CudaView<'a, i32>,
    pub weights: CudaView<'a, f32>,
    pub x: CudaView<'a, f32>,
    pub y: CudaViewMut<'a, f32>,
    pub k: i32,
    pub n: i32,
    pub n_tokens: i32,
    pub n_used: i32,
    pub n_expert: i32,
    pub ldx: i32,
    pub ldy: i32,
}

/// What a variant computes (Cfg `MODE`, `memra::MoeMode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `plain`: `y[s] = W[e_s]·x[b]`.
    Plain,
    /// `swiglu`: `y[s] = silu(Wg[e_s]·x[b]) ⊙ (Wu[e_s]·x[b])`, gate and up in one launch.
    Swiglu,
    /// `geglu`: `y[s] = gelu_tanh(Wg[e_s]·x[b]) ⊙ (Wu[e_s]·x[b])` (Gemma 3's FFN).
    Geglu,
    /// `down`: `y[b] (+)= Σ_j weights[s]·W[e_s]·x[s]`.
    Down,
}

pub fn mode(kernel: &Kernel) -> Result<Mode, Error> {
    match checks::required_sym(kernel, "mode")? {
        "plain" => Ok(Mode::Plain),
        "swiglu" => Ok(Mode::Swiglu),
        "geglu" => Ok(Mode::Geglu),
        "down" => Ok(Mode::Down),
        m => Err(checks::invalid(
            kernel,
            format!("mode `{m}` is not plain, swiglu, geglu or down"),
        )),
    }
}

impl Mode {
    /// Gate and up tensors in one launch, the activation applied where both sums meet.
    pub fn is_paired(self) -> bool {
        matches!(self, Mode::Swiglu | Mode::Geglu)
    }

    /// The Cfg `MODE` token (`mode` in a registry request).
    pub fn token(self) -> &'static str {
        match self {
            Mode::Plain => "plain",
            Mode::Swiglu => "swiglu",
            Mode::Geglu => "geglu",
            Mode::Down => "down",
        }
    }
}

/// The variant's tuning: matvec's fields with BATCH 1 (the x row of each launch slot).
pub fn tuning(kernel: &Kernel) -> Result<MatvecTuning, Error> {
    let t = matvec::tuning(kernel)?;
    Ok(MatvecTuning { batch: 1, ..t })
}

/// Grid: `(ceil(tile rows / R), slots)`, tile rows = N (2N in Swiglu / Geglu), slots = n_tokens·n_used
/// (n_tokens in Down), capped at 65535 (the kernel strides over slots).
pub fn launch_config(
    geo: &matvec::MatvecGeometry,
    mode: Mode,
    n: usize,
    n_tokens: usize,
    n_used: usize,
) -> LaunchConfig {
    launch_config_blocks(geo, mode, n, n_tokens, n_used, usize::MAX)
}

/// [`launch_config`] with at most about `max_blocks` blocks in all: grid.x per slot is
/// `matvec::balanced_blocks(tiles, max_blocks / grid.y)`, so each block walks the same number of
/// its slot's tiles (±1) with its pipeline never drained between them.
pub fn launch_config_blocks(
    geo: &matvec::MatvecGeometry,
    mode: Mode,
    n: usize,
    n_tokens: usize,
    n_used: usize,
    max_blocks: usize,
) -> LaunchConfig {
    let (tile_rows, slots) = match mode {
        Mode::Plain => (n, n_tokens * n_used),
        Mode::Swiglu | Mode::Geglu => (2 * n, n_tokens * n_used),
        Mode::Down => (n, n_tokens),
    };
    let grid_y = checks::grid_dim(slots, 1, GRID_Y_MAX);
    let per_slot = (max_blocks / grid_y.max(1) as usize).max(1);
    let mut cfg = matvec::launch_config_blocks(geo, tile_rows, per_slot);
    cfg.grid_dim.1 = grid_y;
    cfg
}

/// The tensors and vectors of one launch. `w` (and `w_up` for Swiglu / Geglu): the whole stacked expert
/// tensor, `n_expert·n·row_bytes(k)` bytes; `weights` for Down.
pub struct MoeMatvecInputs<'s, 'a> {
    pub w: &'s CudaView<'a, u8>,
    pub w_up: Option<&'s CudaView<'a, u8>>,
    pub ids: &'s CudaView<'a, i32>,
    pub weights: Option<&'s CudaView<'a, f32>>,
    pub x: &'s CudaView<'a, f32>,
}

/// Sizes of one launch: expert `k` × `n`, `n_tokens` tokens routed to `n_used` of `n_expert`
/// experts each, x / y row strides in floats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeDims {
    pub k: usize,
    pub n: usize,
    pub n_tokens: usize,
    pub n_used: usize,
    pub n_expert: usize,
    pub ldx: usize,
    pub ldy: usize,
}

/// Runs the variant's mode (module doc). Ids are read on the device: one outside
/// `[0, n_expert)` makes the outputs it feeds NaN instead of reading out of bounds.
/// Grid: [`GridPolicy::PerTile`] (one block per tile of each slot).
pub fn moe_matvec(
    kernel: &Kernel,
    inp: &MoeMatvecInputs<'_, '_>,
    y: &mut CudaViewMut<'_, f32>,
    d: MoeDims,
) -> Result<(), Error> {
    moe_matvec_with(kernel, inp, y, d, GridPolicy::PerTile)
}

/// [`moe_matvec`] with an explicit grid policy (`Resident`: the blocks the device holds at
/// once, shared out over the slots; benchmarks compare them).
pub fn moe_matvec_with(
    kernel: &Kernel,
    inp: &MoeMatvecInputs<'_, '_>,
    y: &mut CudaViewMut<'_, f32>,
    d: MoeDims,
    grid: GridPolicy,
) -> Result<(), Error> {
    let MoeDims {
        k,
        n,
        n_tokens,
        n_used,
        n_expert,
        ldx,
        ldy,
    } = d;
    let ty = matvec::qtype(kernel)?;
    let mode = mode(kernel)?;
    let tune = tuning(kernel)?;
    checks::check_dim(kernel, "k", k)?;
    checks::check_dim(kernel, "n", n)?;
    if mode.is_paired() && tune.rows_per_group % 2 != 0 {
        return Err(checks::invalid(
            kernel,
            format!("mode {} needs an even rows_per_group", mode.token()),
        ));
    }
    if n_used == 0 || n_expert == 0 || n_used > n_expert {
        return Err(checks::invalid(
            kernel,
            format!("need 1 <= n_used={n_used} <= n_expert={n_expert}"),
        ));
    }
    let overflow = || checks::invalid(kernel, "sizes overflow");
    let n_total = n_expert.checked_mul(n).ok_or_else(overflow)?;
    matvec::check_weight(kernel, ty, inp.w.len(), k, n_total)?;
    checks::check_aligned16(kernel, "w", inp.w)?;
    let w_up = matvec::paired_weight(kernel, ty, inp.w, inp.w_up, (k, n_total), (mode.is_paired(), &format!("mode {}", mode.token())))?;
    let slots = n_tokens.checked_mul(n_used).ok_or_else(overflow)?;
    checks::check_len(kernel, "ids", inp.ids.len(), slots)?;
    let weights = match (mode, inp.weights) {
        (Mode::Down, Some(wt)) => {
            checks::check_len(kernel, "weights", wt.len(), slots)?;
            wt.slice(..)
        }
        (Mode::Down, None) => return Err(checks::invalid(kernel, "mode down needs weights")),
        (_, Some(_)) => {
            return Err(checks::invalid(
                kernel,
                "weights are only read in mode down",
            ));
        }
        (_, None) => inp.x.slice(..),
    };
    let (x_rows, y_rows) = match mode {
        Mode::Down => (slots, n_tokens),
        _ => (n_tokens, slots),
    };
    // xq8 variants read x as quantize_q8 rows (matvec's integer path).
    matvec::check_xq8(kernel, ty, &tune)?;
    let xk = matvec::x_row_floats(tune.reads_q8_rows(), k);
    if ldx < xk || !ldx.is_multiple_of(4) || ldy < n {
        return Err(checks::invalid(
            kernel,
            format!(
                "ldx={ldx} must be >= {xk} (x row floats at k={k}) and a multiple of 4; ldy={ldy} must be >= n={n}"
            ),
        ));
    }
    if n_tokens == 0 {
        return Ok(());
    }
    checks::check_len(
        kernel,
        "x",
        inp.x.len(),
        (x_rows - 1).checked_mul(ldx).ok_or_else(overflow)? + xk,
    )?;
    checks::check_len(
        kernel,
        "y",
        y.len(),
        (y_rows - 1).checked_mul(ldy).ok_or_else(overflow)? + n,
    )?;
    checks::check_aligned16(kernel, "x", inp.x)?;
    let mut geo = matvec::geometry(ty, &tune, matvec::baked_k(kernel)).ok_or_else(|| {
        checks::invalid(kernel, format!("{} experts are not supported", ty.name()))
    })?;
    // XQ8 = 2: the slot's whole q8 x after the stages (BATCH 1); in Down the token's n_used h rows.
    let xf_rows = if mode == Mode::Down { n_used } else { 1 };
    let xf_bytes = matvec::fused_x_bytes(ty, &tune, k)
        .and_then(|b| b.checked_mul(u32::try_from(xf_rows).ok()?))
        .unwrap_or(u32::MAX);
    geo.smem_bytes = geo.smem_bytes.saturating_add(xf_bytes);
    if geo.smem_bytes > matvec::MAX_DYNAMIC_SMEM {
        let rows = if tune.fuse_x && mode == Mode::Down {
            format!(" (x quantized in the block: {xf_rows} rows of n_used)")
        } else {
            String::new()
        };
        return Err(checks::invalid(
            kernel,
            format!(
                "k={k}{rows}: {} bytes of shared memory > {}",
                geo.smem_bytes,
                matvec::MAX_DYNAMIC_SMEM
            ),
        ));
    }
    matvec::allow_smem(kernel, geo.smem_bytes)?;
    let max_blocks = match grid {
        GridPolicy::PerTile => usize::MAX,
        GridPolicy::Resident => matvec::resident_blocks(kernel, &geo)?,
        GridPolicy::AtMost(b) => b.max(1) as usize,
    };
    let mut args = MoeMatvecArgs {
        w: inp.w.slice(..),
        w_up,
        ids: inp.ids.slice(..),
        weights,
        x: inp.x.slice(..),
        y: y.slice_mut(..),
        k: checks::to_i32(kernel, "k", k)?,
        n: checks::to_i32(kernel, "n", n)?,
        n_tokens: checks::to_i32(kernel, "n_tokens", n_tokens)?,
        n_used: checks::to_i32(kernel, "n_used", n_used)?,
        n_expert: checks::to_i32(kernel, "n_expert", n_expert)?,
        ldx: checks::to_i32(kernel, "ldx", ldx)?,
        ldy: checks::to_i32(kernel, "ldy", ldy)?,
    };
    checks::to_i32(kernel, "slots", slots)?;
    // SAFETY: w (and w_up in Swiglu / Geglu) hold n_expert·n rows of row_bytes(qtype, k) bytes, 16-byte
    // aligned; the kernel reads only rows of experts in [0, n_expert) (it checks every id); ids
    // (and weights in Down) hold n_tokens·n_used entries, x and y the rows of this mode at
    // their strides (checked); the dynamic shared memory matches MatvecGeometry with BATCH 1;
    // any grid of 1..=tiles × 1..=slots blocks covers every tile (the kernel strides over both).
    unsafe {
        launch(
            kernel,
            launch_config_blocks(&geo, mode, n, n_tokens, n_used, max_blocks),
            &mut args,
        )
    }
}

impl Mode {
    /// The `memra::MoeMode` enumerator.
    pub fn cpp(self) -> &'static str {
        match self {
            Mode::Plain => "Plain",
            Mode::Swiglu => "Swiglu",
            Mode::Geglu => "Geglu",
            Mode::Down => "Down",
        }
    }
}

/// The thin `.cu` of a moe_matvec variant (benches and tests build their own; `k = n = 0`:
/// generic). `t.batch` is ignored (one x row per slot).
pub fn render_source(
    name: &str,
    ty: GgmlType,
    mode: Mode,
    k: usize,
    n: usize,
    t: &MatvecTuning,
) -> String {
    format!(
        "#include \"memra/moe_matvec.cuh\"\nstruct {name}_cfg {{\n    static constexpr int K = {k};\n    static constexpr int N = {n};\n    \
         static constexpr memra::QType QTYPE = memra::QType::{q};\n    static constexpr memra::MoeMode MODE = memra::MoeMode::{m};\n    \
         static constexpr int THREADS = {th};\n    static constexpr int LANES = {l};\n    static constexpr int ROWS_PER_GROUP = {r};\n    \
         static constexpr int STAGES = {s};\n    static constexpr int ACCUMULATE = {a};\n    static constexpr int XQ8 = {xq};\n}};\n\
         MEMRA_DEFINE_MOE_MATVEC({name}, {name}_cfg)\n",
        q = ty.name(),
        m = mode.cpp(),
        th = t.threads,
        l = t.lanes,
        r = t.rows_per_group,
        s = t.stages,
        a = t.accumulate as i32,
        xq = matvec::xq8_value(t)
    )
}

/// Bytes of the expert rows one launch reads: `n_used` experts per token (distinct ids assumed)
/// × n rows of row_bytes(k), twice in Swiglu / Geglu. For bandwidth figures.
pub fn selected_bytes(
    ty: GgmlType,
    mode: Mode,
    k: usize,
    n: usize,
    n_selected: usize,
) -> Option<usize> {
    let u = matvec::unit_shape(ty)?;
    let rb = k / u.block_elems as usize * u.block_bytes as usize;
    Some(rb * n * n_selected * if mode.is_paired() { 2 } else { 1 })
}
