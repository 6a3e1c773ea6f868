"""Issue 13's drop-in paths on the GPU, in one run (about a minute on an H200). From the
repository root on the device machine:

    PYTHONPATH=. python3 scripts/gpu_dropin.py

1. checks: ``out=(q, k, v)`` on the triton backend (tests/gpu/test_out_buffers_gpu.py: real
   preset shapes, views of one wider NaN-poisoned buffer, against float64);
2. ``examples/hf_qwen3_compile.py --device cuda --dtype bf16``: a transformers Qwen3 (tiny
   config, 2 layers, 64 tokens) compiled with ``fqr.fusion.backend()``, sites fused and
   logits against eager;
3. ``examples/vllm_attention_layer.py --device cuda --dtype bf16``: the vLLM-style attention
   layer in its ``out=`` and ``inplace=True`` forms against float64 (triton backend), and the
   fusion pass in a vLLM-style post-grad pass manager;
4. ``fqr -v verify --backend triton --case 'qwen3-8b*'``: the goldens on the GPU, with
   the INFO log of each kernel lowered / compiled / taken from the cache.

Each step's output goes to ``$OUT/<step>.log`` (``$OUT`` default: a new temporary directory);
the table (step, exit code, seconds, last line) is printed last. Exit 0 when every step
passed. Without CUDA each step is reported as skipped and the exit code is 0 (nothing to run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 170  # the whole run stays under 3 minutes
PY = sys.executable
STEPS = [
    ("out-on-triton", [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                       "tests/gpu/test_out_buffers_gpu.py"]),
    ("hf-example", [PY, "examples/hf_qwen3_compile.py", "--device", "cuda", "--dtype", "bf16",
                    "--layers", "2", "--tokens", "64"]),
    ("vllm-example", [PY, "examples/vllm_attention_layer.py", "--device", "cuda", "--dtype",
                      "bf16", "--tokens", "64"]),
    ("verify-triton", [PY, "-m", "fqr", "-v", "verify", "--backend", "triton", "--case",
                       "qwen3-8b*"]),
]  # fmt: skip


def main() -> int:
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="fqr-dropin-"))
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    rows = []
    began = time.perf_counter()
    for name, cmd in STEPS:
        if not torch.cuda.is_available():
            rows.append((name, "-", "-", "skipped: no CUDA GPU visible to torch"))
            continue
        left = BUDGET_S - (time.perf_counter() - began)
        if left < 20:
            rows.append((name, "-", "-", f"skipped: the {BUDGET_S} s budget is spent"))
            continue
        start = time.perf_counter()
        try:
            r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=left)
            code, stdout, stderr = str(r.returncode), r.stdout, r.stderr
        except subprocess.TimeoutExpired as e:
            code, stdout, stderr = "timeout", str(e.stdout or ""), str(e.stderr or "")
        seconds = time.perf_counter() - start
        (out / f"{name}.log").write_text(f"$ {' '.join(cmd)}\n{stdout}\n--- stderr\n{stderr}")
        # the summary line: verify's is its last line on stderr, the others' on stdout
        summary = stderr if name.startswith("verify") else stdout
        lines = [ln for ln in summary.splitlines() if ln.strip()] or [""]
        rows.append((name, code, f"{seconds:.1f}", lines[-1].strip()[:110]))
    widths = [max(len(r[i]) for r in rows + [("step", "rc", "s", "")]) for i in range(3)]
    print(f"logs in {out}")
    print(f"{'step':<{widths[0]}}  {'rc':>{widths[1]}}  {'s':>{widths[2]}}  last line")
    for name, rc, s, tail in rows:
        print(f"{name:<{widths[0]}}  {rc:>{widths[1]}}  {s:>{widths[2]}}  {tail}")
    return 0 if all(rc in ("0", "-") for _, rc, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
