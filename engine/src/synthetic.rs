//! Synthetic weights: a model of a spec preset's real shapes and GGUF types with random but
//! valid quantized blocks generated directly on the GPU, no file (`memra bench --synthetic
//! glm-5`). GLM-5 at Q4_K experts is ≈ 420 GB; this builds its first N layers in seconds.
//!
//! The description is the spec's tensor table evaluated at the preset's dims with
//! `block_count = N` and no nextn layer (memra-codegen `dims`), so names, shapes, types and
//! layer ranges (dense layers first, then MoE) are exactly what a real GGUF of the preset holds.
//! The forwards read tensor handles from a GGUF, so the description is written as a header-only
//! GGUF (metadata + tensor table) into a sparse temporary file of the full size (no data
//! blocks are ever written or read) and the data comes from [`SyntheticWeights`].
//!
//! Generation (on the GPU, three small NVRTC kernels compiled at first use): random bytes from a
//! counter-based hash (splitmix64 of seed ⊕ word index), then each block's f16 scale fields
//! set to a finite value chosen per format so that elements have a standard deviation of about
//! 1/√k (k = row length): activations stay finite through any number of layers. Every bit
//! pattern of the other fields is a valid encoding. Norm weights are ≈ 1, biases ≈ 0.
//! [`host_blocks`] reproduces the device bytes exactly (tests dequantize them with memra-gguf).

use std::cell::{Cell, OnceCell};
use std::path::PathBuf;

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
use memra_codegen::dims::{self, ModelDims};
use memra_codegen::fixture::{self, Fill};
use memra_codegen::spec::{ArchSpec, Value};
use memra_gguf::{GgmlType, GgufFile, TensorInfo};

use crate::cuda::Gpu;
use crate::models::gpu::{err, mib, DeviceTensor, GpuModelError, Result, WeightSource};
use crate::parallel::shard::{SliceSource, Window};

/// (preset, architecture, spec text) of the presets `--synthetic` knows.
pub const PRESETS: &[(&str, &str, &str)] =
    &[("glm-5", "glm-dsa", include_str!("../../specs/glm-dsa.toml"))];

/// A synthetic model: the spec, the preset's dims cut to `n_layer` layers, and its tensors.
pub struct Description {
    pub preset: String,
    pub spec: ArchSpec,
    pub dims: ModelDims,
    pub n_layer: usize,
    /// The preset's full layer count (without the nextn layers).
    pub full_layers: usize,
}

/// The first `layers` layers of `preset` (e.g. `glm-5`). Errors name the preset or the problem.
pub fn describe(preset: &str, layers: usize) -> std::result::Result<Description, String> {
    let Some(&(_, arch, text)) = PRESETS.iter().find(|(p, _, _)| *p == preset) else {
        let known: Vec<&str> = PRESETS.iter().map(|(p, _, _)| *p).collect();
        return Err(format!(
            "unknown synthetic preset '{preset}' (known: {})",
            known.join(", ")
        ));
    };
    let path = PathBuf::from(format!("specs/{arch}.toml"));
    let spec = ArchSpec::parse(&path, text).map_err(|e| e.to_string())?;
    let full = dims::from_preset(&spec, Some(preset)).map_err(|e| e.to_string())?;
    let full_layers = full
        .int("n_layer")
        .ok_or_else(|| format!("{preset}: no n_layer"))? as usize;
    if layers == 0 || layers > full_layers {
        return Err(format!(
            "--layers {layers}: {preset} has 1..={full_layers} layers"
        ));
    }
    let mut overrides = vec![
        ("block_count", Value::Int(layers as i64)),
        ("nextn_predict_layers", Value::Int(0)),
    ];
    // Fewer layers than the leading dense ones: all of them dense (the first N layers).
    if full
        .int("leading_dense_block_count")
        .is_some_and(|d| layers < d as usize)
    {
        overrides.push(("leading_dense_block_count", Value::Int(layers as i64)));
    }
    let dims =
        dims::from_preset_with(&spec, Some(preset), &overrides).map_err(|e| e.to_string())?;
    Ok(Description {
        preset: preset.to_string(),
        spec,
        dims,
        n_layer: layers,
        full_layers,
    })
}

fn tensor_bytes(ty: GgmlType, shape: &[u64]) -> u64 {
    let rows: u64 = shape[1..].iter().product();
    ty.row_bytes(shape[0]).unwrap_or(0) * rows
}

impl Description {
    pub fn arch(&self) -> &str {
        &self.spec.arch
    }

