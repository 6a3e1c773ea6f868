"""The ``ascend`` target profile: persistent grid, tiles sized from the on-chip buffer budget.

An Ascend NPU runs a Triton-Ascend vector kernel on its AI vector cores (AIV). Each core
computes out of its *Unified Buffer* (UB), a small on-chip SRAM: every tile a kernel holds in
"registers" is really a UB buffer, and a kernel whose live tiles exceed the UB does not
compile (or, with a hand-picked budget that is too large, spills). So this profile:

* launches a **persistent grid of one program per vector core** (fewer when there are fewer
  token tiles): the count comes from
  ``triton.runtime.driver.active.utils.get_device_properties(dev)["num_vectorcore"]`` on an
  NPU, from the ``num_vectorcore`` option (``fqr lower --num-vectorcore N``) offline, and
  otherwise defaults to :data:`DEFAULT_NUM_VECTORCORE` (an Atlas 800T A2, Ascend910B3:
  20 AI cores x 2 vector cores). The token count stays a runtime value, so the kernel never
  recompiles per batch size, and each program loops over its token tiles;
* sizes the tile from an **explicit UB budget per chip** (:data:`CHIPS`, overridable with the
  ``ub_bytes`` option or ``$FQR_ASCEND_UB_BYTES``): :func:`chain_footprint`,
  :func:`tile_scope_footprint` and :func:`hoisted_footprint` count the bytes every live tile
  of the emitted kernel occupies, and :func:`ascend_tiling` picks the largest ``BLOCK_T`` (a
  power of two in [:data:`MIN_BLOCK_T`, :data:`MAX_BLOCK_T`]) at which every chain's whole
  row fits. When even :data:`MIN_BLOCK_T` tokens of a chain's row do not fit, that chain is
  processed in **head chunks** (the largest power-of-two head count that fits), emitted as
  static power-of-two parts (``chunk_mode="unroll"``: 24 heads are 16 + 8, no padded heads
  taking UB) or as a runtime loop (``"loop"``). Nothing is clamped silently: when one head of
  :data:`MIN_BLOCK_T` tokens does not fit, :class:`TileDoesNotFit` says so with the numbers.

A kernel with a product (the projected form, ``fqr.<op>_proj``: the QKV GEMM with the prologue
as its epilogue) multiplies on the AI cores' **cube unit** instead (``tl.dot``: a mix kernel,
one cube and its two vector cores per program): :func:`ascend_product_tiling` sizes it from
the UB and from the cube's own buffers per AI core (:class:`CubeBuffers`: L0A / L0B for one K
step's operands, L0C for its fp32 products, L1 staging both), and the grid is one program per
AI core walking (token tile, head group) items, each K loop whole: no split-K, no workspace,
no atomics (:attr:`Tiling.persistent_blocks`).

The emitted source itself is the generic one (``fqr/lowering/emit.py``): positions and cos/sin
are loaded as vectors of the token tile and used as tensors (a position is never read back as
a scalar from a tile whose load may still be in flight, the flaw of vllm-ascend issue 16674).

UB sizes (bytes per vector core), from Huawei's Ascend C documentation:

========  =====================  =========  =====================================================
chip      Triton-Ascend arch     UB         note
========  =====================  =========  =====================================================
``A2``    ``Ascend910B3``        192 KiB    Atlas A2 (910B1-B4); the compiler double-buffers loads
``A3``    ``Ascend910_9391``     192 KiB    Atlas A3 (910C, two 910B-class dies per package)
``950``   ``Ascend910_9599``     248 KiB    Ascend 950PR/950DT, SIMD-only kernels (216 KiB when
                                            SIMD and SIMT mix; these kernels are SIMD)
========  =====================  =========  =====================================================

Cube buffers (bytes per AI core): L1 512 KiB, L0A 64 KiB, L0B 64 KiB, L0C 128 KiB on A2 / A3
(CATLASS, ``Catlass::Arch::AtlasA2`` in include/catlass/arch/arch.hpp, which also gives the
UB's 192 KiB); the 950's L0C 256 KiB (ops-transformer, gmm/common/groupedmatmul_act/utils/
arch.h for ``__NPU_ARCH__ == 3101``), its others unchanged.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch

from ..core import Role, lookup
from .emit import static_parts
from .plan import Chain, KernelPlan, next_pow2
from .targets import Target, cdiv, register_target
from .tiling import Tiling

KIB = 1024
DEFAULT_NUM_VECTORCORE = 40
DEFAULT_INTERPRET_VECTORCORES = 3
# AI cores (one cube unit and two vector cores each) of an Atlas 800T A2 (Ascend910B3): the
# persistent grid of a kernel that multiplies on the cube (CATLASS's AscendC910B3 MaxBlock).
DEFAULT_NUM_AICORE = 20
DEFAULT_INTERPRET_AICORES = 3
MAX_BLOCK_T = 16
# triton-adapter-opt (triton-ascend 3.2.0) aborts on single-token tiles: once BLOCK_T == 1 folds
# the token axis away, the cos/sin row pointer shared by two gathers trips its assertion
# "tt.addptr has multiple users" (BlockPtrAnalysis.cpp). So tiles hold >= 2 tokens and a row
# that does not fit twice is split into head chunks instead.
MIN_BLOCK_T = 2
UB_RESERVE_BYTES = 16 * KIB  # compiler scratch: reduction workspaces, masks, index vectors
UB_ALIGN = 32  # UB buffers are allocated in 32-byte blocks
FP32 = 4


@dataclass(frozen=True)
class CubeBuffers:
    """The cube unit's on-chip buffers of one AI core, in bytes: L1 (staging of both
    operands from global memory), L0A / L0B (the left / right operand of one multiply), L0C
    (its fp32 result)."""

    l1: int
    l0a: int
    l0b: int
    l0c: int


# Atlas A2 / A3 (dav-c220): CATLASS's ``Catlass::Arch::AtlasA2`` (include/catlass/arch/arch.hpp:
# L1 512 KiB, L0A 64 KiB, L0B 64 KiB, L0C 128 KiB, UB 192 KiB); the 950 (Ascend910_95,
# dav-c310): L0C 256 KiB, the others unchanged (ops-transformer's
# gmm/common/groupedmatmul_act/utils/arch.h, ``__NPU_ARCH__ == 3101``).
CUBE_A2 = CubeBuffers(l1=512 * KIB, l0a=64 * KIB, l0b=64 * KIB, l0c=128 * KIB)
CUBE_950 = CubeBuffers(l1=512 * KIB, l0a=64 * KIB, l0b=64 * KIB, l0c=256 * KIB)


@dataclass(frozen=True)
class AscendChip:
    name: str
    arch: str  # the GPUTarget arch Triton-Ascend compiles for
    ub_bytes: int  # Unified Buffer per vector core
    multibuffer: bool  # Triton-Ascend's default auto multi-buffering of loads/stores
    compile_on_910_95: bool
    cube: CubeBuffers = CUBE_A2  # the cube unit's buffers per AI core

    @property
    def summary(self) -> str:
        return f"{self.name} ({self.arch}, UB {self.ub_bytes // KIB} KiB per vector core)"


CHIPS: dict[str, AscendChip] = {
    c.name: c
    for c in [
        AscendChip("A2", "Ascend910B3", 192 * KIB, multibuffer=True, compile_on_910_95=False),
        AscendChip("A3", "Ascend910_9391", 192 * KIB, multibuffer=True, compile_on_910_95=False),
        AscendChip(
            "950",
            "Ascend910_9599",
            248 * KIB,
            multibuffer=False,
            compile_on_910_95=True,
            cube=CUBE_950,
        ),  # fmt: skip
    ]
}
DEFAULT_CHIP = "A2"


class UnsupportedOnChip(ValueError):
    """The program needs something the chip does not have (the message says what)."""


FP8_STORES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_store_dtypes(plan: KernelPlan, chip: AscendChip) -> None:
    """Refuse FP8 stores before the 950: the A2/A3 vector units have no FP8 type, and
    Triton-Ascend 3.2.0 compiles ``tl.float8e4nv`` only for Ascend910_95 (its compile options
    carry ``allow_fp8e4nv=False``); vllm-ascend likewise runs FP8 KV caches on A5 only."""
    stores = [(f"output {i}", v.aval.dtype) for i, v in enumerate(plan.program.outputs)]
    stores += [
        (
            f"input {i} (a paged cache)"
            if dtype == v.aval.dtype
            else f"a field of input {i} (a byte-layout paged cache)",
            dtype,
        )
        for i, v in enumerate(plan.program.inputs)
        if plan.input_role(v) is Role.CACHE
        for dtype in sorted(plan.stored_dtypes(v), key=str)
    ]
    fp8 = [(what, dtype) for what, dtype in stores if dtype in FP8_STORES]
    if fp8 and not chip.compile_on_910_95:
        what, dtype = fp8[0]
        raise UnsupportedOnChip(
            f"{what} is {dtype}: FP8 stores need an Ascend 950 (chip='950'); {chip.summary} "
            f"has no FP8 (Triton-Ascend compiles float8e4nv only for Ascend910_95)"
        )


def default_chip(plan: KernelPlan) -> AscendChip:
    """The chip when none is named (``chip=``) or detected (an NPU): ``$FQR_ASCEND_CHIP`` when
    set, else the 950 for a program that stores FP8 (the one chip that has it: what an offline
    compile check or the interpreter of such a program can only mean), else A2."""
    if not os.environ.get("FQR_ASCEND_CHIP") and stores_fp8(plan):
        return CHIPS["950"]
    return get_chip()


def stores_fp8(plan: KernelPlan) -> bool:
    """Whether the program stores an FP8 value (an output, or into a paged cache it updates:
    an FP8 cache, or an FP8 field of a byte-layout entry)."""
    return any(v.aval.dtype in FP8_STORES for v in plan.program.outputs) or any(
        dtype in FP8_STORES
        for v in plan.program.inputs
        if plan.input_role(v) is Role.CACHE
        for dtype in plan.stored_dtypes(v)
    )


class TileDoesNotFit(ValueError):
    """Even the smallest tile (:data:`MIN_BLOCK_T` tokens of one head) exceeds the UB budget."""


def get_chip(name: str | None = None) -> AscendChip:
    name = name or os.environ.get("FQR_ASCEND_CHIP") or DEFAULT_CHIP
    return lookup(CHIPS, name, "chip")


def chip_of_arch(arch: str) -> AscendChip:
    """The chip family of a SoC name as the NPU driver reports it (``Ascend910B3`` -> A2)."""
    a = arch.replace(" ", "")
    if a.startswith(("Ascend910_95", "Ascend950")):
        return CHIPS["950"]
    if a.startswith("Ascend910_93"):
        return CHIPS["A3"]
    if a.startswith("Ascend910B") or a.startswith("Ascend910_B"):
        return CHIPS["A2"]
    raise ValueError(f"unknown Ascend SoC {arch!r}: pass chip= (one of {', '.join(CHIPS)})")


@functools.lru_cache(maxsize=1)
def detected_chip() -> AscendChip | None:
    """The chip of NPU 0 when torch_npu sees one (None offline: the default chip applies)."""
    import importlib.util

    if importlib.util.find_spec("torch_npu") is None:
        return None
    import torch_npu  # noqa: F401  (registers torch.npu)

    if not torch.npu.is_available():  # type: ignore[attr-defined]
        return None
    return chip_of_arch(torch.npu.get_device_name(0))  # type: ignore[attr-defined]


def ub_budget(chip: AscendChip, ub_bytes: int | None = None) -> int:
    """Bytes the kernel's tiles may occupy: the UB (or the override) minus the compiler reserve."""
    if ub_bytes is None and os.environ.get("FQR_ASCEND_UB_BYTES"):
        text = os.environ["FQR_ASCEND_UB_BYTES"]
        if not text.strip().isdigit():
            raise ValueError(f"ub_bytes: $FQR_ASCEND_UB_BYTES must be a byte count, got {text!r}")
        ub_bytes = int(text)
    ub = chip.ub_bytes if ub_bytes is None else ub_bytes
    if not isinstance(ub, int) or isinstance(ub, bool) or ub <= UB_RESERVE_BYTES:
        raise ValueError(
            f"ub_bytes must be an int > {UB_RESERVE_BYTES} (the compiler reserve), got {ub!r}"
        )
    return ub - UB_RESERVE_BYTES


