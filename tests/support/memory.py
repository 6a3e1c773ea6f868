"""Peak host memory of a call, as the OOM killer sees it: the rise of the process's peak
resident set (``VmHWM``, reset through ``/proc/self/clear_refs``) above its resident set before
the call, after freed heap memory went back to the OS."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from pathlib import Path

import pytest


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _trim() -> None:
    """glibc keeps freed heap memory resident; give it back so the baseline is what is in use."""
    libc = ctypes.util.find_library("c")
    if libc:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)


def peak_bytes(fn) -> int:
    """Bytes by which ``fn()`` raised the peak resident set (skips where it cannot be reset)."""
    gc.collect()
    _trim()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    except OSError:
        pytest.skip("no /proc/self/clear_refs (the peak resident set cannot be reset here)")
    before = _status("VmRSS")
    fn()
    return _status("VmHWM") - before


def in_fresh_process(fn, *args):
    """``fn(*args)`` in a new interpreter (``spawn``; ``fn`` a module-level function): a
    measure of the resident set there depends on the call alone, not on the heap that earlier
    tests of this process left fragmented (the main suite runs in one process)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)
