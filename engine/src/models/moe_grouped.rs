//! Expert-grouped MoE prefill. Per token the expert kernel (moe_matvec) re-reads each selected
//! expert's weights once per token that chose it; for a prompt the tokens are instead grouped by
//! expert (the router's ids read back on the host: prefill is not graph-captured) and the
//! tensor-core matmul runs each expert over the matrix of its tokens' rows, all experts in one
//! grouped launch (grid.z): gather `h` rows (embed over an f32 table) → gate, up grouped
//! matmuls → SwiGLU over all pairs → down grouped matmul → moe_combine, the routing-weighted
//! sum in slot order. A slot of routing weight 0 gets no row: on a multi-GPU rank every slot
//! routed to another rank's expert is one (ep_localize), about half of all slots on 2 GPUs,
//! which as rows of local expert 0 made that expert the grouped launch's straggler.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use memra_gguf::GgmlType;

use super::gpu::{self, DeviceTensor, KernelPlan, Result, err};
use crate::cuda::{Gpu, Kernels};
use crate::kernels::registry::Param;
use crate::kernels::swiglu::GluLayout;
use crate::kernels::{embed, matmul, moe_combine, swiglu};

/// Prompt chunks take the grouped path from this many tokens on, and only when the experts get
/// [`GROUPED_MIN_TOKENS_PER_EXPERT`] tokens on average; shorter ones (and decode) stay on
/// moe_matvec. The grouped path costs a host round trip and reads every expert with tokens
/// once; with one or two tokens per expert moe_matvec reads about the same bytes. On the H200
/// (session 6, GLM-5 dims, 4 layers) one matmul launch per expert was 1.5× slower end to end
/// than moe_matvec; the one-launch grouped matmul is 1.20× faster at 256 tokens (8 per
/// expert), 1.41× at 1024 and 1.40× at 4096.
pub const GROUPED_MIN_TOKENS: usize = 16;
pub const GROUPED_MIN_TOKENS_PER_EXPERT: usize = 4;

/// Whether a chunk of `t` tokens, each routed to `n_used` of `n_expert` experts, runs grouped.
/// `MEMRA_MOE_GROUPED=1` takes the grouped path for every prompt chunk of 2 tokens or more and
/// `=0` never (A/B timing of the thresholds); unset or anything else applies the rule.
pub fn use_grouped(t: usize, n_used: usize, n_expert: usize) -> bool {
    static FORCED: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    match FORCED.get_or_init(|| match std::env::var("MEMRA_MOE_GROUPED").as_deref() {
        Ok("1") => Some(true),
        Ok("0") => Some(false),
        _ => None,
    }) {
        Some(forced) => *forced && t >= 2,
        None => t >= GROUPED_MIN_TOKENS && t * n_used >= GROUPED_MIN_TOKENS_PER_EXPERT * n_expert,
    }
}

/// The (token, slot) pairs of a chunk grouped by expert: rows `offsets[x]..offsets[x + 1]` of
/// the grouped matrices belong to expert `x`, in token order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertGroups {
    /// Grouped row → the token whose `h` row it holds.
    pub token_of_row: Vec<i32>,
    /// `token·n_used + slot` → its grouped row (what moe_combine reads).
    pub row_of_slot: Vec<i32>,
    /// `n_expert + 1` row offsets.
    pub offsets: Vec<usize>,
}

impl ExpertGroups {
    /// Rows of expert `x`.
    pub fn rows(&self, x: usize) -> std::ops::Range<usize> {
        self.offsets[x]..self.offsets[x + 1]
    }

    /// Rows of all experts: the slots that were kept. A dropped slot's `row_of_slot` is this
    /// index, the zero row just after them.
    pub fn kept(&self) -> usize {
        self.offsets[self.offsets.len() - 1]
    }
}

