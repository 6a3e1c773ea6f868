"""What one ``fqr bench`` run measures, validated before anything runs."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from ..core import ACTIVATION_DTYPE_NAMES, dtype_name
from ..peers import PEER_NAMES
from ..presets import Preset
from ..validate import ACTIVATION_DTYPES, NUMERICS, check_choice

DEFAULT_TOKENS = (1, 16, 128, 1024, 4096, 16384, 65536)
# The H200 target set of docs/PERFORMANCE.md: Qwen3 0.6B/8B/32B/235B-A22B, Gemma 3 27B,
# Qwen3.5 27B (all TP1).
DEFAULT_PRESETS = (
    "qwen3-0.6b",
    "qwen3-8b",
    "qwen3-32b",
    "qwen3-235b-a22b",
    "gemma3-27b",
    "qwen3.5-27b",
)


@dataclass
class BenchConfig:
    presets: list[Preset]
    tokens: list[int]
    dtypes: list[torch.dtype]
    compare: list[str] = field(default_factory=lambda: list(PEER_NAMES))
    backend: str = "triton"
    numerics: str = "fused"
    check_rows: int = 1024
    warmup_ms: float = 10.0
    rep_ms: float = 50.0
    graph_rep_ms: float = 20.0
    seed: int = 0
    dispatch: bool = True  # the dispatch table (backend triton only)
    floors: bool = True  # per cell the same-size copy and the GEMM before the op (fqr.bench.floors)
    # with the floors, GEMM then fqr's kernel launched with programmatic dependent launch (triton)
    pdl: bool = False

    def __post_init__(self):
        if not self.presets:
            raise ValueError("presets: give at least one preset")
        if not self.tokens:
            raise ValueError("tokens: give at least one token count")
        for t in self.tokens:
            if not isinstance(t, int) or isinstance(t, bool) or t < 1:
                raise ValueError(f"tokens must be positive integers, got {t!r}")
        if not self.dtypes:
            raise ValueError("dtype: give at least one dtype")
        for d in self.dtypes:
            if d not in ACTIVATION_DTYPES:
                names = ", ".join(ACTIVATION_DTYPE_NAMES)
                raise ValueError(f"dtype must be one of {names}, got {d}")
        for c in self.compare:
            check_choice("compare", c, PEER_NAMES)
        check_choice("--numerics", self.numerics, NUMERICS)
        if self.pdl and (self.backend != "triton" or not self.floors):
            raise ValueError(
                "pdl: programmatic dependent launch is timed after the GEMM floor, on the "
                "triton backend"
            )
        if self.check_rows < 0:
            raise ValueError(f"check_rows must be >= 0, got {self.check_rows}")
        for name in ("warmup_ms", "rep_ms", "graph_rep_ms"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {getattr(self, name)}")

    @property
    def cells(self) -> int:
        return len(self.presets) * len(self.dtypes) * len(self.tokens)

    def settings(self) -> dict:
        """The configuration as the document records it (names, not objects)."""
        d = asdict(self)
        d["presets"] = [p.name for p in self.presets]
        d["dtypes"] = [dtype_name(t) for t in self.dtypes]
        return d
