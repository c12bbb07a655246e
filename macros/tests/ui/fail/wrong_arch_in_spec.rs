// The spec file describes another architecture than the one asked for.
memra_macros::arch!("qwen3", spec = "../../../../specs/olmoe.toml");

fn main() {}