/// Groups the router's `ids` (`[t][n_used]`) by expert (a stable counting sort). With `wts`, a
/// slot whose routing weight is exactly 0 contributes nothing and gets no row (its
/// `row_of_slot` is [`ExpertGroups::kept`]). An id outside `[0, n_expert)` (the router's −1
/// for an unselectable slot included) is an error naming it.
pub fn group_by_expert(ids: &[i32], wts: Option<&[f32]>, n_used: usize, n_expert: usize) -> std::result::Result<ExpertGroups, String> {
    if n_used == 0 || !ids.len().is_multiple_of(n_used) {
        return Err(format!("{} expert ids are not whole rows of n_used = {n_used}", ids.len()));
    }
    if let Some(w) = wts.filter(|w| w.len() != ids.len()) {
        return Err(format!("{} routing weights for {} expert ids", w.len(), ids.len()));
    }
    let kept = |i: usize| wts.is_none_or(|w| w[i] != 0.0);
    let mut offsets = vec![0usize; n_expert + 1];
    for (i, &x) in ids.iter().enumerate() {
        if x < 0 || x as usize >= n_expert {
            return Err(format!("token {} slot {}: expert id {x} is outside [0, {n_expert})", i / n_used, i % n_used));
        }
        if kept(i) {
            offsets[x as usize + 1] += 1;
        }
    }
    for x in 0..n_expert {
        offsets[x + 1] += offsets[x];
    }
    let zero_row = offsets[n_expert];
    let mut next = offsets.clone();
    let mut token_of_row = vec![0i32; zero_row];
    let mut row_of_slot = vec![zero_row as i32; ids.len()];
    for (i, &x) in ids.iter().enumerate() {
        if !kept(i) {
            continue;
        }
        let row = next[x as usize];
        next[x as usize] += 1;
        token_of_row[row] = (i / n_used) as i32;
        row_of_slot[i] = row as i32;
    }
    Ok(ExpertGroups { token_of_row, row_of_slot, offsets })
}

/// Device scratch of one prefill chunk: `pairs = t·n_used` rows each.
pub struct GroupedScratch {
    token_of_row: CudaSlice<i32>,
    row_of_slot: CudaSlice<i32>,
    /// Gathered `h` rows `[pairs][n_embd]`, then the down outputs.
    rows: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    act: CudaSlice<f32>,
    /// The grouped matmuls' expert row offsets (`n_expert + 1`; a rank's local experts fit).
    offsets: CudaSlice<i32>,
}

impl GroupedScratch {
    pub fn new(gpu: &Gpu, t: usize, n_used: usize, n_expert: usize, n_embd: usize, n_ff_exp: usize) -> Result<GroupedScratch> {
        let pairs = t * n_used;
        let what = |w: &str| format!("grouped MoE {w} ({t} tokens × {n_used} experts)");
        Ok(GroupedScratch {
            token_of_row: gpu::alloc(gpu, pairs, &what("row tokens"))?,
            row_of_slot: gpu::alloc(gpu, pairs, &what("slot rows"))?,
            rows: gpu::alloc(gpu, pairs * n_embd, &what("rows"))?,
            gate: gpu::alloc(gpu, pairs * n_ff_exp, &what("gate"))?,
            up: gpu::alloc(gpu, pairs * n_ff_exp, &what("up"))?,
            act: gpu::alloc(gpu, pairs * n_ff_exp, &what("activations"))?,
            offsets: gpu::alloc(gpu, n_expert + 1, &what("expert offsets"))?,
        })
    }
}

/// The kernels of the grouped path for one layer's experts.
pub struct GroupedMoe {
    gather: &'static str,
    gate_up: &'static str,
    down: &'static str,
    glu: &'static str,
    combine: &'static str,
}

/// Bytes of one expert in a stacked `[n_expert][rows][k]` tensor.
fn expert_bytes(w: &DeviceTensor, n_expert: usize) -> Option<usize> {
    let rows = w.n.checked_div(n_expert)?;
    Some(rows * w.ty.row_bytes(w.k as u64)? as usize)
}

/// The `n_expert` experts of a stacked tensor.
fn experts(w: &DeviceTensor, n_expert: usize) -> CudaView<'_, u8> {
    let b = expert_bytes(w, n_expert).expect("checked by GroupedMoe::plan");
    w.data.slice(..n_expert * b)
}

