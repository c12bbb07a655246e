//! A glm-dsa model on N GPUs: one worker thread per GPU owns that rank's `MlaDecoder` (loaded
//! with its shard of the weights, `shard.rs`, and its communicator, `rank.rs`); the caller's
//! thread broadcasts each command and waits for every rank's reply. All ranks run the same
//! step at the same time, so their collectives meet. Logits and argmax come from rank 0 (every
//! rank holds the same all-reduced residual stream and the whole LM head).
//!
//! Attention: heads split across the ranks (`n_head / N` per GPU: q_b, k_b, v_b rows and
//! attn_output columns), the output projection's partial sums all-reduced. The latent cache is
//! replicated: it is one 576-value row per token shared by every head, produced from the
//! replicated `attn_kv_a_mqa`, so sharding it by heads is impossible and by positions would add
//! a collective inside every attention launch; at 32k tokens it is 37 MB per layer. The DSA
//! indexer is replicated too (its 32 heads share one key cache and feed one top-k), so every rank
//! selects the same rows. Dense FFN / shared expert: gate and up row-split, down column-split,
//! all-reduced. Routed experts: expert-parallel (rank.rs). Per layer: one all-reduce after the
//! attention, one after a dense FFN, two after a MoE FFN (shared expert, routed experts); one
//! all-gather of the logits per step.
//!
//! Kernels: a rank's shapes that differ from the preset's — 64/N heads (mla_rope, mla_decode,
//! mla_sparse_decode), q_b's and the FFNs' N-times-smaller rows, attn_output's and ffn_down's
//! shorter rows, the LM head's vocabulary block — have specialized variants when the build
//! planned N (`[parallel] shards` / `MEMRA_SHARDS`, see the module doc of `crate::parallel`),
//! else run the generic ones (the rank's report line says which); the per-head absorption
//! (k_b, v_b), the routed experts, the router, the indexer and argmax keep the 1-GPU variants
//! (their dims do not change).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::ops::Range;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Barrier, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use memra_gguf::GgufFile;

use super::rank::RankSpec;
use super::shard::{Shard, ShardSource, SliceSource};
use super::{Communicator, require_devices};
use crate::models::gpu::{Result, err};
use crate::models::mla::MlaDecoder;
use crate::models::{GpuModel, GpuOptions, glm_dsa};
use crate::synthetic::{Description, SyntheticWeights};

/// Where the weights come from.
#[derive(Clone)]
pub enum Weights {
    /// A GGUF file (each rank maps it and copies its windows).
    File(PathBuf),
    /// The synthetic generator (`memra bench --synthetic`), the same seed on every rank.
    Synthetic { desc: Arc<Description>, seed: u64 },
}

enum Cmd {
    Forward(Vec<u32>),
    Logits,
    Argmax,
    Sync,
    Reset,
    /// Synthetic caches filled to this many positions (`MlaDecoder::assume_cached`).
    FillCache(usize),
    /// One eager round of the collectives (`MlaDecoder::warm_up_rank`).
    WarmUp,
}

enum Reply {
    Loaded(Result<Loaded>),
    Unit(Result<()>),
    Logits(Result<Vec<f32>>),
    Argmax(Result<u32>),
}

struct Loaded {
    report: Vec<String>,
    max_ctx: usize,
    n_vocab: usize,
    weight_bytes: usize,
}

struct Worker {
    cmds: Sender<Cmd>,
    handle: Option<JoinHandle<()>>,
}

/// The model on N GPUs (see the module doc).
pub struct ShardedMla {
    workers: Vec<Worker>,
    /// Every rank's replies, tagged with the rank: the first failure is seen as it happens,
    /// not after the ranks before it (which may wait in a collective the failed rank left).
    replies: Receiver<(usize, Reply)>,
    report: Vec<String>,
    len: usize,
    max_ctx: usize,
    n_vocab: usize,
    weight_bytes: usize,
    /// Set when a rank failed inside a step: the other ranks may wait in a collective forever,
    /// so the model refuses further work and its drop does not wait for them.
    broken: Mutex<Option<String>>,
}

