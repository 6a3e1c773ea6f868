"""Cold start: the time from a fresh process to its first result, JIT against a kernel bundle.

A serving process pays, before its first prologue returns, the interpreter and imports, CUDA's
start, the inputs, and the first call of each kernel: lowering, and either Triton's compile
(JIT) or loading the compiled kernel (:mod:`fqr.lowering.bundle`). :func:`measure_cold_start`
starts fresh Python processes that each make one call of a preset's public op and wait for its
result, each with an empty kernel cache and an empty Triton cache of its own, so nothing
compiled by an earlier run is found:

``jit``     no bundle: every kernel the call needs is compiled in the process;
``bundle``  ``FQR_KERNEL_BUNDLE`` set: the kernels are loaded, none compiled.

Triton's own runtime pieces (its CUDA utilities, which it builds with the host's C compiler the
first time it runs on a machine) come from an untimed call before: each process starts with a
copy of a Triton cache that holds them and no fqr kernel, and the bytecode of the modules the
call imports is cached as on an installed machine (:func:`_bytecode_env`). Each mode runs
``repeats`` times, alternating; the medians of two wall-clock spans are kept:
``to_first_result`` from just before the process is spawned to the first result on the host
(``torch.cuda.synchronize`` after the call), and ``first_call`` the call alone (the inputs
are on the GPU and synchronised before it starts). The child also reports how many kernels
were loaded from the bundle (:data:`fqr.lowering.bundle.STATS`); the fqr kernels Triton compiled
are counted in its cache after the process ends.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("jit", "bundle")

# The parts of a first call (:data:`_CHILD` times each; ``fqr_s`` is everything after the CUDA
# context exists: lowering, bundle open and checks, module load, launch).
PARTS = {
    "import_s": "import: the interpreter, torch, fqr and Triton, from the spawn",
    "cuda_context_s": "CUDA context: torch's (an allocation, synchronised) and Triton's driver",
    "lower_s": "lowering: the kernel's source generated, cached and made a Triton function",
    "bundle_s": "bundle open and checks: its directory, files, sha256s (loading only)",
    "module_load_s": "module load: the compiled kernel read, its module and launcher loaded",
    "launch_s": "launch: the rest (the program traced, the call checked, Triton's first run)",
    "fqr_s": "fqr's part: everything after the CUDA context exists, to the result",
}

# Runs in the fresh process: argv = preset, TP, tokens; the spawn time in FQR_COLD_START_T0.
# Each part's functions are wrapped with a timer (nested calls counted once).
_CHILD = r"""
import json, os, sys, time
import torch
import triton, triton.compiler.compiler as triton_compiler
import fqr.lowering as lowering
import fqr.lowering.bundle as bundle
from fqr.lowering.bundle import STATS
from fqr.presets import get_preset
from fqr.prologue import variant_of
imported = time.time()

spent, depth = {}, {}
def timed(part, owner, name, static=False):
    raw = owner.__dict__[name]
    fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    def wrapper(*args, **kwargs):
        depth[part] = depth.get(part, 0) + 1
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            depth[part] -= 1
            if not depth[part]:
                spent[part] = spent.get(part, 0.0) + time.perf_counter() - start
    setattr(owner, name, classmethod(wrapper) if isinstance(raw, classmethod) else wrapper)
timed("lower_s", lowering, "_build")
timed("bundle_s", bundle, "use_kernel_bundle")
timed("bundle_s", bundle.KernelBundle, "open")
timed("bundle_s", bundle.KernelBundle, "metadata_group")
timed("module_load_s", triton_compiler.CompiledKernel, "__init__")
timed("module_load_s", triton_compiler.CompiledKernel, "_init_handles")

torch.zeros(1, device="cuda")
torch.cuda.synchronize()
from triton.runtime import driver
driver.active.get_current_device()
driver.active.utils  # Triton's CUDA utilities, loaded once per process
context = time.time()

