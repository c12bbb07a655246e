//! `memra bench --sweep moe_matvec`: candidate moe_matvec tunings × grid policies at GLM-5's
//! decode MoE shapes (one token), in one run, timed as the matvec sweep times its candidates
//! (clean L2 flush before every launch, median of `--iters`, `floor_us`, `dirty_flush_us`).
//!
//! Experts are `PATTERN_ROWS` random rows per tensor (gate and up differ) quantized once and
//! tiled over all `n_expert·N` rows, so the oracle needs one dot product per pattern row and
//! x row; ids are distinct random experts. Every candidate is checked once against it (relative
//! L2 ≤ 1e-4, NaN-poisoned output; xq8 candidates against `memra_reference::q8`) before timing.
//! Grids (`matvec::GridPolicy`): `tile` = one block per tile of each slot (the wrapper's default
//! before this sweep), `resident` = the blocks the device holds at once shared out over the
//! slots, each walking its slot's tiles with one pipeline. Only specialized variants.

use std::fmt::Write as _;
use std::path::Path;

use cudarc::driver::CudaSlice;
use memra_gguf::{GgmlType, quant};
use memra_reference::{Rng, act, q8};
use rayon::prelude::*;
use serde_json::{Value, json};

use super::{
    BenchArgs, L2Flush, PATTERN_ROWS, TOLERANCE, err_vs, floor_us, gbps, pct_net, poison,
    quantize_variant, time_checked, time_dirty,
};
use crate::bench::{
    alloc, commit, copy_bandwidth, driver_version, drv, l2_bytes, tile, token, utc_now,
};
use crate::cuda::{Error, Gpu, Kernel, Kernels};
use crate::kernels::matvec::{self, GridPolicy, MatvecTuning};
use crate::kernels::moe_matvec::{self, Mode, MoeDims, MoeMatvecInputs};
use crate::kernels::quantize_q8;
use crate::kernels::registry::{KernelVariant, Param};

/// One decode MoE launch shape.
#[derive(Clone, Copy, Debug)]
pub struct MoeShape {
    pub model: &'static str,
    pub tensor: &'static str,
    pub mode: Mode,
    pub k: usize,
    pub n: usize,
    pub n_expert: usize,
    pub n_used: usize,
    pub ty: GgmlType,
}

pub const SHAPES: [MoeShape; 4] = [
    MoeShape {
        model: "glm-5",
        tensor: "routed gate+up+SwiGLU, 8 of 256 experts",
        mode: Mode::Swiglu,
        k: 6144,
        n: 2048,
        n_expert: 256,
        n_used: 8,
        ty: GgmlType::Q4_K,
    },
    MoeShape {
        model: "glm-5",
        tensor: "routed down + weighted sum, 8 of 256 experts",
        mode: Mode::Down,
        k: 2048,
        n: 6144,
        n_expert: 256,
        n_used: 8,
        ty: GgmlType::Q4_K,
    },
    MoeShape {
        model: "glm-5",
        tensor: "shared expert gate+up+SwiGLU",
        mode: Mode::Swiglu,
        k: 6144,
        n: 2048,
        n_expert: 1,
        n_used: 1,
        ty: GgmlType::Q8_0,
    },
    MoeShape {
        model: "glm-5",
        tensor: "dense FFN gate+up+SwiGLU",
        mode: Mode::Swiglu,
        k: 6144,
        n: 12288,
        n_expert: 1,
        n_used: 1,
        ty: GgmlType::Q8_0,
    },
];

/// (threads, lanes, rows per group, stages); the first is the README default. Rows per group
/// stay even (Swiglu pairs gate and up rows).
const TUNINGS: [(u32, u32, u32, u32); 8] = [
    (256, 32, 2, 3),
    (256, 32, 4, 3),
    (512, 32, 2, 3),
    (256, 32, 2, 4),
    (256, 32, 4, 4),
    (128, 32, 2, 4),
    (512, 32, 2, 4),
    (128, 32, 4, 4),
];
/// The first tunings also run with `xq8` (x quantized by a quantize_q8 launch, timed with it)
/// and, except in Down, with `xq8` + `fuse_x` (each block quantizes its slot's x: one launch).
const XQ8_TUNINGS: usize = 3;

