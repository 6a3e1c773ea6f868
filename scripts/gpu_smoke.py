"""GPU smoke + tuning sweep for the generated kernel (run on the device machine).

Checks the triton backend against the float64 formulation on a spread of presets/dtypes, then
times the fused kernel at large T for several launch configurations against a same-run
device-to-device copy of the same byte count. Prints a short table last.
"""

import json
import os
import sys

import torch
import triton

import fqr
from fqr.bench import traffic_bytes
from fqr.core import eval_program
from fqr.inputs import random_inputs
from fqr.lowering import lower
from fqr.numerics import compare
from fqr.prologue import preset_program


def inputs(p, T, dtype, bias=False):
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = random_inputs(p.spec, T, dtype, gen, p.cos_sin_cache().cuda(), bias=bias)
    return x.operands()


def check(name, tp, dtype, T, numerics="fused", bias=False):
    p = (
        fqr.get_preset(name, tp)
        if tp > 1 and fqr.get_preset(name).norm != "full"
        else fqr.get_preset(name)
    )
    prog = preset_program(p, dtype, numerics=numerics, bias=bias)
    args = inputs(p, T, dtype, bias)
    k = lower(prog, "cuda")
    outs = [
        torch.full((T, v.aval.shape[1]), float("nan"), dtype=dtype, device="cuda")
        for v in prog.outputs
    ]
    k(*args, out=outs)
    exact = eval_program(
        prog, [a.double().cpu() if a.is_floating_point() else a.cpu() for a in args], torch.float64
    )
    res = [
        compare(o, e, head_dim=p.head_dim, numerics=numerics, bitwise=(i == 2))
        for i, (o, e) in enumerate(zip(outs, exact))
    ]
    ok = all(r.passed for r in res)
    print(
        f"check {p.label:22s} {str(dtype)[6:]:9s} T={T:5d} {numerics:7s} bias={bias!s:5s} "
        f"ulp={[r.max_ulp for r in res]} rel={max(r.max_rel_head for r in res):.2e} "
        f"{'PASS' if ok else 'FAIL'}"
    )
    return ok


def bench(name, dtype, T, **opts):
    p = fqr.get_preset(name)
    prog = preset_program(p, dtype)
    args = inputs(p, T, dtype)
    k = lower(prog, "cuda", **opts)
    outs = [torch.empty((T, v.aval.shape[1]), dtype=dtype, device="cuda") for v in prog.outputs]
    ms = triton.testing.do_bench(
        lambda: k(*args, out=outs), warmup=50, rep=300, return_mode="median"
    )
    return ms, traffic_bytes(p.spec, dtype, T).total


def copy_ceiling(nbytes):
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * 2 / ms / 1e6  # GB/s (read + write)


if __name__ == "__main__":
    ok = True
    if "--checks" in sys.argv:
        for name in ["qwen3-8b", "qwen3.5-27b", "glm4-9b"]:
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                ok &= check(name, 1, dtype, 1037)
        ok &= check("qwen3-8b", 1, torch.bfloat16, 513, numerics="unfused")
        ok &= check("qwen3-8b", 1, torch.bfloat16, 513, bias=True)
    ceiling = copy_ceiling(2 * 65536 * 6144 * 2)
    rows = []
    shapes = [
        ("qwen3-8b", torch.bfloat16, 65536),
        ("qwen3-8b", torch.bfloat16, 4096),
        ("qwen3-8b", torch.bfloat16, 1024),
        ("qwen3-32b", torch.bfloat16, 65536),
        ("qwen3-235b-a22b", torch.bfloat16, 65536),
        ("gemma3-27b", torch.bfloat16, 65536),
        ("qwen3.5-27b", torch.bfloat16, 65536),
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
    for name, dtype, T in shapes:
        for opts in variants:
            ms, nbytes = bench(name, dtype, T, **opts)
            gbs = nbytes / ms / 1e6
            rows.append(
                (name, str(dtype)[6:], T, json.dumps(opts), ms * 1e3, gbs, 100 * gbs / ceiling)
            )
    print(f"copy ceiling {ceiling:.0f} GB/s")
    for r in rows:
        print(
            f"{r[0]:15s} {r[1]:8s} T={r[2]:6d} {r[3]:40s} {r[4]:8.1f} us {r[5]:6.0f} GB/s "
            f"{r[6]:5.1f}%"
        )
    print("ALL CHECKS", "PASS" if ok else "FAIL")