    /// What one rank of `n_ranks` GPUs holds (`memra_codegen::shard::rank_dims`: split tensors
    /// as the rank's windows, heads and FFN widths divided); its byte counts are one GPU's.
    pub fn rank(&self, n_ranks: usize) -> std::result::Result<Description, String> {
        let dims = memra_codegen::shard::rank_dims(&self.spec, &self.dims, n_ranks)?;
        Ok(Description { dims, preset: self.preset.clone(), spec: self.spec.clone(), ..*self })
    }

    /// Bytes of every tensor of layer `il` (`None`: the global tensors).
    pub fn layer_bytes(&self, il: Option<usize>) -> u64 {
        self.dims
            .tensors
            .iter()
            .filter(|t| t.layer == il)
            .map(|t| tensor_bytes(t.ggml_type, &t.shape))
            .sum()
    }

    pub fn total_bytes(&self) -> u64 {
        self.dims
            .tensors
            .iter()
            .map(|t| tensor_bytes(t.ggml_type, &t.shape))
            .sum()
    }

    /// Weight bytes one decode step of layer `il` must read: every tensor except routed experts,
    /// of which only `n_expert_used` of `n_expert` are read.
    pub fn decode_weight_bytes(&self, il: usize) -> u64 {
        let (used, all) = (
            self.dims.int("n_expert_used").unwrap_or(1),
            self.dims.int("n_expert").unwrap_or(1),
        );
        self.dims
            .tensors
            .iter()
            .filter(|t| t.layer == Some(il))
            .map(|t| {
                let b = tensor_bytes(t.ggml_type, &t.shape);
                if t.name.contains("_exps.") {
                    b / all as u64 * used as u64
                } else {
                    b
                }
            })
            .sum()
    }

    /// Global weight bytes of a decode step: one embedding row, the output norm and the LM head.
    pub fn decode_global_bytes(&self) -> u64 {
        self.dims
            .tensors
            .iter()
            .filter(|t| t.layer.is_none())
            .map(|t| {
                if t.name == "token_embd.weight" {
                    t.ggml_type.row_bytes(t.shape[0]).unwrap_or(0)
                } else {
                    tensor_bytes(t.ggml_type, &t.shape)
                }
            })
            .sum()
    }

    /// Cache bytes layer `il`'s decode step reads at `ctx` cached positions: the bf16 latent rows
    /// (all of them while ≤ top_k are visible, else the top_k selected), and on indexer layers
    /// past top_k the f32 index keys of every position plus the scores written and read.
    pub fn decode_cache_bytes(&self, il: usize, ctx: usize) -> u64 {
        let int = |n: &str| self.dims.int(n).unwrap_or(0) as u64;
        let row = 2 * (int("kv_lora_rank") + int("n_rot"));
        let visible = ctx as u64 + 1;
        let has_indexer = self
            .dims
            .tensors
            .iter()
            .any(|t| t.layer == Some(il) && t.name.contains(".indexer."));
        let top_k = int("indexer_top_k");
        if has_indexer && top_k > 0 && visible > top_k {
            top_k * row + visible * (4 * int("indexer_head_dim") + 2 * 4)
        } else {
            visible * row
        }
    }