preset = get_preset(sys.argv[1], int(sys.argv[2]))
tokens = int(sys.argv[3])
variant = variant_of(preset)
gen = torch.Generator(device="cuda").manual_seed(0)
inputs = variant.draw(preset, tokens, torch.bfloat16, gen, max_position=preset.max_position)
table = preset.cos_sin_cache(preset.max_position).cuda()
torch.cuda.synchronize()
ready = time.time()
variant.run_in_place(preset, inputs, table, backend="triton")
torch.cuda.synchronize()
done = time.time()
parts = {k: spent.get(k, 0.0) for k in ("lower_s", "bundle_s", "module_load_s")}
parts["launch_s"] = (done - ready) - sum(parts.values())
print(json.dumps({
    "to_first_result_s": done - float(os.environ["FQR_COLD_START_T0"]),
    "first_call_s": done - ready,
    "import_s": imported - float(os.environ["FQR_COLD_START_T0"]),
    "cuda_context_s": context - imported,
    **parts,
    "fqr_s": done - ready,
    "loaded": STATS.loaded,
}))
"""


def _run_child(
    preset: str,
    tp: int,
    tokens: int,
    bundle: str | None,
    triton_runtime: Path | None,
    pycache: Path | None = None,
) -> dict:
    """One fresh process; ``triton_runtime``: a Triton cache holding only Triton's own
    compiled runtime pieces, copied in first (a machine that ran Triton before has them);
    ``pycache``: the bytecode cache the processes share (:func:`_bytecode_env`)."""
    with tempfile.TemporaryDirectory(prefix="fqr-cold-") as scratch:
        kernels, triton_cache = Path(scratch, "kernels"), Path(scratch, "triton")
        kernels.mkdir(mode=0o700)
        if triton_runtime is None:
            triton_cache.mkdir(mode=0o700)
        else:
            shutil.copytree(triton_runtime, triton_cache)
        env = dict(os.environ) | _bytecode_env(pycache)
        env.pop("FQR_KERNEL_BUNDLE", None)
        env |= {"FQR_CACHE_DIR": str(kernels), "TRITON_CACHE_DIR": str(triton_cache)}
        if bundle is not None:
            env["FQR_KERNEL_BUNDLE"] = bundle
        result = _spawn(preset, tp, tokens, env, "cold-start child")
        # what Triton compiled in the process: fqr's kernels among its cache's binaries
        compiled = len(list(triton_cache.rglob("fqr_*.cubin")))
    return {**result, "compiled": compiled}


def _spawn(preset: str, tp: int, tokens: int, env: dict[str, str], what: str) -> dict:
    """Run :data:`_CHILD` in a fresh process with ``env`` (its spawn time added); its report."""
    env = {**env, "FQR_COLD_START_T0": repr(time.time())}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, preset, str(tp), str(tokens)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode:
        raise RuntimeError(f"{what} ({preset}) failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _bytecode_env(pycache: Path | None) -> dict[str, str]:
    """Python's bytecode cache for the measured processes: the caller's
    ``PYTHONPYCACHEPREFIX`` if set, else ``pycache``, which the untimed warm-up fills. An
    installed package has its bytecode; where site-packages is read-only and shipped without
    it (the GPU image), every fresh process would compile Triton's sources again (117 ms of a
    first call went to compiling the modules Triton imports on its first launch)."""
    if "PYTHONPYCACHEPREFIX" in os.environ or pycache is None:
        return {}
    return {"PYTHONPYCACHEPREFIX": str(pycache)}


def _triton_runtime(preset: str, tp: int, tokens: int, bundle: str, scratch: Path) -> Path:
    """A Triton cache with Triton's runtime pieces (its CUDA utilities, built with the host's C
    compiler on first use) and no fqr kernel: what an untimed call from the bundle leaves; the
    bytecode of every module the call imports goes to ``scratch / "pycache"``."""
    runtime = scratch / "triton"
    env = dict(os.environ, TRITON_CACHE_DIR=str(runtime), FQR_KERNEL_BUNDLE=bundle)
    env |= _bytecode_env(scratch / "pycache")
    # the warm-up writes the bytecode the measured processes read (an image that sets
    # PYTHONDONTWRITEBYTECODE would otherwise leave the shared cache empty)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["FQR_CACHE_DIR"] = str(scratch / "kernels")
    runtime.mkdir(mode=0o700)
    (scratch / "kernels").mkdir(mode=0o700)
    _spawn(preset, tp, tokens, env, "cold-start warm-up")
    compiled = sorted(p.name for p in runtime.rglob("fqr_*.cubin"))
    if compiled:
        raise RuntimeError(f"the bundle {bundle} lacks {preset}'s kernels {compiled}")
    return runtime


def measure_cold_start(
    preset: str, bundle: str, *, tp: int = 1, tokens: int = 1, repeats: int = 3
) -> dict:
    """Median spans of ``repeats`` fresh processes per mode (:data:`MODES`), alternating, for
    one call of ``preset`` (TP ``tp``) with ``tokens`` tokens; ``bundle`` holds its kernels
    (``fqr build --preset PRESET``)."""
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="fqr-cold-runtime-") as scratch:
        runtime = _triton_runtime(preset, tp, tokens, bundle, Path(scratch))
        for _ in range(repeats):
            for mode in MODES:
                chosen = bundle if mode == "bundle" else None
                pycache = Path(scratch, "pycache")
                runs[mode].append(_run_child(preset, tp, tokens, chosen, runtime, pycache))
    rows = {}
    for mode, results in runs.items():
        rows[mode] = {
            "to_first_result_s": statistics.median(r["to_first_result_s"] for r in results),
            "first_call_s": statistics.median(r["first_call_s"] for r in results),
            **{part: statistics.median(r[part] for r in results) for part in PARTS},
            "loaded": max(r["loaded"] for r in results),
            "compiled": max(r["compiled"] for r in results),
            "runs": results,
        }
    return {"preset": preset, "tp": tp, "tokens": tokens, "repeats": repeats, "modes": rows}


def cold_start_table(rows: list[dict]) -> Any:
    """The rich table of :func:`measure_cold_start`'s rows: each mode's spans and the parts of
    its first call (:data:`PARTS`, milliseconds), fqr's own part last."""
    from rich.table import Table

    table = Table(
        title="cold start: a fresh process to its first result (medians; wall s, parts ms)"
    )
    columns = [
        *("preset", "T", "mode", "to first result", "import", "CUDA context", "lowering"),
        *("bundle open+checks", "module load", "launch", "fqr's part", "compiled", "loaded"),
    ]
    for column in columns:
        table.add_column(column, justify="left" if column in ("preset", "mode") else "right")
    for row in rows:
        for mode, m in row["modes"].items():
            ms = [f"{1000 * m[p]:.0f}" for p in PARTS]
            table.add_row(
                row["preset"], str(row["tokens"]), mode, f"{m['to_first_result_s']:.2f}", *ms,
                str(m["compiled"]), str(m["loaded"]),
            )  # fmt: skip
    return table
