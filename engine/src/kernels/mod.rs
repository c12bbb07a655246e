//! Kernel variants (generated registry), variant selection, typed launches, and one module per
//! kernel family (`<family>.rs`: argument struct, launch geometry, safe wrapper, GPU tests).

pub mod cli;
pub mod launch;
pub mod registry;

// Kernel families (H-dense): argument struct, launch geometry, safe wrapper each.
pub mod add_rmsnorm;
pub mod argmax;
pub mod checks;
pub mod embed;
pub mod geglu;
pub mod qk_norm_rope;
pub mod rmsnorm;
pub mod swiglu;
pub mod topk;

// Matrix families (H-gemv).
pub mod matmul;
pub mod matvec;
pub mod norm_matvec;
pub mod combine_matvec;
pub mod quantize_q8;

// MoE families (H-moe).
pub mod moe_combine;
pub mod moe_matvec;
pub mod moe_router;

pub use launch::{ArgKind, KernelArg, KernelArgs, LaunchConfig, launch};
pub use registry::{KernelVariant, Param, Policy, Selection, select, select_with};

// Attention families (H-attn).
pub mod attn_decode;
pub mod attn_decode_rope;
pub mod attn_prefill;
pub mod mla_decode;
pub mod dsa_indexer;
pub mod dsa_topk;
pub mod mla_sparse_decode;
pub mod dsa_index_key;

// MLA layer pieces (H-mla).
pub mod mla_rope;
