//! `memra bench`: specialized vs generic vs the memory roofline, on the GPU.
//!
//! First the copy bandwidth of this device, measured now (a 1 GiB device-to-device copy, bytes
//! read + written). Then, for every specialized variant of each built architecture (or one
//! `--arch`), its family at that variant's baked shape, run with the specialized variant and with
//! its generic twin on the same buffers. Each timing: `--warmup` launches, then `--iters` (≥ 20)
//! launches each between two CUDA events, median reported. Before every timed launch a memset of
//! twice the L2 size runs (outside the events): it evicts L2 and keeps the GPU busy while the
//! host enqueues the launch, so host launch latency stays out of the events. Inputs also rotate
//! among several buffer sets when one set is smaller than twice L2 (criterion batches rely on it).
//!
//! Bytes moved per launch (the fewest: each input read once, each output written once):
//! - matvec (batch 1): weight bytes (GGUF row bytes × N) + x (4K) + y (4N); FLOPs 2·K·N.
//! - matmul: weight bytes + X (4·T·K) + Y (4·T·N); FLOPs 2·T·K·N (T = 4096).
//! - rmsnorm: x + out (2 · 4·rows·n) + w (4n).
//! - add_rmsnorm: residual read and written, delta read, out written (4 · 4·rows·n) + w (4n)
//!   (+ delta_w when the variant normalizes delta).
//! - swiglu / geglu: gate + up + out (3 · 4·rows·n_ff).
//! - argmax / topk: logits (4·rows·n_vocab); the outputs are negligible and not counted.
//! - embed: gathered table rows (T · row bytes) + out (4·T·n_embd) + tokens (4T).
//!
//! Shapes come from the registry: a specialized variant's baked params (k/n/qtype for matvec and
//! matmul, n for the norms, n_ff, n_vocab, n_embd). matvec also runs each specialized shape in
//! Q8_0, Q4_K and BF16: where the registry has no specialized variant of that type, one is
//! rendered here with `matvec::render_source` (same tuning; `origin: "rendered"` in the JSON).
//! Not measured: qk_norm_rope (no bench wiring yet), batch > 1 matvec, matmul in types other than
//! the baked one.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use memra_gguf::{GgmlType, quant};
use memra_reference::Rng;
use serde_json::{Value, json};

use crate::cuda::{Error, Gpu, Kernel, Kernels};
use crate::kernels::registry::{self, KernelVariant, Param};
use crate::kernels::swiglu::GluLayout;
use crate::kernels::{add_rmsnorm, argmax, embed, geglu, matmul, matvec, rmsnorm, swiglu, topk};

pub mod report;
pub mod sweep;

/// Tokens of the prefill matmul and of the "prefill" row counts of the row-wise families.
pub const PREFILL_T: usize = 4096;
/// The copy used for the bandwidth ceiling.
pub const COPY_BYTES: usize = 1 << 30;
/// Fallback when the driver does not report the L2 size (H200: 60 MiB).
const DEFAULT_L2: usize = 60 << 20;
/// Most buffer sets one case rotates among.
const MAX_SETS: usize = 64;
/// The extra weight types every specialized matvec shape also runs in.
const MATVEC_EXTRA_TYPES: [GgmlType; 3] = [GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::BF16];

#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Only variants specialized for this architecture (e.g. glm-dsa); default: every built one.
    #[arg(long, value_name = "ARCH")]
    pub arch: Option<String>,
    /// Only this kernel family (e.g. matvec).
    #[arg(long, value_name = "FAMILY")]
    pub family: Option<String>,
    /// Also write the results as JSON (schema: benches/results/SCHEMA.md).
    #[arg(long, value_name = "OUT")]
    pub json: Option<PathBuf>,
    /// Timed launches per variant (median reported); at least 20.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u32).range(20..))]
    pub iters: u32,
    /// Untimed launches before the timed ones.
    #[arg(long, default_value_t = 5)]
    pub warmup: u32,
    /// The commit to record (default: $MEMRA_COMMIT at run or build time, else `git rev-parse HEAD`).
    #[arg(long)]
    pub commit: Option<String>,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Print the planned cases and exit (no GPU needed).
    #[arg(long)]
    pub list: bool,
    /// Instead of the built variants: sweep candidate tunings of this family (`matvec`), each
    /// checked against the CPU oracle, then timed (bench/sweep.rs).
    #[arg(long, value_name = "FAMILY")]
    pub sweep: Option<String>,
    /// Measure this whole model end to end (prefill and decode tokens/s, specialized and
    /// generic kernels) instead of the kernel families.
    #[arg(long, value_name = "FILE")]
    pub model: Option<PathBuf>,
    /// Prompt tokens of the `--model` prefill.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Greedy decode steps of the `--model` run.
    #[arg(long, default_value_t = 128)]
    pub decode_tokens: usize,
    /// Measure nothing: report on this earlier `--json` output (no GPU needed; bench/report.rs).
    #[arg(long, value_name = "RUN_JSON")]
    pub report: Option<PathBuf>,
    /// Merge these peer figures (scripts/peers.py output) into the report.
    #[arg(long, value_name = "PEERS_JSON")]
    pub peers: Option<PathBuf>,
    /// Also write the chart (specialized, generic, peer, roofline per shape) as SVG.
    #[arg(long, value_name = "OUT")]
    pub svg: Option<PathBuf>,
}

// ---------------------------------------------------------------------------------------------
// Plan: which shapes, which variants.

/// One launch shape of one family.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Shape {
    Matvec { ty: GgmlType, k: usize, n: usize },
    Matmul { ty: GgmlType, t: usize, k: usize, n: usize },
    Rmsnorm { rows: usize, n: usize },
    AddRmsnorm { rows: usize, n: usize, delta_norm: bool },
    Glu { family: &'static str, rows: usize, n_ff: usize },
    Argmax { rows: usize, n_vocab: usize },
    Topk { rows: usize, n_vocab: usize, k: usize },
    Embed { ty: GgmlType, t: usize, n_embd: usize, n_vocab: usize },
}

