//! `memra bench --sweep matvec`: candidate matvec tunings at run time, on the GPU, in one run.
//!
//! For each decode shape below (GLM-5, Qwen3-8B, Gemma 3 270M), weight type and batch (1 and 4),
//! every candidate tuning is rendered with `matvec::render_source` twice — specialized (K, N baked)
//! and generic (dims at run time) — compiled with NVRTC (all at once, in parallel, disk-cached),
//! then each (variant, grid policy) is:
//! 1. checked once against the CPU oracle (f64 dot products of the dequantized rows, relative L2
//!    ≤ 1e-4, NaN-poisoned output), so a fast wrong kernel cannot win: failures are printed, kept
//!    in the JSON with `"ok": false` and never ranked;
//! 2. timed: `--warmup` launches, then `--iters` launches each between two CUDA events, each
//!    preceded (outside the events) by a *clean* L2 flush: a read pass over a never-written
//!    buffer of twice the L2 size (a bf16 matvec whose output is a few KB), so every launch reads
//!    its weights from HBM and the L2 it finds holds no dirty lines; the median is reported.
//!    (`memra bench`'s flush is a memset of 2 × L2: it leaves L2 full of dirty lines, so a launch's
//!    first ~L2-size of misses each also write a line back — weights under ~60 MB read at about
//!    half the copy rate. Each case also times its default tuning that way: `dirty_flush_us`.)
//!    `floor_us` (top level) is the same harness around the smallest matvec launch (one block,
//!    16 bytes of weight): event, launch and completion cost that no kernel can go below;
//!    `pct_copy_net` rates a candidate's bytes over its time minus that floor.
//!
//! The copy bandwidth (1 GiB device-to-device, read + write) is measured in the same run and
//! every figure is also given as % of it. Bytes per launch: weight bytes + 4·K·batch (x) +
//! 4·N·batch (y). Weights are `PATTERN_ROWS` (a prime) random rows quantized once and tiled over
//! the N rows on the device, so the oracle needs only those rows while a result stored in the
//! wrong row still fails unless the rows are a multiple of the prime apart.
//!
//! Integer path: for the types with one (`matvec::int_dot`), the first `XQ8_CANDIDATES` tunings
//! are also run with `xq8` (label suffix `_q8`): each timed launch is quantize_q8 of x plus the
//! xq8 matvec (the quantization is not amortized over q/k/v here); and with `xq8` + `fuse_x`
//! (`_q8f`, `XQ8 = 2`: one launch, each block quantizes x itself). Both checked against
//! `memra_reference::q8` (x quantized the same way) at the same tolerance. `--list` shows them.
//!
//! Grid policies (`matvec::GridPolicy`): `tile` = one block per tile of rows (what the kernel
//! did before resident grids); `resident` = SMs × blocks per SM, balanced (the wrapper's default).
//! "default/tile" in the summary is therefore the previous launch (default tuning, one block per
//! tile) and the summary's speed-ups are measured against it and against the best generic.

use std::fmt::Write as _;
use std::path::Path;

use cudarc::driver::CudaSlice;
use memra_gguf::{GgmlType, quant};
use memra_reference::{Rng, q8, rel_err};
use rayon::prelude::*;
use serde_json::{Value, json};

use super::{
    BenchArgs, L2Flush, alloc, commit, copy_bandwidth, driver_version, drv, l2_bytes, median,
    record, tile, time_launches, token, utc_now, weight_bytes,
};
use crate::cuda::{Error, Gpu, Kernel, Kernels};
use crate::kernels::matvec::{self, GridPolicy, MatvecTuning};
use crate::kernels::quantize_q8;
use crate::kernels::registry::{KernelVariant, Param};

pub mod moe;

/// Distinct random weight rows tiled over N (prime, so tile-periodic indexing bugs still show).
const PATTERN_ROWS: usize = 509;
/// Relative L2 error a candidate must stay under (f32 path, DESIGN.md).
const TOLERANCE: f64 = 1e-4;
/// Most dynamic shared memory one block may use on sm_90 (227 KiB).
const MAX_SMEM: u32 = 232_448;
const BATCHES: [usize; 2] = [1, 4];
/// Tunings (the first of [`candidate_tunings`]) also run with `xq8` on integer-path types.
const XQ8_CANDIDATES: usize = 5;
/// Batch 1: further tunings also run with `xq8` (the deeper / taller ones, more bytes in flight).
const XQ8_EXTRA_BATCH1: [(u32, u32, u32, u32); 3] =
    [(256, 32, 4, 4), (512, 32, 2, 4), (128, 32, 4, 4)];
const TYPES: [GgmlType; 5] = [
    GgmlType::Q4_K,
    GgmlType::Q8_0,
    GgmlType::Q6_K,
    GgmlType::Q5_0,
    GgmlType::BF16,
];

/// One decode matrix shape: which model and tensor it stands for, K → N, the weight types.
#[derive(Clone, Copy, Debug)]
pub struct SweepShape {
    pub model: &'static str,
    pub tensor: &'static str,
    pub k: usize,
    pub n: usize,
    pub types: &'static [GgmlType],
}

