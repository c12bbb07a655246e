#!/usr/bin/env python3
"""Stream every tensor of a GGUF file, dequantized by the gguf-py reference, to stdout.

Used by tests/tests/real_gemma3_dequant.rs, which compares the stream with memra's dequantizer
tensor by tensor without any temporary file. Rows are dequantized in chunks, so memory stays small
even for the 167M-element token embedding. Time on the gemma3 270M file is mostly GGUFReader's
parse of the 262k-token vocabulary (~14 s CPU); the dequantization itself takes ~3.5 s.

Stream format (all little-endian):
    b"MEMRADQ1", u64 tensor count
    per tensor, in file order:
        u32 name length, name (UTF-8, exactly as in the file), u32 ggml type id, u64 element count,
        then element-count f32 values in memory order (row after row)

Usage: python dequant-reference.py MODEL.gguf > stream
"""

import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

CHUNK_ELEMENTS = 1 << 22


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: dequant-reference.py MODEL.gguf")
    reader = GGUFReader(sys.argv[1])
    out = sys.stdout.buffer
    out.write(b"MEMRADQ1" + np.uint64(len(reader.tensors)).astype("<u8").tobytes())
    for t in reader.tensors:
        name = t.name.encode("utf-8")
        header = np.array([len(name)], "<u4").tobytes() + name
        header += np.array([int(t.tensor_type)], "<u4").tobytes() + np.array([int(t.n_elements)], "<u8").tobytes()
        out.write(header)
        # t.data is (rows, row bytes) of uint8 for block types, or the typed values for F32/F16.
        data = t.data.reshape(-1, t.data.shape[-1])
        row_elements = int(t.n_elements) // data.shape[0]
        rows_per_chunk = max(1, CHUNK_ELEMENTS // row_elements)
        written = 0
        for start in range(0, data.shape[0], rows_per_chunk):
            values = np.asarray(dequantize(data[start:start + rows_per_chunk], t.tensor_type), dtype="<f4")
            out.write(values.tobytes())
            written += values.size
        if written != int(t.n_elements):
            sys.exit(f"dequant-reference.py: {t.name}: wrote {written} values, expected {int(t.n_elements)}")
    out.flush()


if __name__ == "__main__":
    main()
