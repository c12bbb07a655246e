memra_macros::arch!("llama");

fn main() {}
