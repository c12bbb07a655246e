// memra/qk_norm_rope.cuh — QK RMS-norm + RoPE + KV-cache write, fused (GQA layouts).
//
// Cfg fields:
//   HEAD_DIM   int              head_dim (even, <= 512); 0 = run time
//   N_HEAD     int              query heads; 0 = run time
//   N_KV       int              key/value heads; 0 = run time
//   N_ROT      int              rotated dims per head (even, <= head_dim); 0 = run time
//   ROPE_MODE  memra::RopeMode  None / Interleaved (ggml NORM, pairs (2i, 2i+1)) / Neox (pairs (i, i + n_rot/2))
//   QK_NORM    memra::QkNorm    None / PerHead (weights [hd]) / Full (weights [n_head·hd], [n_kv·hd])
//   CACHE_T    memra::CacheType F32 / BF16 cache elements
//   THREADS    int              threads per block (multiple of 32; a warp per head)
// Kernel parameters: (float* q, float* k, const float* v, const float* q_norm_w, const float* k_norm_w,
//   const int* pos, void* k_cache, void* v_cache, int n_tokens, int head_dim, int n_head, int n_kv,
//   int n_rot, int q_stride, int k_stride, int v_stride, int max_ctx, float freq_base,
//   float freq_scale, float eps)
//   q [T, n_head, hd], k [T, n_kv, hd], v [T, n_kv, hd], token rows q_stride / k_stride / v_stride
//   floats apart. Per token t: q, k <- RoPE(RMSNorm(.)·w) in place; k (after RoPE) and v ->
//   caches [max_ctx, n_kv, hd] at row pos[t] as CACHE_T. k_cache == nullptr: no cache writes;
//   pos[t] outside [0, max_ctx): that token's cache write is skipped.
//   θ_i = freq_scale · pos · base^(−2i/n_rot); θ is formed and reduced mod 2π in f64, then
//   sin/cos in f32 (__sincosf on |r| <= π), so large positions keep full accuracy.
// Geometry: U = n_head + 2·n_kv units per token (q heads, k heads, v heads), W = THREADS/32;
//   grid (QK_NORM == Full ? 1 : ceil(U / W), min(n_tokens, 65535)), block THREADS, no dynamic
//   smem. Tokens and units are visited with grid strides: any grid >= 1 is correct, except that
//   QK_NORM == Full needs grid.x == 1 (the whole-vector sums read rows other blocks rewrite).
#pragma once
#include "memra/common.cuh"

