"""Target profiles: how a kernel plan is tiled, launched and compiled on each target.

=================== ========================================================================
``cuda``            upstream Triton on NVIDIA GPUs. Heads in static power-of-two chunks of at
                    most 2048 fp32 registers per token, ``BLOCK_T`` tokens per tile, grid =
                    tiles (the persistent loop runs once per program unless the grid is capped).
``interpret``       the same generated source run by ``TRITON_INTERPRET=1`` on CPU tensors,
                    with bigger token tiles (numpy vectorises them) and a small grid, so the
                    persistent loop really iterates.
``ascend``          Triton-Ascend on NPUs (``fqr/lowering/ascend.py``): one program per vector
                    core, tiles sized from the on-chip buffer budget, head chunks when needed;
                    a kernel with a product (the projected form): one program per AI core,
                    ``tl.dot`` on the cube, tiles sized from the UB and the cube's buffers.
``ascend-interpret`` the ``ascend`` source under Triton-Ascend's interpreter (CPU tensors).
=================== ========================================================================
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ..core import lookup
from .plan import KernelPlan, next_pow2
from .tiling import Tiling
from .tuning import CHUNK_MODES, TILING_OPTIONS, TOKEN_BUCKETS, Variants, load_table


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """The streaming multiprocessors of CUDA ``device`` (asked once per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _multiprocessors(index)


def checked_block_t(value: Any) -> int:
    block_t = int(value)
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two, got {value}")
    return block_t


@dataclass(frozen=True)
class Target:
    """A target profile: how the generic kernel source is tiled, launched and compiled.

    ``interpret``: run under ``TRITON_INTERPRET=1`` on CPU tensors; ``flavour``: which triton
    package compiles it (``upstream`` or ``ascend``). The base profile is one token per tile,
    whole rows, one program per token."""

    name: str
    interpret: bool = False
    flavour: str = "upstream"

    def tiling(self, plan: KernelPlan, **options: Any) -> Tiling:
        return Tiling(block_t=1, head_chunks=tuple(c.heads for c in plan.chains))

    def block_t(self, plan: KernelPlan, tiling: Tiling, **options: Any) -> int:
        return tiling.block_t

    def grid(self, tokens: int, tile: int, device: torch.device, **options: Any) -> int:
        """Programs along grid axis 0 for ``tokens`` tokens in tiles of ``tile``; ``options``
        are the kernel's, with ``work_per_tile`` (blocks per token tile) where the persistent
        loop walks the blocks too (:attr:`~fqr.lowering.tiling.Tiling.persistent_blocks`)."""
        return max(1, cdiv(tokens, tile))

    def grid_expression(self, tile: int, device: torch.device, **options: Any) -> str | None:
        """:meth:`grid` on ``device`` as a Python expression of ``T`` (T >= 1) for the generated
        host function (:mod:`fqr.lowering.host`); None: it calls :meth:`grid`."""
        return None

    def launch_options(
        self, plan: KernelPlan, *, rounding_points: bool = False, **options: Any
    ) -> dict[str, Any]:
        """The compile and launch keywords of the kernel (``rounding_points``: its code rounds
        between steps, :class:`~fqr.lowering.emit.EmittedKernel`)."""
        return {}

    def token_buckets(
        self, plan: KernelPlan, **options: Any
    ) -> tuple[tuple[int | None, dict[str, Any]], ...]:
        """The kernel variants of one program by token count: ``(max_tokens, options)`` in
        increasing order, the last with ``max_tokens`` None (any T). Each variant is lowered
        and compiled once, when a call first falls in its range; T itself never recompiles.
        The base profile has one variant."""
        return ((None, dict(options)),)


@dataclass(frozen=True)
class CudaTarget(Target):
    """Heads are processed in chunks of at most ``tile_elems`` fp32 values per token (default
    2048: 16 heads of 128), covered by static power-of-two chunks (``chunk_mode="unroll"``:
    Qwen3.5's 24 heads of 256 -> 8 + 8 + 8, nothing masked), so registers never spill; 2 warps
    per program; GPT-J pairs read as contiguous rows (``pair_access="reshape"``: GLM-4-9B 97%
    of the copy ceiling at 65,536 tokens against 69% for split pair tiles). These defaults won
    the H200 sweeps recorded in docs/PERFORMANCE.md ("Kernel design measurements"); without
    options, :meth:`token_buckets` picks per shape and token count among a few variants.

    The schedule knobs (issue 38, :mod:`fqr.lowering.tuning`): ``heads_per_program`` (the
    decode schedule, :attr:`Tiling.heads_per_program`), ``maxnreg`` (a register budget,
    :meth:`launch_options`), ``pipeline_stages`` (the token loop's loads pipelined,
    :attr:`Tiling.pipeline_stages`); each 0 (off) by default."""

    bf16_rounding: str = "native"

    def tiling(self, plan: KernelPlan, **options: Any) -> Tiling:
        if plan.products:
            return self.product_tiling(plan, **options)
        budget = int(options.get("tile_elems", 2048))
        mode = options.get("chunk_mode", "unroll")
        if mode not in CHUNK_MODES:
            raise ValueError(f"chunk_mode must be loop, unroll or grid, got {mode!r}")
        per_program = heads_per_program(options)
        if per_program and mode != "grid":
            raise ValueError(
                f"heads_per_program (one program per group of heads) needs chunk_mode='grid', "
                f"got {mode!r}"
            )
        stages = schedule_knob(options, "pipeline_stages")
        if stages > 8:
            raise ValueError(f"pipeline_stages must be 0 .. 8, got {stages}")
        chunks = []
        for c in plan.chains:
            if per_program and not c.row_reductions:
                # the decode schedule: groups of heads, one program each (a chain reduced over
                # its whole row stays one program, chunked by the budget below)
                chunks.append(min(per_program, next_pow2(c.heads)))
                continue
            chunks.append(budget_chunk(c, budget))
        if options.get("pdl") and self.interpret:
            raise ValueError(
                "pdl: programmatic dependent launch runs on a CUDA GPU (target cuda), not "
                f"under the interpreter (target {self.name})"
            )
        return Tiling(
            block_t=1,
            head_chunks=tuple(chunks),
            bf16_rounding=self.bf16_rounding,
            chunk_mode=mode,
            pair_access=pair_access(options),
            grid_dependency=bool(options.get("pdl", False)),
            # off where no chain is grouped (MLA's single heads): the same kernel as without it
            heads_per_program=per_program
            if any(h < c.heads for h, c in zip(chunks, plan.chains) if not c.row_reductions)
            else 0,
            pipeline_stages=stages if stages > 1 else 0,
        )

    def product_tiling(self, plan: KernelPlan, **options: Any) -> Tiling:
        """The tiling of a kernel whose packed row is a product computed in it (the projected
        form, a GEMM with the prologue as its epilogue): one program per group of
        ``heads_per_program`` heads (default 1) and token tile, so that the weight's rows
        are spread over the programs; each head's columns accumulated over K in steps of
        ``block_k`` (default 64) by ``product_dot`` ("mma", default: ``tl.dot`` on tiles of at
        least 16 tokens; "fma": any tile). A chain reduced over its whole row (OLMo2's norm)
        stays one program, chunked by ``tile_elems`` as other kernels are. ``product_operands``
        ("native" or "tf32"), ``split_k`` (K in ranges, the decode schedule) and ``k_stages``
        (the K loop's loads pipelined): see :class:`~fqr.lowering.tiling.Tiling`."""
        mode = options.get("chunk_mode", "grid")
        if mode != "grid":
            raise ValueError(
                "a kernel with a product (the projected form) runs one program per group of "
                f"heads: chunk_mode must be 'grid', got {mode!r}"
            )
        per_program = heads_per_program(options) or 1
        block_k = schedule_knob(options, "block_k") or 64
        dot = options.get("product_dot", "mma")
        if dot not in ("mma", "fma"):
            raise ValueError(f"product_dot must be 'mma' or 'fma', got {dot!r}")
        if block_k & (block_k - 1) or (dot == "mma" and block_k < 16):
            raise ValueError(
                f"block_k must be a power of two (at least 16 with product_dot 'mma'), got "
                f"{block_k}"
            )
        operands = options.get("product_operands", "native")
        if operands not in ("native", "tf32"):
            raise ValueError(f"product_operands must be 'native' or 'tf32', got {operands!r}")
        split_k = schedule_knob(options, "split_k") or 1
        k_stages = schedule_knob(options, "k_stages")
        if k_stages > 8:
            raise ValueError(f"k_stages must be 0 .. 8, got {k_stages}")
        if split_k > 1 and any(c.row_reductions for c in plan.chains):
            raise ValueError(
                "split_k: a chain normalised over its whole row (OLMo2's norm) is computed in "
                "one program; split_k must be 1 there"
            )
        budget = int(options.get("tile_elems", 2048))
        chunks = []
        for c in plan.chains:
            if c.row_reductions:
                chunks.append(budget_chunk(c, budget))
            else:
                chunks.append(min(per_program, next_pow2(c.heads)))
        grouped = any(h < c.heads for h, c in zip(chunks, plan.chains) if not c.row_reductions)
        return Tiling(
            block_t=16 if dot == "mma" else 1,
            head_chunks=tuple(chunks),
            bf16_rounding=self.bf16_rounding,
            chunk_mode="grid",
            pair_access=pair_access(options),
            heads_per_program=per_program if grouped else 0,
            pipeline_stages=0,
            block_k=block_k,
            product_dot=dot,
            product_operands=operands,
            split_k=split_k,
            k_stages=k_stages if k_stages > 1 else 0,
        )

    def product_buckets(
        self, plan: KernelPlan, **options: Any
    ) -> tuple[tuple[int | None, dict[str, Any]], ...]:
        """A projected kernel's variants when no schedule option is pinned. One token, and two
        where the weights are at most :data:`GEMV_TWO_TOKEN_BYTES`: the GEMV
        (``product_dot="fma"``: each weight tile times x as a column, a program per token and
        K range; :func:`gemv_schedule`): ranges of one 256-wide step and 8 warps where that
        makes at most :data:`ONE_STEP_GEMV_PROGRAMS` programs (TP 8's 6 heads at K = 4,096 and
        one token: 96), else ranges of 512 walked in 64-wide steps with their loads pipelined
        4 deep (``k_stages``), 4 warps (Qwen3-8B at TP 1, 48 heads; Qwen3-32B at TP 8, 10
        heads at K = 5,120; two tokens at TP 8). Decode (T <= 16): split-K on tensor
        cores, 4 warps, K in 4 ranges where there are 32 head programs or more and in 8 below,
        as far as each range keeps two K steps of 64. Then 64-token tensor-core tiles, 4 warps.
        Measured on the H200 among 4 to 64 ranges, K steps of 64 to 256, tensor-core and
        broadcast products, 64 / 128-token tiles, 2 to 8 warps, 0 to 4 stages
        (docs/results/projection-*-issue40*.log). A chain normalised over its whole row keeps
        one range (and no GEMV bucket). Any option given pins one variant."""
        if any(k in options for k in (*TILING_OPTIONS, *PRODUCT_OPTIONS)):
            return ((None, dict(options)),)
        blocks = sum(c.heads if not c.row_reductions else 1 for c in plan.chains)
        depth = max(c.product.depth for c in plan.chains if c.product is not None)
        split = 4 if blocks >= 32 else 8
        while split > 1 and depth // split < 2 * 64:
            split //= 2
        whole_rows = any(c.row_reductions for c in plan.chains)
        if whole_rows:
            split = 1
        decode = {"num_warps": 4, **({"split_k": split} if split > 1 else {})}
        buckets: list[tuple[int | None, dict[str, Any]]] = []
        if not whole_rows:
            weight = next(c.product.weight for c in plan.chains if c.product is not None)
            rows, columns = (int(n) for n in weight.aval.shape)  # [N, K]: static
            weight_bytes = rows * columns * weight.aval.dtype.itemsize
            # a second token re-reads the weights: from L2 where they fit it easily
            most = 2 if weight_bytes <= GEMV_TWO_TOKEN_BYTES else 1
            for tokens in range(1, most + 1):
                buckets.append((tokens, {**gemv_schedule(tokens * blocks, depth), **options}))
        buckets.append((16, {**decode, **options}))
        buckets.append((None, {"block_t": 64, "num_warps": 4, **options}))
        return tuple(buckets)

    def launch_options(
        self, plan: KernelPlan, *, rounding_points: bool = False, **options: Any
    ) -> dict[str, Any]:
        """``num_warps`` (default 2); Triton's ``enable_fp_fusion`` (whether a multiply and an
        add may contract into one FMA): ``fp_fusion`` where given, else off for a kernel with
        ``rounding_points`` and on otherwise (always passed: Triton 3.9 warns that its own
        default turns off in 3.10). A contraction skips the rounding between the product and
        the sum: in the PTX of an unfused kernel ``round(round(a * c) - round(b * s))`` became
        ``fma.rn.bf16(a, c, -round(b * s))``; in a fused kernel it only adds precision. With
        ``pdl``, Triton's ``launch_pdl`` (the kernel then waits on the one before it:
        :attr:`Tiling.grid_dependency`). With ``maxnreg`` (> 0), Triton's ``maxnreg``: the
        registers a thread may use (ptx ``.maxnreg``; what the compiler cannot fit spills),
        the register budget that sets how many warps an SM holds."""
        launch: dict[str, Any] = {"num_warps": int(options.get("num_warps", 2))}
        launch["enable_fp_fusion"] = bool(options.get("fp_fusion", not rounding_points))
        if options.get("pdl"):
            launch["launch_pdl"] = True
        maxnreg = schedule_knob(options, "maxnreg")
        if maxnreg and not 16 <= maxnreg <= 255:
            raise ValueError(f"maxnreg must be 0 (no budget) or 16 .. 255, got {maxnreg}")
        if maxnreg and not self.interpret:  # the interpreter has no registers to budget
            launch["maxnreg"] = maxnreg
        return launch

    def block_t(self, plan: KernelPlan, tiling: Tiling, **options: Any) -> int:
        block_t = checked_block_t(options.get("block_t", tiling.block_t))
        if tiling.block_k and tiling.product_dot == "mma" and block_t < 16:
            raise ValueError(
                f"product_dot 'mma' multiplies tiles of at least 16 tokens: block_t must be >= "
                f"16, got {block_t} (product_dot 'fma' takes any)"
            )
        return block_t

    def program_cap(self, device: torch.device, **options: Any) -> int | None:
        """The most programs launched on ``device``: ``max_programs`` where given, else
        ``programs_per_sm`` times the device's multiprocessors (on a CUDA device; 0 or absent:
        None, one program per token tile)."""
        if options.get("max_programs"):
            return int(options["max_programs"])
        per_sm = int(options.get("programs_per_sm") or 0)
        if per_sm and device.type == "cuda":
            return per_sm * multiprocessors(device)
        return None

    def grid(self, tokens: int, tile: int, device: torch.device, **options: Any) -> int:
        tiles = max(1, cdiv(tokens, tile))
        cap = self.program_cap(device, **options)
        return min(tiles, cap) if cap else tiles

    def grid_expression(self, tile: int, device: torch.device, **options: Any) -> str | None:
        tiles = "T" if tile == 1 else f"(T + {tile - 1}) // {tile}"
        cap = self.program_cap(device, **options)
        return f"min({tiles}, {cap})" if cap else tiles

    def token_buckets(
        self, plan: KernelPlan, **options: Any
    ) -> tuple[tuple[int | None, dict[str, Any]], ...]:
        """Three variants when no tiling option is pinned: decode (T <= 256), middle
        (T <= 8192) and large T, tuned per shape on the H200 (:data:`TUNED`, with
        :data:`UNTUNED` for shapes not in the table); any option given pins one variant."""
        if plan.products:
            return self.product_buckets(plan, **options)
        if any(k in options for k in TILING_OPTIONS):
            return ((None, dict(options)),)
        tuned = tuned_variants(plan)
        return tuple(
            (limit, {**dict(zip(TILING_OPTIONS, cfg)), **options})
            for limit, cfg in zip(TOKEN_BUCKETS, tuned)
        )


# The GEMV schedules (CudaTarget.product_buckets, gemv_schedule). One step a split-K range,
# every weight load of a program in flight at once, where tokens x heads x ranges stay within
# this many programs (one wave of 8-warp programs on the H200's 132 SMs); else ranges of 512
# in 64-wide steps, the next steps' weight tiles loaded while one is summed.
GEMV_BLOCK_K = 256
ONE_STEP_GEMV_PROGRAMS = 128
PIPELINED_GEMV = {"product_dot": "fma", "block_k": 64, "k_stages": 4, "num_warps": 4}
PIPELINED_GEMV_RANGE = 512
# The GEMV also takes T = 2 (one program per token and range, the second token's weight reads
# hitting L2) where the weights are at most this big: TP 8's 6-13 MB on the H200 (50 MB of L2),
# not TP 1's 50-105 MB.
GEMV_TWO_TOKEN_BYTES = 16 << 20


def gemv_schedule(head_programs: int, depth: int) -> dict[str, Any]:
    """The GEMV's options for ``head_programs`` (tokens x heads) over K = ``depth``: one
    256-wide step a split-K range and 8 warps where that makes at most
    :data:`ONE_STEP_GEMV_PROGRAMS` programs, else ranges of :data:`PIPELINED_GEMV_RANGE`
    (:data:`PIPELINED_GEMV`); no ``split_k`` where K is one range."""
    one_step = -(-depth // GEMV_BLOCK_K)
    if head_programs * one_step <= ONE_STEP_GEMV_PROGRAMS:
        gemv = {"product_dot": "fma", "block_k": GEMV_BLOCK_K, "num_warps": 8}
        split = one_step
    else:
        gemv = dict(PIPELINED_GEMV)
        split = -(-depth // PIPELINED_GEMV_RANGE)
    return {**gemv, "split_k": split} if split > 1 else gemv


# The projected kernel's own schedule options (CudaTarget.product_tiling).
PRODUCT_OPTIONS = ("block_k", "product_dot", "product_operands", "split_k", "k_stages")


def heads_per_program(options: dict[str, Any]) -> int:
    """The ``heads_per_program`` knob: 0 (off) or a power of two; ValueError otherwise."""
    per_program = schedule_knob(options, "heads_per_program")
    if per_program & (per_program - 1):
        raise ValueError(f"heads_per_program must be a power of two, got {per_program}")
    return per_program


def pair_access(options: dict[str, Any]) -> str:
    """How GPT-J pair tiles are read (:attr:`~fqr.lowering.tiling.Tiling.pair_access`)."""
    access = options.get("pair_access", "reshape")
    if access not in ("split", "reshape"):
        raise ValueError(f"pair_access must be split or reshape, got {access!r}")
    return access


def budget_chunk(chain, budget: int) -> int:
    """The heads of ``chain`` one chunk holds within ``budget`` fp32 values per token: all of
    them where their padded count fits, else the largest power of two that does (at least 1)."""
    fit = max(1, budget // chain.head_layout.padded_elems)
    return chain.heads if next_pow2(chain.heads) <= fit else 1 << (fit.bit_length() - 1)


def schedule_knob(options: dict[str, Any], name: str) -> int:
    """The int value of schedule knob ``name`` in ``options`` (absent or None: 0, off);
    ValueError naming it where it is not an int >= 0."""
    value = options.get(name) or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0 (0: off), got {value!r}")
    return value


def tuned_variants(plan: KernelPlan) -> Variants:
    """The (decode, middle, large) variants :data:`TUNED` holds for ``plan``: its entry for
    the shape and the outputs' dtype where one was measured apart, else the shape's entry,
    else :data:`UNTUNED`."""
    shape = shape_key(plan)
    dtype = plan.program.outputs[0].aval.dtype if plan.program.outputs else None
    return TUNED.get((shape, dtype)) or TUNED.get(shape, UNTUNED)


def shape_key(plan: KernelPlan) -> tuple:
    """What the tuning table is keyed on: per chain (heads, head_dim, register layout tag,
    whether it is a copy)."""
    return tuple((c.heads, c.head_dim, c.head_layout.tag, c.compute_free) for c in plan.chains)


# The H200 tuning table (fqr/lowering/tuning.json, :mod:`fqr.lowering.tuning`): variants per
# shape (:func:`shape_key`) or ``(shape, dtype)`` for a dtype measured apart, and the variants
# of shapes no sweep covered (grid chunks below 8192 tokens, then 2 warps and 2048-element
# unrolled chunks).
UNTUNED, TUNED = load_table()


@dataclass(frozen=True)
class InterpretTarget(CudaTarget):
    """The cuda kernel under the interpreter: same tiling and body, bf16 rounding done on the
    bits (the interpreter's own fp32 -> bf16 cast truncates), tiles of 8 tokens, at most 3
    programs so that the persistent loop iterates."""

    bf16_rounding: str = "bits"

    def block_t(self, plan: KernelPlan, tiling: Tiling, **options: Any) -> int:
        return checked_block_t(options.get("block_t", 8))

    def grid(self, tokens: int, tile: int, device: torch.device, **options: Any) -> int:
        return min(int(options.get("max_programs", 3)), max(1, cdiv(tokens, tile)))

    def grid_expression(self, tile: int, device: torch.device, **options: Any) -> str | None:
        return super().grid_expression(
            tile, device, max_programs=int(options.get("max_programs", 3))
        )

    def token_buckets(
        self, plan: KernelPlan, **options: Any
    ) -> tuple[tuple[int | None, dict[str, Any]], ...]:
        return ((None, dict(options)),)  # one variant: tests pin the interpreted tiling


# The target compiled for each accelerator's tensors: what ``jit`` lowers for there, and the
# target of the backend ``backend="auto"`` runs there (fqr.backends.AUTO_BACKENDS derives from
# this). Other devices: the interpreter (jit) or the reference rules (auto).
ACCELERATOR_TARGETS = {"cuda": "cuda", "npu": "ascend"}

TARGETS: dict[str, Target] = {}


def register_target(target: Target) -> Target:
    """Make ``target`` available to :func:`get_target` (and ``lower(..., target=name)``)."""
    if target.name in TARGETS:
        raise ValueError(f"target {target.name!r} is already registered")
    TARGETS[target.name] = target
    return target


register_target(CudaTarget("cuda"))
register_target(InterpretTarget("interpret", interpret=True))


def get_target(name: str) -> Target:
    return lookup(TARGETS, name, "target")
