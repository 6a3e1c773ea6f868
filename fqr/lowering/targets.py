"""Target profiles: how a kernel plan is tiled, launched and compiled on each target.

=================== ========================================================================
``cuda``            upstream Triton on NVIDIA GPUs. One head chunk (the whole row of each
                    chain fits in registers), ``BLOCK_T`` tokens per tile, grid = tiles (the
                    persistent loop runs once per program unless the grid is capped).
``interpret``       the same generated source run by ``TRITON_INTERPRET=1`` on CPU tensors,
                    with bigger token tiles (numpy vectorises them) and a small grid, so the
                    persistent loop really iterates.
``ascend``          Triton-Ascend on NPUs (``fqr/lowering/ascend.py``): one program per vector
                    core, tiles sized from the on-chip buffer budget, head chunks when needed.
``ascend-interpret`` the ``ascend`` source under Triton-Ascend's interpreter (CPU tensors).
=================== ========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .emit import Tiling
from .plan import KernelPlan, next_pow2


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Target:
    name: str
    interpret: bool = False
    flavour: str = "upstream"      # which triton package compiles it: upstream | ascend
    source_target: str = ""        # whose source it runs ("" = its own name)

    @property
    def source_name(self) -> str:
        return self.source_target or self.name

    def tiling(self, plan: KernelPlan, **options) -> Tiling:
        return Tiling(block_t=1, head_chunks=tuple(c.heads for c in plan.chains))

    def block_t(self, plan: KernelPlan, tiling: Tiling, **options) -> int:
        return tiling.block_t

    def grid(self, tokens: int, block_t: int, device: torch.device, **options) -> int:
        return max(1, cdiv(tokens, block_t))

    def launch_options(self, plan: KernelPlan, **options) -> dict:
        return {}


@dataclass(frozen=True)
class CudaTarget(Target):
    def launch_options(self, plan: KernelPlan, **options) -> dict:
        if "num_warps" in options:
            return {"num_warps": int(options["num_warps"])}
        # fp32 elements live per token tile: the widest chain decides the warps.
        widest = max(next_pow2(c.heads) * next_pow2(c.head_dim) for c in plan.chains)
        return {"num_warps": int(min(16, max(2, widest // 1024)))}

    def block_t(self, plan, tiling, **options) -> int:
        return int(options.get("block_t", tiling.block_t))

    def grid(self, tokens, block_t, device, **options) -> int:
        tiles = max(1, cdiv(tokens, block_t))
        cap = options.get("max_programs")
        return min(tiles, int(cap)) if cap else tiles


@dataclass(frozen=True)
class InterpretTarget(Target):
    """The cuda source under the interpreter: tiles of 8 tokens, at most 3 programs."""

    def block_t(self, plan, tiling, **options) -> int:
        return int(options.get("block_t", 8))

    def grid(self, tokens, block_t, device, **options) -> int:
        return min(int(options.get("max_programs", 3)), max(1, cdiv(tokens, block_t)))


TARGETS: dict[str, Target] = {
    "cuda": CudaTarget("cuda"),
    "interpret": InterpretTarget("interpret", interpret=True, source_target="cuda"),
}


def get_target(name: str) -> Target:
    if name in ("ascend", "ascend-interpret") and name not in TARGETS:
        from . import ascend  # registers the Ascend targets  # noqa: F401
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"target must be one of {', '.join(sorted(set(TARGETS) | {'ascend', 'ascend-interpret'}))};"
                         f" got {name!r}") from None
