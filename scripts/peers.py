#!/usr/bin/env python3
"""peers.py — time the ops and shapes `memra bench` plans in PyTorch, on the same GPU.

Run on the GPU machine (torch 2.11 there, no network):

    python3 scripts/peers.py --from memra.json --json peers.json [--shapes extra.json]
    python3 scripts/peers.py --from memra.json --list        # the plan only, no torch needed

Shapes: the `results` entries (family, shape, dtype) of a `memra bench --json` file, so the peer
runs exactly what memra ran; `--shapes FILE` adds entries from a JSON list of
{"family", "shape", "dtype"} (e.g. benches/peers-attention.json: attention decode, which memra
bench plans them too now; the file also covers builds without those architectures). Each
distinct (family, shape, dtype) is timed once.

Implementations (`impl` in the output):
- torch_eager:   the op in eager PyTorch (several kernels where torch has no fused one).
- torch_compile: the same function through torch.compile (Inductor), `--compile-mode`
                 (default `default`; `max-autotune-no-cudagraphs` autotunes GEMMs but compiles
                 for minutes). CUDA graphs stay off in both, as in memra bench.
- cublas:        matvec / matmul via torch.matmul on bf16 (cuBLAS). For matvec/matmul this is
                 what eager runs, so no separate torch_eager row is written.
torch has no GGUF quant types: for q8_0/q4_k/... weights the peer runs the dequantized **bf16**
weight (`peer_dtype: "bf16"`) and `bytes` counts the bytes torch moves (2 bytes per weight), not
memra's. Activations are f32 as in memra (x, norms, GLU, logits), except where the op needs the
weight's dtype (matvec/matmul inputs are bf16, outputs bf16).

Timing as memra bench: `--warmup` untimed calls, then `--iters` calls each between two CUDA
events, median reported; before every timed call a memset of 2 × L2 runs outside the events (it
evicts L2 and keeps the GPU busy while Python enqueues the call). Copy bandwidth: a 1 GiB
device-to-device copy, bytes read + written.

A shape the script cannot express (or that fails: out of memory, compile error) is recorded with
`median_us: null` and `skipped: "<reason>"`; the script does not stop. Output schema:
benches/results/SCHEMA.md, "Peers file".
"""
import argparse
import datetime
import json
import os
import re
import sys
import time

GIB = 1 << 30


