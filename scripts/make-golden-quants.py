#!/usr/bin/env python3
"""Write golden dequantization vectors for memra-gguf's quant tests.

For each supported ggml type this makes a few blocks of pseudo-random raw block bytes (seeded, so
the output is reproducible), dequantizes them with the gguf-py reference
(`gguf.quants.dequantize`), and writes
    gguf/tests/data/golden/<TYPE>.bin   the raw block bytes
    gguf/tests/data/golden/<TYPE>.f32   the reference values, little-endian f32
which gguf/tests/quant_golden.rs compares against memra's dequantizer.

Random bytes are valid blocks for every type here, except that f16 scale fields are set to finite
values (uniform in [-2, 2]; one block per type gets a subnormal scale) and plain F16/BF16/F32
values are kept finite so that the comparison is not about NaN payloads.

Usage: "$(bash scripts/setup-python)" scripts/make-golden-quants.py           # (re)write the files
       "$(bash scripts/setup-python)" scripts/make-golden-quants.py --verify  # check the .f32 files
--verify dequantizes the committed .bin files again and checks that the committed .f32 files are
bit for bit gguf-py's output (independent of numpy's RNG stream, which may change across versions).
"""

import importlib.metadata
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

SEED = 20240611
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gguf", "tests", "data", "golden")

# Byte offsets of the f16 scale fields within one block (ggml-common.h).
F16_FIELDS = {
    T.Q8_0: [0],
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.IQ4_NL: [0],
    T.IQ4_XS: [0],
}
PLAIN = [T.F32, T.F16, T.BF16]


def block_bytes(rng: np.random.Generator, qtype: T) -> np.ndarray:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = 8 if block_size == 32 else 4
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scales = rng.uniform(-2.0, 2.0, size=n_blocks).astype(np.float16)
        scales[1] = np.float16(3.0e-6) * (1 if off == 0 else -1)  # subnormal f16
        raw[:, off:off + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1)


def plain_bytes(rng: np.random.Generator, qtype: T) -> np.ndarray:
    n = 64
    if qtype == T.F32:
        vals = (rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, size=n)).astype(np.float32)
        vals[:4] = [0.0, -0.0, 1.0e-40, -3.4e38]  # zeros, a subnormal, near the max
        return vals.view(np.uint8)
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    exp_mask = 0x7C00 if qtype == T.F16 else 0x7F80
    bits = np.where((bits & exp_mask) == exp_mask, bits & ~np.uint16(0x4000), bits).astype(np.uint16)  # no inf/NaN
    return bits.view(np.uint8)


def verify() -> None:
    bad = []
    for qtype in PLAIN + list(F16_FIELDS):
        raw = np.fromfile(os.path.join(OUT, f"{qtype.name}.bin"), dtype=np.uint8)
        want = np.fromfile(os.path.join(OUT, f"{qtype.name}.f32"), dtype="<f4")
        got = np.asarray(gguf.quants.dequantize(raw, qtype), dtype="<f4").reshape(-1)
        if got.shape != want.shape or not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
            bad.append(qtype.name)
    if bad:
        sys.exit(f"golden .f32 files differ from gguf-py's dequantization of the .bin files: {bad}")
    version = importlib.metadata.version("gguf")
    print(f"verified {len(PLAIN) + len(F16_FIELDS)} golden types against gguf {version}", file=sys.stderr)


def main() -> None:
    if sys.argv[1:] == ["--verify"]:
        return verify()
    if sys.argv[1:]:
        sys.exit("usage: make-golden-quants.py [--verify]")
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(SEED)
    total = 0
    for qtype in PLAIN + list(F16_FIELDS):
        raw = plain_bytes(rng, qtype) if qtype in PLAIN else block_bytes(rng, qtype)
        ref = gguf.quants.dequantize(raw, qtype)  # raw is uint8 for every type
        ref = np.asarray(ref, dtype=np.float32).reshape(-1)
        if not np.all(np.isfinite(ref)):
            sys.exit(f"{qtype.name}: reference produced non-finite values")
        name = qtype.name
        raw.tofile(os.path.join(OUT, f"{name}.bin"))
        ref.astype("<f4").tofile(os.path.join(OUT, f"{name}.f32"))
        total += raw.nbytes + ref.nbytes
        print(f"{name}: {ref.size} elements, {raw.nbytes} bytes", file=sys.stderr)
    print(f"wrote {total} bytes to {os.path.normpath(OUT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
