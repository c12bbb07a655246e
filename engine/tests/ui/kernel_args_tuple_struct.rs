// Field names appear in parameter-mismatch errors, so tuple structs are refused.
use memra_engine::cuda::cudarc::driver::CudaSlice;
use memra_engine::kernels::KernelArgs;

#[derive(KernelArgs)]
#[kernel_args(family = "rmsnorm")]
struct RmsnormArgs<'a>(&'a CudaSlice<f32>, i32);

fn main() {}