fn candidates(ty: GgmlType, mode: Mode, k: usize) -> Vec<MatvecTuning> {
    let base: Vec<MatvecTuning> = TUNINGS
        .iter()
        .map(|&(threads, lanes, rows_per_group, stages)| MatvecTuning {
            batch: 1,
            threads,
            lanes,
            rows_per_group,
            stages,
            accumulate: false,
            xq8: false,
            fuse_x: false,
        })
        .collect();
    let fused: &[bool] = if mode == Mode::Down {
        &[false]
    } else {
        &[false, true]
    };
    let q8: Vec<MatvecTuning> = if matvec::int_dot(ty) {
        fused
            .iter()
            .flat_map(|&fuse_x| {
                base.iter().take(XQ8_TUNINGS).map(move |t| MatvecTuning {
                    xq8: true,
                    fuse_x,
                    ..*t
                })
            })
            .collect()
    } else {
        Vec::new()
    };
    base.into_iter()
        .chain(q8)
        .filter(|t| {
            matvec::geometry(ty, t).is_some_and(|g| {
                g.smem_bytes + matvec::fused_x_bytes(ty, t, k).unwrap_or(u32::MAX)
                    <= matvec::MAX_DYNAMIC_SMEM
            })
        })
        .collect()
}

fn label(t: &MatvecTuning) -> String {
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

/// A specialized variant (leaked, as the matvec sweep's).
fn render(s: &MoeShape, t: &MatvecTuning) -> &'static KernelVariant {
    let tok = token(s.ty);
    let name: &'static str = Box::leak(
        format!(
            "moe_matvec__k{}_n{}__{tok}_{}_sweep_{}",
            s.k,
            s.n,
            s.mode.token(),
            label(t)
        )
        .into_boxed_str(),
    );
    let mut params: Vec<(&'static str, Param)> = vec![
        ("k", Param::Int(s.k as i64)),
        ("n", Param::Int(s.n as i64)),
        ("qtype", Param::Sym(tok)),
        ("mode", Param::Sym(s.mode.token())),
    ];
    for (key, v) in [
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
    let source: &'static str =
        Box::leak(moe_matvec::render_source(name, s.ty, s.mode, s.k, s.n, t).into_boxed_str());
    Box::leak(Box::new(KernelVariant {
        name,
        family: moe_matvec::FAMILY,
        arch: Some("sweep"),
        params: Box::leak(params.into_boxed_slice()),
        source,
    }))
}

pub struct MoeCase {
    pub shape: MoeShape,
    pub candidates: Vec<(MatvecTuning, &'static KernelVariant)>,
}

impl MoeCase {
    /// Selected expert rows (distinct ids) + x + y.
    pub fn bytes(&self) -> u64 {
        let s = &self.shape;
        let w = moe_matvec::selected_bytes(s.ty, s.mode, s.k, s.n, s.n_used).unwrap_or(0);
        let (x_rows, y_rows) = match s.mode {
            Mode::Down => (s.n_used, 1),
            _ => (1, s.n_used),
        };
        (w + 4 * s.k * x_rows + 4 * s.n * y_rows) as u64
    }