fn weight_bytes(ty: GgmlType, k: usize, n: usize) -> u64 {
    ty.row_bytes(k as u64).unwrap_or(0) * n as u64
}

impl Shape {
    pub fn family(&self) -> &'static str {
        match self {
            Shape::Matvec { .. } => matvec::FAMILY,
            Shape::Matmul { .. } => matmul::FAMILY,
            Shape::Rmsnorm { .. } => rmsnorm::FAMILY,
            Shape::AddRmsnorm { .. } => add_rmsnorm::FAMILY,
            Shape::Glu { family, .. } => family,
            Shape::Argmax { .. } => argmax::FAMILY,
            Shape::Topk { .. } => topk::FAMILY,
            Shape::Embed { .. } => embed::FAMILY,
        }
    }

    /// `k6144_n2048`, `4096x6144`, `t4096_k6144_n2048`, …
    pub fn label(&self) -> String {
        match *self {
            Shape::Matvec { k, n, .. } => format!("k{k}_n{n}"),
            Shape::Matmul { t, k, n, .. } => format!("t{t}_k{k}_n{n}"),
            Shape::Rmsnorm { rows, n } | Shape::AddRmsnorm { rows, n, .. } => format!("{rows}x{n}"),
            Shape::Glu { rows, n_ff, .. } => format!("{rows}x{n_ff}"),
            Shape::Argmax { rows, n_vocab } => format!("{rows}x{n_vocab}"),
            Shape::Topk { rows, n_vocab, k } => format!("{rows}x{n_vocab}_k{k}"),
            Shape::Embed { t, n_embd, n_vocab, .. } => format!("t{t}_e{n_embd}_v{n_vocab}"),
        }
    }

    /// The weight type for matvec/matmul/embed, `f32` for the activation-only families.
    pub fn dtype(&self) -> String {
        match self {
            Shape::Matvec { ty, .. } | Shape::Matmul { ty, .. } | Shape::Embed { ty, .. } => ty.name().to_ascii_lowercase(),
            _ => "f32".into(),
        }
    }

    /// Fewest bytes one launch must move (module doc).
    pub fn bytes(&self) -> u64 {
        let f = 4u64;
        match *self {
            Shape::Matvec { ty, k, n } => weight_bytes(ty, k, n) + f * (k + n) as u64,
            Shape::Matmul { ty, t, k, n } => weight_bytes(ty, k, n) + f * (t * k + t * n) as u64,
            Shape::Rmsnorm { rows, n } => f * (2 * rows * n + n) as u64,
            Shape::AddRmsnorm { rows, n, delta_norm } => f * (4 * rows * n + n * (1 + delta_norm as usize)) as u64,
            Shape::Glu { rows, n_ff, .. } => f * (3 * rows * n_ff) as u64,
            Shape::Argmax { rows, n_vocab } | Shape::Topk { rows, n_vocab, .. } => f * (rows * n_vocab) as u64,
            Shape::Embed { ty, t, n_embd, .. } => weight_bytes(ty, n_embd, t) + f * (t * n_embd + t) as u64,
        }
    }

    /// Floating-point operations of one launch where they matter (the matrix families).
    pub fn flops(&self) -> Option<u64> {
        match *self {
            Shape::Matvec { k, n, .. } => Some(2 * (k * n) as u64),
            Shape::Matmul { t, k, n, .. } => Some(2 * (t * k) as u64 * n as u64),
            _ => None,
        }
    }
}

/// One shape with the variants to compare on it.
#[derive(Clone, Debug)]
pub struct Case {
    pub shape: Shape,
    /// The architecture whose preset gave the shape.
    pub arch: &'static str,
    pub specialized: Option<&'static KernelVariant>,
    pub generic: Option<&'static KernelVariant>,
    /// The specialized variant was rendered by the bench (no registry variant of this dtype).
    pub rendered: bool,
}

impl Case {
    pub fn variants(&self) -> impl Iterator<Item = (&'static KernelVariant, Kind)> + '_ {
        self.specialized.map(|v| (v, Kind::Specialized)).into_iter().chain(self.generic.map(|v| (v, Kind::Generic)))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Specialized,
    Generic,
}

impl Kind {
    pub fn label(self) -> &'static str {
        match self {
            Kind::Specialized => "specialized",
            Kind::Generic => "generic",
        }
    }
}

fn int(v: &KernelVariant, key: &str) -> Option<usize> {
    match v.param(key) {
        Some(Param::Int(i)) if i >= 0 => Some(i as usize),
        _ => None,
    }
}

fn sym_type(v: &KernelVariant) -> Option<GgmlType> {
    match v.param("qtype") {
        Some(Param::Sym(s)) => GgmlType::from_name(s),
        _ => None,
    }
}

fn token(ty: GgmlType) -> &'static str {
    // The registry's dtype tokens are ggml names in lower case (KERNEL-CONTRACT §2).
    Box::leak(ty.name().to_ascii_lowercase().into_boxed_str())
}

/// The generic variant of `v`'s family with the same non-dim choices (qtype, delta_norm, batch,
/// accumulate, …); among several, the one sharing most tuning knobs. `qtype` overrides v's type.
pub fn generic_twin(v: &KernelVariant, qtype: Option<&str>) -> Option<&'static KernelVariant> {
    let wanted = |key: &str| -> Option<Param> {
        match (key, qtype) {
            ("qtype", Some(q)) => Some(Param::Sym(Box::leak(q.to_string().into_boxed_str()))),
            _ => v.param(key),
        }
    };
    // Keys that change what is computed must match; the rest are tuning and only rank candidates.
    const SEMANTIC: [&str; 6] = ["qtype", "delta_norm", "batch", "accumulate", "rope_mode", "cache_t"];
    registry::variants()
        .iter()
        .filter(|g| g.is_generic() && g.family == v.family)
        .filter(|g| SEMANTIC.iter().all(|k| g.param(k).is_none() || g.param(k) == wanted(k)))
        .max_by_key(|g| g.params.iter().filter(|(k, val)| wanted(k) == Some(*val)).count())
}

