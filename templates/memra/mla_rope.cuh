// memra/mla_rope.cuh — the per-token RoPE work of an MLA layer (model-specs §6.3 steps 2-4, §8.4
// step 3) in one launch, a block per token:
//   (a) latent cache row: c = RMSNorm(kv[t][0..kv_lora))·kv_norm_w, k_pe = RoPE(kv[t][kv_lora..])
//       -> cache[pos[t]] = [c | k_pe] as CACHE_T;
//   (b) absorbed-query tail: q_out[t][h][kv_lora..] = RoPE(q[t][h][nope..]) for every head (the
//       absorption q_nope·attn_k_b fills q_out[t][h][0..kv_lora) in another launch);
//   (c) DSA indexer queries (n_idx_head > 0): iq[t][h] <- idx_q_scale · RoPE(iq[t][h]) in place, the
//       rope part first in each indexer head (§8.1), plain RoPE (no frequency scaling). The scale
//       carries the indexer's 1/sqrt(d_I·H_I) head-weight factor: Σ_h w_h·ReLU(c·q_h·k) =
//       c·Σ_h w_h·ReLU(q_h·k) for c > 0.
//
// RoPE of (a) and (b), pair i < rope/2 (YaRN as ggml's rope_yarn without the magnitude factor,
// which memra folds into the softmax scale, §6.4):
//   e_i = pos · base^(−2i/rope), ramp_i = ext_factor · (1 − clamp((i − corr_low) /
//   max(corr_high − corr_low, 0.001), 0, 1)), θ_i = freq_scale·e_i·(1 − ramp_i) + e_i·ramp_i
//   (ext_factor = 0: plain linear scaling). Per-pair frequencies in f64; θ formed and reduced
//   mod 2π in f64, sin/cos in f32 (as qk_norm_rope). Pairs (2i, 2i+1) Interleaved, (i, i + rope/2) Neox.
//
// Cfg fields:
//   N_HEAD     int              MLA heads; 0 = run time
//   NOPE       int              q head's non-rotated part (q head = [nope | rope]); 0 = run time
//   ROPE       int              rotated dims (even, ≤ 128); 0 = run time
//   KV_LORA    int              latent width (≤ 1024); 0 = run time
//   ROPE_MODE  memra::RopeMode  None / Interleaved (GLM-5, DeepSeek) / Neox
//   CACHE_T    memra::CacheType latent cache element type
//   THREADS    int              threads per block (multiple of 32)
// The indexer job's sizes (n_idx_head, idx_head_dim) are always run time (a few hundred floats).
// Kernel parameters:
//   (const float* q, float* q_out, const float* kv, const float* kv_norm_w, const int* pos,
//    void* cache, float* iq, int n_tokens, int n_head, int nope, int rope, int kv_lora,
//    int n_idx_head, int idx_head_dim, int max_ctx, float freq_base, float freq_scale,
//    float ext_factor, float corr_low, float corr_high, float idx_q_scale, float eps)
//   q [T, n_head, nope + rope], q_out [T, n_head, kv_lora + rope], kv [T, kv_lora + rope],
//   kv_norm_w [kv_lora], pos [T] on the device, cache [max_ctx, kv_lora + rope] CACHE_T,
//   iq [T, n_idx_head, idx_head_dim] (unread when n_idx_head = 0; idx_head_dim ≥ rope).
//   pos[t] ∉ [0, max_ctx): no cache write and q_out[t][h][kv_lora..] = NaN (iq untouched).
// Geometry: grid (min(T, 65535), P) (tokens with a grid stride; the P blocks of a token share its
//   q_pe pairs and indexer work, block y = 0 also normalizes and caches the latent), block
//   THREADS, static shared memory about 2.5 KiB; no dynamic shared memory. One block a token left
//   a decode step's 2,048 q_pe pairs (GLM-5) to 256 threads in 8 dependent rounds of loads.
#pragma once
#include "memra/common.cuh"

#define MEMRA_DEFINE_MLA_ROPE(SYMBOL, CFG)                                                                      \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS)                                                  \
        SYMBOL(const float* q, float* q_out, const float* kv, const float* kv_norm_w, const int* pos,           \
               void* cache, float* iq, int n_tokens, int n_head, int nope, int rope, int kv_lora,               \
               int n_idx_head, int idx_head_dim, int max_ctx, float freq_base, float freq_scale,                \
               float ext_factor, float corr_low, float corr_high, float idx_q_scale, float eps) {               \
        memra::pdl_entry();                                                                                     \
        memra::mla_rope_impl<CFG>(q, q_out, kv, kv_norm_w, pos, cache, iq, n_tokens, n_head, nope, rope,        \
                                  kv_lora, n_idx_head, idx_head_dim, max_ctx, freq_base, freq_scale,            \
                                  ext_factor, corr_low, corr_high, idx_q_scale, eps);                           \
    }

