//! Host C++ stand-ins for the warp-level tensor-core PTX the templates use (ldmatrix .x4 and
//! .x4.trans, mma.sync.m16n8k16 bf16 → f32, cvt.rn.bf16x2) and for sm_90a's warpgroup MMAs
//! (`namespace wg`: K-major 128-byte-swizzled operands, A from shared memory or registers), written
//! from the PTX ISA fragment and matrix-descriptor layouts, for the host emulation tests that
//! compile templates as C++ on std::threads.
//!
//! [`host_ptx`] is the whole `namespace ptx` of templates/memra/mma.cuh on the host (the
//! templates include mma.cuh; the emulators strip that include and paste this inside `namespace
//! memra` instead); [`FNS`] is its tensor-core part alone. They expect, from the including
//! prelude: `u16` / `u32`, `threadIdx` (thread_local, x = thread in block), `__syncwarp()` (a
//! barrier of the 32 threads of a warp), `memcpy` / `memset`, `g_smem` (the block's
//! shared-memory base: a shared-window address is an offset from it) and `g_smem_bytes` (its
//! dynamic size). Warps exchange fragments
//! through per-thread slots between two `__syncwarp()`s; mma accumulates the 16 products in
//! f64 before rounding to f32 (the tensor core's f32 accumulation is at least as coarse).
#![allow(dead_code)]

pub const FNS: &str = r#"
inline u16 bf16_rn(float f) { u32 u; memcpy(&u, &f, 4); if ((u & 0x7fffffff) > 0x7f800000) return (u >> 16) | 0x40; u32 r = u + 0x7fff + ((u >> 16) & 1); return r >> 16; }
inline float bf16f(u16 h) { u32 u = (u32)h << 16; float f; memcpy(&f, &u, 4); return f; }
inline u32 pack_bf16x2(float lo, float hi) { return (u32)bf16_rn(lo) | ((u32)bf16_rn(hi) << 16); }
struct Slot { const void* p; u32 a[4]; u32 b[2]; };
inline Slot* slots() { static Slot s[1024]; return s; }
// Matrix i's row addresses come from lanes 8i .. 8i+7. Plain: lane l holds row l/4, columns
// 2(l%4), 2(l%4)+1 of each matrix; .trans: rows 2(l%4), 2(l%4)+1 of column l/4.
inline void ldmatrix_x4_any(u32 (&r)[4], const void* smem, bool trans) {
    int t = threadIdx.x, base = t & ~31, lane = t & 31;
    slots()[t].p = smem; __syncwarp();
    for (int i = 0; i < 4; ++i) {
        if (!trans) {
            const u16* row = (const u16*)slots()[base + 8 * i + lane / 4].p;
            r[i] = (u32)row[2 * (lane % 4)] | ((u32)row[2 * (lane % 4) + 1] << 16);
        } else {
            const u16* r0 = (const u16*)slots()[base + 8 * i + 2 * (lane % 4)].p;
            const u16* r1 = (const u16*)slots()[base + 8 * i + 2 * (lane % 4) + 1].p;
            r[i] = (u32)r0[lane / 4] | ((u32)r1[lane / 4] << 16);
        }
    }
    __syncwarp(); }
inline void ldmatrix_x4(u32 (&r)[4], const void* smem) { ldmatrix_x4_any(r, smem, false); }
inline void ldmatrix_x4_trans(u32 (&r)[4], const void* smem) { ldmatrix_x4_any(r, smem, true); }
inline void ldmatrix_x4(u32 (&r)[4], u32 smem) { ldmatrix_x4_any(r, g_smem + smem, false); }
inline void ldmatrix_x4_trans(u32 (&r)[4], u32 smem) { ldmatrix_x4_any(r, g_smem + smem, true); }
inline void bf16_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    int t = threadIdx.x, base = t & ~31, lane = t & 31;
    Slot& s = slots()[t]; for (int i = 0; i < 4; ++i) s.a[i] = a[i]; s.b[0] = b0; s.b[1] = b1;
    __syncwarp();
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; ++l) { const Slot& q = slots()[base + l]; int g = l / 4, tt = l % 4;
        auto lo = [](u32 v) { return bf16f(v & 0xffff); }; auto hi = [](u32 v) { return bf16f(v >> 16); };
        A[g][2*tt] = lo(q.a[0]); A[g][2*tt+1] = hi(q.a[0]); A[g+8][2*tt] = lo(q.a[1]); A[g+8][2*tt+1] = hi(q.a[1]);
        A[g][2*tt+8] = lo(q.a[2]); A[g][2*tt+9] = hi(q.a[2]); A[g+8][2*tt+8] = lo(q.a[3]); A[g+8][2*tt+9] = hi(q.a[3]);
        B[2*tt][g] = lo(q.b[0]); B[2*tt+1][g] = hi(q.b[0]); B[2*tt+8][g] = lo(q.b[1]); B[2*tt+9][g] = hi(q.b[1]); }
    __syncwarp();
    int g = lane / 4, tt = lane % 4;
    for (int e = 0; e < 4; ++e) { int row = g + (e / 2) * 8, col = 2 * tt + (e % 2); double acc = d[e];
        for (int kk = 0; kk < 16; ++kk) acc += (double)A[row][kk] * B[kk][col]; d[e] = (float)acc; } }
