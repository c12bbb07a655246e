// memra/attn_decode_rope.cuh — a decode step's attention with its QK-norm + RoPE + KV-cache write
// in the prologue: attn_decode (attn_decode.cuh) on the raw q/k/v projections, one launch where
// qk_norm_rope + attn_decode took two.
//
// Cfg fields: attn_decode's (HEAD_DIM, N_HEAD, N_KV, CACHE_T, THREADS, MIN_SPLIT_ROWS) plus
// qk_norm_rope's N_ROT, ROPE_MODE and QK_NORM (templates/README.md).
// Kernel parameters:
//   (const float* q, const float* k, const float* v, const float* q_norm_w, const float* k_norm_w,
//    void* k_cache, void* v_cache, const int* pos, float* out, float* work, int n_seq,
//    int head_dim, int n_head, int n_kv, int n_rot, int max_ctx, int window, int n_split,
//    float scale, float freq_base, float freq_scale, float eps)
//   q [n_seq, n_head, hd], k and v [n_seq, n_kv, hd]: the projections of each sequence's new
//   token at position p = pos[b], before the norm. Per sequence, as qk_norm_rope would: q and k
//   RMS-normed (QK_NORM) and rotated (ROPE_MODE, first n_rot dims, the same angles), k and v
//   written to the caches [n_seq, max_ctx, n_kv, hd] at row p; then attn_decode's attention over
//   rows [lo, p] with the rotated q. q, k and v are read only (not rewritten in place).
//   p ∉ [0, max_ctx): NaN output and no cache write, as attn_decode.
// Work split as attn_decode (grid, workspace, n_split). Every block normalizes and rotates its
//   own q heads (a warp per head) into shared memory; a block whose key range holds p also builds
//   the new k and v row (CACHE_T-rounded, so it attends to what the cache will hold) and reads
//   that row from shared memory in its key loop; head group 0's block of that split writes it to
//   the caches. No block reads row p from the cache, so no block races the write.
#pragma once
#include "memra/attn_decode.cuh"
#include "memra/qk_norm_rope.cuh"

