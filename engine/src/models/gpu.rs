//! Building blocks of the GPU forwards (one file per architecture beside this one): weights on
//! the device, the model's kernel plan (one selection per need, one parallel load), linear layers
//! that pick matvec for one token and matmul for many, and the bf16 KV cache.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr, DriverError, PinnedHostSlice, ValidAsZeroBits};
use memra_gguf::{GgmlType, Gguf, TensorInfo, quant};

use crate::cuda::graph::Graph;
use crate::cuda::{Error as CudaError, Gpu, Kernel, Kernels};
use crate::kernels::registry::{self, KernelVariant, Param, Policy, Selection};
use crate::kernels::quantize_q8::{self, Q8Activation};
use crate::kernels::{argmax, matmul, matvec, norm_matvec};
use super::GpuModel;

/// Why a model cannot be loaded or run on the GPU. Messages name the file, tensor, kernel or
/// size involved.
#[derive(Debug, Clone)]
pub struct GpuModelError(pub String);

impl fmt::Display for GpuModelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for GpuModelError {}

impl From<CudaError> for GpuModelError {
    fn from(e: CudaError) -> Self {
        GpuModelError(e.to_string())
    }
}

pub type Result<T> = std::result::Result<T, GpuModelError>;

pub fn err(msg: impl Into<String>) -> GpuModelError {
    GpuModelError(msg.into())
}

/// Bytes as MiB for messages.
pub fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// A device allocation of `n` zeroed elements; out-of-memory names what and how much.
pub fn alloc<T: DeviceRepr + ValidAsZeroBits>(gpu: &Gpu, n: usize, what: &str) -> Result<CudaSlice<T>> {
    gpu.stream().alloc_zeros::<T>(n.max(1)).map_err(|e| {
        err(format!(
            "out of GPU memory allocating {what}: {} ({n} × {} bytes): {e:?}",
            mib(n * std::mem::size_of::<T>()),
            std::mem::size_of::<T>()
        ))
    })
}

/// A weight matrix (or vector) in its GGUF encoding on the device. `k` = ne0 (the row length),
/// `n` = the number of rows (product of the other dims).
pub struct DeviceTensor {
    pub name: String,
    pub ty: GgmlType,
    pub k: usize,
    pub n: usize,
    pub data: CudaSlice<u8>,
}

impl DeviceTensor {
    pub fn upload<B: AsRef<[u8]>>(gpu: &Gpu, file: &Gguf<B>, t: &TensorInfo<'_>) -> Result<DeviceTensor> {
        let bytes = tensor_bytes(file, t)?;
        let mut data = alloc::<u8>(gpu, bytes.len(), &format!("tensor '{}'", t.name))?;
        gpu.stream().memcpy_htod(bytes, &mut data).map_err(|e| err(format!("copying tensor '{}' to the GPU: {e:?}", t.name)))?;
        Ok(DeviceTensor { name: t.name.to_string(), ty: t.ggml_type, k: t.row_len() as usize, n: t.n_rows() as usize, data })
    }

