// memra/quant.cuh — GGUF block layouts and dequantization on the device. Shared by H-dense
// (embed) and H-gemv (matvec/matmul); either may add helpers, keep the existing ones stable.
//
// Layouts per model-specs §1.4 (ggml-common.h / ggml-quants.c). A row of n elements is
// n / BLOCK blocks of BYTES bytes; GGUF only guarantees 2-byte alignment of a block (18-,
// 22-, 34-, 210-byte blocks), so multi-byte fields are read as u16 pairs.
//
//   memra::QTraits<Q>::BLOCK / ::BYTES      elements / bytes per block
//   memra::row_bytes<Q>(n)                  bytes of a row of n elements
//   memra::dequant8<Q>(row, g, out)         elements [8g, 8g+8) of a row -> out[8]
//   memra::dequant1<Q>(row, i)              element i of a row (slow path, tails)
#pragma once
#include "memra/common.cuh"

namespace memra {

// Enumerators, not static constexpr members: those become device globals that slow every
// module load (templates/README.md).
template <QType Q> struct QTraits;
template <> struct QTraits<QType::F32> { enum : int { BLOCK = 1, BYTES = 4 }; };
template <> struct QTraits<QType::F16> { enum : int { BLOCK = 1, BYTES = 2 }; };
template <> struct QTraits<QType::BF16> { enum : int { BLOCK = 1, BYTES = 2 }; };
template <> struct QTraits<QType::Q4_0> { enum : int { BLOCK = 32, BYTES = 18 }; };
template <> struct QTraits<QType::Q4_1> { enum : int { BLOCK = 32, BYTES = 20 }; };
template <> struct QTraits<QType::Q5_0> { enum : int { BLOCK = 32, BYTES = 22 }; };
template <> struct QTraits<QType::Q5_1> { enum : int { BLOCK = 32, BYTES = 24 }; };
template <> struct QTraits<QType::Q8_0> { enum : int { BLOCK = 32, BYTES = 34 }; };
template <> struct QTraits<QType::Q4_K> { enum : int { BLOCK = 256, BYTES = 144 }; };
template <> struct QTraits<QType::Q5_K> { enum : int { BLOCK = 256, BYTES = 176 }; };
template <> struct QTraits<QType::Q6_K> { enum : int { BLOCK = 256, BYTES = 210 }; };
template <> struct QTraits<QType::IQ4_NL> { enum : int { BLOCK = 32, BYTES = 18 }; };
template <> struct QTraits<QType::IQ4_XS> { enum : int { BLOCK = 256, BYTES = 136 }; };

template <QType Q> __device__ __forceinline__ constexpr i64 row_bytes(i64 n) {
    return n / QTraits<Q>::BLOCK * QTraits<Q>::BYTES;
}

// kvalues_iq4nl (model-specs §1.4), shared by IQ4_NL and IQ4_XS.
__constant__ i8 IQ4NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

__device__ __forceinline__ float load_f16(const u8* p) { return f16_to_f32(load_u16(p)); }

// 8 bytes at a 2-byte aligned address.
__device__ __forceinline__ void load_bytes8(const u8* p, u8 (&b)[8]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u16 h = load_u16(p + 2 * i);
        b[2 * i] = (u8)(h & 0xff);
        b[2 * i + 1] = (u8)(h >> 8);
    }
}

// Q4_K / Q5_K 6-bit scale and min of sub-block j (ggml get_scale_min_k4).
__device__ __forceinline__ void k4_scale_min(const u8* scales, int j, float& sc, float& m) {
    if (j < 4) {
        sc = (float)(scales[j] & 63);
        m = (float)(scales[j + 4] & 63);
    } else {
        sc = (float)((scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4));
        m = (float)((scales[j + 4] >> 4) | ((scales[j] >> 6) << 4));
    }
}

