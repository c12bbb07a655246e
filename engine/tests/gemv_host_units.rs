//! CPU-only check of the device quant decoders of matvec.cuh / matmul.cuh (`namespace qunit`):
//! the namespace is cut out of the template, compiled as host C++ with small stand-ins for the
//! CUDA intrinsics it uses (`__byte_perm`, `__funnelshift_r`, …), and its dequantized rows are
//! compared bit for bit with `memra_gguf::quant::dequantize` on random blocks, with every block
//! placed at each misalignment its type can have in a GGUF tensor (2-byte steps for 18/22/34/210-
//! byte blocks: the funnel-shift path). Skips (one SKIP line) without a C++ compiler.

use std::path::PathBuf;
use std::process::Command;

use memra_gguf::{GgmlType, quant};
use memra_reference::Rng;

/// Host stand-ins: PTX semantics of prmt (default mode, bit 3 of a selector = sign replicate)
/// and shf.r.wrap; the f16 decode is IEEE binary16.
const PRELUDE: &str = r#"
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#define __device__
#define __host__
#define __forceinline__ inline
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    uint64_t v = ((uint64_t)y << 32) | x; unsigned r = 0;
    for (int i = 0; i < 4; ++i) {
        unsigned sel = (s >> (4 * i)) & 0xF, byte = (v >> (8 * (sel & 7))) & 0xFF;
        if (sel & 8) byte = (byte & 0x80) ? 0xFF : 0;
        r |= byte << (8 * i);
    }
    return r;
}
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned sh) { return (unsigned)((((uint64_t)hi << 32) | lo) >> (sh & 31)); }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
namespace memra {
typedef unsigned char u8; typedef signed char i8; typedef unsigned short u16; typedef unsigned int u32;
typedef unsigned long long u64; typedef long long i64;
enum class QType : int { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, BF16 = 30 };
inline float f16_to_f32(u16 h) {
    unsigned s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023; float v;
    if (e == 0) v = std::ldexp((float)m, -24); else if (e == 31) v = m ? NAN : INFINITY; else v = std::ldexp((float)(m | 1024), (int)e - 25);
    return s ? -v : v;
}
inline u16 load_u16(const u8* p) { u16 v; memcpy(&v, p, 2); return v; }
"#;

/// Reads (qtype id, blocks, misalignment, input file) and writes the f32 row to stdout, built the
/// way matvec's compute loop uses a unit: value = scale(g)·v + min(g) at x offsets xa/xb.
const DRIVER: &str = r#"
}  // namespace memra
using namespace memra;
template <QType Q> int run(const u8* data, int nblocks, float* out, int mis) {
    using U = qunit::Unit<Q>;
    size_t bytes = (size_t)nblocks * U::BYTES;
    u8* buf = (u8*)aligned_alloc(16, (bytes + 64 + 15) / 16 * 16);
    memset(buf, 0xAB, bytes + 64);
    memcpy(buf + mis, data, bytes);
    for (int bi = 0; bi < nblocks; ++bi)
        for (int sub = 0; sub < U::UPB; ++sub) {
            typename U::Raw raw;
            U::load(buf + mis + (size_t)bi * U::BYTES, sub, raw);
            float* o = out + (size_t)bi * U::BLOCK + sub * U::UE;
            for (int oc = 0; oc < U::UE / 8; ++oc) {
                float v[8];
                U::oct(raw, sub, oc, v);
                if constexpr (U::QBITS > 0) {
                    // The 1 + q/2^QBITS decode (matvec) must be exactly 1 + oct's q / 2^QBITS.
                    u32 wa, wb;
                    U::ones(raw, sub, oc, wa, wb);
                    for (int j = 0; j < 8; ++j) {
                        const float one = qunit::one_plus(j < 4 ? wa : wb, j % 4);
                        if (one != 1.0f + v[j] / (float)(1 << U::QBITS)) {
                            fprintf(stderr, "ones(): qtype %d block %d sub %d oct %d elem %d: %g, oct says q = %g\n", (int)Q, bi, sub, oc, j, one, v[j]);
                            exit(6);
                        }
                    }
                }
                for (int j = 0; j < 4; ++j) {
                    float a = v[j], b = v[4 + j];
                    if (U::SCALED) {
                        a = U::scale(raw, U::ga(oc)) * a + U::minv(raw, U::ga(oc));
                        b = U::scale(raw, U::gb(oc)) * b + U::minv(raw, U::gb(oc));
                    }
                    o[U::xa(oc) + j] = a;
                    o[U::xb(oc) + j] = b;
                }
            }
        }
    free(buf);
    return nblocks * U::BLOCK;
}
int main(int argc, char** argv) {
    if (argc != 5) return 2;
    int q = atoi(argv[1]), nblocks = atoi(argv[2]), mis = atoi(argv[3]);
    FILE* f = fopen(argv[4], "rb");
    if (!f) return 3;
    fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
    u8* data = (u8*)malloc(n);
    if (fread(data, 1, n, f) != (size_t)n) return 4;
    fclose(f);
    float* out = (float*)calloc((size_t)nblocks * 256, 4);
    int elems = 0;
    switch ((QType)q) {
#define C(T) case QType::T: elems = run<QType::T>(data, nblocks, out, mis); break;
        C(F32) C(F16) C(BF16) C(Q8_0) C(Q4_0) C(Q4_1) C(Q5_0) C(Q5_1) C(Q4_K) C(Q5_K) C(Q6_K) C(IQ4_NL) C(IQ4_XS)
        default: return 5;
    }
    fwrite(out, 4, elems, stdout);
    return 0;
}
"#;

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("engine/ has a parent")
        .to_path_buf()
}

