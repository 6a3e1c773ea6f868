"""Issue 12 on the GPU in under two minutes: the dispatch table (host µs per call of the public
op, ``torch.ops.fqr``, ``F.rms_norm`` and a bare Triton launch at T = 1, 16, 1024) and device /
wall % of the copy ceiling at 1,024 / 16,384 / 65,536 tokens for Qwen3-8B and GLM-4-9B (bf16),
from one ``fqr bench`` run (:func:`fqr.bench.run_bench`, the same method as the command).

    PYTHONPATH=. python3 scripts/launch_floor_gpu.py          # on the device machine

Kernels are compiled first in parallel processes (Triton's disk cache), so the run measures.
Writes ``$OUT/launch-floor.json`` (an ``fqr-bench/1`` document) when ``$OUT`` is set; prints
the tables, then one line per target.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch

PRESETS = ("qwen3-8b", "glm4-9b")
TOKENS = (1024, 16384, 65536)
# One T per kernel variant (fqr.lowering.targets.TOKEN_BUCKETS): decode, middle, large.
BUCKET_TOKENS = (1, 300, 9000)


def _warm(job: tuple[str, str, dict]) -> str | None:
    """Compile one preset's kernel variants (one launch per token bucket) in this process."""
    name, dtype_name, options = job
    try:
        from fqr.core import dtype_of
        from fqr.inputs import random_inputs
        from fqr.lowering import lower_by_tokens
        from fqr.presets import get_preset
        from fqr.prologue import program_of

        preset, dtype = get_preset(name), dtype_of(dtype_name)
        variants = lower_by_tokens(program_of(preset, dtype), "cuda", **options)
        cache = preset.cos_sin_cache().cuda()
        g = torch.Generator("cuda").manual_seed(0)
        for tokens in BUCKET_TOKENS:
            variants.launch(random_inputs(preset.spec, tokens, dtype, g, cache).operands())
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001  (reported, the run goes on)
        return f"{name} {dtype_name} {options}: {type(e).__name__}: {str(e)[:300]}"


def warm(jobs: list[tuple[str, str, dict]], workers: int = 15) -> list[str]:
    """Compile every job's kernels in ``workers`` processes; the errors, one line each."""
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=spawn) as pool:
        return [e for e in pool.map(_warm, jobs) if e]


def print_report(table) -> None:
    """A :class:`fqr.bench.report.ReportTable` as plain aligned text."""
    rows = [[c for c, _ in table.columns], *table.rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"\n{table.title}")
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    print(table.caption)


def main() -> int:
    from fqr import bench
    from fqr.bench.report import dispatch_table, results_table
    from fqr.presets import get_preset

    start = time.time()
    errors = warm([(name, "bf16", {}) for name in PRESETS])
    for e in errors:
        print("compile failed:", e, file=sys.stderr)
    print(f"compiled in {time.time() - start:.0f}s", file=sys.stderr)
    cfg = bench.BenchConfig(
        presets=[get_preset(n) for n in PRESETS],
        tokens=list(TOKENS),
        dtypes=[torch.bfloat16],
        compare=[],
        rep_ms=25.0,
        warmup_ms=5.0,
    )
    doc = bench.run_bench(cfg, progress=lambda text: print(text, file=sys.stderr, flush=True))
    if os.environ.get("OUT"):
        bench.save_document(doc, os.path.join(os.environ["OUT"], "launch-floor.json"))
    print_report(results_table(doc))
    dispatch = dispatch_table(doc)
    if dispatch is not None:
        print_report(dispatch)
    print()
    for row in doc["rows"]:
        r = row["impls"]["fqr"]
        if "device_pct" not in r:
            print(f"{row['preset']:9s} T={row['tokens']:6d}: {r.get('error', 'no measurement')}")
            continue
        print(
            f"{row['preset']:9s} T={row['tokens']:6d}: device {r['device_pct']:.1f}% "
            f"wall {r['wall_pct']:.1f}% of {doc['ceiling']['gbps']:.0f} GB/s"
        )
    for d in doc.get("dispatch", []):
        x = d["x_rms_norm"]
        print(
            f"{d['preset']:9s} T={d['tokens']:5d}: public op {x['public op']:.2f}x F.rms_norm "
            f"(target 1.5), torch.ops.fqr {x['torch.ops.fqr']:.2f}x (target 2.0)"
        )
    print(f"done in {time.time() - start:.0f}s, numerics {'passed' if doc['passed'] else 'FAILED'}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