// Elements [8g, 8g+8) of a row. 8 consecutive elements never straddle a block or a scale group.
template <QType Q> __device__ __forceinline__ void dequant8(const u8* row, int g, float (&out)[8]) {
    constexpr int BLOCK = QTraits<Q>::BLOCK, BYTES = QTraits<Q>::BYTES;
    if constexpr (Q == QType::F32) {
        const float* p = reinterpret_cast<const float*>(row) + 8 * g;
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = p[i];
    } else if constexpr (Q == QType::F16 || Q == QType::BF16) {
        const u16* p = reinterpret_cast<const u16*>(row) + 8 * g;
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = Q == QType::F16 ? f16_to_f32(p[i]) : bf16_to_f32(p[i]);
    } else if constexpr (BLOCK == 32) {
        const u8* blk = row + (i64)(g / 4) * BYTES;
        const int j0 = (g % 4) * 8;               // first element inside the block
        const int shift = j0 < 16 ? 0 : 4;        // low nibbles hold elements 0..15
        const int byte0 = j0 % 16;
        const float d = load_f16(blk);
        if constexpr (Q == QType::Q8_0) {
            u8 b[8];
            load_bytes8(blk + 2 + j0, b);
#pragma unroll
            for (int i = 0; i < 8; ++i) out[i] = d * (float)(i8)b[i];
        } else if constexpr (Q == QType::Q4_0 || Q == QType::IQ4_NL) {
            u8 b[8];
            load_bytes8(blk + 2 + byte0, b);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int q = (b[i] >> shift) & 0xF;
                out[i] = Q == QType::Q4_0 ? d * (float)(q - 8) : d * (float)IQ4NL_VALUES[q];
            }
        } else if constexpr (Q == QType::Q4_1) {
            const float m = load_f16(blk + 2);
            u8 b[8];
            load_bytes8(blk + 4 + byte0, b);
#pragma unroll
            for (int i = 0; i < 8; ++i) out[i] = d * (float)((b[i] >> shift) & 0xF) + m;
        } else if constexpr (Q == QType::Q5_0 || Q == QType::Q5_1) {
            constexpr int QH = Q == QType::Q5_0 ? 2 : 4;
            const u32 qh = load_u32_a2(blk + QH);
            u8 b[8];
            load_bytes8(blk + QH + 4 + byte0, b);
            const float m = Q == QType::Q5_1 ? load_f16(blk + 2) : 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int q = ((b[i] >> shift) & 0xF) | (((qh >> (j0 + i)) & 1) << 4);
                out[i] = Q == QType::Q5_0 ? d * (float)(q - 16) : d * (float)q + m;
            }
        } else {
            static_assert(Q == QType::Q8_0, "unhandled 32-element block type");
        }
    } else {  // 256-element super-blocks
        const u8* blk = row + (i64)(g / 32) * BYTES;
        const int e0 = (g % 32) * 8;  // first element inside the super-block
        if constexpr (Q == QType::Q4_K || Q == QType::Q5_K) {
            const float d = load_f16(blk), dmin = load_f16(blk + 2);
            const u8* scales = blk + 4;
            const int chunk = e0 / 64, l0 = e0 % 32, hi = (e0 % 64) >= 32;
            float sc, m;
            k4_scale_min(scales, 2 * chunk + hi, sc, m);
            const float dl = d * sc, ml = dmin * m;
            const u8* qs = blk + (Q == QType::Q4_K ? 16 : 48) + 32 * chunk + l0;
            u8 b[8];
            load_bytes8(qs, b);
            if constexpr (Q == QType::Q4_K) {
#pragma unroll
                for (int i = 0; i < 8; ++i) out[i] = dl * (float)((b[i] >> (4 * hi)) & 0xF) - ml;
            } else {
                u8 h[8];
                load_bytes8(blk + 16 + l0, h);
                const int bit = 2 * chunk + hi;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const int q = ((b[i] >> (4 * hi)) & 0xF) | (((h[i] >> bit) & 1) << 4);
                    out[i] = dl * (float)q - ml;
                }
            }
        } else if constexpr (Q == QType::Q6_K) {
            const int half = e0 / 128, r = e0 % 128, quarter = r / 32, l0 = r % 32;
            const u8* ql = blk + 64 * half + (quarter & 1) * 32 + l0;
            const u8* qh = blk + 128 + 32 * half + l0;
            const i8 sc = (i8)blk[192 + 8 * half + l0 / 16 + 2 * quarter];
            const float dl = load_f16(blk + 208) * (float)sc;
            const int lshift = (quarter >> 1) * 4, hshift = 2 * quarter;
            u8 lo[8], h[8];
            load_bytes8(ql, lo);
            load_bytes8(qh, h);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int q = ((lo[i] >> lshift) & 0xF) | (((h[i] >> hshift) & 3) << 4);
                out[i] = dl * (float)(q - 32);
            }
        } else if constexpr (Q == QType::IQ4_XS) {
            const float d = load_f16(blk);
            const u32 scales_h = load_u16(blk + 2);
            const int ib = e0 / 32, j0 = e0 % 32;
            const int ls = ((blk[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4);
            const float dl = d * (float)(ls - 32);
            u8 b[8];
            load_bytes8(blk + 8 + 16 * ib + j0 % 16, b);
            const int shift = j0 < 16 ? 0 : 4;
#pragma unroll
            for (int i = 0; i < 8; ++i) out[i] = dl * (float)IQ4NL_VALUES[(b[i] >> shift) & 0xF];
        } else {
            static_assert(Q == QType::Q6_K, "unhandled 256-element block type");
        }
    }
}

// Element i of a row (tails of F32/F16/BF16 rows whose length is not a multiple of 8).
template <QType Q> __device__ __forceinline__ float dequant1(const u8* row, int i) {
    if constexpr (Q == QType::F32) {
        return reinterpret_cast<const float*>(row)[i];
    } else if constexpr (Q == QType::F16) {
        return f16_to_f32(reinterpret_cast<const u16*>(row)[i]);
    } else if constexpr (Q == QType::BF16) {
        return bf16_to_f32(reinterpret_cast<const u16*>(row)[i]);
    } else {
        float v[8];
        dequant8<Q>(row, i / 8, v);
        float r = v[0];
#pragma unroll
        for (int k = 1; k < 8; ++k) r = (i % 8 == k) ? v[k] : r;
        return r;
    }
}

}  // namespace memra
