//! Several GPUs of one host working on one model through NCCL collectives.
//!
//! **One thread per GPU, in one process.** Each rank is a thread that owns its device's `Gpu`
//! (context, stream, loaded kernels) and its [`Communicator`]; collectives are enqueued on that
//! GPU's stream like any kernel, so a decode step stays one stream per GPU and can still be
//! captured as a CUDA graph. Why threads rather than one process per GPU:
//! - the communicators come from one `ncclCommInitAll` call: no unique-id exchange, no launcher,
//!   no environment protocol between processes;
//! - the ranks share one GGUF memory map (the page cache is read once for all GPUs), one NVRTC
//!   disk cache and one compile of each variant, and one host-side synthetic-weight description;
//! - a failure on any rank comes back as an ordinary `Result` in the caller, and the logits of
//!   rank 0 need no IPC.
//!   The cost: a crash in one rank takes the whole process down (it would take the job down with
//!   processes too), and one host only; multi-node would need `ncclCommInitRank` with a unique
//!   id per process, which [`nccl`] can add without changing the collectives.
//!
//! NVLink multicast stays off: [`nccl::nccl`] sets `NCCL_NVLS_ENABLE=0` before NCCL is loaded
//! unless the user set it, and the process environment carries it into child processes. It also
//! sets `NCCL_RUNTIME_CONNECT=0` (unless set): channels connect at init, never inside the first
//! collective, which may be inside a decode step's CUDA graph capture.
//!
//! Modules: `nccl` (the library), `shard` (which part of each tensor a rank holds), `rank` (a
//! decoder's collectives and expert remap), `sharded` (a glm-dsa model on N GPUs).
//!
//! **Kernels at the per-GPU shapes.** The shard count is a build parameter: the spec's
//! `[parallel] shards = [2, 8]` (specs/glm-dsa.toml; schema in specs/README.md), replaced by
//! `MEMRA_SHARDS=2,4,8` at build time (`MEMRA_SHARDS=1`: none; cargo rebuilds when it
//! changes). For each count N the build plans the spec's `[[kernels]]` once more at a rank's
//! dims — heads/N (mla_rope, mla_decode, mla_sparse_decode), q_b rows/N, attn_output columns/N,
//! dense-FFN and shared-expert widths/N (matvec, matmul, swiglu, fused gate/up), LM-head rows/N
//! — named by the one naming function (`mla_decode__n_head32_…`, `matvec__k2048_n8192__q8_0`).
//! The split rules are spec data (`[tensors]` `split`, `[parallel] per_rank`), applied in one
//! place, `memra_codegen::shard`: the ranks cut the weights by them ([`shard`]) and the planner
//! the dims. Nothing else changes at run time: a rank asks the
//! registry for its shapes like one GPU does and gets those variants; its load report line
//! says whether this build planned its GPU count (else the differing shapes run generic and
//! `--require-specialized` refuses). Shapes a rank keeps (the k_b/v_b heads and the experts,
//! whose kernels do not bake the head or expert count; router, indexer, argmax) add nothing:
//! 19 variants per GPU count at GLM-5 dims.
//!
//! A rank that fails before a collective leaves the others waiting in it on the GPU; callers
//! check every rank's setup at a barrier before the first collective ([`run_ranks`]).

pub mod nccl;
pub mod rank;
pub mod shard;
pub mod sharded;

use std::ffi::c_int;
use std::fmt;
use std::sync::{Arc, Barrier};

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t};

pub use nccl::{Nccl, nccl, nccl_or_skip};

