"""GPU smoke + tuning sweep for the generated kernel (run on the device machine).

Checks the compiled kernel (NaN-poisoned outputs) against the float64 formulation on a spread of
presets and dtypes (``--checks``), then times it at large T for several launch options against
a same-run device-to-device copy (``fqr.bench``'s timers and traffic model). Prints a short
table last. ``SHAPES=qwen3-8b:bfloat16:65536,...`` and ``VARIANTS='{"num_warps": 4};{}'``
override the sweep.
"""

import json
import os
import sys

import torch

import fqr
from fqr import reference
from fqr.bench import CudaTimers, traffic_bytes
from fqr.inputs import random_inputs
from fqr.lowering import lower
from fqr.numerics import compare
from fqr.prologue import program_of


def inputs(p, tokens, dtype, bias=False):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    return random_inputs(p.spec, tokens, dtype, gen, p.cos_sin_cache().cuda(), bias=bias)


def check(name, tp, dtype, tokens, numerics="fused", bias=False):
    p = fqr.get_preset(name, tp if fqr.get_preset(name).norm != "full" else 1)
    prog = program_of(p, dtype, numerics=numerics, bias=bias)
    x = inputs(p, tokens, dtype, bias)
    outs = [
        torch.full((tokens, v.aval.shape[1]), float("nan"), dtype=dtype, device="cuda")
        for v in prog.outputs
    ]
    lower(prog, "cuda")(*x.operands(), out=outs)
    exact = reference.prologue(*x.args(), **x.kwargs())
    res = [
        compare(o, e, head_dim=p.head_dim, numerics=numerics, bitwise=(i == 2))
        for i, (o, e) in enumerate(zip(outs, exact))
    ]
    ok = all(r.passed for r in res)
    print(
        f"check {p.label:22s} {str(dtype)[6:]:9s} T={tokens:5d} {numerics:7s} bias={bias!s:5s} "
        f"ulp={[r.max_ulp for r in res]} rel={max(r.max_rel_head for r in res):.2e} "
        f"{'PASS' if ok else 'FAIL'}"
    )
    return ok


def bench(timers, name, dtype, tokens, **opts):
    p = fqr.get_preset(name)
    prog = program_of(p, dtype)
    operands = inputs(p, tokens, dtype).operands()
    kernel = lower(prog, "cuda", **opts)
    outs = [
        torch.empty((tokens, v.aval.shape[1]), dtype=dtype, device="cuda") for v in prog.outputs
    ]
    us = timers.kernel_us(lambda: kernel(*operands, out=outs), warmup_ms=50, rep_ms=300)
    return us, traffic_bytes(p.spec, dtype, tokens).total


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("gpu_smoke.py needs a CUDA GPU (checks and timings run the compiled kernel)")
    ok = True
    if "--checks" in sys.argv:
        for name in ["qwen3-8b", "gemma3-1b", "glm4-9b"]:
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                ok &= check(name, 1, dtype, 1037)
        ok &= check("qwen3-8b", 1, torch.bfloat16, 513, numerics="unfused")
        ok &= check("qwen3-8b", 1, torch.bfloat16, 513, bias=True)
    timers = CudaTimers()
    ceiling = timers.copy_ceiling()["gbps"]
    rows = []
    shapes = [
        ("qwen3-8b", torch.bfloat16, 65536),
        ("qwen3-8b", torch.bfloat16, 4096),
        ("qwen3-8b", torch.bfloat16, 1024),
        ("qwen3-32b", torch.bfloat16, 65536),
        ("qwen3-235b-a22b", torch.bfloat16, 65536),
        ("gemma3-27b", torch.bfloat16, 65536),
        ("gemma3-1b", torch.bfloat16, 65536),
        ("qwen3-0.6b", torch.bfloat16, 65536),
        ("qwen3-8b", torch.float32, 65536),
    ]
    if os.environ.get("SHAPES"):
        shapes = [
            (n, getattr(torch, d), int(t))
            for n, d, t in (x.split(":") for x in os.environ["SHAPES"].split(","))
        ]
    variants = [json.loads(v) for v in os.environ.get("VARIANTS", "").split(";") if v] or [
        dict(),
        dict(tile_elems=2048),
        dict(tile_elems=8192),
        dict(num_warps=8),
        dict(tile_elems=2048, num_warps=2),
        dict(block_t=2),
        dict(tile_elems=2048, block_t=2),
    ]
    for name, dtype, tokens in shapes:
        for opts in variants:
            us, nbytes = bench(timers, name, dtype, tokens, **opts)
            gbs = nbytes / us / 1e3
            rows.append(
                (name, str(dtype)[6:], tokens, json.dumps(opts), us, gbs, 100 * gbs / ceiling)
            )
    print(f"copy ceiling {ceiling:.0f} GB/s")
    for r in rows:
        print(
            f"{r[0]:15s} {r[1]:8s} T={r[2]:6d} {r[3]:40s} {r[4]:8.1f} us {r[5]:6.0f} GB/s "
            f"{r[6]:5.1f}%"
        )
    print("ALL CHECKS", "PASS" if ok else "FAIL")