    /// Matrices with one row length, their rows stacked in order in one buffer as type `ty`
    /// (each part's own type, or one it widens to exactly: `quant::widen`, re-encoded here):
    /// shape `[k, Σ n]`, named `a+b+…`. Returns the tensor and each part's first byte.
    pub fn upload_stacked<B: AsRef<[u8]>>(gpu: &Gpu, file: &Gguf<B>, parts: &[TensorInfo<'_>], ty: GgmlType) -> Result<(DeviceTensor, Vec<usize>)> {
        let name = parts.iter().map(|t| t.name).collect::<Vec<_>>().join("+");
        let k = parts[0].row_len();
        if let Some(t) = parts.iter().find(|t| t.row_len() != k) {
            return Err(err(format!("tensor '{}': cannot stack with '{}' (row length differs)", t.name, parts[0].name)));
        }
        let datas = parts
            .iter()
            .map(|t| {
                let bytes = tensor_bytes(file, t)?;
                if t.ggml_type == ty {
                    return Ok(std::borrow::Cow::Borrowed(bytes));
                }
                quant::widen(t.ggml_type, ty, bytes, t.n_elements() as usize)
                    .map(std::borrow::Cow::Owned)
                    .map_err(|e| err(format!("tensor '{}': cannot stack as {ty} with '{}': {e}", t.name, parts[0].name)))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut offsets = Vec::with_capacity(parts.len());
        let mut total = 0usize;
        for bytes in &datas {
            offsets.push(total);
            total += bytes.len();
        }
        let mut data = alloc::<u8>(gpu, total, &format!("tensors '{name}'"))?;
        for ((t, &off), bytes) in parts.iter().zip(&offsets).zip(&datas) {
            gpu.stream()
                .memcpy_htod(bytes.as_ref(), &mut data.slice_mut(off..off + bytes.len()))
                .map_err(|e| err(format!("copying tensor '{}' to the GPU: {e:?}", t.name)))?;
        }
        let n = parts.iter().map(|t| t.n_rows() as usize).sum();
        Ok((DeviceTensor { name, ty, k: k as usize, n, data }, offsets))
    }

    pub fn bytes(&self) -> usize {
        self.data.len()
    }
}

/// A tensor's data in the file, all `n_bytes` of it (a truncated file is an error naming it).
fn tensor_bytes<'f, B: AsRef<[u8]>>(file: &'f Gguf<B>, t: &TensorInfo<'_>) -> Result<&'f [u8]> {
    let bytes = file.tensor_data(*t);
    if bytes.len() as u64 != t.n_bytes {
        return Err(err(format!("tensor '{}': {} data bytes in the file, {} expected (truncated?)", t.name, bytes.len(), t.n_bytes)));
    }
    Ok(bytes)
}

/// Matrices of one row length in runs that can share a buffer: [`memra_codegen::plan::stack_runs`]
/// over `(type, row length, elements)` (equal types, or with `widen` one every part is exact in),
/// and a part whose bytes in the run's type would start off a 16-byte boundary (the kernels'
/// alignment) starts a run of its own. Each run: the parts' indices and the stored type.
pub fn aligned_runs(parts: &[(GgmlType, u64, u64)], widen: bool) -> Vec<(Vec<usize>, GgmlType)> {
    let keys: Vec<_> = parts.iter().map(|&(ty, k, _)| (ty, k)).collect();
    let mut out = Vec::new();
    for (run, ty) in memra_codegen::plan::stack_runs(&keys, widen) {
        let (mut cur, mut offset) = (Vec::new(), 0u64);
        for i in run {
            if !cur.is_empty() && !offset.is_multiple_of(16) {
                out.push((std::mem::take(&mut cur), ty));
                offset = 0;
            }
            cur.push(i);
            offset += parts[i].2 / ty.block_size() * ty.type_size();
        }
        out.push((cur, ty));
    }
    out
}

/// Projections of one input, their rows stacked at load in runs of one type
/// ([`aligned_runs`]; the specs' `stack = true` entries plan the same runs): a decode step
/// projects each run in one matvec launch, a prefill chunk each part alone (matmul). Part `i`'s
/// output for `t` tokens is the `t` rows at [`Stack::at`]`(i, t)` of one buffer, so for one
/// token the parts' rows lie back to back, as a run writes them.
pub struct Stack {
    runs: Vec<StackRun>,
    /// Each part's rows, in order.
    rows: Vec<usize>,
}

struct StackRun {
    w: DeviceTensor,
    /// The run's decode matvec (f32 x).
    matvec: &'static str,
    /// Index of the run's first part.
    first: usize,
    parts: Vec<StackPart>,
}

struct StackPart {
    name: String,
    n: usize,
    /// The part's bytes in the run's buffer.
    bytes: std::ops::Range<usize>,
    matmul: &'static str,
}

impl Stack {
    /// Stacks `parts` (uploaded, one row length) on the device: each run's parts are copied into
    /// one buffer and freed. Runs keep their parts' types (no widening).
    pub fn new(gpu: &Gpu, plan: &mut KernelPlan, parts: Vec<DeviceTensor>) -> Result<Stack> {
        let rows = parts.iter().map(|p| p.n).collect();
        let keys: Vec<_> = parts.iter().map(|p| (p.ty, p.k as u64, (p.k * p.n) as u64)).collect();
        if let Some(p) = parts.iter().find(|p| p.k != parts[0].k) {
            return Err(err(format!("tensor '{}': cannot stack with '{}' (row length differs)", p.name, parts[0].name)));
        }
        let mut parts: Vec<Option<DeviceTensor>> = parts.into_iter().map(Some).collect();
        let mut runs = Vec::new();
        for (run, ty) in aligned_runs(&keys, false) {
            let members: Vec<DeviceTensor> = run.iter().map(|&i| parts[i].take().expect("each part in one run")).collect();
            let total: usize = members.iter().map(DeviceTensor::bytes).sum();
            let name = members.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join("+");
            let mut data = alloc::<u8>(gpu, total, &format!("tensors '{name}'"))?;
            let (mut at, mut stacked) = (0usize, Vec::with_capacity(members.len()));
            for p in &members {
                let end = at + p.bytes();
                gpu.stream()
                    .memcpy_dtod(&p.data, &mut data.slice_mut(at..end))
                    .map_err(|e| err(format!("stacking tensor '{}' on the GPU: {e:?}", p.name)))?;
                let named = |e: GpuModelError| err(format!("tensor '{}': {e}", p.name));
                let matmul = plan.want(matmul::FAMILY, &projection_request(&p.name, ty, p.k, p.n)?).map_err(named)?;
                stacked.push(StackPart { name: p.name.clone(), n: p.n, bytes: at..end, matmul });
                at = end;
            }
            // The copies finish before the parts' buffers are freed.
            gpu.stream().synchronize().map_err(|e| err(format!("stacking '{name}': {e:?}")))?;
            let (k, n) = (members[0].k, members.iter().map(|p| p.n).sum());
            let matvec = plan.want_f32_x(matvec::FAMILY, &projection_request(&name, ty, k, n)?).map_err(|e| err(format!("tensors '{name}': {e}")))?;
            runs.push(StackRun { w: DeviceTensor { name, ty, k, n, data }, matvec, first: run[0], parts: stacked });
        }
        Ok(Stack { runs, rows })
    }

    /// Where part `i`'s `t` output rows start in the output buffer.
    pub fn at(&self, i: usize, t: usize) -> usize {
        t * self.rows[..i].iter().sum::<usize>()
    }

    /// Rows of every part together (a token's output width).
    pub fn width(&self) -> usize {
        self.rows.iter().sum()
    }

    /// Part `i`'s rows.
    pub fn rows(&self, i: usize) -> usize {
        self.rows[i]
    }

    /// `y` = every part of `t` rows of `x` (`[t, k]` packed), laid out as [`Stack::at`] says.
    pub fn forward(&self, kernels: &Kernels, x: &CudaView<'_, f32>, y: &mut CudaViewMut<'_, f32>, t: usize) -> Result<()> {
        for run in &self.runs {
            let k = run.w.k;
            if t == 1 {
                let at = self.at(run.first, 1);
                matvec::matvec(kernels.get(run.matvec)?, &run.w.data.slice(..), x, &mut y.slice_mut(at..at + run.w.n), k, run.w.n, 1, k, run.w.n)
                    .map_err(|e| err(format!("tensors '{}': {e}", run.w.name)))?;
                continue;
            }
            for (j, p) in run.parts.iter().enumerate() {
                let at = self.at(run.first + j, t);
                let w = run.w.data.slice(p.bytes.clone());
                matmul::matmul(kernels.get(p.matmul)?, &w, x, &mut y.slice_mut(at..at + t * p.n), t, k, p.n, k, p.n)
                    .map_err(|e| err(format!("tensor '{}': {e}", p.name)))?;
            }
        }
        Ok(())
    }
}

/// A small f32 tensor (norm weights) dequantized on the host and uploaded.
pub fn upload_f32<B: AsRef<[u8]>>(gpu: &Gpu, file: &Gguf<B>, t: &TensorInfo<'_>) -> Result<CudaSlice<f32>> {
    let bytes = file.tensor_data(*t);
    let values = quant::dequantize(t.ggml_type, bytes, t.n_elements() as usize)
        .map_err(|e| err(format!("tensor '{}': {e}", t.name)))?;
    let mut buf = alloc::<f32>(gpu, values.len(), &format!("tensor '{}'", t.name))?;
    gpu.stream().memcpy_htod(&values, &mut buf).map_err(|e| err(format!("copying tensor '{}' to the GPU: {e:?}", t.name)))?;
    Ok(buf)
}

/// Where a forward's weights come from: a GGUF file (its tensor data uploaded) or a synthetic
/// description (`crate::synthetic`: random valid blocks generated on the GPU). The tensor
/// handles are the file's `TensorInfo`s either way (a synthetic model's header-only GGUF).
pub trait WeightSource {
    /// The tensor in its GGUF encoding on the device.
    fn upload(&self, gpu: &Gpu, t: &TensorInfo<'_>) -> Result<DeviceTensor>;
    /// A small tensor (norm weights, biases) as f32 on the device.
    fn upload_f32(&self, gpu: &Gpu, t: &TensorInfo<'_>) -> Result<CudaSlice<f32>>;
}

impl<B: AsRef<[u8]>> WeightSource for Gguf<B> {
    fn upload(&self, gpu: &Gpu, t: &TensorInfo<'_>) -> Result<DeviceTensor> {
        DeviceTensor::upload(gpu, self, t)
    }

    fn upload_f32(&self, gpu: &Gpu, t: &TensorInfo<'_>) -> Result<CudaSlice<f32>> {
        upload_f32(gpu, self, t)
    }
}

/// The kernels a model needs: each `want` selects one variant under the policy (specialized
/// where the model's dims match the build, else generic, saying why); `load` compiles or fetches
/// them all at once.
pub struct KernelPlan {
    policy: Policy,
    picks: BTreeMap<&'static str, Selection>,
}

impl KernelPlan {
    pub fn new(policy: Policy) -> KernelPlan {
        KernelPlan { policy, picks: BTreeMap::new() }
    }

    /// The variant name for `family` at the model's `request` (dims and enum tokens).
    pub fn want(&mut self, family: &str, request: &[(&str, Param)]) -> Result<&'static str> {
        let s = registry::select_with(family, request, self.policy)?;
        let name = s.variant.name;
        self.picks.entry(name).or_insert(s);
        Ok(name)
    }

    /// [`KernelPlan::want`] for a product (matvec, moe_matvec) and how its x arrives: a call
    /// site that takes a [`Product`] passes x through [`product_x`], which quantizes it for
    /// variants that read q8 rows.
    pub fn product(&mut self, family: &str, request: &[(&str, Param)]) -> Result<Product> {
        let name = self.want(family, request)?;
        Ok(Product { name, q8_x: reads_q8_rows(name) })
    }

    /// [`KernelPlan::want`] for a product whose call site passes f32 x: a variant that reads q8
    /// rows (a spec entry's `xq8 = 1`) is refused by name instead of reading f32 as q8.
    pub fn want_f32_x(&mut self, family: &str, request: &[(&str, Param)]) -> Result<&'static str> {
        let name = self.want(family, request)?;
        if reads_q8_rows(name) {
            return Err(err(format!(
                "{name} reads x as quantize_q8 rows (xq8 = 1) but this call site passes f32 x; a spec entry can take fuse_x = 1 instead (the kernel quantizes x itself)"
            )));
        }
        Ok(name)
    }

    /// The quantize_q8 variant, planned when a product of this plan reads q8 rows (call after
    /// the products are planned).
    pub fn quantizer(&mut self) -> Result<Option<&'static str>> {
        if self.picks.keys().any(|n| reads_q8_rows(n)) {
            return self.want(quantize_q8::FAMILY, &[]).map(Some);
        }
        Ok(None)
    }

    /// A matvec (decode) and a matmul (prefill) variant for a weight matrix. A matvec on the
    /// integer path (a spec entry's `xq8 = 1`) gets the quantize_q8 variant and a one-row q8
    /// buffer of its own: [`Linear::forward`] quantizes x into it before the product.
    pub fn linear(&mut self, w: DeviceTensor) -> Result<Linear> {
        let req = projection_request(&w.name, w.ty, w.k, w.n)?;
        let named = |e: GpuModelError| err(format!("tensor '{}': {e}", w.name));
        let product = self.product(matvec::FAMILY, &req).map_err(named)?;
        let matmul = self.want(matmul::FAMILY, &req).map_err(named)?;
        let q8 = match product.q8_x {
            true => {
                let quantize = self.want(quantize_q8::FAMILY, &[]).map_err(named)?;
                Some((quantize, Mutex::new(Q8Activation::new(w.data.stream(), w.k, 1)?)))
            }
            false => None,
        };
        Ok(Linear { w, matvec: product.name, matmul, q8 })
    }

    /// The matvec and matmul variants for a `k`-long, `n`-row matrix `name` of type `ty`, for a
    /// call site that passes f32 x ([`project`]).
    pub fn projection(&mut self, name: &str, ty: GgmlType, k: usize, n: usize) -> Result<(&'static str, &'static str)> {
        let req = projection_request(name, ty, k, n)?;
        let matvec = self.want_f32_x(matvec::FAMILY, &req).map_err(|e| err(format!("tensor '{name}': {e}")))?;
        let matmul = self.want(matmul::FAMILY, &req).map_err(|e| err(format!("tensor '{name}': {e}")))?;
        Ok((matvec, matmul))
    }

    /// The norm_matvec variant over `w` (a decode projection with the residual add + RMSNorm in
    /// front), plain or as the gate of a `glu` pair.
    pub fn norm_matvec(&mut self, w: &DeviceTensor, glu: norm_matvec::Glu) -> Result<&'static str> {
        let q = qtype_token(norm_matvec::FAMILY, w.ty).map_err(|e| err(format!("tensor '{}': {e}", w.name)))?;
        let req = [("k", Param::Int(w.k as i64)), ("n", Param::Int(w.n as i64)), ("qtype", Param::Sym(q)), ("glu", Param::Sym(glu.token()))];
        self.want(norm_matvec::FAMILY, &req).map_err(|e| err(format!("tensor '{}': {e}", w.name)))
    }

    /// One line per generic fallback (grouped by reason) and a count.
    pub fn report(&self) -> Vec<String> {
        let specialized = self.picks.values().filter(|s| s.specialized).count();
        let mut lines: Vec<String> = Vec::new();
        for s in self.picks.values().filter(|s| !s.specialized) {
            if !lines.contains(&s.reason) {
                lines.push(s.reason.clone());
            }
        }
        lines.push(format!(
            "kernels: {} variants, {specialized} specialized, {} generic",
            self.picks.len(),
            self.picks.len() - specialized
        ));
        lines
    }

    pub fn variants(&self) -> Vec<&'static KernelVariant> {
        self.picks.values().map(|s| s.variant).collect()
    }

