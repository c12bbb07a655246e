// memra/matvec.cuh — quantized matrix × few-vectors product for decode (owned by H-gemv).
//
//   y[b][n] (+)= Σ_k W[n][k] · x[b][k]      b < batch ≤ BATCH, n < N, k < K
//
// W is a GGUF weight, ne = [K, N]: N rows of K elements, quant blocks along K, dequantized
// inside the kernel; x, y f32; f32 accumulation.
//
// Cfg fields (static constexpr):
//   int   K               row length (input dim); 0 = run time (kernel parameter `k`)
//   int   N               rows (output dim); 0 = run time (`n`)
//   QType QTYPE           element / block type of W
//   int   BATCH           largest batch one launch handles (1..8); the kernel dispatches on the
//                         run-time `batch` to a body compiled for 1, 2, 4 or 8 rows
//   int   THREADS         threads per block (multiple of LANES, ≤ 1024)
//   int   LANES           lanes that share one row group (8, 16 or 32)
//   int   ROWS_PER_GROUP  rows each lane group computes (1..8)
//   int   STAGES          cp.async pipeline depth (2..6)
//   int   ACCUMULATE      0: y = W·x; 1: y += W·x (residual fusion)
//   int   XQ8             optional (absent = 0). 0: f32 x. 1: x quantized to int8 blocks of 32
//                         (quantize_q8.cuh, llama.cpp's q8_1 numerics) and products by __dp4a on
//                         the packed weights, scales applied once per block; Q8_0, Q4_0, Q5_0,
//                         Q4_K, Q6_K, IQ4_NL, IQ4_XS only (others trap; the wrapper refuses them).
//                         2: the same products, but x is f32 and every block quantizes all of it
//                         into shared memory in its prologue (while its first weight chunks load):
//                         no separate launch, no x staging per chunk (a segmented source, batch 1:
//                         one q8 row per segment)
//   int   FUSE_X          optional (absent = 0). 1: XQ8 = 2 as a tuning (the launch interface, f32 x,
//                         is XQ8 = 0's), so specs choose it per entry like any tuning
//
// F32, F16 and BF16 with XQ8 = 0, and Q8_0 and Q4_K with XQ8 = 1, take the direct path when
// LANES = 32 (run_direct / run_direct_q8 below): no shared memory, no STAGES; the geometry is the
// same tiles of R rows, dynamic shared memory 0.
//
// Kernel parameters, in order:
//   (const unsigned char* w, const float* x, float* y, int k, int n, int batch, int ldx, int ldy)
//   w: N·row_bytes(K) bytes, 16-byte aligned; x: [batch][ldx] f32, 16-byte aligned, ldx % 4 == 0;
//   y: [batch][ldy] f32. K is a multiple of the block size (32 or 256; 8 for F32/F16/BF16).
//   XQ8 = 1: x is quantize_q8's output, q8 rows of ldx floats (ldx·4 ≥ q8 row bytes
//   round_up(K + K/4, 16), ldx % 4 == 0): K int8, then (d, Σq) f32 pairs per block of 32.
//   XQ8 = 2: x as for XQ8 = 0; dynamic shared memory + BATCH · xf_row(K) (below).
//
// Launch geometry (matvec_geometry<Cfg> below; the Rust wrapper mirrors it):
//   rows per tile R = THREADS / LANES · ROWS_PER_GROUP; tiles T = ceil(N / R); grid (G) for
//   any 1 ≤ G ≤ T: block b computes tiles b, b + G, b + 2G, … (G = T: one tile per block; the
//   wrapper launches G = ceil(T / waves) with waves = ceil(T / resident blocks), so every
//   resident block walks the same number of tiles with its pipeline never drained); block (THREADS);
//   dynamic shared memory STAGES · (R · ROW_SLOT + BATCH · XS_ROW) + 16 bytes, where
//   KC = LANES · UPL · UE elements per chunk (UE, UPL per QType: qunit::Unit<Q>),
//   CB = KC / BLOCK · BYTES, ROW_SLOT = round_up(min(CB, RB), 16) + 16 (RB: a baked K's row bytes,
//   else CB), XS_ROW = min(LANES · UPL, K / UE if baked) · (UE + 4) · 4
//   (XQ8: LANES · UPL · (UE + 16) + KC / 4).
//   The kernel traps if launched with less dynamic shared memory than that.
//   __launch_bounds__(THREADS, MIN_BLOCKS): MIN_BLOCKS = the blocks per SM that the shared memory
//   allows (≤ 3) for BATCH ≤ 2, else 1 (ptxas's own register target spilled batch-8 bodies).
//
// Design (bandwidth first). W streams through shared memory in chunks of KC elements × R rows:
// each row's byte range is copied with 16-byte cp.async from the 16-byte-aligned address at or
// below it (GGUF blocks of 18/22/34/210 bytes are only 2-byte aligned), STAGES deep, so several
// tens of KB per SM are in flight. The matching x chunk is staged next to it, one padded run of
// UE + 4 floats per unit so that lanes reading neighbouring units hit distinct banks. A lane
// owns a "unit" (a contiguous run of UE elements with its own scales) of each of its group's
// rows: it decodes quant bytes to exact small-integer floats with byte-permute tricks (no
// int→float conversion unit), dots them with x in f32, applies the group scale (and the min
// through Σx) once per scale group, and the LANES partial sums of a row meet in a shuffle.
#pragma once
#include "memra/common.cuh"
#include "memra/mma.cuh"
#include "memra/quant.cuh"

namespace memra {

// ---------------------------------------------------------------------------------------------
// Async copies (sm_80+) and shared-memory helpers, shared with matmul.cuh: mma.cuh's, plus a
// copy that stops at its buffer's end.
namespace async {

using ptx::commit;
using ptx::cp16;
using ptx::dynamic_smem_bytes;
using ptx::smem_addr;
using ptx::wait;

// cp16 for a piece that may end past the buffer (`rest` bytes left in it): a full piece goes
// async; the last, short one is read byte by byte so no 16-byte access crosses the allocation's
// end (compute-sanitizer memcheck counts a zero-filling cp.async as a full 16-byte read).
__device__ __forceinline__ void cp16_tail(void* smem, const void* gmem, long long rest) {
    if (rest >= 16) {
        cp16(smem, gmem, 16);
        return;
    }
    u8* d = (u8*)smem;
    const u8* g = (const u8*)gmem;
    for (int b = 0; b < 16; ++b) d[b] = b < rest ? g[b] : (u8)0;
}

// `p` as a pointer the compiler cannot see through, made after pdl_entry(): loads through it
// depend on this asm, so they stay after the PDL wait. (A plain load through the kernel's
// const __restrict__ x is an invariant load the compiler may hoist above that wait: olmoe's F32
// router read the previous step's x in device-fed graphs, session 27.)
__device__ __forceinline__ const float* after_wait(const float* p) {
    const float* r;
    asm volatile("mov.b64 %0, %1;" : "=l"(r) : "l"(p));
    return r;
}

}  // namespace async

// ---------------------------------------------------------------------------------------------
// Quant units: the smallest run of consecutive elements of a row that one lane decodes on its
// own (contiguous bytes plus its block's scales). Every unit exposes the same interface:
//
//   UE       elements per unit; BLOCK / BYTES: elements / bytes of the block a unit lives in
//            (F32/F16/BF16 use a pseudo-block of one unit); UPB = BLOCK / UE units per block.
//   ALIGN    alignment every block start has, given a 16-byte aligned tensor (gcd(BYTES, 16)).
//   UPL      units per lane per chunk (sizes a chunk at ~1-2 KB per row).
//   GROUPS   scale groups per unit; OCTS = UE / 8 octets.
//   SCALED   false: oct() gives final values; true: value = s_g · v + m_g (XSUM: m_g ≠ 0).
//   load(blk, sub, raw)     reads unit `sub` of the block at `blk` into registers.
//   oct(raw, sub, o, v)     8 values: v[0..4) pair with x[xa(o) ..+4), v[4..8) with x[xb(o) ..+4),
//                           in scale groups ga(o) / gb(o).
//   scale(raw, g), minv(raw, g)
//   QBITS                   0, or (XSUM units whose values are s_g · q + m_g with 0 ≤ q < 2^QBITS)
//   ones(raw, sub, o, a, b) the octet's q as bytes 0x80 | q << (7 − QBITS) (a: v[0..4), b: v[4..8)),
//                           which one_plus() turns into the exact float 1 + q / 2^QBITS with one
//                           PRMT per element (no FADD to remove a bias; the core takes
//                           Σ q·x = 2^QBITS · (Σ (1 + q/2^QBITS)·x − Σx) with the Σx it has anyway).
//
// The integer path (Cfg::XQ8 = 1; x arrives as int8 blocks of 32 with one f32 scale and the
// block's Σq each, quantize_q8.cuh) uses, where INT_DOT:
//   ints(raw, sub, j, q)    x block j (< UE / 32) of the unit: 8 words of signed bytes c·v_i (c a
//                           power of two, folded into iscale), element i of the block in byte
//                           i % 4 of word i / 4 (x's order), so __dp4a pairs them with x's words
//   IGROUPS                 int sums per x block (Q6_K: 2, its 16-element scale groups); sum g
//                           covers words [8g / IGROUPS, 8(g + 1) / IGROUPS)
//   iscale(raw, j, g)       float per unit of the int sum: Σ_i w_i·x_i = d_x · Σ_g iscale · Σ c·v·q
//   IMIN, imin(raw, j)      Q4_K's min: + imin · d_x · Σq (Σq from the x block's header)
//
// Quant values come out as exact floats: a byte b is placed in the mantissa of 2^23
// (0x4B0000bb = 8388608 + b) by one PRMT and the bias removed with one FADD.
namespace qunit {

__device__ __forceinline__ float byte_float(u32 w, int j, float offset) {
    return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | (u32)j)) - (8388608.0f + offset);
}

// Byte j of w (0x80 | q << (7 − B), from Unit::ones) as the float 1 + q / 2^B: the byte becomes
// bits 16..23 (lowest exponent bit set, q under the top mantissa bits) below 0x3F, zeros below.
__device__ __forceinline__ float one_plus(u32 w, int j) {
    return __uint_as_float(__byte_perm(w, 0x3F000000u, 0x7054u | ((u32)j << 8)));
}