/// A specialized matvec variant of `base`'s shape and tuning in weight type `ty`: the registry's
/// if it has one, else one rendered here (leaked: it lives as long as the process, like the registry).
fn matvec_in_type(base: &'static KernelVariant, ty: GgmlType, k: usize, n: usize) -> (&'static KernelVariant, bool) {
    if sym_type(base) == Some(ty) {
        return (base, false);
    }
    let tok = token(ty);
    if let Some(found) = registry::variants().iter().find(|v| {
        v.family == matvec::FAMILY && !v.is_generic() && int(v, "k") == Some(k) && int(v, "n") == Some(n) && v.param("qtype") == Some(Param::Sym(tok))
            && v.params.iter().filter(|(key, _)| *key != "qtype").all(|(key, val)| base.param(key) == Some(*val))
    }) {
        return (found, false);
    }
    let d = matvec::MatvecTuning::default();
    let get = |key: &str, default: u32| int(base, key).map(|v| v as u32).unwrap_or(default);
    let tune = matvec::MatvecTuning {
        batch: get("batch", d.batch),
        threads: get("threads", d.threads),
        lanes: get("lanes", d.lanes),
        rows_per_group: get("rows_per_group", d.rows_per_group),
        stages: get("stages", d.stages),
        accumulate: get("accumulate", 0) == 1,
    };
    let name: &'static str = Box::leak(format!("matvec__k{k}_n{n}__{tok}").into_boxed_str());
    let params: Vec<(&'static str, Param)> =
        base.params.iter().map(|&(key, val)| if key == "qtype" { (key, Param::Sym(tok)) } else { (key, val) }).collect();
    let source: &'static str = Box::leak(matvec::render_source(name, ty, k, n, &tune).into_boxed_str());
    let v = Box::leak(Box::new(KernelVariant { name, family: matvec::FAMILY, arch: base.arch, params: Box::leak(params.into_boxed_slice()), source }));
    (v, true)
}

/// The n_vocab of an architecture's preset as far as the registry shows it (its argmax variant).
fn arch_vocab(arch: &str) -> usize {
    registry::variants()
        .iter()
        .find(|v| v.arch == Some(arch) && v.family == argmax::FAMILY)
        .and_then(|v| int(v, "n_vocab"))
        .unwrap_or(32000)
}

/// The cases for the built architectures (or `arch`), optionally one family.
pub fn plan(arch: Option<&str>, family: Option<&str>) -> Vec<Case> {
    let mut cases: Vec<Case> = Vec::new();
    let push = |cases: &mut Vec<Case>, shape: Shape, arch: &'static str, spec: &'static KernelVariant, generic_q: Option<&str>, rendered: bool| {
        if family.is_some_and(|f| f != shape.family()) {
            return;
        }
        if cases.iter().any(|c| c.shape == shape && c.specialized.map(|s| s.name) == Some(spec.name)) {
            return;
        }
        cases.push(Case { shape, arch, specialized: Some(spec), generic: generic_twin(spec, generic_q), rendered });
    };
    for v in registry::variants().iter().filter(|v| !v.is_generic()) {
        let Some(a) = v.arch else { continue };
        if arch.is_some_and(|want| want != a) {
            continue;
        }
        match v.family {
            "matvec" => {
                let (Some(k), Some(n), Some(baked)) = (int(v, "k"), int(v, "n"), sym_type(v)) else { continue };
                if int(v, "batch").unwrap_or(1) != 1 {
                    continue;
                }
                let mut types = vec![baked];
                types.extend(MATVEC_EXTRA_TYPES.iter().copied().filter(|t| *t != baked));
                for ty in types {
                    if matvec::k_multiple(ty).is_none_or(|m| !k.is_multiple_of(m)) {
                        continue;
                    }
                    let (spec, rendered) = matvec_in_type(v, ty, k, n);
                    push(&mut cases, Shape::Matvec { ty, k, n }, a, spec, Some(token(ty)), rendered);
                }
            }
            "matmul" => {
                let (Some(k), Some(n), Some(ty)) = (int(v, "k"), int(v, "n"), sym_type(v)) else { continue };
                push(&mut cases, Shape::Matmul { ty, t: PREFILL_T, k, n }, a, v, None, false);
            }
            "rmsnorm" => {
                let Some(n) = int(v, "n") else { continue };
                for rows in [PREFILL_T, 1] {
                    push(&mut cases, Shape::Rmsnorm { rows, n }, a, v, None, false);
                }
            }
            "add_rmsnorm" => {
                let Some(n) = int(v, "n") else { continue };
                let delta_norm = int(v, "delta_norm").unwrap_or(0) == 1;
                for rows in [PREFILL_T, 1] {
                    push(&mut cases, Shape::AddRmsnorm { rows, n, delta_norm }, a, v, None, false);
                }
            }
            "swiglu" | "geglu" => {
                let Some(n_ff) = int(v, "n_ff") else { continue };
                let fam: &'static str = if v.family == "swiglu" { swiglu::FAMILY } else { geglu::FAMILY };
                for rows in [PREFILL_T, 1] {
                    push(&mut cases, Shape::Glu { family: fam, rows, n_ff }, a, v, None, false);
                }
            }
            "argmax" => {
                let Some(n_vocab) = int(v, "n_vocab") else { continue };
                push(&mut cases, Shape::Argmax { rows: 1, n_vocab }, a, v, None, false);
            }
            "topk" => {
                let (Some(n_vocab), Some(k)) = (int(v, "n_vocab"), int(v, "k")) else { continue };
                for rows in [1, PREFILL_T] {
                    push(&mut cases, Shape::Topk { rows, n_vocab, k }, a, v, None, false);
                }
            }
            "embed" => {
                let (Some(n_embd), Some(ty)) = (int(v, "n_embd"), sym_type(v)) else { continue };
                for t in [1, PREFILL_T] {
                    push(&mut cases, Shape::Embed { ty, t, n_embd, n_vocab: arch_vocab(a) }, a, v, None, false);
                }
            }
            // Not wired yet (module doc): qk_norm_rope and families added later.
            _ => {}
        }
    }
    cases
}

// ---------------------------------------------------------------------------------------------
// Buffers and timing.

fn drv(call: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Driver { call: call.to_string(), detail: format!("{e:?}") }
}

/// Fills `dst` by repeating `pattern` (whole copies, then a prefix).
fn tile<T: DeviceRepr>(s: &Arc<CudaStream>, dst: &mut CudaSlice<T>, pattern: &CudaSlice<T>) -> Result<(), Error> {
    let (len, p) = (dst.len(), pattern.len());
    let mut at = 0;
    while at < len {
        let m = p.min(len - at);
        s.memcpy_dtod(&pattern.slice(..m), &mut dst.slice_mut(at..at + m)).map_err(drv("cuMemcpyDtoDAsync (fill)"))?;
        at += m;
    }
    Ok(())
}

fn alloc<T: DeviceRepr + ValidAsZeroBits>(s: &Arc<CudaStream>, n: usize) -> Result<CudaSlice<T>, Error> {
    s.alloc_zeros::<T>(n.max(1)).map_err(|e| Error::Driver { call: format!("cuMemAlloc({} bytes)", n * size_of::<T>()), detail: format!("{e:?}") })
}

/// Random data sources: one small random pattern per element kind, tiled into every buffer
/// (random values, never zeros; repeating a few MiB does not change a kernel's speed).
struct Filler {
    stream: Arc<CudaStream>,
    rng: Rng,
    floats: CudaSlice<f32>,
}

impl Filler {
    fn new(stream: &Arc<CudaStream>, rng: Rng) -> Result<Filler, Error> {
        let mut rng = rng;
        let host = rng.normal_vec(1 << 20, 1.0);
        let floats = stream.clone_htod(&host).map_err(drv("cuMemcpyHtoD (pattern)"))?;
        Ok(Filler { stream: stream.clone(), rng, floats })
    }

    fn f32s(&self, n: usize) -> Result<CudaSlice<f32>, Error> {
        let mut b = alloc::<f32>(&self.stream, n)?;
        tile(&self.stream, &mut b, &self.floats)?;
        Ok(b)
    }

    /// `n` rows of `ty` at `k` elements: 64 random rows quantized, repeated.
    fn weights(&mut self, ty: GgmlType, k: usize, n: usize) -> Result<CudaSlice<u8>, Error> {
        let rows = n.clamp(1, 64);
        let host = quant::quantize(ty, &self.rng.normal_vec(rows * k, 1.0))
            .map_err(|e| Error::Selection { detail: format!("quantize {} {k}x{rows} for the bench: {e}", ty.name()) })?;
        let pattern = self.stream.clone_htod(&host).map_err(drv("cuMemcpyHtoD (weights)"))?;
        let mut b = alloc::<u8>(&self.stream, weight_bytes(ty, k, n) as usize)?;
        tile(&self.stream, &mut b, &pattern)?;
        Ok(b)
    }

    fn tokens(&mut self, t: usize, n_vocab: usize) -> Result<CudaSlice<i32>, Error> {
        let host: Vec<i32> = (0..t).map(|_| self.rng.below(n_vocab) as i32).collect();
        self.stream.clone_htod(&host).map_err(drv("cuMemcpyHtoD (tokens)"))
    }
}

/// One set of buffers a launch reads and writes.
enum Set {
    Matrix { w: CudaSlice<u8>, x: CudaSlice<f32>, y: CudaSlice<f32> },
    Norm { x: CudaSlice<f32>, w: CudaSlice<f32>, out: CudaSlice<f32>, residual: CudaSlice<f32> },
    Glu { gate: CudaSlice<f32>, up: CudaSlice<f32>, out: CudaSlice<f32> },
    Logits { logits: CudaSlice<f32>, idx: CudaSlice<i32>, val: CudaSlice<f32> },
    Embed { tokens: CudaSlice<i32>, table: Arc<CudaSlice<u8>>, out: CudaSlice<f32> },
}

/// A case's buffers on the device, ready to launch any of its variants.
pub struct Prepared {
    pub shape: Shape,
    sets: Vec<Set>,
    scratch: HashMap<&'static str, CudaSlice<u8>>,
}

impl Prepared {
    /// Allocates and fills `sets` buffer sets (see [`sets_for`]).
    pub fn new(gpu: &Gpu, shape: Shape, sets: usize, rng: Rng) -> Result<Prepared, Error> {
        let s = gpu.stream();
        let mut fill = Filler::new(s, rng)?;
        let mut out = Vec::with_capacity(sets);
        // The embedding table is large and read sparsely: one copy shared by every set.
        let table = match shape {
            Shape::Embed { ty, n_embd, n_vocab, .. } => Some(Arc::new(fill.weights(ty, n_embd, n_vocab)?)),
            _ => None,
        };
        for _ in 0..sets.max(1) {
            out.push(match shape {
                Shape::Matvec { ty, k, n } => Set::Matrix { w: fill.weights(ty, k, n)?, x: fill.f32s(k)?, y: alloc(s, n)? },
                Shape::Matmul { ty, t, k, n } => Set::Matrix { w: fill.weights(ty, k, n)?, x: fill.f32s(t * k)?, y: alloc(s, t * n)? },
                Shape::Rmsnorm { rows, n } => Set::Norm { x: fill.f32s(rows * n)?, w: fill.f32s(n)?, out: alloc(s, rows * n)?, residual: alloc(s, 1)? },
                Shape::AddRmsnorm { rows, n, .. } => {
                    Set::Norm { x: fill.f32s(rows * n)?, w: fill.f32s(n)?, out: alloc(s, rows * n)?, residual: fill.f32s(rows * n)? }
                }
                Shape::Glu { rows, n_ff, .. } => Set::Glu { gate: fill.f32s(rows * n_ff)?, up: fill.f32s(rows * n_ff)?, out: alloc(s, rows * n_ff)? },
                Shape::Argmax { rows, n_vocab } | Shape::Topk { rows, n_vocab, .. } => {
                    Set::Logits { logits: fill.f32s(rows * n_vocab)?, idx: alloc(s, rows * topk::MAX_K)?, val: alloc(s, rows * topk::MAX_K)? }
                }
                Shape::Embed { t, n_embd, n_vocab, .. } => {
                    Set::Embed { tokens: fill.tokens(t, n_vocab)?, table: table.clone().expect("made above"), out: alloc(s, t * n_embd)? }
                }
            });
        }
        gpu.sync()?;
        Ok(Prepared { shape, sets: out, scratch: HashMap::new() })
    }

    pub fn sets(&self) -> usize {
        self.sets.len()
    }

    /// One launch of `kernel` on buffer set `i % sets`.
    pub fn launch(&mut self, kernel: &Kernel, i: usize) -> Result<(), Error> {
        let n_sets = self.sets.len();
        let set = &mut self.sets[i % n_sets];
        match (self.shape, set) {
            (Shape::Matvec { k, n, .. }, Set::Matrix { w, x, y }) => {
                matvec::matvec(kernel, &w.slice(..), &x.slice(..), &mut y.slice_mut(..), k, n, 1, k, n)
            }
            (Shape::Matmul { t, k, n, .. }, Set::Matrix { w, x, y }) => {
                matmul::matmul(kernel, &w.slice(..), &x.slice(..), &mut y.slice_mut(..), t, k, n, k, n)
            }
            (Shape::Rmsnorm { rows, n }, Set::Norm { x, w, out, .. }) => {
                rmsnorm::rmsnorm(kernel, &x.slice(..), &w.slice(..), &mut out.slice_mut(..), rows, n, 1e-6)
            }
            (Shape::AddRmsnorm { rows, n, delta_norm }, Set::Norm { x, w, out, residual }) => {
                let w = w.slice(..);
                let dw = delta_norm.then_some(&w);
                add_rmsnorm::add_rmsnorm(kernel, &mut residual.slice_mut(..), &x.slice(..), dw, &w, &mut out.slice_mut(..), rows, n, 1e-6)
            }
            (Shape::Glu { family, rows, n_ff }, Set::Glu { gate, up, out }) => {
                let layout = GluLayout::separate(n_ff);
                if family == swiglu::FAMILY {
                    swiglu::swiglu(kernel, &gate.slice(..), &up.slice(..), &mut out.slice_mut(..), rows, n_ff, layout)
                } else {
                    geglu::geglu(kernel, &gate.slice(..), &up.slice(..), &mut out.slice_mut(..), rows, n_ff, layout)
                }
            }
            (Shape::Argmax { rows, n_vocab }, Set::Logits { logits, idx, val }) => {
                let scratch = match self.scratch.entry(kernel.name()) {
                    std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::hash_map::Entry::Vacant(e) => e.insert(argmax::alloc_scratch(kernel, rows, n_vocab)?),
                };
                argmax::argmax(kernel, &logits.slice(..), &mut idx.slice_mut(..), &mut val.slice_mut(..), &mut scratch.slice_mut(..), rows, n_vocab)
            }
            (Shape::Topk { rows, n_vocab, k }, Set::Logits { logits, idx, val }) => {
                let scratch = match self.scratch.entry(kernel.name()) {
                    std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::hash_map::Entry::Vacant(e) => e.insert(topk::alloc_scratch(kernel, rows, n_vocab, k)?),
                };
                topk::topk(kernel, &logits.slice(..), &mut val.slice_mut(..), &mut idx.slice_mut(..), &mut scratch.slice_mut(..), rows, n_vocab, k)
            }
            (Shape::Embed { t, n_embd, n_vocab, .. }, Set::Embed { tokens, table, out }) => {
                embed::embed(kernel, &tokens.slice(..), &table.slice(..), &mut out.slice_mut(..), t, n_embd, n_vocab, 1.0)
            }
            _ => unreachable!("Prepared::new builds the set that matches its shape"),
        }
    }

    /// Device time of `n` back-to-back launches (rotating sets), in seconds (criterion's batches).
    pub fn time_batch(&mut self, gpu: &Gpu, kernel: &Kernel, n: u64) -> Result<f64, Error> {
        let s = gpu.stream();
        let start = record(s)?;
        for i in 0..n {
            self.launch(kernel, i as usize)?;
        }
        let end = record(s)?;
        Ok(start.elapsed_ms(&end).map_err(drv("cuEventElapsedTime"))? as f64 / 1e3)
    }
}

fn record(s: &Arc<CudaStream>) -> Result<CudaEvent, Error> {
    s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("cuEventRecord"))
}