    pub fn load(&self, gpu: &Gpu) -> Result<Kernels> {
        Ok(gpu.load(&self.variants())?)
    }
}

/// The registry token (`q4_k`) of a GGUF type among the `family` variants of this build, or an
/// error naming the type when no kernel of the family reads it.
pub fn qtype_token(family: &str, ty: GgmlType) -> Result<&'static str> {
    registry::family(family)
        .iter()
        .find_map(|v| match v.param("qtype") {
            Some(Param::Sym(s)) if GgmlType::from_name(s) == Some(ty) => Some(s),
            _ => None,
        })
        .ok_or_else(|| err(format!("no {family} kernel in this build reads {} data", ty.name())))
}

/// The request of a projection's matvec / matmul: its dims and weight type.
fn projection_request(name: &str, ty: GgmlType, k: usize, n: usize) -> Result<[(&'static str, Param); 3]> {
    let qtype = Param::Sym(qtype_token(matvec::FAMILY, ty).map_err(|e| err(format!("tensor '{name}': {e}")))?);
    Ok([("k", Param::Int(k as i64)), ("n", Param::Int(n as i64)), ("qtype", qtype)])
}

/// A weight matrix with its decode and prefill kernels: `y[t] = W · x[t]`.
pub struct Linear {
    pub w: DeviceTensor,
    matvec: &'static str,
    matmul: &'static str,
    /// A matvec that reads x as q8 rows: the quantize_q8 variant and this projection's q8 row
    /// (locked only to write it from `&self`; a forward runs on one thread).
    q8: Option<(&'static str, Mutex<Q8Activation>)>,
}

impl Linear {
    /// `x`: `[t, k]` packed, `y`: `[t, n]` packed. One token runs the matvec (quantizing x
    /// first on the integer path), more the matmul.
    pub fn forward(&self, kernels: &Kernels, x: &CudaView<'_, f32>, y: &mut CudaViewMut<'_, f32>, t: usize) -> Result<()> {
        let (w, k, n) = (&self.w.data.slice(..), self.w.k, self.w.n);
        match &self.q8 {
            Some((quantize, q8)) if t == 1 => {
                let mut q8 = q8.lock().unwrap_or_else(|p| p.into_inner());
                let named = |e: CudaError| err(format!("tensor '{}': {e}", self.w.name));
                q8.quantize(kernels.get(quantize)?, x, 1, k).map_err(named)?;
                matvec::matvec(kernels.get(self.matvec)?, w, &q8.view(), y, k, n, 1, q8.ld(), n).map_err(named)
            }
            _ => project(kernels, (self.matvec, self.matmul), &self.w.name, w, k, n, x, y, t),
        }
    }
}

/// `y[t] = W · x[t]` for `W` (`n` rows of `k`, bytes `w`) with its (matvec, matmul) variants:
/// one token runs the matvec, more the matmul.
#[allow(clippy::too_many_arguments)]
pub fn project(kernels: &Kernels, variants: (&str, &str), name: &str, w: &CudaView<'_, u8>, k: usize, n: usize, x: &CudaView<'_, f32>, y: &mut CudaViewMut<'_, f32>, t: usize) -> Result<()> {
    let res = if t == 1 {
        matvec::matvec(kernels.get(variants.0)?, w, x, y, k, n, 1, k, n)
    } else {
        matmul::matmul(kernels.get(variants.1)?, w, x, y, t, k, n, k, n)
    };
    res.map_err(|e| err(format!("tensor '{name}': {e}")))
}

/// A planned product variant (matvec, moe_matvec) and whether it reads x as quantize_q8 rows
/// (`xq8 = 1`; `fuse_x` variants take f32 x and quantize it in each block).
#[derive(Clone, Copy, Debug)]
pub struct Product {
    pub name: &'static str,
    pub q8_x: bool,
}

/// Whether the matvec / moe_matvec variant `name` reads x as quantize_q8 rows.
pub fn reads_q8_rows(name: &str) -> bool {
    registry::find(name).is_some_and(matvec::variant_reads_q8)
}

/// `x` (`rows` rows of `ld` floats) as the product `p` reads it, with the stride to pass as its
/// `ldx`: as given, or quantized into `q8` by the quantize_q8 variant `quantize` first (q8 x).
pub fn product_x<'a>(
    kernels: &Kernels,
    p: Product,
    quantize: Option<&str>,
    q8: &'a mut Option<Q8Activation>,
    x: CudaView<'a, f32>,
    rows: usize,
    ld: usize,
) -> Result<(CudaView<'a, f32>, usize)> {
    if !p.q8_x {
        return Ok((x, ld));
    }
    match (quantize, q8.as_mut()) {
        (Some(qk), Some(q8)) => {
            q8.quantize(kernels.get(qk)?, &x, rows, ld)?;
            let q8: &'a Q8Activation = q8;
            Ok((q8.view(), q8.ld()))
        }
        _ => Err(err(format!("{} reads x as q8 rows but no quantize_q8 buffer was planned for it", p.name))),
    }
}

/// A kernel by name (loaded by the plan).
pub fn kernel<'k>(kernels: &'k Kernels, name: &str) -> Result<&'k Kernel> {
    Ok(kernels.get(name)?)
}