    /// The header-only GGUF: metadata as a real file of the preset has it, the tensor table,
    /// alignment 1, and the data section's length (never written).
    pub fn header(&self) -> std::result::Result<(Vec<u8>, u64), String> {
        let mut meta_only = self.dims.clone();
        meta_only.tensors.clear();
        let w = fixture::writer_for(&self.spec, &meta_only, Fill::Zeros)?.with_alignment(1);
        let mut out = w.to_bytes().map_err(|e| e.to_string())?;
        out[8..16].copy_from_slice(&(self.dims.tensors.len() as u64).to_le_bytes());
        let mut offset = 0u64;
        for t in &self.dims.tensors {
            out.extend_from_slice(&(t.name.len() as u64).to_le_bytes());
            out.extend_from_slice(t.name.as_bytes());
            out.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            for d in &t.shape {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.id().to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offset += tensor_bytes(t.ggml_type, &t.shape);
        }
        Ok((out, offset))
    }

    /// The header as a GGUF file: a sparse temporary file of the full size (only the header's
    /// blocks exist on disk), opened and unlinked.
    pub fn open(&self) -> std::result::Result<GgufFile, String> {
        // One name per call: threads of one process (parallel tests) open their own copies.
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let (header, data) = self.header()?;
        let path = std::env::temp_dir().join(format!(
            "memra-synthetic-{}-{}-{}.gguf",
            self.preset,
            std::process::id(),
            SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let write = || -> std::io::Result<()> {
            let f = std::fs::File::create(&path)?;
            std::io::Write::write_all(&mut &f, &header)?;
            f.set_len(header.len() as u64 + data)
        };
        write().map_err(|e| format!("{}: writing the synthetic header: {e}", path.display()))?;
        let file = GgufFile::open(&path).map_err(|e| e.to_string());
        let _ = std::fs::remove_file(&path);
        file
    }
}

// ---------------------------------------------------------------------------------------------
// Block formats.

/// Where a block's f16 scale fields are and what they are set to, for elements of standard
/// deviation `sigma`: (byte offset, value) per field. `None`: a type the generator cannot fill.
pub fn scale_fields(ty: GgmlType, sigma: f32) -> Option<Vec<(u32, f32)>> {
    use GgmlType::*;
    // Divisors: the RMS of the integer part (e.g. Q8_0 bytes ±128 → ≈ 74; Q4_K 6-bit sub-scale
    // ≈ 36 × 4-bit quant about its mean ≈ 4.6); the minima centre the unsigned quants.
    Some(match ty {
        Q8_0 => vec![(0, sigma / 74.0)],
        Q4_0 => vec![(0, sigma / 4.6)],
        Q5_0 => vec![(0, sigma / 9.2)],
        Q4_1 => vec![(0, sigma / 4.6), (2, -7.5 * sigma / 4.6)],
        Q5_1 => vec![(0, sigma / 9.2), (2, -15.5 * sigma / 9.2)],
        Q4_K => vec![(0, sigma / (36.0 * 4.6)), (2, 7.5 * sigma / (36.0 * 4.6))],
        Q5_K => vec![(0, sigma / (36.0 * 9.2)), (2, 15.5 * sigma / (36.0 * 9.2))],
        Q6_K => vec![(208, sigma / (74.0 * 18.5))],
        IQ4_NL => vec![(0, sigma / 60.0)],
        IQ4_XS => vec![(0, sigma / (60.0 * 18.5))],
        _ => return None,
    })
}

/// IEEE half bits of `v` (round to nearest, subnormals kept; |v| < 65504 here).
pub fn f16_bits(v: f32) -> u16 {
    let sign = ((v.to_bits() >> 16) & 0x8000) as u16;
    let a = v.abs();
    if a >= 65504.0 {
        return sign | 0x7bff;
    }
    if a < 6.103_515_6e-5 {
        return sign | (a / 5.960_464_5e-8).round() as u16;
    }
    let bits = a.to_bits();
    let exp = ((bits >> 23) as i32) - 127 + 15;
    let mant = bits & 0x7f_ffff;
    let mut h = ((exp as u32) << 10) | (mant >> 13);
    if mant & 0x1fff > 0x1000 || (mant & 0x1fff == 0x1000 && h & 1 == 1) {
        h += 1;
    }
    sign | h as u16
}

/// splitmix64 finalizer, as the kernel's `hash32`.
fn hash32(mut x: u64) -> u32 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (x ^ (x >> 31)) as u32
}

const WORD_MIX: u64 = 0xd1b5_4a32_d192_ed03;

/// The seed of one tensor: the model seed and the tensor name (FNV-1a).
pub fn tensor_seed(seed: u64, name: &str) -> u64 {
    seed ^ name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// The first `n_blocks` blocks of a tensor exactly as the GPU writes them (for tests).
pub fn host_blocks(ty: GgmlType, k: u64, seed: u64, n_blocks: usize) -> Option<Vec<u8>> {
    let fields = scale_fields(ty, 1.0 / (k as f32).sqrt())?;
    let bb = ty.type_size() as usize;
    let n = n_blocks * bb;
    let mut out: Vec<u8> = (0..n.div_ceil(4))
        .flat_map(|i| hash32(seed ^ (i as u64).wrapping_mul(WORD_MIX)).to_le_bytes())
        .collect();
    out.truncate(n);
    for b in 0..n_blocks {
        for &(off, v) in &fields {
            let at = b * bb + off as usize;
            out[at..at + 2].copy_from_slice(&f16_bits(v).to_le_bytes());
        }
    }
    Some(out)
}

/// The generator kernels (NVRTC source, no headers).
pub const KERNELS: &str = r#"
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
__device__ __forceinline__ u32 hash32(u64 x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return (u32)(x ^ (x >> 31));
}
// Random bytes; whole words as u32 stores (allocations are 256-byte aligned).
extern "C" __global__ void synth_bytes(unsigned char* out, u64 n, u64 seed) {
    u64 words = (n + 3) / 4;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < words; i += (u64)gridDim.x * blockDim.x) {
        u32 h = hash32(seed ^ (i * 0xd1b54a32d192ed03ULL));
        if (i * 4 + 4 <= n) ((u32*)out)[i] = h;
        else for (u64 b = i * 4; b < n; ++b) out[b] = (unsigned char)(h >> (8 * (b - i * 4)));
    }
}
// The bytes of a [rows × out_row_bytes] window of a tensor whose rows are full_row_bytes long,
// starting at byte src0 of it: exactly the bytes synth_bytes writes there (one shard's slice).
extern "C" __global__ void synth_bytes_slice(unsigned char* out, u64 rows, u64 out_row_bytes, u64 full_row_bytes,
                                             u64 src0, u64 seed) {
    u64 n = rows * out_row_bytes;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u64 src = src0 + (i / out_row_bytes) * full_row_bytes + i % out_row_bytes;
        u32 h = hash32(seed ^ ((src / 4) * 0xd1b54a32d192ed03ULL));
        out[i] = (unsigned char)(h >> (8 * (src % 4)));
    }
}
// Each block's f16 scale fields (byte offsets even, blocks of even size).
extern "C" __global__ void synth_scales(unsigned char* out, u64 n_blocks, u32 block_bytes, u32 n_fields,
                                        u32 off0, u32 bits0, u32 off1, u32 bits1) {
    for (u64 b = blockIdx.x * (u64)blockDim.x + threadIdx.x; b < n_blocks; b += (u64)gridDim.x * blockDim.x) {
        unsigned char* p = out + b * block_bytes;
        *(u16*)(p + off0) = (u16)bits0;
        if (n_fields > 1) *(u16*)(p + off1) = (u16)bits1;
    }
}
// Uniform values in [center - spread, center + spread): f32 (kind 0), bf16 (1) or f16 (2) bits.
extern "C" __global__ void synth_values(void* out, u64 n, u64 seed, float center, float spread, u32 kind) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        float u = (hash32(seed ^ (i * 0xd1b54a32d192ed03ULL)) >> 8) * (1.0f / 16777216.0f);
        float v = center + spread * (2.0f * u - 1.0f);
        if (kind == 0) ((float*)out)[i] = v;
        else if (kind == 1) ((u16*)out)[i] = (u16)(__float_as_uint(v) >> 16);
        else {
            u32 s = (__float_as_uint(v) >> 16) & 0x8000u;
            float a = fabsf(v);
            u32 h = a < 6.1035156e-5f ? (u32)rintf(a * 16777216.0f)
                                      : ((((__float_as_uint(a) >> 23) - 112u) << 10) | ((__float_as_uint(a) >> 13) & 0x3ffu));
            ((u16*)out)[i] = (u16)(s | h);
        }
    }
}
"#;