pub const SHAPES: [SweepShape; 11] = [
    SweepShape {
        model: "glm-5",
        tensor: "attn_q_a / kv_a (6144→2048)",
        k: 6144,
        n: 2048,
        types: &TYPES,
    },
    SweepShape {
        model: "glm-5",
        tensor: "shared expert up/gate (6144→12288)",
        k: 6144,
        n: 12288,
        types: &TYPES,
    },
    SweepShape {
        model: "glm-5",
        tensor: "6144→24576",
        k: 6144,
        n: 24576,
        types: &TYPES,
    },
    SweepShape {
        model: "glm-5",
        tensor: "2048→6144",
        k: 2048,
        n: 6144,
        types: &TYPES,
    },
    // Few-row projections: a few MB or less, bound by the launch and one DRAM round trip.
    SweepShape {
        model: "glm-5",
        tensor: "attn_kv_a_mqa (6144→576)",
        k: 6144,
        n: 576,
        types: &TYPES,
    },
    SweepShape {
        model: "glm-5",
        tensor: "indexer.proj (6144→32)",
        k: 6144,
        n: 32,
        types: &[GgmlType::Q8_0, GgmlType::BF16],
    },
    SweepShape {
        model: "qwen3-8b",
        tensor: "ffn_up/gate (4096→12288)",
        k: 4096,
        n: 12288,
        types: &TYPES,
    },
    SweepShape {
        model: "qwen3-8b",
        tensor: "ffn_down (12288→4096)",
        k: 12288,
        n: 4096,
        types: &TYPES,
    },
    SweepShape {
        model: "gemma3-270m",
        tensor: "ffn_up/gate (640→2048)",
        k: 640,
        n: 2048,
        types: &TYPES,
    },
    SweepShape {
        model: "gemma3-270m",
        tensor: "ffn_down (2048→640)",
        k: 2048,
        n: 640,
        types: &TYPES,
    },
    SweepShape {
        model: "gemma3-270m",
        tensor: "lm_head (640→262144)",
        k: 640,
        n: 262144,
        types: &[GgmlType::Q8_0],
    },
];

/// (threads, lanes, rows per group, stages) candidates for a batch size; the first is the
/// README default (for batch 4 with BATCH = 4).
pub fn candidate_tunings(batch: usize) -> Vec<MatvecTuning> {
    let shapes: &[(u32, u32, u32, u32)] = if batch == 1 {
        &[
            (256, 32, 2, 3),
            (256, 32, 1, 4),
            (256, 32, 4, 3),
            (512, 32, 1, 3),
            (512, 32, 2, 3),
            // More bytes in flight per SM (taller tiles, deeper pipelines): one resident block
            // of R rows keeps (STAGES − 1)·R row chunks (~1.1 KB each for Q4_K) in flight.
            // (128-thread 4- and 8-row and LANES 16 tiles never won a batch-1 case on the H200.)
            (256, 32, 4, 4),
            (512, 32, 2, 4),
            (128, 32, 4, 4),
            (256, 32, 2, 5),
            (512, 32, 4, 2),
            // Few-row matrices: 2- and 1-row blocks spread N = 576 over all SMs (4-row tiles
            // leave some SMs two tiles, others none) with the whole row in flight.
            (64, 32, 1, 4),
            (32, 32, 1, 4),
        ]
    } else {
        &[
            (256, 32, 2, 3),
            (256, 32, 1, 4),
            (128, 32, 1, 4),
            (256, 16, 1, 3),
            (256, 8, 1, 3),
            (128, 16, 1, 4),
            (512, 16, 1, 3),
        ]
    };
    shapes
        .iter()
        .map(|&(threads, lanes, rows_per_group, stages)| MatvecTuning {
            batch: batch as u32,
            threads,
            lanes,
            rows_per_group,
            stages,
            accumulate: false,
            xq8: false,
            fuse_x: false,
        })
        .collect()
}

fn tuning_label(t: &MatvecTuning) -> String {
    format!(
        "t{}_l{}_r{}_s{}{}",
        t.threads,
        t.lanes,
        t.rows_per_group,
        t.stages,
        match (t.xq8, t.fuse_x) {
            (false, _) => "",
            (true, false) => "_q8",
            (true, true) => "_q8f",
        }
    )
}

/// The f32 candidates, then (integer-path types) the first [`XQ8_CANDIDATES`] and, at batch 1,
/// those of [`XQ8_EXTRA_BATCH1`] with `xq8` (x quantized by a quantize_q8 launch) and with
/// `xq8` + `fuse_x` (quantized in each block).
fn candidates_for(ty: GgmlType, batch: usize) -> Vec<MatvecTuning> {
    let f32_path = candidate_tunings(batch);
    let mut q8_path: Vec<MatvecTuning> = Vec::new();
    if matvec::int_dot(ty) {
        let extra = f32_path.iter().skip(XQ8_CANDIDATES).filter(|t| {
            batch == 1
                && XQ8_EXTRA_BATCH1.contains(&(t.threads, t.lanes, t.rows_per_group, t.stages))
        });
        let picked: Vec<MatvecTuning> = f32_path
            .iter()
            .take(XQ8_CANDIDATES)
            .chain(extra)
            .copied()
            .collect();
        for fuse_x in [false, true] {
            q8_path.extend(picked.iter().map(|t| MatvecTuning {
                xq8: true,
                fuse_x,
                ..*t
            }));
        }
    }
    f32_path.into_iter().chain(q8_path).collect()
}

/// The quantize_q8 variant the xq8 candidates' launches start with (leaked, as `render`'s).
fn quantize_variant() -> &'static KernelVariant {
    use std::sync::OnceLock;
    static V: OnceLock<&'static KernelVariant> = OnceLock::new();
    V.get_or_init(|| {
        let name = "quantize_q8__sweep";
        Box::leak(Box::new(KernelVariant {
            name,
            family: quantize_q8::FAMILY,
            arch: None,
            params: &[("threads", Param::Int(quantize_q8::DEFAULT_THREADS as i64))],
            source: Box::leak(
                quantize_q8::render_source(name, quantize_q8::DEFAULT_THREADS).into_boxed_str(),
            ),
        }))
    })
}