namespace memra {
namespace attn_detail {

// One head of hd floats from `src`, RMS-normed per QK_NORM (weights `nw`; Full: `inv` is the
// token's 1/rms, PerHead: the head's own, computed here with `eps`) and rotated by `cs`, into
// `dst` (shared memory), in qk_norm_rope's order of operations. One warp; hd ≤ HD_MAX. The
// weights load with the head, not after its reduction (one memory latency, not two).
template <RopeMode MODE, QkNorm NORM, int HD_MAX>
__device__ __forceinline__ void warp_norm_rope(const float* __restrict__ src, const float* __restrict__ nw, float inv,
                                               float eps, const float2* cs, int hd, int n_rot, float* dst) {
    constexpr int PER = HD_MAX / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    float ss = 0.0f, w[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = lane + j * WARP_SIZE;
        const float e = i < hd ? src[i] : 0.0f;
        w[j] = NORM != QkNorm::None && i < hd ? __ldg(nw + i) : 0.0f;
        if (i < hd) dst[i] = e;
        ss = fmaf(e, e, ss);
    }
    if constexpr (NORM != QkNorm::None) {
        if constexpr (NORM == QkNorm::PerHead) inv = rsqrtf(warp_sum(ss) / (float)hd + eps);
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = lane + j * WARP_SIZE;
            if (i < hd) dst[i] = dst[i] * inv * w[j];
        }
    }
    if constexpr (MODE != RopeMode::None) {
        __syncwarp();
        const int half = n_rot / 2;
        for (int i = lane; i < half; i += WARP_SIZE) {  // rotated pairs; the tail stays
            const int a = MODE == RopeMode::Neox ? i : 2 * i;
            const int c = MODE == RopeMode::Neox ? i + half : 2 * i + 1;
            const float2 r = cs[i];
            const float x0 = dst[a], x1 = dst[c];
            dst[a] = x0 * r.x - x1 * r.y;
            dst[c] = x0 * r.y + x1 * r.x;
        }
    }
    __syncwarp();
}

template <class Cfg> struct RopePrologue {
    enum : bool { ON = true };
    const float* q;
    const float* k;
    const float* v;
    const float* q_norm_w;
    const float* k_norm_w;
    void* k_cache;
    void* v_cache;
    int n_rot_rt;
    float freq_base, freq_scale, eps;

    enum : int { HALF_CAP = Cfg::N_ROT != 0 ? (Cfg::N_ROT / 2 > 0 ? Cfg::N_ROT / 2 : 1)
                                                    : (Cfg::HEAD_DIM != 0 ? Cfg::HEAD_DIM : 256) / 2 };
    static_assert(Cfg::N_ROT % 2 == 0 && (Cfg::HEAD_DIM == 0 || Cfg::N_ROT <= Cfg::HEAD_DIM), "N_ROT even, <= HEAD_DIM");
    // (cos θ_i, sin θ_i) of the token, one block-wide table (a function-scope __shared__ is static).
    __device__ __forceinline__ static float2* angles() {
        __shared__ float2 cs[HALF_CAP];
        return cs;
    }

    // Before the wait for the previous kernel, what depends on p and constants only: the
    // rotation angles (the f64 exp2 is the prologue's longest dependent chain) and the norm
    // weights.
    __device__ __forceinline__ void before_wait(int p, int hd, int n_head, int n_kv) const {
        // The norm weights into L2 (addresses 128 bytes apart, the last one the final element):
        // the prologue's loads of them then hit.
        if constexpr (Cfg::QK_NORM != QkNorm::None) {
            const int nq = Cfg::QK_NORM == QkNorm::Full ? n_head * hd : hd;
            const int nk = Cfg::QK_NORM == QkNorm::Full ? n_kv * hd : hd;
            for (int i = threadIdx.x; i <= nq / 32; i += Cfg::THREADS) prefetch_l2(q_norm_w + min(32 * i, nq - 1));
            for (int i = threadIdx.x; i <= nk / 32; i += Cfg::THREADS) prefetch_l2(k_norm_w + min(32 * i, nk - 1));
        }
        constexpr RopeMode MODE = Cfg::ROPE_MODE;
        if constexpr (MODE != RopeMode::None) {
            const int n_rot = dim_or<Cfg::N_ROT>(n_rot_rt), half = n_rot / 2;
            float2* cs = angles();
            const double log2_base = log2((double)freq_base);
            for (int i = threadIdx.x; i < half; i += Cfg::THREADS) {
                const double inv_freq = (double)freq_scale * exp2_f64(-(double)(2 * i) / (double)n_rot * log2_base);  // as qk_norm_rope
                cs[i] = rope_cos_sin(p, inv_freq);
            }
        }
    }

    template <int HP_MAX, int HD_MAX>
    __device__ __forceinline__ Prepared run(const BlockAt& at, int hd, int n_head, int n_kv, int max_ctx) const {
        constexpr int THREADS = Cfg::THREADS, W = THREADS / WARP_SIZE;
        constexpr RopeMode MODE = Cfg::ROPE_MODE;
        constexpr QkNorm NORM = Cfg::QK_NORM;
        constexpr CacheType CT = Cfg::CACHE_T;
        static_assert(HD_MAX == (Cfg::HEAD_DIM != 0 ? Cfg::HEAD_DIM : 256), "angles() is sized for HD_MAX");
        const float2* cs = angles();
        __shared__ float s_q[HP_MAX * HD_MAX];
        __shared__ float s_k[HD_MAX];
        __shared__ float4 s_row[2][HD_MAX * (CT == CacheType::F32 ? 4 : 2) / 16];  // new k, v as CACHE_T
        __shared__ float full_inv[2];

        const int n_rot = MODE == RopeMode::None ? 0 : dim_or<Cfg::N_ROT>(n_rot_rt);
        const float* qt = q + (i64)at.b * n_head * hd;
        const float* kt = k + (i64)at.b * n_kv * hd;
        if constexpr (NORM == QkNorm::Full) full_norm_inv<THREADS>(qt, kt, n_head * hd, n_kv * hd, eps, full_inv);
        __syncthreads();

        // Units: the block's q heads, then (when it holds p) its kv head's k and v.
        const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
        const int n_units = at.nh + (at.holds_p ? 2 : 0);
        const bool write = at.holds_p && at.hg == 0;
        const i64 cache_row = (((i64)at.b * max_ctx + at.p) * n_kv + at.kvh) * hd;
        for (int u = warp; u < n_units; u += W) {
            if (u < at.nh) {
                const int h = at.h0 + u;
                const float* nw = NORM == QkNorm::Full ? q_norm_w + (i64)h * hd : q_norm_w;
                warp_norm_rope<MODE, NORM, HD_MAX>(qt + (i64)h * hd, nw, NORM == QkNorm::Full ? full_inv[0] : 0.0f, eps, cs, hd, n_rot, s_q + u * hd);
            } else if (u == at.nh) {
                const float* nw = NORM == QkNorm::Full ? k_norm_w + (i64)at.kvh * hd : k_norm_w;
                warp_norm_rope<MODE, NORM, HD_MAX>(kt + (i64)at.kvh * hd, nw, NORM == QkNorm::Full ? full_inv[1] : 0.0f, eps, cs, hd, n_rot, s_k);
                for (int i = lane; i < hd; i += WARP_SIZE) {
                    store_as<CT>(s_row[0], i, s_k[i]);
                    if (write) store_as<CT>(k_cache, cache_row + i, s_k[i]);
                }
            } else {
                const float* vt = v + ((i64)at.b * n_kv + at.kvh) * hd;
                for (int i = lane; i < hd; i += WARP_SIZE) {
                    const float e = vt[i];
                    store_as<CT>(s_row[1], i, e);
                    if (write) store_as<CT>(v_cache, cache_row + i, e);
                }
            }
        }
        __syncthreads();
        return Prepared{s_q, SmemNewRow{s_row[0], s_row[1], at.holds_p ? at.p : -1}};
    }
};

}  // namespace attn_detail
}  // namespace memra

// __launch_bounds__(THREADS, 1): as attn_decode's.
#define MEMRA_DEFINE_ATTN_DECODE_ROPE(SYMBOL, CFG)                                                                    \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS, 1)                                                     \
        SYMBOL(const float* q, const float* k, const float* v, const float* q_norm_w, const float* k_norm_w,          \
               void* k_cache, void* v_cache, const int* pos, float* out, float* work, int n_seq, int head_dim,        \
               int n_head, int n_kv, int n_rot, int max_ctx, int window, int n_split, float scale, float freq_base,   \
               float freq_scale, float eps) {                                                                         \
        const memra::attn_detail::RopePrologue<CFG> pre{q, k, v, q_norm_w, k_norm_w, k_cache, v_cache, n_rot,         \
                                                         freq_base, freq_scale, eps};                                 \
        memra::attn_decode_impl<CFG>(nullptr, k_cache, v_cache, pos, out, work, n_seq, head_dim, n_head, n_kv,        \
                                     max_ctx, window, n_split, scale, pre);                                           \
    }
