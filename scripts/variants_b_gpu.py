"""MiniMax-M3 on the GPU (issue 15, variants-b): checks first, then timings.

    PYTHONPATH=. python3 scripts/variants_b_gpu.py

1. the golden cases ``minimax-m3*`` on the triton backend (what ``fqr verify --backend triton
   --case 'minimax-m3*'`` runs);
2. every MiniMax-M3 preset at TP 1 and 8, T = 1, 257, 4099, against the float64 formulation,
   two calls each (the second through the bound launcher), through the variant registry (what
   ``pytest tests/gpu/test_gpu_variants.py`` runs, without needing pytest);
3. timings at the TP 8 view (one rank of an 8-GPU deployment) for T = 1 and 4096: the fused
   op, the model's eager chain (``Variant.eager``) and ``torch.compile(fullgraph=True)`` of it,
   CUDA-event medians.

Logs (JSON) under ``$OUT`` (default: a temporary directory); a table is printed last. Without
CUDA it runs the golden cases on the reference backend and says that the rest is skipped.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path

import torch

import fqr
from fqr.golden import CASES, load_case
from fqr.numerics import compare_kind
from fqr.prologue import variant_of

PRESETS = ("minimax-m3", "minimax-m3-fp8", "minimax-m3-kvcache", "minimax-m3-kvcache-fp8")
CHECK_TOKENS = (1, 257, 4099)
BENCH_TOKENS = (1, 4096)
TIME_BUDGET_S = 150  # timings stop starting new presets past this (the run stays under 3 min)
MAX_POSITION = 1 << 17


def golden_checks(backend: str) -> list[dict]:
    rows = []
    for spec in CASES:
        if not spec.name.startswith("minimax-m3"):
            continue
        case = load_case(spec.name)
        device = "cuda" if backend == "triton" else "cpu"
        outs = case.to(device).run(backend)
        results = case.check(*outs)
        rows.append(
            {
                "check": f"golden {spec.name}",
                "backend": backend,
                "passed": all(c.passed for c in results.values()),
                "max_ulp": max((c.max_ulp or 0) for c in results.values()),
            }
        )
    return rows


def preset_checks() -> list[dict]:
    rows = []
    for name in PRESETS:
        for tp in (1, 8):
            preset = fqr.get_preset(name, tp)
            variant = variant_of(preset)
            table = preset.cos_sin_cache(MAX_POSITION)
            for tokens in CHECK_TOKENS:
                gen = torch.Generator().manual_seed(tokens * 131 + tp)
                inputs = variant.draw(
                    preset, tokens, torch.bfloat16, gen, max_position=MAX_POSITION
                )
                expected = variant.expected(preset, inputs, table)
                on_gpu = {k: x.cuda() for k, x in inputs.items()}
                ok, worst = True, 0
                for _ in range(2):
                    outs = variant.run(preset, on_gpu, table.cuda(), backend="triton")
                    torch.cuda.synchronize()
                    for out_name, out in zip(variant.outputs, outs):
                        c = compare_kind(
                            variant.tolerance(out_name),
                            out,
                            expected[out_name],
                            head_dim=variant.head_dim(preset, out_name),
                        )
                        ok, worst = ok and c.passed, max(worst, c.max_ulp or 0)
                rows.append(
                    {
                        "check": f"{preset.label} T={tokens}",
                        "backend": "triton",
                        "passed": ok,
                        "max_ulp": worst,
                    }
                )
    return rows


def cuda_median_us(fn, reps: int = 100, warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def fused_call(variant, preset, inputs, table):
    """The public op on ``inputs``; the cache op straight on the drawn caches (in place, as a
    server calls it: ``Variant.run`` would time a copy of the caches too)."""
    if preset.variant != "kv-cache":
        return partial(variant.run, preset, inputs, table, backend="triton")
    kwargs = {k: v for k, v in preset.spec.kwargs().items() if k != "norm"}
    return partial(
        fqr.split_qkv_rmsnorm_rope_cache,
        *(inputs[n] for n in ("qkv", "positions")),
        table,
        *(inputs[n] for n in ("q_weight", "k_weight", "key_cache", "value_cache")),
        inputs["slot_mapping"],
        k_scale=inputs.get("k_scale"),
        v_scale=inputs.get("v_scale"),
        backend="triton",
        **kwargs,
    )


def timings(started: float) -> list[dict]:
    rows = []
    for name in PRESETS:
        if time.time() - started > TIME_BUDGET_S:
            rows.append({"preset": name, "skipped": f"past the {TIME_BUDGET_S} s budget"})
            continue
        preset = fqr.get_preset(name, 8)
        variant = variant_of(preset)
        table = preset.cos_sin_cache(MAX_POSITION).cuda()
        eager = variant.eager(preset, table, torch.bfloat16)
        compiled = torch.compile(eager, fullgraph=True, dynamic=True)
        for tokens in BENCH_TOKENS:
            gen = torch.Generator().manual_seed(tokens)
            inputs = variant.draw(preset, tokens, torch.bfloat16, gen, max_position=MAX_POSITION)
            on_gpu = {k: x.cuda() for k, x in inputs.items()}
            row = {"preset": preset.label, "tokens": tokens}
            for peer, fn in (
                ("fused", fused_call(variant, preset, on_gpu, table)),
                ("eager", partial(eager, on_gpu)),
                ("compile", partial(compiled, on_gpu)),
            ):
                try:
                    row[f"{peer}_us"] = round(cuda_median_us(fn), 2)
                except Exception as e:  # noqa: BLE001 -- a peer that fails is a row, not a stop
                    row[f"{peer}_us"] = None
                    row[f"{peer}_error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
    return rows


def main() -> int:
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="variants-b-"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    cuda = torch.cuda.is_available()
    checks, bench, errors = [], [], []
    for step in (
        (lambda: golden_checks("triton" if cuda else "reference")),
        (preset_checks if cuda else None),
        ((lambda: timings(started)) if cuda else None),
    ):
        if step is None:
            continue
        try:
            rows = step()
        except Exception:  # noqa: BLE001 -- log it, go on to the next step
            errors.append(traceback.format_exc())
            continue
        (bench if rows and "preset" in rows[0] else checks).extend(rows)
    log = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "seconds": round(time.time() - started, 1),
        "checks": checks,
        "timings": bench,
        "errors": errors,
    }
    (out / "variants_b_gpu.json").write_text(json.dumps(log, indent=1))
    for e in errors:
        print(e, file=sys.stderr)
    if not cuda:
        print("no CUDA: the golden cases ran on the reference backend; checks 2-3 skipped")
    failed = [c for c in checks if not c["passed"]]
    print(f"\nchecks: {len(checks) - len(failed)} pass, {len(failed)} fail ({log['device']})")
    for c in checks:
        print(
            f"  {'pass' if c['passed'] else 'FAIL'}  {c['check']:<44} {c['backend']:<9} "
            f"max ulp {c['max_ulp']}"
        )
    if bench:
        print(f"\n{'preset':<26} {'T':>5} {'fused us':>9} {'eager us':>9} {'compile us':>10}")
        for r in bench:
            if "skipped" in r:
                print(f"{r['preset']:<26} skipped: {r['skipped']}")
                continue
            print(
                f"{r['preset']:<26} {r['tokens']:>5} "
                + " ".join(
                    f"{r.get(k) if r.get(k) is not None else 'error':>{w}}"
                    for k, w in (("fused_us", 9), ("eager_us", 9), ("compile_us", 10))
                )
            )
    print(f"\nlog: {out / 'variants_b_gpu.json'}")
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