struct Fills {
    bytes: CudaFunction,
    bytes_slice: CudaFunction,
    scales: CudaFunction,
    values: CudaFunction,
}

fn launch_cfg(n: u64) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 8192) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn drv(what: &str) -> impl Fn(cudarc::driver::DriverError) -> GpuModelError + '_ {
    move |e| err(format!("synthetic weights: {what}: {e:?}"))
}

/// Random weights for a [`Description`]'s tensors, generated on the device on upload, with a
/// progress line on stderr.
pub struct SyntheticWeights {
    pub seed: u64,
    total: u64,
    done: Cell<u64>,
    last_layer: Cell<Option<usize>>,
    fills: OnceCell<Fills>,
}

impl SyntheticWeights {
    pub fn new(desc: &Description, seed: u64) -> SyntheticWeights {
        SyntheticWeights {
            seed,
            total: desc.total_bytes(),
            done: Cell::new(0),
            last_layer: Cell::new(None),
            fills: OnceCell::new(),
        }
    }

    fn fills(&self, gpu: &Gpu) -> Result<&Fills> {
        if let Some(f) = self.fills.get() {
            return Ok(f);
        }
        let [bytes, bytes_slice, scales, values]: [CudaFunction; 4] = gpu
            .load_functions(
                "memra_synthetic.cu",
                KERNELS,
                &["synth_bytes", "synth_bytes_slice", "synth_scales", "synth_values"],
            )?
            .try_into()
            .map_err(|_| err("synthetic weights: memra_synthetic.cu: expected 4 functions"))?;
        let f = Fills {
            bytes,
            bytes_slice,
            scales,
            values,
        };
        Ok(self.fills.get_or_init(|| f))
    }

