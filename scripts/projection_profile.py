"""The projected kernel and the pair it replaces, launched for Nsight Compute (issue 40).

For each preset and TP at T tokens (bf16, random weights, the preset's real table): the fused
projected op (``fqr.<op>_proj``, its public schedule, or the lowering options given with
``--options``), then cuBLAS's GEMM into the packed row and fqr's prologue op on it. Each is
launched twice inside an NVTX range named ``profile``, so that::

    ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight ... \
        python3 scripts/projection_profile.py --preset qwen3-8b --tp 8 --tokens 1

counts only those launches (not the inputs' random fill). Without ncu it prints each launch's
device µs (CUDA events, warm caches: a sanity figure, not a benchmark).
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from fqr.bench.projection import lowering_options, projected_call
from fqr.lowering import lower


def launches(preset_name: str, tp: int, tokens: int, options: dict) -> dict:
    """``{name: launch}``: the fused projected kernel, cuBLAS's GEMM into the packed row, fqr's
    prologue op on that row; each loaded and run once here."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    proj, rest, hidden, width, inputs, values, variant, preset, table = projected_call(
        preset_name, tp, tokens, dtype, device, gen
    )
    x = torch.randn(tokens, hidden, generator=gen, device=device, dtype=dtype)
    w = torch.randn(width, hidden, generator=gen, device=device, dtype=dtype) * hidden**-0.5
    given = dict(rest, x=x, w_qkv=w, backend="triton")
    options = lowering_options(options, hidden)
    if options:
        call = proj.bound(proj.bind((), given))
        proj.validate(call)
        kernel, operands = lower(proj.program(call), "cuda", **options), proj.operands(call)
        fused = functools.partial(kernel.launch, operands)
    else:
        fused = functools.partial(proj.function, **given)
    row = torch.empty(tokens, width, device=device, dtype=dtype)
    base = variant.declaration
    base_args = {k: v for k, v in values.items() if k in base.index}
    base_args.update(qkv=row, backend="triton")
    calls = {
        "fused": fused,
        "gemm": functools.partial(torch.mm, x, w.T, out=row),
        "op": functools.partial(base.function, **base_args),
    }
    for fn in calls.values():
        fn()
    torch.cuda.synchronize()
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-8b")
    parser.add_argument("--tp", default="8", help="comma-separated TP sizes")
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--options", default="{}", help="JSON lowering options of the fused kernel")
    args = parser.parse_args()
    for tp in (int(t) for t in args.tp.split(",")):
        for name, fn in launches(args.preset, tp, args.tokens, json.loads(args.options)).items():
            for _ in range(2):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                torch.cuda.nvtx.range_push("profile")
                start.record()
                fn()
                end.record()
                torch.cuda.nvtx.range_pop()
                torch.cuda.synchronize()
                us = start.elapsed_time(end) * 1e3
                print(f"{args.preset} TP{tp} T={args.tokens} {name}: {us:.1f} us")


if __name__ == "__main__":
    main()
