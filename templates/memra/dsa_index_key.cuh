// memra/dsa_index_key.cuh — DSA index-key producer (model-specs §8.2 step 3, §8.4 steps 3 and 5):
// k = LayerNorm(k_raw; weight, bias, eps), RoPE on its first n_rot dims (the indexer's rope part
// comes first), written to the index-key cache row pos[t]. k_raw is the indexer.attn_k
// projection of the attn_norm output.
//
// Cfg fields:
//   HEAD_DIM   int              d_I (≤ 256); 0 = run time
//   N_ROT      int              roped dims at the start of the key (even, ≤ HEAD_DIM); 0 = run time
//   ROPE_MODE  memra::RopeMode  Interleaved (pairs (2i, 2i+1), GLM-5) or Neox (pairs (i, i + n_rot/2),
//                               DeepSeek-V3.2); None = no RoPE
//   CACHE_T    memra::CacheType index-key cache element type
//   THREADS    int              threads per block (multiple of 32; a warp per token)
// Kernel parameters:
//   (const float* k, const float* weight, const float* bias, const int* pos, void* kcache,
//    int n_tokens, int head_dim, int n_rot, int k_stride, int max_ctx, float freq_base,
//    float freq_scale, float eps)
//   k [n_tokens] rows of k_stride floats (the first head_dim used); weight, bias [head_dim];
//   pos [n_tokens] on the device; kcache [max_ctx, head_dim] CACHE_T. A token whose position is
//   outside [0, max_ctx) writes nothing. LayerNorm: biased variance, f32 sums.
//   θ_i = freq_scale · pos · base^(−2i/n_rot), formed and reduced mod 2π in f64, sin/cos in f32
//   (as qk_norm_rope).
// Geometry: grid (any ≥ 1; tokens are visited with a grid stride of gridDim.x·THREADS/32 warps),
//   block THREADS, static shared memory (THREADS/32)·256·4 bytes.
#pragma once
#include "memra/common.cuh"

namespace memra {

template <class Cfg>
__device__ __forceinline__ void dsa_index_key_impl(const float* __restrict__ k, const float* __restrict__ weight,
                                                   const float* __restrict__ bias, const int* __restrict__ pos,
                                                   void* __restrict__ kcache, int n_tokens, int head_dim_rt,
                                                   int n_rot_rt, int k_stride, int max_ctx, float freq_base,
                                                   float freq_scale, float eps) {
    constexpr int THREADS = Cfg::THREADS;
    constexpr int W = THREADS / WARP_SIZE;
    constexpr int CAP = 256;
    constexpr int PER = CAP / WARP_SIZE;
    constexpr RopeMode MODE = Cfg::ROPE_MODE;
    static_assert(THREADS % WARP_SIZE == 0 && THREADS <= 1024, "THREADS must be a multiple of 32, <= 1024");
    static_assert(Cfg::HEAD_DIM <= CAP, "HEAD_DIM must be <= 256");
    const int hd = dim_or<Cfg::HEAD_DIM>(head_dim_rt);
    const int n_rot = MODE == RopeMode::None ? 0 : dim_or<Cfg::N_ROT>(n_rot_rt);
    const int half = n_rot / 2;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    __shared__ float buf[W][CAP];
    const double log2_base = MODE == RopeMode::None ? 0.0 : log2((double)freq_base);

    for (int t = blockIdx.x * W + warp; t < n_tokens; t += gridDim.x * W) {
        const int p = pos[t];
        if (p < 0 || p >= max_ctx) continue;  // warp-uniform
        const float* x = k + (i64)t * k_stride;
        float v[PER];
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = lane + WARP_SIZE * j;
            v[j] = i < hd ? x[i] : 0.0f;
            s += v[j];
        }
        const float mean = warp_sum(s) / (float)hd;
        float s2 = 0.0f;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const float d = lane + WARP_SIZE * j < hd ? v[j] - mean : 0.0f;
            s2 = fmaf(d, d, s2);
        }
        const float inv = rsqrtf(warp_sum(s2) / (float)hd + eps);
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = lane + WARP_SIZE * j;
            if (i < hd) {
                v[j] = fmaf((v[j] - mean) * inv, weight[i], bias[i]);
                buf[warp][i] = v[j];
            }
        }
        __syncwarp();
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = lane + WARP_SIZE * j;
            if (i >= hd) continue;
            float o = v[j];
            if (MODE != RopeMode::None && i < n_rot) {
                const bool interleaved = MODE == RopeMode::Interleaved;
                const int pair = interleaved ? i >> 1 : (i < half ? i : i - half);
                const bool first = interleaved ? (i & 1) == 0 : i < half;
                const int partner = interleaved ? i ^ 1 : (first ? i + half : i - half);
                const double theta = (double)freq_scale * (double)p *
                                     exp2_f64(-(double)(2 * pair) / (double)n_rot * log2_base);
                const double r = theta - rint(theta * 0.15915494309189535) * 6.283185307179586;
                float sn, cs;
                __sincosf((float)r, &sn, &cs);
                const float other = buf[warp][partner];
                o = first ? v[j] * cs - other * sn : other * sn + v[j] * cs;
            }
            store_as<Cfg::CACHE_T>(kcache, (i64)p * hd + i, o);
        }
        __syncwarp();  // buf is rewritten by this warp's next token
    }
}

}  // namespace memra

#define MEMRA_DEFINE_DSA_INDEX_KEY(SYMBOL, CFG)                                                                \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS)                                                 \
        SYMBOL(const float* k, const float* weight, const float* bias, const int* pos, void* kcache,            \
               int n_tokens, int head_dim, int n_rot, int k_stride, int max_ctx, float freq_base,               \
               float freq_scale, float eps) {                                                                   \
        memra::pdl_entry();                                                                                     \
        memra::dsa_index_key_impl<CFG>(k, weight, bias, pos, kcache, n_tokens, head_dim, n_rot, k_stride,       \
                                       max_ctx, freq_base, freq_scale, eps);                                    \
    }
