// memra/moe_router.cuh — MoE routing of router logits (model-specs §2 "MoE routing", §4, §7.4):
// per token, probs = softmax(logits) (GATING Softmax) or sigmoid(logits) (GATING Sigmoid), computed in f64
// and rounded to f32; selection score = prob + bias[i] (f32 add, bias optional: exp_probs_b);
// the n_used highest scores, ties toward the lower expert index, in selection order; weights =
// the unbiased probs of the selected experts, divided by max(Σ, 2^−14) if `norm`, times `scale`
// if scale ∉ {0, 1} (f64, rounded to f32). This is memra-reference moe::route step for step.
//
// Cfg fields:
//   N_EXPERT  int  experts (router logits per token); 0 = run time (≤ 32·MAX_PER_LANE = 512)
//   N_USED    int  experts per token (1 ≤ n_used ≤ min(32, n_expert)); 0 = run time
//   GATING    Gating  Softmax (olmoe) or Sigmoid (glm-dsa): GGUF `expert_gating_func` 1 / 2
//   THREADS   int  threads per block (multiple of 32): one warp per token
// Kernel parameters: (const float* logits, const float* bias, int* ids, float* weights,
//                     int n_tokens, int n_expert, int n_used, int norm, float scale)
//   logits [n_tokens, n_expert]; bias [n_expert] or null; ids / weights [n_tokens, n_used].
//   A NaN score is never selected; when fewer than n_used scores are selectable the remaining
//   slots get id −1 and weight NaN (moe_matvec turns id −1 into NaN outputs).
// Geometry: grid (min(ceil(n_tokens / (THREADS/32)), 65535)), block THREADS, no dynamic smem;
//   tokens use a grid stride, so any grid ≥ 1 is correct.
// Scheme: lane l holds experts l, l + 32, ... as arg-keys (common.cuh: larger score first, then
//   lower index); n_used rounds of a warp max pick the winners; lane j < n_used keeps winner j,
//   recomputes its prob from the logit and the softmax max / sum every lane holds, and the
//   weights are normalized with a warp sum.
#pragma once
#include "memra/common.cuh"

namespace memra {
namespace moe_router_detail {

constexpr int MAX_PER_LANE = 16;  // generic variants: up to 512 experts
constexpr double RENORM_MIN_SUM = 6.103515625e-5;  // llama.cpp build_moe_ffn clamp (2^−14)

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

}  // namespace moe_router_detail

template <class Cfg>
__device__ __forceinline__ void moe_router_impl(const float* __restrict__ logits, const float* __restrict__ bias,
                                                int* __restrict__ ids, float* __restrict__ weights, int n_tokens,
                                                int n_expert_rt, int n_used_rt, int norm, float scale) {
    using namespace moe_router_detail;
    static_assert(Cfg::THREADS % 32 == 0 && Cfg::THREADS <= 1024, "THREADS must be a multiple of 32");
    static_assert(Cfg::N_EXPERT >= 0 && Cfg::N_EXPERT <= 32 * MAX_PER_LANE, "N_EXPERT must be <= 512");
    static_assert(Cfg::N_USED >= 0 && Cfg::N_USED <= 32, "N_USED must be <= 32");
    constexpr int V = Cfg::N_EXPERT != 0 ? (Cfg::N_EXPERT + 31) / 32 : MAX_PER_LANE;
    constexpr int WARPS = Cfg::THREADS / 32;
    const int n_expert = dim_or<Cfg::N_EXPERT>(n_expert_rt), n_used = dim_or<Cfg::N_USED>(n_used_rt);
    if (n_expert < 1 || n_expert > 32 * V || n_used < 1 || n_used > 32 || n_used > n_expert) __trap();
    const int lane = threadIdx.x % 32;
    const float neg_inf = __int_as_float(0xff800000);

    for (int t = blockIdx.x * WARPS + threadIdx.x / 32; t < n_tokens; t += gridDim.x * WARPS) {
        const float* lt = logits + (i64)t * n_expert;
        float l[V];
        float lmax = neg_inf;
#pragma unroll
        for (int v = 0; v < V; ++v) {
            const int i = lane + 32 * v;
            l[v] = i < n_expert ? lt[i] : neg_inf;
            lmax = fmaxf(lmax, l[v]);
        }
        // Softmax: f64 exp(l − max) summed over the warp (every lane gets max and sum).
        double sum = 1.0;
        if constexpr (Cfg::GATING == Gating::Softmax) {
            lmax = warp_max(lmax);
            double s = 0.0;
#pragma unroll
            for (int v = 0; v < V; ++v)
                if (lane + 32 * v < n_expert) s += exp((double)l[v] - (double)lmax);
            sum = warp_sum_f64(s);
        }
        auto prob = [&](float logit) -> float {
            if constexpr (Cfg::GATING == Gating::Softmax) {
                return lmax == neg_inf ? 0.0f : (float)(exp((double)logit - (double)lmax) / sum);
            } else {
                return (float)(1.0 / (1.0 + exp(-(double)logit)));
            }
        };
        u64 key[V];
        u64 best = 0;
#pragma unroll
        for (int v = 0; v < V; ++v) {
            const int i = lane + 32 * v;
            key[v] = 0;
            if (i < n_expert) {
                float score = prob(l[v]);
                if (bias != nullptr) score += bias[i];
                if (score == score)  // NaN never selected
                    key[v] = make_arg_key(score, (u32)i);
            }
            best = key[v] > best ? key[v] : best;
        }
        // n_used rounds of a warp max; the owner of each winner drops it.
        int my_id = -1;
        for (int r = 0; r < n_used; ++r) {
            const u64 win = warp_max_u64(best);
            const int id = win == 0 ? -1 : (int)arg_key_index(win);
            if (lane == r) my_id = id;
            if (id >= 0 && lane == id % 32) {
                best = 0;
#pragma unroll
                for (int v = 0; v < V; ++v) {
                    if (key[v] == win) key[v] = 0;
                    best = key[v] > best ? key[v] : best;
                }
            }
        }
        // Weights: unbiased probs of the winners, then norm and scale as the reference (f64).
        const double p = lane < n_used && my_id >= 0 ? (double)prob(lt[my_id]) : 0.0;
        double wgt = p;
        if (norm != 0) {
            const double total = warp_sum_f64(p);
            wgt = p / (total > RENORM_MIN_SUM ? total : RENORM_MIN_SUM);
        }
        if (scale != 0.0f && scale != 1.0f) wgt *= (double)scale;
        if (lane < n_used) {
            ids[(i64)t * n_used + lane] = my_id;
            weights[(i64)t * n_used + lane] = my_id >= 0 ? (float)wgt : __int_as_float(0x7fc00000);
        }
    }
}

}  // namespace memra

#define MEMRA_DEFINE_MOE_ROUTER(SYMBOL, CFG)                                                                   \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS)                                                   \
        SYMBOL(const float* __restrict__ logits, const float* __restrict__ bias, int* __restrict__ ids,          \
               float* __restrict__ weights, int n_tokens, int n_expert, int n_used, int norm, float scale) {     \
        memra::pdl_entry();                                                                                     \
        memra::moe_router_impl<CFG>(logits, bias, ids, weights, n_tokens, n_expert, n_used, norm, scale);       \
    }
