//! memra's dequantizer against golden vectors from the gguf-py reference
//! (`gguf.quants.dequantize`), written by `scripts/make-golden-quants.py` into tests/data/golden/.
//! Acceptance: per type, max |ours − ref| ≤ 1e-6 · max |ref|.

use std::path::PathBuf;

use memra_gguf::GgmlType;
use memra_gguf::quant::{dequantize, dequantize_row, is_supported};

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden")
}

/// (raw block bytes, reference values) for `ty`.
fn load(ty: GgmlType) -> (Vec<u8>, Vec<f32>) {
    let dir = golden_dir();
    let read = |ext: &str| {
        let path = dir.join(format!("{ty}.{ext}"));
        std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (run scripts/make-golden-quants.py)",
                path.display()
            )
        })
    };
    let raw = read("bin");
    let floats = read("f32");
    assert_eq!(floats.len() % 4, 0, "{ty}.f32 is not a whole number of f32");
    let reference = floats
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    (raw, reference)
}

fn supported() -> Vec<GgmlType> {
    GgmlType::all().filter(|&t| is_supported(t)).collect()
}

#[test]
fn dequantize_matches_gguf_py_golden_vectors() {
    let types = supported();
    assert_eq!(
        types.len(),
        13,
        "the golden set covers the 13 supported types: {types:?}"
    );
    for ty in types {
        let (raw, reference) = load(ty);
        assert!(!reference.is_empty(), "{ty}: empty golden file");
        let ours = dequantize(ty, &raw, reference.len()).unwrap_or_else(|e| panic!("{ty}: {e}"));
        let max_ref = reference.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let (worst, max_diff) = ours
            .iter()
            .zip(&reference)
            .map(|(a, b)| (a - b).abs())
            .enumerate()
            .fold(
                (0, 0.0f32),
                |acc, (i, d)| if d > acc.1 { (i, d) } else { acc },
            );
        let exact = ours
            .iter()
            .zip(&reference)
            .filter(|(a, b)| a.to_bits() == b.to_bits())
            .count();
        println!(
            "{ty}: {} values, {exact} bit-identical, max |diff| {max_diff:e} (max |ref| {max_ref:e})",
            ours.len()
        );
        assert!(
            max_diff <= 1e-6 * max_ref,
            "{ty}: element {worst}: ours {} vs gguf-py {} (|diff| {max_diff:e} > 1e-6 * {max_ref:e})",
            ours[worst],
            reference[worst]
        );
        // Stronger than the acceptance criterion: small values must match too, not just large ones.
        for (i, (a, b)) in ours.iter().zip(&reference).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs(),
                "{ty}: element {i}: ours {a:e} vs gguf-py {b:e}"
            );
        }
    }
}

/// Dequantizing block by block gives the same values as one call over all blocks.
#[test]
fn blockwise_and_whole_dequantization_agree() {
    for ty in supported() {
        let (raw, reference) = load(ty);
        let whole = dequantize(ty, &raw, reference.len()).unwrap();
        let (block, bytes) = (ty.block_size() as usize, ty.type_size() as usize);
        let mut piecewise = vec![f32::NAN; whole.len()];
        for (src, dst) in raw.chunks(bytes).zip(piecewise.chunks_mut(block)) {
            dequantize_row(ty, src, dst).unwrap();
        }
        assert!(
            whole
                .iter()
                .zip(&piecewise)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{ty}: blockwise dequantization differs from whole"
        );
    }
}

/// A truncated or padded buffer is an error naming the type, never a panic or a partial result.
#[test]
fn wrong_sizes_are_errors() {
    for ty in supported() {
        let (raw, reference) = load(ty);
        let n = reference.len();
        for bad in [&raw[..raw.len() - 1], &[raw.as_slice(), &[0]].concat()[..]] {
            let e = dequantize(ty, bad, n).expect_err("size mismatch must fail");
            assert!(e.to_string().contains(ty.name()), "{ty}: {e}");
        }
        if ty.block_size() > 1 {
            let e = dequantize(ty, &raw, n - 1).expect_err("partial block must fail");
            assert!(e.to_string().contains(ty.name()), "{ty}: {e}");
        }
    }
}

/// The committed .f32 files are gguf-py's own output for the committed .bin files (not hand
/// edited): re-dequantizes them with gguf-py. Needs MEMRA_PYTHON (scripts/test sets it).
#[test]
fn golden_files_are_gguf_py_output() {
    let Some(python) = std::env::var_os("MEMRA_PYTHON") else {
        println!("SKIP: MEMRA_PYTHON is not set (scripts/test sets it from scripts/setup-python)");
        return;
    };
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/make-golden-quants.py");
    let out = std::process::Command::new(&python)
        .arg(&script)
        .arg("--verify")
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "running {} {}: {e}",
                python.to_string_lossy(),
                script.display()
            )
        });
    assert!(
        out.status.success(),
        "{} --verify failed ({}):\n{}{}",
        script.display(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