/// The device's L2 size in bytes.
pub fn l2_bytes(gpu: &Gpu) -> usize {
    let dev_attr = gpu.ctx().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE);
    dev_attr.ok().filter(|v| *v > 0).map(|v| v as usize).unwrap_or(DEFAULT_L2)
}

/// Buffer sets for a working set of `bytes`: enough that the sets together exceed twice L2.
pub fn sets_for(shape: &Shape, l2: usize) -> usize {
    if matches!(shape, Shape::Embed { .. }) {
        return 1;
    }
    let ws = shape.bytes().max(1) as usize;
    (2 * l2).div_ceil(ws).clamp(1, MAX_SETS)
}

/// Per-launch times: `warmup` untimed launches, then `iters` launches each between two events,
/// each preceded by `flush` (outside the events). Returns microseconds, sorted.
pub fn time_launches(
    gpu: &Gpu,
    warmup: u32,
    iters: u32,
    flush: &mut CudaSlice<u8>,
    f: &mut dyn FnMut(usize) -> Result<(), Error>,
) -> Result<Vec<f64>, Error> {
    let s = gpu.stream();
    for i in 0..warmup as usize {
        f(i)?;
    }
    let mut events = Vec::with_capacity(iters as usize);
    for i in 0..iters as usize {
        s.memset_zeros(flush).map_err(drv("cuMemsetD8Async (L2 flush)"))?;
        let start = record(s)?;
        f(warmup as usize + i)?;
        events.push((start, record(s)?));
    }
    let mut us = Vec::with_capacity(events.len());
    for (start, end) in &events {
        us.push(start.elapsed_ms(end).map_err(drv("cuEventElapsedTime (a launch failed?)"))? as f64 * 1e3);
    }
    us.sort_by(f64::total_cmp);
    Ok(us)
}

fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    if n % 2 == 1 { sorted[n / 2] } else { 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]) }
}

/// Copy bandwidth in GB/s (bytes read + written), median of `iters` 1 GiB device-to-device copies.
pub fn copy_bandwidth(gpu: &Gpu, warmup: u32, iters: u32) -> Result<f64, Error> {
    let s = gpu.stream();
    let n = COPY_BYTES / 4;
    let filler = Filler::new(s, Rng::new(7))?;
    let src = filler.f32s(n)?;
    let mut dst = alloc::<f32>(s, n)?;
    let mut times = Vec::new();
    for i in 0..(warmup + iters) {
        let start = record(s)?;
        s.memcpy_dtod(&src, &mut dst).map_err(drv("cuMemcpyDtoDAsync (copy bandwidth)"))?;
        let end = record(s)?;
        if i >= warmup {
            times.push((start, end));
        }
    }
    let mut ms: Vec<f64> = times.iter().map(|(a, b)| a.elapsed_ms(b).map(|v| v as f64)).collect::<Result<_, _>>().map_err(drv("cuEventElapsedTime"))?;
    ms.sort_by(f64::total_cmp);
    Ok(2.0 * COPY_BYTES as f64 / (median(&ms) * 1e-3) / 1e9)
}

// ---------------------------------------------------------------------------------------------
// The command.

