//! Model architectures: `spec` holds the typed hparams and weight structs generated from
//! `specs/<arch>.toml`; each architecture's forward pass goes in `<arch>.rs` beside it.

pub mod spec;
pub mod validate;
