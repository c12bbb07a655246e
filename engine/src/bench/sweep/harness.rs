//! What the matvec and moe_matvec sweeps share. Each candidate (variant × grid policy) is checked
//! once against the CPU oracle (NaN-poisoned output, relative L2 ≤ [`TOLERANCE`]), timed after a
//! clean L2 flush if it passed, ranked, printed as a table and written as one JSON document
//! (benches/results/SCHEMA.md, `Doc::Sweep`). A sweep supplies its cases through [`Case`]: the
//! candidates, buffers and oracle, the launch, the grid size, the bytes moved, and how a case is
//! named in the table and the JSON.

use std::fmt::Write as _;
use std::path::Path;

use cudarc::driver::CudaSlice;
use memra_gguf::GgmlType;
use memra_reference::{Rng, rel_err};
use serde_json::{Map, Value, json};

use super::{PATTERN_ROWS, TOLERANCE};
use crate::bench::{
    BenchArgs, L2Flush, alloc, commit, copy_bandwidth, driver_version, drv, l2_bytes, median,
    record, time_launches, utc_now,
};
use crate::cuda::{Error, Gpu, Kernel, Kernels};
use crate::kernels::matvec::{self, GridPolicy, MatvecGeometry, MatvecTuning};
use crate::kernels::quantize_q8;
use crate::kernels::registry::{KernelVariant, Param};

/// The output a candidate writes and what the oracle wants in it.
pub(super) struct Output {
    pub y: CudaSlice<f32>,
    /// With x in f32.
    pub want: Vec<f32>,
    /// With x quantized as quantize_q8 does (xq8 candidates); empty when the case has none.
    pub want_q8: Vec<f32>,
}

