//! What a decoder needs to run as one rank of a tensor- and expert-parallel model: its
//! communicator, its shard, and the expert-parallel id remap, attached to the rank's `Gpu`.
//!
//! Expert parallelism, minimum viable form: every rank runs the (replicated) router on the same
//! all-reduced hidden state, so all ranks select the same experts bit for bit. `ep_localize`
//! then rewrites each selected id to the rank's local expert index, or — for an expert another
//! rank holds — to local expert 0 with routing weight 0: the fused gate/up/down kernels run
//! unchanged over the rank's `E/N` experts and the foreign slots add exactly 0 (weights are
//! finite). The down products' partial sums are all-reduced. Cost: a rank computes all
//! `n_used` slots, the foreign ones re-reading local expert 0 (from L2 after the first); a
//! kernel that skips foreign slots would save that compute.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use super::Communicator;
use super::shard::Shard;
use crate::cuda::Gpu;
use crate::models::gpu::{Result, err};

/// The NVRTC source of the id remap (waits on a programmatic edge like every memra kernel).
pub const LOCALIZE: &str = r#"
extern "C" __global__ void ep_localize(int* ids, float* weights, int n, int lo, int count) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int e = ids[i] - lo;
    bool mine = e >= 0 && e < count;
    ids[i] = mine ? e : 0;
    if (!mine) weights[i] = 0.0f;
}
"#;

/// Handed to `MlaDecoder::load_rank`: which rank, its communicator.
pub struct RankSpec {
    pub comm: Communicator,
    pub shard: Shard,
    /// The routed experts this rank holds (`None`: no MoE layers).
    pub experts: Option<Range<usize>>,
}

/// A [`RankSpec`] attached to the rank's GPU.
pub struct Rank {
    comm: Communicator,
    pub shard: Shard,
    experts: Option<Range<usize>>,
    stream: Arc<CudaStream>,
    localize: Option<CudaFunction>,
}

impl RankSpec {
    /// Checks the GPU is the communicator's device and compiles the remap kernel on it.
    pub fn attach(self, gpu: &Gpu) -> Result<Rank> {
        let ordinal = gpu.ctx().ordinal();
        if ordinal != self.comm.device() {
            return Err(err(format!(
                "rank {}: its communicator is on device {}, the model on device {ordinal}",
                self.shard.rank,
                self.comm.device()
            )));
        }
        let localize = match self.experts {
            Some(_) => gpu
                .load_functions("memra_ep_localize.cu", LOCALIZE, &["ep_localize"])?
                .pop(),
            None => None,
        };
        Ok(Rank {
            comm: self.comm,
            shard: self.shard,
            experts: self.experts,
            stream: gpu.stream().clone(),
            localize,
        })
    }
}

impl Rank {
    /// `buf[..n]` summed over all ranks, in place, on the rank's stream.
    pub fn all_reduce(&self, buf: &mut CudaSlice<f32>, n: usize) -> Result<()> {
        let mut view = buf.slice_mut(..n);
        Ok(self.comm.all_reduce_sum_f32(&self.stream, &mut view)?)
    }

    /// `buf` as `n_ranks` equal row blocks, this rank's written: every block gathered, in place.
    pub fn gather_rows(&self, buf: &mut CudaSlice<f32>) -> Result<()> {
        Ok(self.comm.all_gather_in_place_f32(&self.stream, buf)?)
    }

    /// One eager all-reduce of a decode step's and a prefill chunk's size and the logits
    /// all-gather, waited for: the step's collectives then never run first inside a graph
    /// capture. Every rank must call it together.
    pub fn warm_up(&self, gpu: &Gpu, n_embd: usize, chunk: usize, n_vocab: usize) -> Result<()> {
        let mut buf =
            crate::models::gpu::alloc::<f32>(gpu, (chunk * n_embd).max(n_vocab), "NCCL warm-up")?;
        self.all_reduce(&mut buf, n_embd)?;
        self.all_reduce(&mut buf, chunk * n_embd)?;
        if n_vocab % self.shard.n_ranks == 0 {
            let mut logits = buf.slice_mut(..n_vocab);
            self.comm
                .all_gather_in_place_f32(&self.stream, &mut logits)?;
        }
        Ok(gpu.sync()?)
    }

    /// Routed experts on this rank (the expert kernels' `n_expert`).
    pub fn local_experts(&self) -> usize {
        self.experts.as_ref().map_or(0, |r| r.len())
    }

    /// Rewrites `n` selected expert ids to local indices (foreign ones: index 0, weight 0).
    pub fn localize(
        &self,
        ids: &mut CudaSlice<i32>,
        weights: &mut CudaSlice<f32>,
        n: usize,
    ) -> Result<()> {
        let (Some(f), Some(r)) = (&self.localize, &self.experts) else {
            return Err(err("expert remap on a rank without routed experts"));
        };
        if ids.len() < n || weights.len() < n {
            return Err(err(format!(
                "ep_localize: {n} slots, buffers of {} ids / {} weights",
                ids.len(),
                weights.len()
            )));
        }
        let (n32, lo, count) = (n as i32, r.start as i32, r.len() as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(ids).arg(weights).arg(&n32).arg(&lo).arg(&count);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(128) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: ids and weights hold ≥ n elements (checked); the kernel touches only [0, n).
        unsafe { b.launch(cfg) }.map_err(|e| err(format!("ep_localize: {e:?}")))?;
        Ok(())
    }

    /// One line for the load report.
    pub fn describe(&self, n_head_local: usize) -> String {
        let s = self.shard;
        let heads = s.rank * n_head_local..(s.rank + 1) * n_head_local;
        let experts = self
            .experts
            .as_ref()
            .map_or("none".to_string(), |r| format!("{}..{}", r.start, r.end));
        format!(
            "rank {} of {} on device {}: attention heads {}..{}, routed experts {experts}; attention and FFN outputs all-reduced (NCCL); {}",
            s.rank,
            s.n_ranks,
            self.comm.device(),
            heads.start,
            heads.end,
            shard_kernels_line(s.n_ranks, super::planned_shards())
        )
    }
}

/// Whether this build has specialized variants at the per-GPU shapes of `n_ranks` GPUs (the
/// kernel report above counts what was picked; this says why the shard shapes are or are not).
pub fn shard_kernels_line(n_ranks: usize, planned: &[usize]) -> String {
    if planned.contains(&n_ranks) {
        format!(
            "kernels specialized for the {n_ranks}-GPU shard shapes (this build plans {planned:?} GPUs)"
        )
    } else {
        format!(
            "this build has no {n_ranks}-GPU shard variants (it plans {planned:?} GPUs): the per-GPU shapes run generic; rebuild with MEMRA_SHARDS={n_ranks} or add {n_ranks} to [parallel] shards in specs/glm-dsa.toml"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::shard_kernels_line;

    #[test]
    fn the_report_says_whether_shard_shapes_are_specialized() {
        let yes = shard_kernels_line(2, &[2, 8]);
        assert!(
            yes.contains("specialized for the 2-GPU shard shapes"),
            "{yes}"
        );
        let no = shard_kernels_line(4, &[2, 8]);
        assert!(
            no.contains("no 4-GPU shard variants") && no.contains("MEMRA_SHARDS=4"),
            "{no}"
        );
    }
}
