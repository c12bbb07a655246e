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

use cudarc::driver::CudaSlice;
use memra_gguf::{GgmlType, quant};
use memra_reference::{Rng, q8};
use rayon::prelude::*;
use serde_json::{Value, json};

use super::{BenchArgs, alloc, drv, tile, token, weight_bytes};
use crate::cuda::{Error, Gpu, Kernel};
use crate::kernels::matvec::{self, GridPolicy, MatvecTuning};
use crate::kernels::quantize_q8;
use crate::kernels::registry::{KernelVariant, Param};

mod harness;
pub mod moe;

use harness::{Case, Measured, Output, Rates, baseline, best, fits, ratio, tuning_label};

/// Distinct random weight rows tiled over N (prime, so tile-periodic indexing bugs still show).
const PATTERN_ROWS: usize = 509;
/// Relative L2 error a candidate must stay under (f32 path, DESIGN.md).
const TOLERANCE: f64 = 1e-4;
const BATCHES: [usize; 2] = [1, 4];
/// Batch 1 tries tunings of fewer than 32 lanes a row only on rows this short (elements).
const SHORT_ROW_K: usize = 1024;
/// Tunings (the first of [`candidate_tunings`]) also run with `xq8` on integer-path types.
const XQ8_CANDIDATES: usize = 5;
/// Batch 1: further tunings also run with `xq8` (the deeper / taller ones, more bytes in flight).
const XQ8_EXTRA_BATCH1: [(u32, u32, u32, u32); 7] =
    [(256, 32, 4, 4), (512, 32, 2, 4), (128, 32, 4, 4), (256, 16, 4, 3), (256, 8, 4, 3), (256, 8, 8, 3), (128, 8, 8, 4)];
const TYPES: [GgmlType; 5] = [
    GgmlType::Q4_K,
    GgmlType::Q8_0,
    GgmlType::Q6_K,
    GgmlType::Q5_0,
    GgmlType::BF16,
];
/// The types issue #3's bandwidth goal names (Q8_0, Q4_K, BF16).
const BIG_TYPES: [GgmlType; 3] = [GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::BF16];

/// One decode matrix shape: which model and tensor it stands for, K → N, the weight types.
#[derive(Clone, Copy, Debug)]
pub struct SweepShape {
    pub model: &'static str,
    pub tensor: &'static str,
    pub k: usize,
    pub n: usize,
    pub types: &'static [GgmlType],
}

pub const SHAPES: [SweepShape; 13] = [
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
    // The largest decode projections below the LM head (107 / 80 MB in Q8_0).
    SweepShape {
        model: "glm-5",
        tensor: "attn_output (16384→6144)",
        k: 16384,
        n: 6144,
        types: &BIG_TYPES,
    },
    SweepShape {
        model: "glm-5",
        tensor: "dense ffn_down (12288→6144)",
        k: 12288,
        n: 6144,
        types: &BIG_TYPES,
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
            // Short rows only (K ≤ SHORT_ROW_K; K = 640 is 20 Q8_0 units, so 32 lanes leave 12
            // idle): fewer lanes a row, more rows a group (the Gemma 3 LM head).
            (256, 16, 4, 3),
            (256, 8, 4, 3),
            (256, 8, 8, 3),
            (128, 8, 8, 4),
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
    harness::tunings(batch as u32, shapes)
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
    params.push(("batch", Param::Int(t.batch as i64)));
    params.extend(harness::tuning_params(t));
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
                    .filter(|t| fits(ty, t, shape.k) && (batch > 1 || t.lanes == 32 || shape.k <= SHORT_ROW_K))
                    // The direct path has no pipeline: candidates that differ in stages alone are one kernel.
                    .filter(|t| !matvec::direct(ty, t) || t.stages == MatvecTuning::default().stages)
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
    /// x as q8 rows (written by each xq8 launch); None without xq8 candidates.
    xq: Option<CudaSlice<f32>>,
    /// y[b][j] and its oracles, row j from pattern row j % PATTERN_ROWS.
    out: Output,
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
        xq,
        out: Output { y, want, want_q8 },
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
            &mut buf.out.y.slice_mut(..),
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
        &mut buf.out.y.slice_mut(..),
        k,
        n,
        case.batch,
        k,
        n,
        grid,
    )
}

impl Case for SweepCase {
    type Buffers = Buffers;
    // As the wrapper launches by default.
    const DIRTY_GRID: GridPolicy = GridPolicy::Resident;
    const SUMMARY_HEADING: &'static str = "summary (best correct candidate per case; default/tile = default tuning, one block per tile = the previous launch):";
    const DIRTY_LABELS: (&'static str, &'static str) = (
        " | default after a dirty (memset) flush: ",
        " | default after a memset flush ",
    );