/// One case of a sweep: what the matvec and moe_matvec sweeps differ in.
pub(super) trait Case {
    type Buffers;
    /// The grid the default tuning is timed with after `memra bench`'s dirty flush.
    const DIRTY_GRID: GridPolicy;
    /// The heading of the table's summary lines.
    const SUMMARY_HEADING: &'static str;
    /// What precedes the dirty-flush median after a summary: in the progress line, in the table.
    const DIRTY_LABELS: (&'static str, &'static str);
    /// `--list`: the cases and their candidates, no GPU needed.
    fn list(cases: &[Self])
    where
        Self: Sized;
    /// (tuning, variant, specialized) in launch order; the first is the default tuning, specialized.
    fn candidates(&self) -> Vec<(MatvecTuning, &'static KernelVariant, bool)>;
    /// Fewest bytes one launch moves.
    fn bytes(&self) -> u64;
    /// Inputs on the device, the output and its oracle; errors name the case.
    fn prepare(
        &self,
        gpu: &Gpu,
        rng: &mut Rng,
    ) -> Result<Self::Buffers, Box<dyn std::error::Error>>;
    fn output(buf: &mut Self::Buffers) -> &mut Output;
    /// One launch of the candidate; an xq8 candidate quantizes x first (`qk`).
    fn launch(
        &self,
        kernel: &Kernel,
        qk: &Kernel,
        buf: &mut Self::Buffers,
        grid: GridPolicy,
    ) -> Result<(), Error>;
    /// Blocks a launch with `grid` runs (0 when the tuning has no geometry).
    fn blocks(&self, kernel: &Kernel, grid: GridPolicy) -> u32;
    /// The case in WRONG lines.
    fn what(&self) -> String;
    /// The table's columns before the tuning's: the header, then a row's.
    fn table_head() -> String;
    fn table_columns(&self, specialized: bool) -> String;
    /// One summary line: the ranked candidates (`rates` formats them).
    fn summary(&self, m: &[Measured], rates: &Rates) -> String;
    /// The `cases[]` keys that describe the case (`model` … `bytes`), in order.
    fn json_case(&self) -> Vec<(&'static str, Value)>;
}

/// One measured candidate.
#[derive(Clone, Debug)]
pub(super) struct Measured {
    pub variant: &'static str,
    pub specialized: bool,
    pub tuning: MatvecTuning,
    pub grid: &'static str,
    pub blocks: u32,
    pub rel_err: f64,
    pub ok: bool,
    pub median_us: f64,
    pub min_us: f64,
}

/// A case's index, its measured candidates and its default tuning's median after a memset flush.
pub(super) type CaseResult = (usize, Vec<Measured>, Option<f64>);

/// The run-wide figures a time is rated against.
pub(super) struct Rates {
    /// Copy bandwidth, GB/s.
    pub copy: f64,
    /// Harness floor, µs.
    pub floor: f64,
}

impl Rates {
    /// "median, % of copy (net of the floor) (tuning grid)" of a ranked candidate, or "-".
    pub fn pick(&self, bytes: u64, r: Option<&Measured>) -> String {
        r.map(|r| {
            format!(
                "{:.2} us {:.1}% (net of floor {}) ({} {})",
                r.median_us,
                100.0 * gbps(bytes, r.median_us) / self.copy,
                pct_net(bytes, r.median_us, self.floor, self.copy)
                    .map_or("-".into(), |p| format!("{p:.1}%")),
                tuning_label(&r.tuning),
                r.grid
            )
        })
        .unwrap_or_else(|| "-".into())
    }
}

pub(super) fn tuning_label(t: &MatvecTuning) -> String {
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

/// f32-path tunings of `batch` from (threads, lanes, rows per group, stages).
pub(super) fn tunings(batch: u32, shapes: &[(u32, u32, u32, u32)]) -> Vec<MatvecTuning> {
    shapes
        .iter()
        .map(|&(threads, lanes, rows_per_group, stages)| MatvecTuning {
            batch,
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

/// Whether tuning `t` has a geometry for `ty` whose shared memory (with the block's q8 x of K
/// for XQ8 = 2) one block may use on sm_90.
pub(super) fn fits(ty: GgmlType, t: &MatvecTuning, k: usize) -> bool {
    matvec::geometry(ty, t, None).is_some_and(|g| {
        g.smem_bytes + matvec::fused_x_bytes(ty, t, k).unwrap_or(u32::MAX)
            <= matvec::MAX_DYNAMIC_SMEM
    })
}

/// A candidate variant's tuning parameters (after its shape's): threads, lanes, rows_per_group,
/// stages, and xq8 when set.
pub(super) fn tuning_params(t: &MatvecTuning) -> Vec<(&'static str, Param)> {
    let mut params: Vec<(&'static str, Param)> = [
        ("threads", t.threads),
        ("lanes", t.lanes),
        ("rows_per_group", t.rows_per_group),
        ("stages", t.stages),
    ]
    .into_iter()
    .map(|(key, v)| (key, Param::Int(v as i64)))
    .collect();
    if t.xq8 {
        params.push(("xq8", Param::Int(matvec::xq8_value(t) as i64)));
    }
    params
}

/// "1.23 us" or "-".
fn us_or_dash(us: Option<f64>) -> String {
    us.map_or("-".into(), |us| format!("{us:.2} us"))
}

/// The quantize_q8 variant the xq8 candidates' launches start with (leaked, as the candidates').
pub(super) fn quantize_variant() -> &'static KernelVariant {
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

/// The geometry a wrapper launches tuning `t` with (XQ8 = 2 adds the block's q8 x of K, so
/// occupancy matches the launch) and the most blocks `grid` allows.
pub(super) fn grid_geometry(
    kernel: &Kernel,
    ty: GgmlType,
    t: &MatvecTuning,
    k: usize,
    grid: GridPolicy,
) -> Option<(MatvecGeometry, usize)> {
    let baked_k = matvec::baked_k(kernel);
    let mut geo = if kernel.variant().family == matvec::FAMILY {
        matvec::launch_geometry(ty, t, baked_k)?
    } else {
        matvec::geometry(ty, t, baked_k)?
    };
    geo.smem_bytes += matvec::fused_x_bytes(ty, t, k).unwrap_or(0);
    let max = match grid {
        GridPolicy::PerTile => usize::MAX,
        GridPolicy::Resident => matvec::resident_blocks(kernel, &geo).unwrap_or(usize::MAX),
        GridPolicy::AtMost(b) => b as usize,
    };
    Some((geo, max))
}

fn policy(grid: &str) -> GridPolicy {
    if grid == "tile" {
        GridPolicy::PerTile
    } else {
        GridPolicy::Resident
    }
}

/// Poisons y with NaN, launches once and compares with the oracle (the q8 one for xq8 variants).
fn check<C: Case>(
    gpu: &Gpu,
    kernel: &Kernel,
    qk: &Kernel,
    case: &C,
    buf: &mut C::Buffers,
    grid: GridPolicy,
) -> Result<f64, Error> {
    poison(gpu, &mut C::output(buf).y)?;
    case.launch(kernel, qk, buf, grid)?;
    let xq8 = matvec::tuning(kernel)?.xq8;
    let out = C::output(buf);
    let want = if xq8 { &out.want_q8 } else { &out.want };
    err_vs(gpu, &out.y, want)
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

/// Runs every case of `family`'s sweep on the GPU: check, time, print the table, write the JSON
/// (`--json`, rewritten after every case so a run cut short still leaves what it measured).
pub(super) fn run<C: Case>(
    args: &BenchArgs,
    family: &str,
    cases: &[C],
) -> Result<(), Box<dyn std::error::Error>> {
    if args.list {
        C::list(cases);
        return Ok(());
    }
    let gpu =
        Gpu::new(args.device).map_err(|e| format!("memra bench --sweep needs a CUDA GPU: {e}"))?;
    let driver = driver_version().unwrap_or_else(|| "unknown".into());
    let l2 = l2_bytes(&gpu);
    let mut all: Vec<&'static KernelVariant> = cases
        .iter()
        .flat_map(|c| c.candidates().into_iter().map(|(_, v, _)| v))
        .collect();
    all.push(quantize_variant());
    all.sort_by_key(|v| v.name);
    all.dedup_by_key(|v| v.name);
    eprintln!(
        "memra bench --sweep {family}: {} ({}), {driver}, L2 {} MiB; {} cases, compiling {} variants",
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
    let copy = copy_bandwidth(&gpu, 3, args.iters)?;
    eprintln!("copy bandwidth (1 GiB device-to-device, read + write): {copy:.0} GB/s");

    let mut flush = alloc::<u8>(gpu.stream(), 2 * l2)?;
    let mut cleaner = L2Flush::new(&gpu, l2)?;
    let floor = floor_us(&gpu, args, &mut cleaner)?;
    eprintln!(
        "harness floor (bf16 matvec 1x8, clean flush, events): {floor:.2} us; timed launches follow a clean flush (read pass over {} MiB)",
        cleaner.bytes() >> 20
    );
    let rates = Rates { copy, floor };
    let info = RunInfo {
        family,
        commit: commit(args),
        device: gpu.name().to_string(),
        sm: gpu.arch().to_string(),
        driver,
        iters: args.iters,
        warmup: args.warmup,
    };
    let mut rng = Rng::from_env_or_time(&format!("memra bench --sweep {family}"));
    eprintln!(
        "seed {} (replay with MEMRA_SEED={})",
        rng.seed(),
        rng.seed()
    );
    let mut results: Vec<CaseResult> = Vec::new();
    let mut failures = 0usize;
    for (ci, case) in cases.iter().enumerate() {
        let mut buf = case.prepare(&gpu, &mut rng)?;
        let candidates = case.candidates();
        let what = case.what();
        let mut measured = Vec::new();
        for &(tuning, v, specialized) in &candidates {
            let kernel = kernels.get(v.name)?;
            for grid in ["tile", "resident"] {
                let p = policy(grid);
                let checked = check(&gpu, kernel, qk, case, &mut buf, p);
                let (err, ok, median_us, min_us) = time_checked(
                    &gpu,
                    args,
                    &mut cleaner,
                    v.name,
                    grid,
                    &what,
                    checked,
                    &mut || case.launch(kernel, qk, &mut buf, p),
                );
                failures += usize::from(!ok);
                measured.push(Measured {
                    variant: v.name,
                    specialized,
                    tuning,
                    grid,
                    blocks: case.blocks(kernel, p),
                    rel_err: err,
                    ok,
                    median_us,
                    min_us,
                });
            }
        }
        // The default tuning once more after `memra bench`'s memset flush (dirty L2), to show
        // what that flush costs at this size.
        let dirty = match candidates.first() {
            Some((_, v, _)) if measured.first().is_some_and(|m| m.ok) => {
                let kernel = kernels.get(v.name)?;
                time_dirty(&gpu, args, &mut flush, &mut || {
                    case.launch(kernel, qk, &mut buf, C::DIRTY_GRID)
                })
            }
            _ => None,
        };
        eprintln!(
            "[{}/{}] {}",
            ci + 1,
            cases.len(),
            progress_line(case, &measured, &rates, dirty)
        );
        results.push((ci, measured, dirty));
        drop(buf);
        if let Some(path) = &args.json {
            write_json(path, &document(&info, &rates, cases, &results))?;
        }
    }
    drop(flush);

    println!(
        "copy bandwidth: {copy:.0} GB/s (clean L2 flush before every timed launch; median of {} launches); harness floor {floor:.2} us",
        args.iters
    );
    print!("{}", table(cases, &results, &rates));
    if let Some(path) = &args.json {
        write_json(path, &document(&info, &rates, cases, &results))?;
        eprintln!("wrote {}", path.display());
    }
    if failures > 0 {
        return Err(format!("{failures} candidate launches failed or disagreed with the CPU oracle (ERROR / WRONG lines; not ranked)").into());
    }
    Ok(())
}

pub(super) fn gbps(bytes: u64, us: f64) -> f64 {
    bytes as f64 / (us * 1e-6) / 1e9
}

/// % of copy over the time above the harness floor (the part a kernel can shorten); None when
/// the time is not above the floor.
fn pct_net(bytes: u64, us: f64, floor: f64, copy: f64) -> Option<f64> {
    (us > floor).then(|| 100.0 * gbps(bytes, us - floor) / copy)
}

/// The fastest correct candidate, specialized or generic.
pub(super) fn best(m: &[Measured], specialized: bool) -> Option<&Measured> {
    m.iter()
        .filter(|r| r.ok && r.specialized == specialized)
        .min_by(|a, b| a.median_us.total_cmp(&b.median_us))
}

/// The previous launch: default tuning (first candidate), specialized, one block per tile.
pub(super) fn baseline(m: &[Measured]) -> Option<&Measured> {
    let default = m.first()?.tuning;
    m.iter()
        .find(|r| r.ok && r.specialized && r.grid == "tile" && r.tuning == default)
}

/// "2.00x": how many times faster `a` is than `b`, or "-".
pub(super) fn ratio(a: Option<&Measured>, b: Option<&Measured>) -> String {
    match (a, b) {
        (Some(a), Some(b)) => format!("{:.2}x", b.median_us / a.median_us),
        _ => "-".into(),
    }
}

/// Every measured candidate, one line each, then the summary lines.
fn table<C: Case>(cases: &[C], results: &[CaseResult], rates: &Rates) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} {:<16} {:<8} {:>6} {:>10} {:>7} {:>6} {:>9}",
        C::table_head(),
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
                "{} {:<16} {:<8} {:>6} {:>10.2} {:>7.0} {:>5.1}% {:>9.1e}{}",
                c.table_columns(r.specialized),
                tuning_label(&r.tuning),
                r.grid,
                r.blocks,
                r.median_us,
                gbps(bytes, r.median_us),
                100.0 * gbps(bytes, r.median_us) / rates.copy,
                r.rel_err,
                if r.ok { "" } else { "  FAILED" }
            );
        }
    }
    let _ = writeln!(out, "\n{}", C::SUMMARY_HEADING);
    for (ci, m, dirty) in results {
        let c = &cases[*ci];
        let _ = writeln!(
            out,
            "{}{}{}",
            c.summary(m, rates),
            C::DIRTY_LABELS.1,
            us_or_dash(*dirty)
        );
    }
    out
}

/// The line printed as each case finishes (without its `[i/n] `).
fn progress_line<C: Case>(case: &C, m: &[Measured], rates: &Rates, dirty: Option<f64>) -> String {
    format!(
        "{}{}{}",
        case.summary(m, rates),
        C::DIRTY_LABELS.0,
        us_or_dash(dirty)
    )
}

/// What the JSON document says about the run besides the cases.
struct RunInfo<'a> {
    family: &'a str,
    commit: String,
    device: String,
    sm: String,
    driver: String,
    iters: u32,
    warmup: u32,
}

/// The sweep's JSON document (SCHEMA.md, `memra bench --sweep matvec --json`).
fn document<C: Case>(
    info: &RunInfo<'_>,
    rates: &Rates,
    cases: &[C],
    results: &[CaseResult],
) -> Value {
    let (copy, floor) = (rates.copy, rates.floor);
    let row = |bytes: u64, r: &Measured| -> Value {
        let g = gbps(bytes, r.median_us);
        json!({
            "variant": r.variant, "kind": if r.specialized { "specialized" } else { "generic" },
            "tuning": { "batch": r.tuning.batch, "threads": r.tuning.threads, "lanes": r.tuning.lanes,
                        "rows_per_group": r.tuning.rows_per_group, "stages": r.tuning.stages, "xq8": matvec::xq8_value(&r.tuning) },
            "grid": r.grid, "blocks": r.blocks, "ok": r.ok, "rel_err": if r.rel_err.is_finite() { json!(r.rel_err) } else { Value::Null },
            "median_us": if r.ok { json!(r.median_us) } else { Value::Null },
            "min_us": if r.ok { json!(r.min_us) } else { Value::Null },
            "gbps": if r.ok { json!(g) } else { Value::Null },
            "pct_copy": if r.ok { json!(100.0 * g / copy) } else { Value::Null },
            "pct_copy_net": if r.ok { json!(pct_net(bytes, r.median_us, floor, copy)) } else { Value::Null },
        })
    };
    let pick = |r: Option<&Measured>| {
        r.map(|r| json!({ "variant": r.variant, "grid": r.grid, "median_us": r.median_us }))
    };
    let cases_json: Vec<Value> = results
        .iter()
        .map(|(ci, m, dirty)| {
            let c = &cases[*ci];
            let bytes = c.bytes();
            let mut o: Map<String, Value> = c
                .json_case()
                .into_iter()
                .map(|(key, v)| (key.to_string(), v))
                .collect();
            o.insert("best_specialized".into(), json!(pick(best(m, true))));
            o.insert("best_generic".into(), json!(pick(best(m, false))));
            o.insert("baseline_default_per_tile".into(), json!(pick(baseline(m))));
            o.insert("dirty_flush_us".into(), json!(dirty));
            o.insert(
                "candidates".into(),
                m.iter().map(|r| row(bytes, r)).collect::<Vec<_>>().into(),
            );
            Value::Object(o)
        })
        .collect();
    json!({
        "tool": format!("memra bench --sweep {}", info.family), "commit": info.commit, "date": utc_now(),
        "device": info.device, "sm": info.sm, "driver": info.driver,
        "copy_gbps": copy, "iters": info.iters, "warmup": info.warmup, "l2_flushed": true,
        "flush": "clean: a read pass over a never-written buffer of 2 x L2 before every timed launch", "floor_us": floor,
        "cases_planned": cases.len(), "cases_done": results.len(), "tolerance_rel_l2": TOLERANCE, "pattern_rows": PATTERN_ROWS, "cases": cases_json,
    })
}

fn write_json(path: &Path, doc: &Value) -> Result<(), Box<dyn std::error::Error>> {
    std::fs::write(path, serde_json::to_string_pretty(doc)? + "\n")
        .map_err(|e| format!("write {}: {e}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::bench::report::{self, Doc};
    use crate::bench::sweep::{self, moe};

    /// Fake measurements of every candidate of the first `n` cases: each ok but the last
    /// (a failed check: infinite error, no times).
    fn fake<C: Case>(cases: &[C], n: usize) -> Vec<CaseResult> {
        cases
            .iter()
            .take(n)
            .enumerate()
            .map(|(ci, c)| {
                let cands = c.candidates();
                let m: Vec<Measured> = cands
                    .iter()
                    .enumerate()
                    .flat_map(|(i, &(tuning, v, specialized))| {
                        ["tile", "resident"].map(|grid| {
                            let ok = i + 1 < cands.len();
                            Measured {
                                variant: v.name,
                                specialized,
                                tuning,
                                grid,
                                blocks: 132,
                                rel_err: if ok { 1e-7 } else { f64::INFINITY },
                                ok,
                                median_us: if ok { 10.0 + i as f64 } else { f64::NAN },
                                min_us: if ok { 9.0 + i as f64 } else { f64::NAN },
                            }
                        })
                    })
                    .collect();
                (ci, m, Some(12.5))
            })
            .collect()
    }

    fn doc_of<C: Case>(family: &str, cases: &[C]) -> Value {
        let info = RunInfo {
            family,
            commit: "0000000".into(),
            device: "NVIDIA H200".into(),
            sm: "sm_90".into(),
            driver: "CUDA 13.0".into(),
            iters: 20,
            warmup: 3,
        };
        let rates = Rates {
            copy: 3900.0,
            floor: 4.0,
        };
        document(&info, &rates, cases, &fake(cases, 2))
    }

    fn keys(v: &Value) -> BTreeSet<String> {
        v.as_object().expect("an object").keys().cloned().collect()
    }

    /// The keys of the top level, a case, a candidate and its tuning.
    fn key_sets(v: &Value) -> [BTreeSet<String>; 4] {
        let case = &v["cases"][0];
        let cand = &case["candidates"][0];
        [keys(v), keys(case), keys(cand), keys(&cand["tuning"])]
    }

    fn committed(name: &str) -> Value {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../benches/results")
            .join(name);
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// Both sweeps' documents, written by the one generic writer, pass the schema checker and
    /// have exactly the keys of the committed H200 files of each sweep.
    #[test]
    fn sweep_documents_match_the_schema_and_the_committed_files() {
        let matvec_cases = sweep::plan();
        let moe_cases = moe::plan();
        for (family, doc, file) in [
            (
                "matvec",
                doc_of("matvec", &matvec_cases),
                "h200-2026-11-30-s4-matvec-sweep-1b27330.json",
            ),
            (
                "moe_matvec",
                doc_of("moe_matvec", &moe_cases),
                "h200-2026-11-30-s4-moe-sweep-1b27330.json",
            ),
        ] {
            assert_eq!(report::doc_kind(&doc), Doc::Sweep, "{family}");
            if let Err(errs) = report::validate(&doc, Doc::Sweep) {
                panic!("{family}: {}", errs.join("\n"));
            }
            assert_eq!(
                key_sets(&doc),
                key_sets(&committed(file)),
                "{family} vs {file}"
            );
            assert_eq!(doc["tool"], format!("memra bench --sweep {family}"));
            assert_eq!(doc["cases_done"], 2);
            let case = &doc["cases"][0];
            assert_eq!(case["dirty_flush_us"], 12.5);
            // The failed last candidate is not ranked and has no times.
            let cands = case["candidates"].as_array().unwrap();
            let last = cands.last().unwrap();
            assert_eq!(last["ok"], false);
            assert!(last["median_us"].is_null() && last["rel_err"].is_null());
            assert_eq!(case["best_specialized"]["median_us"], 10.0);
            assert_eq!(case["baseline_default_per_tile"]["grid"], "tile");
        }
        // The moe sweep has no generic twins.
        let doc = doc_of("moe_matvec", &moe_cases);
        assert!(doc["cases"][0]["best_generic"].is_null());
        assert_eq!(doc["cases"][0]["mode"], "swiglu");
    }

    /// The table's header and rows keep each sweep's columns as they were printed before the
    /// harness was shared (the format strings below are the old ones), one row per candidate.
    #[test]
    fn tables_keep_each_sweeps_columns() {
        let rates = Rates {
            copy: 3900.0,
            floor: 4.0,
        };
        // The table of the first case's fake measurements: its lines and those measurements.
        fn first_case_table<C: Case>(cases: &[C], rates: &Rates) -> (Vec<String>, Vec<Measured>) {
            let mut results = fake(cases, 1);
            let text = table(cases, &results, rates);
            (
                text.lines().map(str::to_string).collect(),
                results.remove(0).1,
            )
        }
        let cases = sweep::plan();
        let (lines, m) = first_case_table(&cases, &rates);
        assert_eq!(
            lines[0],
            format!(
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
            )
        );
        let (c, r) = (&cases[0], &m[1]);
        let g = gbps(c.bytes(), r.median_us);
        assert_eq!(
            lines[2],
            format!(
                "{:<12} {:<13} {:<6} {:>5} {:<5} {:<16} {:<8} {:>6} {:>10.2} {:>7.0} {:>5.1}% {:>9.1e}{}",
                c.shape.model,
                format!("{}x{}", c.shape.k, c.shape.n),
                c.ty.name(),
                c.batch,
                "spec",
                tuning_label(&r.tuning),
                r.grid,
                r.blocks,
                r.median_us,
                g,
                100.0 * g / rates.copy,
                r.rel_err,
                ""
            )
        );
        assert_eq!(lines.len(), 1 + m.len() + 2 + 1);
        assert!(lines[m.len()].ends_with("  FAILED"));
        assert_eq!(lines[m.len() + 2], C_HEADING_MATVEC);
        assert!(
            lines[m.len() + 3].ends_with("| default after a memset flush 12.50 us"),
            "{}",
            lines[m.len() + 3]
        );

        let cases = moe::plan();
        let (lines, m) = first_case_table(&cases, &rates);
        assert_eq!(
            lines[0],
            format!(
                "{:<48} {:<6} {:<16} {:<8} {:>6} {:>10} {:>7} {:>6} {:>9}",
                "case",
                "dtype",
                "tuning",
                "grid",
                "blocks",
                "median_us",
                "GB/s",
                "%copy",
                "rel_err"
            )
        );
        // The columns after the case's are the matvec table's (checked above).
        let r = &m[0];
        let prefix = format!(
            "{:<48} {:<6} {:<16} {:<8} ",
            cases[0].shape.tensor,
            cases[0].shape.ty.name(),
            tuning_label(&r.tuning),
            r.grid
        );
        assert!(lines[1].starts_with(&prefix), "{}", lines[1]);
        assert!(lines[m.len()].ends_with("  FAILED"));
        assert_eq!(lines[lines.len() - 2], "summary:");
        let last = &lines[lines.len() - 1];
        assert!(
            last.starts_with(
                "glm-5 routed gate+up+SwiGLU, 8 of 256 experts Q4_K 6144x2048: best 10.00 us"
            ) && last.ends_with(" | default/tile after a memset flush 12.50 us"),
            "{last}"
        );
    }

    const C_HEADING_MATVEC: &str = "summary (best correct candidate per case; default/tile = default tuning, one block per tile = the previous launch):";

    /// The progress lines of the committed H200 matvec sweep (its .txt, stderr of the run)
    /// come out again, character for character, from the measurements in its JSON: ranking,
    /// rates and wording as before the harness was shared.
    #[test]
    fn progress_lines_reproduce_the_committed_matvec_run() {
        let doc = committed("h200-2026-11-30-s4-matvec-sweep-1b27330.json");
        let log_path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../benches/results/h200-2026-11-30-s4-matvec-sweep-1b27330.txt");
        let log = std::fs::read_to_string(&log_path)
            .unwrap_or_else(|e| panic!("{}: {e}", log_path.display()));
        let rates = Rates {
            copy: doc["copy_gbps"].as_f64().unwrap(),
            floor: doc["floor_us"].as_f64().unwrap(),
        };
        let plan = sweep::plan();
        let planned = doc["cases_planned"].as_u64().unwrap();
        let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
        let mut checked = 0;
        for (ci, c) in doc["cases"].as_array().unwrap().iter().enumerate() {
            let case = plan
                .iter()
                .find(|p| {
                    p.shape.model == c["model"]
                        && p.shape.tensor == c["tensor"]
                        && p.ty.name() == c["dtype"]
                        && p.batch as u64 == c["batch"]
                })
                .unwrap_or_else(|| panic!("case {ci} not in the plan"));
            assert_eq!(case.bytes(), c["bytes"], "case {ci} bytes");
            let m: Vec<Measured> = c["candidates"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| {
                    let t = &r["tuning"];
                    let u = |k: &str| t[k].as_u64().unwrap() as u32;
                    let xq8 = u("xq8");
                    Measured {
                        variant: Box::leak(
                            r["variant"].as_str().unwrap().to_string().into_boxed_str(),
                        ),
                        specialized: r["kind"] == "specialized",
                        tuning: MatvecTuning {
                            batch: u("batch"),
                            threads: u("threads"),
                            lanes: u("lanes"),
                            rows_per_group: u("rows_per_group"),
                            stages: u("stages"),
                            accumulate: false,
                            xq8: xq8 > 0,
                            fuse_x: xq8 == 2,
                        },
                        grid: if r["grid"] == "tile" {
                            "tile"
                        } else {
                            "resident"
                        },
                        blocks: r["blocks"].as_u64().unwrap() as u32,
                        rel_err: f(&r["rel_err"]),
                        ok: r["ok"] == true,
                        median_us: f(&r["median_us"]),
                        min_us: f(&r["min_us"]),
                    }
                })
                .collect();
            let line = format!(
                "[{}/{planned}] {}",
                ci + 1,
                progress_line(case, &m, &rates, c["dirty_flush_us"].as_f64())
            );
            assert!(
                log.lines().any(|l| l == line),
                "not in {}:\n{line}",
                log_path.display()
            );
            checked += 1;
        }
        assert_eq!(checked, doc["cases_done"].as_u64().unwrap() as usize);
    }
}