// NW little-endian words starting at p, which is ALIGN-byte aligned. For ALIGN 2 it reads the
// aligned words around the range (up to 4 bytes past its end; EXACT: never past it, one 16-bit
// read more in flight, which the staged paths' tightest bodies pay in spills) and funnel-shifts them.
template <int ALIGN, int NW, bool EXACT = false> __device__ __forceinline__ void load_words(const u8* p, u32 (&w)[NW]) {
    if constexpr (ALIGN % 16 == 0 && NW % 4 == 0) {
#pragma unroll
        for (int i = 0; i < NW / 4; ++i) {
            const uint4 t = reinterpret_cast<const uint4*>(p)[i];
            w[4 * i] = t.x, w[4 * i + 1] = t.y, w[4 * i + 2] = t.z, w[4 * i + 3] = t.w;
        }
    } else if constexpr (ALIGN % 8 == 0 && NW % 2 == 0) {
#pragma unroll
        for (int i = 0; i < NW / 2; ++i) {
            const uint2 t = reinterpret_cast<const uint2*>(p)[i];
            w[2 * i] = t.x, w[2 * i + 1] = t.y;
        }
    } else if constexpr (ALIGN % 4 == 0) {
#pragma unroll
        for (int i = 0; i < NW; ++i) w[i] = reinterpret_cast<const u32*>(p)[i];
    } else {
        static_assert(ALIGN % 2 == 0, "blocks are at least 2-byte aligned");
        // Pointer arithmetic (not integer masking) keeps the address space visible: LDS, not LD.
        const u32* a = reinterpret_cast<const u32*>(p - (reinterpret_cast<u64>(p) & 2u));
        const u32 shift = ((u32)reinterpret_cast<u64>(p) & 2u) * 8u;
        u32 t[NW + 1];
#pragma unroll
        for (int i = 0; i < NW; ++i) t[i] = a[i];
        // The last word serves only with its low half (shift 16), the range's last 2 bytes, and
        // goes unused with shift 0: EXACT reads just those 2 bytes (the direct path reads a
        // tensor's last block in place, with nothing after it).
        t[NW] = EXACT ? (u32)load_u16(p + 4 * NW - 2) : a[NW];
#pragma unroll
        for (int i = 0; i < NW; ++i) w[i] = __funnelshift_r(t[i], t[i + 1], shift);
    }
}

// Where a unit's bytes come from (units with REG_BYTES decode through either): memory at p
// (MemBytes), or words a thread already holds, byte 4i + j of the range in byte j of w[i]
// (RegBytes: matmul's raw rows read as aligned 16-byte loads; byte offsets are constants after
// unrolling, so every word stays a register).
template <bool EXACT = false> struct MemBytes {
    const u8* p;
    __device__ __forceinline__ u16 u16_at(int b) const { return load_u16(p + b); }
    template <int ALIGN, int NW> __device__ __forceinline__ void words(int b, u32 (&w)[NW]) const {
        load_words<ALIGN, NW, EXACT>(p + b, w);
    }
};
template <int N> struct RegBytes {
    u32 w[N];
    __device__ __forceinline__ u16 u16_at(int b) const { return (u16)(b & 2 ? w[b >> 2] >> 16 : w[b >> 2]); }
    template <int ALIGN, int NW> __device__ __forceinline__ void words(int b, u32 (&out)[NW]) const {
#pragma unroll
        for (int i = 0; i < NW; ++i) {
            const int o = b + 4 * i;
            out[i] = o & 3 ? __funnelshift_r(w[o >> 2], w[(o >> 2) + 1], 8 * (o & 3)) : w[o >> 2];
        }
    }
};

// 4 bits k of t -> bit 4 of byte k (Q5 high bits next to their nibbles).
__device__ __forceinline__ u32 spread4_to_bit4(u32 t) { return (t * 0x02040810u) & 0x10101010u; }

// kvalues_iq4nl + 128 as bytes, 4 per word: entry e is byte e % 4 of word e / 4.
__host__ __device__ constexpr u32 iq4_table_word(int i) {
    constexpr int kv[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
    return (u32)(kv[4 * i] + 128) | ((u32)(kv[4 * i + 1] + 128) << 8) | ((u32)(kv[4 * i + 2] + 128) << 16) |
           ((u32)(kv[4 * i + 3] + 128) << 24);
}

// IQ4 octet: the low nibbles of the 4 bytes of w are elements e..e+3 -> v[0..4), the high
// nibbles elements e+16..e+19 -> v[4..8) (as Q4_0). Table lookup 4 nibbles at a time: the 16
// low bits of (w >> 16h) are the selector nibbles [lo(b), hi(b), lo(b+1), hi(b+1)].
__device__ __forceinline__ void iq4_oct(u32 w, float (&v)[8]) {
    constexpr u32 T0 = iq4_table_word(0), T1 = iq4_table_word(1), T2 = iq4_table_word(2), T3 = iq4_table_word(3);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 s = w >> (16 * h);
        const u32 sel = s & 0x7777u;
        const u32 lo = __byte_perm(T0, T1, sel), hi = __byte_perm(T2, T3, sel);
        const u32 r = __byte_perm(lo, hi, 0x3210u | ((s >> 1) & 0x4444u));
        v[2 * h] = byte_float(r, 0, 128.0f);
        v[4 + 2 * h] = byte_float(r, 1, 128.0f);
        v[2 * h + 1] = byte_float(r, 2, 128.0f);
        v[4 + 2 * h + 1] = byte_float(r, 3, 128.0f);
    }
}

// kvalues_iq4nl as signed bytes, 4 per word (the integer path's table).
__host__ __device__ constexpr u32 iq4s_table_word(int i) {
    return iq4_table_word(i) ^ 0x80808080u;  // (kv + 128) ^ 0x80 = kv as a two's complement byte
}

// IQ4 word w (8 nibbles, Q4_0 order) -> lo: kvalues of its 4 low nibbles, hi: of its 4 high
// nibbles, as signed bytes in element order (the lookup of iq4_oct, then bytes regrouped).
__device__ __forceinline__ void iq4_ints(u32 w, u32& lo, u32& hi) {
    constexpr u32 T0 = iq4s_table_word(0), T1 = iq4s_table_word(1), T2 = iq4s_table_word(2), T3 = iq4s_table_word(3);
    u32 r[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 t = w >> (16 * h);
        const u32 sel = t & 0x7777u;
        r[h] = __byte_perm(__byte_perm(T0, T1, sel), __byte_perm(T2, T3, sel), 0x3210u | ((t >> 1) & 0x4444u));
    }
    lo = __byte_perm(r[0], r[1], 0x6420u);
    hi = __byte_perm(r[0], r[1], 0x7531u);
}

// Q4_0-style octet: low nibbles -> v[0..4), high nibbles -> v[4..8), each minus `offset`.
__device__ __forceinline__ void nibble_oct(u32 lo, u32 hi, float offset, float (&v)[8]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        v[j] = byte_float(lo, j, offset);
        v[4 + j] = byte_float(hi, j, offset);
    }
}

// Q4_K / Q5_K scale and min of sub-block j (ggml get_scale_min_k4) from the scale words
// s0 = scales[0..4), s1 = scales[4..8), s2 = scales[8..12); j may be a run-time value.
__device__ __forceinline__ void k4_scale_min_words(u32 s0, u32 s1, u32 s2, int j, float& sc, float& m) {
    const u32 sh = 8u * (u32)(j & 3);
    const u32 a = (s0 >> sh) & 0xFFu, b = (s1 >> sh) & 0xFFu, c = (s2 >> sh) & 0xFFu;
    const u32 sc_i = j < 4 ? (a & 63u) : ((c & 0xFu) | ((a >> 6) << 4));
    const u32 m_i = j < 4 ? (b & 63u) : ((c >> 4) | ((b >> 6) << 4));
    sc = (float)sc_i;
    m = (float)m_i;
}

__device__ __forceinline__ float half_lo(u32 w) { return f16_to_f32((u16)(w & 0xFFFFu)); }
__device__ __forceinline__ float half_hi(u32 w) { return f16_to_f32((u16)(w >> 16)); }

template <QType Q> struct Unit;

// Defaults for the unit interface; units override what differs.
struct UnitBase {
    enum : int { GROUPS = 1, QBITS = 0 };
    enum : bool { SCALED = true, XSUM = false };
    enum : bool { INT_DOT = false, IMIN = false };
    enum : int { IGROUPS = 1 };
    // The integer path (XQ8 = 1) loads this type's units straight from global memory (run_direct_q8).
    enum : bool { DIRECT_Q8 = false };
    // oct_scaled(raw, sub, o, v): oct with the scale applied in the same instruction (matmul's
    // dequantization), where a type has it.
    enum : bool { FOLDED = false };
    // load_from(bytes, b, sub, raw): load from a byte source (MemBytes / RegBytes) at byte b.
    enum : bool { REG_BYTES = false };
    __host__ __device__ static constexpr int ga(int) { return 0; }
    __host__ __device__ static constexpr int gb(int) { return 0; }
};

// Unscaled float types: a unit is 8 consecutive elements; runs x[8o..], x[8o+4..].
struct FloatUnitBase : UnitBase {
    enum : int { UE = 8, BLOCK = 8, UPB = 1, ALIGN = 16 };
    enum : bool { SCALED = false };
    __host__ __device__ static constexpr int xa(int o) { return 8 * o; }
    __host__ __device__ static constexpr int xb(int o) { return 8 * o + 4; }
};

template <> struct Unit<QType::F32> : FloatUnitBase {
    enum : int { BYTES = 32, UPL = 2 };
    struct Raw { u32 w[8]; };
    __device__ static void load(const u8* blk, int, Raw& r) { load_words<16, 8>(blk, r.w); }
    __device__ static void oct(const Raw& r, int, int, float (&v)[8]) {
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = __uint_as_float(r.w[j]);
    }
    __device__ static float scale(const Raw&, int) { return 1.0f; }
    __device__ static float minv(const Raw&, int) { return 0.0f; }
};

template <> struct Unit<QType::F16> : FloatUnitBase {
    enum : int { BYTES = 16, UPL = 4 };
    struct Raw { u32 w[4]; };
    __device__ static void load(const u8* blk, int, Raw& r) { load_words<16, 4>(blk, r.w); }
    __device__ static void oct(const Raw& r, int, int, float (&v)[8]) {
#pragma unroll
        for (int j = 0; j < 4; ++j) v[2 * j] = half_lo(r.w[j]), v[2 * j + 1] = half_hi(r.w[j]);
    }
    __device__ static float scale(const Raw&, int) { return 1.0f; }
    __device__ static float minv(const Raw&, int) { return 0.0f; }
};

template <> struct Unit<QType::BF16> : FloatUnitBase {
    enum : int { BYTES = 16, UPL = 4 };
    struct Raw { u32 w[4]; };
    __device__ static void load(const u8* blk, int, Raw& r) { load_words<16, 4>(blk, r.w); }
    __device__ static void oct(const Raw& r, int, int, float (&v)[8]) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            v[2 * j] = __uint_as_float(r.w[j] << 16);
            v[2 * j + 1] = __uint_as_float(r.w[j] & 0xFFFF0000u);
        }
    }
    __device__ static float scale(const Raw&, int) { return 1.0f; }
    __device__ static float minv(const Raw&, int) { return 0.0f; }
};

// 32-element blocks: a unit is a whole block.
struct Block32UnitBase : UnitBase {
    enum : int { UE = 32, BLOCK = 32, UPB = 1 };
};

// Nibble layouts (Q4_0, Q4_1, Q5_*, IQ4_NL): word o of qs holds elements 4o..4o+3 (low
// nibbles) and 16+4o.. (high nibbles).
struct NibbleRuns {
    __host__ __device__ static constexpr int xa(int o) { return 4 * o; }
    __host__ __device__ static constexpr int xb(int o) { return 16 + 4 * o; }
};

