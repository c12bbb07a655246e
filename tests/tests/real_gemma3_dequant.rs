//! Every tensor of the real Gemma 3 270M Q4_K_M file dequantizes, through memra's reader and
//! dequantizer, to the same values as the gguf-py reference (`gguf.quants.dequantize`).
//! Acceptance per tensor: max |ours − ref| ≤ 1e-6 · max |ref|.
//!
//! The reference values come from `scripts/dequant-reference.py`, streamed over a pipe and
//! compared chunk by chunk, so no 1 GB temporary file and little memory.
//! Needs `MEMRA_PYTHON` (set by scripts/test) and the model (`MEMRA_GEMMA3_GGUF`, else the memra
//! cache); prints "SKIP: ..." and passes when either is missing.

use std::collections::BTreeMap;
use std::io::{BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use memra_gguf::quant::dequantize_row;
use memra_gguf::{GgmlType, GgufFile};

/// Elements compared per step; bounds memory (two buffers of this many f32).
const CHUNK_ELEMENTS: usize = 1 << 20;

fn model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("MEMRA_GEMMA3_GGUF") {
        return PathBuf::from(p);
    }
    let cache = std::env::var_os("MEMRA_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/memra")
        });
    cache.join("models/gemma-3-270m-q4_k_m.gguf")
}

/// Reads the reference stream written by scripts/dequant-reference.py.
struct Stream<R> {
    inner: R,
}

impl<R: Read> Stream<R> {
    fn bytes<const N: usize>(&mut self, what: &str) -> [u8; N] {
        let mut b = [0u8; N];
        self.inner
            .read_exact(&mut b)
            .unwrap_or_else(|e| panic!("reference stream: reading {what}: {e}"));
        b
    }
    fn u32(&mut self, what: &str) -> u32 {
        u32::from_le_bytes(self.bytes(what))
    }
    fn u64(&mut self, what: &str) -> u64 {
        u64::from_le_bytes(self.bytes(what))
    }
    fn f32s(&mut self, dst: &mut [f32], raw: &mut Vec<u8>, what: &str) {
        raw.resize(dst.len() * 4, 0);
        self.inner
            .read_exact(raw)
            .unwrap_or_else(|e| panic!("reference stream: values of {what}: {e}"));
        for (v, b) in dst.iter_mut().zip(raw.as_chunks::<4>().0) {
            *v = f32::from_le_bytes(*b);
        }
    }
}

#[derive(Default)]
struct PerType {
    tensors: usize,
    elements: u64,
    bit_identical: u64,
    worst_rel: f64,
    worst_tensor: String,
}

/// Kills the reference process if the test panics before it finished.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

