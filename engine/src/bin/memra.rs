//! The `memra` command line: one subcommand per task, each implemented in the library
//! (`memra_engine::<module>::run`) so that this file only parses and dispatches.

use std::error::Error;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use memra_engine::inspect;

/// memra: an LLM inference engine whose CUDA kernels are specialized at build time for one
/// model architecture.
#[derive(Parser, Debug)]
#[command(name = "memra", version, propagate_version = true, after_help = ENVIRONMENT)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The environment variables memra reads at run time (build-time ones: README.md).
const ENVIRONMENT: &str = "Environment:
  MEMRA_CACHE=DIR            kernel CUBIN cache and fetched models (default ~/.cache/memra)
  MEMRA_NO_NVRTC=1           never compile: a kernel missing from the cache is an error
  MEMRA_NVRTC_PROCS=N        most child processes for cold compiles (default: the cores, at most
                             16; 0 or 1: compile in this process)
  MEMRA_NVRTC_PATH, MEMRA_LIBCUDA_PATH, MEMRA_NCCL_PATH
                             where to look first for libnvrtc, libcuda, libnccl
  MEMRA_SEED=N               replay the random inputs of a test or `memra bench --synthetic`
  MEMRA_SHARDED_GRAPHS=1     CUDA-graph decode steps on several GPUs (they hung at GLM-5 dims)
  MEMRA_RANK_TIMEOUT_S=S     several GPUs: a step's limit before the model reports the silent
                             ranks and refuses further work (default 900)
  MEMRA_MOE_GROUPED=1|0      force the expert-grouped MoE prefill on / off (default: by chunk size)";

#[derive(Subcommand, Debug)]
enum Command {
    /// Describe a GGUF file: architecture, hparams, tokenizer, tensor table, per-type totals,
    /// and which memra spec matches it. Works without a GPU.
    #[command(after_help = "Examples:\n  memra inspect model.gguf\n  memra inspect model.gguf --json | jq .hparams")]
    Inspect(inspect::InspectArgs),
    /// Generate text from a prompt, streaming it as tokens are produced, on the GPU forward of
    /// the file's architecture (every architecture with a spec) with this build's specialized
    /// kernels where the dims match, or on the CPU reference forward (`--cpu`). Without a file:
    /// the embedded micro model of the built architecture (random weights).
    #[command(after_help = "Examples:\n  memra run model.gguf -p \"Water boils at\" -n 16 --temp 0\n  memra run model.gguf -p \"Once upon a time\" --temp 0.8 --top-k 40 --top-p 0.95 --seed 1\n  memra run model.gguf -p \"Water boils at\" --require-specialized   # fail unless every kernel is specialized\n  memra run model.gguf -p \"Water boils at\" -n 16 --cpu --temp 0   # the f32 reference path\n  memra run                                                   # the embedded default model")]
    Run(memra_engine::run::RunArgs),
    /// List this build's kernel variants; compile them with NVRTC (cache-aware) for the GPU or
    /// for `--sm` without one; report registers and spills.
    #[command(after_help = "Examples:\n  memra kernels\n  memra kernels --compile --sm 90 --report\n  memra kernels --clear-cache\n  memra kernels --arch glm-dsa --clear-cache --load   # a cold start-up, timed; again without --clear-cache: a warm one")]
    Kernels(memra_engine::kernels::cli::KernelsCommand),
    /// Measure every kernel family at the built architectures' preset shapes on the GPU:
    /// specialized vs generic vs the copy bandwidth measured in the same run; or a whole model
    /// (`--model`), a tuning sweep (`--sweep matvec`), or a report with torch peers and an SVG
    /// chart from saved results (`--report`, no GPU needed).
    #[command(after_help = "Examples:\n  memra bench\n  memra bench --arch glm-dsa --family matvec --json out/h200.json\n  memra bench --list\n  memra bench --model gemma-3-270m-q4_k_m.gguf --json model.json\n  memra bench --model gemma-3-270m-q4_k_m.gguf --breakdown\n  memra bench --report h200.json --peers peers.json --svg chart.svg")]
    Bench(memra_engine::bench::BenchArgs),
    /// Internal: compile the named kernel variants into the cache for a cold start-up of another
    /// memra process (memra_engine::cuda::workers).
    #[command(name = "nvrtc-worker", hide = true)]
    NvrtcWorker(memra_engine::cuda::workers::WorkerArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Cold compiles may run in child processes of this executable (`memra nvrtc-worker`).
    memra_engine::cuda::workers::enable();
    match cli.command {
        Command::Inspect(args) => exit_code(inspect::run(&args)),
        Command::Run(args) => exit_code(memra_engine::run::run(&args)),
        Command::Kernels(args) => memra_engine::kernels::cli::run(&args),
        Command::Bench(args) => exit_code(memra_engine::bench::run(&args)),
        Command::NvrtcWorker(args) => exit_code(memra_engine::cuda::workers::worker_main(&args).map_err(Into::into)),
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