"#;

/// mma.cuh's `namespace wg` on the host (emulators that define `__CUDA_ARCH_FEAT_SM90_ALL`).
/// An MMA runs when issued (the kernels keep its operands still until they wait on it), so
/// fence / commit / wait do nothing; shared-memory operands are read through the descriptor's
/// start and stride and the 128-byte swizzle (address bits 4..6 XOR 7..9); MN-major B
/// (TRANS_B = 1) is not emulated (aborts). The register-A form gathers the warpgroup's fragments
/// between two barriers of its 128 threads. Products accumulate in f64 as in [`FNS`].
pub const WG_FNS: &str = r#"
namespace wg {
inline u64 desc_sw128(u32 addr, u32 lbo, u32 sbo) { return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((lbo >> 4) & 0x3FFF) << 16) | ((u64)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62); }
inline u64 desc_plus(u64 desc, u32 bytes) { return (desc & 0xFFFFFFFF00000000ull) | (u32)((u32)desc + (bytes >> 4)); }
inline void fence() {}
inline void commit() {}
template <int PENDING> inline void wait() {}
inline void fence_proxy_async() {}
template <int N> inline void fence_operand(float (&)[N]) {}
// Element (r, k) of the K-major operand a descriptor points at (k < 16).
inline float sw128_at(u64 desc, int r, int k) {
    u32 a = ((u32)(desc & 0x3FFF) << 4) + (r / 8) * ((u32)((desc >> 32) & 0x3FFF) << 4) + (r % 8) * 128 + 2 * k;
    a ^= ((a >> 7) & 7) << 4;
    u16 h; memcpy(&h, g_smem + a, 2); return ptx::bf16f(h); }
// This thread's D fragment: row 16·(warp % 4) + lane / 4 + 8·(e / 2), column 8j + 2·(lane % 4) + e % 2.
template <int NN, class A> inline void mma_d(float* d, A a_at, u64 b, int accumulate) {
    int t = threadIdx.x % 128, w4 = t / 32, lane = t % 32;
    for (int j = 0; j < NN / 8; ++j) for (int e = 0; e < 4; ++e) {
        int row = 16 * w4 + lane / 4 + 8 * (e / 2), col = 8 * j + 2 * (lane % 4) + (e % 2);
        double acc = accumulate ? d[4 * j + e] : 0.0;
        for (int kk = 0; kk < 16; ++kk) acc += (double)a_at(row, kk) * sw128_at(b, col, kk);
        d[4 * j + e] = (float)acc; } }
template <int NN, int TRANS_B> inline void mma_ss(float* d, u64 a, u64 b, int accumulate) {
    if (TRANS_B) abort();
    mma_d<NN>(d, [&](int r, int k) { return sw128_at(a, r, k); }, b, accumulate); }