impl GroupedMoe {
    /// Plans the grouped path's kernels, or `None` (moe_matvec then runs every chunk) when no
    /// matmul reads the experts' type, an expert's bytes are not 16-byte aligned (the matmul's
    /// cp.async loads) or the policy refuses one of the kernels.
    pub fn plan(plan: &mut KernelPlan, gate: &DeviceTensor, up: &DeviceTensor, down: &DeviceTensor, n_expert: usize, n_ff_exp: usize) -> Option<GroupedMoe> {
        let n_embd = gate.k;
        let shapes_fit = up.k == n_embd && down.k == n_ff_exp && [gate.n, up.n] == [n_expert * n_ff_exp; 2] && down.n == n_expert * n_embd;
        let aligned = [gate, up, down].iter().all(|w| expert_bytes(w, n_expert).is_some_and(|b| b.is_multiple_of(16)));
        // Rows of x and y are float4-loaded at expert offsets: both widths multiples of 4.
        if !shapes_fit || !aligned || gate.ty != up.ty || !n_embd.is_multiple_of(4) || !n_ff_exp.is_multiple_of(4) {
            return None;
        }
        let (Ok(gq), Ok(dq)) = (gpu::qtype_token(matmul::FAMILY, gate.ty), gpu::qtype_token(matmul::FAMILY, down.ty)) else {
            return None;
        };
        let int = |v: usize| Param::Int(v as i64);
        let f32_token = gpu::qtype_token(embed::FAMILY, GgmlType::F32).ok()?;
        // A kernel the policy cannot give (`--require-specialized` without specialized
        // variants for these shapes) leaves the layer on moe_matvec, which the plan has.
        let mut want = |family: &str, req: &[(&str, Param)]| plan.want(family, req).ok();
        Some(GroupedMoe {
            gather: want(embed::FAMILY, &[("n_embd", int(n_embd)), ("qtype", Param::Sym(f32_token))])?,
            gate_up: want(matmul::FAMILY, &[("k", int(n_embd)), ("n", int(n_ff_exp)), ("qtype", Param::Sym(gq))])?,
            down: want(matmul::FAMILY, &[("k", int(n_ff_exp)), ("n", int(n_embd)), ("qtype", Param::Sym(dq))])?,
            glu: want(swiglu::FAMILY, &[("n_ff", int(n_ff_exp))])?,
            combine: want(moe_combine::FAMILY, &[("n", int(n_embd))])?,
        })
    }