    /// Uniform values `center ± spread` into `n` elements of `out` (f32, bf16 or f16 bits).
    fn values<T: cudarc::driver::DeviceRepr>(
        &self,
        gpu: &Gpu,
        out: &mut CudaSlice<T>,
        n: u64,
        seed: u64,
        center: f32,
        spread: f32,
        kind: u32,
    ) -> Result<()> {
        let f = self.fills(gpu)?;
        let mut b = gpu.stream().launch_builder(&f.values);
        b.arg(out)
            .arg(&n)
            .arg(&seed)
            .arg(&center)
            .arg(&spread)
            .arg(&kind);
        unsafe { b.launch(launch_cfg(n)) }.map_err(drv("synth_values"))?;
        Ok(())
    }

    /// Random bf16 latent rows and f32 index keys (≈ N(0, 1)-sized) for `MlaDecoder::assume_cached`.
    pub fn fill_cache(
        &self,
        gpu: &Gpu,
        il: usize,
        latent: &mut CudaSlice<u16>,
        keys: Option<&mut CudaSlice<f32>>,
    ) -> Result<()> {
        let seed = tensor_seed(self.seed, &format!("cache.{il}"));
        let n = latent.len() as u64;
        self.values(gpu, latent, n, seed, 0.0, 1.7, 1)?;
        if let Some(k) = keys {
            let n = k.len() as u64;
            self.values(gpu, k, n, seed ^ 1, 0.0, 1.7, 0)?;
        }
        Ok(())
    }

    /// Each block's f16 scale `fields` in `data` (whole blocks of `ty`).
    fn set_scales(
        &self,
        gpu: &Gpu,
        data: &mut CudaSlice<u8>,
        ty: GgmlType,
        fields: &[(u32, f32)],
    ) -> Result<()> {
        let f = self.fills(gpu)?;
        let n_blocks = data.len() as u64 / ty.type_size();
        let block_bytes = ty.type_size() as u32;
        let n_fields = fields.len() as u32;
        let (off0, bits0) = (fields[0].0, f16_bits(fields[0].1) as u32);
        let (off1, bits1) = fields
            .get(1)
            .map_or((0, 0), |&(o, v)| (o, f16_bits(v) as u32));
        let mut b = gpu.stream().launch_builder(&f.scales);
        b.arg(data)
            .arg(&n_blocks)
            .arg(&block_bytes)
            .arg(&n_fields)
            .arg(&off0)
            .arg(&bits0)
            .arg(&off1)
            .arg(&bits1);
        unsafe { b.launch(launch_cfg(n_blocks)) }.map_err(drv("synth_scales"))?;
        Ok(())
    }

    fn progress(&self, t: &TensorInfo<'_>) {
        self.done.set(self.done.get() + t.n_bytes);
        let layer = t
            .name
            .strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|s| s.parse().ok());
        if layer.is_some() && layer != self.last_layer.get() {
            self.last_layer.set(layer);
            eprintln!(
                "synthetic weights: layer {} ({} of {} generated)",
                layer.unwrap_or(0),
                mib(self.done.get() as usize),
                mib(self.total as usize)
            );
        }
    }
}

impl SliceSource for SyntheticWeights {
    /// The window `w` of the block-quantized tensor `t`: byte for byte the window of what
    /// [`WeightSource::upload`] generates for the whole tensor (a multi-GPU shard,
    /// `crate::parallel::shard`). Whole blocks only; the scales keep the whole row's 1/√k.
    fn upload_window(&self, gpu: &Gpu, t: &TensorInfo<'_>, w: Window) -> Result<DeviceTensor> {
        w.check(t)?;
        let Window { row0, rows, col0, cols } = w;
        let (ty, k) = (t.ggml_type, t.row_len());
        let what = || format!("synthetic tensor '{}' {w}", t.name);
        let fields = scale_fields(ty, 1.0 / (k as f32).sqrt())
            .ok_or_else(|| err(format!("{}: cannot generate slices of {} data", what(), ty.name())))?;
        let bs = ty.block_size() as usize;
        let block = |e: usize| (e / bs) as u64 * ty.type_size();
        let full_row = block(k as usize);
        let out_row = block(cols);
        let mut data = crate::models::gpu::alloc::<u8>(gpu, rows * out_row as usize, &what())?;
        let (rows64, src0) = (rows as u64, row0 as u64 * full_row + block(col0));
        let seed = tensor_seed(self.seed, t.name);
        let f = self.fills(gpu)?;
        let mut b = gpu.stream().launch_builder(&f.bytes_slice);
        b.arg(&mut data)
            .arg(&rows64)
            .arg(&out_row)
            .arg(&full_row)
            .arg(&src0)
            .arg(&seed);
        unsafe { b.launch(launch_cfg(rows64 * out_row)) }.map_err(drv("synth_bytes_slice"))?;
        self.set_scales(gpu, &mut data, ty, &fields)?;
        self.progress(t);
        Ok(DeviceTensor { name: t.name.to_string(), ty, k: cols, n: rows, data })
    }
}

