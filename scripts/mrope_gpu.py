"""mRoPE + gate on the GPU (issue 15, variants-mrope): checks first, then timings.

Run on the device machine: ``PYTHONPATH=. python3 scripts/mrope_gpu.py`` (under 3 minutes on one
H200). Logs (and a JSON of every row) go to ``$OUT`` (default: a temporary directory).

1. checks (a failure exits 1 after the table):
   * every golden case of the mrope / mrope-gate variants through the ``triton`` backend (what
     ``fqr verify --backend triton`` runs for them);
   * qwen3-vl-8b and qwen3.5-27b at TP 1 and 8, bf16 and fp16, T = 1, 257, 4099, outputs from
     NaN-poisoned memory, against the float64 formulation (per-output tolerance kinds: v and the
     gate bit for bit);
   * text-only positions (``[T]`` and three equal planes) give the plain RoPE kernel's bits;
   * unfused numerics against the model's own eager chain on the GPU (reported: bit-equal or
     the largest difference; not a failure, the GPU may contract the chain's products);
2. timings (CUDA-graph replays, ``fqr.bench.CudaTimers.graph_us``): the fused op, the model's
   eager chain (``Variant.eager``) and ``torch.compile(fullgraph=True)`` of it, same run,
   T = 1, 16, 256, 4096, 16384, bf16.

Without CUDA it runs the checks it can on CPU (goldens on the reference backend) and says that
the timings were skipped.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch

import fqr
from fqr.golden import list_cases, load_case
from fqr.numerics import compare_kind
from fqr.prologue import variant_of

PRESETS = ("qwen3-vl-8b", "qwen3.5-27b")
TOKENS_CHECK = (1, 257, 4099)
TOKENS_TIME = (1, 16, 256, 4096, 16384)
OUT = os.environ.get("OUT") or tempfile.mkdtemp(prefix="mrope_gpu_")
LOG = open(os.path.join(OUT, "mrope_gpu.log"), "w")


def log(line: str) -> None:
    print(line, file=LOG, flush=True)
    print(line, file=sys.stderr, flush=True)


def poison(device) -> None:
    if device.type == "cuda":
        torch.full((256 << 20,), float("nan"), dtype=torch.float32, device=device)


def record(rows: list[dict], check: str, comparisons: dict, logged_as: str | None = None) -> None:
    """One check row (passed: every output's comparison passed) and its log line, the check
    (or ``logged_as``) with each output's ULP count."""
    ok = all(c.passed for c in comparisons.values())
    rows.append({"check": check, "passed": ok})
    log(
        f"{'PASS' if ok else 'FAIL'} {logged_as or check}: "
        + " ".join(f"{n}={c.max_ulp}ulp" for n, c in comparisons.items())
    )


def check_goldens(backend: str, device) -> list[dict]:
    rows = []
    for entry in list_cases():
        if entry["variant"] not in ("mrope", "mrope-gate"):
            continue
        case = load_case(entry).to(device)
        poison(device)
        outs = case.run(backend)
        record(
            rows,
            f"golden {entry['name']} [{backend}]",
            case.check(*(o.cpu() for o in outs)),
            logged_as=f"golden {entry['name']} {backend}",
        )
    return rows


def check_presets(device) -> list[dict]:
    rows = []
    for name in PRESETS:
        for tp in (1, 8):
            p = fqr.get_preset(name, tp)
            variant = variant_of(p)
            cache = p.cos_sin_cache(1 << 17)
            for dtype in (torch.bfloat16, torch.float16):
                for tokens in TOKENS_CHECK:
                    gen = torch.Generator().manual_seed(tokens + tp)
                    x = variant.draw(p, tokens, dtype, gen, max_position=1 << 17, bias=tp == 8)
                    exact = variant.expected(p, x, cache)
                    poison(device)
                    outs = variant.run(p, {k: t.to(device) for k, t in x.items()}, cache.to(device))
                    res = {
                        n: compare_kind(
                            variant.tolerance(n), o.cpu(), exact[n], head_dim=p.head_dim
                        )
                        for n, o in zip(variant.outputs, outs)
                    }
                    record(rows, f"float64 {p.label} {str(dtype)[6:]} T={tokens}", res)
    return rows


def check_text_and_unfused(device) -> list[dict]:
    rows = []
    for name in PRESETS:
        p = fqr.get_preset(name)
        variant = variant_of(p)
        cache = p.cos_sin_cache(1 << 17).to(device)
        for tokens in TOKENS_CHECK:
            gen = torch.Generator().manual_seed(7 * tokens)
            x = variant.draw(p, tokens, torch.bfloat16, gen, max_position=1 << 17)
            x = {k: t.to(device) for k, t in x.items()}
            text = x["positions"][0].contiguous()
            qkv = x["qkv"]
            if variant.output_gate:
                d, hq = p.head_dim, p.num_heads
                q = qkv[:, : 2 * hq * d].reshape(tokens, hq, 2, d)[:, :, 0].reshape(tokens, -1)
                qkv = torch.cat([q, qkv[:, 2 * hq * d :]], dim=1)
            plain = fqr.split_qkv_rmsnorm_rope(
                qkv, text, cache, x["q_weight"], x["k_weight"], **p.spec.kwargs()
            )
            same = True
            for positions in (text, text.expand(3, -1).contiguous()):
                outs = variant.run(p, dict(x, positions=positions), cache)
                same &= all(torch.equal(a, b) for a, b in zip(outs, plain))
            rows.append({"check": f"text-only == rope {name} T={tokens}", "passed": same})
            log(f"{'PASS' if same else 'FAIL'} text-only positions == rope {name} T={tokens}")
            eager = variant.eager(p, cache, torch.bfloat16)(x)
            unfused = variant.run(p, x, cache, numerics="unfused")
            diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(eager, unfused)]
            log(
                f"info unfused vs eager chain {name} T={tokens}: max |diff| per output {diffs}"
                f" ({'bit-equal' if max(diffs) == 0 else 'not bit-equal'})"
            )
    return rows