/// With CUDA graphs on several GPUs (`MEMRA_SHARDED_GRAPHS=1`), every forward starts on all
/// ranks together with their streams idle: a graph holding NCCL calls is a collective launch
/// (each rank must launch the graph of the same capture), and no eager collective (prefill,
/// warm-up) may still run on a communicator when one of its graphs is launched. Costs one host
/// sync per step on each rank (a decode step is synchronized by the caller anyway). On the H200
/// (2 GPUs, session 6) the glm-5-dims test hung in its first graph step with
/// `NCCL_GRAPH_MIXING_SUPPORT=0`, while with NCCL's default (1) the micro model's graph steps
/// matched one GPU; so NCCL's default stays.
pub struct StepGate {
    barrier: Barrier,
    /// Sticky: a rank that could not reach an idle stream makes every later step fail on all
    /// ranks (instead of the others launching collectives it will never join).
    failed: AtomicBool,
}

impl StepGate {
    pub fn new(n_ranks: usize) -> StepGate {
        StepGate {
            barrier: Barrier::new(n_ranks),
            failed: AtomicBool::new(false),
        }
    }

    /// Every rank calls it before a forward with its stream sync's result; all return together,
    /// each with an error when any rank's sync failed.
    pub fn enter(&self, idle: Result<()>) -> Result<()> {
        if idle.is_err() {
            self.failed.store(true, Ordering::SeqCst);
        }
        self.barrier.wait();
        idle?;
        if self.failed.load(Ordering::SeqCst) {
            return Err(err(
                "another rank failed before this step; the multi-GPU model is unusable",
            ));
        }
        Ok(())
    }
}

#[allow(clippy::too_many_arguments)]
fn rank_main(
    comm: Communicator,
    weights: Weights,
    file: Arc<GgufFile>,
    label: PathBuf,
    mut opts: GpuOptions,
    gate: Option<Arc<StepGate>>,
    cmds: Receiver<Cmd>,
    replies: Sender<(usize, Reply)>,
) {
    let (rank, n_ranks) = (comm.rank(), comm.n_ranks());
    opts.device = comm.device();
    let synth = match &weights {
        Weights::Synthetic { desc, seed } => Some(SyntheticWeights::new(desc, *seed)),
        Weights::File(_) => None,
    };
    let loaded = (|| {
        let src: &dyn SliceSource = match &synth {
            Some(s) => s,
            None => &*file,
        };
        let arch = file
            .architecture()
            .map_err(|e| err(format!("{}: {e}", label.display())))?;
        let shard = Shard::new(arch, rank, n_ranks)?;
        let mut spec = glm_dsa::mla_spec(&label, &file)?;
        let experts = shard.experts(&spec.config)?;
        spec.config = shard.config(&spec.config)?;
        let rank = RankSpec {
            comm,
            shard,
            experts,
        };
        MlaDecoder::load_rank(&label, &ShardSource { src, shard }, spec, &opts, Some(rank))
    })();
    let mut model = match loaded {
        Ok(m) => {
            let info = Loaded {
                report: m.report().to_vec(),
                max_ctx: m.max_ctx(),
                n_vocab: m.n_vocab(),
                weight_bytes: m.weight_bytes(),
            };
            if replies.send((rank, Reply::Loaded(Ok(info)))).is_err() {
                return;
            }
            m
        }
        Err(e) => {
            let _ = replies.send((rank, Reply::Loaded(Err(e))));
            return;
        }
    };
    while let Ok(cmd) = cmds.recv() {
        let reply = match cmd {
            Cmd::Forward(tokens) => Reply::Unit(match &gate {
                Some(g) => g.enter(model.sync()).and_then(|()| model.forward(&tokens)),
                None => model.forward(&tokens),
            }),
            Cmd::Logits => Reply::Logits(model.logits()),
            Cmd::Argmax => Reply::Argmax(model.argmax()),
            Cmd::Sync => Reply::Unit(model.sync()),
            Cmd::WarmUp => Reply::Unit(model.warm_up_rank()),
            Cmd::Reset => {
                model.reset();
                Reply::Unit(Ok(()))
            }
            Cmd::FillCache(len) => Reply::Unit(match &synth {
                Some(s) => model.assume_cached(len, &mut |gpu, il, latent, keys| {
                    s.fill_cache(gpu, il, latent, keys)
                }),
                None => Err(err("filling the caches needs synthetic weights")),
            }),
        };
        if replies.send((rank, reply)).is_err() {
            return;
        }
    }
}

