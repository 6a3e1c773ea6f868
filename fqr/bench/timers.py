"""How the bench reads the clock on a CUDA device (Triton's benchmarking helpers), and the
same-run copy ceiling.

Any object with these four methods can time a run (the tests drive the bookkeeping on CPU with
a clock that returns fixed times); :mod:`fqr.bench.measurements` says which method each reported
figure comes from.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

CEILING_BYTES = 2 << 30  # size of the copied buffer: 2 GiB read + 2 GiB written


class CudaTimers:
    def kernel_us(self, call: Callable[[], object], warmup_ms: float, rep_ms: float) -> float:
        """Median kernel time in µs (``triton.testing.do_bench``: L2 flushed, CUDA events)."""
        from triton.testing import do_bench

        return 1e3 * do_bench(call, warmup=warmup_ms, rep=rep_ms, return_mode="median")

    def graph_us(self, call: Callable[[], object], rep_ms: float) -> float:
        """Device µs per call: median of CUDA-graph replays (``do_bench_cudagraph``: many calls
        captured in one graph; ``call`` rotates over the input sets, so nothing repeats)."""
        from triton.testing import do_bench_cudagraph

        return 1e3 * do_bench_cudagraph(call, rep=rep_ms, return_mode="median")

    def wall_us(self, call: Callable[[], object], rep_ms: float, rounds: int = 5) -> float:
        """Wall µs per call with host dispatch, no graphs: host clock over back-to-back calls,
        from the first call to the last one's completion (synchronised), median of rounds."""
        call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        estimate = (time.perf_counter() - start) / 5
        calls = max(10, min(5000, int(rep_ms * 1e-3 / max(estimate, 1e-7))))
        per_call = []
        for _ in range(rounds):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
            per_call.append((time.perf_counter() - start) / calls * 1e6)
        return statistics.median(per_call)

    def dispatch_us(self, call: Callable[[], object], calls: int = 200, rounds: int = 7) -> float:
        """Host cost per call in µs without graphs: host clock over back-to-back calls."""
        call()
        torch.cuda.synchronize()
        per_call = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                call()
            per_call.append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
        return statistics.median(per_call)

    def copy_ceiling(
        self, nbytes: int = CEILING_BYTES, warmup_ms: float = 25, rep_ms: float = 200
    ) -> dict:
        """Device-to-device copy of ``nbytes``: bytes read + written over the median time of
        the fastest copy, ``copy_`` or the SM copy kernel under each of its settings (the same
        candidates as a cell's copy floor, :func:`fqr.bench.floors.copy_calls`); ``by`` names
        it, ``candidates`` holds every one's µs, ``errors`` any candidate that could not be
        timed (``copy_`` must be)."""
        from ..text import exception_line
        from .floors import COPY_, copy_calls, fastest

        src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").normal_()
        dst = torch.empty_like(src)
        calls = copy_calls([(src, dst)], src.device)
        candidates, errors = {}, {}
        for name, call in calls.items():
            try:
                candidates[name] = self.kernel_us(call, warmup_ms, rep_ms)
            except Exception as e:  # the SM kernel failed: copy_ alone stands
                if name == COPY_:
                    raise
                errors[name] = exception_line(e)
        moved = 2 * src.numel() * src.element_size()
        src = dst = calls = None  # free both before the next measurement
        torch.cuda.empty_cache()
        by, us = fastest(candidates) or (COPY_, float("nan"))  # copy_ was timed or raised
        ceiling = {"bytes": moved, "us": us, "gbps": moved / us / 1e3, "by": by}
        ceiling["candidates"] = candidates
        if errors:
            ceiling["errors"] = errors
        return ceiling