def timings(device) -> list[dict]:
    from fqr.bench import CudaTimers

    timers = CudaTimers()
    rows = []
    for name in PRESETS:
        p = fqr.get_preset(name)
        variant = variant_of(p)
        cache = p.cos_sin_cache(1 << 17).to(device)
        eager = variant.eager(p, cache, torch.bfloat16)
        compiled = torch.compile(eager, fullgraph=True, dynamic=True)
        for tokens in TOKENS_TIME:
            gen = torch.Generator().manual_seed(tokens)
            x = variant.draw(p, tokens, torch.bfloat16, gen, max_position=1 << 17)
            x = {k: t.to(device) for k, t in x.items()}
            calls = {
                "fused": lambda x=x, p=p, v=variant, c=cache: v.run(p, x, c),
                "eager": lambda x=x, f=eager: f(x),
                "compile": lambda x=x, f=compiled: f(x),
            }
            row = {"preset": name, "tokens": tokens}
            for peer, call in calls.items():
                for _ in range(3):
                    call()
                torch.cuda.synchronize()
                try:
                    row[peer] = timers.graph_us(call, rep_ms=60)
                except Exception as e:  # a peer that cannot be captured is reported, not fatal
                    row[peer] = None
                    log(f"{name} T={tokens} {peer}: not timed ({type(e).__name__}: {e})")
            rows.append(row)
            log(
                f"time {name} T={tokens}: "
                + " ".join(f"{k}={v:.2f}us" for k, v in row.items() if isinstance(v, float))
            )
    return rows


def main() -> int:
    start = time.time()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    log(f"OUT={OUT} device={torch.cuda.get_device_name() if cuda else 'cpu'}")
    checks = check_goldens("triton" if cuda else "reference", device)
    if cuda:
        checks += check_presets(device) + check_text_and_unfused(device)
        rows = timings(device)
    else:
        log(
            "no CUDA device: the kernel checks and the timings were skipped (goldens ran on "
            "the reference backend)"
        )
        rows = []
    json.dump({"checks": checks, "timings": rows}, open(os.path.join(OUT, "mrope_gpu.json"), "w"))
    failed = [c["check"] for c in checks if not c["passed"]]
    print(
        f"\nchecks: {len(checks) - len(failed)} pass, {len(failed)} fail"
        + "".join(f"\n  FAIL {f}" for f in failed)
    )
    if rows:
        print(
            f"\n{'preset':14s} {'T':>6s} {'fused us':>9s} {'eager us':>9s} {'compile us':>10s}"
            f" {'x eager':>8s} {'x compile':>9s}"
        )
        for r in rows:

            def f(v):
                return f"{v:.2f}" if v else "-"

            fu, ea, co = r.get("fused"), r.get("eager"), r.get("compile")
            print(
                f"{r['preset']:14s} {r['tokens']:6d} {f(fu):>9s} {f(ea):>9s} {f(co):>10s}"
                f" {f(ea / fu if fu and ea else None):>8s} {f(co / fu if fu and co else None):>9s}"
            )
    print(f"\n{time.time() - start:.0f} s, logs in {OUT}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