// Q8_0 (34 B): d:f16, qs:i8[32].
template <> struct Unit<QType::Q8_0> : Block32UnitBase {
    enum : int { BYTES = 34, ALIGN = 2, UPL = 1 };
    enum : bool { DIRECT_Q8 = true };
    struct Raw { float d; u32 q[8]; };
    // EXACT: read nothing past the block (run_direct_q8 reads global memory in place).
    template <bool EXACT = false> __device__ static void load(const u8* blk, int sub, Raw& r) {
        load_from(MemBytes<EXACT>{blk}, 0, sub, r);
    }
    enum : bool { REG_BYTES = true };
    template <class B> __device__ static void load_from(const B& bytes, int b, int, Raw& r) {
        r.d = f16_to_f32(bytes.u16_at(b));
        bytes.template words<2, 8>(b + 2, r.q);
    }
    __host__ __device__ static constexpr int xa(int o) { return 8 * o; }
    __host__ __device__ static constexpr int xb(int o) { return 8 * o + 4; }
    __device__ static void oct(const Raw& r, int, int o, float (&v)[8]) {
        const u32 a = r.q[2 * o] ^ 0x80808080u, b = r.q[2 * o + 1] ^ 0x80808080u;  // i8 -> u8 + 128
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            v[j] = byte_float(a, j, 128.0f);
            v[4 + j] = byte_float(b, j, 128.0f);
        }
    }
    __device__ static float scale(const Raw& r, int) { return r.d; }
    __device__ static float minv(const Raw&, int) { return 0.0f; }
    // d·q in one FMA an element: byte q + 128 as bits 8..15 below 2^23 is p = 2^23 + 256(q + 128),
    // and p·(d / 256) − 257·128·d = q·d before the FMA's one rounding (257·128·d has at most 20
    // significant bits: exact), so the result equals round(d·q) as oct + scale give it.
    enum : bool { FOLDED = true };
    __device__ static void oct_scaled(const Raw& r, int, int o, float (&v)[8]) {
        const u32 a = r.q[2 * o] ^ 0x80808080u, b = r.q[2 * o + 1] ^ 0x80808080u;
        const float ds = r.d * (1.0f / 256.0f), off = -32896.0f * r.d;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            v[j] = fmaf(__uint_as_float(__byte_perm(a, 0x4B000000u, 0x7404u | ((u32)j << 4))), ds, off);
            v[4 + j] = fmaf(__uint_as_float(__byte_perm(b, 0x4B000000u, 0x7404u | ((u32)j << 4))), ds, off);
        }
    }
    enum : bool { INT_DOT = true };
    __device__ static void ints(const Raw& r, int, int, u32 (&q)[8]) {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = r.q[i];
    }
    __device__ static float iscale(const Raw& r, int, int) { return r.d; }
    __device__ static float imin(const Raw&, int) { return 0.0f; }
};

// Q4_0 (18 B): d:f16, qs[16]; value d·(q − 8).
template <> struct Unit<QType::Q4_0> : Block32UnitBase, NibbleRuns {
    using NibbleRuns::xa, NibbleRuns::xb;
    enum : int { BYTES = 18, ALIGN = 2, UPL = 2 };
    struct Raw { float d; u32 q[4]; };
    __device__ static void load(const u8* blk, int sub, Raw& r) { load_from(MemBytes<>{blk}, 0, sub, r); }
    enum : bool { REG_BYTES = true };
    template <class B> __device__ static void load_from(const B& bytes, int b, int, Raw& r) {
        r.d = f16_to_f32(bytes.u16_at(b));
        bytes.template words<2, 4>(b + 2, r.q);
    }
    __device__ static void oct(const Raw& r, int, int o, float (&v)[8]) {
        nibble_oct(r.q[o] & 0x0F0F0F0Fu, (r.q[o] >> 4) & 0x0F0F0F0Fu, 8.0f, v);
    }
    __device__ static float scale(const Raw& r, int) { return r.d; }
    __device__ static float minv(const Raw&, int) { return 0.0f; }
    // (q ^ 8) << 4 is 16·(q − 8) as a signed byte (a 4-bit two's complement value, shifted up).
    enum : bool { INT_DOT = true };
    __device__ static void ints(const Raw& r, int, int, u32 (&q)[8]) {
#pragma unroll
        for (int o = 0; o < 4; ++o) {
            q[o] = ((r.q[o] & 0x0F0F0F0Fu) ^ 0x08080808u) << 4;
            q[4 + o] = (((r.q[o] >> 4) & 0x0F0F0F0Fu) ^ 0x08080808u) << 4;
        }
    }
    __device__ static float iscale(const Raw& r, int, int) { return r.d * 0.0625f; }
    __device__ static float imin(const Raw&, int) { return 0.0f; }
};

// IQ4_NL (18 B): d:f16, qs[16]; value d·kvalues[q], Q4_0 nibble order.
template <> struct Unit<QType::IQ4_NL> : Block32UnitBase, NibbleRuns {
    using NibbleRuns::xa, NibbleRuns::xb;
    enum : int { BYTES = 18, ALIGN = 2, UPL = 2 };
    struct Raw { float d; u32 q[4]; };
    __device__ static void load(const u8* blk, int, Raw& r) {
        r.d = f16_to_f32(load_u16(blk));
        load_words<2, 4>(blk + 2, r.q);
    }
    __device__ static void oct(const Raw& r, int, int o, float (&v)[8]) { iq4_oct(r.q[o], v); }
    __device__ static float scale(const Raw& r, int) { return r.d; }
    __device__ static float minv(const Raw&, int) { return 0.0f; }
    enum : bool { INT_DOT = true };
    __device__ static void ints(const Raw& r, int, int, u32 (&q)[8]) {
#pragma unroll
        for (int o = 0; o < 4; ++o) iq4_ints(r.q[o], q[o], q[4 + o]);
    }
    __device__ static float iscale(const Raw& r, int, int) { return r.d; }
    __device__ static float imin(const Raw&, int) { return 0.0f; }
};

// Q4_1 (20 B): d:f16, m:f16, qs[16]; value d·q + m.
template <> struct Unit<QType::Q4_1> : Block32UnitBase, NibbleRuns {
    using NibbleRuns::xa, NibbleRuns::xb;
    enum : int { BYTES = 20, ALIGN = 4, UPL = 2 };
    enum : bool { XSUM = true };
    struct Raw { float d, m; u32 q[4]; };
    __device__ static void load(const u8* blk, int, Raw& r) {
        u32 w[5];
        load_words<4, 5>(blk, w);
        r.d = half_lo(w[0]);
        r.m = half_hi(w[0]);
#pragma unroll
        for (int i = 0; i < 4; ++i) r.q[i] = w[1 + i];
    }
    __device__ static void oct(const Raw& r, int, int o, float (&v)[8]) {
        nibble_oct(r.q[o] & 0x0F0F0F0Fu, (r.q[o] >> 4) & 0x0F0F0F0Fu, 0.0f, v);
    }
    enum : int { QBITS = 4 };
    __device__ static void ones(const Raw& r, int, int o, u32& a, u32& b) {
        a = ((r.q[o] << 3) & 0x78787878u) | 0x80808080u;
        b = ((r.q[o] >> 1) & 0x78787878u) | 0x80808080u;
    }
    __device__ static float scale(const Raw& r, int) { return r.d; }
    __device__ static float minv(const Raw& r, int) { return r.m; }
};

// Q5_0 (22 B): d:f16, qh:u32, qs[16]; element j's 5th bit is bit j of qh; value d·(q − 16).
template <> struct Unit<QType::Q5_0> : Block32UnitBase, NibbleRuns {
    using NibbleRuns::xa, NibbleRuns::xb;
    enum : int { BYTES = 22, ALIGN = 2, UPL = 2 };
    struct Raw { float d; u32 qh; u32 q[4]; };
    __device__ static void load(const u8* blk, int sub, Raw& r) { load_from(MemBytes<>{blk}, 0, sub, r); }
    enum : bool { REG_BYTES = true };
    template <class B> __device__ static void load_from(const B& bytes, int b, int, Raw& r) {
        r.d = f16_to_f32(bytes.u16_at(b));
        u32 w[5];
        bytes.template words<2, 5>(b + 2, w);
        r.qh = w[0];
#pragma unroll
        for (int i = 0; i < 4; ++i) r.q[i] = w[1 + i];
    }
    __device__ static void oct(const Raw& r, int, int o, float (&v)[8]) {
        const u32 lo = (r.q[o] & 0x0F0F0F0Fu) | spread4_to_bit4((r.qh >> (4 * o)) & 0xFu);
        const u32 hi = ((r.q[o] >> 4) & 0x0F0F0F0Fu) | spread4_to_bit4((r.qh >> (16 + 4 * o)) & 0xFu);
        nibble_oct(lo, hi, 16.0f, v);
    }
    __device__ static float scale(const Raw& r, int) { return r.d; }
    __device__ static float minv(const Raw&, int) { return 0.0f; }
    // (q ^ 16) << 3 is 8·(q − 16) as a signed byte.
    enum : bool { INT_DOT = true };
    __device__ static void ints(const Raw& r, int, int, u32 (&q)[8]) {
#pragma unroll
        for (int o = 0; o < 4; ++o) {
            const u32 lo = (r.q[o] & 0x0F0F0F0Fu) | spread4_to_bit4((r.qh >> (4 * o)) & 0xFu);
            const u32 hi = ((r.q[o] >> 4) & 0x0F0F0F0Fu) | spread4_to_bit4((r.qh >> (16 + 4 * o)) & 0xFu);
            q[o] = (lo ^ 0x10101010u) << 3;
            q[4 + o] = (hi ^ 0x10101010u) << 3;
        }
    }
    __device__ static float iscale(const Raw& r, int, int) { return r.d * 0.125f; }
    __device__ static float imin(const Raw&, int) { return 0.0f; }
};

// Q5_1 (24 B): d:f16, m:f16, qh:u32, qs[16]; value d·q + m.
template <> struct Unit<QType::Q5_1> : Block32UnitBase, NibbleRuns {
    using NibbleRuns::xa, NibbleRuns::xb;
    enum : int { BYTES = 24, ALIGN = 8, UPL = 2 };
    enum : bool { XSUM = true };
    struct Raw { float d, m; u32 qh; u32 q[4]; };
    __device__ static void load(const u8* blk, int, Raw& r) {
        u32 w[6];
        load_words<8, 6>(blk, w);
        r.d = half_lo(w[0]);
        r.m = half_hi(w[0]);
        r.qh = w[1];
#pragma unroll
        for (int i = 0; i < 4; ++i) r.q[i] = w[2 + i];
    }
    __device__ static void oct(const Raw& r, int, int o, float (&v)[8]) {
        const u32 lo = (r.q[o] & 0x0F0F0F0Fu) | spread4_to_bit4((r.qh >> (4 * o)) & 0xFu);
        const u32 hi = ((r.q[o] >> 4) & 0x0F0F0F0Fu) | spread4_to_bit4((r.qh >> (16 + 4 * o)) & 0xFu);
        nibble_oct(lo, hi, 0.0f, v);
    }
    enum : int { QBITS = 5 };
    __device__ static void ones(const Raw& r, int, int o, u32& a, u32& b) {
        const u32 lo = (r.q[o] & 0x0F0F0F0Fu) | spread4_to_bit4((r.qh >> (4 * o)) & 0xFu);
        const u32 hi = ((r.q[o] >> 4) & 0x0F0F0F0Fu) | spread4_to_bit4((r.qh >> (16 + 4 * o)) & 0xFu);
        a = (lo << 2) | 0x80808080u;
        b = (hi << 2) | 0x80808080u;
    }
    __device__ static float scale(const Raw& r, int) { return r.d; }
    __device__ static float minv(const Raw& r, int) { return r.m; }
};

