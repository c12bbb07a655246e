//! Whole-model CPU reference forward passes, built from this crate's ops with every weight
//! dequantized to f32 once at load. They are the oracles for the GPU forwards and the `--cpu`
//! path of `memra run`.
//!
//! Unlike the ops, loading reads untrusted files: a missing key or tensor, a wrong shape or an
//! unsupported type is a [`ModelError`] naming the file and the key or tensor, never a panic.

pub mod gemma3;

use std::fmt;
use std::path::{Path, PathBuf};

use memra_gguf::{GgmlType, Gguf, TensorInfo};

pub use gemma3::{Gemma3, Gemma3Cache, Gemma3Hparams};

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
    let threads = n_threads()
        .min(n_rows.max(1))
        .min((n_rows * work_per_row / (1 << 20)).max(1));
    if threads <= 1 {
        return f(0, n_rows);
    }
    let chunk = n_rows.div_ceil(threads);
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
    // Each thread returns its rows' outputs as [row][t]; scatter to [t][n] afterwards.
    let by_row = par_rows(n, k * t, |first, rows| {
        let mut out = Vec::with_capacity(rows * t);
        for row in w[first * k..(first + rows) * k].chunks_exact(k) {
            for xt in x.chunks_exact(k) {
                out.push(crate::linear::dot(row, xt) as f32);
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
        vec![
            crate::linear::dequantize_matrix(
                ty,
                &data[first * row_bytes..(first + rows) * row_bytes],
                k,
                rows,
            )
            .map_err(|e| e.to_string()),
        ]
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
