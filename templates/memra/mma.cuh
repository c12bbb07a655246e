// memra/mma.cuh — the PTX wrappers of the tensor-core and async-copy kernels (mla_decode,
// attn_prefill, matmul, matvec): shared-window addresses, 16-byte cp.async (sm_80+), ldmatrix
// .x4 / .x4.trans and mma.sync m16n8k16 bf16 → f32 fragments (PTX ISA layouts), bf16x2 packing.
// The host emulation tests swap `namespace ptx` for stand-ins (engine/tests/mma_host).
#pragma once
#include "memra/common.cuh"

namespace memra {
namespace ptx {

// The shared-window address of a generic pointer into shared memory.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}

// A copy of x the compiler cannot see through. Shared addresses derived from it inside a tile
// loop stay there: hoisted out, the many constant-offset fragment addresses of unrolled
// ldmatrix / cp.async calls would each hold a register across the loop and spill.
__device__ __forceinline__ u32 opaque(u32 x) {
    u32 r;
    asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

// 16 bytes global → shared (a shared-window address): `src_bytes` (0..16) copied, the rest of
// the 16 zero-filled.
__device__ __forceinline__ void cp16(u32 smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(src_bytes) : "memory");
}

// cp16 to a generic pointer into shared memory.
__device__ __forceinline__ void cp16(void* smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes)
                 : "memory");
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most PENDING committed groups are still in flight.
template <int PENDING> __device__ __forceinline__ void wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

__device__ __forceinline__ void wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ u32 dynamic_smem_bytes() {
    u32 r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// (lo, hi) rounded to bf16, lo in the low half.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem));
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* smem) { ldmatrix_x4(r, smem_addr(smem)); }

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem));
}

// d += a · b, a 16×16 (row), b 16×8 (col), bf16 in, f32 accumulate.
__device__ __forceinline__ void bf16_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace ptx
}  // namespace memra