fn fits(ty: GgmlType, t: &MatvecTuning, k: usize) -> bool {
    matvec::geometry(ty, t).is_some_and(|g| {
        g.smem_bytes + matvec::fused_x_bytes(ty, t, k).unwrap_or(u32::MAX) <= MAX_SMEM
    })
}

/// A rendered variant (leaked: it lives as long as the process, like the registry's).
fn render(ty: GgmlType, dims: Option<(usize, usize)>, t: &MatvecTuning) -> &'static KernelVariant {
    let tok = token(ty);
    let name = match dims {
        Some((k, n)) => format!(
            "matvec__k{k}_n{n}__{tok}_batch{}_sweep_{}",
            t.batch,
            tuning_label(t)
        ),
        None => format!(
            "matvec__generic__{tok}_batch{}_sweep_{}",
            t.batch,
            tuning_label(t)
        ),
    };
    let name: &'static str = Box::leak(name.into_boxed_str());
    let mut params: Vec<(&'static str, Param)> = Vec::new();
    if let Some((k, n)) = dims {
        params.push(("k", Param::Int(k as i64)));
        params.push(("n", Param::Int(n as i64)));
    }
    params.push(("qtype", Param::Sym(tok)));
    for (key, v) in [
        ("batch", t.batch),
        ("threads", t.threads),
        ("lanes", t.lanes),
        ("rows_per_group", t.rows_per_group),
        ("stages", t.stages),
    ] {
        params.push((key, Param::Int(v as i64)));
    }
    if t.xq8 {
        params.push(("xq8", Param::Int(matvec::xq8_value(t) as i64)));
    }
    let (k, n) = dims.unwrap_or((0, 0));
    let source: &'static str = Box::leak(matvec::render_source(name, ty, k, n, t).into_boxed_str());
    Box::leak(Box::new(KernelVariant {
        name,
        family: matvec::FAMILY,
        arch: dims.map(|_| "sweep"),
        params: Box::leak(params.into_boxed_slice()),
        source,
    }))
}

/// One (shape, type, batch) case with its candidates: (tuning, specialized, generic).
pub struct SweepCase {
    pub shape: SweepShape,
    pub ty: GgmlType,
    pub batch: usize,
    pub candidates: Vec<(MatvecTuning, &'static KernelVariant, &'static KernelVariant)>,
}

impl SweepCase {
    pub fn bytes(&self) -> u64 {
        weight_bytes(self.ty, self.shape.k, self.shape.n)
            + 4 * (self.shape.k * self.batch) as u64
            + 4 * (self.shape.n * self.batch) as u64
    }
}

