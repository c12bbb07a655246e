//! The `memra` command line: one subcommand per task, each implemented in the library
//! (`memra_engine::<module>::run`) so that this file only parses and dispatches.

use std::error::Error;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use memra_engine::inspect;

/// memra: an LLM inference engine whose CUDA kernels are specialized at build time for one
/// model architecture.
#[derive(Parser, Debug)]
#[command(name = "memra", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Describe a GGUF file: architecture, hparams, tokenizer, tensor table, per-type totals,
    /// and which memra spec matches it. Works without a GPU.
    #[command(after_help = "Examples:\n  memra inspect model.gguf\n  memra inspect model.gguf --json | jq .hparams")]
    Inspect(inspect::InspectArgs),
    /// Generate text from a prompt, streaming it as tokens are produced. Only the CPU reference
    /// forward exists so far (`--cpu`, gemma3); the GPU path is not built yet.
    #[command(after_help = "Examples:\n  memra run model.gguf -p \"Water boils at\" -n 16 --cpu --temp 0\n  memra run model.gguf -p \"Once upon a time\" --cpu --temp 0.8 --top-k 40 --top-p 0.95 --seed 1")]
    Run(memra_engine::run::RunArgs),
    /// List this build's kernel variants; compile them with NVRTC (cache-aware) for the GPU or
    /// for `--sm` without one; report registers and spills.
    #[command(after_help = "Examples:\n  memra kernels\n  memra kernels --compile --sm 90 --report\n  memra kernels --clear-cache")]
    Kernels(memra_engine::kernels::cli::KernelsCommand),
    /// Measure every kernel family at the built architectures' preset shapes on the GPU:
    /// specialized vs generic vs the copy bandwidth measured in the same run.
    #[command(after_help = "Examples:\n  memra bench\n  memra bench --arch glm-dsa --family matvec --json out/h200.json\n  memra bench --list")]
    Bench(memra_engine::bench::BenchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Inspect(args) => exit_code(inspect::run(&args)),
        Command::Run(args) => exit_code(memra_engine::run::run(&args)),
        Command::Kernels(args) => memra_engine::kernels::cli::run(&args),
        Command::Bench(args) => exit_code(memra_engine::bench::run(&args)),
    }
}

/// Prints an error as one line on stderr and turns it into a failing exit status.
fn exit_code(result: Result<(), Box<dyn Error>>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("memra: error: {e}");
            ExitCode::FAILURE
        }
    }
}
