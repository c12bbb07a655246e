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

use cudarc::driver::CudaSlice;
use memra_gguf::{GgmlType, quant};
use memra_reference::{Rng, act, q8};
use rayon::prelude::*;
use serde_json::{Value, json};

use super::harness::{self, Case, Measured, Output, Rates, baseline, best, tuning_label};
use super::{BenchArgs, PATTERN_ROWS};
use crate::bench::{alloc, drv, tile, token};
use crate::cuda::{Error, Gpu, Kernel};
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
const TUNINGS: [(u32, u32, u32, u32); 11] = [
    (256, 32, 2, 3),
    (256, 32, 4, 3),
    (512, 32, 2, 3),
    (256, 32, 2, 4),
    (256, 32, 4, 4),
    (128, 32, 2, 4),
    (512, 32, 2, 4),
    (128, 32, 4, 4),
    (512, 32, 4, 3),
    (1024, 32, 2, 3),
    (256, 16, 2, 4),
];
/// Every tuning also runs with `xq8` (x quantized by a quantize_q8 launch, timed with it) and
/// with `xq8` + `fuse_x` (each block quantizes its slot's x, in Down its token's n_used h
/// rows: one launch).
const XQ8_TUNINGS: usize = TUNINGS.len();

fn candidates(s: &MoeShape) -> Vec<MatvecTuning> {
    let base = harness::tunings(1, &TUNINGS);
    let q8: Vec<MatvecTuning> = if matvec::int_dot(s.ty) {
        [false, true]
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
    // Shared memory holds one fused q8 x row per slot, n_used of them in Down (`fits` counts
    // `batch` such rows; with f32 or quantize_q8 x, BATCH is 1).
    let fused_rows = if s.mode == Mode::Down { s.n_used as u32 } else { 1 };
    base.into_iter()
        .chain(q8)
        .filter(|t| {
            let batch = if t.fuse_x { fused_rows } else { 1 };
            harness::fits(s.ty, &MatvecTuning { batch, ..*t }, s.k)
        })
        .collect()
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
            tuning_label(t)
        )
        .into_boxed_str(),
    );
    let mut params: Vec<(&'static str, Param)> = vec![
        ("k", Param::Int(s.k as i64)),
        ("n", Param::Int(s.n as i64)),
        ("qtype", Param::Sym(tok)),
        ("mode", Param::Sym(s.mode.token())),
    ];
    params.extend(harness::tuning_params(t));
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
            candidates: candidates(s)
                .iter()
                .map(|t| (*t, render(s, t)))
                .collect(),
        })
        .collect()
}

pub(super) struct Buffers {
    w: CudaSlice<u8>,
    w_up: Option<CudaSlice<u8>>,
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    x: CudaSlice<f32>,
    xq: CudaSlice<f32>,
    out: Output,
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
        out: Output {
            y: alloc::<f32>(st, y_rows * s.n)?,
            want,
            want_q8,
        },
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
    let xq8 = t.reads_q8_rows(); // x as quantize_q8 rows
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
    moe_matvec::moe_matvec_with(kernel, &inp, &mut buf.out.y.slice_mut(..), dims, grid)
}

impl Case for MoeCase {
    type Buffers = Buffers;
    // The wrapper's launch before this sweep.
    const DIRTY_GRID: GridPolicy = GridPolicy::PerTile;
    const SUMMARY_HEADING: &'static str = "summary:";
    const DIRTY_LABELS: (&'static str, &'static str) = (
        " | default/tile after a memset flush ",
        " | default/tile after a memset flush ",
    );

    fn list(cases: &[Self]) {
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
                    .map(|(t, _)| tuning_label(t))
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

    fn candidates(&self) -> Vec<(MatvecTuning, &'static KernelVariant, bool)> {
        self.candidates.iter().map(|&(t, v)| (t, v, true)).collect()
    }

    fn bytes(&self) -> u64 {
        MoeCase::bytes(self)
    }

    fn prepare(&self, gpu: &Gpu, rng: &mut Rng) -> Result<Buffers, Box<dyn std::error::Error>> {
        prepare(gpu, self, rng).map_err(|e| format!("{}: {e}", self.shape.tensor).into())
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
        let s = &self.shape;
        let t = moe_matvec::tuning(kernel).unwrap_or_default();
        harness::grid_geometry(kernel, s.ty, &t, s.k, grid).map_or(0, |(geo, max)| {
            let c = moe_matvec::launch_config_blocks(&geo, s.mode, s.n, 1, s.n_used, max);
            c.grid_dim.0 * c.grid_dim.1
        })
    }

    fn what(&self) -> String {
        self.shape.tensor.to_string()
    }

    fn table_head() -> String {
        format!("{:<48} {:<6}", "case", "dtype")
    }

    fn table_columns(&self, _specialized: bool) -> String {
        format!("{:<48} {:<6}", self.shape.tensor, self.shape.ty.name())
    }

    fn summary(&self, m: &[Measured], rates: &Rates) -> String {
        let bytes = MoeCase::bytes(self);
        let s = &self.shape;
        format!(
            "{} {} {} {}x{}: best {} | default/tile {}",
            s.model,
            s.tensor,
            s.ty.name(),
            s.k,
            s.n,
            rates.pick(bytes, best(m, true)),
            rates.pick(bytes, baseline(m))
        )
    }

    /// The matvec sweep's keys (`batch` 1) and the MoE launch's.
    fn json_case(&self) -> Vec<(&'static str, Value)> {
        let s = &self.shape;
        vec![
            ("model", json!(s.model)),
            ("tensor", json!(s.tensor)),
            ("k", json!(s.k)),
            ("n", json!(s.n)),
            ("dtype", json!(s.ty.name())),
            ("batch", json!(1)),
            ("mode", json!(s.mode.token())),
            ("n_expert", json!(s.n_expert)),
            ("n_used", json!(s.n_used)),
            ("bytes", json!(MoeCase::bytes(self))),
        ]
    }
}

/// `memra bench --sweep moe_matvec`.
pub fn run(args: &BenchArgs) -> Result<(), Box<dyn std::error::Error>> {
    harness::run(args, moe_matvec::FAMILY, &plan())
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