/// Every case of the sweep (no GPU needed). Generic variants are shared between shapes.
pub fn plan() -> Vec<SweepCase> {
    let mut generic: Vec<(GgmlType, MatvecTuning, &'static KernelVariant)> = Vec::new();
    let mut cases = Vec::new();
    for shape in SHAPES {
        for &ty in shape.types {
            if matvec::k_multiple(ty).is_none_or(|m| !shape.k.is_multiple_of(m)) {
                continue;
            }
            for batch in BATCHES {
                let mut candidates = Vec::new();
                for t in candidates_for(ty, batch)
                    .into_iter()
                    .filter(|t| fits(ty, t, shape.k))
                {
                    let g = match generic
                        .iter()
                        .find(|(gt, gtune, _)| *gt == ty && *gtune == t)
                    {
                        Some((.., v)) => *v,
                        None => {
                            let v = render(ty, None, &t);
                            generic.push((ty, t, v));
                            v
                        }
                    };
                    candidates.push((t, render(ty, Some((shape.k, shape.n)), &t), g));
                }
                cases.push(SweepCase {
                    shape,
                    ty,
                    batch,
                    candidates,
                });
            }
        }
    }
    cases
}

fn list(cases: &[SweepCase]) {
    let mut variants = 0;
    for c in cases {
        println!(
            "{:<12} {:<36} {:<6} batch {}  {} candidates: {}",
            c.shape.model,
            c.shape.tensor,
            c.ty.name(),
            c.batch,
            c.candidates.len(),
            c.candidates
                .iter()
                .map(|(t, ..)| tuning_label(t))
                .collect::<Vec<_>>()
                .join(" ")
        );
        variants += c.candidates.len();
    }
    println!(
        "{} cases, {} specialized variants (+ generic twins), 2 grid policies each",
        cases.len(),
        variants
    );
}

/// One measured candidate.
#[derive(Clone, Debug)]
struct Measured {
    variant: &'static str,
    specialized: bool,
    tuning: MatvecTuning,
    grid: &'static str,
    blocks: u32,
    rel_err: f64,
    ok: bool,
    median_us: f64,
    min_us: f64,
}

fn policy(grid: &str) -> GridPolicy {
    if grid == "tile" {
        GridPolicy::PerTile
    } else {
        GridPolicy::Resident
    }
}

/// The oracle for the pattern rows: y[b][j] for j < PATTERN_ROWS.min(n), f64 dot products.
fn oracle(
    ty: GgmlType,
    pattern: &[u8],
    rows: usize,
    k: usize,
    x: &[f32],
    batch: usize,
) -> Result<Vec<f64>, String> {
    let dense = quant::dequantize(ty, pattern, rows * k)
        .map_err(|e| format!("dequantize {} pattern: {e}", ty.name()))?;
    Ok((0..batch * rows)
        .into_par_iter()
        .map(|i| {
            let (b, j) = (i / rows, i % rows);
            dense[j * k..(j + 1) * k]
                .iter()
                .zip(&x[b * k..(b + 1) * k])
                .map(|(w, v)| *w as f64 * *v as f64)
                .sum()
        })
        .collect())
}

/// [`oracle`] for xq8 candidates: x rows quantized as quantize_q8 does, per-block integer
/// products (`memra_reference::q8`).
fn oracle_q8(
    ty: GgmlType,
    pattern: &[u8],
    rows: usize,
    k: usize,
    x: &[f32],
    batch: usize,
) -> Result<Vec<f64>, String> {
    let rb = pattern.len() / rows;
    let xq: Vec<q8::Q8Row> = x.chunks_exact(k).map(q8::quantize_q8_blocks).collect();
    (0..batch * rows)
        .into_par_iter()
        .map(|i| {
            let (b, j) = (i / rows, i % rows);
            q8::vec_dot_q8(ty, &pattern[j * rb..(j + 1) * rb], &xq[b])
                .map_err(|e| format!("q8 oracle {}: {e}", ty.name()))
        })
        .collect()
}

struct Buffers {
    w: CudaSlice<u8>,
    x: CudaSlice<f32>,
    y: CudaSlice<f32>,
    /// y[b][j] wanted, row j from pattern row j % PATTERN_ROWS.
    want: Vec<f32>,
    /// x as q8 rows (written by each xq8 launch) and the q8 oracle; empty without xq8 candidates.
    xq: Option<CudaSlice<f32>>,
    want_q8: Vec<f32>,
}

fn prepare(
    gpu: &Gpu,
    case: &SweepCase,
    rng: &mut Rng,
) -> Result<Buffers, Box<dyn std::error::Error>> {
    let (k, n, batch, ty) = (case.shape.k, case.shape.n, case.batch, case.ty);
    let s = gpu.stream();
    let rows = PATTERN_ROWS.min(n);
    let pattern = quant::quantize(ty, &rng.normal_vec(rows * k, 1.0))
        .map_err(|e| format!("quantize {} {k}x{rows}: {e}", ty.name()))?;
    let pattern_dev = s
        .clone_htod(&pattern)
        .map_err(drv("cuMemcpyHtoD (weight pattern)"))?;
    let mut w = alloc::<u8>(s, weight_bytes(ty, k, n) as usize)?;
    tile(s, &mut w, &pattern_dev)?;
    let xh = rng.normal_vec(batch * k, 1.0);
    let x = s.clone_htod(&xh).map_err(drv("cuMemcpyHtoD (x)"))?;
    let y = alloc::<f32>(s, batch * n)?;
    let per_row = oracle(ty, &pattern, rows, k, &xh, batch)?;
    let spread = |per_row: Vec<f64>| -> Vec<f32> {
        (0..batch * n)
            .map(|i| per_row[(i / n) * rows + (i % n) % rows] as f32)
            .collect()
    };
    let want = spread(per_row);
    let (xq, want_q8) = if case.candidates.iter().any(|(t, ..)| t.xq8) {
        let xq = alloc::<f32>(s, batch * quantize_q8::row_floats(k))?;
        (
            Some(xq),
            spread(oracle_q8(ty, &pattern, rows, k, &xh, batch)?),
        )
    } else {
        (None, Vec::new())
    };
    gpu.sync()?;
    Ok(Buffers {
        w,
        x,
        y,
        want,
        xq,
        want_q8,
    })
}

/// One launch of the candidate; an xq8 candidate quantizes x first (`qk`), then reads the q8 rows.
fn launch(
    kernel: &Kernel,
    qk: &Kernel,
    case: &SweepCase,
    buf: &mut Buffers,
    grid: GridPolicy,
) -> Result<(), Error> {
    let (k, n) = (case.shape.k, case.shape.n);
    if matvec::reads_q8(kernel)? {
        let ldq = quantize_q8::row_floats(k);
        let xq = buf
            .xq
            .as_mut()
            .ok_or_else(|| crate::kernels::checks::invalid(kernel, "no q8 x buffer"))?;
        quantize_q8::quantize_q8(
            qk,
            &buf.x.slice(..),
            &mut xq.slice_mut(..),
            k,
            case.batch,
            k,
            ldq,
        )?;
        return matvec::matvec_with(
            kernel,
            &buf.w.slice(..),
            &xq.slice(..),
            &mut buf.y.slice_mut(..),
            k,
            n,
            case.batch,
            ldq,
            n,
            grid,
        );
    }
    matvec::matvec_with(
        kernel,
        &buf.w.slice(..),
        &buf.x.slice(..),
        &mut buf.y.slice_mut(..),
        k,
        n,
        case.batch,
        k,
        n,
        grid,
    )
}

/// Poisons y with NaN, launches once and compares with the oracle.
fn check(
    gpu: &Gpu,
    kernel: &Kernel,
    qk: &Kernel,
    case: &SweepCase,
    buf: &mut Buffers,
    grid: GridPolicy,
) -> Result<f64, Error> {
    poison(gpu, &mut buf.y)?;
    launch(kernel, qk, case, buf, grid)?;
    let want = if matvec::tuning(kernel)?.xq8 {
        &buf.want_q8
    } else {
        &buf.want
    };
    err_vs(gpu, &buf.y, want)
}

/// Fills `y` with NaN (so an output the kernel does not write fails the check).
fn poison(gpu: &Gpu, y: &mut CudaSlice<f32>) -> Result<(), Error> {
    let nan = vec![f32::NAN; y.len()];
    gpu.stream()
        .memcpy_htod(nan.as_slice(), y)
        .map_err(drv("cuMemcpyHtoD (NaN poison)"))
}

/// Relative L2 error of `y` (read back) against `want`.
fn err_vs(gpu: &Gpu, y: &CudaSlice<f32>, want: &[f32]) -> Result<f64, Error> {
    let got = gpu
        .stream()
        .clone_dtoh(y)
        .map_err(drv("cuMemcpyDtoH (y)"))?;
    Ok(rel_err(&got, want))
}

fn blocks(kernel: &Kernel, case: &SweepCase, grid: GridPolicy) -> u32 {
    let t = matvec::tuning(kernel).unwrap_or_default();
    let Some(mut geo) = matvec::geometry(case.ty, &t) else {
        return 0;
    };
    // As the wrapper sizes it (XQ8 = 2: + the block's q8 x), so occupancy matches the launch.
    geo.smem_bytes += matvec::fused_x_bytes(case.ty, &t, case.shape.k).unwrap_or(0);
    let max = match grid {
        GridPolicy::PerTile => usize::MAX,
        GridPolicy::Resident => matvec::resident_blocks(kernel, &geo).unwrap_or(usize::MAX),
        GridPolicy::AtMost(b) => b as usize,
    };
    matvec::launch_config_blocks(&geo, case.shape.n, max)
        .grid_dim
        .0
}

/// [`time_launches`] with the clean flush ([`L2Flush`]) before every timed launch (outside the events).
fn time_clean(
    gpu: &Gpu,
    warmup: u32,
    iters: u32,
    cleaner: &mut L2Flush,
    f: &mut dyn FnMut() -> Result<(), Error>,
) -> Result<Vec<f64>, Error> {
    let s = gpu.stream();
    for _ in 0..warmup {
        f()?;
    }
    let mut events = Vec::with_capacity(iters as usize);
    for _ in 0..iters {
        cleaner.run()?;
        let start = record(s)?;
        f()?;
        events.push((start, record(s)?));
    }
    let mut us = Vec::with_capacity(events.len());
    for (start, end) in &events {
        us.push(
            start
                .elapsed_ms(end)
                .map_err(drv("cuEventElapsedTime (a launch failed?)"))? as f64
                * 1e3,
        );
    }
    us.sort_by(f64::total_cmp);
    Ok(us)
}

/// Times a candidate that was checked once (`checked`: its relative L2 error against the oracle,
/// or the launch error) with the clean flush, if it passed; prints ERROR / WRONG lines (`what`
/// describes the case). A launch error is this candidate's failure, not the sweep's (a sticky
/// one fails the rest too, each with its message). Returns (rel_err, ok, median_us, min_us),
/// the times NaN unless ok.
#[allow(clippy::too_many_arguments)]
fn time_checked(
    gpu: &Gpu,
    args: &BenchArgs,
    cleaner: &mut L2Flush,
    name: &str,
    grid: &str,
    what: &str,
    checked: Result<f64, Error>,
    launch: &mut dyn FnMut() -> Result<(), Error>,
) -> (f64, bool, f64, f64) {
    let (err, launched) = match checked {
        Ok(err) => (err, true),
        Err(e) => {
            eprintln!("ERROR {name} ({grid}): {e}");
            (f64::INFINITY, false)
        }
    };
    if err > TOLERANCE {
        if launched {
            eprintln!(
                "WRONG {name} ({grid}) {what}: relative L2 error {err:e} > {TOLERANCE:e} (inf: NaN/inf in the output)"
            );
        }
        return (err, false, f64::NAN, f64::NAN);
    }
    match time_clean(gpu, args.warmup, args.iters, cleaner, launch) {
        Ok(us) => (err, true, median(&us), us[0]),
        Err(e) => {
            eprintln!("ERROR {name} ({grid}) while timing: {e}");
            (err, false, f64::NAN, f64::NAN)
        }
    }
}

/// Median µs of `launch` after `memra bench`'s flush (a 2 × L2 memset: L2 left dirty).
fn time_dirty(
    gpu: &Gpu,
    args: &BenchArgs,
    flush: &mut CudaSlice<u8>,
    launch: &mut dyn FnMut() -> Result<(), Error>,
) -> Option<f64> {
    time_launches(gpu, args.warmup, args.iters, flush, &mut |_| launch())
        .map(|us| median(&us))
        .ok()
}

/// The harness floor: the smallest matvec launch (bf16 1 × 8: one block, 16 bytes of weight)
/// timed as the candidates are. Median µs.
fn floor_us(gpu: &Gpu, args: &BenchArgs, cleaner: &mut L2Flush) -> Result<f64, Error> {
    let s = gpu.stream();
    let v = L2Flush::variant();
    let kernel = gpu
        .load(&[v])?
        .remove(v.name)
        .ok_or_else(|| Error::Driver {
            call: format!("load {}", v.name),
            detail: "kernel missing after load".into(),
        })?;
    let (w, x, mut y) = (
        alloc::<u8>(s, 16)?,
        alloc::<f32>(s, 8)?,
        alloc::<f32>(s, 1)?,
    );
    let us = time_clean(gpu, args.warmup, args.iters, cleaner, &mut || {
        let (w, x) = (w.slice(..), x.slice(..));
        matvec::matvec_with(
            &kernel,
            &w,
            &x,
            &mut y.slice_mut(..),
            8,
            1,
            1,
            8,
            1,
            GridPolicy::Resident,
        )
    })?;
    Ok(median(&us))
}

/// `memra bench --sweep matvec` (and `--sweep moe_matvec`: [`moe::run`]).
pub fn run(args: &BenchArgs, family: &str) -> Result<(), Box<dyn std::error::Error>> {
    if family == crate::kernels::moe_matvec::FAMILY {
        return moe::run(args);
    }
    if family != matvec::FAMILY {
        return Err(
            format!("--sweep {family}: only `matvec` and `moe_matvec` have a sweep").into(),
        );
    }
    let mut cases = plan();
    // `--arch MODEL` keeps one model's shapes (glm-5, qwen3-8b, gemma3-270m): shorter runs.
    if let Some(model) = &args.arch {
        cases.retain(|c| c.shape.model == model.as_str());
        if cases.is_empty() {
            return Err(format!("--sweep matvec --arch {model}: no shapes of that model (glm-5, qwen3-8b, gemma3-270m)").into());
        }
    }
    if args.list {
        list(&cases);
        return Ok(());
    }
    let gpu =
        Gpu::new(args.device).map_err(|e| format!("memra bench --sweep needs a CUDA GPU: {e}"))?;
    let driver = driver_version().unwrap_or_else(|| "unknown".into());
    let l2 = l2_bytes(&gpu);
    let mut all: Vec<&'static KernelVariant> = cases
        .iter()
        .flat_map(|c| c.candidates.iter().flat_map(|(_, s, g)| [*s, *g]))
        .collect();
    all.push(quantize_variant());
    all.sort_by_key(|v| v.name);
    all.dedup_by_key(|v| v.name);
    eprintln!(
        "memra bench --sweep matvec: {} ({}), {driver}, L2 {} MiB; {} cases, compiling {} variants",
        gpu.name(),
        gpu.arch(),
        l2 >> 20,
        cases.len(),
        all.len()
    );
    let t0 = std::time::Instant::now();
    let kernels: Kernels = gpu.load(&all)?;
    eprintln!("compiled/loaded in {:.1} s", t0.elapsed().as_secs_f64());
    let qk = kernels.get(quantize_variant().name)?;
    let copy_gbps = copy_bandwidth(&gpu, 3, args.iters)?;
    eprintln!("copy bandwidth (1 GiB device-to-device, read + write): {copy_gbps:.0} GB/s");

    let mut flush = alloc::<u8>(gpu.stream(), 2 * l2)?;
    let mut cleaner = L2Flush::new(&gpu, l2)?;
    let floor = floor_us(&gpu, args, &mut cleaner)?;
    eprintln!(
        "harness floor (bf16 matvec 1x8, clean flush, events): {floor:.2} us; timed launches follow a clean flush (read pass over {} MiB)",
        cleaner.bytes() >> 20
    );
    let mut rng = Rng::from_env_or_time("memra bench --sweep");
    eprintln!(
        "seed {} (replay with MEMRA_SEED={})",
        rng.seed(),
        rng.seed()
    );
    let mut results: Vec<CaseResult> = Vec::new();
    let mut failures = 0usize;
    for (ci, case) in cases.iter().enumerate() {
        let mut buf = prepare(&gpu, case, &mut rng)
            .map_err(|e| format!("{} {}: {e}", case.shape.tensor, case.ty.name()))?;
        let mut measured = Vec::new();
        for (tuning, spec, generic) in &case.candidates {
            for (v, specialized) in [(*spec, true), (*generic, false)] {
                let kernel = kernels.get(v.name)?;
                for grid in ["tile", "resident"] {
                    let p = policy(grid);
                    let checked = check(&gpu, kernel, qk, case, &mut buf, p);
                    let what =
                        format!("k={} n={} batch={}", case.shape.k, case.shape.n, case.batch);
                    let (err, ok, median_us, min_us) = time_checked(
                        &gpu,
                        args,
                        &mut cleaner,
                        v.name,
                        grid,
                        &what,
                        checked,
                        &mut || launch(kernel, qk, case, &mut buf, p),
                    );
                    failures += usize::from(!ok);
                    measured.push(Measured {
                        variant: v.name,
                        specialized,
                        tuning: *tuning,
                        grid,
                        blocks: blocks(kernel, case, p),
                        rel_err: err,
                        ok,
                        median_us,
                        min_us,
                    });
                }
            }
        }
        // The default tuning (specialized, resident) once more after `memra bench`'s memset
        // flush (dirty L2), to show what that flush costs at this size.
        let dirty_us = match case.candidates.first() {
            Some((_, spec, _)) if measured.first().is_some_and(|m| m.ok) => {
                let kernel = kernels.get(spec.name)?;
                time_dirty(&gpu, args, &mut flush, &mut || {
                    launch(kernel, qk, case, &mut buf, GridPolicy::Resident)
                })
            }
            _ => None,
        };
        let summary = summarize(case, &measured, copy_gbps, floor);
        eprintln!(
            "[{}/{}] {summary} | default after a dirty (memset) flush: {}",
            ci + 1,
            cases.len(),
            dirty_us.map_or("-".into(), |us| format!("{us:.2} us"))
        );
        results.push((ci, measured, dirty_us));
        drop(buf);
        // Rewritten after every case, so a run cut short still leaves what it measured.
        if let Some(path) = &args.json {
            let h = Harness {
                copy: copy_gbps,
                floor,
                driver: &driver,
            };
            write_json(path, args, &gpu, &h, &cases, &results)?;
        }
    }
    drop(flush);

    let text = table(&cases, &results, copy_gbps, floor);
    println!(
        "copy bandwidth: {copy_gbps:.0} GB/s (clean L2 flush before every timed launch; median of {} launches); harness floor {floor:.2} us",
        args.iters
    );
    print!("{text}");
    if let Some(path) = &args.json {
        let h = Harness {
            copy: copy_gbps,
            floor,
            driver: &driver,
        };
        write_json(path, args, &gpu, &h, &cases, &results)?;
        eprintln!("wrote {}", path.display());
    }
    if failures > 0 {
        return Err(format!("{failures} candidate launches failed or disagreed with the CPU oracle (ERROR / WRONG lines; not ranked)").into());
    }
    Ok(())
}

fn gbps(bytes: u64, us: f64) -> f64 {
    bytes as f64 / (us * 1e-6) / 1e9
}

/// % of copy over the time above the harness floor (the part a kernel can shorten); None when
/// the time is not above the floor.
fn pct_net(bytes: u64, us: f64, floor: f64, copy: f64) -> Option<f64> {
    (us > floor).then(|| 100.0 * gbps(bytes, us - floor) / copy)
}

/// A case's index, its measured candidates and its default tuning's median after a memset flush.
type CaseResult = (usize, Vec<Measured>, Option<f64>);

/// Run-wide figures the report carries.
struct Harness<'a> {
    copy: f64,
    floor: f64,
    driver: &'a str,
}

