"""The GPU suite's kernels and memory: kernels built ahead of time on a CPU machine and loaded on
the GPU, each test admitted when the GPU memory it needs is free (a pytest plugin, loaded by
``tests/conftest.py``; not a ``tests/gpu/conftest.py``, whose module name ``conftest`` would
shadow the one the other test files import helpers from). It acts only in the build run and on
a machine with a CUDA GPU.

Two runs of the same files (``tests/support/devices.py``):

* **build** (``FQR_GPU_TEST_DEVICE=meta``, no GPU, Triton compiled: ``TRITON_INTERPRET=0``):
  the tensors are ``meta`` and every fqr launch is compiled for the GPU into the kernel
  bundle ``$FQR_BUNDLE_BUILD_DIR`` (target ``$FQR_BUNDLE_TARGET``, default ``cuda:90``)
  instead of running (:class:`fqr.lowering.bundle.BundleWriter`). ``FQR_BUNDLE_DRY=1``
  compiles nothing: a quick check that every file runs on ``meta``;
* **GPU** (``cuda``): with ``FQR_KERNEL_BUNDLE`` set, kernels load from the bundle; any the
  bundle lacks compile here and are counted.

Either run ends with the kernel line: how many distinct kernels (compiled specialisations) the
suite needed, and how many were compiled (build) or loaded and compiled (GPU); and a table of
every file's passed / failed / skipped tests. Under pytest-xdist each worker writes its counts
to a file and the controller adds them up.

**Memory by need** (GPU run): each test needs :func:`need_bytes` of GPU memory (stated with
``@pytest.mark.gpu_memory(bytes)`` or ``.with_args(params -> bytes)``, else estimated from its
token count), and a worker runs it only once that much of the GPU's budget
(:func:`budget_bytes`) is free: the workers share one ledger file under a lock, first come first
served (a big case waits until the memory is there instead of failing at a fixed share, and the
small ones queue behind it). Each test runs under a cap of its need plus :data:`HEADROOM`
(``set_per_process_memory_fraction``: a test far past its statement fails in its own worker,
out of memory, instead of starving the others), and gives its cached blocks back when it ends.
The peak each test allocated is recorded; the summary names the largest and any test past its
statement.

Torch's CPU threads: ``FQR_TEST_TORCH_THREADS`` (``share`` of the host's cores per worker by
default, a number, or ``torch`` for torch's own default).
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from .devices import BUILDING

STATS_ENV = "FQR_KERNEL_STATS_DIR"
LEDGER_ENV = "FQR_GPU_LEDGER_DIR"
_WRITER = None
GIB = 1 << 30
DEFAULT_NEED = 3 * GIB  # a test of a few thousand tokens at most, references and comparison
HEADROOM = 8 * GIB  # a test's cap above its statement
CONTEXT = 3 * GIB // 4  # each worker's CUDA context and libraries, outside torch's allocator


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "gpu_memory(need): GPU memory the test needs, bytes or a function of its parameters "
        "(tests/support/gpu_kernels.py)",
    )
    if not hasattr(config, "workerinput") and (BUILDING or torch.cuda.is_available()):
        os.environ.setdefault(STATS_ENV, tempfile.mkdtemp(prefix="fqr-kernel-stats-"))
        os.environ.setdefault(LEDGER_ENV, tempfile.mkdtemp(prefix="fqr-gpu-ledger-"))


def _workers(config) -> int:
    return int(getattr(config, "workerinput", {}).get("workercount", 1))


def _worker_id(config) -> str:
    return getattr(config, "workerinput", {}).get("workerid", "main")


# ---------------------------------------------------------------------- memory by need


def _token_count(value, key: str = "") -> int:
    """The largest token count among a test's parameters: ints under a key naming tokens
    (``tokens``, ``num_tokens``; in case dicts too), and ints of 2,048 or more in a case
    tuple (the mRoPE grids' ``(model, tp, dtype, tokens)``; no other int there is that big)."""
    if isinstance(value, dict):
        return max((_token_count(v, str(k)) for k, v in value.items()), default=0)
    if isinstance(value, (tuple, list)):
        found = [_token_count(v, key) for v in value]
        found += [v for v in value if isinstance(v, int) and not isinstance(v, bool) and v >= 2048]
        return max(found, default=0)
    if isinstance(value, int) and not isinstance(value, bool) and "token" in key:
        return value
    return 0


def need_bytes(item) -> int:
    """The GPU memory ``item`` needs: its ``gpu_memory`` mark (bytes, or a function of the
    test's parameters), else by its token count: inputs, float64 references and comparison
    take about 50 bytes per input byte (measured on the CPU for the variant presets and the
    ascend batches: 1.4-1.9 GiB at 1,000-4,000 tokens; the comparison works in pieces of
    bounded size, :data:`fqr.numerics.COMPARE_CHUNK`), so 12 GiB from 4,096 tokens (up to
    20,001 tokens of 200 MB), 5 GiB from 1,024, else :data:`DEFAULT_NEED`."""
    params = dict(getattr(getattr(item, "callspec", None), "params", {}))
    mark = item.get_closest_marker("gpu_memory")
    if mark is not None:
        need = mark.args[0]
        return int(need(params) if callable(need) else need)
    tokens = _token_count(params)
    if tokens >= 4096:
        return 12 * GIB
    if tokens >= 1024:
        return 5 * GIB
    return DEFAULT_NEED


def budget_bytes(workers: int) -> int:
    """The GPU memory the tests may hold at once: 92% of the GPU less each worker's
    :data:`CONTEXT`."""
    total = torch.cuda.get_device_properties(0).total_memory
    return int(0.92 * total) - workers * CONTEXT


class Ledger:
    """The GPU memory held by the running tests of every worker: ``ledger.json`` in a shared
    directory, read and written under ``flock``. :meth:`admitted` waits its turn (first come,
    first served) until ``need`` fits in the budget beside what the others hold."""

    def __init__(self, directory: str, worker: str, budget: int):
        self.path = Path(directory, "ledger.json")
        self.lock = Path(directory, "ledger.lock")
        self.worker, self.budget = worker, budget

    @contextmanager
    def _state(self):
        with open(self.lock, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                state = json.loads(self.path.read_text()) if self.path.exists() else {}
                # a worker that died (xdist starts another) holds nothing and waits for nothing
                state["held"] = {w: v for w, v in state.get("held", {}).items() if _alive(v[0])}
                state["queue"] = [e for e in state.get("queue", []) if _alive(e[1])]
                yield state
                self.path.write_text(json.dumps(state))
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    @contextmanager
    def admitted(self, need: int):
        need = min(need, self.budget)
        me = os.getpid()
        with self._state() as state:
            state["queue"].append([self.worker, me, need])
        waited = 0.0
        while True:
            with self._state() as state:
                first = state["queue"][0][1] == me
                held = sum(v[1] for v in state["held"].values())
                if first and held + need <= self.budget:
                    state["queue"].pop(0)
                    state["held"][self.worker] = [me, need]
                    break
            time.sleep(0.02)
            waited += 0.02
        try:
            yield waited
        finally:
            with self._state() as state:
                state["held"].pop(self.worker, None)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_LEDGER: Ledger | None = None
_PEAKS: dict[str, list] = {}  # nodeid -> [need, peak allocated, seconds waited]


_COMPILED_BY: dict[str, list[str]] = {}  # nodeid -> kernels the bundle lacked (GPU run)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if BUILDING or not torch.cuda.is_available():
        yield
        return
    from fqr.lowering.bundle import STATS

    compiled = len(STATS.missing)
    if _LEDGER is None:
        yield
    else:
        need = need_bytes(item)
        total = torch.cuda.get_device_properties(0).total_memory
        with _LEDGER.admitted(need) as waited:
            cap = min(need + HEADROOM, _LEDGER.budget)
            torch.cuda.set_per_process_memory_fraction(cap / total)
            torch.cuda.reset_peak_memory_stats()
            try:
                yield
            finally:
                _PEAKS[item.nodeid] = [need, torch.cuda.max_memory_allocated(), round(waited, 2)]
                torch.cuda.synchronize()
                torch.cuda.empty_cache()  # what it held goes back before the next test's turn
    if len(STATS.missing) > compiled:
        _COMPILED_BY[item.nodeid] = STATS.missing[compiled:]


# ------------------------------------------------------------------------------ session


def pytest_sessionstart(session) -> None:
    global _WRITER, _LEDGER
    workers = _workers(session.config)
    if BUILDING:
        from fqr.lowering.bundle import BundleWriter

        directory = os.environ.get("FQR_BUNDLE_BUILD_DIR")
        if os.environ.get("FQR_BUNDLE_DRY") == "1":
            directory = directory or tempfile.mkdtemp(prefix="fqr-dry-bundle-")
            BundleWriter.compile = _dry_compile  # type: ignore[method-assign]
        if not directory:
            raise pytest.UsageError(
                "FQR_GPU_TEST_DEVICE=meta builds a bundle: set FQR_BUNDLE_BUILD_DIR"
            )
        _WRITER = BundleWriter(directory, os.environ.get("FQR_BUNDLE_TARGET", "cuda:90")).open()
    elif torch.cuda.is_available():
        ledger_dir = os.environ.get(LEDGER_ENV)
        if ledger_dir:
            _LEDGER = Ledger(ledger_dir, _worker_id(session.config), budget_bytes(workers))
        threads = os.environ.get("FQR_TEST_TORCH_THREADS", "share")  # "torch": its default
        if threads != "torch" and hasattr(session.config, "workerinput"):
            share = max(1, (os.cpu_count() or 1) // workers)
            torch.set_num_threads(share if threads == "share" else int(threads))


def _dry_compile(self, fn, grid, args, kwargs) -> None:
    """``FQR_BUNDLE_DRY=1``: a launch on ``meta`` recorded by its kernel and argument
    metadata, not compiled (no Triton specialisation: the ids are not the bundle's)."""
    from fqr.lowering.bundle import _kernel_of

    known = _kernel_of(fn)
    if known is None:
        raise RuntimeError(f"{fn} is not a kernel fqr lowered: nothing to bundle")
    shape = [(tuple(a.shape), a.dtype, a.stride()) if hasattr(a, "shape") else a for a in args]
    self.seen.add(f"{known[0]}:{hash((repr(shape), repr(sorted(kwargs.items()))))}")


def _counts() -> dict | None:
    from fqr.lowering.bundle import STATS

    if _WRITER is not None:
        return {"mode": "build", "ids": sorted(_WRITER.seen), "compiled": _WRITER.written}
    if torch.cuda.is_available():
        return {"mode": "gpu", **STATS.to_dict(), "peaks": _PEAKS, "compiled_by": _COMPILED_BY}
    return None


def pytest_sessionfinish(session) -> None:
    counts = _counts()
    if _WRITER is not None:
        _WRITER.close()
    stats_dir = os.environ.get(STATS_ENV)
    if counts is None or not stats_dir:
        return
    Path(stats_dir, f"{_worker_id(session.config)}.json").write_text(json.dumps(counts))


# ------------------------------------------------------------------------------- report

_OUTCOMES: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))


def pytest_runtest_logreport(report) -> None:
    """Each test's outcome by file (the controller sees every worker's reports)."""
    if report.when == "call" or (report.when == "setup" and not report.passed):
        outcome = "skipped" if report.skipped else report.outcome
        _OUTCOMES[report.nodeid.split("::")[0]][outcome] += 1
    elif report.when == "teardown" and report.failed:
        _OUTCOMES[report.nodeid.split("::")[0]]["error"] += 1


def _file_table(terminalreporter) -> None:
    if not _OUTCOMES:
        return
    write = terminalreporter.write_line
    write(f"{'file':<44} {'passed':>7} {'failed':>7} {'skipped':>8} {'error':>6}")
    totals: dict[str, int] = defaultdict(int)
    for name in sorted(_OUTCOMES):
        row = _OUTCOMES[name]
        for k in ("passed", "failed", "skipped", "error"):
            totals[k] += row[k]
        short = name.removeprefix("tests/gpu/")
        write(
            f"{short:<44} {row['passed']:>7} {row['failed']:>7} {row['skipped']:>8} "
            f"{row['error']:>6}"
        )
    write(
        f"{'all files':<44} {totals['passed']:>7} {totals['failed']:>7} "
        f"{totals['skipped']:>8} {totals['error']:>6}"
    )


def _memory_lines(parts: list[dict], write) -> None:
    peaks = {n: p for part in parts for n, p in part.get("peaks", {}).items()}
    if not peaks:
        return
    top = sorted(peaks.items(), key=lambda kv: -kv[1][1])[:10]
    write("largest GPU memory peaks (allocated; stated need; seconds waiting for it):")
    for nodeid, (need, peak, waited) in top:
        write(
            f"  {peak / GIB:6.2f} GiB  (need {need / GIB:.1f} GiB, waited {waited:.1f} s)  {nodeid}"
        )
    over = [n for n, (need, peak, _) in peaks.items() if peak > need]
    write(
        f"tests past their stated GPU memory: {len(over)}"
        + (f" ({', '.join(over[:5])})" if over else "")
    )
    waited = sum(w for _, _, w in peaks.values())
    write(f"seconds the tests waited for GPU memory, all workers: {waited:.1f}")


def pytest_terminal_summary(terminalreporter, config) -> None:
    if hasattr(config, "workerinput"):
        return
    if BUILDING or torch.cuda.is_available():
        _file_table(terminalreporter)
    stats_dir = os.environ.get(STATS_ENV)
    if not stats_dir or not Path(stats_dir).is_dir():
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
        _memory_lines(parts, terminalreporter.write_line)
        for nodeid, names in sorted(
            (n, k) for part in parts for n, k in part.get("compiled_by", {}).items()
        ):
            terminalreporter.write_line(f"compiled here (not in the bundle): {nodeid}: {names}")
        report = os.environ.get("FQR_GPU_MEMORY_REPORT")
        if report:
            peaks = {n: p for part in parts for n, p in part.get("peaks", {}).items()}
            Path(report).write_text(json.dumps(peaks, indent=0, sort_keys=True))
    terminalreporter.write_line(line)
