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


def checked_block_t(value) -> int:
    block_t = int(value)
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two, got {value}")
    return block_t


@dataclass(frozen=True)
class Target:
    name: str
    interpret: bool = False
    flavour: str = "upstream"  # which triton package compiles it: upstream | ascend
    source_target: str = ""  # whose source it runs ("" = its own name)

    @property
    def source_name(self) -> str:
        return self.source_target or self.name

    def tiling(self, plan: KernelPlan, **options) -> Tiling:
        return Tiling(block_t=1, head_chunks=tuple(c.heads for c in plan.chains))

    def block_t(self, plan: KernelPlan, tiling: Tiling, **options) -> int:
        return tiling.block_t

    def grid(self, tokens: int, tile: int, device: torch.device, **options) -> int:
        return max(1, cdiv(tokens, tile))

    def launch_options(self, plan: KernelPlan, **options) -> dict:
        return {}


def padded_head_elems(chain) -> int:
    """fp32 registers one head of ``chain`` takes in the kernel (its slots, padded)."""
    return sum(slot.padded * (2 if slot.kind == "pairs" else 1) for slot in chain.layout.slots)


@dataclass(frozen=True)
class CudaTarget(Target):
    """Heads are processed in chunks of at most ``tile_elems`` fp32 values per token (default
    2048: 16 heads of 128), covered by static power-of-two chunks (``chunk_mode="unroll"``:
    Qwen3.5's 24 heads of 256 -> 8 + 8 + 8, nothing masked), so registers never spill.
    Measured on an H200 (scripts/gpu_smoke.py, docs/PERFORMANCE.md):
    unroll beat one-program-per-chunk (``grid``) and a runtime chunk loop (``loop``), and 2
    warps beat 4 and 8 (bf16 Qwen3-8B at 65,536 tokens: 92% / 79% / 70% of the copy ceiling),
    2048-element chunks beat 4096 for Qwen3.5-27B (91% vs 74%), and GPT-J pairs loaded as one
    contiguous pair tile split in registers beat two stride-2 loads (66% vs 25%, GLM-4-9B; the
    stride-2 variant was removed)."""

    bf16_rounding: str = "native"

    def tiling(self, plan: KernelPlan, **options) -> Tiling:
        budget = int(options.get("tile_elems", 2048))
        mode = options.get("chunk_mode", "unroll")
        if mode not in ("loop", "unroll", "grid"):
            raise ValueError(f"chunk_mode must be loop, unroll or grid, got {mode!r}")
        chunks = []
        for c in plan.chains:
            fit = max(1, budget // padded_head_elems(c))
            hc = c.heads if next_pow2(c.heads) <= fit else 1 << (fit.bit_length() - 1)
            chunks.append(hc)
        return Tiling(
            block_t=1, head_chunks=tuple(chunks), bf16_rounding=self.bf16_rounding, chunk_mode=mode
        )

    def launch_options(self, plan: KernelPlan, **options) -> dict:
        return {"num_warps": int(options.get("num_warps", 2))}

    def block_t(self, plan, tiling, **options) -> int:
        return checked_block_t(options.get("block_t", tiling.block_t))

    def grid(self, tokens, tile, device, **options) -> int:
        tiles = max(1, cdiv(tokens, tile))
        cap = options.get("max_programs")
        return min(tiles, int(cap)) if cap else tiles


@dataclass(frozen=True)
class InterpretTarget(CudaTarget):
    """The cuda kernel under the interpreter: same tiling and body, bf16 rounding done on the
    bits (the interpreter's own fp32 -> bf16 cast truncates), tiles of 8 tokens, at most 3
    programs so that the persistent loop iterates."""

    bf16_rounding: str = "bits"

    def block_t(self, plan, tiling, **options) -> int:
        return checked_block_t(options.get("block_t", 8))

    def grid(self, tokens, tile, device, **options) -> int:
        return min(int(options.get("max_programs", 3)), max(1, cdiv(tokens, tile)))


TARGETS: dict[str, Target] = {
    "cuda": CudaTarget("cuda"),
    "interpret": InterpretTarget("interpret", interpret=True),
}


def get_target(name: str) -> Target:
    if name in ("ascend", "ascend-interpret") and name not in TARGETS:
        from . import ascend  # registers the Ascend targets  # noqa: F401
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(
            f"target must be one of "
            f"{', '.join(sorted(set(TARGETS) | {'ascend', 'ascend-interpret'}))};"
            f" got {name!r}"
        ) from None
