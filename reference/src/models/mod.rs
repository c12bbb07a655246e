//! Whole-model CPU reference forward passes, built from this crate's ops with every weight
//! dequantized to f32 once at load. They are the oracles for the GPU forwards and the `--cpu`
//! path of `memra run`.
//!
//! Unlike the ops, loading reads untrusted files: a missing key or tensor, a wrong shape or an
//! unsupported type is a [`ModelError`] naming the file and the key or tensor, never a panic.

pub mod common;
pub mod gemma3;
pub mod mla_model;
pub mod olmoe;
pub mod qwen3;

use std::fmt;
use std::path::{Path, PathBuf};

use memra_gguf::{GgmlType, Gguf, GgufFile, TensorInfo};

pub use common::{KvCache, MoeHparams, Yarn};
pub use gemma3::{Gemma3, Gemma3Cache, Gemma3Hparams};
pub use mla_model::{
    DsaSelections, IndexerHparams, MlaArch, MlaModel, MlaModelCache, MlaModelHparams, MLA_ARCHS,
};
pub use olmoe::{Olmoe, OlmoeCache, OlmoeHparams};
pub use qwen3::{Qwen3, Qwen3Cache, Qwen3Hparams};

/// Any supported architecture, chosen by `general.architecture`: the GQA architectures with a
/// forward file here, and every architecture whose spec has MLA attention ([`MLA_ARCHS`],
/// generated from `specs/*.toml`: no code per MLA architecture).
pub enum CpuModel {
    Gemma3(Gemma3),
    Qwen3(Qwen3),
    Olmoe(Olmoe),
    /// glm-dsa, deepseek2, ...
    Mla(MlaModel),
}

/// The cache of a [`CpuModel`].
pub enum CpuCache {
    /// gemma3, qwen3, olmoe.
    Kv(KvCache),
    Mla(MlaModelCache),
}

