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
class AscendChip:
    name: str
    arch: str  # the GPUTarget arch Triton-Ascend compiles for
    ub_bytes: int  # Unified Buffer per vector core
    multibuffer: bool  # Triton-Ascend's default auto multi-buffering of loads/stores
    compile_on_910_95: bool

    @property
    def summary(self) -> str:
        return f"{self.name} ({self.arch}, UB {self.ub_bytes // KIB} KiB per vector core)"


CHIPS: dict[str, AscendChip] = {
    c.name: c
    for c in [
        AscendChip("A2", "Ascend910B3", 192 * KIB, multibuffer=True, compile_on_910_95=False),
        AscendChip("A3", "Ascend910_9391", 192 * KIB, multibuffer=True, compile_on_910_95=False),
        AscendChip("950", "Ascend910_9599", 248 * KIB, multibuffer=False, compile_on_910_95=True),
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

    def describe(self) -> str:
        chunks = "; ".join(self.chunked)
        return (
            f"{self.chip.summary}: BLOCK_T={self.tiling.block_t}, head chunks "
            f"{list(self.tiling.head_chunks)}, footprint {self.footprint / KIB:.1f} KiB of "
            f"{self.budget / KIB:.1f} KiB budget" + (f" ({chunks})" if self.chunked else "")
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


# ----------------------------------------------------------------------- vector cores


def npu_vector_core_count(device: torch.device | int | None = None) -> int:
    """``num_vectorcore`` of an NPU, as Triton-Ascend's driver reports it."""
    import triton

    index = device.index if isinstance(device, torch.device) else device
    if index is None:
        # torch_npu registers torch.npu
        index = torch.npu.current_device()  # type: ignore[attr-defined]
    props = triton.runtime.driver.active.utils.get_device_properties(index)
    return int(props["num_vectorcore"])


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


# ----------------------------------------------------------------------- the targets


@dataclass(frozen=True)
class AscendTarget(Target):
    """Triton-Ascend on NPUs: one program per vector core, UB-sized tiles (module docstring)."""

    default_vector_cores: int = DEFAULT_NUM_VECTORCORE
    bf16_rounding: str = "native"  # the NPU's fp32 -> bf16 conversion rounds to nearest even
    chunk_mode: str = "unroll"  # static power-of-two head parts: no padded heads in the UB

    def ascend_tiling(self, plan: KernelPlan, **options) -> AscendTiling:
        """Options: ``chip`` (A2, A3, 950; default: the NPU's, else ``$FQR_ASCEND_CHIP`` or A2),
        ``ub_bytes`` (overrides the chip's UB), ``max_block_t``; others are ignored here."""
        chip = options.get("chip")
        if chip is not None and not isinstance(chip, AscendChip):
            chip = get_chip(chip)
        if options.get("num_vectorcore") is not None:
            vector_core_count(num_vectorcore=options["num_vectorcore"])  # validate before emitting
        return ascend_tiling(
            plan,
            chip=chip or detected_chip(),
            ub_bytes=options.get("ub_bytes", options.get("buffer_bytes")),
            block_t=options.get("block_t"),
            max_block_t=options.get("max_block_t", MAX_BLOCK_T),
            bf16_rounding=self.bf16_rounding,
            chunk_mode=options.get("chunk_mode", self.chunk_mode),
        )

    def tiling(self, plan: KernelPlan, **options) -> Tiling:
        if plan.products:
            raise ValueError(
                f"target {self.name}: the projected form's GEMM-epilogue kernel is built for the "
                "cuda and interpret targets only (its cube-unit lowering is not; issue 40): run "
                "torch.matmul, then the prologue op"
            )
        return self.ascend_tiling(plan, **options).tiling

    def grid(self, tokens: int, tile: int, device: torch.device, **options) -> int:
        """One program per vector core, but never more programs than token tiles."""
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
        bf16_rounding="bits",
    )
)