/// One measured (variant, shape) row; serialized as described in benches/results/SCHEMA.md.
#[derive(Clone, Debug)]
pub struct Row {
    pub family: &'static str,
    pub variant: &'static str,
    pub kind: Kind,
    pub arch: &'static str,
    pub origin: &'static str,
    pub shape: String,
    pub dtype: String,
    pub median_us: f64,
    pub min_us: f64,
    pub max_us: f64,
    pub reps: usize,
    pub buffer_sets: usize,
    pub bytes: u64,
    pub flops: Option<u64>,
    pub speedup_vs_generic: Option<f64>,
}

impl Row {
    fn gbps(&self) -> f64 {
        self.bytes as f64 / (self.median_us * 1e-6) / 1e9
    }
    fn tflops(&self) -> Option<f64> {
        self.flops.map(|f| f as f64 / (self.median_us * 1e-6) / 1e12)
    }
    fn to_json(&self, copy_gbps: f64) -> Value {
        json!({
            "family": self.family, "variant": self.variant, "kind": self.kind.label(), "arch": self.arch,
            "origin": self.origin, "shape": self.shape, "dtype": self.dtype,
            "median_us": self.median_us, "min_us": self.min_us, "max_us": self.max_us, "reps": self.reps,
            "buffer_sets": self.buffer_sets, "bytes": self.bytes, "gbps": self.gbps(),
            "pct_copy": 100.0 * self.gbps() / copy_gbps, "flops": self.flops, "tflops": self.tflops(),
            "speedup_vs_generic": self.speedup_vs_generic,
        })
    }
}

/// Where the commit id comes from, first found: `--commit`, `$MEMRA_COMMIT` now, `MEMRA_COMMIT`
/// at build time, `git rev-parse HEAD` in the current directory.
fn commit(args: &BenchArgs) -> String {
    if let Some(c) = &args.commit {
        return c.clone();
    }
    if let Some(c) = std::env::var("MEMRA_COMMIT").ok().filter(|c| !c.is_empty()) {
        return c;
    }
    if let Some(c) = option_env!("MEMRA_COMMIT").filter(|c| !c.is_empty()) {
        return c.to_string();
    }
    std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// `YYYY-MM-DDTHH:MM:SSZ` from the system clock (UTC; civil-from-days, no date crate).
fn utc_now() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem / 60 % 60, rem % 60)
}

fn driver_version() -> Option<String> {
    let mut v: std::ffi::c_int = 0;
    // SAFETY: libcuda is loaded (Gpu::new succeeded before this is called); the call writes one int.
    let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    (r == cudarc::driver::sys::CUresult::CUDA_SUCCESS).then(|| format!("CUDA {}.{}", v / 1000, v % 1000 / 10))
}

fn list(cases: &[Case]) {
    println!("{:<12} {:<12} {:<26} {:<8} {:<48} generic", "family", "arch", "shape", "dtype", "specialized");
    for c in cases {
        let spec = c.specialized.map(|v| format!("{}{}", v.name, if c.rendered { " (rendered)" } else { "" })).unwrap_or_else(|| "-".into());
        println!(
            "{:<12} {:<12} {:<26} {:<8} {:<48} {}",
            c.shape.family(),
            c.arch,
            c.shape.label(),
            c.shape.dtype(),
            spec,
            c.generic.map(|v| v.name).unwrap_or("- (none in registry)")
        );
    }
}