/// Per layer bf16 K and V caches `[max_ctx, n_kv, head_dim]` (bf16 as u16 bits); the filled
/// positions are counted in [`StackState::len`].
pub struct KvCache {
    pub k: Vec<CudaSlice<u16>>,
    pub v: Vec<CudaSlice<u16>>,
    pub max_ctx: usize,
}

impl KvCache {
    pub fn new(gpu: &Gpu, n_layer: usize, max_ctx: usize, n_kv: usize, head_dim: usize) -> Result<KvCache> {
        let per = max_ctx
            .checked_mul(n_kv * head_dim)
            .ok_or_else(|| err(format!("KV cache of {max_ctx} positions overflows")))?;
        let total = per * 2 * 2 * n_layer;
        let mut k = Vec::with_capacity(n_layer);
        let mut v = Vec::with_capacity(n_layer);
        for il in 0..n_layer {
            let what = format!(
                "the KV cache (layer {il}; {n_layer} layers × {max_ctx} positions × {n_kv} kv heads × {head_dim} dims × bf16 × K,V = {} in all; lower it with --ctx)",
                mib(total)
            );
            k.push(alloc::<u16>(gpu, per, &what)?);
            v.push(alloc::<u16>(gpu, per, &what)?);
        }
        Ok(KvCache { k, v, max_ctx })
    }

