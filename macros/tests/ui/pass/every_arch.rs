// Every committed spec expands to compiling code; the items are usable by name.
mod glm_dsa {
    memra_macros::arch!("glm-dsa");
}
mod qwen3 {
    memra_macros::arch!("qwen3");
}
mod olmoe {
    memra_macros::arch!("olmoe");
}
mod gemma3 {
    memra_macros::arch!("gemma3", spec = "../../../../specs/gemma3.toml");
}

fn layer_count(hp: &glm_dsa::GlmDsaHparams) -> u32 {
    hp.n_layer
}

fn main() {
    assert_eq!(glm_dsa::GlmDsa::ARCH, "glm-dsa");
    assert_eq!(qwen3::Qwen3::ARCH, "qwen3");
    assert_eq!(olmoe::Olmoe::ARCH, "olmoe");
    assert_eq!(gemma3::Gemma3::ARCH, "gemma3");
    let _: fn(&glm_dsa::GlmDsaHparams) -> u32 = layer_count;
    let _: Option<gemma3::Gemma3Weights<usize>> = None;
    let _: Option<qwen3::Qwen3LayerWeights<()>> = None;
    let _: Option<olmoe::OlmoeLoadError> = None;
}