/// What multi-GPU setup and collectives fail with; messages name the call, rank and sizes.
#[derive(Clone, Debug)]
pub enum Error {
    /// libnccl was not found (every path tried is listed), libcuda is missing, or a CUDA call
    /// around the collectives failed.
    Cuda(crate::cuda::Error),
    /// An NCCL call failed.
    Call { call: &'static str, detail: String },
    /// Fewer GPUs than asked for, or a bad device list.
    Devices { detail: String },
    /// Buffers whose sizes do not fit the collective.
    Sizes { call: &'static str, detail: String },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Cuda(e) => write!(f, "{e}"),
            Error::Call { call, detail } => write!(f, "NCCL {call} failed: {detail}"),
            Error::Devices { detail } => write!(f, "{detail}"),
            Error::Sizes { call, detail } => write!(f, "NCCL {call}: {detail}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<crate::cuda::Error> for Error {
    fn from(e: crate::cuda::Error) -> Self {
        Error::Cuda(e)
    }
}

impl From<Error> for crate::models::gpu::GpuModelError {
    fn from(e: Error) -> Self {
        crate::models::gpu::GpuModelError(e.to_string())
    }
}

/// How many CUDA devices there are, and an error saying so when fewer than `n` (a clear message
/// for `--gpus N` and for tests that need several GPUs).
pub fn require_devices(n: usize) -> Result<usize, Error> {
    if n == 0 {
        return Err(Error::Devices {
            detail: "--gpus must be at least 1".into(),
        });
    }
    crate::cuda::library::driver().map_err(Error::Cuda)?;
    let have = crate::cuda::Gpu::device_count();
    if have < n {
        return Err(Error::Devices {
            detail: format!(
                "{n} GPUs asked for, {have} CUDA device(s) visible (CUDA_VISIBLE_DEVICES={})",
                std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into())
            ),
        });
    }
    Ok(have)
}

/// The GPU counts whose per-rank shapes this build specialized kernels for (glm-dsa, the one
/// architecture with a multi-GPU forward).
pub fn planned_shards() -> &'static [usize] {
    crate::kernels::registry::SHARDS_FOR
        .iter()
        .find(|(arch, _)| *arch == "glm-dsa")
        .map_or(&[], |(_, counts)| *counts)
}

/// One rank's NCCL communicator. `Send` so its rank's thread can own it; not `Sync`: NCCL
/// forbids concurrent calls on one communicator.
pub struct Communicator {
    comm: ncclComm_t,
    rank: usize,
    n_ranks: usize,
    device: usize,
    nccl: &'static Nccl,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time (`!Sync`).
unsafe impl Send for Communicator {}

impl fmt::Debug for Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Communicator(rank {}/{}, device {})",
            self.rank, self.n_ranks, self.device
        )
    }
}

impl Communicator {
    /// One communicator per device of `devices` (CUDA ordinals, rank i = `devices[i]`), created
    /// together by `ncclCommInitAll`. Loads NCCL (NVLS off) and checks the devices exist.
    pub fn init_all(devices: &[usize]) -> Result<Vec<Communicator>, Error> {
        let max = devices
            .iter()
            .copied()
            .max()
            .ok_or_else(|| Error::Devices {
                detail: "no devices given".into(),
            })?;
        let mut seen = devices.to_vec();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != devices.len() {
            return Err(Error::Devices {
                detail: format!("device list {devices:?} names a device twice"),
            });
        }
        require_devices(max + 1)?;
        let nccl = nccl()?;
        let list: Vec<c_int> = devices.iter().map(|&d| d as c_int).collect();
        let mut comms: Vec<ncclComm_t> = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `comms` has one slot per device in `list`.
        let rc = unsafe {
            (nccl.api.comm_init_all)(comms.as_mut_ptr(), list.len() as c_int, list.as_ptr())
        };
        nccl.check("ncclCommInitAll", rc, None)
            .map_err(|e| match e {
                Error::Call { call, detail } => Error::Call {
                    call,
                    detail: format!("{detail} (devices {devices:?}; NCCL_DEBUG=WARN says more)"),
                },
                e => e,
            })?;
        let comms: Vec<Communicator> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| Communicator {
                comm,
                rank,
                n_ranks: devices.len(),
                device: devices[rank],
                nccl,
            })
            .collect();
        for c in &comms {
            let mut count: c_int = 0;
            // SAFETY: a live communicator and a valid out pointer.
            let rc = unsafe { (nccl.api.comm_count)(c.comm, &mut count) };
            nccl.check("ncclCommCount", rc, Some(c.comm))?;
            if count as usize != devices.len() {
                return Err(Error::Call {
                    call: "ncclCommCount",
                    detail: format!(
                        "rank {} sees {count} ranks, {} expected",
                        c.rank,
                        devices.len()
                    ),
                });
            }
        }
        Ok(comms)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn n_ranks(&self) -> usize {
        self.n_ranks
    }