#[test]
fn gemma3_270m_every_tensor_dequantizes_like_gguf_py() {
    let model = model_path();
    if !model.is_file() {
        println!(
            "SKIP: gemma3 model not found at {} (set MEMRA_GEMMA3_GGUF or run scripts/fetch-gemma3-270m)",
            model.display()
        );
        return;
    }
    let Some(python) = std::env::var_os("MEMRA_PYTHON") else {
        println!("SKIP: MEMRA_PYTHON is not set (scripts/test sets it from scripts/setup-python)");
        return;
    };
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/dequant-reference.py");
    let file = GgufFile::open(&model).unwrap_or_else(|e| panic!("{e}"));

    let child = Command::new(&python)
        .arg(&script)
        .arg(&model)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "spawning {} {}: {e}",
                python.to_string_lossy(),
                script.display()
            )
        });
    let mut child = KillOnDrop(child);
    let stdout = child.0.stdout.take().expect("stdout was piped");
    let mut stream = Stream {
        inner: BufReader::with_capacity(1 << 20, stdout),
    };

    let started = Instant::now();
    let mut ours_time = Duration::ZERO;
    assert_eq!(
        &stream.bytes::<8>("magic"),
        b"MEMRADQ1",
        "reference stream: bad magic"
    );
    let n_tensors = stream.u64("tensor count");
    assert_eq!(
        n_tensors,
        file.tensors().len() as u64,
        "tensor count: gguf-py vs memra reader"
    );

    let mut per_type: BTreeMap<GgmlType, PerType> = BTreeMap::new();
    let mut failures = Vec::new();
    let (mut ours, mut reference, mut raw) = (Vec::new(), Vec::new(), Vec::new());
    for info in file.tensors() {
        let name_len = stream.u32("name length") as usize;
        let mut name = vec![0u8; name_len];
        stream
            .inner
            .read_exact(&mut name)
            .unwrap_or_else(|e| panic!("reference stream: name: {e}"));
        let name = String::from_utf8_lossy(&name).into_owned();
        let ty_id = stream.u32("type id");
        let n_elements = stream.u64("element count");
        assert_eq!(name, info.name, "tensor order: gguf-py vs memra reader");
        assert_eq!(ty_id, info.ggml_type.id(), "{name}: type id");
        assert_eq!(n_elements, info.n_elements(), "{name}: element count");

        let ty = info.ggml_type;
        let data = file.tensor_data(info);
        let row_len = info.row_len() as usize;
        let row_bytes = info.row_bytes() as usize;
        assert_eq!(
            data.len(),
            row_bytes * info.n_rows() as usize,
            "{name}: data size"
        );
        let rows_per_chunk = (CHUNK_ELEMENTS / row_len).max(1);
        let (mut max_ref, mut max_diff, mut identical) = (0.0f32, 0.0f32, 0u64);
        for src in data.chunks(rows_per_chunk * row_bytes) {
            let n = src.len() / row_bytes * row_len;
            ours.resize(n, 0.0);
            reference.resize(n, 0.0);
            let t = Instant::now();
            dequantize_row(ty, src, &mut ours).unwrap_or_else(|e| panic!("{name}: {e}"));
            ours_time += t.elapsed();
            stream.f32s(&mut reference, &mut raw, &name);
            for (a, b) in ours.iter().zip(&reference) {
                let diff = (a - b).abs();
                // A NaN on either side that is not the same NaN counts as an infinite difference.
                let diff = if diff.is_nan() && a.to_bits() != b.to_bits() {
                    f32::INFINITY
                } else {
                    diff
                };
                max_diff = max_diff.max(diff);
                max_ref = max_ref.max(b.abs());
                identical += (a.to_bits() == b.to_bits()) as u64;
            }
        }
        let rel = if max_ref > 0.0 {
            max_diff as f64 / max_ref as f64
        } else {
            max_diff as f64
        };
        if max_diff > 1e-6 * max_ref {
            failures.push(format!(
                "{name} ({ty}): max |diff| {max_diff:e} > 1e-6 * max |ref| {max_ref:e}"
            ));
        }
        let s = per_type.entry(ty).or_default();
        s.tensors += 1;
        s.elements += n_elements;
        s.bit_identical += identical;
        if rel > s.worst_rel || s.worst_tensor.is_empty() {
            s.worst_rel = rel;
            s.worst_tensor = name;
        }
    }
    let mut trailing = [0u8; 1];
    let extra = stream.inner.read(&mut trailing).unwrap_or(0);
    assert_eq!(extra, 0, "reference stream has data after the last tensor");
    let status = child
        .0
        .wait()
        .unwrap_or_else(|e| panic!("waiting for {}: {e}", script.display()));
    assert!(
        status.success(),
        "{} exited with {status}",
        script.display()
    );

    let total: u64 = per_type.values().map(|s| s.elements).sum();
    println!(
        "{}: {} tensors, {total} elements in {:.1?} (memra dequant {:.1?})",
        model.display(),
        n_tensors,
        started.elapsed(),
        ours_time
    );
    for (ty, s) in &per_type {
        println!(
            "  {ty:>6}: {:>3} tensors, {:>10} elements, {:>10} bit-identical, worst max|diff|/max|ref| {:e} ({})",
            s.tensors, s.elements, s.bit_identical, s.worst_rel, s.worst_tensor
        );
    }
    assert!(
        failures.is_empty(),
        "{} tensors differ from gguf-py:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert_eq!(
        per_type.values().map(|s| s.tensors).sum::<usize>() as u64,
        n_tensors
    );
}
