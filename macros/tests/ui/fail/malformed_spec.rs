// bad-spec/bad.toml has an unknown capability value, an undefined name in a shape, and an
// unknown key: all three are reported, each with its line and key.
memra_macros::arch!("bad", spec = "bad-spec/bad.toml");

fn main() {}