fn best<'a>(m: &'a [Measured], specialized: bool) -> Option<&'a Measured> {
    m.iter()
        .filter(|r| r.ok && r.specialized == specialized)
        .min_by(|a, b| a.median_us.total_cmp(&b.median_us))
}

/// The previous launch: default tuning (first candidate), specialized, one block per tile.
fn baseline(m: &[Measured]) -> Option<&Measured> {
    let default = m.first()?.tuning;
    m.iter()
        .find(|r| r.ok && r.specialized && r.grid == "tile" && r.tuning == default)
}

fn summarize(case: &SweepCase, m: &[Measured], copy: f64, floor: f64) -> String {
    let bytes = case.bytes();
    let fmt = |r: Option<&Measured>| {
        r.map(|r| {
            format!(
                "{:.2} us {:.1}% (net of floor {}) ({} {})",
                r.median_us,
                100.0 * gbps(bytes, r.median_us) / copy,
                pct_net(bytes, r.median_us, floor, copy).map_or("-".into(), |p| format!("{p:.1}%")),
                tuning_label(&r.tuning),
                r.grid
            )
        })
        .unwrap_or_else(|| "-".into())
    };
    let (bs, bg, base) = (best(m, true), best(m, false), baseline(m));
    let ratio = |a: Option<&Measured>, b: Option<&Measured>| match (a, b) {
        (Some(a), Some(b)) => format!("{:.2}x", b.median_us / a.median_us),
        _ => "-".into(),
    };
    format!(
        "{} {} k={} n={} {} batch {}: best spec {} | best generic {} | spec/generic {} | vs default/tile {}",
        case.shape.model,
        case.shape.tensor,
        case.shape.k,
        case.shape.n,
        case.ty.name(),
        case.batch,
        fmt(bs),
        fmt(bg),
        ratio(bs, bg),
        ratio(bs, base)
    )
}