    pub fn bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|b| b.len() * 2).sum()
    }
}

/// A decode step captured as a CUDA graph and replayed while its `key` (whatever the captured
/// launches baked besides device buffers: split counts, sparse or dense attention) is unchanged;
/// or, when not `enabled` (`GpuOptions::graphs` off), launched directly every time.
/// With `pdl`, consecutive kernels are linked by programmatic dependent launch (cuda::graph,
/// sm_90+; elsewhere ignored).
pub struct StepGraph<K> {
    enabled: bool,
    pdl: bool,
    graph: Option<(Graph, K)>,
}

impl<K: PartialEq> StepGraph<K> {
    pub fn new(enabled: bool, pdl: bool) -> StepGraph<K> {
        StepGraph { enabled, pdl, graph: None }
    }

    /// Replays the graph captured for `key`, capturing `enqueue`'s launches first when there is
    /// none for it (or just runs `enqueue` when graphs are off). The step's inputs (token,
    /// position) must live in device buffers.
    pub fn run(&mut self, stream: &Arc<CudaStream>, key: K, enqueue: impl FnOnce() -> Result<()>) -> Result<()> {
        if !self.enabled {
            return enqueue();
        }
        if self.graph.as_ref().is_none_or(|(_, k)| *k != key) {
            self.graph = None;
            let pdl = self.pdl && stream.context().compute_capability().is_ok_and(|(major, _)| major >= 9);
            let graph = Graph::capture(stream, pdl, enqueue)?;
            self.graph = Some((graph, key));
        }
        let (graph, _) = self.graph.as_ref().expect("captured above");
        Ok(graph.launch()?)
    }
}

