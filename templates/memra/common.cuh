// memra/common.cuh — shared device helpers for every kernel family (owned by H-dense).
//
// No CUDA toolkit headers: NVRTC compiles these with no include path. float2/float4/int4 and
// the math built-ins (rsqrtf, __expf, sincosf, exp2, rint, ...) are NVRTC built-ins.
// bf16/f16 live in `unsigned short` and are converted with PTX `cvt` (sm_80+).
#pragma once

namespace memra {

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef short i16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// Values are the ggml type ids (model-specs §1.3).
enum class QType : int {
    F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
    Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, BF16 = 30
};
enum class RopeMode : int { None = 0, Interleaved = 1, Neox = 2 };
enum class QkNorm : int { None = 0, PerHead = 1, Full = 2 };
enum class CacheType : int { F32 = 0, BF16 = 1 };
// MoE (moe_matvec.cuh, moe_router.cuh). Gating values = GGUF `expert_gating_func`.
enum class MoeMode : int { Plain = 0, Swiglu = 1, Down = 2, Geglu = 3 };
enum class Gating : int { Softmax = 1, Sigmoid = 2 };

constexpr int WARP_SIZE = 32;

// Programmatic dependent launch (engine/src/cuda/graph.rs). pdl_entry() waits until the grids
// this one depends on have completed and their writes are visible (so a programmatic edge orders
// memory like a normal one), then lets the next kernel of the graph launch. Waiting first keeps
// at most one kernel ahead; triggering first would let each launched kernel launch its successor
// at once, a cascade of waiting grids on the SMs (that order measured slower than no PDL on the
// H200). Without PDL both are no-ops.
//
// Most kernels call it as their first statement (the MEMRA_DEFINE_* macros). A few do useful
// work before it, while the previous kernel still runs: they may only read what no kernel of the
// step writes (weights, norm weights, the positions: written by the host or by the previous
// step's argmax, a separate graph launch, argmax.cuh's decode feed) and only touch other memory
// as L2 prefetch hints; everything else waits. Every block calls it exactly once, before it
// writes global memory or returns, so the grid completes only after its predecessors did.
__device__ __forceinline__ void pdl_entry() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
constexpr unsigned FULL_MASK = 0xffffffffu;

// A hint: start bringing the 128-byte line at `p` into L2 (no register, no wait).
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

// ---------------------------------------------------------------------------------------------
// Scalar conversions.

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {  // round to nearest even, NaN stays NaN
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// Store one f32 as the cache element type.
template <CacheType C> __device__ __forceinline__ void store_as(void* base, i64 i, float v) {
    if constexpr (C == CacheType::F32) {
        static_cast<float*>(base)[i] = v;
    } else {
        static_cast<u16*>(base)[i] = f32_to_bf16(v);
    }
}

// ---------------------------------------------------------------------------------------------
// Compile-time-or-run-time dims: a Cfg dim of 0 means "read the kernel parameter".

template <int CT> __device__ __forceinline__ int dim_or(int rt) { return CT != 0 ? CT : rt; }

constexpr __host__ __device__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// 2^x in f64 for -1022 < x < 1023, to ~1 ulp: Taylor series of e^(f·ln2) on the fraction.
// (CUDA's exp2(double) costs a call with a stack frame; this is 17 FMAs inline.)
__device__ __forceinline__ double exp2_f64(double x) {
    const double n = floor(x);
    const double t = (x - n) * 0.6931471805599453;
    double p = 1.0;
#pragma unroll
    for (int k = 17; k >= 1; --k) p = fma(p, t * (1.0 / k), 1.0);  // 1 + t/1·(1 + t/2·(1 + ...))
    return p * __hiloint2double(((int)n + 1023) << 20, 0);
}

// ---------------------------------------------------------------------------------------------
// Reductions. Every thread of the warp / block gets the result. 1-D blocks only.

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ u64 warp_max_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(FULL_MASK, v, o);
        v = other > v ? other : v;
    }
    return v;
}

// Block-wide sum over THREADS threads (a multiple of 32). Starts with a barrier so that
// back-to-back calls may reuse the shared slots.
template <int THREADS> __device__ __forceinline__ float block_sum(float v) {
    static_assert(THREADS % WARP_SIZE == 0 && THREADS <= 1024, "THREADS must be a multiple of 32, <= 1024");
    v = warp_sum(v);
    if constexpr (THREADS == WARP_SIZE) {
        return v;
    } else {
        __shared__ float partial[THREADS / WARP_SIZE];
        const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
        __syncthreads();
        if (lane == 0) partial[warp] = v;
        __syncthreads();
        return warp_sum(lane < THREADS / WARP_SIZE ? partial[lane] : 0.0f);
    }
}

// ---------------------------------------------------------------------------------------------
// Arg-keys: (value, index) packed in a u64 whose unsigned order is "larger value first, then
// lower index first", so argmax / top-k reduce with plain integer max. Key 0 = "no element"
// (it would be -NaN with the index 0xffffffff, which never occurs).

__device__ __forceinline__ u32 float_order_bits(float f) {
    const u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float order_bits_float(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ u64 make_arg_key(float v, u32 index) {
    v = v == 0.0f ? 0.0f : v;  // -0 ties with +0 (lower index wins), as in the reference
    return ((u64)float_order_bits(v) << 32) | (u64)(0xffffffffu - index);
}

__device__ __forceinline__ u32 arg_key_index(u64 key) { return 0xffffffffu - (u32)key; }
__device__ __forceinline__ float arg_key_value(u64 key) { return order_bits_float((u32)(key >> 32)); }

// ---------------------------------------------------------------------------------------------
// Loads.

__device__ __forceinline__ float4 load_f4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void store_f4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }

// Little-endian loads from byte pointers with only the alignment GGUF guarantees (2 bytes
// for every block type; blocks of 18/22/34/210 bytes break 4-byte alignment).
__device__ __forceinline__ u16 load_u16(const u8* p) { return *reinterpret_cast<const u16*>(p); }
__device__ __forceinline__ u32 load_u32_a2(const u8* p) {  // 2-byte aligned
    return (u32)load_u16(p) | ((u32)load_u16(p + 2) << 16);
}

// 16 bytes read once per kernel (weights, cache rows): the read-only path without allocating in L1,
// so data that is reused (x, indices) keeps it.
__device__ __forceinline__ uint4 ldg16(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// ---------------------------------------------------------------------------------------------
// Grid scope: blocks of one launch that wait for each other (dsa_topk's passes over a row,
// mla_decode's phase 3); the caller makes sure every block is resident at once. The counters
// live in global memory, read past L1 (not coherent across multiprocessors). The host
// emulations replace the four primitives (up to the end marker) with std::atomic_ref.
namespace grid {

__device__ __forceinline__ u32 load_volatile(const u32* p) { return *(const volatile u32*)p; }
__device__ __forceinline__ void red_add(u32* p, u32 v) { atomicAdd(p, v); }
__device__ __forceinline__ u32 fetch_add(u32* p, u32 v) { return atomicAdd(p, v); }
__device__ __forceinline__ void store_zero(u32* p) { *(volatile u32*)p = 0u; }
// end of grid-scope primitives

// The block arrives on `arrive` and returns once `target` arrivals are counted; what every
// arrived block wrote before arriving is then visible. Every thread of the block calls it.
__device__ __forceinline__ void barrier(u32* arrive, u32 target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        red_add(arrive, 1u);
        while (load_volatile(arrive) < target) {
        }
        __threadfence();
    }
    __syncthreads();
}

}  // namespace grid

}  // namespace memra
