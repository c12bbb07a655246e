memra_macros::arch!("GLM_DSA");

fn main() {}
