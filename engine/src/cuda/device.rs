//! `Gpu`: one device's context and stream, its architecture, and the kernel cache used to load
//! variants onto it.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream};
use cudarc::nvrtc::Ptx;

use super::cache::{CacheConfig, KernelCache};
use super::module::{self, CompiledVariant, Kernel, Kernels};
use super::nvrtc::{self, HeaderSet};
use super::{Error, SmArch, library};
use crate::kernels::registry::KernelVariant;

pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: SmArch,
    name: String,
    cache: KernelCache,
    headers: HeaderSet,
}

impl Gpu {
    /// Device `ordinal` with the cache from the environment (`MEMRA_CACHE`, `MEMRA_NO_NVRTC`).
    /// Fails with the paths tried when libcuda or NVRTC is missing; never panics.
    pub fn new(ordinal: usize) -> Result<Gpu, Error> {
        Gpu::with_cache(ordinal, CacheConfig::from_env())
    }

    pub fn with_cache(ordinal: usize, cache: CacheConfig) -> Result<Gpu, Error> {
        library::driver()?;
        library::nvrtc()?;
        let ctx = CudaContext::new(ordinal).map_err(|e| Error::driver(format!("cuInit/context for device {ordinal}"), e))?;
        let (major, minor) = ctx.compute_capability().map_err(|e| Error::driver("cuDeviceGetAttribute(compute capability)", e))?;
        let name = ctx.name().map_err(|e| Error::driver("cuDeviceGetName", e))?;
        // One explicit stream for all work: CUDA graphs cannot capture the legacy default
        // stream, and with a single stream cudarc's per-buffer event tracking only adds cost
        // (and events recorded during a capture would become graph nodes).
        // SAFETY: every buffer of this context is used on `stream` only (Gpu hands out no other),
        // so no cross-stream synchronization is needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| Error::driver("cuStreamCreate", e))?;
        Ok(Gpu {
            ctx,
            stream,
            arch: SmArch((major * 10 + minor) as u32),
            name,
            cache: KernelCache::new(cache),
            headers: HeaderSet::registry(),
        })
    }

    /// How many CUDA devices the driver sees (0 without a driver or GPU; never panics).
    pub fn device_count() -> usize {
        if library::driver().is_err() {
            return 0;
        }
        cudarc::driver::result::init().ok().and_then(|_| CudaContext::device_count().ok()).unwrap_or(0).max(0) as usize
    }

    pub fn ctx(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn arch(&self) -> SmArch {
        self.arch
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Compiles a small self-contained helper source (no templates, not a planned variant: the
    /// synthetic-weight generators, the expert remap) for this device and loads `functions`
    /// from it, in order. Errors name the file or the function.
    pub fn load_functions(&self, file: &str, source: &str, functions: &[&str]) -> Result<Vec<CudaFunction>, Error> {
        let cubin = nvrtc::compile_cubin(file, source, &HeaderSet::new(&[]), self.arch)?;
        let module =
            self.ctx.load_module(Ptx::from_binary(cubin.bytes)).map_err(|e| Error::driver(format!("cuModuleLoadData ({file})"), e))?;
        functions
            .iter()
            .map(|f| module.load_function(f).map_err(|e| Error::driver(format!("cuModuleGetFunction {f} ({file})"), e)))
            .collect()
    }

    pub fn cache(&self) -> &KernelCache {
        &self.cache
    }

    /// Compiles (cache-aware, in parallel) and loads `variants`. Fails on the first kernel that
    /// does not compile or load (all compile errors are printed).
    pub fn load(&self, variants: &[&'static KernelVariant]) -> Result<Kernels, Error> {
        Ok(self.load_reporting(variants)?.0)
    }

    /// [`Gpu::load`], also returning where each cubin came from and how long it took.
    pub fn load_reporting(&self, variants: &[&'static KernelVariant]) -> Result<(Kernels, Vec<CompiledVariant>), Error> {
        let results = module::compile_variants(&self.cache, variants, &self.headers, self.arch);
        let compiled = module::first_error(results)?;
        let kernels = module::load_modules(&self.ctx, &self.stream, &compiled)?;
        Ok((kernels, compiled))
    }

    /// One variant, loaded on its own (tests, tools).
    pub fn load_one(&self, variant: &'static KernelVariant) -> Result<Kernel, Error> {
        let mut kernels = self.load(&[variant])?;
        kernels.remove(variant.name).ok_or_else(|| Error::NoSuchKernel { name: variant.name.to_string(), loaded: Vec::new() })
    }

    /// Streaming multiprocessors (sizes split-K grids).
    pub fn sm_count(&self) -> Result<usize, Error> {
        use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        let n = self.ctx.attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(|e| Error::driver("cuDeviceGetAttribute(multiprocessor count)", e))?;
        Ok(n.max(1) as usize)
    }

    /// Waits for all work on the stream.
    pub fn sync(&self) -> Result<(), Error> {
        self.stream.synchronize().map_err(|e| Error::driver("cuStreamSynchronize", e))
    }
}

/// The architecture of device `ordinal`, without creating a `Gpu` (no NVRTC needed).
pub fn device_arch(ordinal: usize) -> Result<SmArch, Error> {
    library::driver()?;
    let ctx = CudaContext::new(ordinal).map_err(|e| Error::driver(format!("cuInit/context for device {ordinal}"), e))?;
    let (major, minor) = ctx.compute_capability().map_err(|e| Error::driver("cuDeviceGetAttribute(compute capability)", e))?;
    Ok(SmArch((major * 10 + minor) as u32))
}