    fn list(cases: &[Self]) {
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

    fn candidates(&self) -> Vec<(MatvecTuning, &'static KernelVariant, bool)> {
        self.candidates
            .iter()
            .flat_map(|&(t, spec, generic)| [(t, spec, true), (t, generic, false)])
            .collect()
    }

    fn bytes(&self) -> u64 {
        SweepCase::bytes(self)
    }

    fn prepare(&self, gpu: &Gpu, rng: &mut Rng) -> Result<Buffers, Box<dyn std::error::Error>> {
        prepare(gpu, self, rng)
            .map_err(|e| format!("{} {}: {e}", self.shape.tensor, self.ty.name()).into())
    }

    fn output(buf: &mut Buffers) -> &mut Output {
        &mut buf.out
    }

    fn launch(
        &self,
        kernel: &Kernel,
        qk: &Kernel,
        buf: &mut Buffers,
        grid: GridPolicy,
    ) -> Result<(), Error> {
        launch(kernel, qk, self, buf, grid)
    }

    fn blocks(&self, kernel: &Kernel, grid: GridPolicy) -> u32 {
        let t = matvec::tuning(kernel).unwrap_or_default();
        harness::grid_geometry(kernel, self.ty, &t, self.shape.k, grid).map_or(0, |(geo, max)| {
            matvec::launch_config_blocks(&geo, self.shape.n, max)
                .grid_dim
                .0
        })
    }

    fn what(&self) -> String {
        format!("k={} n={} batch={}", self.shape.k, self.shape.n, self.batch)
    }

    fn table_head() -> String {
        format!(
            "{:<12} {:<13} {:<6} {:>5} {:<5}",
            "model", "k x n", "dtype", "batch", "kind"
        )
    }

    fn table_columns(&self, specialized: bool) -> String {
        format!(
            "{:<12} {:<13} {:<6} {:>5} {:<5}",
            self.shape.model,
            format!("{}x{}", self.shape.k, self.shape.n),
            self.ty.name(),
            self.batch,
            if specialized { "spec" } else { "gen" },
        )
    }

    fn summary(&self, m: &[Measured], rates: &Rates) -> String {
        let bytes = SweepCase::bytes(self);
        let (bs, bg, base) = (best(m, true), best(m, false), baseline(m));
        format!(
            "{} {} k={} n={} {} batch {}: best spec {} | best generic {} | spec/generic {} | vs default/tile {}",
            self.shape.model,
            self.shape.tensor,
            self.shape.k,
            self.shape.n,
            self.ty.name(),
            self.batch,
            rates.pick(bytes, bs),
            rates.pick(bytes, bg),
            ratio(bs, bg),
            ratio(bs, base)
        )
    }

    fn json_case(&self) -> Vec<(&'static str, Value)> {
        let s = &self.shape;
        vec![
            ("model", json!(s.model)),
            ("tensor", json!(s.tensor)),
            ("k", json!(s.k)),
            ("n", json!(s.n)),
            ("dtype", json!(self.ty.name())),
            ("batch", json!(self.batch)),
            ("bytes", json!(SweepCase::bytes(self))),
        ]
    }
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
    if let Some(text) = &args.tensor {
        cases.retain(|c| c.shape.tensor.contains(text.as_str()));
        if cases.is_empty() {
            let labels: Vec<&str> = SHAPES.iter().map(|s| s.tensor).collect();
            return Err(format!("--sweep matvec --tensor {text}: no shape's label contains it ({})", labels.join("; ")).into());
        }
    }
    harness::run(args, matvec::FAMILY, &cases)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_covers_the_shapes_and_every_candidate_fits() {
        let cases = plan();
        // 9 shapes × 5 types minus Q4_K/Q6_K at K = 640 (one shape), + lm_head Q8_0, + the
        // 32-row projection in 2 types, + 2 big shapes in 3 types; × 2 batches.
        assert_eq!(cases.len(), (9 * 5 - 2 + 1 + 2 + 2 * 3) * 2);
        // Batch 1: the taller / deeper tunings also run on the integer path (on quantize_q8 rows
        // Q4_K takes the direct path, where stages do not exist: one candidate per shape of rows).
        let q4k = cases
            .iter()
            .find(|c| c.ty == GgmlType::Q4_K && c.batch == 1)
            .unwrap();
        assert!(q4k.candidates.iter().any(|(t, ..)| t.xq8 && t.fuse_x && (t.threads, t.rows_per_group, t.stages) == (256, 4, 4)));
        assert!(q4k.candidates.iter().any(|(t, ..)| t.xq8 && !t.fuse_x && (t.threads, t.rows_per_group) == (256, 4)));
        assert!(!q4k.candidates.iter().any(|(t, ..)| matvec::direct(GgmlType::Q4_K, t) && t.stages != MatvecTuning::default().stages));
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
        // The device compiles them all within one command's 10 minutes (in this process: NVRTC
        // 13.0 compiles one at a time per process there, ~50 ms each, s24).
        eprintln!("{} variants to compile", names.len());
        assert!(names.len() <= 2400, "{} variants", names.len());
    }
}