    /// The CUDA ordinal this rank's collectives run on (its `Gpu` must be on the same device).
    pub fn device(&self) -> usize {
        self.device
    }

    fn check_stream(&self, call: &'static str, stream: &CudaStream) -> Result<(), Error> {
        let ordinal = stream.context().ordinal();
        if ordinal != self.device {
            return Err(Error::Sizes {
                call,
                detail: format!(
                    "rank {} is on device {}, the stream on device {ordinal}",
                    self.rank, self.device
                ),
            });
        }
        Ok(())
    }

    /// In place: every rank's `buf` becomes the element-wise sum of all ranks' `buf`, enqueued on
    /// `stream`. Every rank must call it with the same length, in the same order.
    pub fn all_reduce_sum_f32<B: DevicePtrMut<f32>>(
        &self,
        stream: &Arc<CudaStream>,
        buf: &mut B,
    ) -> Result<(), Error> {
        self.check_stream("ncclAllReduce", stream)?;
        let n = buf.len();
        let (ptr, _sync) = buf.device_ptr_mut(stream);
        // SAFETY: `ptr` holds `n` f32 on this rank's device; send == recv is NCCL's in-place mode.
        let rc = unsafe {
            (self.nccl.api.all_reduce)(
                ptr as *const _,
                ptr as *mut _,
                n,
                ncclDataType_t::ncclFloat32,
                ncclRedOp_t::ncclSum,
                self.comm,
                stream.cu_stream(),
            )
        };
        self.nccl.check("ncclAllReduce", rc, Some(self.comm))
    }

    /// `recv = [send of rank 0 | send of rank 1 | ...]` on every rank, enqueued on `stream`;
    /// `recv.len()` must be `n_ranks · send.len()`.
    pub fn all_gather_f32<S: DevicePtr<f32>, R: DevicePtrMut<f32>>(
        &self,
        stream: &Arc<CudaStream>,
        send: &S,
        recv: &mut R,
    ) -> Result<(), Error> {
        self.check_stream("ncclAllGather", stream)?;
        let n = send.len();
        if recv.len() != n * self.n_ranks {
            return Err(Error::Sizes {
                call: "ncclAllGather",
                detail: format!(
                    "rank {}: {} receive elements for {} ranks × {n} sent",
                    self.rank,
                    recv.len(),
                    self.n_ranks
                ),
            });
        }
        let (src, _s) = send.device_ptr(stream);
        let (dst, _d) = recv.device_ptr_mut(stream);
        // SAFETY: sizes checked above; both buffers live on this rank's device.
        unsafe { self.gather(stream, src, dst, n) }
    }

    /// ncclAllGather of `n` f32 from `src` into `dst` (`n_ranks·n`).
    ///
    /// # Safety
    /// Both device addresses are valid on this rank's device for those sizes.
    unsafe fn gather(
        &self,
        stream: &CudaStream,
        src: u64,
        dst: u64,
        n: usize,
    ) -> Result<(), Error> {
        // SAFETY: the caller's contract.
        let rc = unsafe {
            (self.nccl.api.all_gather)(
                src as *const _,
                dst as *mut _,
                n,
                ncclDataType_t::ncclFloat32,
                self.comm,
                stream.cu_stream(),
            )
        };
        self.nccl.check("ncclAllGather", rc, Some(self.comm))
    }

