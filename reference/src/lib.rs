//! memra-reference: naive, obviously-right f32 CPU ops — the oracles every GPU kernel and
//! forward pass is tested against.
//!
//! Conventions (every module):
//! - Tensors are plain `&[f32]` slices in **row-major** order with explicit dims. A shape
//!   written `[a, b, c]` means index `(i·b + j)·c + k`, last dim contiguous.
//! - A weight with GGUF `ne = {K, N}` is `N` rows of `K` floats (model-specs §1.5), so
//!   `y[n] = Σ_k W[n][k]·x[k]`. Weight arguments keep the GGUF tensor names.
//! - Values are stored as f32; dot products, norms and softmax accumulate in f64.
//! - A shape mismatch is a bug in the calling test, not bad data: functions `assert!` their
//!   shapes and panic with a message naming the argument.
//! - The position of KV-cache row `s` is `s`.
//!
//! Formulas and their sources are in `shared/reference/model-specs.md` (§ cited per function).

// Index loops mirror the formulas they implement; iterator chains would hide them.
#![allow(clippy::needless_range_loop)]

pub mod act;
pub mod attention;
pub mod compare;
pub mod dsa;
pub mod linear;
pub mod mla;
pub mod models;
pub mod moe;
pub mod norm;
pub mod rng;
pub mod q8;
pub mod rope;

pub use compare::{logit_verdict, logit_verdict_rows, max_abs_diff, rel_err};
pub use rng::Rng;