namespace memra {

constexpr int QK_ROPE_MAX_HEAD_DIM = 512;

// (cos θ, sin θ) of θ = p · inv_freq, inv_freq = freq_scale · base^(−2i/n_rot) in f64 (shared with
// attn_decode_rope.cuh): θ is reduced mod 2π in f64, then sin/cos in f32 (__sincosf on |r| ≤ π:
// abs error ~4e-7, no slow-path stack frame), so large positions keep full accuracy.
__device__ __forceinline__ float2 rope_cos_sin(int p, double inv_freq) {
    const double theta = (double)p * inv_freq;
    const double r = theta - rint(theta * 0.15915494309189535) * 6.283185307179586;
    float s, c;
    __sincosf((float)r, &s, &c);
    return make_float2(c, s);
}

// QK_NORM == Full: 1/rms of a token's whole q (nq floats) and k (nk floats) into inv[0], inv[1]
// (written by thread 0; the caller syncs before reading). Every thread of the block calls it.
template <int THREADS>
__device__ __forceinline__ void full_norm_inv(const float* qt, const float* kt, int nq, int nk, float eps, float* inv) {
    float sq = 0.0f, sk = 0.0f;
    for (int i = threadIdx.x; i < nq; i += THREADS) sq = fmaf(qt[i], qt[i], sq);
    for (int i = threadIdx.x; i < nk; i += THREADS) sk = fmaf(kt[i], kt[i], sk);
    sq = block_sum<THREADS>(sq);
    sk = block_sum<THREADS>(sk);
    if (threadIdx.x == 0) {
        inv[0] = rsqrtf(sq / (float)nq + eps);
        inv[1] = rsqrtf(sk / (float)nk + eps);
    }
}

template <class Cfg>
__device__ __forceinline__ void qk_norm_rope_impl(float* q, float* k, const float* v, const float* __restrict__ q_norm_w,
                                                  const float* __restrict__ k_norm_w, const int* __restrict__ pos,
                                                  void* k_cache, void* v_cache, int n_tokens, int head_dim_rt,
                                                  int n_head_rt, int n_kv_rt, int n_rot_rt, int q_stride,
                                                  int k_stride, int v_stride, int max_ctx, float freq_base,
                                                  float freq_scale, float eps) {
    constexpr int THREADS = Cfg::THREADS;
    constexpr int W = THREADS / WARP_SIZE;
    constexpr RopeMode MODE = Cfg::ROPE_MODE;
    constexpr QkNorm NORM = Cfg::QK_NORM;
    constexpr CacheType CT = Cfg::CACHE_T;
    static_assert(THREADS % WARP_SIZE == 0 && THREADS <= 1024, "THREADS must be a multiple of 32, <= 1024");
    static_assert(Cfg::HEAD_DIM % 2 == 0 && Cfg::HEAD_DIM <= QK_ROPE_MAX_HEAD_DIM, "HEAD_DIM even, <= 512");
    static_assert(Cfg::N_ROT % 2 == 0 && (Cfg::HEAD_DIM == 0 || Cfg::N_ROT <= Cfg::HEAD_DIM), "N_ROT even, <= HEAD_DIM");

    // Capacities: exact when specialized, the supported maximum when generic.
    constexpr int HD_CAP = Cfg::HEAD_DIM != 0 ? Cfg::HEAD_DIM : QK_ROPE_MAX_HEAD_DIM;
    constexpr int HALF_CAP = Cfg::N_ROT != 0 ? (Cfg::N_ROT / 2 > 0 ? Cfg::N_ROT / 2 : 1)
                                             : (Cfg::HEAD_DIM != 0 ? Cfg::HEAD_DIM / 2 : QK_ROPE_MAX_HEAD_DIM / 2);
    constexpr int EPL = ceil_div(HD_CAP, WARP_SIZE);        // elements per lane
    constexpr bool EXACT = Cfg::HEAD_DIM != 0 && Cfg::HEAD_DIM % WARP_SIZE == 0;

    const int hd = dim_or<Cfg::HEAD_DIM>(head_dim_rt);
    const int n_head = dim_or<Cfg::N_HEAD>(n_head_rt);
    const int n_kv = dim_or<Cfg::N_KV>(n_kv_rt);
    const int n_rot = MODE == RopeMode::None ? 0 : dim_or<Cfg::N_ROT>(n_rot_rt);
    const int half = n_rot / 2;
    const int n_units = n_head + 2 * n_kv;

    __shared__ double inv_freq[HALF_CAP];
    __shared__ float2 cs[HALF_CAP];            // (cos θ_i, sin θ_i) of the current token
    __shared__ float buf[W][HD_CAP];           // one normalized head per warp
    __shared__ float full_inv[2];              // QK_NORM == Full: q and k scale of the token

    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;

    if constexpr (MODE != RopeMode::None) {
        const double log2_base = log2((double)freq_base);
        for (int i = threadIdx.x; i < half; i += THREADS)
            inv_freq[i] = (double)freq_scale * exp2_f64(-(double)(2 * i) / (double)n_rot * log2_base);
    }

    for (int t = blockIdx.y; t < n_tokens; t += gridDim.y) {
        const int p = pos[t];
        __syncthreads();  // inv_freq written / previous token's cs and full_inv no longer read
        if constexpr (MODE != RopeMode::None) {
            for (int i = threadIdx.x; i < half; i += THREADS) cs[i] = rope_cos_sin(p, inv_freq[i]);
        }
        float* qt = q + (i64)t * q_stride;
        float* kt = k + (i64)t * k_stride;
        if constexpr (NORM == QkNorm::Full) full_norm_inv<THREADS>(qt, kt, n_head * hd, n_kv * hd, eps, full_inv);
        __syncthreads();

        const bool write_cache = k_cache != nullptr && p >= 0 && p < max_ctx;
        for (int u = blockIdx.x * W + warp; u < n_units; u += gridDim.x * W) {
            if (u >= n_head + n_kv) {  // v head: cache copy only
                if (!write_cache) continue;
                const int h = u - n_head - n_kv;
                const float* src = v + (i64)t * v_stride + (i64)h * hd;
                const i64 dst = ((i64)p * n_kv + h) * hd;
#pragma unroll
                for (int j = 0; j < EPL; ++j) {
                    const int i = j * WARP_SIZE + lane;
                    if (EXACT || i < hd) store_as<CT>(v_cache, dst + i, src[i]);
                }
                continue;
            }
            const bool is_q = u < n_head;
            const int h = is_q ? u : u - n_head;
            float* x = is_q ? qt + (i64)h * hd : kt + (i64)h * hd;

            float e[EPL];
            float ss = 0.0f;
#pragma unroll
            for (int j = 0; j < EPL; ++j) {
                const int i = j * WARP_SIZE + lane;
                e[j] = (EXACT || i < hd) ? x[i] : 0.0f;
                ss = fmaf(e[j], e[j], ss);
            }
            if constexpr (NORM != QkNorm::None) {
                const float* nw = is_q ? q_norm_w : k_norm_w;
                float inv;
                if constexpr (NORM == QkNorm::PerHead) {
                    inv = rsqrtf(warp_sum(ss) / (float)hd + eps);
                } else {
                    inv = full_inv[is_q ? 0 : 1];
                    nw += (i64)h * hd;
                }
#pragma unroll
                for (int j = 0; j < EPL; ++j) {
                    const int i = j * WARP_SIZE + lane;
                    if (EXACT || i < hd) e[j] = e[j] * inv * __ldg(nw + i);
                }
            }

            i64 cache_row = 0;
            if (!is_q) cache_row = ((i64)p * n_kv + h) * hd;
            const bool cache_k = !is_q && write_cache;

            if constexpr (MODE == RopeMode::None) {
#pragma unroll
                for (int j = 0; j < EPL; ++j) {
                    const int i = j * WARP_SIZE + lane;
                    if (EXACT || i < hd) {
                        x[i] = e[j];
                        if (cache_k) store_as<CT>(k_cache, cache_row + i, e[j]);
                    }
                }
            } else {
                float* b = buf[warp];
#pragma unroll
                for (int j = 0; j < EPL; ++j) {
                    const int i = j * WARP_SIZE + lane;
                    if (EXACT || i < hd) b[i] = e[j];
                }
                __syncwarp();
                for (int i = lane; i < half; i += WARP_SIZE) {  // rotated pairs
                    const int a = MODE == RopeMode::Neox ? i : 2 * i;
                    const int c = MODE == RopeMode::Neox ? i + half : 2 * i + 1;
                    const float2 r = cs[i];
                    const float x0 = b[a], x1 = b[c];
                    const float y0 = x0 * r.x - x1 * r.y;
                    const float y1 = x0 * r.y + x1 * r.x;
                    x[a] = y0;
                    x[c] = y1;
                    if (cache_k) {
                        store_as<CT>(k_cache, cache_row + a, y0);
                        store_as<CT>(k_cache, cache_row + c, y1);
                    }
                }
                for (int i = n_rot + lane; i < hd; i += WARP_SIZE) {  // pass-through tail
                    x[i] = b[i];
                    if (cache_k) store_as<CT>(k_cache, cache_row + i, b[i]);
                }
                __syncwarp();  // buf is reused by this warp's next unit
            }
        }
    }
}

}  // namespace memra

#define MEMRA_DEFINE_QK_NORM_ROPE(SYMBOL, CFG)                                                         \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS)                                         \
        SYMBOL(float* q, float* k, const float* v, const float* q_norm_w, const float* k_norm_w,       \
               const int* pos, void* k_cache, void* v_cache, int n_tokens, int head_dim, int n_head,   \
               int n_kv, int n_rot, int q_stride, int k_stride, int v_stride, int max_ctx,             \
               float freq_base, float freq_scale, float eps) {                                         \
        memra::pdl_entry();                                                                            \
        memra::qk_norm_rope_impl<CFG>(q, k, v, q_norm_w, k_norm_w, pos, k_cache, v_cache, n_tokens,    \
                                      head_dim, n_head, n_kv, n_rot, q_stride, k_stride, v_stride,     \
                                      max_ctx, freq_base, freq_scale, eps);                            \
    }