    /// Rows of x the kernel reads and of y it writes.
    fn rows(&self) -> (usize, usize) {
        match self.shape.mode {
            Mode::Down => (self.shape.n_used, 1),
            _ => (1, self.shape.n_used),
        }
    }
}

pub fn plan() -> Vec<MoeCase> {
    SHAPES
        .iter()
        .map(|s| MoeCase {
            shape: *s,
            candidates: candidates(s.ty, s.mode, s.k)
                .iter()
                .map(|t| (*t, render(s, t)))
                .collect(),
        })
        .collect()
}

struct Buffers {
    w: CudaSlice<u8>,
    w_up: Option<CudaSlice<u8>>,
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    x: CudaSlice<f32>,
    xq: CudaSlice<f32>,
    y: CudaSlice<f32>,
    want: Vec<f32>,
    want_q8: Vec<f32>,
}

/// Dot products of every pattern row with every x row: `[x row][pattern row]`, f64 (or the q8
/// oracle's, x quantized as quantize_q8 does).
fn dots(ty: GgmlType, pattern: &[u8], k: usize, xs: &[f32], q8x: bool) -> Result<Vec<f64>, String> {
    let rows = pattern.len() / ty.row_bytes(k as u64).unwrap_or(1) as usize;
    let rb = pattern.len() / rows;
    let dense = if q8x {
        Vec::new()
    } else {
        quant::dequantize(ty, pattern, rows * k).map_err(|e| format!("dequantize: {e}"))?
    };
    let xq: Vec<q8::Q8Row> = if q8x {
        xs.chunks_exact(k).map(q8::quantize_q8_blocks).collect()
    } else {
        Vec::new()
    };
    let n_x = xs.len() / k;
    (0..n_x * rows)
        .into_par_iter()
        .map(|i| {
            let (b, p) = (i / rows, i % rows);
            if q8x {
                q8::vec_dot_q8(ty, &pattern[p * rb..(p + 1) * rb], &xq[b])
                    .map_err(|e| format!("q8 oracle {}: {e}", ty.name()))
            } else {
                Ok(dense[p * k..(p + 1) * k]
                    .iter()
                    .zip(&xs[b * k..(b + 1) * k])
                    .map(|(w, v)| *w as f64 * *v as f64)
                    .sum())
            }
        })
        .collect()
}

/// The expected y: row n of expert e is pattern row (e·N + n) % P of its tensor.
fn expected(
    s: &MoeShape,
    ids: &[i32],
    wts: &[f32],
    gate: &[f64],
    up: &[f64],
    p: usize,
) -> Vec<f32> {
    let row = |j: usize, n: usize| (ids[j] as usize * s.n + n) % p;
    match s.mode {
        Mode::Down => (0..s.n)
            .map(|n| {
                (0..s.n_used)
                    .map(|j| wts[j] as f64 * gate[j * p + row(j, n)])
                    .sum::<f64>() as f32
            })
            .collect(),
        _ => (0..s.n_used * s.n)
            .map(|i| {
                let (j, n) = (i / s.n, i % s.n);
                let g = gate[row(j, n)];
                match s.mode {
                    Mode::Swiglu => (g / (1.0 + (-g).exp()) * up[row(j, n)]) as f32,
                    Mode::Geglu => act::gelu_tanh(g as f32) * up[row(j, n)] as f32,
                    _ => g as f32,
                }
            })
            .collect(),
    }
}

fn prepare(
    gpu: &Gpu,
    case: &MoeCase,
    rng: &mut Rng,
) -> Result<Buffers, Box<dyn std::error::Error>> {
    let s = &case.shape;
    let st = gpu.stream();
    let p = PATTERN_ROWS.min(s.n_expert * s.n);
    let rb = s.ty.row_bytes(s.k as u64).ok_or("row bytes")? as usize;
    let total = s.n_expert * s.n * rb;
    let tensor = |rng: &mut Rng| -> Result<(Vec<u8>, CudaSlice<u8>), Box<dyn std::error::Error>> {
        let pat = quant::quantize(s.ty, &rng.normal_vec(p * s.k, 1.0))
            .map_err(|e| format!("quantize {} {}x{p}: {e}", s.ty.name(), s.k))?;
        let pat_dev = st
            .clone_htod(&pat)
            .map_err(drv("cuMemcpyHtoD (expert pattern)"))?;
        let mut w = alloc::<u8>(st, total)?;
        tile(st, &mut w, &pat_dev)?;
        Ok((pat, w))
    };
    let (pat_g, w) = tensor(rng)?;
    let (pat_u, w_up) = if s.mode.is_paired() {
        let (pu, wu) = tensor(rng)?;
        (pu, Some(wu))
    } else {
        (Vec::new(), None)
    };
    // Distinct experts for the one token.
    let mut pool: Vec<i32> = (0..s.n_expert as i32).collect();
    for j in 0..s.n_used {
        let i = j + rng.below(s.n_expert - j);
        pool.swap(j, i);
    }
    let ids_h = pool[..s.n_used].to_vec();
    let wts_h: Vec<f32> = (0..s.n_used).map(|_| rng.uniform_in(0.05, 1.0)).collect();
    let (x_rows, y_rows) = case.rows();
    let xh = rng.normal_vec(x_rows * s.k, 1.0);
    let want_for = |q8x: bool| -> Result<Vec<f32>, Box<dyn std::error::Error>> {
        let g = dots(s.ty, &pat_g, s.k, &xh, q8x)?;
        let u = if s.mode.is_paired() {
            dots(s.ty, &pat_u, s.k, &xh, q8x)?
        } else {
            Vec::new()
        };
        Ok(expected(s, &ids_h, &wts_h, &g, &u, p))
    };
    let want = want_for(false)?;
    let want_q8 = if case.candidates.iter().any(|(t, _)| t.xq8) {
        want_for(true)?
    } else {
        Vec::new()
    };
    let b = Buffers {
        w,
        w_up,
        ids: st.clone_htod(&ids_h).map_err(drv("cuMemcpyHtoD (ids)"))?,
        weights: st
            .clone_htod(&wts_h)
            .map_err(drv("cuMemcpyHtoD (weights)"))?,
        x: st.clone_htod(&xh).map_err(drv("cuMemcpyHtoD (x)"))?,
        xq: alloc::<f32>(st, x_rows * quantize_q8::row_floats(s.k))?,
        y: alloc::<f32>(st, y_rows * s.n)?,
        want,
        want_q8,
    };
    gpu.sync()?;
    Ok(b)
}

fn launch(
    kernel: &Kernel,
    qk: &Kernel,
    case: &MoeCase,
    buf: &mut Buffers,
    grid: GridPolicy,
) -> Result<(), Error> {
    let s = &case.shape;
    let t = moe_matvec::tuning(kernel)?;
    let xq8 = t.xq8 && !t.fuse_x; // x as quantize_q8 rows
    let (x_rows, _) = case.rows();
    let ldx = if xq8 {
        let ldq = quantize_q8::row_floats(s.k);
        quantize_q8::quantize_q8(
            qk,
            &buf.x.slice(..),
            &mut buf.xq.slice_mut(..),
            s.k,
            x_rows,
            s.k,
            ldq,
        )?;
        ldq
    } else {
        s.k
    };
    let w = buf.w.slice(..);
    let w_up = buf.w_up.as_ref().map(|u| u.slice(..));
    let ids = buf.ids.slice(..);
    let wts = buf.weights.slice(..);
    let x = if xq8 {
        buf.xq.slice(..)
    } else {
        buf.x.slice(..)
    };
    let inp = MoeMatvecInputs {
        w: &w,
        w_up: w_up.as_ref(),
        ids: &ids,
        weights: (s.mode == Mode::Down).then_some(&wts),
        x: &x,
    };
    let dims = MoeDims {
        k: s.k,
        n: s.n,
        n_tokens: 1,
        n_used: s.n_used,
        n_expert: s.n_expert,
        ldx,
        ldy: s.n,
    };
    moe_matvec::moe_matvec_with(kernel, &inp, &mut buf.y.slice_mut(..), dims, grid)
}

fn check(
    gpu: &Gpu,
    kernel: &Kernel,
    qk: &Kernel,
    case: &MoeCase,
    buf: &mut Buffers,
    grid: GridPolicy,
) -> Result<f64, Error> {
    poison(gpu, &mut buf.y)?;
    launch(kernel, qk, case, buf, grid)?;
    let want = if moe_matvec::tuning(kernel)?.xq8 {
        &buf.want_q8
    } else {
        &buf.want
    };
    err_vs(gpu, &buf.y, want)
}

struct Measured {
    variant: &'static str,
    tuning: MatvecTuning,
    grid: &'static str,
    blocks: u32,
    rel_err: f64,
    ok: bool,
    median_us: f64,
    min_us: f64,
}

fn blocks(kernel: &Kernel, case: &MoeCase, grid: GridPolicy) -> u32 {
    let s = &case.shape;
    let t = moe_matvec::tuning(kernel).unwrap_or_default();
    let Some(mut geo) = matvec::geometry(s.ty, &t) else {
        return 0;
    };
    geo.smem_bytes += matvec::fused_x_bytes(s.ty, &t, s.k).unwrap_or(0);
    let max = match grid {
        GridPolicy::PerTile => usize::MAX,
        GridPolicy::Resident => matvec::resident_blocks(kernel, &geo).unwrap_or(usize::MAX),
        GridPolicy::AtMost(b) => b as usize,
    };
    let c = moe_matvec::launch_config_blocks(&geo, s.mode, s.n, 1, s.n_used, max);
    c.grid_dim.0 * c.grid_dim.1
}

fn list(cases: &[MoeCase]) {
    for c in cases {
        let s = &c.shape;
        println!(
            "{:<6} {:<46} {:<6} {}x{} e{} u{}  {} candidates: {}",
            s.model,
            s.tensor,
            s.ty.name(),
            s.k,
            s.n,
            s.n_expert,
            s.n_used,
            c.candidates.len(),
            c.candidates
                .iter()
                .map(|(t, _)| label(t))
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    println!(
        "{} cases, {} specialized variants, 2 grid policies each",
        cases.len(),
        cases.iter().map(|c| c.candidates.len()).sum::<usize>()
    );
}

/// `memra bench --sweep moe_matvec`.
pub fn run(args: &BenchArgs) -> Result<(), Box<dyn std::error::Error>> {
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
        .flat_map(|c| c.candidates.iter().map(|(_, v)| *v))
        .collect();
    all.push(quantize_variant());
    all.sort_by_key(|v| v.name);
    all.dedup_by_key(|v| v.name);
    eprintln!(
        "memra bench --sweep moe_matvec: {} ({}), {driver}, L2 {} MiB; {} cases, compiling {} variants",
        gpu.name(),
        gpu.arch(),
        l2 >> 20,
        cases.len(),
        all.len()
    );
    let kernels: Kernels = gpu.load(&all)?;
    let qk = kernels.get(quantize_variant().name)?;
    let copy = copy_bandwidth(&gpu, 3, args.iters)?;
    let mut flush = alloc::<u8>(gpu.stream(), 2 * l2)?;
    let mut cleaner = L2Flush::new(&gpu, l2)?;
    let floor = floor_us(&gpu, args, &mut cleaner)?;
    eprintln!("copy bandwidth {copy:.0} GB/s; harness floor {floor:.2} us");
    let mut rng = Rng::from_env_or_time("memra bench --sweep moe_matvec");
    eprintln!(
        "seed {} (replay with MEMRA_SEED={})",
        rng.seed(),
        rng.seed()
    );
    let mut results: Vec<(usize, Vec<Measured>, Option<f64>)> = Vec::new();
    let mut failures = 0usize;
    for (ci, case) in cases.iter().enumerate() {
        let mut buf =
            prepare(&gpu, case, &mut rng).map_err(|e| format!("{}: {e}", case.shape.tensor))?;
        let mut measured = Vec::new();
        for (tuning, v) in &case.candidates {
            let kernel = kernels.get(v.name)?;
            for grid in ["tile", "resident"] {
                let p = if grid == "tile" {
                    GridPolicy::PerTile
                } else {
                    GridPolicy::Resident
                };
                let checked = check(&gpu, kernel, qk, case, &mut buf, p);
                let (err, ok, median_us, min_us) = time_checked(
                    &gpu,
                    args,
                    &mut cleaner,
                    v.name,
                    grid,
                    case.shape.tensor,
                    checked,
                    &mut || launch(kernel, qk, case, &mut buf, p),
                );
                failures += usize::from(!ok);
                measured.push(Measured {
                    variant: v.name,
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
        let dirty = match case.candidates.first() {
            Some((_, v)) if measured.first().is_some_and(|m| m.ok) => {
                let kernel = kernels.get(v.name)?;
                time_dirty(&gpu, args, &mut flush, &mut || {
                    launch(kernel, qk, case, &mut buf, GridPolicy::PerTile)
                })
            }
            _ => None,
        };
        eprintln!(
            "[{}/{}] {}",
            ci + 1,
            cases.len(),
            summarize(case, &measured, copy, floor, dirty)
        );
        results.push((ci, measured, dirty));
        drop(buf);
        if let Some(path) = &args.json {
            write_json(path, args, &gpu, &driver, (copy, floor), &cases, &results)?;
        }
    }
    println!(
        "copy bandwidth: {copy:.0} GB/s (clean L2 flush before every timed launch; median of {} launches); harness floor {floor:.2} us",
        args.iters
    );
    print!("{}", table(&cases, &results, copy, floor));
    if failures > 0 {
        return Err(format!("{failures} candidate launches failed or disagreed with the CPU oracle (ERROR / WRONG lines; not ranked)").into());
    }
    Ok(())
}

fn best(m: &[Measured]) -> Option<&Measured> {
    m.iter()
        .filter(|r| r.ok)
        .min_by(|a, b| a.median_us.total_cmp(&b.median_us))
}

/// The default tuning, one block per tile: the wrapper's launch before this sweep.
fn baseline(m: &[Measured]) -> Option<&Measured> {
    let d = m.first()?.tuning;
    m.iter().find(|r| r.ok && r.grid == "tile" && r.tuning == d)
}

fn summarize(case: &MoeCase, m: &[Measured], copy: f64, floor: f64, dirty: Option<f64>) -> String {
    let bytes = case.bytes();
    let fmt = |r: Option<&Measured>| {
        r.map(|r| {
            format!(
                "{:.2} us {:.1}% (net of floor {}) ({} {})",
                r.median_us,
                100.0 * gbps(bytes, r.median_us) / copy,
                pct_net(bytes, r.median_us, floor, copy).map_or("-".into(), |p| format!("{p:.1}%")),
                label(&r.tuning),
                r.grid
            )
        })
        .unwrap_or_else(|| "-".into())
    };
    let s = &case.shape;
    format!(
        "{} {} {} {}x{}: best {} | default/tile {} | default/tile after a memset flush {}",
        s.model,
        s.tensor,
        s.ty.name(),
        s.k,
        s.n,
        fmt(best(m)),
        fmt(baseline(m)),
        dirty.map_or("-".into(), |us| format!("{us:.2} us"))
    )
}

fn table(
    cases: &[MoeCase],
    results: &[(usize, Vec<Measured>, Option<f64>)],
    copy: f64,
    floor: f64,
) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<48} {:<6} {:<16} {:<8} {:>6} {:>10} {:>7} {:>6} {:>9}",
        "case", "dtype", "tuning", "grid", "blocks", "median_us", "GB/s", "%copy", "rel_err"
    );
    for (ci, m, _) in results {
        let c = &cases[*ci];
        for r in m {
            let _ = writeln!(
                out,
                "{:<48} {:<6} {:<16} {:<8} {:>6} {:>10.2} {:>7.0} {:>5.1}% {:>9.1e}{}",
                c.shape.tensor,
                c.shape.ty.name(),
                label(&r.tuning),
                r.grid,
                r.blocks,
                r.median_us,
                gbps(c.bytes(), r.median_us),
                100.0 * gbps(c.bytes(), r.median_us) / copy,
                r.rel_err,
                if r.ok { "" } else { "  FAILED" }
            );
        }
    }
    let _ = writeln!(out, "\nsummary:");
    for (ci, m, dirty) in results {
        let _ = writeln!(out, "{}", summarize(&cases[*ci], m, copy, floor, *dirty));
    }
    out
}

/// The matvec sweep's document shape (SCHEMA.md, `Doc::Sweep`): `batch` 1, no generic twins.
fn write_json(
    path: &Path,
    args: &BenchArgs,
    gpu: &Gpu,
    driver: &str,
    (copy, floor): (f64, f64),
    cases: &[MoeCase],
    results: &[(usize, Vec<Measured>, Option<f64>)],
) -> Result<(), Box<dyn std::error::Error>> {
    let cases_json: Vec<Value> = results
        .iter()
        .map(|(ci, m, dirty)| {
            let c = &cases[*ci];
            let s = &c.shape;
            let bytes = c.bytes();
            let pick = |r: Option<&Measured>| r.map(|r| json!({ "variant": r.variant, "grid": r.grid, "median_us": r.median_us }));
            let rows: Vec<Value> = m
                .iter()
                .map(|r| {
                    let g = gbps(bytes, r.median_us);
                    json!({
                        "variant": r.variant, "kind": "specialized",
                        "tuning": { "batch": 1, "threads": r.tuning.threads, "lanes": r.tuning.lanes,
                                    "rows_per_group": r.tuning.rows_per_group, "stages": r.tuning.stages, "xq8": matvec::xq8_value(&r.tuning) },
                        "grid": r.grid, "blocks": r.blocks, "ok": r.ok,
                        "rel_err": if r.rel_err.is_finite() { json!(r.rel_err) } else { Value::Null },
                        "median_us": if r.ok { json!(r.median_us) } else { Value::Null },
                        "min_us": if r.ok { json!(r.min_us) } else { Value::Null },
                        "gbps": if r.ok { json!(g) } else { Value::Null },
                        "pct_copy": if r.ok { json!(100.0 * g / copy) } else { Value::Null },
                        "pct_copy_net": if r.ok { json!(pct_net(bytes, r.median_us, floor, copy)) } else { Value::Null },
                    })
                })
                .collect();
            json!({
                "model": s.model, "tensor": s.tensor, "k": s.k, "n": s.n, "dtype": s.ty.name(), "batch": 1,
                "mode": s.mode.token(), "n_expert": s.n_expert, "n_used": s.n_used, "bytes": bytes,
                "best_specialized": pick(best(m)), "best_generic": Value::Null,
                "baseline_default_per_tile": pick(baseline(m)), "dirty_flush_us": dirty,
                "candidates": rows,
            })
        })
        .collect();
    let doc = json!({
        "tool": "memra bench --sweep moe_matvec", "commit": commit(args), "date": utc_now(),
        "device": gpu.name(), "sm": gpu.arch().to_string(), "driver": driver,
        "copy_gbps": copy, "iters": args.iters, "warmup": args.warmup, "l2_flushed": true,
        "flush": "clean: a read pass over a never-written buffer of 2 x L2 before every timed launch", "floor_us": floor,
        "cases_planned": cases.len(), "cases_done": results.len(), "tolerance_rel_l2": TOLERANCE,
        "pattern_rows": PATTERN_ROWS, "cases": cases_json,
    });
    std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
        .map_err(|e| format!("write {}: {e}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moe_plan_candidates_fit_and_pair_rows() {
        let cases = plan();
        assert_eq!(cases.len(), SHAPES.len());
        for c in &cases {
            assert!(!c.candidates.is_empty(), "{}", c.shape.tensor);
            for (t, v) in &c.candidates {
                assert!(
                    !c.shape.mode.is_paired() || t.rows_per_group % 2 == 0,
                    "{}",
                    v.name
                );
                assert!(
                    v.source.contains(&format!("K = {}", c.shape.k)),
                    "{}",
                    v.name
                );
                let cfg = format!("XQ8 = {}", matvec::xq8_value(t));
                assert!(v.source.contains(&cfg), "{}", v.name);
                assert!(!(t.fuse_x && c.shape.mode == Mode::Down), "{}", v.name);
            }
            // The first candidate is the README default (the baseline).
            assert_eq!(c.candidates[0].0, MatvecTuning::default());
        }
        // Swiglu at 8 of 256 experts reads 8 experts' gate and up rows.
        let q4k = 6144 / 256 * 144;
        assert_eq!(
            cases[0].bytes(),
            (8 * 2 * 2048 * q4k + 4 * 6144 + 4 * 2048 * 8) as u64
        );
    }

    #[test]
    fn expected_swiglu_and_down_follow_the_tiled_pattern() {
        let s = MoeShape {
            n: 3,
            n_used: 2,
            n_expert: 4,
            ..SHAPES[1]
        };
        // Down: y[n] = Σ_j wt_j · gate[j][(e_j·N + n) % P], P = 5.
        let gate: Vec<f64> = (0..10).map(|i| i as f64).collect();
        let y = expected(&s, &[1, 3], &[0.5, 2.0], &gate, &[], 5);
        let want: Vec<f32> = (0..3)
            .map(|n| (0.5 * ((3 + n) % 5) as f64 + 2.0 * (5 + (9 + n) % 5) as f64) as f32)
            .collect();
        assert_eq!(y, want);
        let s = MoeShape {
            mode: Mode::Swiglu,
            ..s
        };
        let up: Vec<f64> = (0..5).map(|i| 1.0 + i as f64).collect();
        let y = expected(&s, &[1, 3], &[1.0, 1.0], &gate, &up, 5);
        let silu = |g: f64| g / (1.0 + (-g).exp());
        assert_eq!(
            y[4],
            (silu(gate[(3 * 3 + 1) % 5]) * up[(3 * 3 + 1) % 5]) as f32
        );
    }
}