/// How long one command may take on the ranks before the model calls itself broken:
/// `MEMRA_RANK_TIMEOUT_S` seconds, 900 by default (a long prefill on many layers stays well
/// under it; a collective that waits for a rank which will never join does not end at all).
fn reply_timeout() -> Duration {
    let secs = std::env::var("MEMRA_RANK_TIMEOUT_S").ok().and_then(|v| v.parse::<u64>().ok()).filter(|&s| s > 0);
    Duration::from_secs(secs.unwrap_or(900))
}

/// The replies of `ranks` to one command, in rank order. The first failed reply returns at
/// once, naming its rank (the others may wait in a collective it left); so does a deadline
/// passed (naming the ranks that did not answer), every worker gone, or a reply from a rank
/// that was not asked.
fn collect_replies(replies: &Receiver<(usize, Reply)>, ranks: Range<usize>, timeout: Duration) -> std::result::Result<Vec<Reply>, String> {
    let deadline = Instant::now() + timeout;
    let mut got: Vec<Option<Reply>> = ranks.clone().map(|_| None).collect();
    for _ in ranks.clone() {
        let (r, reply) = match replies.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(m) => m,
            Err(RecvTimeoutError::Timeout) => {
                let silent: Vec<usize> = ranks.clone().filter(|r| got[r - ranks.start].is_none()).collect();
                return Err(format!(
                    "rank(s) {silent:?} did not answer within {} s (stuck in a collective? MEMRA_RANK_TIMEOUT_S sets the limit)",
                    timeout.as_secs_f64()
                ));
            }
            Err(RecvTimeoutError::Disconnected) => return Err("every worker thread has ended".to_string()),
        };
        let failed = match &reply {
            Reply::Unit(Err(e)) => Some(e.to_string()),
            Reply::Logits(Err(e)) => Some(e.to_string()),
            Reply::Argmax(Err(e)) => Some(e.to_string()),
            _ => None,
        };
        if let Some(e) = failed {
            return Err(format!("rank {r}: {e}"));
        }
        match got.get_mut(r.wrapping_sub(ranks.start)) {
            Some(slot @ None) => *slot = Some(reply),
            _ => return Err(format!("rank {r}: a reply nobody asked for")),
        }
    }
    Ok(got.into_iter().map(|g| g.expect("one reply per asked rank")).collect())
}

