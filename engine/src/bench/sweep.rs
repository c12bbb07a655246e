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
//!    preceded (outside the events) by a memset of twice the L2 size, so every launch reads its
//!    weights from HBM (L2 flushed; one buffer set); the median is reported.
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
    BenchArgs, alloc, commit, copy_bandwidth, driver_version, drv, l2_bytes, median, tile,
    time_launches, token, utc_now, weight_bytes,
};
use crate::cuda::{Error, Gpu, Kernel, Kernels};
use crate::kernels::matvec::{self, GridPolicy, MatvecTuning};
use crate::kernels::quantize_q8;
use crate::kernels::registry::{KernelVariant, Param};

/// Distinct random weight rows tiled over N (prime, so tile-periodic indexing bugs still show).
const PATTERN_ROWS: usize = 509;
/// Relative L2 error a candidate must stay under (f32 path, DESIGN.md).
const TOLERANCE: f64 = 1e-4;
/// Most dynamic shared memory one block may use on sm_90 (227 KiB).
const MAX_SMEM: u32 = 232_448;
const BATCHES: [usize; 2] = [1, 4];
/// Tunings (the first of [`candidate_tunings`]) also run with `xq8` on integer-path types.
const XQ8_CANDIDATES: usize = 5;
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

pub const SHAPES: [SweepShape; 9] = [
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
            (128, 32, 1, 4),
            (128, 32, 2, 4),
            (256, 32, 4, 3),
            (512, 32, 1, 3),
            (512, 32, 2, 3),
            (256, 16, 1, 4),
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

/// The f32 candidates, then (integer-path types) the first [`XQ8_CANDIDATES`] with `xq8`
/// (x quantized by a quantize_q8 launch) and with `xq8` + `fuse_x` (quantized in each block).
fn candidates_for(ty: GgmlType, batch: usize) -> Vec<MatvecTuning> {
    let f32_path = candidate_tunings(batch);
    let mut q8_path: Vec<MatvecTuning> = Vec::new();
    if matvec::int_dot(ty) {
        for fuse_x in [false, true] {
            q8_path.extend(f32_path.iter().take(XQ8_CANDIDATES).map(|t| MatvecTuning {
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
    let s = gpu.stream();
    let nan = vec![f32::NAN; buf.y.len()];
    s.memcpy_htod(nan.as_slice(), &mut buf.y)
        .map_err(drv("cuMemcpyHtoD (NaN poison)"))?;
    launch(kernel, qk, case, buf, grid)?;
    let got = s.clone_dtoh(&buf.y).map_err(drv("cuMemcpyDtoH (y)"))?;
    let want = if matvec::tuning(kernel)?.xq8 {
        &buf.want_q8
    } else {
        &buf.want
    };
    Ok(rel_err(&got, want))
}

fn blocks(kernel: &Kernel, case: &SweepCase, grid: GridPolicy) -> u32 {
    let Some(geo) = matvec::geometry(case.ty, &matvec::tuning(kernel).unwrap_or_default()) else {
        return 0;
    };
    let max = match grid {
        GridPolicy::PerTile => usize::MAX,
        GridPolicy::Resident => matvec::resident_blocks(kernel, &geo).unwrap_or(usize::MAX),
        GridPolicy::AtMost(b) => b as usize,
    };
    matvec::launch_config_blocks(&geo, case.shape.n, max)
        .grid_dim
        .0
}

/// `memra bench --sweep matvec`.
pub fn run(args: &BenchArgs, family: &str) -> Result<(), Box<dyn std::error::Error>> {
    if family != matvec::FAMILY {
        return Err(format!("--sweep {family}: only `matvec` has a sweep").into());
    }
    let cases = plan();
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
    let mut rng = Rng::from_env_or_time("memra bench --sweep");
    eprintln!(
        "seed {} (replay with MEMRA_SEED={})",
        rng.seed(),
        rng.seed()
    );
    let mut results: Vec<(usize, Vec<Measured>)> = Vec::new();
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
                    // A launch error is this candidate's failure, not the sweep's (a sticky
                    // one fails the rest too, each with its message).
                    let (err, launched) = match check(&gpu, kernel, qk, case, &mut buf, p) {
                        Ok(err) => (err, true),
                        Err(e) => {
                            eprintln!("ERROR {} ({grid}): {e}", v.name);
                            (f64::INFINITY, false)
                        }
                    };
                    let mut ok = err <= TOLERANCE;
                    let (mut median_us, mut min_us) = (f64::NAN, f64::NAN);
                    if ok {
                        match time_launches(&gpu, args.warmup, args.iters, &mut flush, &mut |_| {
                            launch(kernel, qk, case, &mut buf, p)
                        }) {
                            Ok(us) => (median_us, min_us) = (median(&us), us[0]),
                            Err(e) => {
                                eprintln!("ERROR {} ({grid}) while timing: {e}", v.name);
                                ok = false;
                            }
                        }
                    } else if launched {
                        eprintln!(
                            "WRONG {} ({grid}) k={} n={} batch={}: relative L2 error {err:e} > {TOLERANCE:e} (inf: NaN/inf in the output)",
                            v.name, case.shape.k, case.shape.n, case.batch
                        );
                    }
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
        let summary = summarize(case, &measured, copy_gbps);
        eprintln!("[{}/{}] {summary}", ci + 1, cases.len());
        results.push((ci, measured));
        drop(buf);
        // Rewritten after every case, so a run cut short still leaves what it measured.
        if let Some(path) = &args.json {
            write_json(path, args, &gpu, &driver, copy_gbps, &cases, &results)?;
        }
    }
    drop(flush);

    let text = table(&cases, &results, copy_gbps);
    println!(
        "copy bandwidth: {copy_gbps:.0} GB/s (L2 flushed before every timed launch; median of {} launches)",
        args.iters
    );
    print!("{text}");
    if let Some(path) = &args.json {
        write_json(path, args, &gpu, &driver, copy_gbps, &cases, &results)?;
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

fn summarize(case: &SweepCase, m: &[Measured], copy: f64) -> String {
    let bytes = case.bytes();
    let fmt = |r: Option<&Measured>| {
        r.map(|r| {
            format!(
                "{:.2} us {:.1}% ({} {})",
                r.median_us,
                100.0 * gbps(bytes, r.median_us) / copy,
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

fn table(cases: &[SweepCase], results: &[(usize, Vec<Measured>)], copy: f64) -> String {
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
    for (ci, m) in results {
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
    for (ci, m) in results {
        let _ = writeln!(out, "{}", summarize(&cases[*ci], m, copy));
    }
    out
}

fn write_json(
    path: &Path,
    args: &BenchArgs,
    gpu: &Gpu,
    driver: &str,
    copy: f64,
    cases: &[SweepCase],
    results: &[(usize, Vec<Measured>)],
) -> Result<(), Box<dyn std::error::Error>> {
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
        })
    };
    let cases_json: Vec<Value> = results
        .iter()
        .map(|(ci, m)| {
            let c = &cases[*ci];
            let pick = |r: Option<&Measured>| {
                r.map(|r| json!({ "variant": r.variant, "grid": r.grid, "median_us": r.median_us }))
            };
            json!({
                "model": c.shape.model, "tensor": c.shape.tensor, "k": c.shape.k, "n": c.shape.n,
                "dtype": c.ty.name(), "batch": c.batch, "bytes": c.bytes(),
                "best_specialized": pick(best(m, true)), "best_generic": pick(best(m, false)),
                "baseline_default_per_tile": pick(baseline(m)),
                "candidates": m.iter().map(|r| row(c, r)).collect::<Vec<_>>(),
            })
        })
        .collect();
    let doc = json!({
        "tool": "memra bench --sweep matvec", "commit": commit(args), "date": utc_now(),
        "device": gpu.name(), "sm": gpu.arch().to_string(), "driver": driver,
        "copy_gbps": copy, "iters": args.iters, "warmup": args.warmup, "l2_flushed": true,
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
        // 8 shapes × 5 types minus Q4_K/Q6_K at K = 640 (one shape), + lm_head Q8_0; × 2 batches.
        assert_eq!(cases.len(), (8 * 5 - 2 + 1) * 2);
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
    }
}