// Q4_K (144 B / 256): d, dmin, scales[12], qs[128]. Unit `sub` (0..3) = elements 64·sub ..+64
// = sub-blocks 2·sub (low nibbles of qs[32·sub ..+32]) and 2·sub+1 (high nibbles).
// value = d·sc_j·q − dmin·m_j.
template <> struct Unit<QType::Q4_K> : UnitBase {
    enum : int { UE = 64, BLOCK = 256, BYTES = 144, UPB = 4, ALIGN = 16, UPL = 1, GROUPS = 2 };
    enum : bool { DIRECT_Q8 = true };
    enum : bool { XSUM = true };
    __host__ __device__ static constexpr int xa(int o) { return 4 * o; }
    __host__ __device__ static constexpr int xb(int o) { return 32 + 4 * o; }
    __host__ __device__ static constexpr int ga(int) { return 0; }
    __host__ __device__ static constexpr int gb(int) { return 1; }
    struct Raw { float s[2], m[2]; u32 q[8]; };
    __device__ static void load(const u8* blk, int sub, Raw& r) {
        u32 h[4];
        load_words<16, 4>(blk, h);
        load_words<16, 8>(blk + 16 + 32 * sub, r.q);
        const float d = half_lo(h[0]), dmin = half_hi(h[0]);
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            float sc, m;
            k4_scale_min_words(h[1], h[2], h[3], 2 * sub + t, sc, m);
            r.s[t] = d * sc;
            r.m[t] = -dmin * m;
        }
    }
    __device__ static void oct(const Raw& r, int, int o, float (&v)[8]) {
        nibble_oct(r.q[o] & 0x0F0F0F0Fu, (r.q[o] >> 4) & 0x0F0F0F0Fu, 0.0f, v);
    }
    enum : int { QBITS = 4 };
    __device__ static void ones(const Raw& r, int, int o, u32& a, u32& b) {
        a = ((r.q[o] << 3) & 0x78787878u) | 0x80808080u;
        b = ((r.q[o] >> 1) & 0x78787878u) | 0x80808080u;
    }
    __device__ static float scale(const Raw& r, int g) { return r.s[g]; }
    __device__ static float minv(const Raw& r, int g) { return r.m[g]; }
    // x block j = sub-block 2·sub + j: the low (j = 0) or high nibbles, q in 0..15.
    enum : bool { INT_DOT = true, IMIN = true };
    __device__ static void ints(const Raw& r, int, int j, u32 (&q)[8]) {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = (r.q[i] >> (4 * j)) & 0x0F0F0F0Fu;
    }
    __device__ static float iscale(const Raw& r, int j, int) { return r.s[j]; }
    __device__ static float imin(const Raw& r, int j) { return r.m[j]; }
};

// Q5_K (176 B / 256): d, dmin, scales[12], qh[32], qs[128]. As Q4_K; element l of sub-block j
// adds 16 if bit j of qh[l] is set.
template <> struct Unit<QType::Q5_K> : UnitBase {
    enum : int { UE = 64, BLOCK = 256, BYTES = 176, UPB = 4, ALIGN = 16, UPL = 1, GROUPS = 2 };
    enum : bool { XSUM = true };
    __host__ __device__ static constexpr int xa(int o) { return 4 * o; }
    __host__ __device__ static constexpr int xb(int o) { return 32 + 4 * o; }
    __host__ __device__ static constexpr int ga(int) { return 0; }
    __host__ __device__ static constexpr int gb(int) { return 1; }
    struct Raw { float s[2], m[2]; u32 q[8], qh[8]; };
    __device__ static void load(const u8* blk, int sub, Raw& r) {
        u32 h[4];
        load_words<16, 4>(blk, h);
        load_words<16, 8>(blk + 16, r.qh);
        load_words<16, 8>(blk + 48 + 32 * sub, r.q);
        const float d = half_lo(h[0]), dmin = half_hi(h[0]);
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            float sc, m;
            k4_scale_min_words(h[1], h[2], h[3], 2 * sub + t, sc, m);
            r.s[t] = d * sc;
            r.m[t] = -dmin * m;
        }
    }
    __device__ static void oct(const Raw& r, int sub, int o, float (&v)[8]) {
        const u32 h = r.qh[o] >> (2 * sub);
        const u32 lo = (r.q[o] & 0x0F0F0F0Fu) | ((h << 4) & 0x10101010u);
        const u32 hi = ((r.q[o] >> 4) & 0x0F0F0F0Fu) | ((h << 3) & 0x10101010u);
        nibble_oct(lo, hi, 0.0f, v);
    }
    enum : int { QBITS = 5 };
    __device__ static void ones(const Raw& r, int sub, int o, u32& a, u32& b) {
        const u32 h = r.qh[o] >> (2 * sub);
        a = ((r.q[o] << 2) & 0x3C3C3C3Cu) | ((h << 6) & 0x40404040u) | 0x80808080u;
        b = ((r.q[o] >> 2) & 0x3C3C3C3Cu) | ((h << 5) & 0x40404040u) | 0x80808080u;
    }
    __device__ static float scale(const Raw& r, int g) { return r.s[g]; }
    __device__ static float minv(const Raw& r, int g) { return r.m[g]; }
};

// Q6_K (210 B / 256): ql[128], qh[64], scales:i8[16], d. Unit `sub` = quarter q = sub % 4 of
// half h = sub / 4: elements 128h + 32q + l (l < 32) use the low (q < 2) or high nibble of
// ql[64h + 32(q&1) + l], bits 2q..2q+1 of qh[32h + l], and scale sc[8h + 2q + l/16];
// value d·sc·(q6 − 32).
template <> struct Unit<QType::Q6_K> : UnitBase {
    enum : int { UE = 32, BLOCK = 256, BYTES = 210, UPB = 8, ALIGN = 2, UPL = 2, GROUPS = 2 };
    __host__ __device__ static constexpr int xa(int o) { return 8 * o; }
    __host__ __device__ static constexpr int xb(int o) { return 8 * o + 4; }
    __host__ __device__ static constexpr int ga(int o) { return o / 2; }
    __host__ __device__ static constexpr int gb(int o) { return o / 2; }
    struct Raw { float s[2]; u32 ql[8], qh[8]; };
    __device__ static void load(const u8* blk, int sub, Raw& r) {
        const int h = sub >> 2, q = sub & 3;
        load_words<2, 8>(blk + 64 * h + 32 * (q & 1), r.ql);
        load_words<2, 8>(blk + 128 + 32 * h, r.qh);
        const u32 sc = load_u16(blk + 192 + 8 * h + 2 * q);
        const float d = f16_to_f32(load_u16(blk + 208));
        r.s[0] = d * (float)(int)(signed char)(sc & 0xFFu);
        r.s[1] = d * (float)(int)(signed char)(sc >> 8);
    }
    __device__ static void oct(const Raw& r, int sub, int o, float (&v)[8]) {
        const int q = sub & 3;
        const u32 lshift = 4u * (u32)(q >> 1), hshift = 2u * (u32)q;
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            const u32 w = ((r.ql[2 * o + t] >> lshift) & 0x0F0F0F0Fu) | (((r.qh[2 * o + t] >> hshift) & 0x03030303u) << 4);
#pragma unroll
            for (int j = 0; j < 4; ++j) v[4 * t + j] = byte_float(w, j, 32.0f);
        }
    }
    __device__ static float scale(const Raw& r, int g) { return r.s[g]; }
    __device__ static float minv(const Raw&, int) { return 0.0f; }
    // (q ^ 32) << 2 is 4·(q − 32) as a signed byte; words 0..3 / 4..7 are the two scale groups.
    enum : bool { INT_DOT = true };
    enum : int { IGROUPS = 2 };
    __device__ static void ints(const Raw& r, int sub, int, u32 (&q)[8]) {
        const int qq = sub & 3;
        const u32 lshift = 4u * (u32)(qq >> 1), hshift = 2u * (u32)qq;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const u32 w = ((r.ql[i] >> lshift) & 0x0F0F0F0Fu) | (((r.qh[i] >> hshift) & 0x03030303u) << 4);
            q[i] = (w ^ 0x20202020u) << 2;
        }
    }
    __device__ static float iscale(const Raw& r, int, int g) { return r.s[g] * 0.25f; }
    __device__ static float imin(const Raw&, int) { return 0.0f; }
};

// IQ4_XS (136 B / 256): d:f16, scales_h:u16, scales_l[4], qs[128]. Unit = sub-block ib (32
// elements, qs[16ib ..+16] in IQ4_NL order); value d·(ls − 32)·kvalues[q].
template <> struct Unit<QType::IQ4_XS> : UnitBase, NibbleRuns {
    using NibbleRuns::xa, NibbleRuns::xb;
    enum : int { UE = 32, BLOCK = 256, BYTES = 136, UPB = 8, ALIGN = 8, UPL = 2 };
    struct Raw { float s; u32 q[4]; };
    __device__ static void load(const u8* blk, int ib, Raw& r) {
        u32 h[2];
        load_words<8, 2>(blk, h);
        load_words<8, 4>(blk + 8 + 16 * ib, r.q);
        const u32 ls = ((h[1] >> (4 * ib)) & 0xFu) | (((h[0] >> (16 + 2 * ib)) & 3u) << 4);
        r.s = half_lo(h[0]) * (float)((int)ls - 32);
    }
    __device__ static void oct(const Raw& r, int, int o, float (&v)[8]) { iq4_oct(r.q[o], v); }
    __device__ static float scale(const Raw& r, int) { return r.s; }
    __device__ static float minv(const Raw&, int) { return 0.0f; }
    enum : bool { INT_DOT = true };
    __device__ static void ints(const Raw& r, int, int, u32 (&q)[8]) {
#pragma unroll
        for (int o = 0; o < 4; ++o) iq4_ints(r.q[o], q[o], q[4 + o]);
    }
    __device__ static float iscale(const Raw& r, int, int) { return r.s; }
    __device__ static float imin(const Raw&, int) { return 0.0f; }
};

}  // namespace qunit

// ---------------------------------------------------------------------------------------------
// One q8 block of 32 quantized by a warp, element `lane` = v (quantize_q8.cuh's numerics,
// shared with XQ8 = 2's prologue): d = max|v| / 127 (IEEE division), q = round(v / d) half away
// from zero (0 for an all-zero block), s = Σq (exact; summed as floats, |s| ≤ 4064).
__device__ __forceinline__ void q8_block_lane(float v, int& q, float& d, float& s) {
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, o));
    d = amax / 127.0f;
    q = amax == 0.0f ? 0 : (int)roundf(v / d);
    s = (float)q;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
}

// Cfg::XQ8, 0 when a Cfg does not declare it (Cfgs written before the integer path); a Cfg's
// FUSE_X = 1 (a tuning: x stays f32 at the interface) is XQ8 = 2.
template <class...> using void_t = void;
template <class Cfg, class = void> struct CfgXq8Field { enum : int { value = 0 }; };
template <class Cfg> struct CfgXq8Field<Cfg, void_t<decltype(Cfg::XQ8)>> { enum : int { value = Cfg::XQ8 }; };
template <class Cfg, class = void> struct CfgFuseX { enum : int { value = 0 }; };
template <class Cfg> struct CfgFuseX<Cfg, void_t<decltype(Cfg::FUSE_X)>> { enum : int { value = Cfg::FUSE_X }; };
template <class Cfg> struct CfgXq8 {
    static_assert(CfgFuseX<Cfg>::value == 0 || CfgXq8Field<Cfg>::value != 1, "FUSE_X takes f32 x: not with XQ8 = 1");
    enum : int { value = CfgFuseX<Cfg>::value != 0 ? 2 : CfgXq8Field<Cfg>::value };
};