impl ShardedMla {
    /// Loads a glm-dsa model split over GPUs `0..n_gpus` (one NCCL communicator each; NVLS off).
    /// Errors name the rank; a head or expert count that `n_gpus` does not divide is refused.
    pub fn load(
        weights: Weights,
        label: &Path,
        n_gpus: usize,
        opts: &GpuOptions,
    ) -> Result<ShardedMla> {
        if n_gpus < 2 {
            return Err(err(format!(
                "a sharded model needs at least 2 GPUs (--gpus {n_gpus}); one GPU runs the ordinary path"
            )));
        }
        // Decode steps captured as CUDA graphs that hold the NCCL calls hung on the H200 (2 GPUs,
        // 2026-11-30) while eager steps passed the same 2-GPU test: graphs stay off here unless
        // MEMRA_SHARDED_GRAPHS=1 asks for them (then with the step gate, `StepGate`).
        let graphs_asked = opts.graphs;
        let graphs = graphs_asked && std::env::var("MEMRA_SHARDED_GRAPHS").is_ok_and(|v| v == "1");
        // NCCL's kernels do not wait on programmatic graph edges: no PDL across ranks.
        let opts = &GpuOptions {
            graphs,
            pdl: false,
            ..opts.clone()
        };
        // Refuse counts that do not split before any GPU or NCCL work.
        let header = match &weights {
            Weights::File(p) => {
                GgufFile::open(p).map_err(|e| err(format!("{}: {e}", p.display())))?
            }
            Weights::Synthetic { desc, .. } => desc.open().map_err(err)?,
        };
        super::shard::check_split(label, &header, n_gpus)?;
        // One mapping for all ranks (a synthetic header is one temporary file per process).
        let header = Arc::new(header);
        require_devices(n_gpus)?;
        let comms = Communicator::init_all(&(0..n_gpus).collect::<Vec<_>>())?;
        let gate = graphs.then(|| Arc::new(StepGate::new(n_gpus)));
        let mut workers = Vec::with_capacity(n_gpus);
        let (rep_tx, replies) = channel();
        for comm in comms {
            let (cmd_tx, cmd_rx) = channel();
            let rep_tx = rep_tx.clone();
            let (weights, label, opts) = (weights.clone(), label.to_path_buf(), opts.clone());
            let gate = gate.clone();
            let file = header.clone();
            let name = format!("memra-rank{}", comm.rank());
            let handle = std::thread::Builder::new()
                .name(name)
                .spawn(move || rank_main(comm, weights, file, label, opts, gate, cmd_rx, rep_tx))
                .map_err(|e| err(format!("spawning a GPU worker thread: {e}")))?;
            workers.push(Worker {
                cmds: cmd_tx,
                handle: Some(handle),
            });
        }
        drop(rep_tx);
        let mut model = ShardedMla {
            workers,
            replies,
            report: Vec::new(),
            len: 0,
            max_ctx: 0,
            n_vocab: 0,
            weight_bytes: 0,
            broken: Mutex::new(None),
        };
        let mut errors = Vec::new();
        let mut infos: Vec<Option<Loaded>> = (0..n_gpus).map(|_| None).collect();
        for _ in 0..n_gpus {
            match model.replies.recv() {
                Ok((rank, Reply::Loaded(Ok(info)))) => infos[rank] = Some(info),
                Ok((rank, Reply::Loaded(Err(e)))) => errors.push(format!("rank {rank}: {e}")),
                Ok((rank, _)) => errors.push(format!("rank {rank}: unexpected reply while loading")),
                Err(_) => {
                    errors.push("the worker threads ended while loading".to_string());
                    break;
                }
            }
        }
        for (rank, info) in infos.into_iter().enumerate() {
            match info {
                Some(info) => {
                    if rank == 0 {
                        model.report = info.report.clone();
                        (model.max_ctx, model.n_vocab) = (info.max_ctx, info.n_vocab);
                    } else if let Some(line) = info.report.iter().find(|l| l.starts_with("rank ")) {
                        model.report.push(line.clone());
                    }
                    model.weight_bytes += info.weight_bytes;
                }
                None if errors.is_empty() => errors.push(format!("rank {rank}: no reply while loading")),
                None => {}
            }
        }
        if !errors.is_empty() {
            errors.sort();
            return Err(err(errors.join("\n")));
        }
        // Every rank is loaded: the first collectives now run eagerly, not in a graph capture.
        model.all_units(|| Cmd::WarmUp, "NCCL warm-up")?;
        model.report.push(format!(
            "{n_gpus} GPUs, one worker thread each; weights {} in all",
            crate::models::gpu::mib(model.weight_bytes)
        ));
        if graphs_asked && !graphs {
            model.report.push(
                "decode steps run without CUDA graphs on several GPUs (graphs holding NCCL calls hung; MEMRA_SHARDED_GRAPHS=1 tries them)"
                    .to_string(),
            );
        }
        Ok(model)
    }

    /// Marks the model unusable (the other ranks may wait in a collective the failed one left)
    /// and returns `msg` as the error.
    fn fail(&self, msg: String) -> crate::models::gpu::GpuModelError {
        if let Ok(mut b) = self.broken.lock() {
            b.get_or_insert_with(|| msg.clone());
        }
        err(msg)
    }

    /// Sends `cmd()` to the ranks `ranks` and collects their replies in rank order. The first
    /// failed reply (or a rank that ended) returns at once, marking the model unusable:
    /// waiting for the other ranks could wait for ever.
    fn ask(&self, ranks: Range<usize>, cmd: impl Fn() -> Cmd) -> Result<Vec<Reply>> {
        if let Some(b) = self.broken.lock().map_err(|_| err("a worker panicked"))?.as_ref() {
            return Err(err(format!(
                "the multi-GPU model is unusable after an earlier failure: {b}"
            )));
        }
        for r in ranks.clone() {
            if self.workers[r].cmds.send(cmd()).is_err() {
                return Err(self.fail(format!("rank {r}: the worker thread has ended")));
            }
        }
        collect_replies(&self.replies, ranks, reply_timeout()).map_err(|m| self.fail(m))
    }