/// Norm weights ≈ 1, biases ≈ 0 (the router's selection bias small), matrices ± √3/√k.
fn value_range(t: &TensorInfo<'_>) -> (f32, f32) {
    if t.name.ends_with("norm.weight") {
        (1.0, 0.1)
    } else if t.name.ends_with("exp_probs_b.bias") {
        (0.0, 0.01)
    } else if t.name.ends_with(".bias") {
        (0.0, 0.1)
    } else {
        (0.0, 3f32.sqrt() / (t.row_len() as f32).sqrt())
    }
}

impl WeightSource for SyntheticWeights {
    fn upload(&self, gpu: &Gpu, t: &TensorInfo<'_>) -> Result<DeviceTensor> {
        let n = t.n_bytes;
        let mut data = crate::models::gpu::alloc::<u8>(
            gpu,
            n as usize,
            &format!("synthetic tensor '{}'", t.name),
        )?;
        let seed = tensor_seed(self.seed, t.name);
        let kind = match t.ggml_type {
            GgmlType::F32 => Some(0),
            GgmlType::BF16 => Some(1),
            GgmlType::F16 => Some(2),
            _ => None,
        };
        if let Some(kind) = kind {
            let (c, s) = value_range(t);
            self.values(gpu, &mut data, t.n_elements(), seed, c, s, kind)?;
        } else {
            let fields =
                scale_fields(t.ggml_type, 1.0 / (t.row_len() as f32).sqrt()).ok_or_else(|| {
                    err(format!(
                        "synthetic tensor '{}': cannot generate {} blocks",
                        t.name,
                        t.ggml_type.name()
                    ))
                })?;
            let f = self.fills(gpu)?;
            let mut b = gpu.stream().launch_builder(&f.bytes);
            b.arg(&mut data).arg(&n).arg(&seed);
            unsafe { b.launch(launch_cfg(n.div_ceil(4))) }.map_err(drv("synth_bytes"))?;
            self.set_scales(gpu, &mut data, t.ggml_type, &fields)?;
        }
        self.progress(t);
        Ok(DeviceTensor {
            name: t.name.to_string(),
            ty: t.ggml_type,
            k: t.row_len() as usize,
            n: t.n_rows() as usize,
            data,
        })
    }