impl<K: PartialEq> Default for StepGraph<K> {
    fn default() -> Self {
        StepGraph::new(true, true)
    }
}

/// Refuses an empty batch, an out-of-vocabulary id, or more positions than the cache holds.
pub fn check_tokens(tokens: &[u32], n_vocab: usize, len: usize, max_ctx: usize, n_ctx_train: usize) -> Result<()> {
    if tokens.is_empty() {
        return Err(err("forward: no tokens"));
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
        return Err(err(format!("token id {bad} is out of range (n_vocab {n_vocab})")));
    }
    check_room(len, tokens.len(), "new positions", max_ctx, n_ctx_train)
}

/// Refuses `wanted` more positions (`what`, for the message) after `len` cached ones when the
/// cache holds `max_ctx` (the sum cannot overflow).
fn check_room(len: usize, wanted: usize, what: &str, max_ctx: usize, n_ctx_train: usize) -> Result<()> {
    if len.checked_add(wanted).is_none_or(|end| end > max_ctx) {
        return Err(err(format!(
            "context full: {len} cached + {wanted} {what} > {max_ctx} (the KV cache size; --ctx raises it up to the model's {n_ctx_train})"
        )));
    }
    Ok(())
}

/// The last position's logits, their device argmax, and the greedy tokens decode steps fed
/// each other on the device.
pub struct LogitsState {
    pub logits: CudaSlice<f32>,
    pub best_idx: CudaSlice<i32>,
    pub best_val: CudaSlice<f32>,
    pub argmax_scratch: CudaSlice<u8>,
    /// `history[p]`: the token a decode step's argmax fed to position p (max_ctx + 1 entries:
    /// the step at the last position feeds one past it; then GREEDY_READ spare ones, so that
    /// [`GpuModel::decode_greedy`] always reads whole slots).
    pub history: CudaSlice<i32>,
}

impl LogitsState {
    pub fn new(gpu: &Gpu, argmax_kernel: &Kernel, n_vocab: usize, max_ctx: usize) -> Result<LogitsState> {
        Ok(LogitsState {
            logits: alloc(gpu, n_vocab, "the logits")?,
            best_idx: alloc(gpu, 1, "argmax")?,
            best_val: alloc(gpu, 1, "argmax")?,
            argmax_scratch: argmax::alloc_scratch(argmax_kernel, 1, n_vocab)?,
            history: alloc(gpu, max_ctx + 1 + GREEDY_READ, "the greedy token history")?,
        })
    }

    /// Enqueues the argmax of `logits` (one row). A decode step passes its token and position
    /// buffers as `feed`: the argmax then becomes the next step's token there, the position
    /// advances, and the token goes to `history` (argmax.cuh's decode feed).
    pub fn enqueue_argmax(&mut self, argmax_kernel: &Kernel, feed: Option<(&mut CudaSlice<i32>, &mut CudaSlice<i32>)>) -> Result<()> {
        let n_vocab = self.logits.len();
        let feed = feed.map(|(token, pos)| argmax::DecodeFeed { token, pos, history: &mut self.history });
        argmax::argmax(
            argmax_kernel,
            &self.logits.slice(..),
            &mut self.best_idx.slice_mut(..),
            &mut self.best_val.slice_mut(..),
            &mut self.argmax_scratch.slice_mut(..),
            1,
            n_vocab,
            feed,
        )?;
        Ok(())
    }

    /// The logits on the host (waits for the forward).
    pub fn to_host(&self, gpu: &Gpu) -> Result<Vec<f32>> {
        gpu.stream().clone_dtoh(&self.logits).map_err(|e| err(format!("copying the logits to the host: {e:?}")))
    }

    /// The device argmax on the host (waits for the forward).
    pub fn argmax(&self, gpu: &Gpu) -> Result<u32> {
        let v = gpu.stream().clone_dtoh(&self.best_idx).map_err(|e| err(format!("copying the argmax to the host: {e:?}")))?;
        Ok(v[0].max(0) as u32)
    }
}

/// Copies `tokens` and their positions `pos0..` into the device buffers a forward reads them
/// from (a decode step's live outside its captured graph).
pub fn upload_tokens(gpu: &Gpu, tokens: &[u32], pos0: usize, ids: &mut CudaSlice<i32>, pos: &mut CudaSlice<i32>) -> Result<()> {
    let (what_ids, what_pos) = if tokens.len() == 1 { ("the token", "the position") } else { ("the prompt", "positions") };
    let ids_host: Vec<i32> = tokens.iter().map(|&v| v as i32).collect();
    let pos_host: Vec<i32> = (pos0..pos0 + tokens.len()).map(|p| p as i32).collect();
    let stream = gpu.stream();
    stream.memcpy_htod(&ids_host, ids).map_err(|e| err(format!("copying {what_ids} to the GPU: {e:?}")))?;
    stream.memcpy_htod(&pos_host, pos).map_err(|e| err(format!("copying {what_pos} to the GPU: {e:?}")))?;
    Ok(())
}

/// Greedy tokens the host reads at once in [`GpuModel::decode_greedy`] (a stop costs at most
/// twice this many steps run ahead and taken back).
pub const GREEDY_READ: usize = 4;

/// What every decoder stack (decoder.rs: GQA, mla.rs: MLA) holds besides its weights and
/// activations: the device, its cache `C`, the last logits, the filled positions and the load
/// report. [`DecoderStack`] builds `GpuModel` on it once for all stacks.
pub struct StackState<C> {
    pub gpu: Gpu,
    pub cache: C,
    pub out: LogitsState,
    /// Positions filled so far (the next token goes to `len`).
    pub len: usize,
    /// Cache capacity in positions.
    pub max_ctx: usize,
    pub n_ctx_train: usize,
    pub n_vocab: usize,
    /// Bytes of weights on the device.
    pub weight_bytes: usize,
    pub report: Vec<String>,
}