// Src::X_IN_SMEM, false when a row source does not declare it: true for sources that build
// their (batch-1) x row in shared memory themselves (norm_matvec.cuh's prologue), at
// matvec_smem + SMEM as padded units of XS_UNIT floats; no x chunk is staged then.
template <class Src, class = void> struct SrcXInSmem { enum : bool { value = false }; };
template <class Src> struct SrcXInSmem<Src, void_t<decltype(Src::X_IN_SMEM)>> { enum : bool { value = bool(Src::X_IN_SMEM) }; };

// Src::EARLY_WEIGHTS, false when a row source does not declare it: true for sources whose weight
// rows depend on nothing an earlier kernel writes (the dense matrices, not MoE's routed experts).
// run() then issues the block's first weight chunks and calls the source's before_wait() (loads
// of its own constants, handed back as a Preload for its prologue) before pdl_entry(), so they
// load while the previous kernel of the graph finishes; the kernel entry must not call
// pdl_entry() itself.
template <class Src, class = void> struct SrcEarlyWeights { enum : bool { value = false }; };
template <class Src> struct SrcEarlyWeights<Src, void_t<decltype(Src::EARLY_WEIGHTS)>> { enum : bool { value = bool(Src::EARLY_WEIGHTS) }; };
struct NoPreload {};
template <class Src> __device__ __forceinline__ auto early_preload(const Src& src) {
    if constexpr (SrcEarlyWeights<Src>::value) {
        return src.before_wait();
    } else {
        return NoPreload{};
    }
}

// Geometry shared by the kernel and (mirrored) the Rust launcher.
template <class Cfg> struct MatvecGeometry {
    using U = qunit::Unit<Cfg::QTYPE>;
    enum : bool { XQ8 = bool(CfgXq8<Cfg>::value != 0) };
    enum : bool { XQ8_FUSED = bool(CfgXq8<Cfg>::value == 2) };
    enum : int { LANES = Cfg::LANES, RPG = Cfg::ROWS_PER_GROUP };
    enum : int { GROUPS_PER_BLOCK = Cfg::THREADS / LANES };
    enum : int { ROWS = GROUPS_PER_BLOCK * RPG };          // rows per thread block
    enum : int { UPC = LANES * U::UPL };                   // units per chunk
    enum : int { KC = UPC * U::UE };                       // elements per chunk
    enum : int { CB = UPC / U::UPB * U::BYTES };           // bytes of one row's chunk
    // A baked row shorter than a chunk (K < KC) needs slots of its own size only: less shared
    // memory per block, so more blocks fit beside those of the kernel before (PDL).
    enum : int { RB = Cfg::K != 0 ? Cfg::K / U::BLOCK * U::BYTES : CB };
    enum : int { SLOT_BYTES = RB < CB ? RB : CB };
    enum : int { ROW_SLOT = (SLOT_BYTES + 15) / 16 * 16 + 16 };  // + room for the misalignment
    enum : int { SLOT16 = ROW_SLOT / 16 };
    enum : int { XS_UNIT = U::UE + 4 };                    // floats per padded x unit
    // XQ8: a unit's int8 x padded to UE + 16 bytes (lanes' 16-byte reads hit distinct banks),
    // then the chunk's (d, Σq) float pairs, one per x block of 32.
    enum : int { XQ_UNIT = U::UE + 16 };
    enum : int { XQ_QS = UPC * XQ_UNIT };
    enum : int { X_UNITS = Cfg::K != 0 && Cfg::K / U::UE < UPC ? Cfg::K / U::UE : UPC };  // f32 x units staged per chunk
    enum : int { XS_ROW = XQ8_FUSED ? 0 : XQ8 ? XQ_QS + KC / 32 * 8 : X_UNITS * XS_UNIT * 4 };  // bytes of one x row's chunk
    // XQ8 = 2: the whole q8 x of one batch row, after the stages (at SMEM): every unit of the
    // row padded as XQ_UNIT, then the (d, Σq) pairs; 16-byte multiple.
    __host__ __device__ static constexpr int xf_row(int k) { return ((k / U::UE) * XQ_UNIT + k / 4 + 15) / 16 * 16; }
    enum : int { W_BYTES = ROWS * ROW_SLOT };
    enum : int { STAGE = W_BYTES + Cfg::BATCH * XS_ROW };
    enum : int { SMEM = Cfg::STAGES * STAGE + 16 };        // + funnel-shift over-read pad
    // Blocks per SM that shared memory allows (227 KiB, 1 KiB reserved per block), at most 3:
    // the register budget ptxas is given (__launch_bounds__ min blocks). Batches of 4+ are
    // FMA-bound and get the whole register file (1) rather than spill.
    enum : int { SMEM_BLOCKS = 232448 / (SMEM + 1024) };
    enum : int { MIN_BLOCKS = Cfg::BATCH >= 4 ? 1 : (SMEM_BLOCKS < 1 ? 1 : (SMEM_BLOCKS > 3 ? 3 : SMEM_BLOCKS)) };

    static_assert(LANES == 8 || LANES == 16 || LANES == 32, "LANES must be 8, 16 or 32");
    static_assert(Cfg::THREADS % LANES == 0 && Cfg::THREADS % 32 == 0 && Cfg::THREADS <= 1024, "bad THREADS");
    static_assert(RPG >= 1 && RPG <= 8, "ROWS_PER_GROUP must be 1..8");
    static_assert(Cfg::BATCH >= 1 && Cfg::BATCH <= 8, "BATCH must be 1..8");
    static_assert(Cfg::STAGES >= 2 && Cfg::STAGES <= 6, "STAGES must be 2..6");
    static_assert(UPC % U::UPB == 0, "a chunk must hold whole blocks");
    static_assert(Cfg::K == 0 || Cfg::K % U::BLOCK == 0, "K must be a multiple of the block size");
    static_assert(!XQ8 || U::UE % 32 == 0 || !U::INT_DOT, "integer-path units hold whole x blocks");
};

// The plain matvec's launch (MEMRA_DEFINE_MATVEC; moe_matvec, norm_matvec and combine_matvec
// always stage and take MatvecGeometry): with 32 lanes, unscaled 16-byte units on f32 x and
// DIRECT_Q8 types on quantize_q8 rows (XQ8 = 1) take the direct path, with no shared memory.
template <class Cfg> struct MatvecLaunch : MatvecGeometry<Cfg> {
    using G = MatvecGeometry<Cfg>;
    using U = typename G::U;
    enum : bool { DIRECT_FLOAT = !U::SCALED && U::UE == 8 && U::BYTES % 16 == 0 && !G::XQ8 && G::LANES == 32 };
    enum : bool { DIRECT_Q8 = U::DIRECT_Q8 && G::XQ8 && !G::XQ8_FUSED && G::LANES == 32 };
    enum : bool { DIRECT = DIRECT_FLOAT || DIRECT_Q8 };
    enum : int { LAUNCH_SMEM = DIRECT ? 0 : G::SMEM };  // dynamic shared memory (XQ8 = 2: + the q8 x)
    // The direct path is bound by loads in flight, not shared memory: 3 blocks (85 registers at 256
    // threads; 64 spilled the generic BF16 body) keep 24+ warps per SM streaming.
    enum : int { MIN_BLOCKS = DIRECT && Cfg::BATCH < 4 ? 3 : G::MIN_BLOCKS };
};

namespace matvec_detail {

// Where the rows of a block tile and the x they multiply come from. The streaming core below
// walks a block's R rows through K in chunks; a source maps (segment, tile row) to a weight
// row, gives the x row of each segment, and stores the reduced sums. Segments concatenate
// along K: chunk c is chunk c % (chunks per row) of segment c / (chunks per row), so several
// matrices' rows can feed one accumulator (moe_matvec's weighted combine). Interface:
//   SEGMENTED, WEIGHTED          compile-time: more than one segment; per-segment weights
//   segments()                   number of segments
//   w_total                      bytes readable from every row base (over-read clamp)
//   row(seg, tile_row, base)     the 16-byte aligned tensor base and the row index in it
//   xrow(seg, b)                 x of batch row b for this segment (16-byte aligned)
//   weight(seg)                  multiplier of the segment's products (WEIGHTED only)
//   store<RPG, NB>(lane, first_row, sums, batch)
//                                sums[r][b] is row first_row + r's total, in every lane
//
// The plain matvec: one matrix, one segment, y rows of ldy.
template <class Cfg> struct DenseRows {
    enum : bool { SEGMENTED = false, WEIGHTED = false, EARLY_WEIGHTS = true };
    enum : int { LANES = Cfg::LANES };
    const u8* w;
    const float* x;
    float* y;
    i64 w_total;
    int n, ldx, ldy;
    __device__ __forceinline__ int segments() const { return 1; }
    __device__ __forceinline__ i64 row(int, int r, const u8*& base) const {
        base = w;
        return r;
    }
    __device__ __forceinline__ const float* xrow(int, int b) const { return x + (i64)b * ldx; }
    __device__ __forceinline__ float weight(int) const { return 1.0f; }
    struct Preload {};
    __device__ __forceinline__ Preload before_wait() const { return {}; }
    template <int RPG, int NB>
    __device__ __forceinline__ void store(int lane, int first_row, const float (&sums)[RPG][NB], int batch) const {
#pragma unroll
        for (int r = 0; r < RPG; ++r)
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                const int row = first_row + r;
                if (lane == (r * NB + b) % LANES && row < n && b < batch) {
                    float* dst = y + (i64)b * ldy + row;
                    if constexpr (Cfg::ACCUMULATE != 0) {
                        *dst += sums[r][b];
                    } else {
                        *dst = sums[r][b];
                    }
                }
            }
    }
};

