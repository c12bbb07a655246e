//! Dequantization on arbitrary block bytes. A parsed file has every tensor whose type the
//! CPU supports dequantized (bounded: at most `ELEMENT_BUDGET` elements per input), whole and
//! row by row, which must agree bit for bit. Input that does not parse is read as one type
//! byte followed by raw blocks, so the decoders see arbitrary bytes either way.

#![no_main]

use libfuzzer_sys::fuzz_target;
use memra_gguf::{GgmlType, Gguf, quant};

/// Keeps one input's work in the microseconds-to-milliseconds range.
const ELEMENT_BUDGET: u64 = 1 << 18;

fuzz_target!(|data: &[u8]| {
    match Gguf::parse(data) {
        Ok(file) => {
            let mut budget = ELEMENT_BUDGET;
            for t in file.tensors() {
                let n = t.n_elements();
                if !t.ggml_type.is_supported() || n > budget {
                    continue;
                }
                budget -= n;
                check(
                    t.ggml_type,
                    file.tensor_data(t),
                    n as usize,
                    t.row_len() as usize,
                );
            }
        }
        Err(_) => {
            let Some((&selector, blocks)) = data.split_first() else {
                return;
            };
            let supported: Vec<GgmlType> = GgmlType::all().filter(|t| t.is_supported()).collect();
            let ty = supported[selector as usize % supported.len()];
            let (block_bytes, block_len) = (ty.type_size() as usize, ty.block_size() as usize);
            let n_blocks = (blocks.len() / block_bytes).min((ELEMENT_BUDGET as usize) / block_len);
            check(
                ty,
                &blocks[..n_blocks * block_bytes],
                n_blocks * block_len,
                block_len,
            );
            // A size that is not whole blocks, or a short buffer, is an error, not a panic.
            assert!(
                quant::dequantize(ty, blocks, n_blocks * block_len + 1).is_err() || block_len == 1
            );
            if !blocks.is_empty() && n_blocks > 0 {
                let short = &blocks[..n_blocks * block_bytes - 1];
                assert!(quant::dequantize(ty, short, n_blocks * block_len).is_err());
            }
        }
    }
});

/// Whole-tensor and per-row dequantization succeed and agree (NaN payloads included).
fn check(ty: GgmlType, bytes: &[u8], n_elements: usize, row_len: usize) {
    let whole = quant::dequantize(ty, bytes, n_elements)
        .unwrap_or_else(|e| panic!("{ty}: {n_elements} elements in {} bytes: {e}", bytes.len()));
    if row_len == 0 {
        return;
    }
    let row_bytes = ty.row_bytes(row_len as u64).expect("whole blocks") as usize;
    let mut row = vec![0f32; row_len];
    for (i, src) in bytes.chunks(row_bytes).enumerate() {
        quant::dequantize_row(ty, src, &mut row).unwrap_or_else(|e| panic!("{ty} row {i}: {e}"));
        let expected = &whole[i * row_len..(i + 1) * row_len];
        assert!(
            row.iter()
                .zip(expected)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{ty} row {i} differs from the whole-tensor dequantization"
        );
    }
}
