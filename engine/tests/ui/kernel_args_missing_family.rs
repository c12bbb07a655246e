// Without #[kernel_args(family = "...")] a launch could not check which kernels the struct fits.
use memra_engine::cuda::cudarc::driver::CudaSlice;
use memra_engine::kernels::KernelArgs;

#[derive(KernelArgs)]
struct RmsnormArgs<'a> {
    x: &'a CudaSlice<f32>,
    n: i32,
}

fn main() {}
