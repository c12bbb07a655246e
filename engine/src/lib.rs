//! memra-engine: runtime pieces behind the `memra` binary.

// Lets `#[derive(KernelArgs)]` name `::memra_engine::…` inside this crate as well as outside.
extern crate self as memra_engine;

pub mod bench;
pub mod bench_model;
pub mod bench_synthetic;
pub mod cuda;
pub mod inspect;
pub mod run;
pub mod sampling;
pub mod synthetic;
pub mod tokenizer;
pub mod kernels;
pub mod models;
pub mod parallel;
