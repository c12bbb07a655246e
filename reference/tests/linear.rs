//! matvec / matmul, f32 and GGUF-typed weights.

use memra_gguf::GgmlType;
use memra_gguf::quant::{QuantError, dequantize, quantize};
use memra_reference::linear::{dequantize_matrix, matmul, matmul_gguf, matvec, matvec_gguf};
use memra_reference::{Rng, rel_err};

#[test]
fn matvec_hand_values_and_row_convention() {
    // ne {3, 2}: two rows of three.
    let w = [1.0, 2.0, 3.0, -1.0, 0.0, 0.5];
    assert_eq!(matvec(&w, 3, 2, &[1.0, 1.0, 2.0]), vec![9.0, 0.0]);
    let y = matmul(&w, 3, 2, &[1.0, 1.0, 2.0, 0.0, 1.0, 0.0], 2);
    assert_eq!(y, vec![9.0, 0.0, 2.0, 0.0]);
}

#[test]
fn gguf_typed_matmul_equals_f32_matmul_on_dequantized_rows() {
    let mut rng = Rng::from_env_or_time("gguf_typed_matmul_equals_f32_matmul_on_dequantized_rows");
    let (k, n, t) = (512, 12, 3);
    let w = rng.normal_vec(k * n, 0.05);
    let x = rng.normal_vec(t * k, 1.0);
    let exact = matmul(&w, k, n, &x, t);
    // Bounds on the quantization noise alone (rms step/sqrt(12) over a block's range); a layout
    // bug (wrong row, wrong nibble order) gives an error near sqrt(2).
    for (ty, tol) in [
        (GgmlType::F32, 1e-7),
        (GgmlType::F16, 1e-3),
        (GgmlType::BF16, 1e-2),
        (GgmlType::Q8_0, 0.02),
        (GgmlType::Q5_0, 0.1),
        (GgmlType::Q6_K, 0.1),
        (GgmlType::Q4_K, 0.2),
        (GgmlType::IQ4_NL, 0.2),
    ] {
        let bytes = quantize(ty, &w).expect("quantize");
        let deq = dequantize(ty, &bytes, k * n).expect("dequantize");
        assert_eq!(dequantize_matrix(ty, &bytes, k, n).unwrap(), deq, "{ty}");
        let y = matmul_gguf(ty, &bytes, k, n, &x, t).unwrap();
        assert_eq!(
            y,
            matmul(&deq, k, n, &x, t),
            "{ty}: row-by-row differs from whole-matrix dequantization"
        );
        assert_eq!(
            matvec_gguf(ty, &bytes, k, n, &x[..k]).unwrap(),
            y[..n],
            "{ty}"
        );
        let err = rel_err(&y, &exact);
        eprintln!("{ty}: rel err {err:e}");
        assert!(
            err < tol,
            "{ty}: quantized result is {err:e} from the f32 one (seed {})",
            rng.seed()
        );
    }
}

#[test]
fn gguf_typed_matmul_reports_bad_sizes() {
    let bytes = vec![0u8; 34 * 3];
    let x = vec![0.0f32; 32];
    let err = matvec_gguf(GgmlType::Q8_0, &bytes, 32, 2, &x).unwrap_err();
    assert!(
        matches!(
            err,
            QuantError::SizeMismatch {
                expected_bytes: 68,
                actual_bytes: 102,
                ..
            }
        ),
        "{err:?}"
    );
    let err = matvec_gguf(GgmlType::Q8_0, &bytes[..34], 16, 1, &x[..16]).unwrap_err();
    assert!(matches!(err, QuantError::NotWholeBlocks { .. }), "{err:?}");
    assert!(matvec_gguf(GgmlType::Q8_0, &bytes[..68], 32, 2, &x).is_ok());
}
