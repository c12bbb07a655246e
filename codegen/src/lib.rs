//! memra-codegen: architecture specs + model dims -> planned kernel variants -> thin CUDA
//! sources and the kernel registry, written into OUT_DIR. Never links CUDA.
//!
//! Pipeline, one module each: [`spec`] (parse + validate `specs/<arch>.toml`, located errors
//! via [`source`]) -> [`dims`] (preset or GGUF header, with [`expr`] for shapes) -> [`plan`]
//! (against the [`families`] catalogue of `templates/README.md`, named by [`variant`]) ->
//! [`render`] -> [`build`] (the build-script entry point `build::emit`). [`fixture`] writes
//! GGUF images matching a spec, for tests. [`shard`] applies the spec's multi-GPU split rules
//! (`[tensors]` `split`, `[parallel]`): the engine's ranks cut weights by them, the planner the
//! dims of each `[parallel] shards` count.

pub mod build;
pub mod dims;
pub mod expr;
pub mod families;
pub mod fixture;
pub mod plan;
pub mod render;
pub mod shard;
pub mod source;
pub mod spec;
pub mod variant;

pub use build::{BuildRequest, emit};
pub use spec::ArchSpec;
pub use variant::KernelVariant;
