"""How a generated kernel tiles its work (:class:`Tiling`, chosen by the target profile,
:mod:`fqr.lowering.targets`; read by the emitter, :mod:`fqr.lowering.emit` and
:mod:`fqr.lowering.product`, and by the launcher, :mod:`fqr.lowering.kernel`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, repr=False)
class Tiling:
    """How the emitted kernel tiles the work (chosen by the target profile)."""

    block_t: int  # tokens per tile
    head_chunks: tuple[int, ...]  # heads per chunk, one entry per chain (== heads: no chunking)
    # How fp32 is rounded to bf16 and to float8_e4m3fn: native (the hardware conversion) | bits
    # (on the bits; an interpreter's casts are wrong): ROUND_TO_BF16, ROUND_TO_FP8E4M3.
    bf16_rounding: str = "native"
    # How a chain wider than its chunk is covered: "loop" (a runtime loop over equal chunks, the
    # last one masked), "unroll" (static power-of-two chunks, no masking) or "grid" (each static
    # chunk is its own program along grid axis 1; a chain with a reduction over its whole row
    # stays in one program).
    chunk_mode: str = "loop"
    # How a GPT-J pair tile is read and written: "split" (a [.., pairs, 2] pointer tile, split
    # in registers) or "reshape" (the contiguous 2 * pairs features of the row, reshaped to
    # [.., pairs, 2] and split; the store joins and reshapes back).
    pair_access: str = "split"
    # How a value wider than a byte is stored into a byte-layout (uint8) cache entry: "cast"
    # (the byte address read as a typed pointer, ``ptr.to(tl.pointer_type(tl.float32))``) or
    # "bytes" (the value's bits split into bytes, each stored through the uint8 pointer: for a
    # compiler that refuses pointer casts between widths, Triton-Ascend 3.2). Shown in the
    # repr (the kernel-cache key, the source header) only when not the default.
    byte_stores: str = "cast"
    # Programmatic dependent launch (CUDA, sm90+): the kernel waits for the previous kernel's
    # writes (``gdc_wait``) before its first load and lets the next kernel launch, so that its
    # launch overlaps the tail of the kernel before it (the QKV projection GEMM). Shown in the
    # repr only when on.
    grid_dependency: bool = False
    # The decode schedule (``grid`` chunk mode only; 0: off): each chain's heads in groups of
    # ``head_chunks[i]``, one program per group along grid axis 1, the group's first head
    # computed from the program index (one body per chain; the last group masked where the
    # heads do not divide). A chain with a reduction over its whole row stays one program.
    # The value is the heads per program asked for (each chain's group: at most its heads,
    # rounded up to a power of two). Shown in the repr only when on.
    heads_per_program: int = 0
    # The persistent token loop as ``tl.range(..., num_stages=n)``: Triton pipelines its loads
    # (the next tiles' rows are read while the current one computes). 0: a plain ``range``.
    # Shown in the repr only when on.
    pipeline_stages: int = 0
    # A product-sourced chain (the projected form, :class:`fqr.lowering.plan.ProductSource`):
    # the K step of its dot products (0: the kernel has no product) and how each step is
    # multiplied: "mma" (``tl.dot``: the tensor cores, every tile at least 16 wide) or "fma"
    # (a broadcast product summed over the step: any width, the GEMV of a few tokens). Shown
    # in the repr only for a kernel with a product.
    block_k: int = 0
    product_dot: str = "mma"
    # How "mma" multiplies bf16 / fp16 operands: "native" (in their dtype) or "tf32" (widened
    # to fp32 and multiplied as TF32, whose 10-bit mantissa holds theirs: the products exact).
    product_operands: str = "native"
    # Split-K (the decode schedule of a product: few tokens, the weight streamed by many
    # programs): K in ``split_k`` ranges along grid axis 2, each program's partial sums stored
    # to an fp32 workspace; the last program of a (token tile, head group) to finish (an
    # atomic count) sums the ranges in order and runs the epilogue. 1: off.
    split_k: int = 1
    # A product's K loop as ``tl.range(..., num_stages=n)``: Triton pipelines its weight loads
    # (the next steps' tiles are read while the current one is summed), for a program that
    # walks several K steps. 0: a plain ``range`` (a ``tl.dot`` loop is pipelined by Triton's
    # own ``num_stages`` anyway). Shown in the repr only when on.
    k_stages: int = 0
    # ``grid`` mode's program blocks walked by the persistent loop instead of laid along grid
    # axis 1: a 1-D grid (on Ascend one program per AI core: its grid is its physical cores)
    # whose programs take the work items ``w = pid, pid + nprog, ...`` over (token tile,
    # block) pairs, ``t0 = (w // blocks) * BLOCK_T`` and ``block = w % blocks`` (the blocks
    # of one token tile side by side), each item's K loop whole. Shown in the repr only when
    # on.
    persistent_blocks: bool = False
    # The smallest M, N and K the target's ``tl.dot`` takes (Triton-Ascend 3.2's interpreter:
    # 16; its compiler and upstream Triton pad small M and N themselves: 1). A product piece
    # narrower than this, or a token tile shorter, is multiplied as a broadcast product summed
    # over the K step (``product_dot="fma"``'s form), the rest of the kernel unchanged. Shown
    # in the repr only when not 1.
    min_dot: int = 1

    @property
    def uses_workspace(self) -> bool:
        """Whether the kernel takes split-K's fp32 workspace and counts."""
        return self.split_k > 1

    def __repr__(self) -> str:
        hidden_defaults = {
            "byte_stores": "cast",
            "grid_dependency": False,
            "heads_per_program": 0,
            "pipeline_stages": 0,
            "block_k": 0,
            **({"product_dot": "mma"} if not self.block_k else {}),
            "product_operands": "native",
            "split_k": 1,
            "k_stages": 0,
            "persistent_blocks": False,
            "min_dot": 1,
        }
        shown = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if hidden_defaults.get(f.name, object()) != getattr(self, f.name)
        ]
        return f"Tiling({', '.join(shown)})"