// The integer path's compute step (Cfg::XQ8): for each x block of each of the lane's units,
// the RPG rows' int8 words are dotted with every batch row's int8 x by __dp4a (exact integer
// sums per block / scale group), then scaled once: acc += d_x·wseg·(Σ_g iscale·sum_g + imin·Σq).
// xq0 / xd0: the chunk's unit 0 int8 run and (d, Σq) pair of batch row 0; xrow: bytes between
// batch rows.
template <class G, class U, int RPG, int NB, bool WHOLE_CHUNKS, bool ALIGNED>
__device__ __forceinline__ void compute_q8(const u8* ws, const u8* xq0, const float* xd0, int xrow, int lane, int group,
                                           int ci, int K, const int (&row_off)[RPG], int chunk_off, float wseg,
                                           float (&acc)[RPG][NB]) {
    constexpr int UE = U::UE, XB = UE / 32, IG = U::IGROUPS;
#pragma unroll
    for (int j = 0; j < U::UPL; ++j) {
        const int u = j * G::LANES + lane;
        if (!WHOLE_CHUNKS && (ci * G::UPC + u) * UE >= K) continue;
        const int bi = u / U::UPB, sub = u % U::UPB;
        typename U::Raw raw[RPG];
#pragma unroll
        for (int r = 0; r < RPG; ++r) {
            const int off = ALIGNED ? 0 : (row_off[r] + chunk_off) & 15;
            U::load(ws + (group * RPG + r) * G::ROW_SLOT + off + bi * U::BYTES, sub, raw[r]);
        }
        const u8* xq = xq0 + u * G::XQ_UNIT;
        const float* xd = xd0 + 2 * u * XB;
#pragma unroll
        for (int xb = 0; xb < XB; ++xb) {
            u32 wq[RPG][8];
#pragma unroll
            for (int r = 0; r < RPG; ++r) U::ints(raw[r], sub, xb, wq[r]);
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                const uint4 x0 = *reinterpret_cast<const uint4*>(xq + b * xrow + 32 * xb);
                const uint4 x1 = *reinterpret_cast<const uint4*>(xq + b * xrow + 32 * xb + 16);
                const int xw[8] = {(int)x0.x, (int)x0.y, (int)x0.z, (int)x0.w, (int)x1.x, (int)x1.y, (int)x1.z, (int)x1.w};
                const float dx = xd[b * (xrow / 4) + 2 * xb] * wseg;
                const float xsum = xd[b * (xrow / 4) + 2 * xb + 1];
#pragma unroll
                for (int r = 0; r < RPG; ++r) {
                    float t = 0.0f;
#pragma unroll
                    for (int g = 0; g < IG; ++g) {
                        int sum = 0;
#pragma unroll
                        for (int i = 8 * g / IG; i < 8 * (g + 1) / IG; ++i) sum = __dp4a((int)wq[r][i], xw[i], sum);
                        t = fmaf(U::iscale(raw[r], xb, g), (float)sum, t);
                    }
                    if constexpr (U::IMIN) t = fmaf(U::imin(raw[r], xb), xsum, t);
                    acc[r][b] = fmaf(dx, t, acc[r][b]);
                }
            }
        }
    }
}