namespace memra {

constexpr int MLA_ROPE_MAX_ROPE = 128;
constexpr int MLA_ROPE_MAX_KV_LORA = 1024;

namespace mla_rope_detail {

// The pair (a, b) rotated by frequency i.
template <RopeMode MODE> __device__ __forceinline__ void pair(int i, int half, int& a, int& b) {
    if constexpr (MODE == RopeMode::Neox) {
        a = i;
        b = i + half;
    } else {
        a = 2 * i;
        b = 2 * i + 1;
    }
}

__device__ __forceinline__ float2 cos_sin(double theta) {
    const double r = theta - rint(theta * 0.15915494309189535) * 6.283185307179586;
    float s, c;
    __sincosf((float)r, &s, &c);  // |r| <= π
    return make_float2(c, s);
}

}  // namespace mla_rope_detail

template <class Cfg>
__device__ __forceinline__ void mla_rope_impl(const float* __restrict__ q, float* __restrict__ q_out,
                                              const float* __restrict__ kv, const float* __restrict__ kv_norm_w,
                                              const int* __restrict__ pos, void* __restrict__ cache, float* iq,
                                              int n_tokens, int n_head_rt, int nope_rt, int rope_rt, int kv_lora_rt,
                                              int n_idx_head, int idx_head_dim, int max_ctx, float freq_base,
                                              float freq_scale, float ext_factor, float corr_low, float corr_high,
                                              float idx_q_scale, float eps) {
    constexpr int THREADS = Cfg::THREADS;
    constexpr RopeMode MODE = Cfg::ROPE_MODE;
    constexpr CacheType CT = Cfg::CACHE_T;
    static_assert(THREADS % WARP_SIZE == 0 && THREADS <= 1024, "THREADS must be a multiple of 32, <= 1024");
    static_assert(Cfg::ROPE % 2 == 0 && Cfg::ROPE <= MLA_ROPE_MAX_ROPE, "ROPE even, <= 128");
    static_assert(Cfg::KV_LORA <= MLA_ROPE_MAX_KV_LORA, "KV_LORA <= 1024");
    constexpr int HALF_CAP = Cfg::ROPE != 0 ? (Cfg::ROPE / 2 > 0 ? Cfg::ROPE / 2 : 1) : MLA_ROPE_MAX_ROPE / 2;
    // Latent elements per thread: exact when specialized, the cap when generic.
    constexpr int LAT_CAP = Cfg::KV_LORA != 0 ? Cfg::KV_LORA : MLA_ROPE_MAX_KV_LORA;
    constexpr int EPT = ceil_div(LAT_CAP, THREADS);
    constexpr bool EXACT = Cfg::KV_LORA != 0 && Cfg::KV_LORA % THREADS == 0;

    const int n_head = dim_or<Cfg::N_HEAD>(n_head_rt);
    const int nope = dim_or<Cfg::NOPE>(nope_rt);
    const int rope = dim_or<Cfg::ROPE>(rope_rt);  // None: the dims are copied unrotated
    const int kv_lora = dim_or<Cfg::KV_LORA>(kv_lora_rt);
    const int half = rope / 2;
    const int dq = nope + rope, dk = kv_lora + rope;

    __shared__ double freq[HALF_CAP];      // MLA frequency per pair (YaRN-mixed)
    __shared__ double idx_freq[HALF_CAP];  // indexer frequency per pair (plain)
    __shared__ float2 cs[HALF_CAP];
    __shared__ float2 idx_cs[HALF_CAP];

    if constexpr (MODE != RopeMode::None) {
        const double log2_base = log2((double)freq_base);
        for (int i = threadIdx.x; i < half; i += THREADS) {
            const double e = exp2_f64(-(double)(2 * i) / (double)rope * log2_base);
            double f = (double)freq_scale * e;
            if (ext_factor != 0.0f) {
                const double y = ((double)i - (double)corr_low) / fmax((double)corr_high - (double)corr_low, 0.001);
                const double ramp = (1.0 - fmin(fmax(y, 0.0), 1.0)) * (double)ext_factor;
                f = f * (1.0 - ramp) + e * ramp;
            }
            freq[i] = f;
            idx_freq[i] = e;
        }
    }

    for (int t = blockIdx.x; t < n_tokens; t += gridDim.x) {
        const int p = pos[t];
        const bool valid = p >= 0 && p < max_ctx;
        __syncthreads();  // freq written / the previous token's cs no longer read
        if constexpr (MODE != RopeMode::None) {
            for (int i = threadIdx.x; i < half; i += THREADS) {
                cs[i] = mla_rope_detail::cos_sin((double)p * freq[i]);
                idx_cs[i] = mla_rope_detail::cos_sin((double)p * idx_freq[i]);
            }
        }
        // (a) the latent row (block y = 0): RMSNorm (f32 sums), then the cache write.
        if (blockIdx.y == 0) {
            const float* kvt = kv + (i64)t * dk;
            float lat[EPT];
            float ss = 0.0f;
#pragma unroll
            for (int j = 0; j < EPT; ++j) {
                const int i = j * THREADS + threadIdx.x;
                lat[j] = (EXACT || i < kv_lora) ? kvt[i] : 0.0f;
                ss = fmaf(lat[j], lat[j], ss);
            }
            const float inv = rsqrtf(block_sum<THREADS>(ss) / (float)kv_lora + eps);  // also syncs cs
            if (valid) {
                const i64 row = (i64)p * dk;
#pragma unroll
                for (int j = 0; j < EPT; ++j) {
                    const int i = j * THREADS + threadIdx.x;
                    if (EXACT || i < kv_lora) store_as<CT>(cache, row + i, lat[j] * inv * kv_norm_w[i]);
                }
                for (int i = threadIdx.x; i < half; i += THREADS) {
                    int a, b;
                    mla_rope_detail::pair<MODE>(i, half, a, b);
                    const float x0 = kvt[kv_lora + a], x1 = kvt[kv_lora + b];
                    float y0 = x0, y1 = x1;
                    if constexpr (MODE != RopeMode::None) {
                        y0 = x0 * cs[i].x - x1 * cs[i].y;
                        y1 = x0 * cs[i].y + x1 * cs[i].x;
                    }
                    store_as<CT>(cache, row + kv_lora + a, y0);
                    store_as<CT>(cache, row + kv_lora + b, y1);
                }
            }
        }
        __syncthreads();  // cs written (block y = 0's block_sum synced it already)
        // (b) q_pe of every head -> the absorbed query's tail.
        const float* qt = q + (i64)t * n_head * dq;
        float* ot = q_out + (i64)t * n_head * dk;
        // This block's share of the token's per-head items: y·THREADS + tid, stride P·THREADS.
        for (int u = blockIdx.y * THREADS + threadIdx.x; u < n_head * half; u += gridDim.y * THREADS) {
            const int h = u / half, i = u - h * half;
            int a, b;
            mla_rope_detail::pair<MODE>(i, half, a, b);
            const float x0 = qt[h * dq + nope + a], x1 = qt[h * dq + nope + b];
            float y0 = x0, y1 = x1;
            if constexpr (MODE != RopeMode::None) {
                y0 = x0 * cs[i].x - x1 * cs[i].y;
                y1 = x0 * cs[i].y + x1 * cs[i].x;
            }
            if (!valid) y0 = y1 = __int_as_float(0x7fc00000);
            ot[h * dk + kv_lora + a] = y0;
            ot[h * dk + kv_lora + b] = y1;
        }
        // (c) indexer queries in place: rope part first, then the whole head scaled.
        if (n_idx_head > 0 && valid) {
            float* it = iq + (i64)t * n_idx_head * idx_head_dim;
            for (int u = blockIdx.y * THREADS + threadIdx.x; u < n_idx_head * half; u += gridDim.y * THREADS) {
                const int h = u / half, i = u - h * half;
                int a, b;
                mla_rope_detail::pair<MODE>(i, half, a, b);
                float* x = it + (i64)h * idx_head_dim;
                const float x0 = x[a], x1 = x[b];
                float y0 = x0, y1 = x1;
                if constexpr (MODE != RopeMode::None) {
                    y0 = x0 * idx_cs[i].x - x1 * idx_cs[i].y;
                    y1 = x0 * idx_cs[i].y + x1 * idx_cs[i].x;
                }
                x[a] = y0 * idx_q_scale;
                x[b] = y1 * idx_q_scale;
            }
            const int rest = idx_head_dim - rope;
            for (int u = blockIdx.y * THREADS + threadIdx.x; u < n_idx_head * rest; u += gridDim.y * THREADS) {
                const int h = u / rest, i = rope + (u - h * rest);
                it[(i64)h * idx_head_dim + i] *= idx_q_scale;
            }
        }
    }
}

}  // namespace memra
