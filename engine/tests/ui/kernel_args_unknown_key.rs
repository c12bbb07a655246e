// A misspelt attribute key is an error at the key.
use memra_engine::kernels::KernelArgs;

#[derive(KernelArgs)]
#[kernel_args(familly = "rmsnorm")]
struct RmsnormArgs {
    n: i32,
}

fn main() {}