    /// Every rank's `()` result; the first failure names its rank ([`collect_replies`] returns
    /// it, so what reaches the check here is a unit or a reply of the wrong kind).
    fn all_units(&self, cmd: impl Fn() -> Cmd, what: &str) -> Result<()> {
        let replies = self
            .ask(0..self.workers.len(), cmd)
            .map_err(|e| err(format!("{what}: {e}")))?;
        match replies.iter().position(|r| !matches!(r, Reply::Unit(Ok(())))) {
            None => Ok(()),
            Some(r) => Err(self.fail(format!("{what}: rank {r}: unexpected reply"))),
        }
    }

    /// Random cache rows on every rank (the same on all) and `len` positions counted as cached.
    pub fn assume_cached(&mut self, len: usize) -> Result<()> {
        self.all_units(|| Cmd::FillCache(len), "filling the caches")?;
        self.len = len;
        Ok(())
    }

    pub fn n_gpus(&self) -> usize {
        self.workers.len()
    }
}

/// `memra run --gpus N`: a GGUF file split over GPUs `0..n_gpus` after the same header
/// validation as one GPU; glm-dsa only.
pub fn load_file(
    path: &Path,
    arch: &str,
    n_gpus: usize,
    opts: &GpuOptions,
) -> Result<Box<dyn GpuModel>> {
    if arch != "glm-dsa" {
        return Err(err(format!(
            "{}: multi-GPU runs (--gpus {n_gpus}) support glm-dsa only; this {arch} model runs on one GPU",
            path.display()
        )));
    }
    crate::models::validate::validate_path(path).map_err(|e| err(e.to_string()))?;
    Ok(Box::new(ShardedMla::load(
        Weights::File(path.to_path_buf()),
        path,
        n_gpus,
        opts,
    )?))
}

impl GpuModel for ShardedMla {
    fn forward(&mut self, tokens: &[u32]) -> Result<()> {
        let owned = tokens.to_vec();
        self.all_units(|| Cmd::Forward(owned.clone()), "forward")?;
        self.len += tokens.len();
        Ok(())
    }

    fn logits(&self) -> Result<Vec<f32>> {
        match self.ask(0..1, || Cmd::Logits)?.pop() {
            Some(Reply::Logits(r)) => r,
            _ => Err(err("rank 0: unexpected reply")),
        }
    }

    fn argmax(&self) -> Result<u32> {
        match self.ask(0..1, || Cmd::Argmax)?.pop() {
            Some(Reply::Argmax(r)) => r,
            _ => Err(err("rank 0: unexpected reply")),
        }
    }

    fn sync(&self) -> Result<()> {
        self.all_units(|| Cmd::Sync, "sync")
    }

    fn len(&self) -> usize {
        self.len
    }

    fn max_ctx(&self) -> usize {
        self.max_ctx
    }

    fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// All ranks' weights together.
    fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    fn reset(&mut self) {
        if self.all_units(|| Cmd::Reset, "reset").is_ok() {
            self.len = 0;
        }
    }

    fn report(&self) -> &[String] {
        &self.report
    }
}

