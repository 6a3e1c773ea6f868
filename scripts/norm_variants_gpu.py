"""GPU run of issue 15's norm variants (Gemma 4's v norm, Llama 4's rope-then-L2 and NoPE
temperature): run on the device machine as

    PYTHONPATH=. python3 scripts/norm_variants_gpu.py

1. Checks: ``fqr verify --backend triton`` on the variants' golden cases, then
   ``pytest tests/gpu/test_gpu.py -k "(gemma4 or llama4) and 4099"`` (each preset, whole
   model and TP 8, at T = 4099: the public op on the CUDA kernel into NaN-poisoned memory,
   fused bf16/fp16 and unfused, against the float64 reference; ``pytest tests/gpu`` runs
   T = 1 and 257 too).
2. Timings: ``fqr bench`` of the four presets, bf16, T = 1,024 / 16,384 / 65,536, against the
   models' unfused eager chains and torch.compile of them, same run; JSON saved under $OUT.

Logs go under $OUT (default a temporary directory); the bench table is printed last. Without
CUDA the checks run on Triton's interpreter (``fqr verify --backend interpret``), the GPU tests
skip and the timings are skipped (it says so).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="fqr-norm-variants-"))
PRESETS = "gemma4-31b-sliding,gemma4-31b-full,llama4-scout,llama4-scout-nope"
CASES = ("gemma4-*", "llama4-*")
CUDA = torch.cuda.is_available()
START = time.perf_counter()


def run(name: str, args: list[str], env: dict | None = None) -> int:
    """Run ``args`` from the repo root, its output to $OUT/<name>.log; one status line."""
    start = time.perf_counter()
    log = OUT / f"{name}.log"
    with log.open("w") as f:
        rc = subprocess.run(
            args, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        ).returncode
    tail = log.read_text().strip().splitlines()[-1:] or [""]
    print(f"[{time.perf_counter() - start:6.1f}s] {name}: rc={rc} {tail[0][:150]}", flush=True)
    return rc


def _pythonpath() -> str:
    """The repo, and the import name of cli/ (fqr_cli) where it is not installed."""
    paths = [str(REPO)]
    try:
        import fqr_cli  # noqa: F401
    except ImportError:
        links = Path(tempfile.mkdtemp(prefix="fqr-path-"))
        (links / "fqr_cli").symlink_to(REPO / "cli")
        paths.append(str(links))
    return os.pathsep.join(paths)


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONPATH": _pythonpath()}
    backend = "triton" if CUDA else "interpret"
    fqr = [sys.executable, "-m", "fqr"]
    failed = 0
    for glob in CASES:
        failed += (
            run(f"verify-{glob[:-2]}", [*fqr, "verify", "--backend", backend, "--case", glob], env)
            != 0
        )
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"]
    # T = 4099 of each preset, whole model and TP 8 (the full T matrix: pytest tests/gpu)
    selected = "(gemma4 or llama4) and 4099"
    rc = run("pytest-gpu", [*pytest, "tests/gpu/test_gpu.py", "-k", selected], env)
    failed += rc not in (0, 5)  # 5: nothing collected
    if not CUDA:
        print("no CUDA device: the timings (fqr bench) are skipped")
        return int(failed > 0)
    saved = OUT / "bench_norm_variants.json"
    bench = [
        *fqr,
        "bench",
        "--preset",
        PRESETS,
        "--tokens",
        "1024,16384,65536",
        "--dtype",
        "bf16",
        "--compare",
        "eager,compile",
        "--save",
        str(saved),
    ]
    failed += run("bench", bench, env) != 0
    print(f"logs and {saved.name} under {OUT}; {time.perf_counter() - START:.0f} s in all")
    print((OUT / "bench.log").read_text())
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main())