def parse_shape(family, shape, dtype):
    """Return (op, dims) for a memra (family, shape, dtype), or raise ValueError(reason)."""
    def ints(pattern):
        m = re.fullmatch(pattern, shape)
        if not m:
            raise ValueError(f"shape {shape!r} does not match {pattern!r} for family {family}")
        return [int(g) for g in m.groups()]

    if family == "matvec":
        k, n = ints(r"k(\d+)_n(\d+)")
        return dict(k=k, n=n)
    if family == "matmul":
        t, k, n = ints(r"t(\d+)_k(\d+)_n(\d+)")
        return dict(t=t, k=k, n=n)
    if family in ("rmsnorm", "add_rmsnorm", "swiglu", "geglu", "argmax"):
        rows, n = ints(r"(\d+)x(\d+)")
        return dict(rows=rows, n=n)
    if family == "topk":
        rows, n, k = ints(r"(\d+)x(\d+)_k(\d+)")
        return dict(rows=rows, n=n, k=k)
    if family == "embed":
        t, e, v = ints(r"t(\d+)_e(\d+)_v(\d+)")
        return dict(t=t, e=e, v=v)
    if family in ("attn_decode", "attn_decode_rope", "mla_decode"):
        # q heads, kv heads, head dim (qk), value dim, context tokens; batch 1, one query token.
        # MLA decode is MQA over the latent: kv 1, d = kv_lora + rope, dv = kv_lora.
        h, kv, d, dv, c = ints(r"h(\d+)_kv(\d+)_d(\d+)_dv(\d+)_c(\d+)")
        return dict(h=h, kv=kv, d=d, dv=dv, c=c)
    if family == "mla_sparse_decode":
        h, kv, d, dv, k, c = ints(r"h(\d+)_kv(\d+)_d(\d+)_dv(\d+)_k(\d+)_c(\d+)")
        return dict(h=h, kv=kv, d=d, dv=dv, k=k, c=c)
    if family == "attn_prefill":
        t, h, kv, d = ints(r"t(\d+)_h(\d+)_kv(\d+)_d(\d+)")
        return dict(t=t, h=h, kv=kv, d=d)
    if family == "qk_norm_rope":
        t, h, kv, d, r = ints(r"t(\d+)_h(\d+)_kv(\d+)_d(\d+)_r(\d+)")
        return dict(t=t, h=h, kv=kv, d=d, r=r)
    if family == "dsa_index_key":
        t, d, r = ints(r"t(\d+)_d(\d+)_r(\d+)")
        return dict(t=t, d=d, r=r)
    if family == "dsa_indexer":
        h, d, c = ints(r"q1_h(\d+)_d(\d+)_c(\d+)")
        return dict(h=h, d=d, c=c)
    if family == "dsa_topk":
        c, k = ints(r"q1_c(\d+)_k(\d+)")
        return dict(c=c, k=k)
    if family == "moe_router":
        m = re.fullmatch(r"t(\d+)_e(\d+)_k(\d+)_(sigmoid|softmax)", shape)
        if not m:
            raise ValueError(f"shape {shape!r} is not t<T>_e<E>_k<k>_<gating> for family {family}")
        return dict(t=int(m[1]), e=int(m[2]), k=int(m[3]), sigmoid=m[4] == "sigmoid")
    if family == "moe_matvec":
        m = re.fullmatch(r"t(\d+)_k(\d+)_n(\d+)_e(\d+)_u(\d+)_(plain|swiglu|geglu|down)", shape)
        if not m:
            raise ValueError(f"shape {shape!r} is not t<T>_k<K>_n<N>_e<E>_u<U>_<mode> for family {family}")
        t, k, n, e, u = (int(g) for g in m.groups()[:5])
        return dict(t=t, k=k, n=n, e=e, u=u, mode=m[6])
    if family == "norm_matvec":
        m = re.fullmatch(r"k(\d+)_n(\d+)_(none|swiglu|geglu)", shape)
        if not m:
            raise ValueError(f"shape {shape!r} is not k<K>_n<N>_<glu> for family {family}")
        return dict(k=int(m[1]), n=int(m[2]), glu=m[3])
    if family == "combine_matvec":
        k, n, d, s = ints(r"k(\d+)_n(\d+)_d(\d+)_s(\d+)")
        return dict(k=k, n=n, d=d, s=s)
    raise ValueError(f"no torch peer for family {family!r}")


def peer_dtype(family, dtype):
    if family in ("matvec", "matmul", "embed", "moe_matvec", "norm_matvec", "combine_matvec"):
        return "bf16"  # quantized weights: the dequantized bf16 weight
    if family in ("attn_decode", "attn_decode_rope", "attn_prefill", "mla_decode", "mla_sparse_decode", "dsa_indexer", "dsa_index_key"):
        return "bf16"  # bf16 caches and bf16 q (memra's q is f32, its caches bf16)
    return "f32"