fn table(cases: &[SweepCase], results: &[CaseResult], copy: f64, floor: f64) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<12} {:<13} {:<6} {:>5} {:<5} {:<16} {:<8} {:>6} {:>10} {:>7} {:>6} {:>9}",
        "model",
        "k x n",
        "dtype",
        "batch",
        "kind",
        "tuning",
        "grid",
        "blocks",
        "median_us",
        "GB/s",
        "%copy",
        "rel_err"
    );
    for (ci, m, _) in results {
        let c = &cases[*ci];
        let bytes = c.bytes();
        for r in m {
            let _ = writeln!(
                out,
                "{:<12} {:<13} {:<6} {:>5} {:<5} {:<16} {:<8} {:>6} {:>10.2} {:>7.0} {:>5.1}% {:>9.1e}{}",
                c.shape.model,
                format!("{}x{}", c.shape.k, c.shape.n),
                c.ty.name(),
                c.batch,
                if r.specialized { "spec" } else { "gen" },
                tuning_label(&r.tuning),
                r.grid,
                r.blocks,
                r.median_us,
                gbps(bytes, r.median_us),
                100.0 * gbps(bytes, r.median_us) / copy,
                r.rel_err,
                if r.ok { "" } else { "  FAILED" }
            );
        }
    }
    let _ = writeln!(
        out,
        "\nsummary (best correct candidate per case; default/tile = default tuning, one block per tile = the previous launch):"
    );
    for (ci, m, dirty) in results {
        let _ = writeln!(
            out,
            "{} | default after a memset flush {}",
            summarize(&cases[*ci], m, copy, floor),
            dirty.map_or("-".into(), |us| format!("{us:.2} us"))
        );
    }
    out
}

