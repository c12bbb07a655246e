// memra/rmsnorm.cuh — RMSNorm over rows, and the row engine shared with add_rmsnorm.
//
// Cfg fields:
//   N        int  row length; 0 = run time (kernel parameter n)
//   THREADS  int  threads per block (multiple of 32)
// Kernel parameters: (const float* x, const float* w, float* out, int n_rows, int n, float eps)
//   out[r, i] = x[r, i] / sqrt(mean_i(x[r, :]^2) + eps) * w[i]; out == x is allowed.
// Geometry: rows per block R = (n <= 1024 ? THREADS/32 : 1): a warp per row for short rows,
//   a block per row otherwise; grid (ceil(n_rows / R)), block THREADS, no dynamic smem.
//   Rows are visited with a grid stride, so any grid >= 1 is correct.
// Specialized (N != 0): the row sits in registers (float4 when N % 4 == 0), loops unroll, the
// bounds checks vanish when N divides evenly. Generic: the same register path for
// n <= 32 floats per thread with guarded loads, else two passes (the second hits L1/L2).
#pragma once
#include "memra/common.cuh"

namespace memra {
namespace norm_detail {

// MODE 0: out = norm(x)·w. MODE 1: res += delta; out = norm(res)·w.
// MODE 2: res += norm(delta)·dw; out = norm(res)·w.
template <int G, int THREADS> __device__ __forceinline__ float group_sum(float v) {
    if constexpr (G == WARP_SIZE) {
        return warp_sum(v);
    } else {
        return block_sum<THREADS>(v);
    }
}

template <int VW> struct Vec { float a[VW]; };

template <int VW> __device__ __forceinline__ Vec<VW> ld(const float* p) {
    Vec<VW> v;
    if constexpr (VW == 4) {
        const float4 f = load_f4(p);
        v.a[0] = f.x; v.a[1] = f.y; v.a[2] = f.z; v.a[3] = f.w;
    } else {
#pragma unroll
        for (int i = 0; i < VW; ++i) v.a[i] = p[i];
    }
    return v;
}

template <int VW> __device__ __forceinline__ Vec<VW> ldg(const float* __restrict__ p) {
    Vec<VW> v;
    if constexpr (VW == 4) {
        const float4 f = __ldg(reinterpret_cast<const float4*>(p));
        v.a[0] = f.x; v.a[1] = f.y; v.a[2] = f.z; v.a[3] = f.w;
    } else {
#pragma unroll
        for (int i = 0; i < VW; ++i) v.a[i] = __ldg(p + i);
    }
    return v;
}

template <int VW> __device__ __forceinline__ void st(float* p, const Vec<VW>& v) {
    if constexpr (VW == 4) {
        store_f4(p, make_float4(v.a[0], v.a[1], v.a[2], v.a[3]));
    } else {
#pragma unroll
        for (int i = 0; i < VW; ++i) p[i] = v.a[i];
    }
}

template <int VW> __device__ __forceinline__ float sumsq(const Vec<VW>& v) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < VW; ++i) s = fmaf(v.a[i], v.a[i], s);
    return s;
}

// One row, held in registers: VPT vectors of VW floats per thread. FULL = every slot valid.
template <int MODE, int G, int THREADS, int VW, int VPT, bool FULL>
__device__ __forceinline__ void row_regs(const float* src, const float* delta, const float* __restrict__ dw,
                                         const float* __restrict__ w, float* res_out, float* out, int n,
                                         float eps, int t) {
    const int nv = n / VW;
    Vec<VW> r[VPT];
    if constexpr (MODE == 0) {
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            const int idx = t + j * G;
            if (FULL || idx < nv) r[j] = ld<VW>(src + idx * VW);
            else r[j] = Vec<VW>{};
        }
    } else {
        Vec<VW> d[VPT];
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            const int idx = t + j * G;
            if (FULL || idx < nv) {
                r[j] = ld<VW>(src + idx * VW);
                d[j] = ld<VW>(delta + idx * VW);
            } else {
                r[j] = Vec<VW>{};
                d[j] = Vec<VW>{};
            }
        }
        float inv_d = 1.0f;
        if constexpr (MODE == 2) {
            float ss = 0.0f;
#pragma unroll
            for (int j = 0; j < VPT; ++j) ss += sumsq(d[j]);
            inv_d = rsqrtf(group_sum<G, THREADS>(ss) / (float)n + eps);
        }
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            const int idx = t + j * G;
            if (FULL || idx < nv) {
                if constexpr (MODE == 2) {
                    const Vec<VW> wv = ldg<VW>(dw + idx * VW);
#pragma unroll
                    for (int i = 0; i < VW; ++i) r[j].a[i] += d[j].a[i] * inv_d * wv.a[i];
                } else {
#pragma unroll
                    for (int i = 0; i < VW; ++i) r[j].a[i] += d[j].a[i];
                }
                st<VW>(res_out + idx * VW, r[j]);
            }
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < VPT; ++j) ss += sumsq(r[j]);
    const float inv = rsqrtf(group_sum<G, THREADS>(ss) / (float)n + eps);
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
        const int idx = t + j * G;
        if (FULL || idx < nv) {
            const Vec<VW> wv = ldg<VW>(w + idx * VW);
            Vec<VW> o;
#pragma unroll
            for (int i = 0; i < VW; ++i) o.a[i] = r[j].a[i] * inv * wv.a[i];
            st<VW>(out + idx * VW, o);
        }
    }
}

