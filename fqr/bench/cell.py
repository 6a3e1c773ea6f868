"""What the run loop (:mod:`fqr.bench.run`) measures: an :class:`Implementation` (a contender)
and a :class:`Cell` (one preset, dtype and token count, with its inputs and expectation). The
split-qkv cells (:mod:`fqr.bench.run`) and the variant cells (:mod:`fqr.bench.variant_cells`)
both build these."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core import dtype_name
from ..inputs import PrologueInputs
from ..presets import Preset
from .traffic import Traffic


@dataclass
class Implementation:
    """One contender: ``call(inputs) -> (q, k, v)``, held to ``numerics``; fqr on triton also
    has its bare kernel ``launcher``, and with ``--pdl`` that kernel launched with
    programmatic dependent launch (``pdl_launcher``, timed after the GEMM:
    :mod:`fqr.bench.floors`)."""

    name: str
    call: Callable[[PrologueInputs], tuple]
    numerics: str
    launcher: Callable[[PrologueInputs], object] | None = None
    pdl_launcher: Callable[[PrologueInputs], object] | None = None


@dataclass
class Cell:
    """One (preset, dtype, tokens) cell: its input sets, the checked rows and their float64
    expectation, and the bytes one call moves."""

    preset: Preset
    dtype: torch.dtype
    tokens: int
    sets: list[PrologueInputs]
    rows: torch.Tensor
    exact: tuple
    traffic: Traffic
    ceiling_gbps: float
    device: torch.device
    # check(outputs, exact, rows, numerics) -> report; None: split-qkv's (q, k, v) check. A
    # variant preset's cell checks through its variant (fqr.bench.variant_cells).
    check: Callable[..., dict] | None = None
    # restore(): the first input set as drawn, before each implementation's check (an op that
    # updates an input in place, not idempotently -- q rotated in place -- changed it)
    restore: Callable[[], None] | None = None

    @property
    def label(self) -> str:
        return f"{self.preset.name} {dtype_name(self.dtype)} T={self.tokens}"