# ----------------------------------------------------------------------- the footprint model


def _buf(nbytes: int) -> int:
    return -(-nbytes // UB_ALIGN) * UB_ALIGN


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


@dataclass(frozen=True)
class ChainShape:
    """What the footprint of one chain depends on (taken from a :class:`Chain` of the plan)."""

    name: str
    heads: int
    head_dim: int
    padded_features: int  # sum of the padded widths of the layout's slots
    in_bytes: int
    out_bytes: int
    compute_free: bool  # a pure copy (v): no fp32 working set
    row_vectors: int  # [H*D] vectors (a full-width norm's weight, bias) loaded per head chunk

    @classmethod
    def of(cls, chain: Chain, plan: KernelPlan) -> ChainShape:
        outs = [o for o in plan.program.outputs if plan.chain_of.get(id(o)) is chain]
        out_dtype = outs[-1].aval.dtype if outs else chain.packed.aval.dtype
        # The row of a one-head value is that head: its vectors are hoisted (hoisted_footprint).
        row_vectors = len(chain.operands(Role.ROW_VECTOR)) if chain.heads > 1 else 0
        return cls(
            f"chain{chain.index}",
            chain.heads,
            chain.head_dim,
            chain.head_layout.padded_elems,
            _itemsize(chain.packed.aval.dtype),
            _itemsize(out_dtype),
            chain.compute_free,
            row_vectors,
        )


# fp32 copies of a head live at once in a compute chain: the loaded value, the normalised value
# and the rotated result (the emitter's pieces; the pass-through piece is shared, so this is an
# upper bound).
FP32_LIVE_COPIES = 3


CHUNK_MODES = ("unroll", "loop")


def heads_held(heads: int, head_chunk: int, chunk_mode: str) -> int:
    """Heads one tile holds at once: the padded chunk (``loop``: a runtime loop over equal,
    masked chunks) or the largest of the static power-of-two parts (``unroll``: 24 heads in
    chunks of 16 are 16 + 8, no padding, no head mask)."""
    if chunk_mode == "loop":
        return next_pow2(head_chunk)
    if chunk_mode == "unroll":
        return max(n for _, n in static_parts(heads, head_chunk))
    raise ValueError(f"chunk_mode must be one of {CHUNK_MODES}, got {chunk_mode!r}")


def chain_footprint(
    c: ChainShape, block_t: int, head_chunk: int, multibuffer: bool, chunk_mode: str = "unroll"
) -> int:
    """UB bytes of one chain's tiles for ``block_t`` tokens x ``head_chunk`` heads."""
    held = heads_held(c.heads, head_chunk, chunk_mode)
    elems = block_t * held * c.padded_features
    mb = 2 if multibuffer else 1
    if c.compute_free:
        return mb * (_buf(elems * c.in_bytes) + _buf(elems * c.out_bytes))
    total = mb * _buf(elems * c.in_bytes)  # load staging
    total += FP32_LIVE_COPIES * _buf(elems * FP32)  # fp32 working set
    total += mb * _buf(elems * c.out_bytes)  # store staging
    total += 2 * _buf(block_t * held * FP32)  # per-head sum of squares, rstd
    total += c.row_vectors * _buf(held * c.padded_features * FP32)  # [1, HC, D] row vectors
    return total


def tile_scope_footprint(plan: KernelPlan, block_t: int, multibuffer: bool) -> int:
    """Bytes live for the whole token tile: indices, masks, per-token inputs, gathered table rows
    (a table's row is gathered once per token, in pieces that together pad to ``next_pow2`` of
    its width: the worst case, whatever columns the rules take)."""
    mb = 2 if multibuffer else 1
    total = _buf(block_t * 4) + _buf(block_t * 8) + _buf(block_t)  # tok, tok64, tmask
    for v in plan.program.inputs:
        role = plan.input_role(v)
        if role is Role.INDEX or role is Role.TOKEN_VALUE:
            total += mb * _buf(block_t * _itemsize(v.aval.dtype))
        elif role is Role.TABLE:
            width = v.aval.shape[1]
            assert isinstance(width, int)
            padded = next_pow2(width)
            total += mb * _buf(block_t * padded * _itemsize(v.aval.dtype))
            total += _buf(block_t * padded * FP32)
    return total


def hoisted_footprint(plan: KernelPlan) -> int:
    """Head vectors (a per-head norm's weight and bias), loaded once before the token loop (fp32);
    the row vectors of one-head values are hoisted too."""
    total = 0
    for c in plan.chains:
        vectors = c.operands(Role.HEAD_VECTOR)
        if c.heads == 1:
            vectors += c.operands(Role.ROW_VECTOR)
        total += len(vectors) * _buf(c.head_layout.padded_elems * FP32)
    return total


@dataclass(frozen=True)
class AscendTiling:
    """The profile's decision, with the numbers behind it."""

    tiling: Tiling
    chip: AscendChip
    budget: int  # bytes available to tiles
    footprint: int  # bytes the chosen tiling occupies (<= budget)
    chain_bytes: tuple[int, ...]  # per chain, at the chosen tiling
    chunked: tuple[str, ...] = field(default=())  # "chain0: 64 heads in chunks of 16"
    # a kernel with a product (the projected form): its K step's bytes in the cube's buffers
    cube: CubeFootprint | None = None

    def describe(self) -> str:
        chunks = "; ".join(self.chunked)
        return (
            f"{self.chip.summary}: BLOCK_T={self.tiling.block_t}, head chunks "
            f"{list(self.tiling.head_chunks)}, footprint {self.footprint / KIB:.1f} KiB of "
            f"{self.budget / KIB:.1f} KiB budget"
            + (f" ({chunks})" if self.chunked else "")
            + (
                f"; cube K step {self.tiling.block_k}: {self.cube.describe(self.chip.cube)}"
                if self.cube is not None
                else ""
            )
        )


def ascend_tiling(
    plan: KernelPlan,
    chip: AscendChip | None = None,
    ub_bytes: int | None = None,
    block_t: int | None = None,
    max_block_t: int = MAX_BLOCK_T,
    bf16_rounding: str = "native",
    chunk_mode: str = "unroll",
) -> AscendTiling:
    """Choose ``BLOCK_T`` and per-chain head chunks so that the kernel's tiles fit the UB.

    Chains (q, k, v) run one after the other inside a token tile, so the footprint is the
    tile-scope and hoisted tensors plus the largest chain. ``block_t`` forces the token tile
    (head chunks are still chosen to fit it).
    """
    chip = chip or default_chip(plan)
    check_store_dtypes(plan, chip)
    budget = ub_budget(chip, ub_bytes)
    shapes = [ChainShape.of(c, plan) for c in plan.chains]
    mb = chip.multibuffer
    fixed = hoisted_footprint(plan)

    def fits(bt: int, chunks: list[int]) -> tuple[bool, int, list[int]]:
        per = [chain_footprint(s, bt, hc, mb, chunk_mode) for s, hc in zip(shapes, chunks)]
        total = fixed + tile_scope_footprint(plan, bt, mb) + max(per)
        return total <= budget, total, per

    whole = [s.heads for s in shapes]
    if block_t is None:
        if not isinstance(max_block_t, int) or max_block_t < MIN_BLOCK_T:
            raise ValueError(f"max_block_t must be an int >= {MIN_BLOCK_T}, got {max_block_t!r}")
        bt = 1 << (max_block_t.bit_length() - 1)  # the largest power of two <= max_block_t
        while bt > MIN_BLOCK_T and not fits(bt, whole)[0]:
            bt //= 2
    else:
        if (
            not isinstance(block_t, int)
            or isinstance(block_t, bool)
            or block_t < MIN_BLOCK_T
            or block_t & (block_t - 1)
        ):
            raise ValueError(f"block_t must be a power of two >= {MIN_BLOCK_T}, got {block_t!r}")
        bt = block_t
    chunks = list(whole)
    ok, total, per = fits(bt, chunks)
    if not ok:
        # Whole rows do not fit even at this token tile: split the chains that overflow.
        base = fixed + tile_scope_footprint(plan, bt, mb)
        for i, s in enumerate(shapes):
            hc = next_pow2(s.heads)
            while (
                hc >= 1 and base + chain_footprint(s, bt, min(hc, s.heads), mb, chunk_mode) > budget
            ):
                hc //= 2
            if hc < 1:
                raise TileDoesNotFit(
                    f"{s.name} ({s.heads} heads x {s.head_dim}): one head of {bt} token(s) needs "
                    f"{(base + chain_footprint(s, bt, 1, mb, chunk_mode)) / KIB:.1f} KiB of UB, "
                    f"the budget is {budget / KIB:.1f} KiB ({chip.summary}, "
                    f"{UB_RESERVE_BYTES // KIB} KiB reserved)"
                    + (
                        "; a larger ub_bytes is needed"
                        if bt == MIN_BLOCK_T
                        else "; use a smaller block_t"
                    )
                )
            chunks[i] = min(hc, s.heads)
        ok, total, per = fits(bt, chunks)
        assert ok, "head chunking must produce a fitting tiling"
    chunked = tuple(
        f"{s.name}: {s.heads} heads in chunks of {hc}"
        for s, hc in zip(shapes, chunks)
        if hc < s.heads
    )
    tiling = Tiling(
        block_t=bt,
        head_chunks=tuple(chunks),
        bf16_rounding=bf16_rounding,
        chunk_mode=chunk_mode,
        # Triton-Ascend 3.2 refuses pointer casts between widths ("Casting pointers with
        # unmatched bitwidth"): a bf16 / fp32 value goes into a byte entry byte by byte
        byte_stores="bytes" if plan.wide_byte_fields else "cast",
    )
    return AscendTiling(tiling, chip, budget, total, tuple(per), chunked)


# ----------------------------------------------------------------------- the cube unit

# The projected form (a chain whose packed row is ``x @ w.T (+ bias)``, computed in the kernel:
# :class:`fqr.lowering.plan.ProductSource`) multiplies on the cube unit (``tl.dot``: the
# kernel compiles in Triton-Ascend's mix mode, one AI core's cube and vector cores per
# program) and runs its epilogue, the traced prologue, on the vector cores out of the UB. No
# split-K: no workspace, no atomics; each program walks (token tile, head group) work items
# (:attr:`Tiling.persistent_blocks`) and runs every item's K loop whole.
CUBE_FRACTAL = 16  # the cube multiplies 16 x 16 fractals: a tile's M and N pad to 16
CUBE_STAGES = 2  # operand buffers per K step: the next step's tiles load while one multiplies
MIN_BLOCK_K = 16
MAX_BLOCK_K = 256
PRODUCT_MAX_BLOCK_T = 64
# Token bucket of a projected kernel: up to this many tokens, tiles of at most one fractal of
# rows (a decode step computes no more rows than the cube does anyway).
PRODUCT_DECODE_TOKENS = 16
# fp32 tiles of a head group a product chain holds in the UB beside its epilogue's: the
# accumulators, the zero each K step's dot starts from (fqr.lowering.product: every step's
# product added to the accumulator by an fp32 add) and that step's products out of L0C.
PRODUCT_UB_TILES = 3
# The options of the cuda target's product schedules that the cube lowering has no use for.
# option -> the values it may take here (split_k 0 or 1: off)
CUDA_PRODUCT_OPTIONS = {
    "split_k": (0, 1),
    "product_dot": ("mma",),
    "product_operands": ("native",),
    "k_stages": (0,),
}


def _fractal(n: int) -> int:
    return -(-n // CUBE_FRACTAL) * CUBE_FRACTAL


@dataclass(frozen=True)
class CubeFootprint:
    """Bytes one K step of a head group's dot products holds in each cube buffer: x's
    ``[BLOCK_T, BLOCK_K]`` tile in L0A, a piece's weight tile ``[BLOCK_K, heads x width]`` in
    L0B (the widest piece), the step's fp32 products of every piece in L0C, both operands of
    every piece staged in L1; L0A, L0B and L1 :data:`CUBE_STAGES` times over. M and N are
    counted padded to the cube's fractal (:data:`CUBE_FRACTAL`)."""

    l1: int
    l0a: int
    l0b: int
    l0c: int

    def _rows(self, cube: CubeBuffers) -> list[tuple[str, int, int]]:
        return [
            ("L0A", self.l0a, cube.l0a),
            ("L0B", self.l0b, cube.l0b),
            ("L0C", self.l0c, cube.l0c),
            ("L1", self.l1, cube.l1),
        ]

    def over(self, cube: CubeBuffers) -> list[str]:
        """The buffers of ``cube`` this footprint overflows, each with its numbers."""
        return [
            f"{name} {need / KIB:.1f} KiB > {have // KIB} KiB"
            for name, need, have in self._rows(cube)
            if need > have
        ]

    def describe(self, cube: CubeBuffers) -> str:
        return ", ".join(
            f"{name} {need / KIB:.1f}/{have // KIB} KiB" for name, need, have in self._rows(cube)
        )

    @staticmethod
    def largest(footprints: list[CubeFootprint]) -> CubeFootprint:
        """Each buffer's largest need among ``footprints`` (the kernel's blocks run one at a
        time on a core)."""
        return CubeFootprint(
            *(max(getattr(f, k) for f in footprints) for k in ("l1", "l0a", "l0b", "l0c"))
        )


def product_pieces(chain: Chain, held: int) -> list[int]:
    """The N of each dot of one K step for ``held`` heads: one per piece of the head layout
    (RoPE's halves, GPT-J's even and odd features, the pass-through runs)."""
    return [held * slot.padded for slot in chain.head_layout.slots for _ in slot.names]


def cube_footprint(chain: Chain, block_t: int, held: int, block_k: int) -> CubeFootprint:
    """:class:`CubeFootprint` of a product chain's K step: ``block_t`` tokens, ``held``
    heads, ``block_k`` columns of x and of the weight rows, operands in x's dtype."""
    product = chain.product
    assert product is not None, "a cube footprint is a product chain's"
    operand = _itemsize(product.hidden.aval.dtype)
    m = _fractal(block_t)
    pieces = product_pieces(chain, held)
    a = m * block_k * operand
    b = [block_k * _fractal(n) * operand for n in pieces]
    return CubeFootprint(
        l1=CUBE_STAGES * (a + sum(b)),
        l0a=CUBE_STAGES * a,
        l0b=CUBE_STAGES * max(b),
        l0c=sum(m * _fractal(n) * FP32 for n in pieces),
    )


def product_chain_footprint(
    s: ChainShape, chain: Chain, block_t: int, held: int, multibuffer: bool
) -> int:
    """UB bytes of a product chain's tiles for ``block_t`` tokens x ``held`` heads: the fp32
    accumulators with each K step's zero and products (:data:`PRODUCT_UB_TILES`), the
    epilogue's fp32 working set (:data:`FP32_LIVE_COPIES`; one copy for a chain that only
    stores its product, such as v), the store staging, the per-head statistics, the rows of
    the projection bias and of the chain's row vectors."""
    product = chain.product
    assert product is not None, "a product chain's footprint"
    elems = block_t * held * s.padded_features
    mb = 2 if multibuffer else 1
    live = 1 if s.compute_free else FP32_LIVE_COPIES
    total = (PRODUCT_UB_TILES + live) * _buf(elems * FP32)
    total += mb * _buf(elems * s.out_bytes)
    if not s.compute_free:
        total += 2 * _buf(block_t * held * FP32)
    rows = s.row_vectors + (product.bias is not None)
    total += rows * _buf(held * s.padded_features * FP32)
    return total


def _power_of_two_option(name: str, value: object, least: int) -> int:
    """An option that is 0 (the profile's choice) or a power of two >= ``least``."""
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be 0 or a power of two >= {least}, got {value!r}")
    if value and (value < least or value & (value - 1)):
        raise ValueError(f"{name} must be 0 or a power of two >= {least}, got {value!r}")
    return value


def ascend_product_tiling(
    plan: KernelPlan,
    chip: AscendChip | None = None,
    ub_bytes: int | None = None,
    max_block_t: int = PRODUCT_MAX_BLOCK_T,
    min_block_t: int = MIN_BLOCK_T,
    heads_per_program: int = 0,
    block_k: int = 0,
    bf16_rounding: str = "native",
    min_dot: int = 1,
) -> AscendTiling:
    """The tiling of a kernel with a product (the projected form) on the cube unit.

    Each program block is a group of heads of one chain (``heads_per_program``, default 1:
    the weight's rows spread over the most work items; a chain normalised over its whole row
    stays one block, in the largest power-of-two head chunks that fit at ``min_block_t``
    tokens: fewer chunks, each of which computes its products twice, before more tokens per
    tile). ``BLOCK_T`` is the
    largest power of two in [``min_block_t``, ``max_block_t``] at which every block fits
    both budgets: the UB (the tile scope, the hoisted vectors and the largest block's
    :func:`product_chain_footprint`, as :func:`ascend_tiling` counts a row's) and the cube's
    buffers (:func:`cube_footprint` at the smallest K step, :data:`MIN_BLOCK_K`). The K step
    is then the largest power of two up to :data:`MAX_BLOCK_K` (and not past K) that every
    block's operands fit, unless ``block_k`` pins it. When even ``min_block_t`` tokens of one
    head group do not fit, :class:`TileDoesNotFit` says which buffer, with the numbers.
    ``min_dot``: the target's smallest ``tl.dot`` (:attr:`Tiling.min_dot`).
    """
    chip = chip or default_chip(plan)
    check_store_dtypes(plan, chip)
    budget = ub_budget(chip, ub_bytes)
    if not isinstance(max_block_t, int) or isinstance(max_block_t, bool) or max_block_t < 1:
        raise ValueError(f"max_block_t must be a positive int, got {max_block_t!r}")
    top = 1 << (max_block_t.bit_length() - 1)  # the largest power of two <= max_block_t
    if top < min_block_t:
        raise ValueError(
            f"max_block_t must be >= {min_block_t} for a kernel with a product on this target, "
            f"got {max_block_t}"
        )
    per_program = _power_of_two_option("heads_per_program", heads_per_program, 1) or 1
    pinned_k = _power_of_two_option("block_k", block_k, MIN_BLOCK_K)
    depth = max(c.product.depth for c in plan.chains if c.product is not None)
    shapes = [ChainShape.of(c, plan) for c in plan.chains]
    mb = chip.multibuffer
    fixed = hoisted_footprint(plan)

    def held(c: Chain, chunk: int) -> int:
        return heads_held(c.heads, chunk, "unroll") if c.row_reductions else chunk

    def needs(i: int, bt: int, chunk: int, bk: int) -> tuple[int, CubeFootprint]:
        c = plan.chains[i]
        n = held(c, chunk)
        ub = fixed + tile_scope_footprint(plan, bt, mb)
        ub += product_chain_footprint(shapes[i], c, bt, n, mb)
        return ub, cube_footprint(c, bt, n, bk)

    def fits(i: int, bt: int, chunk: int, bk: int) -> bool:
        ub, cube = needs(i, bt, chunk, bk)
        return ub <= budget and not cube.over(chip.cube)

    first_k = pinned_k or MIN_BLOCK_K
    # Each block's heads: a group of ``per_program``; a chain normalised over its whole row
    # the largest power-of-two chunk that fits at the smallest tile (its chunks are static
    # parts, each computing its products twice, for the row's sums and for the epilogue:
    # fewer parts before more tokens per tile).
    chunks: list[int] = []
    for i, c in enumerate(plan.chains):
        if c.row_reductions:
            hc = next_pow2(c.heads)
            while hc > 1 and not fits(i, min_block_t, min(hc, c.heads), first_k):
                hc //= 2
            chunks.append(min(hc, c.heads))
        else:
            chunks.append(min(per_program, next_pow2(c.heads)))

    def all_fit(bt: int, bk: int) -> bool:
        return all(fits(i, bt, h, bk) for i, h in enumerate(chunks))

    bt = top
    while bt > min_block_t and not all_fit(bt, first_k):
        bt //= 2
    if not all_fit(bt, first_k):
        raise TileDoesNotFit(_product_misfit(plan, shapes, chip, budget, bt, per_program, needs))
    if pinned_k:
        bk = pinned_k
    else:
        bk = min(MAX_BLOCK_K, max(MIN_BLOCK_K, next_pow2(depth)))
        while bk > MIN_BLOCK_K and not all_fit(bt, bk):
            bk //= 2
    per = [needs(i, bt, h, bk) for i, h in enumerate(chunks)]
    grouped = any(h < c.heads for h, c in zip(chunks, plan.chains) if not c.row_reductions)
    tiling = Tiling(
        block_t=bt,
        head_chunks=tuple(chunks),
        bf16_rounding=bf16_rounding,
        chunk_mode="grid",
        byte_stores="bytes" if plan.wide_byte_fields else "cast",
        heads_per_program=per_program if grouped else 0,
        block_k=bk,
        product_dot="mma",
        persistent_blocks=True,
        min_dot=min_dot,
    )
    base = fixed + tile_scope_footprint(plan, bt, mb)
    chunked = tuple(
        f"{s.name}: {s.heads} heads in chunks of {hc}"
        for s, hc, c in zip(shapes, chunks, plan.chains)
        if c.row_reductions and hc < s.heads
    )
    return AscendTiling(
        tiling,
        chip,
        budget,
        max(ub for ub, _ in per),
        tuple(ub - base for ub, _ in per),
        chunked,
        CubeFootprint.largest([cube for _, cube in per]),
    )


def _product_misfit(
    plan: KernelPlan,
    shapes: list[ChainShape],
    chip: AscendChip,
    budget: int,
    block_t: int,
    per_program: int,
    needs,
) -> str:
    """Why no head group of ``block_t`` tokens fits: the first chain that does not, the
    buffers it overflows with the numbers, one line."""
    for i, (c, s) in enumerate(zip(plan.chains, shapes)):
        group = 1 if c.row_reductions else min(per_program, next_pow2(c.heads))
        ub, cube = needs(i, block_t, group, MIN_BLOCK_K)
        over = [f"UB {ub / KIB:.1f} KiB > {budget / KIB:.1f} KiB"] if ub > budget else []
        over += cube.over(chip.cube)
        if over:
            depth = c.product.depth if c.product is not None else 0
            heads = f"{group} head{'s' if group > 1 else ''}"
            return (
                f"{s.name} ({c.heads} heads x {c.head_dim}, K = {depth}): {heads} of "
                f"{block_t} token(s) at the smallest K step ({MIN_BLOCK_K}) needs "
                f"{'; '.join(over)} on {chip.summary}, whose UB less {UB_RESERVE_BYTES // KIB} "
                "KiB for the compiler is the budget"
                + ("; use a smaller heads_per_program" if group > 1 else "")
            )
    return f"no head group of {block_t} tokens fits {chip.summary}"


# ----------------------------------------------------------------------- vector cores


def npu_core_count(device: torch.device | int | None = None, kind: str = "num_vectorcore") -> int:
    """``num_vectorcore`` (or ``num_aicore``) of an NPU, as Triton-Ascend's driver reports it."""
    import triton

    index = device.index if isinstance(device, torch.device) else device
    if index is None:
        # torch_npu registers torch.npu
        index = torch.npu.current_device()  # type: ignore[attr-defined]
    props = triton.runtime.driver.active.utils.get_device_properties(index)
    return int(props[kind])


def npu_vector_core_count(device: torch.device | int | None = None) -> int:
    """``num_vectorcore`` of an NPU, as Triton-Ascend's driver reports it."""
    return npu_core_count(device, "num_vectorcore")


def vector_core_count(
    device: torch.device | None = None,
    num_vectorcore: int | None = None,
    default: int = DEFAULT_NUM_VECTORCORE,
) -> int:
    """The persistent grid size: the option, else the NPU's count, else ``default``."""
    if num_vectorcore is not None:
        if (
            not isinstance(num_vectorcore, int)
            or isinstance(num_vectorcore, bool)
            or num_vectorcore < 1
        ):
            raise ValueError(f"num_vectorcore must be a positive int, got {num_vectorcore!r}")
        return num_vectorcore
    if device is not None and torch.device(device).type == "npu":
        return npu_vector_core_count(torch.device(device))
    return default


def ai_core_count(
    device: torch.device | None = None,
    num_aicore: int | None = None,
    default: int = DEFAULT_NUM_AICORE,
) -> int:
    """The persistent grid of a kernel that multiplies on the cube (one program per AI core):
    the ``num_aicore`` option, else the NPU's ``num_aicore`` (Triton-Ascend's driver), else
    ``default``."""
    if num_aicore is not None:
        if not isinstance(num_aicore, int) or isinstance(num_aicore, bool) or num_aicore < 1:
            raise ValueError(f"num_aicore must be a positive int, got {num_aicore!r}")
        return num_aicore
    if device is not None and torch.device(device).type == "npu":
        return npu_core_count(torch.device(device), "num_aicore")
    return default


# ----------------------------------------------------------------------- the targets


@dataclass(frozen=True)
class AscendTarget(Target):
    """Triton-Ascend on NPUs: one program per vector core, UB-sized tiles (module docstring)."""

    default_vector_cores: int = DEFAULT_NUM_VECTORCORE
    # the persistent grid of a kernel with a product (the cube's programs) where no NPU says
    default_ai_cores: int = DEFAULT_NUM_AICORE
    # the smallest M, N, K its tl.dot takes (Tiling.min_dot): Triton-Ascend's compiler and
    # upstream Triton pad small M and N themselves; Triton-Ascend 3.2's interpreter asserts 16
    min_dot: int = 1
    bf16_rounding: str = "native"  # the NPU's fp32 -> bf16 conversion rounds to nearest even
    chunk_mode: str = "unroll"  # static power-of-two head parts: no padded heads in the UB

    def ascend_tiling(self, plan: KernelPlan, **options) -> AscendTiling:
        """Options: ``chip`` (A2, A3, 950; default: the NPU's, else ``$FQR_ASCEND_CHIP`` or A2),
        ``ub_bytes`` (overrides the chip's UB), ``max_block_t``; for a kernel with a product
        (the projected form, :func:`ascend_product_tiling`) ``heads_per_program``,
        ``block_k`` and ``num_aicore`` too; others are ignored here."""
        chip = options.get("chip")
        if chip is not None and not isinstance(chip, AscendChip):
            chip = get_chip(chip)
        if options.get("num_vectorcore") is not None:
            vector_core_count(num_vectorcore=options["num_vectorcore"])  # validate before emitting
        if plan.products:
            return self._product_tiling(plan, chip, options)
        return ascend_tiling(
            plan,
            chip=chip or detected_chip(),
            ub_bytes=options.get("ub_bytes", options.get("buffer_bytes")),
            block_t=options.get("block_t"),
            max_block_t=options.get("max_block_t", MAX_BLOCK_T),
            bf16_rounding=self.bf16_rounding,
            chunk_mode=options.get("chunk_mode", self.chunk_mode),
        )

    def _product_tiling(
        self, plan: KernelPlan, chip: AscendChip | None, options: dict
    ) -> AscendTiling:
        """The cube lowering of a projected kernel; the cuda target's schedules that it has no
        use for (split-K, the broadcast product, TF32 operands, chunk modes) are refused with
        one line naming the option."""
        for option, allowed in CUDA_PRODUCT_OPTIONS.items():
            value = options.get(option)
            if value is not None and value not in allowed:
                raise ValueError(
                    f"{option}={value!r}: target {self.name} multiplies on the cube unit "
                    f"(tl.dot, each program's K loop whole: no split-K workspace or atomics); "
                    f"{option} must be {allowed[-1]!r} there"
                )
        if options.get("chunk_mode") not in (None, "grid"):
            raise ValueError(
                f"chunk_mode={options['chunk_mode']!r}: a kernel with a product (the projected "
                f"form) on target {self.name} runs head groups as work items ('grid')"
            )
        if options.get("num_aicore") is not None:
            ai_core_count(num_aicore=options["num_aicore"])  # validate before emitting
        return ascend_product_tiling(
            plan,
            chip=chip or detected_chip(),
            ub_bytes=options.get("ub_bytes", options.get("buffer_bytes")),
            max_block_t=options.get("max_block_t", PRODUCT_MAX_BLOCK_T),
            min_dot=self.min_dot,
            heads_per_program=options.get("heads_per_program") or 0,
            block_k=options.get("block_k") or 0,
            bf16_rounding=self.bf16_rounding,
        )

    def tiling(self, plan: KernelPlan, **options) -> Tiling:
        return self.ascend_tiling(plan, **options).tiling

    def token_buckets(self, plan: KernelPlan, **options) -> tuple[tuple[int | None, dict], ...]:
        """A projected kernel with no tile option pinned: up to
        :data:`PRODUCT_DECODE_TOKENS` tokens, tiles of at most that many (the cube's fractal),
        then the budget's; other kernels: one variant."""
        pinned = ("max_block_t", "block_k", "heads_per_program")
        if not plan.products or any(options.get(k) is not None for k in pinned):
            return ((None, dict(options)),)
        decode = {"max_block_t": PRODUCT_DECODE_TOKENS}
        return ((PRODUCT_DECODE_TOKENS, {**decode, **options}), (None, dict(options)))

    def grid(self, tokens: int, tile: int, device: torch.device, **options) -> int:
        """One program per vector core, but never more programs than token tiles; a kernel
        whose persistent loop walks (token tile, head group) items (``work_per_tile`` of them
        per tile, :attr:`Tiling.persistent_blocks`: the projected form) one program per AI
        core, never more than there are items."""
        work = options.get("work_per_tile")
        if work:
            cores = ai_core_count(device, options.get("num_aicore"), self.default_ai_cores)
            return max(1, min(cores, cdiv(tokens, tile) * work))
        cores = vector_core_count(device, options.get("num_vectorcore"), self.default_vector_cores)
        return max(1, min(cores, cdiv(tokens, tile)))


register_target(AscendTarget("ascend", flavour="ascend"))
# The ascend kernel under Triton-Ascend's interpreter: the same tiling and body, with a small
# persistent grid so that every program runs several token tiles (the multi-tile path an NPU
# takes at large batch sizes), and bf16 rounding done on the bits (the interpreter's own
# fp32 -> bf16 cast truncates).
register_target(
    AscendTarget(
        "ascend-interpret",
        interpret=True,
        flavour="ascend",
        default_vector_cores=DEFAULT_INTERPRET_VECTORCORES,
        default_ai_cores=DEFAULT_INTERPRET_AICORES,
        bf16_rounding="bits",
        # its tl.dot asserts M, N, K >= 16 (triton-ascend 3.2's interpreter builder)
        min_dot=CUBE_FRACTAL,
    )
)