// The streaming core, batch ≤ NB x rows. A block computes tile blockIdx.x (tile t = rows
// [t·R, t·R + R) of `rows`; rows past the end are skipped) and, when tile_stride > 0, tiles
// blockIdx.x + i·tile_stride after it (a grid of resident blocks walking all tiles). The
// cp.async pipeline runs over the block's (tile, chunk) steps without draining between tiles:
// the next tile's first chunks are in flight while this tile's last chunks are computed, so a
// block pays the memory latency ramp once, not once per tile.
template <class Cfg, int NB, class Src>
__device__ __forceinline__ void run(const int batch, const Src& src, const int k, const int rows, const int tile_stride = 0) {
    using G = MatvecGeometry<Cfg>;
    using U = qunit::Unit<Cfg::QTYPE>;
    constexpr int RPG = G::RPG, LANES = G::LANES, UPL = U::UPL, UE = U::UE, OCTS = UE / 8;
    constexpr int GROUPS = U::GROUPS, STAGES = Cfg::STAGES, THREADS = Cfg::THREADS;
    const int K = dim_or<Cfg::K>(k), N = rows;
    static_assert(U::QBITS == 0 || U::XSUM, "the 1 + q/2^QBITS decode needs the unit's Σx");
    // Row bytes and whether every row / chunk starts 16-byte aligned (then no offsets at all).
    const i64 rb = (i64)(K / U::BLOCK) * U::BYTES;
    constexpr bool ALIGNED = Cfg::K != 0 && ((i64)(Cfg::K / U::BLOCK) * U::BYTES) % 16 == 0 && G::CB % 16 == 0;
    constexpr bool WHOLE_CHUNKS = Cfg::K != 0 && Cfg::K % G::KC == 0;
    const int chunks_per_row = (K + G::KC - 1) / G::KC;
    const int n_chunks = chunks_per_row * src.segments();
    const i64 w_total = src.w_total;

    extern __shared__ __align__(16) u8 matvec_smem[];

    const int tid = threadIdx.x, lane = tid % LANES, group = tid / LANES;
    const int n_tiles = (N + G::ROWS - 1) / G::ROWS;
    const int stride = tile_stride > 0 ? tile_stride : n_tiles;
    const int my_tiles = (int)blockIdx.x < n_tiles ? (n_tiles - 1 - (int)blockIdx.x) / stride + 1 : 0;
    const int steps = my_tiles * n_chunks;
    int row0 = blockIdx.x * G::ROWS;   // first row of the tile being computed
    int irow0 = row0, ichunk = 0;      // tile and chunk the next issue() copies

    // Chunk c -> (segment, chunk within the row).
    auto split = [&](int c, int& seg, int& ci) {
        if constexpr (Src::SEGMENTED) {
            seg = c / chunks_per_row;
            ci = c - seg * chunks_per_row;
        } else {
            seg = 0;
            ci = c;
        }
    };

    // The next step's weight chunk -> stage slot; returns its chunk index. Each lane group
    // copies its own rows (per-row values computed once, lanes take consecutive 16-byte pieces).
    auto issue_w = [&](int slot) -> int {
        const int c = ichunk;
        int seg, ci;
        split(c, seg, ci);
        u8* ws = matvec_smem + slot * G::STAGE;
        const i64 chunk_off = (i64)ci * G::CB;
        const i64 left = rb - chunk_off;
        const int len = left < G::CB ? (int)left : G::CB;
#pragma unroll
        for (int r = 0; r < RPG; ++r) {
            const int row = irow0 + group * RPG + r;
            if (row < N) {
                const u8* base;
                const i64 start = src.row(seg, row, base) * rb + chunk_off;
                const int off = ALIGNED ? 0 : (int)(start & 15);
                const u8* from = base + (start - off);
                u8* dst = ws + (group * RPG + r) * G::ROW_SLOT;
                const int pieces = (off + len + 15) >> 4;
                // The row ends inside the tensor (avail ≥ off + len > 16·(pieces − 1)), so only
                // its last piece can cross the tensor's end (a misaligned last row): the pieces
                // before it go without a bound check (this loop's 64-bit test and branch per
                // piece were a fifth of the instructions of GLM-5's Q4_K expert matvec, ncu).
                const i64 avail = w_total - (start - off);
                const int whole = avail >= 16 * (i64)pieces ? pieces : pieces - 1;
                int i = lane;
                // Kept a loop: with a baked row length NVRTC unrolled it into dozens of predicated
                // copies (norm_matvec__k640_n1536__q8_0: 2,200 instructions, 48 LDGSTS; 1,760 / 12
                // rolled), and on the H200 the rolled form was 1.030x faster over Gemma 3's decode
                // shapes and 1.021x over GLM-5's (benches/results/h200-2026-12-02-s21-unroll1-ab.txt).
#pragma unroll 1
                for (; i < whole; i += LANES) async::cp16(dst + 16 * i, from + 16 * i, 16);
                if (i < pieces) async::cp16_tail(dst + 16 * i, from + 16 * i, avail - 16 * i);
            }
        }
        if (++ichunk == n_chunks) {
            ichunk = 0;
            irow0 += stride * G::ROWS;
        }
        return c;
    };
    // Chunk c's x -> stage slot, copied by the whole block.
    auto issue_x = [&](int slot, int c) {
        int seg, ci;
        split(c, seg, ci);
        u8* ws = matvec_smem + slot * G::STAGE;
        if constexpr (SrcXInSmem<Src>::value) {
            // x is the source's own row in shared memory, built in its prologue.
        } else if constexpr (G::XQ8_FUSED) {
            // x is quantized once, in the prologue.
        } else if constexpr (G::XQ8) {
            // q8 x chunk: 16-byte piece i < QP = elements 16i.. -> unit 16i / UE's padded run;
            // then the (d, Σq) pairs, two blocks per piece (q8 rows are padded to 16 bytes, so a
            // piece holding the row's last odd block stays inside the row).
            constexpr int QP = G::KC / 16, PIECES = QP + G::KC / 64;
            for (int p = tid; p < batch * PIECES; p += THREADS) {
                const int b = p / PIECES, i = p % PIECES;
                const u8* xr = reinterpret_cast<const u8*>(src.xrow(seg, b));
                u8* xq = ws + G::W_BYTES + b * G::XS_ROW;
                if (i < QP) {
                    const int e = 16 * i, kk = ci * G::KC + e;
                    if (!WHOLE_CHUNKS && kk >= K) continue;
                    async::cp16(xq + (e / UE) * G::XQ_UNIT + e % UE, xr + kk, 16);
                } else {
                    const int blk = ci * (G::KC / 32) + 2 * (i - QP);
                    if (!WHOLE_CHUNKS && 32 * blk >= K) continue;
                    async::cp16(xq + G::XQ_QS + 16 * (i - QP), xr + K + 8 * (i64)blk, 16);
                }
            }
        } else {
            // x chunk: unit u of row b -> padded run of UE + 4 floats.
            float* xs = reinterpret_cast<float*>(ws + G::W_BYTES);
            constexpr int PIECES = G::KC / 4;
            for (int p = tid; p < batch * PIECES; p += THREADS) {
                const int b = p / PIECES, e = 4 * (p % PIECES);
                const int kk = ci * G::KC + e;
                if (!WHOLE_CHUNKS && kk >= K) continue;
                async::cp16(xs + b * (G::XS_ROW / 4) + (e / UE) * G::XS_UNIT + e % UE, src.xrow(seg, b) + kk, 16);
            }
        }
    };

    float acc[RPG][NB];
#pragma unroll
    for (int r = 0; r < RPG; ++r)
#pragma unroll
        for (int b = 0; b < NB; ++b) acc[r][b] = 0.0f;

    // Misalignment of this group's rows (changes per chunk only through c·CB); per chunk for
    // segmented sources, whose rows change with the segment.
    int row_off[RPG];
    auto tile_row_offsets = [&]() {
        if constexpr (!Src::SEGMENTED) {
#pragma unroll
            for (int r = 0; r < RPG; ++r) {
                const u8* base;
                row_off[r] = ALIGNED ? 0 : (int)((src.row(0, row0 + group * RPG + r, base) * rb) & 15);
            }
        }
    };
    tile_row_offsets();

    auto compute = [&](int c, int slot) {
        int seg, ci;
        split(c, seg, ci);
        if constexpr (Src::SEGMENTED) {
            if (!ALIGNED) {
#pragma unroll
                for (int r = 0; r < RPG; ++r) {
                    const u8* base;
                    row_off[r] = (int)((src.row(seg, row0 + group * RPG + r, base) * rb) & 15);
                }
            }
        }
        const float wseg = Src::WEIGHTED ? src.weight(seg) : 1.0f;
        const u8* ws = matvec_smem + slot * G::STAGE;
        const float* xs;
        if constexpr (SrcXInSmem<Src>::value) {
            xs = reinterpret_cast<const float*>(matvec_smem + G::SMEM) + ci * G::UPC * G::XS_UNIT;
        } else {
            xs = reinterpret_cast<const float*>(ws + G::W_BYTES);
        }
        const int chunk_off = ALIGNED ? 0 : (int)(((i64)ci * G::CB) & 15);
        if constexpr (G::XQ8) {
            if constexpr (U::INT_DOT) {
                if constexpr (G::XQ8_FUSED) {
                    // Segmented sources: one q8 row per segment (the prologue's order).
                    const u8* xf = matvec_smem + G::SMEM + (Src::SEGMENTED ? seg * G::xf_row(K) : 0);
                    const int first = ci * G::UPC;  // the chunk's first unit of the row
                    compute_q8<G, U, RPG, NB, WHOLE_CHUNKS, ALIGNED>(
                        ws, xf + first * G::XQ_UNIT,
                        reinterpret_cast<const float*>(xf + (K / UE) * G::XQ_UNIT) + 2 * first * (UE / 32), G::xf_row(K),
                        lane, group, ci, K, row_off, chunk_off, Src::WEIGHTED ? wseg : 1.0f, acc);
                } else {
                    compute_q8<G, U, RPG, NB, WHOLE_CHUNKS, ALIGNED>(
                        ws, ws + G::W_BYTES, reinterpret_cast<const float*>(ws + G::W_BYTES + G::XQ_QS), G::XS_ROW, lane,
                        group, ci, K, row_off, chunk_off, Src::WEIGHTED ? wseg : 1.0f, acc);
                }
            }
            return;  // XQ8 without INT_DOT: matvec_impl traps before any launch work
        }
#pragma unroll
        for (int j = 0; j < UPL; ++j) {
            const int u = j * LANES + lane;
            if (!WHOLE_CHUNKS && (ci * G::UPC + u) * UE >= K) continue;
            const int bi = u / U::UPB, sub = u % U::UPB;
            typename U::Raw raw[RPG];
#pragma unroll
            for (int r = 0; r < RPG; ++r) {
                const int off = ALIGNED ? 0 : (row_off[r] + chunk_off) & 15;
                U::load(ws + (group * RPG + r) * G::ROW_SLOT + off + bi * U::BYTES, sub, raw[r]);
            }
            const float* xu = xs + u * G::XS_UNIT;
            float part[RPG][NB][GROUPS];
            float xsum[NB][GROUPS];
#pragma unroll
            for (int r = 0; r < RPG; ++r)
#pragma unroll
                for (int b = 0; b < NB; ++b)
#pragma unroll
                    for (int g = 0; g < GROUPS; ++g) part[r][b][g] = 0.0f;
#pragma unroll
            for (int b = 0; b < NB; ++b)
#pragma unroll
                for (int g = 0; g < GROUPS; ++g) xsum[b][g] = 0.0f;
#pragma unroll
            for (int o = 0; o < OCTS; ++o) {
                float v[RPG][8];
#pragma unroll
                for (int r = 0; r < RPG; ++r) {
                    if constexpr (U::QBITS > 0) {
                        u32 wa, wb;
                        U::ones(raw[r], sub, o, wa, wb);
#pragma unroll
                        for (int j = 0; j < 4; ++j) {
                            v[r][j] = qunit::one_plus(wa, j);
                            v[r][4 + j] = qunit::one_plus(wb, j);
                        }
                    } else {
                        U::oct(raw[r], sub, o, v[r]);
                    }
                }
#pragma unroll
                for (int b = 0; b < NB; ++b) {
                    const float4 a4 = load_f4(xu + b * (G::XS_ROW / 4) + U::xa(o));
                    const float4 b4 = load_f4(xu + b * (G::XS_ROW / 4) + U::xb(o));
                    if constexpr (U::XSUM) {
                        xsum[b][U::ga(o)] += (a4.x + a4.y) + (a4.z + a4.w);
                        xsum[b][U::gb(o)] += (b4.x + b4.y) + (b4.z + b4.w);
                    }
#pragma unroll
                    for (int r = 0; r < RPG; ++r) {
                        float& pa = part[r][b][U::ga(o)];
                        pa = fmaf(v[r][0], a4.x, pa);
                        pa = fmaf(v[r][1], a4.y, pa);
                        pa = fmaf(v[r][2], a4.z, pa);
                        pa = fmaf(v[r][3], a4.w, pa);
                        float& pb = part[r][b][U::gb(o)];
                        pb = fmaf(v[r][4], b4.x, pb);
                        pb = fmaf(v[r][5], b4.y, pb);
                        pb = fmaf(v[r][6], b4.z, pb);
                        pb = fmaf(v[r][7], b4.w, pb);
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < RPG; ++r)
#pragma unroll
                for (int g = 0; g < GROUPS; ++g) {
                    if constexpr (U::SCALED) {
                        const float s = Src::WEIGHTED ? U::scale(raw[r], g) * wseg : U::scale(raw[r], g);
#pragma unroll
                        for (int b = 0; b < NB; ++b) {
                            if constexpr (U::QBITS > 0) {
                                // part = Σ (1 + q/2^QBITS)·x: Σ q·x = 2^QBITS · (part − Σx).
                                constexpr float SCALE_Q = (float)(1 << U::QBITS);
                                acc[r][b] = fmaf(s * SCALE_Q, part[r][b][g] - xsum[b][g], acc[r][b]);
                            } else {
                                acc[r][b] = fmaf(s, part[r][b][g], acc[r][b]);
                            }
                            if constexpr (U::XSUM) {
                                const float m = Src::WEIGHTED ? U::minv(raw[r], g) * wseg : U::minv(raw[r], g);
                                acc[r][b] = fmaf(m, xsum[b][g], acc[r][b]);
                            }
                        }
                    } else {
#pragma unroll
                        for (int b = 0; b < NB; ++b) {
                            if constexpr (Src::WEIGHTED) {
                                acc[r][b] = fmaf(wseg, part[r][b][g], acc[r][b]);
                            } else {
                                acc[r][b] += part[r][b][g];
                            }
                        }
                    }
                }
        }
    };

    // STAGES-deep pipeline over the block's steps: step s (chunk s % n_chunks of its tile)
    // lives in slot s % STAGES; cp.async group g = step g (with early weights, group 0 also
    // holds the weights of the other first steps: they were issued before the wait).
    constexpr bool EARLY = SrcEarlyWeights<Src>::value;
    if constexpr (EARLY) {
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s)
            if (s < steps) issue_w(s);
    }
    const auto pre = early_preload(src);
    (void)pre;  // read by X_IN_SMEM sources' prologue only
    if constexpr (EARLY) pdl_entry();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        // Step s's chunk: issued above (early weights), else now.
        if (s < steps) issue_x(s, EARLY ? s % n_chunks : issue_w(s));
        async::commit();
    }
    // With XQ8 = 2 a source's own x row (f32, unpadded) sits after the q8 row it becomes.
    float* const x_own = reinterpret_cast<float*>(matvec_smem + G::SMEM + (G::XQ8_FUSED ? G::xf_row(K) : 0));
    if constexpr (SrcXInSmem<Src>::value) {
        // The source builds its x row (batch 1, f32) in shared memory while the first chunks
        // load; the loop's first barrier publishes it (XQ8 = 2: the barrier below, before the
        // row is quantized).
        static_assert((!G::XQ8 || G::XQ8_FUSED) && !Src::SEGMENTED && NB == 1, "an x row in shared memory is one f32 row");
        src.template prologue<G>(pre, x_own, K);
        if constexpr (G::XQ8_FUSED) __syncthreads();
    }
    if constexpr (G::XQ8_FUSED) {
        // XQ8 = 2: quantize the whole x into shared memory while the first chunks load, a warp
        // per block of 32; the loop's first barrier publishes it. Its rows: the batch's (one
        // segment), or one per segment of a segmented source (batch 1; moe_matvec's Down: each
        // slot's h row). Item it = b·(K/32) + blk; a warp loads DEPTH items' x before quantizing
        // any, so their L2 latencies overlap (one item at a time cost ~11 µs at K = 6144 on the H200).
        static_assert(!Src::SEGMENTED || NB == 1, "a segmented source's q8 rows are its segments' (batch 1)");
        constexpr int NW = THREADS / 32, DEPTH = 16;
        u8* xf = matvec_smem + G::SMEM;
        const int xrow = G::xf_row(K), wl = tid % 32, nblk = K / 32;
        const int items = (Src::SEGMENTED ? src.segments() : batch) * nblk;
        if (my_tiles > 0)
            for (int it0 = tid / 32; it0 < items; it0 += DEPTH * NW) {
                float v[DEPTH];
#pragma unroll
                for (int i = 0; i < DEPTH; ++i) {
                    const int it = it0 + i * NW, b = it / nblk, blk = it - b * nblk;
                    const float* xr = SrcXInSmem<Src>::value ? x_own : Src::SEGMENTED ? src.xrow(b, 0) : src.xrow(0, b);
                    v[i] = it < items ? xr[32 * blk + wl] : 0.0f;
                }
#pragma unroll
                for (int i = 0; i < DEPTH; ++i) {
                    const int it = it0 + i * NW, b = it / nblk, blk = it - b * nblk;
                    if (it >= items) break;  // warp-uniform
                    int q;
                    float d, sq;
                    q8_block_lane(v[i], q, d, sq);
                    u8* row = xf + b * xrow;
                    row[(32 * blk / UE) * G::XQ_UNIT + (32 * blk) % UE + wl] = (u8)(i8)q;
                    if (wl == 0) {
                        float* ds = reinterpret_cast<float*>(row + (K / UE) * G::XQ_UNIT);
                        ds[2 * blk] = d;
                        ds[2 * blk + 1] = sq;
                    }
                }
            }
    }
    int c = 0;
    for (int s = 0; s < steps; ++s) {
        async::wait<STAGES - 2>();
        __syncthreads();  // step s visible to all; everyone is done with step s − 1's slot
        if (s + STAGES - 1 < steps) {
            const int slot = (s + STAGES - 1) % STAGES;
            issue_x(slot, issue_w(slot));
        }
        async::commit();
        compute(c, s % STAGES);
        if (++c == n_chunks) {
            // Sum the LANES partial sums of each row (every lane gets the totals); the source
            // stores; the next tile starts from zero.
#pragma unroll
            for (int r = 0; r < RPG; ++r)
#pragma unroll
                for (int b = 0; b < NB; ++b) {
                    float v = acc[r][b];
#pragma unroll
                    for (int o = LANES / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
                    acc[r][b] = v;
                }
            src.template store<RPG, NB>(lane, row0 + group * RPG, acc, batch);
#pragma unroll
            for (int r = 0; r < RPG; ++r)
#pragma unroll
                for (int b = 0; b < NB; ++b) acc[r][b] = 0.0f;
            c = 0;
            row0 += stride * G::ROWS;
            tile_row_offsets();
        }
    }
}

// The direct path (MatvecLaunch::DIRECT: F32 / F16 / BF16, f32 x, LANES = 32). Each warp owns
// RPG rows of a tile; each lane loads 64 bytes of every row per step (4 BF16 / F16 units of 8
// elements, 2 F32 units; 16-byte aligned) straight into registers with L1-bypassing loads, and
// reads x through L1 after the PDL wait (async::after_wait). Latency is hidden by warps (no
// shared memory: 24+ warps per SM) instead of a cp.async pipeline. H200, session 27
// (benches/probes/gemv_probe.cu, then memra bench): BF16 weights of 100-300 MB streamed at
// 94-96 % of the copy bandwidth per launch where the staged pipeline, every tuning swept,
// plateaued at 66-76 % (it pays in occupancy for shared memory that 16-byte-aligned rows do not need).
template <class Cfg, int NB>
__device__ __forceinline__ void run_direct(const int batch, const DenseRows<Cfg>& src, const int k, const int n) {
    using U = qunit::Unit<Cfg::QTYPE>;
    using G = MatvecGeometry<Cfg>;
    constexpr int RPG = G::RPG, D = 64 / U::BYTES, W = U::BYTES / 16;  // units per step, 16-byte words per unit
    const int units = dim_or<Cfg::K>(k) / U::UE;                      // per row
    const i64 rb = (i64)units * U::BYTES;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int n_tiles = (n + G::ROWS - 1) / G::ROWS;
    bool waited = false;  // pdl_entry once per thread, after its first weight loads
    const float* x = nullptr;  // src.x, read only after the wait
    for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        const int first = tile * G::ROWS + warp * RPG;
        if (first >= n) continue;  // no block-level barrier on this path
        const u8* rows[RPG];
#pragma unroll
        for (int r = 0; r < RPG; ++r) rows[r] = src.w + (first + r < n ? first + r : n - 1) * rb;
        float acc[RPG][NB];
#pragma unroll
        for (int r = 0; r < RPG; ++r)
#pragma unroll
            for (int b = 0; b < NB; ++b) acc[r][b] = 0.0f;
        // One unit of every row into acc (x of unit u of each batch row).
        auto dot = [&](const typename U::Raw (&raw)[RPG], int u) {
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                if (b >= batch) break;
                const float* xr = x + (i64)b * src.ldx + u * U::UE;
                const float4 xa = load_f4(xr), xb = load_f4(xr + 4);
#pragma unroll
                for (int r = 0; r < RPG; ++r) {
                    float v[8];
                    U::oct(raw[r], 0, 0, v);
                    float s = acc[r][b];
                    s = fmaf(v[0], xa.x, s), s = fmaf(v[1], xa.y, s), s = fmaf(v[2], xa.z, s), s = fmaf(v[3], xa.w, s);
                    s = fmaf(v[4], xb.x, s), s = fmaf(v[5], xb.y, s), s = fmaf(v[6], xb.z, s), s = fmaf(v[7], xb.w, s);
                    acc[r][b] = s;
                }
            }
        };
        auto load = [&](typename U::Raw (&raw)[RPG], int u) {
#pragma unroll
            for (int r = 0; r < RPG; ++r)
#pragma unroll
                for (int i = 0; i < W; ++i) {
                    const uint4 t = ldg16(rows[r] + (i64)u * U::BYTES + 16 * i);
                    raw[r].w[4 * i] = t.x, raw[r].w[4 * i + 1] = t.y, raw[r].w[4 * i + 2] = t.z, raw[r].w[4 * i + 3] = t.w;
                }
        };
        int u = lane;
        // Whole steps: D units (64 bytes) per lane per row in flight.
#pragma unroll 1
        for (; u + 32 * (D - 1) < units; u += 32 * D) {
            typename U::Raw raw[D][RPG];
#pragma unroll
            for (int d = 0; d < D; ++d) load(raw[d], u + 32 * d);
            if (!waited) {
                pdl_entry();
                x = async::after_wait(src.x);
                waited = true;
            }
#pragma unroll
            for (int d = 0; d < D; ++d) dot(raw[d], u + 32 * d);
        }
#pragma unroll 1
        for (; u < units; u += 32) {
            typename U::Raw raw[RPG];
            load(raw, u);
            if (!waited) {
                pdl_entry();
                x = async::after_wait(src.x);
                waited = true;
            }
            dot(raw, u);
        }
        if (!waited) {  // a lane past a short row's units: it stores sums all the same
            pdl_entry();
            waited = true;
        }
#pragma unroll
        for (int r = 0; r < RPG; ++r)
#pragma unroll
            for (int b = 0; b < NB; ++b)
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) acc[r][b] += __shfl_xor_sync(FULL_MASK, acc[r][b], o);
        src.template store<RPG, NB>(lane, first, acc, batch);
    }
    if (!waited) pdl_entry();
}