// One row streamed through memory (rows too long for registers, or odd generic lengths).
// Each element is re-read only by the thread that wrote it, so in-place use is safe.
template <int MODE, int G, int THREADS, int VW>
__device__ __forceinline__ void row_stream(const float* src, const float* delta, const float* __restrict__ dw,
                                           const float* __restrict__ w, float* res_out, float* out, int n,
                                           float eps, int t) {
    const int nv = n / VW;
    const float* normed_src = src;
    if constexpr (MODE != 0) {
        float inv_d = 1.0f;
        if constexpr (MODE == 2) {
            float ss = 0.0f;
            for (int idx = t; idx < nv; idx += G) ss += sumsq(ld<VW>(delta + idx * VW));
            inv_d = rsqrtf(group_sum<G, THREADS>(ss) / (float)n + eps);
        }
        for (int idx = t; idx < nv; idx += G) {
            Vec<VW> r = ld<VW>(src + idx * VW);
            const Vec<VW> d = ld<VW>(delta + idx * VW);
            if constexpr (MODE == 2) {
                const Vec<VW> wv = ldg<VW>(dw + idx * VW);
#pragma unroll
                for (int i = 0; i < VW; ++i) r.a[i] += d.a[i] * inv_d * wv.a[i];
            } else {
#pragma unroll
                for (int i = 0; i < VW; ++i) r.a[i] += d.a[i];
            }
            st<VW>(res_out + idx * VW, r);
        }
        normed_src = res_out;
    }
    float ss = 0.0f;
    for (int idx = t; idx < nv; idx += G) ss += sumsq(ld<VW>(normed_src + idx * VW));
    const float inv = rsqrtf(group_sum<G, THREADS>(ss) / (float)n + eps);
    for (int idx = t; idx < nv; idx += G) {
        const Vec<VW> r = ld<VW>(normed_src + idx * VW);
        const Vec<VW> wv = ldg<VW>(w + idx * VW);
        Vec<VW> o;
#pragma unroll
        for (int i = 0; i < VW; ++i) o.a[i] = r.a[i] * inv * wv.a[i];
        st<VW>(out + idx * VW, o);
    }
}

// Per-thread register budget for the row (floats); MODE != 0 holds two rows.
template <int MODE> __host__ __device__ constexpr int reg_floats() { return MODE == 0 ? 64 : 32; }

// All rows handled by groups of G threads (G = 32: a warp per row; G = THREADS: a block per row).
template <int MODE, int G, int THREADS, int NC>
__device__ __forceinline__ void rows(const float* src, const float* delta, const float* dw, const float* w,
                                     float* res_out, float* out, int n_rows, int n, float eps) {
    constexpr int R = THREADS / G;
    const int sub = threadIdx.x / G, t = threadIdx.x % G;
    for (i64 row = (i64)blockIdx.x * R + sub; row < n_rows; row += (i64)gridDim.x * R) {
        const i64 off = row * n;
        const float* s = src + off;
        const float* d = delta + off;
        float* ro = res_out + off;
        float* o = out + off;
        if constexpr (NC != 0) {
            constexpr int VW = NC % 4 == 0 ? 4 : 1;
            constexpr int NV = NC / VW;
            constexpr int VPT = ceil_div(NV, G);
            if constexpr (VPT * VW <= reg_floats<MODE>()) {
                row_regs<MODE, G, THREADS, VW, VPT, NV % G == 0>(s, d, dw, w, ro, o, NC, eps, t);
            } else {
                row_stream<MODE, G, THREADS, VW>(s, d, dw, w, ro, o, NC, eps, t);
            }
        } else {
            // Generic register cache: 8 float4 per thread (n <= 8192 at 256 threads). (6 made
            // ptxas cap add_rmsnorm at 64 registers and spill; 8 does not.)
            constexpr int VPT = 8;
            if (n % 4 == 0 && n <= 4 * G * VPT) {
                row_regs<MODE, G, THREADS, 4, VPT, false>(s, d, dw, w, ro, o, n, eps, t);
            } else if (n % 4 == 0) {
                row_stream<MODE, G, THREADS, 4>(s, d, dw, w, ro, o, n, eps, t);
            } else {
                row_stream<MODE, G, THREADS, 1>(s, d, dw, w, ro, o, n, eps, t);
            }
        }
    }
}

// Dispatch on the row length: a warp per row up to 1024, a block per row beyond.
template <int MODE, int N, int THREADS>
__device__ __forceinline__ void dispatch(const float* src, const float* delta, const float* dw, const float* w,
                                         float* res_out, float* out, int n_rows, int n_rt, float eps) {
    static_assert(THREADS % WARP_SIZE == 0 && THREADS <= 1024, "THREADS must be a multiple of 32, <= 1024");
    if constexpr (N != 0) {
        constexpr int G = N <= 1024 ? WARP_SIZE : THREADS;
        rows<MODE, G, THREADS, N>(src, delta, dw, w, res_out, out, n_rows, N, eps);
    } else if (n_rt <= 1024) {
        rows<MODE, WARP_SIZE, THREADS, 0>(src, delta, dw, w, res_out, out, n_rows, n_rt, eps);
    } else {
        rows<MODE, THREADS, THREADS, 0>(src, delta, dw, w, res_out, out, n_rows, n_rt, eps);
    }
}

}  // namespace norm_detail

template <class Cfg>
__device__ __forceinline__ void rmsnorm_impl(const float* x, const float* w, float* out, int n_rows, int n, float eps) {
    norm_detail::dispatch<0, Cfg::N, Cfg::THREADS>(x, nullptr, nullptr, w, nullptr, out, n_rows, n, eps);
}

}  // namespace memra

#define MEMRA_DEFINE_RMSNORM(SYMBOL, CFG)                                                              \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS)                                         \
        SYMBOL(const float* x, const float* w, float* out, int n_rows, int n, float eps) {             \
        memra::pdl_entry();                                                                            \
        memra::rmsnorm_impl<CFG>(x, w, out, n_rows, n, eps);                                           \
    }
