"""The fusion pass inside real compiled models on the GPU, and the Ascend kernel under true
parallelism, in one run (issue 16). Run on the device machine from the repository root:

    PYTHONPATH=. python3 scripts/gpu_fusion.py [--layers 2] [--models hf-qwen3,vllm] [--quick]

1. checks: every golden case through the ``ascend-on-cuda`` backend (the ``ascend``-target
   kernel compiled by upstream Triton, 40 programs looping over token tiles);
2. for each model (``fqr.fusion.compiled.compare_compiled``): Hugging Face transformers'
   Qwen3 at Qwen3-8B's layer shapes and the vLLM-shaped attention stack (Qwen3-8B preset),
   random weights, compiled with and without ``fqr.fusion.backend()`` under CUDA graphs:
   prologues fused, numerics against the uncompiled model, forward latency for prefill
   T = 512, 2048, 4096, 16384 and decode-sized T = 1, 2, 4, 8, 16, and the profile split
   (device time of prologue kernels vs the rest, classified by what each kernel computes)
   at T = 8, 4096 and 16384, with the SDPA backend each side ran.

Logs, ``gpu_fusion.json`` (what docs/PERFORMANCE.md's tables are filled from) and the
tables as text and Markdown (``gpu_fusion_tables.{txt,md}``) go under ``$OUT`` (default
/tmp/out); the summary of the issue's targets, PASS/FAIL with the numbers, is printed last.
Without CUDA it says so and exits 2; ``--quick`` runs tiny shapes (a smoke run of the script
itself, also on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch


def text_table(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join(
        [title, line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]
    )


def markdown_table(title: str, header: list[str], rows: list[list[str]]) -> str:
    cells = lambda r: "| " + " | ".join(str(c).replace("|", "/") for c in r) + " |"  # noqa: E731
    return "\n".join(
        [f"**{title}**", "", cells(header), cells(["---"] * len(header))] + [cells(r) for r in rows]
    )


def ascend_on_cuda_goldens(log) -> tuple[list[str], list[list[str]], dict]:
    from fqr.golden import list_cases, load_case

    rows, failed = [], []
    start = time.perf_counter()
    for entry in list_cases():
        case = load_case(entry)
        try:
            q, k, v = case.to("cuda").run("ascend-on-cuda")
            checks = case.check(q.cpu(), k.cpu(), v.cpu())
            ok = all(c.passed for c in checks.values())
            detail = "" if ok else "; ".join(f"{n}: {c}" for n, c in checks.items() if not c.passed)
        except Exception as e:  # a case that raises fails; the row says why
            ok, detail = False, f"{type(e).__name__}: {e}"
        log(f"golden {entry['name']}: {'pass' if ok else 'FAIL ' + detail}")
        if not ok:
            failed.append([entry["name"], detail[:160]])
        rows.append(entry["name"])
    summary = {
        "cases": len(rows),
        "failed": len(failed),
        "seconds": time.perf_counter() - start,
    }
    table_rows = [[str(len(rows)), str(len(rows) - len(failed)), str(len(failed))]]
    return failed, table_rows, summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--models", default="hf-qwen3,vllm")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, short sweeps (smoke)")
    ap.add_argument("--skip-goldens", action="store_true", help="no ascend-on-cuda goldens")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT") or "/tmp/out")
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "gpu_fusion.log", "w")

    def log(msg: str) -> None:
        stamp = f"[{time.perf_counter() - t0:7.1f}s] {msg}"
        print(stamp, file=logf, flush=True)
        print(stamp, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        print("gpu_fusion: no CUDA GPU is visible to torch (use --quick for a CPU smoke run)")
        return 2
    import importlib.metadata as md

    import triton

    try:
        hf_version = md.version("transformers")
    except md.PackageNotFoundError:
        hf_version = "not installed"
    env = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": hf_version,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if cuda else "none",
    }
    log(f"environment: {env}")
    from fqr.fusion.compiled import compare_compiled, comparison_tables

    report: dict = {"environment": env, "models": {}}
    tables: list[str] = []
    markdown: list[str] = []  # the same tables for docs/PERFORMANCE.md
    summary: list[list[str]] = []  # model, target, PASS/FAIL, numbers: printed last
    ok = True

    if cuda and not args.skip_goldens:
        failed, rows, summary = ascend_on_cuda_goldens(log)
        report["ascend_on_cuda_goldens"] = dict(summary, failures=failed)
        tables.append(
            text_table(
                "ascend-on-cuda: golden cases (ascend-target kernel, upstream Triton, 40 programs)",
                ["cases", "pass", "fail"],
                rows,
            )
        )
        if failed:
            ok = False
            tables.append(text_table("ascend-on-cuda failures", ["case", "detail"], failed))

    sweep = dict(
        prefill=(512, 2048, 4096, 16384),
        decode=(1, 2, 4, 8, 16),
        profile_tokens=(8, 4096, 16384),
        check_tokens=512,
    )
    if args.quick:
        sweep = dict(
            prefill=(64,), decode=(1, 4), profile_tokens=(4, 64) if cuda else (), check_tokens=32
        )
    for model in args.models.split(","):
        log(f"--- {model}")
        try:
            result = compare_compiled(
                model,
                layers=args.layers,
                device="cuda" if cuda else "cpu",
                tiny=args.quick,
                log=log,
                **sweep,
            )
        except Exception:
            log(traceback.format_exc())
            report["models"][model] = {"error": traceback.format_exc()}
            tables.append(f"{model}: ERROR (see gpu_fusion.log)")
            ok = False
            continue
        report["models"][model] = result.to_dict()
        ok = ok and result.passed
        for t in result.targets():
            verdict = "n/a" if t["passed"] is None else "PASS" if t["passed"] else "FAIL"
            summary.append([model, t["target"], verdict, t["detail"]])
        for title, header, rows in comparison_tables(result):
            tables.append(text_table(title, header, rows))
            markdown.append(markdown_table(title, header, rows))
        (out / "gpu_fusion.json").write_text(json.dumps(report, indent=1))

    report["seconds"] = time.perf_counter() - t0
    (out / "gpu_fusion.json").write_text(json.dumps(report, indent=1))
    log(f"done in {report['seconds']:.0f} s; JSON: {out / 'gpu_fusion.json'}")
    if "ascend_on_cuda_goldens" in report:
        g = report["ascend_on_cuda_goldens"]
        passed = g["failed"] == 0
        detail = f"{g['cases'] - g['failed']} / {g['cases']} golden cases"
        summary.insert(
            0, ["ascend-on-cuda", "every golden case", "PASS" if passed else "FAIL", detail]
        )
    tables.append(
        text_table("summary: issue 16 targets", ["model", "target", "result", "numbers"], summary)
    )
    markdown.append(
        markdown_table(
            "summary: issue 16 targets", ["model", "target", "result", "numbers"], summary
        )
    )
    text = "\n\n".join(tables)
    (out / "gpu_fusion_tables.txt").write_text(text + "\n")
    (out / "gpu_fusion_tables.md").write_text("\n\n".join(markdown) + "\n")
    print("\n" + text)
    print(
        f"\ngpu_fusion: checks {'ok' if ok else 'FAILED'} (goldens, prologues fused, numerics); "
        f"targets {sum(r[2] == 'PASS' for r in summary)} PASS, "
        f"{sum(r[2] == 'FAIL' for r in summary)} FAIL; in {report['seconds']:.0f} s"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
