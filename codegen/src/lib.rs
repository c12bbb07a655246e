//! memra-codegen: specs -> kernel plan -> rendered CUDA + Rust launchers, written into OUT_DIR.