/// What differs between the decoder stacks: their step and chunk enqueues. `GpuModel` is
/// implemented once for all of them on top of [`StackState`].
pub trait DecoderStack {
    type Cache;
    /// Prompt tokens per prefill pass (bounds the activation buffers).
    const PREFILL_CHUNK: usize;
    fn state(&self) -> &StackState<Self::Cache>;
    fn state_mut(&mut self) -> &mut StackState<Self::Cache>;
    /// Enqueues one decode step at position `state().len` (the caller advances `len`): on
    /// `token`, or with `None` on the token and position the previous step's argmax fed it on the
    /// device ([`LogitsState::enqueue_argmax`]).
    fn decode_step(&mut self, token: Option<u32>) -> Result<()>;
    /// Enqueues up to `PREFILL_CHUNK` tokens at positions `state().len..` (the caller advances
    /// `len`).
    fn prefill_chunk(&mut self, tokens: &[u32]) -> Result<()>;
}

impl<S: DecoderStack> GpuModel for S {
    fn forward(&mut self, tokens: &[u32]) -> Result<()> {
        let s = self.state();
        check_tokens(tokens, s.n_vocab, s.len, s.max_ctx, s.n_ctx_train)?;
        if tokens.len() == 1 {
            self.decode_step(Some(tokens[0]))?;
            self.state_mut().len += 1;
            return Ok(());
        }
        for chunk in tokens.chunks(S::PREFILL_CHUNK) {
            self.prefill_chunk(chunk)?;
            self.state_mut().len += chunk.len();
        }
        Ok(())
    }

    /// Steps run ahead of the host: step j + 1 takes its token from step j's argmax on the
    /// device, so the GPU is not idle while the host reads a token and launches the next step.
    /// The host reads the tokens from `history`, [`GREEDY_READ`] at a time, and keeps up to
    /// twice that many steps enqueued beyond the last token it handed over; steps past a stop
    /// are then taken back (`len` reset: their cache rows are rewritten by later steps).
    fn decode_greedy(&mut self, first: u32, n: usize, on_token: &mut dyn FnMut(u32) -> bool) -> Result<usize> {
        let s = self.state();
        check_tokens(&[first], s.n_vocab, s.len, s.max_ctx, s.n_ctx_train)?;
        check_room(s.len, n, "decode steps", s.max_ctx, s.n_ctx_train)?;
        if n == 0 {
            return Ok(0);
        }
        let (start, stream) = (s.len, s.gpu.stream().clone());
        // Two slots, each a pinned buffer and the event recorded after the copy into it (the
        // context tracks no events of its own: Gpu::new disables that).
        let slot = || -> Result<(PinnedHostSlice<i32>, CudaEvent)> {
            let driver = |what: &str, e: DriverError| err(format!("{what} for the greedy tokens: {e:?}"));
            // SAFETY: read only after its event says the copy into it completed.
            let buf = unsafe { stream.context().alloc_pinned::<i32>(GREEDY_READ) }.map_err(|e| driver("allocating pinned memory", e))?;
            let event = stream.context().new_event(None).map_err(|e| driver("creating an event", e))?;
            Ok((buf, event))
        };
        let mut slots = [slot()?, slot()?];
        // Read r copies the tokens of steps r * GREEDY_READ.. (a whole slot, fewer at n) into
        // slot r % 2: every read but the last is whole, so a read starts at a multiple of
        // GREEDY_READ and its slot follows from that step.
        let slot_of = |step: usize| step / GREEDY_READ % 2;
        let (mut enqueued, mut read_to, mut handed) = (0usize, 0usize, 0usize);
        // On an error too, `len` ends at the tokens handed over (the steps after them are undone).
        let mut run = || -> Result<()> {
            loop {
                while enqueued < n && enqueued < handed + 2 * GREEDY_READ {
                    self.decode_step((enqueued == 0).then_some(first))?;
                    self.state_mut().len += 1;
                    enqueued += 1;
                    if enqueued - read_to == GREEDY_READ || enqueued == n {
                        // Steps read_to..enqueued wrote their tokens at positions start + 1 + step;
                        // a whole slot is copied (the history has GREEDY_READ spare entries).
                        let at = start + 1 + read_to;
                        let src = self.state().out.history.slice(at..at + GREEDY_READ);
                        let (buf, event) = &mut slots[slot_of(read_to)];
                        stream.memcpy_dtoh(&src, buf).map_err(|e| err(format!("copying greedy tokens to the host: {e:?}")))?;
                        event.record(&stream).map_err(|e| err(format!("recording the greedy tokens' copy: {e:?}")))?;
                        read_to = enqueued;
                    }
                }
                // The oldest read not handed over starts at `handed` (the reads before it were
                // whole and handed over whole), and it is enqueued: the loop above ran to n or
                // to a whole read past it.
                debug_assert!(handed.is_multiple_of(GREEDY_READ) && handed < read_to, "a read is enqueued for every step enqueued");
                let count = GREEDY_READ.min(n - handed);
                let (buf, event) = &slots[slot_of(handed)];
                event.synchronize().map_err(|e| err(format!("waiting for greedy tokens: {e:?}")))?;
                let tokens = buf.as_slice().map_err(|e| err(format!("reading greedy tokens: {e:?}")))?;
                let mut stop = false;
                for &t in &tokens[..count] {
                    handed += 1;
                    if !on_token(t.max(0) as u32) {
                        stop = true;
                        break;
                    }
                }
                if stop || handed == n {
                    return Ok(());
                }
            }
        };
        let outcome = run();
        self.state_mut().len = start + handed;
        outcome.map(|()| handed)
    }