/// Geometric mean of specialized/generic per architecture (rows with both measured).
pub fn geomeans(rows: &[Row]) -> Vec<(&'static str, f64, usize)> {
    let mut by_arch: Vec<(&'static str, f64, usize)> = Vec::new();
    for r in rows.iter().filter(|r| r.kind == Kind::Specialized) {
        let Some(x) = r.speedup_vs_generic else { continue };
        match by_arch.iter_mut().find(|(a, ..)| *a == r.arch) {
            Some((_, sum, n)) => {
                *sum += x.ln();
                *n += 1;
            }
            None => by_arch.push((r.arch, x.ln(), 1)),
        }
    }
    by_arch.into_iter().map(|(a, sum, n)| (a, (sum / n as f64).exp(), n)).collect()
}

pub fn run(args: &BenchArgs) -> Result<(), Box<dyn std::error::Error>> {
    if let Some(family) = &args.sweep {
        return sweep::run(args, family);
    }
    if let Some(model) = &args.model {
        return run_model(args, model);
    }
    if let Some(run) = &args.report {
        return report::run_report(args, run);
    }
    let cases = plan(args.arch.as_deref(), args.family.as_deref());
    if args.list {
        list(&cases);
        return Ok(());
    }
    if cases.is_empty() {
        let built: Vec<&str> = registry::SPECIALIZED_FOR.iter().map(|(a, _)| *a).collect();
        return Err(format!(
            "no specialized variants to measure (built for: {}; --arch {}, --family {}); build with --features model-<arch>",
            if built.is_empty() { "none".to_string() } else { built.join(", ") },
            args.arch.as_deref().unwrap_or("any"),
            args.family.as_deref().unwrap_or("any")
        )
        .into());
    }
    let gpu = Gpu::new(args.device).map_err(|e| format!("memra bench needs a CUDA GPU: {e}"))?;
    let driver = driver_version().unwrap_or_else(|| "unknown".into());
    let l2 = l2_bytes(&gpu);
    eprintln!("memra bench: {} ({}), {driver}, L2 {} MiB, {} cases", gpu.name(), gpu.arch(), l2 >> 20, cases.len());

    let mut all: Vec<&'static KernelVariant> = cases.iter().flat_map(|c| c.variants().map(|(v, _)| v)).collect();
    all.sort_by_key(|v| v.name);
    all.dedup_by_key(|v| v.name);
    let kernels: Kernels = gpu.load(&all)?;

    let copy_gbps = copy_bandwidth(&gpu, 3, args.iters)?;
    eprintln!("copy bandwidth (1 GiB device-to-device, read + write): {copy_gbps:.0} GB/s");

    let mut flush = alloc::<u8>(gpu.stream(), 2 * l2)?;
    let mut rng = Rng::from_env_or_time("memra bench");
    let mut rows: Vec<Row> = Vec::new();
    for case in &cases {
        let sets = sets_for(&case.shape, l2);
        let mut prepared = Prepared::new(&gpu, case.shape, sets, Rng::new(rng.next_u64()))
            .map_err(|e| format!("{} {}: {e}", case.shape.family(), case.shape.label()))?;
        let mut measured: Vec<Row> = Vec::new();
        for (v, kind) in case.variants() {
            let kernel = kernels.get(v.name)?;
            let us = time_launches(&gpu, args.warmup, args.iters, &mut flush, &mut |i| prepared.launch(kernel, i))
                .map_err(|e| format!("{} {}: {e}", v.name, case.shape.label()))?;
            measured.push(Row {
                family: case.shape.family(),
                variant: v.name,
                kind,
                arch: case.arch,
                origin: if kind == Kind::Specialized && case.rendered { "rendered" } else { "registry" },
                shape: case.shape.label(),
                dtype: case.shape.dtype(),
                median_us: median(&us),
                min_us: us[0],
                max_us: us[us.len() - 1],
                reps: us.len(),
                buffer_sets: prepared.sets(),
                bytes: case.shape.bytes(),
                flops: case.shape.flops(),
                speedup_vs_generic: None,
            });
        }
        let generic_us = measured.iter().find(|r| r.kind == Kind::Generic).map(|r| r.median_us);
        for r in measured.iter_mut().filter(|r| r.kind == Kind::Specialized) {
            r.speedup_vs_generic = generic_us.map(|g| g / r.median_us);
        }
        for r in &measured {
            eprintln!("  {:<48} {:<22} {:>10.2} us", r.variant, r.shape, r.median_us);
        }
        rows.extend(measured);
    }
    drop(flush);

    print!("{}", table(&rows, copy_gbps));
    let means = geomeans(&rows);
    for (arch, g, n) in &means {
        println!("geomean specialized/generic speedup, {arch}: {g:.3}x over {n} shapes");
    }

    if args.json.is_some() || args.svg.is_some() || args.peers.is_some() {
        let doc = json!({
            "schema": 1,
            "device": gpu.name(),
            "sm": gpu.arch().to_string(),
            "driver": driver,
            "date": utc_now(),
            "commit": commit(args),
            "memra_version": env!("CARGO_PKG_VERSION"),
            "iters": args.iters,
            "warmup": args.warmup,
            "l2_bytes": l2,
            "copy_bytes": 2 * COPY_BYTES,
            "copy_gbps": copy_gbps,
            "geomean_speedup": means.iter().map(|(a, g, n)| json!({"arch": a, "speedup": g, "shapes": n})).collect::<Vec<_>>(),
            "results": rows.iter().map(|r| r.to_json(copy_gbps)).collect::<Vec<_>>(),
        });
        report::emit(args, doc)?;
    }
    Ok(())
}

/// `--model`: copy bandwidth, then the model end to end (crate::bench_model).
fn run_model(args: &BenchArgs, model: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    if args.prompt_tokens == 0 || args.decode_tokens == 0 {
        return Err("--prompt-tokens and --decode-tokens must be at least 1".into());
    }
    let gpu = Gpu::new(args.device).map_err(|e| format!("memra bench needs a CUDA GPU: {e}"))?;
    let driver = driver_version().unwrap_or_else(|| "unknown".into());
    let copy_gbps = copy_bandwidth(&gpu, 3, args.iters)?;
    eprintln!("memra bench: {} ({}), {driver}; copy bandwidth {copy_gbps:.0} GB/s", gpu.name(), gpu.arch());
    let name = gpu.name().to_string();
    let sm = gpu.arch().to_string();
    drop(gpu);
    let models = crate::bench_model::run(model, args.device, copy_gbps, args.prompt_tokens, args.decode_tokens)?;
    if let Some(path) = &args.json {
        let doc = json!({
            "schema": 1,
            "device": name,
            "sm": sm,
            "driver": driver,
            "date": utc_now(),
            "commit": commit(args),
            "memra_version": env!("CARGO_PKG_VERSION"),
            "copy_bytes": 2 * COPY_BYTES,
            "copy_gbps": copy_gbps,
            "models": models,
        });
        let text = serde_json::to_string_pretty(&doc)?;
        std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// The printed table: one line per (variant, shape).
pub fn table(rows: &[Row], copy_gbps: f64) -> String {
    let mut t = String::new();
    let _ = writeln!(t, "copy bandwidth: {copy_gbps:.0} GB/s");
    let _ = writeln!(
        t,
        "{:<12} {:<48} {:<11} {:<22} {:<7} {:>10} {:>8} {:>7} {:>8} {:>9}",
        "family", "variant", "kind", "shape", "dtype", "median_us", "GB/s", "%copy", "TFLOP/s", "spec/gen"
    );
    for r in rows {
        let _ = writeln!(
            t,
            "{:<12} {:<48} {:<11} {:<22} {:<7} {:>10.2} {:>8.0} {:>6.1}% {:>8} {:>9}",
            r.family,
            r.variant,
            r.kind.label(),
            r.shape,
            r.dtype,
            r.median_us,
            r.gbps(),
            100.0 * r.gbps() / copy_gbps,
            r.tflops().map(|x| format!("{x:.1}")).unwrap_or_else(|| "-".into()),
            r.speedup_vs_generic.map(|x| format!("{x:.2}x")).unwrap_or_else(|| "-".into()),
        );
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_count_each_input_and_output_once() {
        // Q8_0 row of 6144 = 192 blocks × 34 B.
        let mv = Shape::Matvec { ty: GgmlType::Q8_0, k: 6144, n: 2048 };
        assert_eq!(mv.bytes(), 192 * 34 * 2048 + 4 * (6144 + 2048));
        assert_eq!(mv.flops(), Some(2 * 6144 * 2048));
        assert_eq!(Shape::Rmsnorm { rows: 4096, n: 6144 }.bytes(), 4 * (2 * 4096 * 6144 + 6144));
        assert_eq!(Shape::AddRmsnorm { rows: 2, n: 8, delta_norm: false }.bytes(), 4 * (4 * 16 + 8));
        let mm = Shape::Matmul { ty: GgmlType::BF16, t: 4096, k: 6144, n: 6144 };
        assert_eq!(mm.bytes(), 2 * 6144 * 6144 + 4 * 2 * 4096 * 6144);
        assert_eq!(mm.flops(), Some(2 * 4096 * 6144 * 6144));
    }

    #[test]
    fn rotation_covers_twice_l2_and_is_capped() {
        let l2 = 60 << 20;
        assert_eq!(sets_for(&Shape::Rmsnorm { rows: 4096, n: 6144 }, l2), 1);
        // 48 MiB per set: three sets exceed 120 MiB.
        assert_eq!(sets_for(&Shape::Rmsnorm { rows: 1024, n: 6144 }, l2), 3);
        assert_eq!(sets_for(&Shape::Rmsnorm { rows: 1, n: 6144 }, l2), MAX_SETS);
        assert_eq!(sets_for(&Shape::Matvec { ty: GgmlType::BF16, k: 6144, n: 154880 }, l2), 1);
    }

    #[test]
    fn utc_date_is_well_formed() {
        let d = utc_now();
        assert_eq!(d.len(), 20, "{d}");
        assert!(d.starts_with("20") && d.ends_with('Z'), "{d}");
    }

    #[test]
    fn every_planned_case_has_a_generic_twin_of_its_dtype() {
        for c in plan(None, None) {
            let g = c.generic.unwrap_or_else(|| panic!("{:?} has no generic twin", c.shape));
            assert!(g.is_generic());
            assert_eq!(g.family, c.shape.family());
            if let Some(Param::Sym(q)) = g.param("qtype") {
                assert_eq!(q, c.shape.dtype(), "{:?}: {}", c.shape, g.name);
            }
            let s = c.specialized.expect("planned from a specialized variant");
            assert!(!s.is_generic(), "{}", s.name);
        }
    }

    #[test]
    fn geomean_is_per_arch() {
        let row = |arch, s| Row {
            family: "rmsnorm",
            variant: "v",
            kind: Kind::Specialized,
            arch,
            origin: "registry",
            shape: String::new(),
            dtype: String::new(),
            median_us: 1.0,
            min_us: 1.0,
            max_us: 1.0,
            reps: 20,
            buffer_sets: 1,
            bytes: 1,
            flops: None,
            speedup_vs_generic: Some(s),
        };
        let g = geomeans(&[row("a", 2.0), row("a", 8.0), row("b", 1.5)]);
        assert_eq!(g.len(), 2);
        assert!((g[0].1 - 4.0).abs() < 1e-12 && g[0].2 == 2);
        assert!((g[1].1 - 1.5).abs() < 1e-12);
    }
}
