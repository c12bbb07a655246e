// memra/embed.cuh — token embedding gather from a GGUF table into f32 rows, with a scale.
//
// Cfg fields:
//   N_EMBD   int           row length n_embd; 0 = run time
//   QTYPE    memra::QType  table type (any QType of quant.cuh)
//   THREADS  int           threads per block (multiple of 32)
// Kernel parameters: (const int* tokens, const void* table, float* out, int n_tokens, int n_embd,
//                     int n_vocab, float scale)
//   table ne = [n_embd, n_vocab] (row v = token v, row_bytes<QTYPE>(n_embd) bytes per row);
//   out [n_tokens, n_embd] = dequant(row tokens[t]) · scale (gemma3: scale = sqrt(n_embd)).
//   A token outside [0, n_vocab) gets a NaN row. Block types need n_embd % block == 0.
// Geometry: grid (min(n_tokens, 65535)), block THREADS, no dynamic smem; tokens use a grid
//   stride (any grid >= 1 is correct). Each thread dequantizes runs of 8 elements.
#pragma once
#include "memra/quant.cuh"

namespace memra {

template <class Cfg>
__device__ __forceinline__ void embed_impl(const int* __restrict__ tokens, const void* __restrict__ table,
                                           float* __restrict__ out, int n_tokens, int n_embd_rt, int n_vocab,
                                           float scale) {
    constexpr QType Q = Cfg::QTYPE;
    constexpr int THREADS = Cfg::THREADS;
    static_assert(Cfg::N_EMBD % QTraits<Q>::BLOCK == 0, "N_EMBD must be a multiple of the block size");
    const int n = dim_or<Cfg::N_EMBD>(n_embd_rt);
    const i64 stride = row_bytes<Q>(n);
    const int groups = n / 8;
    const bool vec = (Cfg::N_EMBD != 0 ? Cfg::N_EMBD % 4 == 0 : n % 4 == 0) && (unsigned long long)out % 16 == 0;

    for (int t = blockIdx.x; t < n_tokens; t += gridDim.x) {
        const int tok = tokens[t];
        float* o = out + (i64)t * n;
        if (tok < 0 || tok >= n_vocab) {
            for (int i = threadIdx.x; i < n; i += THREADS) o[i] = __int_as_float(0x7fc00000);
            continue;
        }
        const u8* row = static_cast<const u8*>(table) + (i64)tok * stride;
        for (int g = threadIdx.x; g < groups; g += THREADS) {
            float v[8];
            dequant8<Q>(row, g, v);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] *= scale;
            if (vec) {
                store_f4(o + 8 * g, make_float4(v[0], v[1], v[2], v[3]));
                store_f4(o + 8 * g + 4, make_float4(v[4], v[5], v[6], v[7]));
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) o[8 * g + i] = v[i];
            }
        }
        if constexpr (QTraits<Q>::BLOCK == 1) {  // tail of float rows: n % 8 elements
            for (int i = groups * 8 + threadIdx.x; i < n; i += THREADS) o[i] = dequant1<Q>(row, i) * scale;
        }
    }
}

}  // namespace memra

#define MEMRA_DEFINE_EMBED(SYMBOL, CFG)                                                                \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS)                                         \
        SYMBOL(const int* tokens, const void* table, float* out, int n_tokens, int n_embd, int n_vocab, \
               float scale) {                                                                          \
        memra::pdl_entry();                                                                            \
        memra::embed_impl<CFG>(tokens, table, out, n_tokens, n_embd, n_vocab, scale);                  \
    }
