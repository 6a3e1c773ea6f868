"""Where a decode call's time goes: a ladder of hand-written kernels at one shape (issue 38).

Each rung adds one piece of the prologue's work to the one before, all with one warp per head
(vLLM's decode schedule) over the same rotating input sets, timed like ``fqr bench`` times fqr
(device µs per call, median of CUDA-graph replays, ``triton.testing.do_bench_cudagraph``):

* ``empty``: a kernel that does nothing (the launch floor inside a graph);
* ``copy``: each head loaded and stored (the copy of the call's bytes);
* ``gather``: the copy, scaled by the head's cos row (``positions[t]`` then the table row: the
  two dependent loads the rotation needs, no arithmetic to speak of);
* ``norm``: the copy through the RMSNorm (a reduction over the head, ``rsqrt``), no table;
* ``norm+rope``: the whole prologue by hand (q and k heads normed and rotated, NeoX, v copied);
* ``fqr``: fqr's shipped kernel for the preset (the public op through its host function).

The hand-written ``norm+rope`` output is compared with fqr's before anything is timed (both
are the fused contract: fp32 compute, one rounding; they must agree within 1 ULP).

Usage (on the GPU machine): ``python scripts/decode_floor_probe.py [--preset qwen3-8b]
[--tokens 1,16] [--sets 64] [--json OUT]``; prints one table.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

import fqr
from fqr.presets import get_preset


@triton.jit
def empty(x_ptr):
    pass


@triton.jit
def copy_heads(qkv_ptr, out_ptr, pos_ptr, cs_ptr, w_ptr, eps, NQK: tl.constexpr, D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.arange(0, D)
    row = tl.load(qkv_ptr + t * tl.num_programs(1) * D + h * D + cols)
    tl.store(out_ptr + t * tl.num_programs(1) * D + h * D + cols, row)


@triton.jit
def gather_heads(qkv_ptr, out_ptr, pos_ptr, cs_ptr, w_ptr, eps, NQK: tl.constexpr, D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    half = tl.arange(0, D // 2)
    base = t * tl.num_programs(1) * D + h * D
    a = tl.load(qkv_ptr + base + half).to(tl.float32)
    b = tl.load(qkv_ptr + base + D // 2 + half).to(tl.float32)
    pos = tl.load(pos_ptr + t)
    cos = tl.load(cs_ptr + pos * D + half)
    tl.store(out_ptr + base + half, (a * cos).to(tl.bfloat16))
    tl.store(out_ptr + base + D // 2 + half, (b * cos).to(tl.bfloat16))


@triton.jit
def norm_heads(qkv_ptr, out_ptr, pos_ptr, cs_ptr, w_ptr, eps, NQK: tl.constexpr, D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.arange(0, D)
    base = t * tl.num_programs(1) * D + h * D
    x = tl.load(qkv_ptr + base + cols).to(tl.float32)
    w = tl.load(w_ptr + cols).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    tl.store(out_ptr + base + cols, (x * r * w).to(tl.bfloat16))


@triton.jit
def norm_rope_heads(
    qkv_ptr, out_ptr, pos_ptr, cs_ptr, w_ptr, eps, NQK: tl.constexpr, D: tl.constexpr
):
    """q and k heads (the first NQK): RMSNorm over the head, then NeoX RoPE with the row
    ``cs[pos]`` (cos in [0, D/2), sin in [D/2, D)); v heads copied. One warp per head."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    half = tl.arange(0, D // 2)
    base = t * tl.num_programs(1) * D + h * D
    a = tl.load(qkv_ptr + base + half)
    b = tl.load(qkv_ptr + base + D // 2 + half)
    if h < NQK:
        pos = tl.load(pos_ptr + t)
        cos = tl.load(cs_ptr + pos * D + half)
        sin = tl.load(cs_ptr + pos * D + D // 2 + half)
        af = a.to(tl.float32)
        bf = b.to(tl.float32)
        r = tl.rsqrt((tl.sum(af * af, 0) + tl.sum(bf * bf, 0)) / D + eps)
        wa = tl.load(w_ptr + h // 32 * D + half).to(tl.float32)  # q heads 0..31, k after
        wb = tl.load(w_ptr + h // 32 * D + D // 2 + half).to(tl.float32)
        na = af * r * wa
        nb = bf * r * wb
        tl.store(out_ptr + base + half, (na * cos - nb * sin).to(tl.bfloat16))
        tl.store(out_ptr + base + D // 2 + half, (nb * cos + na * sin).to(tl.bfloat16))
    else:
        tl.store(out_ptr + base + half, a)
        tl.store(out_ptr + base + D // 2 + half, b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--sets", type=int, default=64)
    ap.add_argument("--rep-ms", type=float, default=200.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    spec = get_preset(args.preset).spec
    hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    if hq != 32 or d != 128 or spec.rotary_dim != d or not spec.is_neox:
        raise SystemExit("--preset: the hand kernels are written for 32 q heads of 128, NeoX")
    heads, nqk = hq + 2 * hkv, hq + hkv
    dev = torch.device("cuda")
    table = get_preset(args.preset).cos_sin_cache().to(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    qw = (1 + 0.1 * torch.randn(d, device=dev, generator=gen)).to(torch.bfloat16)
    kw = (1 + 0.1 * torch.randn(d, device=dev, generator=gen)).to(torch.bfloat16)
    w = torch.stack([qw, kw])
    rows = []
    for tokens in (int(x) for x in args.tokens.split(",")):
        sets = [
            (
                torch.randn(tokens, heads * d, device=dev, generator=gen).to(torch.bfloat16),
                torch.randint(0, table.shape[0], (tokens,), device=dev, generator=gen),
                torch.empty(tokens, heads * d, device=dev, dtype=torch.bfloat16),
            )
            for _ in range(args.sets)
        ]
        # the hand prologue agrees with fqr's kernel before anything is timed
        x, pos, out = sets[0]
        norm_rope_heads[(tokens, heads)](x, out, pos, table, w, spec.eps, nqk, d, num_warps=1)
        q, k, v = fqr.split_qkv_rmsnorm_rope(x, pos, table, qw, kw, **spec.head_kwargs())
        mine = out.view(tokens, heads, d)
        theirs = torch.cat([o.view(tokens, -1, d) for o in (q, k, v)], 1)
        ulps = (mine.view(torch.int16).int() - theirs.view(torch.int16).int()).abs().max().item()
        if ulps > 1:
            raise SystemExit(f"norm+rope by hand differs from fqr by {ulps} ULP at T = {tokens}")

        def rung(kernel, sets=sets, tokens=tokens):
            state = {"i": 0}

            def call():
                x, pos, out = sets[state["i"] % len(sets)]
                state["i"] += 1
                if kernel is empty:
                    empty[(tokens, heads)](x, num_warps=1)
                elif kernel == "fqr":
                    fqr.split_qkv_rmsnorm_rope(x, pos, table, qw, kw, **spec.head_kwargs())
                else:
                    kernel[(tokens, heads)](x, out, pos, table, w, spec.eps, nqk, d, num_warps=1)

            call()
            torch.cuda.synchronize()
            return statistics.median(
                1e3 * do_bench_cudagraph(call, rep=args.rep_ms, return_mode="median")
                for _ in range(3)
            )

        for name, kernel in (
            ("empty", empty),
            ("copy", copy_heads),
            ("gather", gather_heads),
            ("norm", norm_heads),
            ("norm+rope", norm_rope_heads),
            ("fqr", "fqr"),
        ):
            rows.append({"T": tokens, "rung": name, "us": rung(kernel), "max_ulp_vs_fqr": ulps})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "rows": rows}, f, indent=1)
    print(f"{'T':>5} {'rung':<10} {'device us':>10}")
    for r in rows:
        print(f"{r['T']:>5} {r['rung']:<10} {r['us']:>10.3f}")


if __name__ == "__main__":
    main()
