//! `cargo run -p memra-codegen --example check-spec -- specs/<arch>.toml...`: validates specs
//! and prints each one's preset dims and planned variants (or every error, located).
use std::path::Path;
use std::process::ExitCode;

fn main() -> ExitCode {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("codegen/ has a parent");
    let catalogue =
        match memra_codegen::families::Catalogue::load(&root.join("templates/README.md")) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        };
    let mut ok = true;
    for arg in std::env::args().skip(1) {
        match memra_codegen::ArchSpec::load(Path::new(&arg)) {
            Err(e) => {
                eprintln!("{e}");
                ok = false;
            }
            Ok(spec) => match memra_codegen::dims::from_preset(&spec, None) {
                Err(e) => {
                    eprintln!("{e}");
                    ok = false;
                }
                Ok(dims) => {
                    println!("{arg}: {} tensors from {}", dims.tensors.len(), dims.origin);
                    match memra_codegen::plan::plan_arch(&spec, &dims, &catalogue) {
                        Ok(plan) => plan.variants.iter().for_each(|v| println!("  {v}")),
                        Err(e) => {
                            eprintln!("{e}");
                            ok = false;
                        }
                    }
                }
            },
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