// The integer path's direct form (MatvecLaunch::DIRECT_Q8: XQ8 = 1, LANES = 32, Q8_0 / Q4_K):
// run_direct's warps and lanes, one unit per lane per step loaded by U::load straight from global
// memory (through L1: Q8_0's 34-byte blocks are read as aligned words, a warp's 32 blocks being
// 1,088 contiguous bytes), x's int8 run and (d, Σq) pairs from its quantize_q8 row, compute_q8's
// sums. H200, session 27 (benches/probes/gemv_probe.cu, `…-s27-gemv-probe-direct-quant.txt`): Q8_0
// 16384→6144 at 82 % of the copy bandwidth per launch, Q4_K 65 %, where the staged integer path
// gave 62 % and 51 %.
template <class Cfg, int NB>
__device__ __forceinline__ void run_direct_q8(const int batch, const DenseRows<Cfg>& src, const int k, const int n) {
    using U = qunit::Unit<Cfg::QTYPE>;
    using G = MatvecGeometry<Cfg>;
    constexpr int RPG = G::RPG, UE = U::UE, XB = UE / 32, IG = U::IGROUPS;
    const int K = dim_or<Cfg::K>(k), units = K / UE;
    const i64 rb = (i64)(K / U::BLOCK) * U::BYTES;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int n_tiles = (n + G::ROWS - 1) / G::ROWS;
    bool waited = false;
    const u8* x = nullptr;  // src.x as bytes, read only after the wait
    for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        const int first = tile * G::ROWS + warp * RPG;
        if (first >= n) continue;
        const u8* rows[RPG];
#pragma unroll
        for (int r = 0; r < RPG; ++r) rows[r] = src.w + (first + r < n ? first + r : n - 1) * rb;
        float acc[RPG][NB];
#pragma unroll
        for (int r = 0; r < RPG; ++r)
#pragma unroll
            for (int b = 0; b < NB; ++b) acc[r][b] = 0.0f;
#pragma unroll 1
        for (int u = lane; u < units; u += 32) {
            const int bi = u / U::UPB, sub = u % U::UPB;
            typename U::Raw raw[RPG];
#pragma unroll
            for (int r = 0; r < RPG; ++r) {
                const u8* blk = rows[r] + (i64)bi * U::BYTES;
                // In place, so nothing past the block: 2-byte-aligned units read exactly.
                if constexpr (U::ALIGN % 4 == 0) U::load(blk, sub, raw[r]);
                else U::template load<true>(blk, sub, raw[r]);
            }
            if (!waited) {
                pdl_entry();
                x = reinterpret_cast<const u8*>(async::after_wait(src.x));
                waited = true;
            }
#pragma unroll
            for (int xb = 0; xb < XB; ++xb) {
                u32 wq[RPG][8];
#pragma unroll
                for (int r = 0; r < RPG; ++r) U::ints(raw[r], sub, xb, wq[r]);
#pragma unroll
                for (int b = 0; b < NB; ++b) {
                    if (b >= batch) break;
                    const u8* xr = x + (i64)b * src.ldx * 4;
                    const int e = u * UE + 32 * xb;  // first element of this x block
                    const uint4 x0 = *reinterpret_cast<const uint4*>(xr + e);
                    const uint4 x1 = *reinterpret_cast<const uint4*>(xr + e + 16);
                    const int xw[8] = {(int)x0.x, (int)x0.y, (int)x0.z, (int)x0.w, (int)x1.x, (int)x1.y, (int)x1.z, (int)x1.w};
                    const float* dxs = reinterpret_cast<const float*>(xr + K + 8 * (e / 32));  // (d, Σq)
#pragma unroll
                    for (int r = 0; r < RPG; ++r) {
                        float t = 0.0f;
#pragma unroll
                        for (int g = 0; g < IG; ++g) {
                            int sum = 0;
#pragma unroll
                            for (int i = 8 * g / IG; i < 8 * (g + 1) / IG; ++i) sum = __dp4a((int)wq[r][i], xw[i], sum);
                            t = fmaf(U::iscale(raw[r], xb, g), (float)sum, t);
                        }
                        if constexpr (U::IMIN) t = fmaf(U::imin(raw[r], xb), dxs[1], t);
                        acc[r][b] = fmaf(dxs[0], t, acc[r][b]);
                    }
                }
            }
        }
        if (!waited) {
            pdl_entry();
            waited = true;
        }
#pragma unroll
        for (int r = 0; r < RPG; ++r)
#pragma unroll
            for (int b = 0; b < NB; ++b)
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) acc[r][b] += __shfl_xor_sync(FULL_MASK, acc[r][b], o);
        src.template store<RPG, NB>(lane, first, acc, batch);
    }
    if (!waited) pdl_entry();
}

// Dispatch on the run-time batch to a body compiled for NB = the smallest of 1, 2, 4, 8 that
// is >= batch (bodies for every NB would multiply NVRTC time). Rows batch..NB-1 of the staged x
// are never written and their sums never stored.
template <class Cfg, int NB>
__device__ __forceinline__ void dispatch(int batch, const DenseRows<Cfg>& src, int k, int n) {
    constexpr int MAX = Cfg::BATCH;
    if constexpr (NB >= MAX) {
        if constexpr (MatvecLaunch<Cfg>::DIRECT_Q8) run_direct_q8<Cfg, MAX>(batch, src, k, n);
        else if constexpr (MatvecLaunch<Cfg>::DIRECT) run_direct<Cfg, MAX>(batch, src, k, n);
        else run<Cfg, MAX>(batch, src, k, n, gridDim.x);
    } else {
        if (batch <= NB) {
            if constexpr (MatvecLaunch<Cfg>::DIRECT_Q8) run_direct_q8<Cfg, NB>(batch, src, k, n);
            else if constexpr (MatvecLaunch<Cfg>::DIRECT) run_direct<Cfg, NB>(batch, src, k, n);
            else run<Cfg, NB>(batch, src, k, n, gridDim.x);
        } else {
            dispatch<Cfg, 2 * NB>(batch, src, k, n);
        }
    }
}

}  // namespace matvec_detail

template <class Cfg>
__device__ __forceinline__ void matvec_impl(const unsigned char* __restrict__ w, const float* __restrict__ x,
                                            float* __restrict__ y, int k, int n, int batch, int ldx, int ldy) {
    {
        using G = MatvecLaunch<Cfg>;
        const u32 need = (u32)G::LAUNCH_SMEM + (G::XQ8_FUSED ? (u32)(Cfg::BATCH * G::xf_row(dim_or<Cfg::K>(k))) : 0u);
        if (async::dynamic_smem_bytes() < need) __trap();
    }
    if (batch < 1 || batch > Cfg::BATCH) __trap();
    if (MatvecGeometry<Cfg>::XQ8 && !qunit::Unit<Cfg::QTYPE>::INT_DOT) __trap();  // the wrapper refuses these
    using U = qunit::Unit<Cfg::QTYPE>;
    const int K = dim_or<Cfg::K>(k), N = dim_or<Cfg::N>(n);
    const matvec_detail::DenseRows<Cfg> src{w, x, y, (i64)N * ((i64)(K / U::BLOCK) * U::BYTES), N, ldx, ldy};
    matvec_detail::dispatch<Cfg, 1>(batch, src, k, N);
}

}  // namespace memra

#define MEMRA_DEFINE_MATVEC(SYMBOL, CFG)                                                                        \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS, memra::MatvecLaunch<CFG>::MIN_BLOCKS)              \
        SYMBOL(const unsigned char* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int k, \
               int n, int batch, int ldx, int ldy) {                                                            \
        memra::matvec_impl<CFG>(w, x, y, k, n, batch, ldx, ldy);                                                \
    }
