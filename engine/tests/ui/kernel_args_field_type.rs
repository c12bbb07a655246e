// A field whose type cannot be a kernel parameter (a host Vec) is rejected at the field.
use memra_engine::cuda::cudarc::driver::CudaSlice;
use memra_engine::kernels::KernelArgs;

#[derive(KernelArgs)]
#[kernel_args(family = "rmsnorm")]
struct RmsnormArgs<'a> {
    x: &'a CudaSlice<f32>,
    w: Vec<f32>,
    n: i32,
}

fn main() {}
