"""The cuda target's kernels compiled for sm_90 without a GPU: Triton's own compiler (TTIR ->
TTGIR -> LLVM -> PTX -> cubin with its bundled ptxas), in a process of its own, since the test
process may run Triton interpreted (``TRITON_INTERPRET=1``, for good once triton is imported).

:func:`run_compiling` runs a script there (skipping the test where this Triton cannot compile
for CUDA); the script calls :func:`compile_for_sm90` on a lowered kernel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


def compile_for_sm90(kernel, tokens: int = 1024):
    """``kernel`` (``fqr.lowering.lower(..., "cuda")``) compiled for sm_90 with its own launch
    options (``enable_fp_fusion`` among them), as a launch with ``tokens`` tokens would."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fqr.lowering.ascend_compile import kernel_signature, launch_arguments

    args, kwargs, _ = launch_arguments(kernel, tokens)
    signature, constants = kernel_signature(kernel.fn, args, kwargs)
    signature = {k: v for k, v in signature.items() if v != "constexpr"}
    constexprs = {(kernel.fn.arg_names.index(k),): v for k, v in constants.items()}
    source = ASTSource(kernel.fn, signature, constexprs=constexprs)
    options = {k: v for k, v in kernel._launch.items() if k != "launch_pdl"}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def run_compiling(script: str, cache_dir: Path) -> str:
    """Run ``script`` (Python, with ``tests/`` importable) in a compiling process; its stdout.
    Skips the test where upstream Triton's nvidia backend is missing or cannot compile here,
    or ``FQR_SKIP_CUDA_COMPILE=1``."""
    if os.environ.get("FQR_SKIP_CUDA_COMPILE") == "1":
        pytest.skip("FQR_SKIP_CUDA_COMPILE=1")
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "FQR_CACHE_DIR": str(cache_dir)}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS), env.get("PYTHONPATH", "")])
    r = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    if r.returncode and "cuda" in r.stderr.lower() and "driver" in r.stderr.lower():
        pytest.skip(f"upstream triton cannot compile for cuda here: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout
