//! NVRTC without a GPU: compile to sm_90 CUBIN, compile errors, parameter-list checks, and the
//! library search's error. Tests that need NVRTC print one SKIP line when it is absent
//! (set MEMRA_NVRTC_PATH or run scripts/setup-python).

mod library_common;

use cudarc::driver::CudaSlice;
use memra_engine::cuda::library::{self, CudaLib, SearchPaths};
use memra_engine::cuda::nvrtc::{self, HeaderSet};
use memra_engine::cuda::{Error, SmArch};
use memra_engine::kernels::launch::{ArgKind, KernelArgs, check_params};
use memra_engine::kernels::registry::KernelVariant;

use library_common::{assert_missing_then_unloadable, empty_dir};

const SCALE_HEADER: &str = "#pragma once\nnamespace demo { template <int K> __device__ float scale(float v) { return v * K; } }\n";

static ADD_SCALED: KernelVariant = KernelVariant {
    name: "demo_add__k3",
    family: "demo_add",
    arch: None,
    params: &[],
    source: "#include \"demo/scale.cuh\"\n\
             extern \"C\" __global__ void __launch_bounds__(128) demo_add__k3(const float* x, float* y, int n, float a) {\n\
               int i = blockIdx.x * blockDim.x + threadIdx.x;\n\
               if (i < n) y[i] = demo::scale<3>(x[i]) + a;\n\
             }\n",
};

fn headers() -> HeaderSet {
    HeaderSet::new(&[("demo/scale.cuh", SCALE_HEADER)])
}

#[test]
fn compiles_a_tiny_kernel_to_an_sm90_cubin() {
    let Some(lib) = library::nvrtc_or_skip("compiles_a_tiny_kernel_to_an_sm90_cubin") else { return };
    eprintln!("NVRTC {}.{} from {}", lib.version.0, lib.version.1, lib.lib.describe());
    let start = std::time::Instant::now();
    let cubin = nvrtc::compile_cubin(ADD_SCALED.name, ADD_SCALED.source, &headers(), SmArch(90)).expect("compiles");
    eprintln!("compiled in {:.0} ms, {} bytes", start.elapsed().as_secs_f64() * 1e3, cubin.bytes.len());
    assert_eq!(&cubin.bytes[..4], b"\x7fELF", "a CUBIN is an ELF image");
    // The ELF must name the entry point (the extern "C" symbol == the variant name).
    let symbol = ADD_SCALED.name.as_bytes();
    assert!(cubin.bytes.windows(symbol.len()).any(|w| w == symbol), "entry symbol missing from the cubin");
    let report = cubin.report();
    assert!(report.registers.is_some_and(|r| r > 0), "no register count in the log:\n{}", cubin.log);
    assert_eq!(report.spill_stores, Some(0), "log:\n{}", cubin.log);
    assert!(cubin.log.contains("sm_90"), "log should name the target:\n{}", cubin.log);
}

#[test]
fn compile_errors_carry_the_log_and_numbered_source() {
    if library::nvrtc_or_skip("compile_errors_carry_the_log_and_numbered_source").is_none() {
        return;
    }
    let source = "extern \"C\" __global__ void broken(float* y) {\n  y[0] = 1.0f\n  y[1] = demo::scale<2>(y[0]);\n}\n";
    let err = nvrtc::compile_cubin("broken", source, &headers(), SmArch(90)).unwrap_err();
    let Error::Compile { name, arch, log, listing } = &err else { panic!("expected a compile error, got {err}") };
    assert_eq!((name.as_str(), *arch), ("broken", SmArch(90)));
    assert!(log.contains("broken.cu("), "the log points into the source file:\n{log}");
    assert!(listing.contains("    2 |   y[0] = 1.0f"), "numbered source:\n{listing}");
    let text = err.to_string();
    assert!(text.starts_with("NVRTC failed to compile broken for sm_90"), "{text}");
}

#[test]
fn header_errors_list_the_header_too() {
    if library::nvrtc_or_skip("header_errors_list_the_header_too").is_none() {
        return;
    }
    let bad = HeaderSet::new(&[("demo/bad.cuh", "#pragma once\nint oops = ;\n")]);
    let err = nvrtc::compile_cubin("uses_bad", "#include \"demo/bad.cuh\"\n", &bad, SmArch(90)).unwrap_err().to_string();
    assert!(err.contains("--- demo/bad.cuh ---") && err.contains("    2 | int oops = ;"), "{err}");
}

#[test]
fn supported_archs_include_sm90() {
    if library::nvrtc_or_skip("supported_archs_include_sm90").is_none() {
        return;
    }
    let archs = nvrtc::supported_archs().unwrap();
    assert!(archs.contains(&90), "{archs:?}");
}

#[derive(KernelArgs)]
#[kernel_args(family = "demo_add")]
#[allow(dead_code)]
struct DemoAddArgs<'a> {
    x: &'a CudaSlice<f32>,
    y: &'a mut CudaSlice<f32>,
    n: i32,
    a: f32,
}

#[derive(KernelArgs)]
#[kernel_args(family = "demo_add")]
#[allow(dead_code)]
struct SwappedArgs<'a> {
    x: &'a CudaSlice<f32>,
    y: &'a mut CudaSlice<f32>,
    a: f32,
    n: i32,
}

#[derive(KernelArgs)]
#[kernel_args(family = "demo_add")]
#[allow(dead_code)]
struct MissingArgs<'a> {
    x: &'a CudaSlice<f32>,
    y: &'a mut CudaSlice<f32>,
    n: i32,
}

#[test]
fn derived_params_follow_field_order() {
    assert_eq!(DemoAddArgs::FAMILY, "demo_add");
    let kinds: Vec<(&str, ArgKind)> = DemoAddArgs::PARAMS.to_vec();
    assert_eq!(kinds, [("x", ArgKind::Ptr), ("y", ArgKind::Ptr), ("n", ArgKind::I32), ("a", ArgKind::F32)]);
}

#[test]
fn param_check_accepts_the_mirror_and_rejects_mismatches() {
    if library::nvrtc_or_skip("param_check_accepts_the_mirror_and_rejects_mismatches").is_none() {
        return;
    }
    let h = headers();
    assert_eq!(check_params::<DemoAddArgs>(&[&ADD_SCALED], &h, SmArch(90)).unwrap(), 1);
    let swapped = check_params::<SwappedArgs>(&[&ADD_SCALED], &h, SmArch(90)).unwrap_err().to_string();
    assert!(swapped.contains("parameter 2 is PTX `.u32` but field `a` is float"), "{swapped}");
    let missing = check_params::<MissingArgs>(&[&ADD_SCALED], &h, SmArch(90)).unwrap_err().to_string();
    assert!(missing.contains("takes 4 parameters, the struct has 3 fields"), "{missing}");
}

#[test]
fn discovery_error_lists_the_paths_tried() {
    let dir = empty_dir("no-nvrtc");
    let err = library::load(CudaLib::Nvrtc, &SearchPaths::only([dir.clone()])).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::LibraryNotFound { .. }), "{text}");
    assert!(text.contains(&format!("{} (given): not found", dir.join("libnvrtc.so.13").display())), "{text}");
    assert!(text.contains(&format!("{} (given): not found", dir.join("libnvrtc.so").display())), "{text}");
    assert!(text.contains("MEMRA_NVRTC_PATH"), "the error says how to fix it: {text}");

    let err = library::load(CudaLib::Driver, &SearchPaths::only([dir.clone()])).unwrap_err().to_string();
    assert!(err.contains(&dir.join("libcuda.so.1").display().to_string()), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn discovery_reports_files_that_do_not_load() {
    assert_missing_then_unloadable(CudaLib::Nvrtc, "bad-nvrtc", "libnvrtc.so.13", "MEMRA_NVRTC_PATH");
}