    fn upload_f32(&self, gpu: &Gpu, t: &TensorInfo<'_>) -> Result<CudaSlice<f32>> {
        let n = t.n_elements();
        let mut buf = crate::models::gpu::alloc::<f32>(
            gpu,
            n as usize,
            &format!("synthetic tensor '{}'", t.name),
        )?;
        let (c, s) = value_range(t);
        self.values(gpu, &mut buf, n, tensor_seed(self.seed, t.name), c, s, 0)?;
        self.progress(t);
        Ok(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memra_gguf::quant;

    const Q8: GgmlType = GgmlType::Q8_0;
    const Q4K: GgmlType = GgmlType::Q4_K;
    const F32: GgmlType = GgmlType::F32;

    /// The spec's tensor table for GLM-5 restated by hand (names verbatim, ne order, preset types).
    fn expected_layer(il: usize) -> Vec<(String, Vec<u64>, GgmlType)> {
        let mut v: Vec<(&str, Vec<u64>, GgmlType)> = vec![
            ("attn_norm.weight", vec![6144], F32),
            ("attn_q_a.weight", vec![6144, 2048], Q8),
            ("attn_q_a_norm.weight", vec![2048], F32),
            ("attn_q_b.weight", vec![2048, 64 * 256], Q8),
            ("attn_kv_a_mqa.weight", vec![6144, 576], Q8),
            ("attn_kv_a_norm.weight", vec![512], F32),
            ("attn_k_b.weight", vec![192, 512, 64], Q8),
            ("attn_v_b.weight", vec![512, 256, 64], Q8),
            ("attn_output.weight", vec![64 * 256, 6144], Q8),
            ("indexer.attn_q_b.weight", vec![2048, 32 * 128], Q8),
            ("indexer.attn_k.weight", vec![6144, 128], Q8),
            ("indexer.k_norm.weight", vec![128], F32),
            ("indexer.k_norm.bias", vec![128], F32),
            ("indexer.proj.weight", vec![6144, 32], Q8),
            ("ffn_norm.weight", vec![6144], F32),
        ];
        if il < 3 {
            v.push(("ffn_gate.weight", vec![6144, 12288], Q8));
            v.push(("ffn_up.weight", vec![6144, 12288], Q8));
            v.push(("ffn_down.weight", vec![12288, 6144], Q8));
        } else {
            v.push(("ffn_gate_inp.weight", vec![6144, 256], F32));
            v.push(("exp_probs_b.bias", vec![256], F32));
            v.push(("ffn_gate_exps.weight", vec![6144, 2048, 256], Q4K));
            v.push(("ffn_up_exps.weight", vec![6144, 2048, 256], Q4K));
            v.push(("ffn_down_exps.weight", vec![2048, 6144, 256], Q4K));
            v.push(("ffn_gate_shexp.weight", vec![6144, 2048], Q8));
            v.push(("ffn_up_shexp.weight", vec![6144, 2048], Q8));
            v.push(("ffn_down_shexp.weight", vec![2048, 6144], Q8));
        }
        v.into_iter()
            .map(|(n, s, t)| (format!("blk.{il}.{n}"), s, t))
            .collect()
    }

    fn sorted(mut v: Vec<(String, Vec<u64>, GgmlType)>) -> Vec<(String, Vec<u64>, GgmlType)> {
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    #[test]
    fn glm5_description_is_the_spec_table_at_preset_dims() {
        let d = describe("glm-5", 5).unwrap();
        assert_eq!((d.arch(), d.n_layer, d.full_layers), ("glm-dsa", 5, 78));
        let got: Vec<_> = d
            .dims
            .tensors
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone(), t.ggml_type))
            .collect();
        let mut want = vec![
            ("token_embd.weight".to_string(), vec![6144, 154880], Q8),
            ("output_norm.weight".to_string(), vec![6144], F32),
            ("output.weight".to_string(), vec![6144, 154880], Q8),
        ];
        for il in 0..5 {
            want.extend(expected_layer(il));
        }
        assert_eq!(sorted(got), sorted(want));
        for t in &d.dims.tensors {
            let layer = t
                .name
                .strip_prefix("blk.")
                .map(|r| r.split('.').next().unwrap().parse::<usize>().unwrap());
            assert_eq!(t.layer, layer, "{}", t.name);
        }
    }

    #[test]
    fn layer_and_model_sizes() {
        let d = describe("glm-5", 4).unwrap();
        let q8 = |k: u64, rows: u64| k / 32 * 34 * rows;
        let q4k = |k: u64, rows: u64| k / 256 * 144 * rows;
        let attn = 4 * (6144 + 2048 + 512 + 128 + 128 + 6144)
            + q8(6144, 2048)
            + q8(2048, 16384)
            + q8(6144, 576)
            + q8(192, 512 * 64)
            + q8(512, 256 * 64)
            + q8(16384, 6144)
            + q8(2048, 4096)
            + q8(6144, 128)
            + q8(6144, 32);
        let dense = 2 * q8(6144, 12288) + q8(12288, 6144);
        let experts = 2 * q4k(6144, 2048 * 256) + q4k(2048, 6144 * 256);
        let moe = 4 * (6144 * 256 + 256) + experts + 2 * q8(6144, 2048) + q8(2048, 6144);
        assert_eq!(d.layer_bytes(Some(0)), attn + dense);
        assert_eq!(d.layer_bytes(Some(3)), attn + moe);
        assert_eq!(d.layer_bytes(None), 2 * q8(6144, 154880) + 4 * 6144);
        assert_eq!(
            d.decode_weight_bytes(3),
            attn + moe - experts + experts / 256 * 8
        );
        assert_eq!(
            d.decode_global_bytes(),
            q8(6144, 1) + q8(6144, 154880) + 4 * 6144
        );
        // Cache: all latent rows up to top_k visible, then top_k rows + f32 keys + scores.
        assert_eq!(d.decode_cache_bytes(3, 1000), 1001 * 1152);
        assert_eq!(
            d.decode_cache_bytes(3, 32768),
            2048 * 1152 + 32769 * (512 + 8)
        );
        let full = describe("glm-5", 78).unwrap();
        let gb = full.total_bytes() as f64 / 1e9;
        println!(
            "GLM-5 78 layers: {gb:.1} GB, layer 3 {:.2} GB",
            d.layer_bytes(Some(3)) as f64 / 1e9
        );
        assert!((380.0..460.0).contains(&gb), "{gb} GB, expected about 420");
    }

    #[test]
    fn fewer_layers_than_the_dense_ones_are_all_dense() {
        for n in 1..=3 {
            let d = describe("glm-5", n).unwrap();
            let mut want = vec![];
            for il in 0..n {
                want.extend(expected_layer(il));
            }
            let got: Vec<_> = d
                .dims
                .tensors
                .iter()
                .filter(|t| t.layer.is_some())
                .map(|t| (t.name.clone(), t.shape.clone(), t.ggml_type))
                .collect();
            assert_eq!(sorted(got), sorted(want), "{n} layers");
            let file = d.open().unwrap();
            memra_reference::models::MlaModelHparams::from_gguf(&file)
                .unwrap_or_else(|e| panic!("{n} layers: {e}"));
        }
    }

    #[test]
    fn bad_presets_and_layer_counts_are_refused() {
        assert!(describe("glm-6", 2)
            .err()
            .unwrap()
            .contains("unknown synthetic preset 'glm-6' (known: glm-5)"));
        assert!(describe("glm-5", 0)
            .err()
            .unwrap()
            .contains("--layers 0: glm-5 has 1..=78 layers"));
        assert!(describe("glm-5", 79).is_err());
    }

    #[test]
    fn header_only_gguf_loads_as_the_spec_structs() {
        use crate::models::spec::glm_dsa::{GlmDsaHparams, GlmDsaWeights};
        let d = describe("glm-5", 4).unwrap();
        let (header, data) = d.header().unwrap();
        assert_eq!(data, d.total_bytes());
        assert!(header.len() < 64 << 10, "{}", header.len());
        let file = d.open().unwrap();
        assert_eq!(file.bytes().len() as u64, header.len() as u64 + data);
        let hp = GlmDsaHparams::from_gguf(&file).unwrap_or_else(|e| panic!("{e}"));
        let w = GlmDsaWeights::from_gguf(&file, &hp).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(w.layers.len(), 4);
        assert_eq!(w.layers[3].ffn_gate_exps.map(|t| t.ggml_type), Some(Q4K));
        memra_reference::models::MlaModelHparams::from_gguf(&file).unwrap_or_else(|e| panic!("{e}"));
        for t in file.tensors().iter() {
            let want = d.dims.tensor(t.name).unwrap();
            assert_eq!(
                (t.dims.as_slice(), t.ggml_type),
                (&want.shape[..], want.ggml_type)
            );
        }
    }

    #[test]
    fn f16_bits_round_to_nearest() {
        for (v, bits) in [
            (1.0f32, 0x3c00u16),
            (-2.0, 0xc000),
            (0.1, 0x2e66),
            (65504.0, 0x7bff),
            (5.960_464_5e-8, 1),
            (6.103_515_6e-5, 0x0400),
            (1e-9, 0),
        ] {
            assert_eq!(f16_bits(v), bits, "{v}");
        }
    }

    /// The generated blocks decode (memra-gguf) to finite elements with a standard deviation
    /// near 1/√k, for every type the generator supports.
    #[test]
    fn host_blocks_dequantize_to_finite_values_of_the_intended_scale() {
        let rng = memra_reference::Rng::from_env_or_time("synthetic host_blocks");
        let seed = rng.seed();
        use GgmlType::*;
        for ty in [
            Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS,
        ] {
            let k = 2048u64;
            let n_blocks = (k / ty.block_size()) as usize * 16;
            let bytes = host_blocks(ty, k, seed, n_blocks).unwrap();
            let vals = quant::dequantize(ty, &bytes, n_blocks * ty.block_size() as usize).unwrap();
            assert!(vals.iter().all(|v| v.is_finite()), "{ty} seed {seed}");
            let n = vals.len() as f64;
            let mean = vals.iter().map(|&v| v as f64).sum::<f64>() / n;
            let sd = (vals.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
            let sigma = 1.0 / (k as f64).sqrt();
            assert!(
                (0.3 * sigma..3.0 * sigma).contains(&sd),
                "{ty}: sd {sd:e} vs 1/sqrt(k) {sigma:e}, seed {seed}"
            );
            assert!(mean.abs() < sigma, "{ty}: mean {mean:e}, seed {seed}");
        }
        assert!(host_blocks(GgmlType::Q2_K, 256, seed, 1).is_none());
    }
}