    /// `out[t] = Σ_s wts[t, s] · down_{ids[t, s]}(silu(gate·h[t]) ⊙ up·h[t])` for a chunk of `t`
    /// tokens: `h` `[t][n_embd]`, `ids` / `wts` `[t][n_used]` from moe_router, `out` `[t][n_embd]`.
    /// Reads the ids and weights back (waits for the stream); slots of weight 0 cost nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        gpu: &Gpu,
        kernels: &Kernels,
        (gate, up, down): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
        s: &mut GroupedScratch,
        h: &CudaView<'_, f32>,
        ids: &CudaView<'_, i32>,
        wts: &CudaView<'_, f32>,
        out: &mut CudaViewMut<'_, f32>,
        t: usize,
        n_used: usize,
        n_expert: usize,
    ) -> Result<()> {
        let (e, nf, pairs) = (gate.k, down.k, t * n_used);
        if s.token_of_row.len() < pairs || s.rows.len() < pairs * e || s.gate.len() < pairs * nf {
            return Err(err(format!("grouped MoE: scratch too small for {t} tokens × {n_used} experts")));
        }
        let stream = gpu.stream();
        let ids_host = stream.clone_dtoh(ids).map_err(|e| err(format!("copying expert ids to the host: {e:?}")))?;
        let wts_host = stream.clone_dtoh(wts).map_err(|e| err(format!("copying routing weights to the host: {e:?}")))?;
        if ids_host.len() < pairs || wts_host.len() < pairs {
            return Err(err(format!("grouped MoE: {} ids / {} weights for {t} tokens × {n_used} experts", ids_host.len(), wts_host.len())));
        }
        let g = group_by_expert(&ids_host[..pairs], Some(&wts_host[..pairs]), n_used, n_expert).map_err(|m| err(format!("grouped MoE ({}): {m}", gate.name)))?;
        let kept = g.kept();
        stream
            .memcpy_htod(&g.row_of_slot, &mut s.row_of_slot.slice_mut(..pairs))
            .map_err(|e| err(format!("copying the expert groups to the GPU: {e:?}")))?;
        if kept < pairs {
            // The dropped slots' row: weight 0 times a row of zeros (not whatever was there).
            stream.memset_zeros(&mut s.rows.slice_mut(kept * e..(kept + 1) * e)).map_err(|e| err(format!("zeroing the grouped MoE's empty row: {e:?}")))?;
        }
        if kept > 0 {
            self.experts(gpu, kernels, (gate, up, down), s, h, &g, t, n_expert)?;
        }
        moe_combine::moe_combine(kernels.get(self.combine)?, &s.rows.slice(..pairs * e), &s.row_of_slot.slice(..pairs), wts, out, t, n_used, e)?;
        Ok(())
    }

    /// The expert FFNs of the `g.kept()` grouped rows, written over the first rows of `s.rows`.
    #[allow(clippy::too_many_arguments)]
    fn experts(
        &self,
        gpu: &Gpu,
        kernels: &Kernels,
        (gate, up, down): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
        s: &mut GroupedScratch,
        h: &CudaView<'_, f32>,
        g: &ExpertGroups,
        t: usize,
        n_expert: usize,
    ) -> Result<()> {
        // pairs: the kept (token, expert) pairs, one grouped row each.
        let (e, nf, pairs) = (gate.k, down.k, g.kept());
        let stream = gpu.stream();
        stream
            .memcpy_htod(&g.token_of_row, &mut s.token_of_row.slice_mut(..pairs))
            .map_err(|e| err(format!("copying the expert groups to the GPU: {e:?}")))?;
        // The h rows as an f32 "embedding table" of t rows, gathered per (expert, token) row.
        // SAFETY: f32 → its 4 bytes each; the view covers exactly h's t·n_embd floats.
        let table = unsafe { h.transmute::<u8>(t * e * 4) }.ok_or_else(|| err("grouped MoE: h is shorter than t rows"))?;
        embed::embed(kernels.get(self.gather)?, &s.token_of_row.slice(..pairs), &table, &mut s.rows.slice_mut(..pairs * e), pairs, e, t, 1.0)?;
        let (gk, dk) = (kernels.get(self.gate_up)?, kernels.get(self.down)?);
        let named = |r: std::result::Result<(), crate::cuda::Error>, w: &DeviceTensor| r.map_err(|m| err(format!("tensor '{}' (grouped by expert): {m}", w.name)));
        let host: Vec<i32> = g.offsets.iter().map(|&o| o as i32).collect();
        let offsets = matmul::ExpertOffsets::upload(gk, &host, &mut s.offsets).map_err(|m| err(format!("grouped MoE ({}): {m}", gate.name)))?;
        // One launch per matrix over every expert (grid.z): per-expert launches of a few blocks
        // each left most SMs idle (measured on the H200: slower than moe_matvec at 1024 tokens).
        let xs = s.rows.slice(..pairs * e);
        for (w, y) in [(gate, &mut s.gate), (up, &mut s.up)] {
            named(matmul::matmul_grouped(gk, &experts(w, n_expert), &xs, &mut y.slice_mut(..pairs * nf), &offsets, e, nf, e, nf), w)?;
        }
        swiglu::swiglu(kernels.get(self.glu)?, &s.gate.slice(..pairs * nf), &s.up.slice(..pairs * nf), &mut s.act.slice_mut(..pairs * nf), pairs, nf, GluLayout::separate(nf))?;
        // The gathered rows are spent: the down outputs go there.
        let a = s.act.slice(..pairs * nf);
        named(matmul::matmul_grouped(dk, &experts(down, n_expert), &a, &mut s.rows.slice_mut(..pairs * e), &offsets, nf, e, nf, e), down)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh seeded xorshift (seed printed by the caller).
    fn next(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    /// Every (token, slot) lands on a row of its expert holding its token; rows of an expert are
    /// in token order; every row is used once.
    fn check(ids: &[i32], n_used: usize, n_expert: usize, what: &str) {
        let g = group_by_expert(ids, None, n_used, n_expert).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(g.offsets.len(), n_expert + 1, "{what}");
        assert_eq!(*g.offsets.last().unwrap(), ids.len(), "{what}");
        let mut seen = vec![false; ids.len()];
        for (i, &x) in ids.iter().enumerate() {
            let row = g.row_of_slot[i] as usize;
            assert!(g.rows(x as usize).contains(&row), "{what}: slot {i} (expert {x}) at row {row}, outside {:?}", g.rows(x as usize));
            assert_eq!(g.token_of_row[row] as usize, i / n_used, "{what}: row {row}");
            assert!(!seen[row], "{what}: row {row} used twice");
            seen[row] = true;
        }
        for x in 0..n_expert {
            let toks = &g.token_of_row[g.rows(x)];
            assert!(toks.windows(2).all(|w| w[0] < w[1]), "{what}: expert {x} rows not in token order: {toks:?}");
            let want = ids.iter().filter(|&&v| v as usize == x).count();
            assert_eq!(g.rows(x).len(), want, "{what}: expert {x} row count");
        }
    }

    #[test]
    fn groups_by_hand() {
        // 3 tokens, 2 slots, 4 experts: expert 1 gets tokens 0, 2; expert 3 tokens 0, 1, 2;
        // expert 2 token 1; expert 0 none.
        let ids = [3, 1, 2, 3, 1, 3];
        let g = group_by_expert(&ids, None, 2, 4).unwrap();
        assert_eq!(g.offsets, vec![0, 0, 2, 3, 6]);
        assert_eq!(g.token_of_row, vec![0, 2, 1, 0, 1, 2]);
        assert_eq!(g.row_of_slot, vec![3, 0, 2, 4, 1, 5]);
        check(&ids, 2, 4, "by hand");
    }

    #[test]
    fn groups_random_and_awkward_routings() {
        let now = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
        let seed = std::env::var("MEMRA_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(now) | 1;
        println!("seed {seed} (MEMRA_SEED to replay)");
        let mut st = seed;
        for (t, n_used, n_expert) in [(7, 8, 64), (130, 8, 256), (1, 1, 1), (33, 2, 4)] {
            // Distinct experts per token, as the router picks them.
            let mut ids = Vec::new();
            for _ in 0..t {
                let mut row: Vec<i32> = Vec::new();
                while row.len() < n_used {
                    let x = (next(&mut st) % n_expert as u64) as i32;
                    if !row.contains(&x) {
                        row.push(x);
                    }
                }
                ids.extend(row);
            }
            check(&ids, n_used, n_expert, &format!("seed {seed}: t {t}, {n_used} of {n_expert}"));
        }
        // One expert chosen by every token, the rest by none.
        check(&vec![5; 130], 1, 64, "all on expert 5");
    }

    /// Zero-weight slots (a rank's foreign experts) get no row and point at the zero row after
    /// the kept ones; the kept slots group as if the others were absent.
    #[test]
    fn zero_weight_slots_get_no_row() {
        // 3 tokens, 2 slots, 4 experts; slots 1 and 4 (experts 1 and 1) weigh 0.
        let ids = [3, 1, 2, 3, 1, 3];
        let wts = [0.5, 0.0, 1.0, 0.25, 0.0, 2.0];
        let g = group_by_expert(&ids, Some(&wts), 2, 4).unwrap();
        assert_eq!(g.kept(), 4);
        assert_eq!(g.offsets, vec![0, 0, 0, 1, 4]);
        assert_eq!(g.token_of_row, vec![1, 0, 1, 2]);
        assert_eq!(g.row_of_slot, vec![1, 4, 0, 2, 4, 3]);
        // All dropped: no rows, every slot on row 0 (the zero row).
        let g = group_by_expert(&ids, Some(&[0.0; 6]), 2, 4).unwrap();
        assert_eq!((g.kept(), g.token_of_row.len()), (0, 0));
        assert!(g.row_of_slot.iter().all(|&r| r == 0));
        // Without weights, or with none zero, nothing is dropped.
        let ones = [1.0; 6];
        assert_eq!(group_by_expert(&ids, Some(&ones), 2, 4).unwrap(), group_by_expert(&ids, None, 2, 4).unwrap());
        let e = group_by_expert(&ids, Some(&ones[..5]), 2, 4).unwrap_err();
        assert!(e.contains("5 routing weights for 6"), "{e}");
    }

    #[test]
    fn threshold_needs_tokens_and_tokens_per_expert() {
        // OLMoE 8 of 64: 4 tokens per expert from 32 tokens; GLM-5 8 of 256: from 128.
        assert!(!use_grouped(31, 8, 64) && use_grouped(32, 8, 64));
        assert!(!use_grouped(127, 8, 256) && use_grouped(128, 8, 256));
        // The micro models' 2 of 4: the token floor decides.
        assert!(!use_grouped(15, 2, 4) && use_grouped(16, 2, 4));
    }

    #[test]
    fn bad_ids_are_errors_naming_the_slot() {
        let e = group_by_expert(&[0, 1, -1, 2], None, 2, 4).unwrap_err();
        assert!(e.contains("token 1 slot 0") && e.contains("-1"), "{e}");
        let e = group_by_expert(&[0, 4], None, 2, 4).unwrap_err();
        assert!(e.contains("token 0 slot 1") && e.contains("[0, 4)"), "{e}");
        assert!(group_by_expert(&[0, 1, 2], None, 2, 4).is_err());
    }
}
