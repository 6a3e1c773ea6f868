"""What the bench measures of each implementation: one :class:`Measurement` per reported figure.

This is the one place a measurement kind is defined: the run loop (:mod:`fqr.bench.run`) takes
every entry of :data:`MEASUREMENTS` in order, the document stores each under its ``key``, and
the table (:mod:`fqr.bench.report`) shows a column for each that has a value. A new kind (say,
wall time around a synchronised call) is one more entry here with the timer method it reads.

================  ===================================================================  ========
key               what                                                                 when
================  ===================================================================  ========
``us``            median kernel time (``do_bench``: L2 flushed, CUDA events); GB/s,    always
                  % of the copy ceiling and the speed-ups come from it
``graph_us``      device time: median µs per call of CUDA-graph replays over the       always
                  rotating input sets (no host in it, nothing served from L2), with    (fqr)
                  its own % of the ceiling (``device_pct``)
``wall_us``       wall time per call with host dispatch: back-to-back calls over the   always
                  rotating sets, no graphs, host clock from first call to last         (fqr)
                  completion, with its own % of the ceiling (``wall_pct``)
``dispatch_us``   host µs per call of the public op without graphs                     T <= 256
``launcher_...``  host µs per call of the bare generated-kernel launcher (fqr on       T <= 256
                  triton only): beside ``dispatch_us`` it splits host time between the
                  argument checks and the launch
================  ===================================================================  ========
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

GRAPH_MAX_TOKENS = 256


@dataclass(frozen=True)
class Measurement:
    """One figure per implementation and cell.

    ``take(timers, call, cfg)`` returns it in µs; ``subject`` says what it times (``"op"``: the
    implementation as called; ``"launcher"``: fqr's bare kernel launcher, where there is one);
    ``max_tokens``: measured only for cells with at most that many tokens. The ``primary``
    measurement comes first: without it (the implementation failed) nothing else is taken, and a
    failure of a secondary one is noted beside the numbers.
    """

    key: str
    column: str
    fmt: str
    take: Callable[..., float]
    subject: str = "op"
    max_tokens: int | None = None
    primary: bool = False
    pct_key: str | None = None  # where its own % of the copy ceiling goes (a time per call)
    only: str | None = None  # the one implementation it is taken of (None: every one)

    def applies(self, tokens: int, impl: str | None = None) -> bool:
        if self.only is not None and impl is not None and impl != self.only:
            return False
        return self.max_tokens is None or tokens <= self.max_tokens


KERNEL = Measurement(
    "us",
    "us",
    ".2f",
    lambda timers, call, cfg: timers.kernel_us(call, cfg.warmup_ms, cfg.rep_ms),
    primary=True,
)
GRAPH = Measurement(
    "graph_us",
    "device us",
    ".2f",
    lambda timers, call, cfg: timers.graph_us(call, cfg.graph_rep_ms),
    pct_key="device_pct",
    only="fqr",
)
WALL = Measurement(
    "wall_us",
    "wall us",
    ".2f",
    lambda timers, call, cfg: timers.wall_us(call, cfg.rep_ms),
    pct_key="wall_pct",
    only="fqr",
)
DISPATCH = Measurement(
    "dispatch_us",
    "dispatch us",
    ".1f",
    lambda timers, call, cfg: timers.dispatch_us(call),
    max_tokens=GRAPH_MAX_TOKENS,
)
LAUNCHER_DISPATCH = Measurement(
    "launcher_dispatch_us",
    "launch us",
    ".1f",
    lambda timers, call, cfg: timers.dispatch_us(call),
    subject="launcher",
    max_tokens=GRAPH_MAX_TOKENS,
)

MEASUREMENTS: tuple[Measurement, ...] = (KERNEL, GRAPH, WALL, DISPATCH, LAUNCHER_DISPATCH)

# The dispatch table (``doc["dispatch"]``): host µs per call at these token counts of the
# public op, its torch custom op, one aten op and a bare Triton launch, in the same run.
DISPATCH_TOKENS = (1, 16, 1024)