def plan_bytes_flops(family, d):
    """Bytes the torch op must move at least (each input read, each output written once)."""
    if family == "matvec":
        return 2 * d["k"] * d["n"] + 2 * d["k"] + 2 * d["n"], 2 * d["k"] * d["n"]
    if family == "matmul":
        t, k, n = d["t"], d["k"], d["n"]
        return 2 * k * n + 2 * t * k + 2 * t * n, 2 * t * k * n
    rows, n = d.get("rows"), d.get("n")
    if family == "rmsnorm":
        return 2 * 4 * rows * n + 4 * n, None
    if family == "add_rmsnorm":
        return 4 * 4 * rows * n + 4 * n, None
    if family in ("swiglu", "geglu"):
        return 3 * 4 * rows * n, None
    if family in ("argmax", "topk"):
        return 4 * rows * n, None
    if family == "embed":
        return d["t"] * d["e"] * 2 + 4 * d["t"] * d["e"] + 8 * d["t"], None
    if family in ("attn_decode", "mla_decode"):
        h, kv, dd, dv, c = d["h"], d["kv"], d["d"], d["dv"], d["c"]
        if family == "mla_decode":
            # One latent cache: the value is its first dv columns, not a second tensor.
            return 2 * (c * dd + h * dd + h * dv), 2 * h * c * (dd + dv)
        byts = 2 * (c * kv * dd + c * kv * dv + h * dd + h * dv)
        return byts, 2 * h * c * (dd + dv)
    if family == "attn_decode_rope":
        h, kv, dd, c = d["h"], d["kv"], d["d"], d["c"]
        # bf16 caches (the new row written), q/k/v in and out f32 as memra's.
        return 2 * 2 * c * kv * dd + 4 * (2 * h + 2 * kv) * dd, 4 * h * c * dd
    if family == "qk_norm_rope":
        tt, h, kv, dd = d["t"], d["h"], d["kv"], d["d"]
        # q and k in and out, v in (f32 as memra's), the K and V rows written (bf16), positions.
        return 4 * 2 * tt * (h + kv) * dd + 4 * tt * kv * dd + 2 * 2 * tt * kv * dd + 4 * tt, None
    if family == "mla_sparse_decode":
        h, dd, dv, k = d["h"], d["d"], d["dv"], d["k"]
        return 2 * (k * dd + h * dd + h * dv) + 8 * k, 2 * h * k * (dd + dv)
    if family == "attn_prefill":
        t, h, kv, dd = d["t"], d["h"], d["kv"], d["d"]
        return 2 * (2 * t * h * dd + 2 * t * kv * dd), 4 * dd * h * (t * (t + 1) // 2)
    if family == "dsa_index_key":
        t, dd = d["t"], d["d"]
        return 4 * t * dd + 8 * dd + 8 * t + 2 * t * dd, None
    if family == "dsa_indexer":
        h, dd, c = d["h"], d["d"], d["c"]
        return 2 * c * dd + 2 * h * dd + 4 * h + 4 * c, 2 * h * dd * c
    if family == "dsa_topk":
        return 4 * d["c"] + 8 * d["k"], None
    if family == "moe_router":
        t, e, k = d["t"], d["e"], d["k"]
        return 4 * t * e + (4 * e if d["sigmoid"] else 0) + 12 * t * k, None
    if family == "moe_matvec":
        t, k, n, u, mode = d["t"], d["k"], d["n"], d["u"], d["mode"]
        slots = t * u
        paired = 2 if mode in ("swiglu", "geglu") else 1
        x_rows, y_rows = (slots, t) if mode == "down" else (t, slots)
        return 2 * paired * slots * n * k + 2 * (x_rows * k + y_rows * n) + 8 * slots, 2 * paired * slots * n * k
    if family == "norm_matvec":
        k, n = d["k"], d["n"]
        paired = 1 if d["glu"] == "none" else 2
        # bf16 weights; x, delta and both norms' weights read, the residual written (f32), y.
        return 2 * paired * n * k + 4 * 5 * k + 4 * n, 2 * paired * n * k
    if family == "combine_matvec":
        k, n, hd, s = d["k"], d["n"], d["d"], d["s"]
        # bf16 weights; every split's f32 partials (acc, m, l per head) read once, y.
        return 2 * n * k + 4 * (k // hd) * s * (hd + 2) + 4 * n, 2 * n * k
    raise ValueError(family)


def load_plan(paths_from, paths_shapes):
    entries = []
    for p in paths_from:
        doc = json.load(open(p))
        if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
            raise SystemExit(f"peers.py: {p}: not a memra bench JSON (no `results` array)")
        entries += [(r["family"], r["shape"], r["dtype"]) for r in doc["results"]]
    for p in paths_shapes:
        doc = json.load(open(p))
        if not isinstance(doc, list):
            raise SystemExit(f"peers.py: {p}: expected a JSON list of {{family, shape, dtype}}")
        for i, r in enumerate(doc):
            try:
                entries.append((r["family"], r["shape"], r["dtype"]))
            except (KeyError, TypeError) as e:
                raise SystemExit(f"peers.py: {p}: entry {i}: missing {e}")
    seen, out = set(), []
    for e in entries:
        if e not in seen:
            seen.add(e)
            out.append(e)
    return out


# ---------------------------------------------------------------------------------------------
# torch side


def make_ops(torch, family, d):
    """Return (inputs, {impl: fn}) where fn(*inputs) runs the op once."""
    F = torch.nn.functional
    dev = "cuda"
    f32, bf16 = torch.float32, torch.bfloat16
    eps = 1e-6

    def randn(*shape, dtype=f32):
        return torch.randn(*shape, device=dev, dtype=f32).to(dtype)

    if family in ("matvec", "matmul"):
        t = 1 if family == "matvec" else d["t"]
        w = randn(d["n"], d["k"], dtype=bf16) * 0.02
        x = randn(t, d["k"], dtype=bf16)
        fn = lambda x, w: torch.matmul(x, w.t())
        return (x, w), {"cublas": fn}, fn
    if family == "rmsnorm":
        x, w = randn(d["rows"], d["n"]), randn(d["n"])

        def fn(x, w):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
        return (x, w), {"torch_eager": fn}, fn
    if family == "add_rmsnorm":
        res, delta, w = randn(d["rows"], d["n"]), randn(d["rows"], d["n"]), randn(d["n"])

        def fn(res, delta, w):
            res.add_(delta)  # residual updated in place, as memra's kernel does
            return res * torch.rsqrt(res.pow(2).mean(-1, keepdim=True) + eps) * w
        return (res, delta, w), {"torch_eager": fn}, fn
    if family in ("swiglu", "geglu"):
        gate, up = randn(d["rows"], d["n"]), randn(d["rows"], d["n"])
        act = F.silu if family == "swiglu" else (lambda g: F.gelu(g, approximate="tanh"))
        fn = lambda gate, up: act(gate) * up
        return (gate, up), {"torch_eager": fn}, fn
    if family == "argmax":
        logits = randn(d["rows"], d["n"])
        fn = lambda logits: torch.argmax(logits, dim=-1)
        return (logits,), {"torch_eager": fn}, fn
    if family == "topk":
        logits = randn(d["rows"], d["n"])
        k = d["k"]
        fn = lambda logits: torch.topk(logits, k, dim=-1)
        return (logits,), {"torch_eager": fn}, fn
    if family == "embed":
        table = randn(d["v"], d["e"], dtype=bf16)
        tokens = torch.randint(0, d["v"], (d["t"],), device=dev)
        fn = lambda tokens, table: F.embedding(tokens, table).float()
        return (tokens, table), {"torch_eager": fn}, fn
    if family in ("attn_decode", "mla_decode"):
        h, kv, dd, dv, c = d["h"], d["kv"], d["d"], d["dv"], d["c"]
        q = randn(1, h, 1, dd, dtype=bf16)
        k = randn(1, kv, c, dd, dtype=bf16)
        if family == "mla_decode":
            v = k[..., :dv]  # the latent itself (a strided view, as an MLA port would pass it)
        else:
            v = randn(1, kv, c, dv, dtype=bf16)
        gqa = h != kv
        fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        return (q, k, v), {"torch_eager": fn}, fn
    if family == "attn_decode_rope":
        h, kv, dd, c = d["h"], d["kv"], d["d"], d["c"]
        q, k, v = randn(h, dd), randn(kv, dd), randn(kv, dd)
        qw, kw = randn(dd), randn(dd)
        kc, vc = randn(1, kv, c, dd, dtype=bf16), randn(1, kv, c, dd, dtype=bf16)
        inv = 1.0e6 ** (-torch.arange(0, dd, 2, device=dev, dtype=f32) / dd)
        ang = (c - 1) * inv
        cos, sin = torch.cos(ang), torch.sin(ang)
        gqa = h != kv

        def rope(x):  # per-head RMSNorm done by the caller; NeoX halves
            a, b = x[:, : dd // 2], x[:, dd // 2 :]
            return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)

        def fn(q, k, v, qw, kw, kc, vc):
            # A decode step's per-head QK-norm + RoPE, the cache write at the last row, attention.
            qn = rope(q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps) * qw)
            kn = rope(k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * kw)
            kc[0, :, c - 1] = kn.to(bf16)
            vc[0, :, c - 1] = v.to(bf16)
            return F.scaled_dot_product_attention(qn.to(bf16)[None, :, None], kc, vc, enable_gqa=gqa)
        return (q, k, v, qw, kw, kc, vc), {"torch_eager": fn}, fn
    if family == "qk_norm_rope":
        tt, h, kv, dd, r = d["t"], d["h"], d["kv"], d["d"], d["r"]
        q, k, v = randn(tt, h, dd), randn(tt, kv, dd), randn(tt, kv, dd)
        qw, kw = randn(dd), randn(dd)
        kc, vc = randn(tt, kv, dd, dtype=bf16), randn(tt, kv, dd, dtype=bf16)
        inv = 1.0e6 ** (-torch.arange(0, r, 2, device=dev, dtype=f32) / r)
        ang = torch.arange(tt, device=dev, dtype=f32)[:, None] * inv  # [T, r/2]
        cos, sin = torch.cos(ang)[:, None], torch.sin(ang)[:, None]

        def rope(x):  # NeoX halves of the first r dims, the rest as it is
            a, b, rest = x[..., : r // 2], x[..., r // 2 : r], x[..., r:]
            return torch.cat((a * cos - b * sin, a * sin + b * cos, rest), dim=-1)

        def fn(q, k, v, qw, kw, kc, vc):
            # Per-head QK-norm + RoPE of T tokens and their K/V cache rows at positions 0..T.
            qn = rope(q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps) * qw)
            kn = rope(k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * kw)
            kc.copy_(kn.to(bf16))
            vc.copy_(v.to(bf16))
            return qn
        return (q, k, v, qw, kw, kc, vc), {"torch_eager": fn}, fn
    if family == "mla_sparse_decode":
        h, dd, dv, kk, c = d["h"], d["d"], d["dv"], d["k"], d["c"]
        q = randn(1, h, 1, dd, dtype=bf16)
        latent = randn(c, dd, dtype=bf16)
        idx = torch.randperm(c, device=dev)[:kk].sort().values

        def fn(q, latent, idx):
            rows = latent.index_select(0, idx)[None, None]  # [1, 1, k, d]
            return F.scaled_dot_product_attention(q, rows, rows[..., :dv], enable_gqa=True)
        return (q, latent, idx), {"torch_eager": fn}, fn
    if family == "attn_prefill":
        t, h, kv, dd = d["t"], d["h"], d["kv"], d["d"]
        q = randn(1, h, t, dd, dtype=bf16)
        k, v = randn(1, kv, t, dd, dtype=bf16), randn(1, kv, t, dd, dtype=bf16)
        gqa = h != kv
        fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return (q, k, v), {"torch_eager": fn}, fn
    if family == "dsa_index_key":
        t, dd, r = d["t"], d["d"], d["r"]
        cache_rows = 131072
        x, w, b = randn(t, dd), randn(dd), randn(dd)
        cache = randn(cache_rows, dd, dtype=bf16)
        start = int(torch.randint(0, cache_rows - t + 1, (1,)))
        pos = torch.arange(start, start + t, device=dev)
        inv = 1.0e6 ** (-torch.arange(0, r, 2, device=dev, dtype=f32) / r)

        def fn(x, w, b, pos, cache):
            y = F.layer_norm(x, (dd,), w, b, eps=1e-6)
            ang = pos[:, None].to(f32) * inv[None, :]
            cos, sin = torch.cos(ang), torch.sin(ang)
            ev, od = y[:, 0:r:2], y[:, 1:r:2]  # interleaved pairs (GGML NORM mode)
            rot = torch.stack((ev * cos - od * sin, ev * sin + od * cos), dim=-1).reshape(t, r)
            cache.index_copy_(0, pos, torch.cat((rot, y[:, r:]), dim=-1).to(bf16))
        return (x, w, b, pos, cache), {"torch_eager": fn}, fn
    if family == "dsa_indexer":
        h, dd, c = d["h"], d["d"], d["c"]
        q, w, keys = randn(h, dd, dtype=bf16), randn(h), randn(c, dd, dtype=bf16)
        fn = lambda q, w, keys: torch.relu(keys @ q.t()).float() @ w
        return (q, w, keys), {"torch_eager": fn}, fn
    if family == "dsa_topk":
        scores = randn(d["c"])
        kk = d["k"]
        fn = lambda scores: torch.topk(scores, kk).indices.sort().values  # ascending, as dsa_topk
        return (scores,), {"torch_eager": fn}, fn
    if family == "moe_router":
        t, e, kk, sig = d["t"], d["e"], d["k"], d["sigmoid"]
        logits, bias = randn(t, e), randn(e) * 0.01

        def fn(logits, bias):
            if sig:  # GLM-5: sigmoid, bias for the selection only, renormalized, x2.5
                p = torch.sigmoid(logits)
                ids = torch.topk(p + bias, kk, dim=-1).indices
                wt = p.gather(-1, ids)
                return ids, wt / wt.sum(-1, keepdim=True) * 2.5
            ids = torch.topk(logits, kk, dim=-1).indices  # OLMoE: softmax weights, no renorm
            return ids, torch.softmax(logits, -1).gather(-1, ids)
        return (logits, bias), {"torch_eager": fn}, fn
    if family == "moe_matvec":
        t, k, n, e, u, mode = d["t"], d["k"], d["n"], d["e"], d["u"], d["mode"]
        slots = t * u
        w = randn(e, n, k, dtype=bf16) * 0.02
        w_up = randn(e, n, k, dtype=bf16) * 0.02 if mode in ("swiglu", "geglu") else None
        ids = torch.randperm(e, device=dev)[:slots]
        wt = torch.rand(slots, device=dev)
        x = randn(slots if mode == "down" else t, k, dtype=bf16)
        act = F.silu if mode == "swiglu" else (lambda g: F.gelu(g, approximate="tanh"))
        tok = torch.arange(slots, device=dev) // u  # the token of each slot

        def fn(w, w_up, ids, wt, x):
            sel = w.index_select(0, ids)  # [slots, n, k]: only the selected experts are read
            if mode == "down":
                y = torch.bmm(sel, x[:, :, None])[:, :, 0].float() * wt[:, None]
                return y.view(t, u, n).sum(1)
            xs = x.index_select(0, tok)[:, :, None]
            g = torch.bmm(sel, xs)[:, :, 0]
            if w_up is None:
                return g
            return act(g.float()) * torch.bmm(w_up.index_select(0, ids), xs)[:, :, 0].float()
        return (w, w_up, ids, wt, x), {"torch_eager": fn}, fn
    if family == "norm_matvec":
        k, n, glu = d["k"], d["n"], d["glu"]
        x, delta, dw, nw = randn(k), randn(k), randn(k), randn(k)
        w = randn(n, k, dtype=bf16) * 0.02
        w_up = randn(n, k, dtype=bf16) * 0.02 if glu != "none" else None
        act = F.silu if glu == "swiglu" else (lambda g: F.gelu(g, approximate="tanh"))

        def fn(x, delta, dw, nw, w, w_up):
            # A decode step's sandwich-norm residual add, the next pre-norm, then the projection.
            r = x + delta * torch.rsqrt(delta.pow(2).mean() + eps) * dw
            h = (r * torch.rsqrt(r.pow(2).mean() + eps) * nw).to(bf16)
            g = torch.matmul(w, h)
            if w_up is None:
                return r, g
            return r, act(g.float()) * torch.matmul(w_up, h).float()
        return (x, delta, dw, nw, w, w_up), {"torch_eager": fn}, fn
    if family == "combine_matvec":
        k, n, hd, s = d["k"], d["n"], d["d"], d["s"]
        heads = k // hd
        acc, m, l = randn(heads, s, hd), randn(heads, s), randn(heads, s).abs() + 0.5
        w = randn(n, k, dtype=bf16) * 0.02

        def fn(acc, m, l, w):
            # Flash-decoding's split merge (base-2 maxima, as memra's partials), then the projection.
            wt = torch.exp2(m - m.amax(dim=1, keepdim=True))
            x = (acc * wt[:, :, None]).sum(1) / (l * wt).sum(1, keepdim=True)
            return torch.matmul(w, x.reshape(k).to(bf16))
        return (acc, m, l, w), {"torch_eager": fn}, fn
    raise ValueError(f"no torch peer for family {family!r}")


def time_fn(torch, fn, args, flush, warmup, iters):
    for _ in range(warmup):
        fn(*args)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        flush.zero_()
        starts[i].record()
        fn(*args)
        ends[i].record()
    torch.cuda.synchronize()
    us = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
    return us[len(us) // 2]


def copy_bandwidth(torch, warmup, iters):
    src = torch.empty(GIB, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    for _ in range(warmup):
        dst.copy_(src)
    torch.cuda.synchronize()
    ms = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        e.synchronize()
        ms.append(s.elapsed_time(e))
    ms.sort()
    del src, dst
    torch.cuda.empty_cache()
    return 2 * GIB / (ms[len(ms) // 2] * 1e-3) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from", dest="from_", action="append", default=[], metavar="MEMRA_JSON",
                    help="memra bench --json output whose results give the shapes (repeatable)")
    ap.add_argument("--shapes", action="append", default=[], metavar="FILE",
                    help="extra shapes: JSON list of {family, shape, dtype} (repeatable)")
    ap.add_argument("--json", metavar="OUT", help="write the results here")
    ap.add_argument("--list", action="store_true", help="print the plan and exit (no torch)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls (default: the memra file's, else 30)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls (default: the memra file's, else 5)")
    ap.add_argument("--compile-mode", default="default",
                    choices=["default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune"])
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--family", action="append", default=[], help="only these families")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="stop compiling (record skipped) after this many seconds; eager still runs")
    args = ap.parse_args()

    if not args.from_ and not args.shapes:
        ap.error("give --from MEMRA_JSON and/or --shapes FILE")
    plan = load_plan(args.from_, args.shapes)
    if args.family:
        plan = [e for e in plan if e[0] in args.family]
    iters, warmup = args.iters, args.warmup
    if args.from_:
        first = json.load(open(args.from_[0]))
        iters = iters or first.get("iters")
        warmup = warmup if warmup is not None else first.get("warmup")
    iters, warmup = iters or 30, 5 if warmup is None else warmup

    if args.list:
        for fam, shape, dtype in plan:
            try:
                d = parse_shape(fam, shape, dtype)
                b, f = plan_bytes_flops(fam, d)
                print(f"{fam:<12} {shape:<24} {dtype:<6} -> {peer_dtype(fam, dtype):<5} bytes {b} flops {f}")
            except ValueError as e:
                print(f"{fam:<12} {shape:<24} {dtype:<6} skipped: {e}")
        return 0

    import torch
    if not torch.cuda.is_available():
        print("peers.py: no CUDA device visible to torch", file=sys.stderr)
        return 2
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 4096)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 0) or (60 << 20)
    copy_gbps = copy_bandwidth(torch, 3, iters)
    print(f"peers: {props.name}, torch {torch.__version__}, L2 {l2 >> 20} MiB, "
          f"copy {copy_gbps:.0f} GB/s, {len(plan)} shapes", file=sys.stderr)
    flush = torch.empty(2 * l2, dtype=torch.uint8, device="cuda")

    def save(results, final):
        """Write the file; also after every shape, so a crash (torch.compile has segfaulted on
        this image before) leaves the shapes done so far in a valid file."""
        doc = {
            "schema": 1,
            "device": props.name,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "compile_mode": None if args.no_compile else args.compile_mode,
            "iters": iters,
            "warmup": warmup,
            "l2_bytes": l2,
            "copy_bytes": 2 * GIB,
            "copy_gbps": copy_gbps,
            "complete": final,
            "results": results,
        }
        text = json.dumps(doc, indent=2, allow_nan=False) + "\n"
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                f.write(text)
            os.replace(args.json + ".tmp", args.json)
            if final:
                print(f"wrote {args.json}", file=sys.stderr)
        elif final:
            sys.stdout.write(text)

    started = time.time()
    results = []
    cache = {}  # (family, shape, peer dtype) -> rows without dtype: quant types share one bf16 peer
    for fam, shape, dtype in plan:
        base = dict(family=fam, shape=shape, dtype=dtype)
        try:
            d = parse_shape(fam, shape, dtype)
        except ValueError as e:
            results.append(dict(base, impl="torch_eager", peer_dtype=None, median_us=None,
                                bytes=None, flops=None, skipped=str(e)))
            continue
        pd = peer_dtype(fam, dtype)
        key = (fam, shape, pd)
        if key not in cache:
            rows = []
            byts, flops = plan_bytes_flops(fam, d)
            try:
                inputs, impls, fn = make_ops(torch, fam, d)
            except Exception as e:  # out of memory etc.: record and go on
                cache[key] = [dict(impl="torch_eager", median_us=None, bytes=byts, flops=flops,
                                   skipped=f"setup: {type(e).__name__}: {e}".splitlines()[0])]
                torch.cuda.empty_cache()
                results += [dict(base, peer_dtype=pd, **r) for r in cache[key]]
                continue
            for impl, f in impls.items():
                try:
                    rows.append(dict(impl=impl, median_us=time_fn(torch, f, inputs, flush, warmup, iters)))
                except Exception as e:
                    rows.append(dict(impl=impl, median_us=None, skipped=f"{type(e).__name__}: {e}".splitlines()[0]))
            if args.no_compile:
                rows.append(dict(impl="torch_compile", median_us=None, skipped="--no-compile"))
            elif time.time() - started > args.budget_s:
                rows.append(dict(impl="torch_compile", median_us=None, skipped=f"time budget {args.budget_s:.0f} s spent"))
            else:
                try:
                    cf = torch.compile(fn, mode=args.compile_mode, dynamic=False, fullgraph=True)
                    rows.append(dict(impl="torch_compile", median_us=time_fn(torch, cf, inputs, flush, warmup, iters)))
                except Exception as e:
                    rows.append(dict(impl="torch_compile", median_us=None, skipped=f"{type(e).__name__}: {e}".splitlines()[0]))
            for r in rows:
                r["bytes"], r["flops"] = byts, flops
            cache[key] = rows
            del inputs
            torch.cuda.empty_cache()
            line = ", ".join(f"{r['impl']} {r['median_us']:.2f} us" if r["median_us"] is not None
                             else f"{r['impl']} skipped" for r in rows)
            print(f"  {fam:<12} {shape:<24} {pd:<5} {line}", file=sys.stderr)
        results += [dict(base, peer_dtype=pd, **r) for r in cache[key]]
        save(results, final=False)

    save(results, final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