impl CpuCache {
    /// Positions stored so far.
    pub fn len(&self) -> usize {
        match self {
            CpuCache::Kv(c) => c.len(),
            CpuCache::Mla(c) => c.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The architectures with a hand-written CPU forward in this module.
const GQA_ARCHS: [&str; 3] = ["gemma3", "qwen3", "olmoe"];

/// Architectures [`CpuModel`] loads (GGUF `general.architecture` values): [`GQA_ARCHS`] then
/// the [`MLA_ARCHS`] names.
pub const CPU_ARCHS: &[&str] = &cpu_archs::<{ GQA_ARCHS.len() + MLA_ARCHS.len() }>();

const fn cpu_archs<const N: usize>() -> [&'static str; N] {
    let mut out = [""; N];
    let mut i = 0;
    while i < GQA_ARCHS.len() {
        out[i] = GQA_ARCHS[i];
        i += 1;
    }
    let mut j = 0;
    while j < MLA_ARCHS.len() {
        out[i + j] = MLA_ARCHS[j].name;
        j += 1;
    }
    out
}

impl CpuModel {
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        Self::from_gguf(&GgufFile::open(path.as_ref())?)
    }

    pub fn from_gguf<B: AsRef<[u8]>>(gguf: &Gguf<B>) -> Result<Self, ModelError> {
        let arch = gguf.architecture()?;
        if let Some(mla) = MlaArch::named(arch) {
            return Ok(CpuModel::Mla(MlaModel::for_arch(gguf, mla)?));
        }
        Ok(match arch {
            "gemma3" => CpuModel::Gemma3(Gemma3::from_gguf(gguf)?),
            "qwen3" => CpuModel::Qwen3(Qwen3::from_gguf(gguf)?),
            "olmoe" => CpuModel::Olmoe(Olmoe::from_gguf(gguf)?),
            other => {
                return Err(ModelError::new(
                    gguf.path(),
                    format!(
                        "general.architecture \"{other}\" has no CPU reference (supported: {})",
                        CPU_ARCHS.join(", ")
                    ),
                ));
            }
        })
    }

    pub fn arch(&self) -> &'static str {
        match self {
            CpuModel::Gemma3(_) => "gemma3",
            CpuModel::Qwen3(_) => "qwen3",
            CpuModel::Olmoe(_) => "olmoe",
            CpuModel::Mla(m) => m.arch(),
        }
    }

    pub fn n_vocab(&self) -> usize {
        match self {
            CpuModel::Gemma3(m) => m.hparams.n_vocab,
            CpuModel::Qwen3(m) => m.hparams.n_vocab,
            CpuModel::Olmoe(m) => m.hparams.n_vocab,
            CpuModel::Mla(m) => m.hparams().n_vocab,
        }
    }

    /// `context_length`: the most positions a cache holds.
    pub fn n_ctx(&self) -> usize {
        match self {
            CpuModel::Gemma3(m) => m.hparams.n_ctx_train,
            CpuModel::Qwen3(m) => m.hparams.n_ctx_train,
            CpuModel::Olmoe(m) => m.hparams.n_ctx_train,
            CpuModel::Mla(m) => m.hparams().n_ctx_train,
        }
    }

    pub fn new_cache(&self) -> CpuCache {
        match self {
            CpuModel::Gemma3(m) => CpuCache::Kv(m.new_cache()),
            CpuModel::Qwen3(m) => CpuCache::Kv(m.new_cache()),
            CpuModel::Olmoe(m) => CpuCache::Kv(m.new_cache()),
            CpuModel::Mla(m) => CpuCache::Mla(m.new_cache()),
        }
    }

    /// The model's `forward` (logits `[n_out, n_vocab]`, every position if `all_logits`).
    /// A cache from another model is an error.
    pub fn forward(
        &self,
        cache: &mut CpuCache,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>, ModelError> {
        match (self, cache) {
            (CpuModel::Gemma3(m), CpuCache::Kv(c)) => m.forward(c, tokens, all_logits),
            (CpuModel::Qwen3(m), CpuCache::Kv(c)) => m.forward(c, tokens, all_logits),
            (CpuModel::Olmoe(m), CpuCache::Kv(c)) => m.forward(c, tokens, all_logits),
            (CpuModel::Mla(m), CpuCache::Mla(c)) => m.forward(c, tokens, all_logits),
            _ => Err(ModelError::new(
                None,
                "forward: the cache was made for another model",
            )),
        }
    }
}

/// A GGUF file that cannot be loaded as a model, or a bad forward input (token id out of
/// range, context full).
#[derive(Debug, Clone)]
pub struct ModelError {
    path: Option<PathBuf>,
    message: String,
}

impl ModelError {
    pub fn new(path: Option<&Path>, message: impl Into<String>) -> Self {
        ModelError {
            path: path.map(Path::to_path_buf),
            message: message.into(),
        }
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for ModelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.path {
            Some(p) => write!(f, "{}: {}", p.display(), self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for ModelError {}

impl From<memra_gguf::GgufError> for ModelError {
    /// GGUF errors already name the file and key.
    fn from(e: memra_gguf::GgufError) -> Self {
        ModelError::new(None, e.to_string())
    }
}

/// Worker threads for the matmuls: `MEMRA_THREADS`, else the available cores.
pub fn n_threads() -> usize {
    std::env::var("MEMRA_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Runs `f(first_row, rows)` over `n_rows` split into one contiguous chunk per thread and
/// concatenates the results in row order. Small jobs run on the calling thread.
pub(crate) fn par_rows<T: Send>(
    n_rows: usize,
    work_per_row: usize,
    f: impl Fn(usize, usize) -> Vec<T> + Sync,
) -> Vec<T> {
    // Below ~1M multiply-adds a thread costs more than it saves.
    let threads = n_threads().min((n_rows * work_per_row / (1 << 20)).max(1));
    par_rows_on(threads, n_rows, f)
}

fn par_rows_on<T: Send>(
    threads: usize,
    n_rows: usize,
    f: impl Fn(usize, usize) -> Vec<T> + Sync,
) -> Vec<T> {
    let threads = threads.min(n_rows.max(1));
    if threads <= 1 {
        return f(0, n_rows);
    }
    let chunk = n_rows.div_ceil(threads);
    // Rounding the chunk up can leave the last threads nothing (512 rows on 30 threads: 29
    // chunks of 18 already cover them); start no thread past the end.
    let threads = n_rows.div_ceil(chunk);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|i| {
                let (start, end) = (i * chunk, ((i + 1) * chunk).min(n_rows));
                let f = &f;
                s.spawn(move || f(start, end.saturating_sub(start)))
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

/// `y[t][n] = Σ_k W[n][k]·x[t][k]` (model-specs §1.5) with the rows of `w` split over
/// threads. `w`: `[n, k]`, `x`: `[t, k]`, returns `[t, n]`. Same arithmetic as
/// [`crate::linear::matmul`] (f64 accumulation through [`crate::linear::dot`]).
pub fn par_matmul(w: &[f32], k: usize, n: usize, x: &[f32], t: usize) -> Vec<f32> {
    assert_eq!(
        w.len(),
        k * n,
        "par_matmul: w.len() {} != k·n = {k}·{n}",
        w.len()
    );
    assert_eq!(
        x.len(),
        t * k,
        "par_matmul: x.len() {} != t·k = {t}·{k}",
        x.len()
    );
    // Each thread returns its rows' outputs as [row][t]; scatter to [t][n] afterwards. Tokens
    // go in blocks that stay in cache while the thread's rows stream past: row-outer order
    // would re-read all of `x` (e.g. 2100 tokens × 16384 floats = 138 MB) for every row.
    const TOKEN_BLOCK: usize = 16;
    let by_row = par_rows(n, k * t, |first, rows| {
        let mut out = vec![0.0f32; rows * t];
        let w_rows = &w[first * k..(first + rows) * k];
        for t0 in (0..t).step_by(TOKEN_BLOCK) {
            let xs = &x[t0 * k..(t0 + TOKEN_BLOCK).min(t) * k];
            for (r, row) in w_rows.chunks_exact(k).enumerate() {
                for (ti, xt) in xs.chunks_exact(k).enumerate() {
                    out[r * t + t0 + ti] = crate::linear::dot(row, xt) as f32;
                }
            }
        }
        out
    });
    let mut y = vec![0.0f32; t * n];
    for (r, outs) in by_row.chunks_exact(t.max(1)).enumerate() {
        for (ti, &v) in outs.iter().enumerate() {
            y[ti * n + r] = v;
        }
    }
    y
}

/// A tensor's info, or an error naming the tensor and file.
pub(crate) fn tensor_info<'g, B: AsRef<[u8]>>(
    gguf: &'g Gguf<B>,
    name: &str,
) -> Result<TensorInfo<'g>, ModelError> {
    gguf.tensor(name)
        .ok_or_else(|| ModelError::new(gguf.path(), format!("tensor '{name}' is missing")))
}

/// Dequantizes tensor `name` to f32 after checking its shape is `dims` (ggml ne order).
/// Rows are split over threads.
pub(crate) fn load_f32<B: AsRef<[u8]>>(
    gguf: &Gguf<B>,
    name: &str,
    dims: &[usize],
) -> Result<Vec<f32>, ModelError> {
    let info = tensor_info(gguf, name)?;
    let got: Vec<u64> = info.dims.to_vec();
    let want: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
    if got != want {
        return Err(ModelError::new(
            gguf.path(),
            format!("tensor '{name}' has shape {got:?}, expected {want:?}"),
        ));
    }
    dequantize_tensor(gguf, &info)
}

fn dequantize_tensor<B: AsRef<[u8]>>(
    gguf: &Gguf<B>,
    info: &TensorInfo,
) -> Result<Vec<f32>, ModelError> {
    let bad = |e: memra_gguf::quant::QuantError| {
        ModelError::new(gguf.path(), format!("tensor '{}': {e}", info.name))
    };
    let data = gguf.tensor_data(info);
    let k = info.row_len() as usize;
    let n = info.n_rows() as usize;
    let row_bytes = memra_gguf::quant::byte_len(info.ggml_type, k, "dequantize").map_err(bad)?;
    if data.len() != row_bytes * n {
        return Err(ModelError::new(
            gguf.path(),
            format!(
                "tensor '{}' ({}) has {} bytes, expected {}",
                info.name,
                info.ggml_type,
                data.len(),
                row_bytes * n
            ),
        ));
    }
    if info.ggml_type == GgmlType::F32 {
        return Ok(data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect());
    }
    let ty = info.ggml_type;
    let chunks: Vec<Result<Vec<f32>, String>> = par_rows(n, k, |first, rows| {
        vec![crate::linear::dequantize_matrix(
            ty,
            &data[first * row_bytes..(first + rows) * row_bytes],
            k,
            rows,
        )
        .map_err(|e| e.to_string())]
    });
    let mut out = Vec::with_capacity(k * n);
    for chunk in chunks {
        out.extend(
            chunk.map_err(|e| {
                ModelError::new(gguf.path(), format!("tensor '{}': {e}", info.name))
            })?,
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::{par_matmul, par_rows_on};

    #[test]
    fn par_rows_covers_every_row_once_for_any_thread_count() {
        // 512 rows on 30 threads once started threads past the last row (found on a 32-core host).
        for n_rows in [0, 1, 7, 31, 512, 1000] {
            let all: Vec<usize> = (0..n_rows).collect();
            for threads in 1..=40 {
                // Slices like par_matmul does: a start past the end panics.
                let rows = par_rows_on(threads, n_rows, |first, rows| {
                    all[first..first + rows].to_vec()
                });
                assert_eq!(rows, all, "{n_rows} rows on {threads} threads");
            }
        }
    }

    #[test]
    fn par_matmul_equals_matmul_bit_for_bit_across_token_blocks() {
        let mut rng = crate::rng::Rng::from_env_or_time("par_matmul");
        let seed = rng.seed();
        // Token counts around the token block (16) and row counts that split over threads.
        for (k, n, t) in [
            (5, 3, 1),
            (33, 70, 15),
            (33, 70, 16),
            (64, 129, 17),
            (40, 300, 50),
        ] {
            let w: Vec<f32> = (0..k * n).map(|_| rng.normal()).collect();
            let x: Vec<f32> = (0..k * t).map(|_| rng.normal()).collect();
            let want = crate::linear::matmul(&w, k, n, &x, t);
            let got = par_matmul(&w, k, n, &x, t);
            assert!(
                want.iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "seed {seed}: par_matmul differs from matmul at k {k}, n {n}, t {t}"
            );
        }
    }
}
