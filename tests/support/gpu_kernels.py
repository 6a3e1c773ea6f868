"""The GPU suite's kernels: built ahead of time on a CPU machine, loaded on the GPU (a pytest
plugin, loaded by ``tests/conftest.py``; not a ``tests/gpu/conftest.py``, whose module name
``conftest`` would shadow the one the other test files import helpers from). It acts only in
the build run and on a machine with a CUDA GPU.

Two runs of the same files (``tests/support/devices.py``):

* **build** (``FQR_GPU_TEST_DEVICE=meta``, no GPU, Triton compiled: ``TRITON_INTERPRET=0``):
  the tensors are ``meta`` and every fqr launch is compiled for the GPU into the kernel
  bundle ``$FQR_BUNDLE_BUILD_DIR`` (target ``$FQR_BUNDLE_TARGET``, default ``cuda:90``)
  instead of running (:class:`fqr.lowering.bundle.BundleWriter`);
* **GPU** (``cuda``): with ``FQR_KERNEL_BUNDLE`` set, kernels load from the bundle; any the
  bundle lacks compile here and are counted.

Either run ends with one line: how many distinct kernels (compiled specialisations) the
suite needed, and how many were compiled (build) or loaded and compiled (GPU). Under
pytest-xdist each worker writes its counts to a file and the controller adds them up.

On a GPU each xdist worker gets a share of the GPU's memory (``FQR_GPU_MEMORY_FRACTION``,
default ``0.9 / workers``: a case too big for its share fails in its own worker with an
out-of-memory error instead of starving the others) and of the host's cores for torch's CPU
threads (``FQR_TEST_TORCH_THREADS``: ``share`` by default, a number, or ``torch`` for torch's
own default; inputs are drawn and outputs compared on the CPU: 16 threads in each of 12 workers
oversubscribe 16 cores).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

from .devices import BUILDING

STATS_ENV = "FQR_KERNEL_STATS_DIR"
_WRITER = None


def _workers(config) -> int:
    return int(getattr(config, "workerinput", {}).get("workercount", 1))


def pytest_configure(config) -> None:
    if not hasattr(config, "workerinput") and (BUILDING or torch.cuda.is_available()):
        os.environ.setdefault(STATS_ENV, tempfile.mkdtemp(prefix="fqr-kernel-stats-"))


def pytest_sessionstart(session) -> None:
    global _WRITER
    workers = _workers(session.config)
    if BUILDING:
        from fqr.lowering.bundle import BundleWriter

        directory = os.environ.get("FQR_BUNDLE_BUILD_DIR")
        if not directory:
            raise pytest.UsageError(
                "FQR_GPU_TEST_DEVICE=meta builds a bundle: set FQR_BUNDLE_BUILD_DIR"
            )  # noqa: E501
        _WRITER = BundleWriter(directory, os.environ.get("FQR_BUNDLE_TARGET", "cuda:90")).open()
    elif torch.cuda.is_available() and hasattr(session.config, "workerinput"):
        fraction = float(os.environ.get("FQR_GPU_MEMORY_FRACTION", 0.9 / workers))
        torch.cuda.set_per_process_memory_fraction(fraction)
        threads = os.environ.get("FQR_TEST_TORCH_THREADS", "share")  # "torch": its default
        if threads != "torch":
            share = max(1, (os.cpu_count() or 1) // workers)
            torch.set_num_threads(share if threads == "share" else int(threads))


def _counts() -> dict | None:
    from fqr.lowering.bundle import STATS

    if _WRITER is not None:
        return {"mode": "build", "ids": sorted(_WRITER.seen), "compiled": _WRITER.written}
    if torch.cuda.is_available():
        return {"mode": "gpu", **STATS.to_dict()}
    return None


def pytest_sessionfinish(session) -> None:
    counts = _counts()
    if _WRITER is not None:
        _WRITER.close()
    stats_dir = os.environ.get(STATS_ENV)
    if counts is None or not stats_dir:
        return
    worker = getattr(session.config, "workerinput", {}).get("workerid", "main")
    Path(stats_dir, f"{worker}.json").write_text(json.dumps(counts))


def pytest_terminal_summary(terminalreporter, config) -> None:
    stats_dir = os.environ.get(STATS_ENV)
    if hasattr(config, "workerinput") or not stats_dir or not Path(stats_dir).is_dir():
        return
    parts = [json.loads(p.read_text()) for p in sorted(Path(stats_dir).glob("*.json"))]
    if not parts:
        return
    ids = set().union(*(p["ids"] for p in parts))
    if parts[0]["mode"] == "build":
        line = (
            f"fqr kernels: {len(ids)} distinct kernels launched on meta, "
            f"{sum(p['compiled'] for p in parts)} compiled into the bundle"
        )
    else:
        missing = sorted({m for p in parts for m in p["missing"]})
        line = (
            f"fqr kernels: {len(ids)} distinct kernels needed, "
            f"{sum(p['loaded'] for p in parts)} loads from the bundle, "
            f"{sum(p['compiled'] for p in parts)} compiled on this machine"
            + (f" ({len(missing)} distinct: {', '.join(missing[:5])} ...)" if missing else "")
        )
    terminalreporter.write_line(line)