fn compiler() -> Option<String> {
    let candidates = [
        std::env::var("CXX").ok(),
        Some("c++".into()),
        Some("g++".into()),
        Some("clang++".into()),
    ];
    candidates.into_iter().flatten().find(|c| {
        Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// Builds the host decoder binary from the current template; None (and a SKIP line) without a compiler.
fn build_host_decoder(test: &str) -> Option<PathBuf> {
    let Some(cxx) = compiler() else {
        eprintln!("SKIP {test}: no C++ compiler (set CXX)");
        return None;
    };
    let template = workspace_root().join("templates/memra/matvec.cuh");
    let text = std::fs::read_to_string(&template)
        .unwrap_or_else(|e| panic!("{}: {e}", template.display()));
    let start = text
        .find("namespace qunit {")
        .expect("matvec.cuh has `namespace qunit {`");
    let end_marker = "}  // namespace qunit";
    let end = text
        .find(end_marker)
        .expect("matvec.cuh closes `}  // namespace qunit`")
        + end_marker.len();
    let dir = std::env::temp_dir().join(format!("memra-gemv-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let src = dir.join("units_host.cpp");
    std::fs::write(&src, format!("{PRELUDE}{}{DRIVER}", &text[start..end]))
        .expect("write host source");
    let bin = dir.join("units_host");
    let out = Command::new(&cxx)
        .args(["-std=c++17", "-O1", "-o"])
        .arg(&bin)
        .arg(&src)
        .output()
        .expect("run the C++ compiler");
    assert!(
        out.status.success(),
        "{cxx} failed on the qunit namespace of matvec.cuh:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(bin)
}

/// (type, ggml id, block elements, block bytes, offsets of f16 scale fields, misalignments a block
/// can have in a 16-byte aligned tensor = multiples of gcd(bytes, 16))
fn cases() -> Vec<(GgmlType, u32, usize, usize, &'static [usize])> {
    use GgmlType::*;
    vec![
        (F32, 0, 8, 32, &[]),
        (F16, 1, 8, 16, &[]),
        (BF16, 30, 8, 16, &[]),
        (Q8_0, 8, 32, 34, &[0]),
        (Q4_0, 2, 32, 18, &[0]),
        (Q4_1, 3, 32, 20, &[0, 2]),
        (Q5_0, 6, 32, 22, &[0]),
        (Q5_1, 7, 32, 24, &[0, 2]),
        (Q4_K, 12, 256, 144, &[0, 2]),
        (Q5_K, 13, 256, 176, &[0, 2]),
        (Q6_K, 14, 256, 210, &[208]),
        (IQ4_NL, 20, 32, 18, &[0]),
        (IQ4_XS, 23, 256, 136, &[0]),
    ]
}

fn f16_bytes(v: f32) -> [u8; 2] {
    let b = quant::quantize(GgmlType::F16, &[v]).expect("finite f16");
    [b[0], b[1]]
}

#[test]
fn device_quant_decoders_match_gguf_dequantize_bit_for_bit() {
    let Some(bin) = build_host_decoder("device_quant_decoders_match_gguf_dequantize_bit_for_bit")
    else {
        return;
    };
    let mut rng = Rng::from_env_or_time("device_quant_decoders_match_gguf_dequantize_bit_for_bit");
    let dir = bin.parent().unwrap().to_path_buf();
    for (ty, id, block, bytes, f16_fields) in cases() {
        let n_elems = 4096;
        let n_blocks = n_elems / block;
        // Random bytes are valid blocks of every type once the f16 scales are finite and sane;
        // float types get random values.
        let data: Vec<u8> = match ty {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                quant::quantize(ty, &rng.normal_vec(n_elems, 1.0)).unwrap_or_else(|e| panic!("{e}"))
            }
            _ => {
                let mut d: Vec<u8> = (0..n_blocks * bytes)
                    .map(|_| rng.below(256) as u8)
                    .collect();
                for b in 0..n_blocks {
                    for &off in f16_fields {
                        d[b * bytes + off..b * bytes + off + 2]
                            .copy_from_slice(&f16_bytes(rng.normal() * 0.05));
                    }
                }
                d
            }
        };
        let want = quant::dequantize(ty, &data, n_elems).unwrap_or_else(|e| panic!("{ty:?}: {e}"));
        let input = dir.join(format!("{}.bin", ty.name()));
        std::fs::write(&input, &data).expect("write blocks");
        let step = [16usize, 8, 4, 2]
            .into_iter()
            .find(|s| bytes % s == 0)
            .unwrap();
        for mis in (0..16).step_by(step) {
            let out = Command::new(&bin)
                .arg(id.to_string())
                .arg(n_blocks.to_string())
                .arg(mis.to_string())
                .arg(&input)
                .output()
                .expect("run host decoder");
            assert!(
                out.status.success(),
                "{ty:?}: host decoder exited with {:?}",
                out.status
            );
            let got: Vec<f32> = out
                .stdout
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            assert_eq!(got.len(), want.len(), "{ty:?}: element count");
            if let Some(i) = (0..want.len())
                .find(|&i| got[i].to_bits() != want[i].to_bits() && !(got[i] == want[i]))
            {
                panic!(
                    "{ty:?} misaligned by {mis}: element {i} (block {}, offset {}) decodes to {} but gguf dequantize gives {} (MEMRA_SEED={})",
                    i / block.max(1),
                    i % block.max(1),
                    got[i],
                    want[i],
                    rng.seed()
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