fn write_json(
    path: &Path,
    args: &BenchArgs,
    gpu: &Gpu,
    h: &Harness<'_>,
    cases: &[SweepCase],
    results: &[CaseResult],
) -> Result<(), Box<dyn std::error::Error>> {
    let (copy, floor, driver) = (h.copy, h.floor, h.driver);
    let row = |c: &SweepCase, r: &Measured| -> Value {
        let g = gbps(c.bytes(), r.median_us);
        json!({
            "variant": r.variant, "kind": if r.specialized { "specialized" } else { "generic" },
            "tuning": { "batch": r.tuning.batch, "threads": r.tuning.threads, "lanes": r.tuning.lanes,
                        "rows_per_group": r.tuning.rows_per_group, "stages": r.tuning.stages, "xq8": matvec::xq8_value(&r.tuning) },
            "grid": r.grid, "blocks": r.blocks, "ok": r.ok, "rel_err": if r.rel_err.is_finite() { json!(r.rel_err) } else { Value::Null },
            "median_us": if r.ok { json!(r.median_us) } else { Value::Null },
            "min_us": if r.ok { json!(r.min_us) } else { Value::Null },
            "gbps": if r.ok { json!(g) } else { Value::Null },
            "pct_copy": if r.ok { json!(100.0 * g / copy) } else { Value::Null },
            "pct_copy_net": if r.ok { json!(pct_net(c.bytes(), r.median_us, floor, copy)) } else { Value::Null },
        })
    };
    let cases_json: Vec<Value> = results
        .iter()
        .map(|(ci, m, dirty)| {
            let c = &cases[*ci];
            let pick = |r: Option<&Measured>| {
                r.map(|r| json!({ "variant": r.variant, "grid": r.grid, "median_us": r.median_us }))
            };
            json!({
                "model": c.shape.model, "tensor": c.shape.tensor, "k": c.shape.k, "n": c.shape.n,
                "dtype": c.ty.name(), "batch": c.batch, "bytes": c.bytes(),
                "best_specialized": pick(best(m, true)), "best_generic": pick(best(m, false)),
                "baseline_default_per_tile": pick(baseline(m)),
                "dirty_flush_us": dirty,
                "candidates": m.iter().map(|r| row(c, r)).collect::<Vec<_>>(),
            })
        })
        .collect();
    let doc = json!({
        "tool": "memra bench --sweep matvec", "commit": commit(args), "date": utc_now(),
        "device": gpu.name(), "sm": gpu.arch().to_string(), "driver": driver,
        "copy_gbps": copy, "iters": args.iters, "warmup": args.warmup, "l2_flushed": true,
        "flush": "clean: a read pass over a never-written buffer of 2 x L2 before every timed launch", "floor_us": floor,
        "cases_planned": cases.len(), "cases_done": results.len(), "tolerance_rel_l2": TOLERANCE, "pattern_rows": PATTERN_ROWS, "cases": cases_json,
    });
    std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
        .map_err(|e| format!("write {}: {e}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_covers_the_shapes_and_every_candidate_fits() {
        let cases = plan();
        // 9 shapes × 5 types minus Q4_K/Q6_K at K = 640 (one shape), + lm_head Q8_0, + the
        // 32-row projection in 2 types; × 2 batches.
        assert_eq!(cases.len(), (9 * 5 - 2 + 1 + 2) * 2);
        // Batch 1: the taller / deeper tunings also run on the integer path.
        let q4k = cases
            .iter()
            .find(|c| c.ty == GgmlType::Q4_K && c.batch == 1)
            .unwrap();
        for fuse_x in [false, true] {
            assert!(q4k.candidates.iter().any(|(t, ..)| t.xq8
                && t.fuse_x == fuse_x
                && (t.threads, t.rows_per_group, t.stages) == (256, 4, 4)));
        }
        for c in &cases {
            assert!(
                !c.candidates.is_empty(),
                "{} {}",
                c.shape.tensor,
                c.ty.name()
            );
            for (t, s, g) in &c.candidates {
                assert!(fits(c.ty, t, c.shape.k));
                assert_eq!(t.batch as usize, c.batch);
                assert!(!s.is_generic() && g.is_generic());
                assert!(
                    s.source.contains(&format!("K = {}", c.shape.k)) && g.source.contains("K = 0")
                );
            }
        }
        let mut names: Vec<&str> = cases
            .iter()
            .flat_map(|c| c.candidates.iter().flat_map(|(_, s, g)| [s.name, g.name]))
            .collect();
        let total = names.len();
        names.sort();
        names.dedup();
        // Integer-path types also run xq8 candidates; the others never.
        for c in &cases {
            let n_q8 = c.candidates.iter().filter(|(t, ..)| t.xq8).count();
            assert_eq!(
                n_q8 > 0,
                matvec::int_dot(c.ty),
                "{} {}",
                c.shape.tensor,
                c.ty.name()
            );
            for (t, s, g) in c.candidates.iter().filter(|(t, ..)| t.xq8) {
                let cfg = format!("XQ8 = {}", matvec::xq8_value(t));
                assert!(s.source.contains(&cfg) && g.source.contains(&cfg));
            }
        }
        // Specialized names are unique per case; generic twins are shared across shapes.
        let spec: usize = cases.iter().map(|c| c.candidates.len()).sum();
        assert!(names.len() > spec && names.len() < total);
        // The device compiles them all (16 cores, ~3 s each) within one command's 10 minutes.
        eprintln!("{} variants to compile", names.len());
        assert!(names.len() <= 2200, "{} variants", names.len());
    }
}
