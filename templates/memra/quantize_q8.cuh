// memra/quantize_q8.cuh — f32 rows to q8 rows, the activations of matvec / moe_matvec with
// XQ8 = 1 (owned by H-gemv). Per block of 32 elements (llama.cpp's q8_1 numerics):
//
//   amax = max |x_i|, d = amax / 127, q_i = amax == 0 ? 0 : round(x_i / d) (half away from zero),
//   s = Σ q_i (an exact integer, stored as f32)
//
// with IEEE division (no reciprocal), so memra_reference::q8::quantize_q8_blocks gives the same
// bytes. A q8 row of K elements (K a multiple of 32) is round_up(K + K/4, 16) bytes: K int8 q,
// then K/32 (d, s) f32 pairs, then padding (never written, never used).
//
// Cfg fields (static constexpr):
//   int   THREADS         threads per block (multiple of 32; a warp per block of 32)
//
// Kernel parameters, in order:
//   (const float* x, float* xq, int k, int rows, int ldx, int ldq)
//   x: [rows][ldx] f32; xq: [rows][ldq] (q8 rows viewed as floats, 16-byte aligned, ldq % 4 == 0,
//   4·ldq ≥ the q8 row bytes); k % 32 == 0.
//
// Launch geometry: grid (ceil(k / 32 / (THREADS / 32)), min(rows, 65535)), block THREADS (any
// grid ≥ 1 is correct: warps stride over blocks, grid.y over rows); no dynamic shared memory.
#pragma once
#include "memra/matvec.cuh"  // q8_block_lane

namespace memra {

template <class Cfg>
__device__ __forceinline__ void quantize_q8_impl(const float* __restrict__ x, float* __restrict__ xq, int k, int rows,
                                                 int ldx, int ldq) {
    constexpr int WARPS = Cfg::THREADS / 32;
    static_assert(Cfg::THREADS % 32 == 0 && Cfg::THREADS <= 1024, "THREADS must be a multiple of 32, ≤ 1024");
    const int lane = threadIdx.x % 32, n_blocks = k / 32;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const float* xr = x + (i64)r * ldx;
        i8* qs = reinterpret_cast<i8*>(xq + (i64)r * ldq);
        float* ds = xq + (i64)r * ldq + k / 4;
        for (int blk = blockIdx.x * WARPS + threadIdx.x / 32; blk < n_blocks; blk += gridDim.x * WARPS) {
            int q;
            float d, s;
            q8_block_lane(xr[32 * blk + lane], q, d, s);
            qs[32 * blk + lane] = (i8)q;
            if (lane == 0) {
                ds[2 * blk] = d;
                ds[2 * blk + 1] = s;
            }
        }
    }
}

}  // namespace memra

#define MEMRA_DEFINE_QUANTIZE_Q8(SYMBOL, CFG)                                                                 \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS)                                               \
        SYMBOL(const float* __restrict__ x, float* __restrict__ xq, int k, int rows, int ldx, int ldq) {    \
        memra::pdl_entry();                                                                                 \
        memra::quantize_q8_impl<CFG>(x, xq, k, rows, ldx, ldq);                                             \
    }
