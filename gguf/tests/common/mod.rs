//! Shared by the gguf integration tests: a seeded PRNG and a small fixture file that uses
//! several metadata types (including a string array) and several tensor types.

#![allow(dead_code)]

use memra_gguf::{GgmlType, GgufWriter, MetaValue};

/// SplitMix64: tiny, seedable, good enough for test inputs.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }

    /// Uniform in [-1, 1).
    pub fn f32_sym(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// `MEMRA_FUZZ_SEED` if set, else a fresh seed from the clock. Printed so failures replay.
pub fn seed(test: &str) -> u64 {
    let seed = match std::env::var("MEMRA_FUZZ_SEED") {
        Ok(s) => s.trim().parse().expect("MEMRA_FUZZ_SEED must be a u64"),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0x5EED),
    };
    eprintln!("{test}: seed {seed} (replay with MEMRA_FUZZ_SEED={seed})");
    seed
}

pub const TOKENS: [&str; 6] = ["<pad>", "<eos>", "<bos>", "▁hello", "world", "\n"];

/// A small but varied valid file: every common metadata type, a string array and four
/// tensors of different types. Tensor bytes are fixed (seeded) so the file is stable.
pub fn fixture_writer() -> GgufWriter {
    let mut rng = Rng::new(7);
    let mut w = GgufWriter::new();
    w.add_meta("general.architecture", "tiny")
        .add_meta("general.name", "fixture")
        .add_meta("tiny.block_count", 2u32)
        .add_meta("tiny.embedding_length", 64u64)
        .add_meta("tiny.attention.head_count", 4i32)
        .add_meta("tiny.attention.layer_norm_rms_epsilon", 1e-6f32)
        .add_meta("tiny.rope.freq_base", 10000.0f64)
        .add_meta("tiny.use_bias", false)
        .add_meta("tiny.small", MetaValue::I8(-3))
        .add_meta("tokenizer.ggml.model", "llama")
        .add_meta("tokenizer.ggml.tokens", TOKENS.to_vec())
        .add_meta("tokenizer.ggml.scores", vec![0.0f32, -1.0, -2.0, -3.5, -4.0, -5.0])
        .add_meta("tokenizer.ggml.token_type", vec![3i32, 3, 3, 1, 1, 6])
        .add_meta("tokenizer.ggml.bos_token_id", 2u32)
        .add_meta("tokenizer.ggml.add_bos_token", true);
    let embd: Vec<f32> = (0..64 * 6).map(|_| rng.f32_sym()).collect();
    w.add_tensor_f32("token_embd.weight", &[64, 6], GgmlType::F16, &embd).unwrap();
    w.add_tensor_bytes("blk.0.attn_q.weight", &[64, 8], GgmlType::Q8_0, rng.bytes(2 * 34 * 8))
        .unwrap();
    let norm: Vec<f32> = (0..64).map(|i| 1.0 + i as f32 / 64.0).collect();
    w.add_tensor_f32("output_norm.weight", &[64], GgmlType::F32, &norm).unwrap();
    w.add_tensor_bytes("blk.0.ffn_down.weight", &[256, 2], GgmlType::Q4_K, rng.bytes(2 * 144))
        .unwrap();
    w
}

pub fn fixture_bytes() -> Vec<u8> {
    fixture_writer().to_bytes().unwrap()
}
