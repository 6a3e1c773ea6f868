"""A copy kernel on the SMs: the bench's other copy beside ``torch.Tensor.copy_``.

``copy_`` between two contiguous buffers is a ``cudaMemcpyAsync``; captured in a CUDA graph it
becomes a memcpy node, which the driver may run on the copy engines (seen at 2.7 TB/s on an
H200 where an SM copy of the same bytes ran at 4.2 TB/s). A floor must not depend on that
choice, so the bench times both (:func:`fqr.bench.floors.copy_calls`, the ceiling in
:meth:`fqr.bench.timers.CudaTimers.copy_ceiling`) and keeps the fastest.

:func:`sm_copy_kernel` copies ``n`` int32 words: every full ``BLOCK``-word tile unmasked (the
pointers of fresh torch buffers are 16-byte aligned and a tile's offsets are contiguous, so each
thread moves 16-byte vectors), then the last partial tile masked, by program 0. Programs loop
over tiles (``for tile in range(pid, full, nprog)``): a grid of a few programs per SM is
persistent, a grid of one program per tile is the plain form. ``n`` is a runtime int that is
not specialised (``do_not_specialize``), so each setting compiles once whatever the size.

Its own module so that importing the bench needs no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

WORD_BYTES = 4  # the kernel moves int32 words; four of them make a thread's 16-byte vector


@triton.jit(do_not_specialize=["n"])
def sm_copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    full = n // BLOCK
    for tile in range(pid, full, nprog):
        at = tile * BLOCK + offs  # < n: no overflow (n is i64 where it needs to be)
        tl.store(dst + at, tl.load(src + at))
    if pid == 0:
        at = full * BLOCK + offs.to(tl.int64)  # may pass n (masked): in int64
        mask = at < n
        tl.store(dst + at, tl.load(src + at, mask=mask), mask=mask)


@dataclass(frozen=True)
class CopySetting:
    """One launch setting of :func:`sm_copy_kernel`: ``block`` int32 words per tile,
    ``num_warps``, and ``per_sm`` programs per SM (a persistent grid), or None for one program
    per tile."""

    block: int
    num_warps: int
    per_sm: int | None

    @property
    def name(self) -> str:
        grid = "tiles" if self.per_sm is None else f"{self.per_sm}/SM"
        return f"sm_copy[{self.block * WORD_BYTES // 1024}KiB,w{self.num_warps},{grid}]"

    def grid(self, n_words: int, sm_count: int) -> int:
        tiles = max(1, -(-n_words // self.block))
        return tiles if self.per_sm is None else max(1, min(tiles, self.per_sm * sm_count))


# A few settings, each 16 bytes per thread per access: tiles of 8-32 KiB, persistent grids of
# 2-8 programs per SM and the one-tile-per-program grid. Each is one compiled kernel.
SETTINGS = (
    CopySetting(block=4096, num_warps=8, per_sm=4),
    CopySetting(block=8192, num_warps=8, per_sm=2),
    CopySetting(block=2048, num_warps=4, per_sm=8),
    CopySetting(block=4096, num_warps=8, per_sm=None),
)


def as_words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous buffer as int32 words (its byte count must be a multiple of 4)."""
    if not t.is_contiguous() or t.nbytes % WORD_BYTES:
        raise ValueError(
            f"sm_copy: needs a contiguous buffer of whole int32 words, got {t.nbytes} bytes"
        )
    return t.reshape(-1).view(torch.uint8).view(torch.int32)


def sm_copy(dst: torch.Tensor, src: torch.Tensor, setting: CopySetting, sm_count: int):
    """Copy ``src`` into ``dst`` (contiguous, the same byte count, a multiple of 4) with
    :func:`sm_copy_kernel` under ``setting``; returns ``dst``."""
    return sm_copy_call(dst, src, setting, sm_count)()


def sm_copy_call(dst: torch.Tensor, src: torch.Tensor, setting: CopySetting, sm_count: int):
    """A ``call()`` for the timers: the launch with its grid and word views computed once."""
    s, d = as_words(src), as_words(dst)
    n = s.numel()
    if d.numel() != n:
        raise ValueError(f"sm_copy: {src.nbytes} bytes into {dst.nbytes}")
    launch = sm_copy_kernel[(setting.grid(n, sm_count),)]
    block, warps = setting.block, setting.num_warps

    def call():
        launch(s, d, n, BLOCK=block, num_warps=warps)
        return dst

    return call
