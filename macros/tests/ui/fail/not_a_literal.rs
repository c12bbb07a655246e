memra_macros::arch!(gemma3);

fn main() {}
