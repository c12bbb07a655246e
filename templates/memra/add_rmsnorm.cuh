// memra/add_rmsnorm.cuh — fused residual add + RMSNorm (one read of each input, row in registers).
//
// Cfg fields:
//   N           int  row length; 0 = run time (kernel parameter n)
//   DELTA_NORM  int  0: residual += delta.  1: residual += rmsnorm(delta)·delta_w (gemma3's
//                    post-attention / post-FFW norm, same eps)
//   THREADS     int  threads per block (multiple of 32)
// Kernel parameters: (float* residual, const float* delta, const float* delta_w, const float* w,
//                     float* out, int n_rows, int n, float eps)
//   residual[r, :] += d[r, :];  out[r, :] = rmsnorm(residual[r, :]) · w.  delta_w may be null
//   when DELTA_NORM = 0. out may alias delta (each element is read before it is written).
// Geometry: as rmsnorm: R = (n <= 1024 ? THREADS/32 : 1) rows per block, grid (ceil(n_rows / R)),
//   block THREADS, no dynamic smem.
#pragma once
#include "memra/rmsnorm.cuh"

namespace memra {

template <class Cfg>
__device__ __forceinline__ void add_rmsnorm_impl(float* residual, const float* delta, const float* delta_w,
                                                 const float* w, float* out, int n_rows, int n, float eps) {
    static_assert(Cfg::DELTA_NORM == 0 || Cfg::DELTA_NORM == 1, "DELTA_NORM is 0 or 1");
    norm_detail::dispatch<Cfg::DELTA_NORM ? 2 : 1, Cfg::N, Cfg::THREADS>(residual, delta, delta_w, w, residual,
                                                                        out, n_rows, n, eps);
}

}  // namespace memra

#define MEMRA_DEFINE_ADD_RMSNORM(SYMBOL, CFG)                                                          \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS)                                         \
        SYMBOL(float* residual, const float* delta, const float* delta_w, const float* w, float* out,  \
               int n_rows, int n, float eps) {                                                         \
        memra::pdl_entry();                                                                            \
        memra::add_rmsnorm_impl<CFG>(residual, delta, delta_w, w, out, n_rows, n, eps);                \
    }