template <int TRANS_B> inline void mma_m64n32k16(float (&d)[16], u64 a, u64 b, int acc) { mma_ss<32, TRANS_B>(d, a, b, acc); }
template <int TRANS_B> inline void mma_m64n64k16(float (&d)[32], u64 a, u64 b, int acc) { mma_ss<64, TRANS_B>(d, a, b, acc); }
template <int TRANS_B> inline void mma_m64n128k16(float (&d)[64], u64 a, u64 b, int acc) { mma_ss<128, TRANS_B>(d, a, b, acc); }
template <int TRANS_B> inline void mma_m64n256k16(float (&d)[128], u64 a, u64 b, int acc) { mma_ss<256, TRANS_B>(d, a, b, acc); }
struct WgSlot { u32 a[4]; };
inline WgSlot* wg_slots() { static WgSlot s[1024]; return s; }
inline std::barrier<>& wg_barrier(int g) { static std::barrier<> b0(128), b1(128), b2(128), b3(128); return g == 0 ? b0 : g == 1 ? b1 : g == 2 ? b2 : b3; }
// A (64 × 16) from the warpgroup's registers: row m from warp m / 16, lane 4·(m % 8) + k % 8 / 2,
// register (m % 16 ≥ 8) + 2·(k ≥ 8), half k % 2 (the mma.sync m16n8k16 A layout a warp).
template <int NN> inline void mma_rs(float* d, const u32 (&a)[4], u64 b, int accumulate) {
    int tid = threadIdx.x, g0 = tid & ~127;
    std::barrier<>& bar = wg_barrier(tid / 128);
    for (int i = 0; i < 4; ++i) wg_slots()[tid].a[i] = a[i];
    bar.arrive_and_wait();
    mma_d<NN>(d, [&](int m, int k) {
        const WgSlot& s = wg_slots()[g0 + 32 * (m / 16) + 4 * (m % 8) + (k % 8) / 2];
        u32 v = s.a[(m % 16 >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)];
        return ptx::bf16f(k % 2 ? v >> 16 : v & 0xffff); }, b, accumulate);
    bar.arrive_and_wait(); }
inline void mma_rs_m64n64k16(float (&d)[32], const u32 (&a)[4], u64 b, int acc) { mma_rs<64>(d, a, b, acc); }
inline void mma_rs_m64n128k16(float (&d)[64], const u32 (&a)[4], u64 b, int acc) { mma_rs<128>(d, a, b, acc); }
}  // namespace wg
"#;

/// mma.cuh's `namespace ptx` on the host: copies are synchronous (`src_bytes` copied, the rest
/// of the 16 zeroed), so commit and wait do nothing.
pub fn host_ptx() -> String {
    format!(
        "namespace ptx {{
inline u32 smem_addr(const void* p) {{ return (u32)((const unsigned char*)p - g_smem); }}
inline u32 opaque(u32 x) {{ return x; }}
inline void cp16(void* smem, const void* gmem, int src_bytes) {{ memset(smem, 0, 16); if (src_bytes) memcpy(smem, gmem, src_bytes); }}
inline void cp16(u32 smem, const void* gmem, int src_bytes) {{ cp16(g_smem + smem, gmem, src_bytes); }}
inline void commit() {{}}
template <int PENDING> inline void wait() {{}}
inline void wait_all() {{}}
inline u32 dynamic_smem_bytes() {{ return g_smem_bytes; }}
{FNS}}}  // namespace ptx
"
    )
}

/// `text` (a template cut or whole) with its `#include "memra/mma.cuh"` removed and
/// [`host_ptx`] put in `namespace memra` at the front.
pub fn with_host_ptx(text: &str) -> String {
    format!(
        "namespace memra {{\n{}}}  // namespace memra\n{}",
        host_ptx(),
        text.replace("#include \"memra/mma.cuh\"", "")
    )
}

/// [`with_host_ptx`] plus [`WG_FNS`] (the prelude brings `u64`, `<barrier>` and `abort`).
pub fn with_host_ptx_wg(text: &str) -> String {
    format!(
        "namespace memra {{\n{}{WG_FNS}}}  // namespace memra\n{}",
        host_ptx(),
        text.replace("#include \"memra/mma.cuh\"", "")
    )
}

/// mla_decode.cuh's tensor-core path with its dynamic shared memory pointed at the emulated
/// block's.
pub fn host_mla_tensor_core_path(mla: &str) -> String {
    let decl = "extern __shared__ __align__(128) unsigned char mla_tc_smem[];";
    assert!(mla.contains(decl), "mla_decode.cuh: no `{decl}`");
    mla.replace(decl, "unsigned char* mla_tc_smem = g_smem;")
}