    fn logits(&self) -> Result<Vec<f32>> {
        let s = self.state();
        s.out.to_host(&s.gpu)
    }

    fn argmax(&self) -> Result<u32> {
        let s = self.state();
        s.out.argmax(&s.gpu)
    }

    fn sync(&self) -> Result<()> {
        Ok(self.state().gpu.sync()?)
    }

    fn len(&self) -> usize {
        self.state().len
    }

    fn max_ctx(&self) -> usize {
        self.state().max_ctx
    }

    fn n_vocab(&self) -> usize {
        self.state().n_vocab
    }

    fn weight_bytes(&self) -> usize {
        self.state().weight_bytes
    }

    fn reset(&mut self) {
        self.state_mut().len = 0;
    }

    fn report(&self) -> &[String] {
        &self.state().report
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(feature = "model-glm-dsa")]
    use crate::kernels::moe_matvec;

    #[cfg(feature = "model-glm-dsa")]
    fn req<'a>(k: i64, n: i64, q: &'static str, mode: &'static str) -> Vec<(&'a str, Param)> {
        vec![("k", Param::Int(k)), ("n", Param::Int(n)), ("qtype", Param::Sym(q)), ("mode", Param::Sym(mode))]
    }

    /// glm-dsa's spec puts its routed experts on the integer path (`xq8 = 1`): at GLM-5's dims the
    /// plan hands out that variant flagged as reading q8 x (the forward quantizes for it), a call
    /// site that passes f32 x refuses it by name, and quantize_q8 joins the plan.
    #[cfg(feature = "model-glm-dsa")]
    #[test]
    fn a_q8_x_product_is_flagged_refused_for_f32_callers_and_brings_quantize_q8() {
        let mut plan = KernelPlan::new(Policy::Best);
        assert_eq!(plan.quantizer().unwrap(), None, "an empty plan needs no quantize_q8");
        let p = plan.product(moe_matvec::FAMILY, &req(6144, 2048, "q4_k", "swiglu")).unwrap();
        assert!(p.q8_x && p.name.contains("xq81"), "{p:?}");
        let e = plan.want_f32_x(moe_matvec::FAMILY, &req(6144, 2048, "q4_k", "swiglu")).unwrap_err().to_string();
        assert!(e.contains(p.name) && e.contains("f32"), "{e}");
        assert_eq!(plan.quantizer().unwrap(), Some("quantize_q8__generic"));
        // Its generic twin under --generic reads q8 rows too.
        let mut generic = KernelPlan::new(Policy::GenericOnly);
        let g = generic.product(moe_matvec::FAMILY, &req(6144, 2048, "q4_k", "swiglu")).unwrap();
        assert!(g.q8_x && g.name.starts_with("moe_matvec__generic__"), "{g:?}");
    }

    /// glm-dsa's largest decode projections take the integer path in the types listed by their
    /// entry's `xq8_types` (codegen's tests plan them); in the preset's Q8_0 they keep f32 x, and
    /// a call site that projects f32 x ([`KernelPlan::projection`]) gets them.
    #[cfg(feature = "model-glm-dsa")]
    #[test]
    fn glm5_q8_0_projections_keep_f32_x() {
        let mut plan = KernelPlan::new(Policy::Best);
        let req = [("k", Param::Int(16384)), ("n", Param::Int(6144)), ("qtype", Param::Sym("q8_0"))];
        let p = plan.product(matvec::FAMILY, &req).unwrap();
        assert!(!p.q8_x && p.name == "matvec__k16384_n6144__q8_0", "{p:?}");
        let (mv, _) = plan.projection("blk.3.attn_output.weight", GgmlType::Q8_0, 16384, 6144).unwrap();
        assert_eq!(mv, p.name);
    }

    /// Dims no spec bakes: among the generic fits (f32 x and the spec-made xq8 = 1 twins) the
    /// f32 default wins, so a forward without a quantize step still gets a variant it can feed.
    #[cfg(feature = "model-glm-dsa")]
    #[test]
    fn unbaked_dims_take_the_f32_generic_default() {
        let mut plan = KernelPlan::new(Policy::Best);
        for (k, n, mode) in [(512, 128, "down"), (128, 512, "swiglu")] {
            let p = plan.product(moe_matvec::FAMILY, &req(k, n, "q4_k", mode)).unwrap();
            assert!(!p.q8_x, "{p:?}");
            assert_eq!(p.name, format!("moe_matvec__generic__q4_k_{mode}"));
        }
        assert_eq!(plan.quantizer().unwrap(), None);
    }

    /// fuse_x (matvec XQ8 = 2 as a tuning) and norm_matvec's XQ8 quantize inside the kernel: f32 x.
    #[test]
    fn in_kernel_quantization_reads_f32_x() {
        for v in registry::variants() {
            let t = matvec::tuning_of(v);
            let in_kernel = v.family == norm_matvec::FAMILY || t.as_ref().is_ok_and(|t| t.fuse_x);
            if in_kernel {
                assert!(!reads_q8_rows(v.name), "{}", v.name);
            }
        }
    }
}