impl Drop for ShardedMla {
    fn drop(&mut self) {
        let broken = self.broken.lock().map_or(true, |b| b.is_some());
        // Close every command channel before joining any worker: each worker's loop then ends
        // and its communicator is destroyed on all ranks together. Joining rank 0 while rank 1
        // still waits for commands hung on the H200 once graphs held NCCL calls (the destroy
        // waits for the peer).
        for w in &mut self.workers {
            let (tx, _) = channel();
            drop(std::mem::replace(&mut w.cmds, tx));
        }
        for w in &mut self.workers {
            if let Some(h) = w.handle.take()
                && !broken
            {
                let _ = h.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use memra_codegen::fixture;
    use memra_codegen::spec::ArchSpec;

    use super::*;

    fn micro_file(arch: &str) -> PathBuf {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let spec = ArchSpec::load(&root.join(format!("specs/{arch}.toml"))).unwrap();
        let path =
            std::env::temp_dir().join(format!("memra-sharded-{arch}-{}.gguf", std::process::id()));
        std::fs::write(&path, fixture::micro_model(&spec, 3).unwrap()).unwrap();
        path
    }

    /// Without GPUs (or NCCL) every refusal is an error that says why, never a panic or a hang.
    #[test]
    fn refusals_name_the_reason() {
        let opts = GpuOptions::default();
        let qwen = micro_file("qwen3");
        let e = load_file(&qwen, "qwen3", 2, &opts)
            .err()
            .expect("qwen3 on 2 GPUs")
            .to_string();
        assert!(e.contains("glm-dsa only"), "{e}");
        let glm = micro_file("glm-dsa");
        let e = ShardedMla::load(Weights::File(glm.clone()), &glm, 1, &opts)
            .err()
            .expect("1 GPU")
            .to_string();
        assert!(e.contains("at least 2 GPUs"), "{e}");
        // The micro model's 4 heads do not split over 3 GPUs: refused before any GPU work.
        let e = ShardedMla::load(Weights::File(glm.clone()), &glm, 3, &opts)
            .err()
            .expect("3 GPUs")
            .to_string();
        assert!(e.contains("3 equal parts"), "{e}");
        // 2 GPUs split the micro model; here the refusal is the missing devices (or NCCL).
        if crate::cuda::Gpu::device_count() < 2 {
            let e = ShardedMla::load(Weights::File(glm.clone()), &glm, 2, &opts)
                .err()
                .expect("no GPUs here")
                .to_string();
            assert!(e.contains("GPUs asked for") || e.contains("libcuda"), "{e}");
        }
        let _ = std::fs::remove_file(qwen);
        let _ = std::fs::remove_file(glm);
    }

    /// No rank blocks when one fails; all get the error, that step and every later one.
    #[test]
    fn the_step_gate_releases_every_rank_and_shares_a_failure() {
        let gate = std::sync::Arc::new(super::StepGate::new(3));
        let run = |fail_rank: Option<usize>| -> Vec<bool> {
            let handles: Vec<_> = (0..3)
                .map(|r| {
                    let g = gate.clone();
                    std::thread::spawn(move || {
                        let idle = if Some(r) == fail_rank {
                            Err(crate::models::gpu::err("sync failed"))
                        } else {
                            Ok(())
                        };
                        g.enter(idle).is_ok()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        };
        assert_eq!(run(None), [true, true, true]);
        assert_eq!(run(Some(1)), [false, false, false]);
        assert_eq!(run(None), [false, false, false], "the failure is sticky");
    }

    /// Replies come back in rank order whatever order they arrive in; a failed rank is reported
    /// at once even while another never answers; silence past the deadline names the silent
    /// ranks; gone workers and unasked replies are errors, never a hang or a panic.
    #[test]
    fn replies_are_collected_in_rank_order_and_never_wait_for_ever() {
        use std::time::{Duration, Instant};
        let unit = |r: Result<()>| Reply::Unit(r);
        let (tx, rx) = channel();
        for r in [2, 0, 1] {
            tx.send((r, unit(Ok(())))).unwrap();
        }
        let got = collect_replies(&rx, 0..3, Duration::from_secs(5)).unwrap();
        assert_eq!(got.len(), 3);
        assert!(got.iter().all(|g| matches!(g, Reply::Unit(Ok(())))));

        // Rank 1 fails, rank 0 never answers (stuck in the collective rank 1 left).
        tx.send((1, unit(Err(err("cuLaunchKernel failed"))))).unwrap();
        let start = Instant::now();
        let e = collect_replies(&rx, 0..2, Duration::from_secs(60)).err().unwrap();
        assert!(e.contains("rank 1") && e.contains("cuLaunchKernel failed"), "{e}");
        assert!(start.elapsed() < Duration::from_secs(10), "waited for the silent rank");

        // Nobody answers: the deadline names every silent rank.
        tx.send((1, unit(Ok(())))).unwrap();
        let e = collect_replies(&rx, 0..3, Duration::from_millis(50)).err().unwrap();
        assert!(e.contains("[0, 2]") && e.contains("did not answer"), "{e}");

        // Asked ranks 0..1 only, rank 3 answers; then every worker is gone.
        tx.send((3, unit(Ok(())))).unwrap();
        let e = collect_replies(&rx, 0..1, Duration::from_secs(5)).err().unwrap();
        assert!(e.contains("rank 3") && e.contains("nobody asked"), "{e}");
        drop(tx);
        let e = collect_replies(&rx, 0..2, Duration::from_secs(5)).err().unwrap();
        assert!(e.contains("ended"), "{e}");
    }
}
