memra_macros::arch!("gemma3", path = "specs/gemma3.toml");

fn main() {}
