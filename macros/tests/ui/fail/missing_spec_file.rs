memra_macros::arch!("gemma3", spec = "specs/no-such-file.toml");

fn main() {}
