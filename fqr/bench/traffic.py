"""The traffic model: the minimal bytes one call of the prologue must move, and how many input
sets to rotate so that repeated calls do not run from L2."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..presets import PrologueSpec

CACHE_DTYPE = torch.float32  # fqr reads the real table in fp32
POSITIONS_DTYPE = torch.int64  # vLLM's positions
MAX_ROTATION_SETS = 32


@dataclass(frozen=True)
class Traffic:
    """Minimal bytes one call must move (each term read or written exactly once)."""

    qkv_read: int
    qkv_written: int  # q, k and v together: the same width as the qkv row
    positions: int
    cos_sin: int  # one table row (R values) per token
    weights: int  # q and k norm weights, once per call

    @property
    def total(self) -> int:
        return self.qkv_read + self.qkv_written + self.positions + self.cos_sin + self.weights


def traffic_bytes(
    spec: PrologueSpec,
    dtype: torch.dtype,
    tokens: int,
    cache_dtype: torch.dtype = CACHE_DTYPE,
    positions_dtype: torch.dtype = POSITIONS_DTYPE,
) -> Traffic:
    """The minimal traffic of one call of the prologue on ``tokens`` tokens of ``spec``.

    ``T*W*e`` read + ``T*W*e`` written (``W = (Hq + 2*Hkv)*D``, ``e`` the element size),
    ``T`` positions, ``T*R`` table values (``R`` = rotary_dim), and the weights (``2*D`` values for
    a per-head norm, ``(Hq + Hkv)*D`` for a full-width norm, none without a norm).
    """
    elt = torch.finfo(dtype).bits // 8
    row = tokens * spec.qkv_width * elt
    weight_values = sum(spec.norm_widths or ())
    return Traffic(
        qkv_read=row,
        qkv_written=row,
        positions=tokens * (torch.iinfo(positions_dtype).bits // 8),
        cos_sin=tokens * spec.rotary_dim * (torch.finfo(cache_dtype).bits // 8),
        weights=weight_values * elt,
    )


def rotation_sets(set_bytes: int, l2_bytes: int) -> int:
    """How many input sets to rotate so that consecutive calls overflow L2 (at most 32)."""
    if set_bytes <= 0:
        raise ValueError(f"set_bytes must be positive, got {set_bytes}")
    return max(1, min(MAX_ROTATION_SETS, math.ceil(2 * l2_bytes / set_bytes)))