    /// In place: `buf` is `n_ranks` equal blocks; each rank's own block (written before) ends up
    /// in every rank's `buf` at its position.
    pub fn all_gather_in_place_f32<B: DevicePtrMut<f32>>(
        &self,
        stream: &Arc<CudaStream>,
        buf: &mut B,
    ) -> Result<(), Error> {
        self.check_stream("ncclAllGather", stream)?;
        let total = buf.len();
        if total % self.n_ranks != 0 {
            return Err(Error::Sizes {
                call: "ncclAllGather",
                detail: format!(
                    "{total} elements do not split into {} equal blocks",
                    self.n_ranks
                ),
            });
        }
        let n = total / self.n_ranks;
        let (dst, _d) = buf.device_ptr_mut(stream);
        let src = dst + (self.rank * n * std::mem::size_of::<f32>()) as u64;
        // SAFETY: `dst` holds n_ranks·n f32 on this rank's device; send = recv + rank·n is
        // NCCL's in-place all-gather.
        unsafe { self.gather(stream, src, dst, n) }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // SAFETY: the communicator is live and dropped once; ncclCommDestroy waits for its work.
        let rc = unsafe { (self.nccl.api.comm_destroy)(self.comm) };
        if let Err(e) = self.nccl.check("ncclCommDestroy", rc, None) {
            eprintln!("warning: rank {}: {e}", self.rank);
        }
    }
}

/// Runs `setup` then `work` on one thread per rank (rank order = `comms` order). Every rank's
/// setup must succeed before any rank starts `work` (which issues collectives): a rank whose
/// setup failed would leave the others blocked inside a collective. Returns the per-rank results,
/// or the first setup error (naming its rank).
pub fn run_ranks<S, R, E>(
    comms: Vec<Communicator>,
    setup: impl Fn(&Communicator) -> Result<S, E> + Sync,
    work: impl Fn(&Communicator, S) -> Result<R, E> + Sync,
) -> Result<Vec<R>, String>
where
    S: Send,
    R: Send,
    E: fmt::Display,
{
    let n = comms.len();
    let barrier = Barrier::new(n);
    let failed = std::sync::atomic::AtomicBool::new(false);
    let results: Vec<Result<R, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (setup, work, barrier, failed) = (&setup, &work, &barrier, &failed);
                scope.spawn(move || {
                    let rank = comm.rank();
                    let state = setup(&comm)
                        .map_err(|e| format!("rank {rank} (device {}): {e}", comm.device()));
                    if state.is_err() {
                        failed.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                    barrier.wait();
                    if failed.load(std::sync::atomic::Ordering::SeqCst) {
                        return Err(state.err().unwrap_or_else(|| {
                            format!("rank {rank}: not started (another rank's setup failed)")
                        }));
                    }
                    let state = state.expect("checked: no rank failed");
                    work(&comm, state)
                        .map_err(|e| format!("rank {rank} (device {}): {e}", comm.device()))
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join()
                    .unwrap_or_else(|_| Err(format!("rank {rank}: thread panicked")))
            })
            .collect()
    });
    let mut out = Vec::with_capacity(n);
    let mut errors = Vec::new();
    for r in results {
        match r {
            Ok(v) => out.push(v),
            Err(e) => errors.push(e),
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors.join("; "))
    }
}

/// Runs `f` between `ncclGroupStart` and `ncclGroupEnd`: one thread may then issue the
/// collectives of several ranks (each on its own communicator and stream) without deadlocking.
pub fn group<T>(f: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
    let nccl = nccl()?;
    // SAFETY: no arguments; paired with the ncclGroupEnd below on every path.
    nccl.check("ncclGroupStart", unsafe { (nccl.api.group_start)() }, None)?;
    let out = f();
    // SAFETY: closes the group opened above.
    let end = nccl.check("ncclGroupEnd", unsafe { (nccl.api.group_end)() }, None);
    let out = out?;
    end.map(|_| out)
}
