"""Issue 24.2 on the GPU: does programmatic dependent launch (``pdl=True``: Triton's
``launch_pdl`` and ``gdc_wait`` before the first load) make fqr's prologue cheaper right after
the QKV projection GEMM, and is it still right?

Per preset and token count, the preset's projection GEMM (``[T, K] @ [K, W]`` into the op's
first input, ``K`` = :meth:`fqr.prologue.Variant.projection_in_features`) followed by fqr's
generated kernel, once as fqr launches it today and once with ``pdl=True``; both in one
CUDA graph (``triton.testing.do_bench_cudagraph``, median). Inputs do not rotate: both
columns share that. The outputs of the two kernels are compared bit for bit.

    PYTHONPATH=. python3 scripts/pdl_probe.py [preset ...]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from fqr.lowering import lower_by_tokens
from fqr.presets import get_preset
from fqr.prologue import variant_of

OUT = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="fqr-pdl-"))
TOKENS = (1, 16, 128, 1024, 4096, 16384, 65536)


def probe(name: str) -> list[list]:
    from triton.testing import do_bench_cudagraph

    preset = get_preset(name)
    variant = variant_of(preset)
    dtype = torch.bfloat16
    cache = preset.cos_sin_cache(min(preset.max_position, 1 << 18)).cuda()
    program = variant.program(preset, dtype)
    plain, pdl = lower_by_tokens(program, "cuda"), lower_by_tokens(program, "cuda", pdl=True)
    k = variant.projection_in_features(preset)
    rows = []
    for tokens in TOKENS:
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        inputs = variant.draw(preset, tokens, dtype, gen, max_position=cache.shape[0])
        args = variant.program_args(preset, inputs, cache)
        width = args[0].shape[1]
        hidden = torch.randn(tokens, k, device="cuda", dtype=dtype, generator=gen)
        weight = torch.randn(k, width, device="cuda", dtype=dtype, generator=gen) * k**-0.5

        def gemm(hidden=hidden, weight=weight, args=args):
            torch.mm(hidden, weight, out=args[0])

        def run(kernels, gemm=gemm, args=args):
            gemm()
            return kernels.launch(args)

        same = all(
            torch.equal(a, b)
            for a, b in zip(
                [x.clone() for x in run(plain)], [x.clone() for x in run(pdl)], strict=True
            )
        )
        times = [
            1e3 * do_bench_cudagraph(f, rep=20, return_mode="median")
            for f in (gemm, lambda: run(plain), lambda: run(pdl))
        ]
        g, a, b = times
        rows.append([name, tokens, round(g, 2), round(a - g, 2), round(b - g, 2), same])
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("pdl_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    names = sys.argv[1:] or ["qwen3-8b", "qwen3.5-27b", "deepseek-v3-q-rope"]
    header = ["preset", "T", "GEMM us", "after GEMM us", "after GEMM us (pdl)", "same bits"]
    rows = [r for n in names for r in probe(n)]
    (OUT / "pdl_probe.json").write_text(json.dumps({"header": header, "rows": rows}))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for line in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths)))
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
