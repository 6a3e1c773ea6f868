"""Kernel plan + target profile -> Triton source text.

The emitted kernel is persistent: program ``pid`` handles token tiles ``pid, pid + NPROG, ...``
of ``BLOCK_T`` tokens, so the token count ``T`` is a runtime argument (``do_not_specialize``:
a new batch size never recompiles) and the launcher picks the grid. Inside a tile, each chain
(q, k, v) is processed head-chunk by head-chunk (one chunk of all heads unless the target's
tiling splits it), as 3-D register tiles ``[BLOCK_T, heads, features]``.

The text for each primitive comes from its emit rule (``fqr/ops/*.py``), which calls the
:class:`KernelBuilder` through the :class:`fqr.core.EmitContext` interface: ``pieces`` (a
value's register tiles, loading a view of the packed row on first use), ``vector`` (a head or
row vector), ``token_values`` and ``gather`` (per-token values and table rows, loaded once per
token tile and shared by every chain), ``sum_squares`` (per head, or over the whole row: summed
in a first pass over the chunks when the row is chunked), ``set`` (bind an equation's result).

Source has three scopes: before the token loop (``emit_pre``: index vectors, head vectors),
the top of each token tile (``emit_tile``: positions, table rows, per-token values; requested
lazily, written at the tile's start), and the chain bodies (``emit``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core import TOKENS, ProgramPrinter, Reduction, Role, Var
from .plan import Chain, KernelPlan, Layout, PlanError, Slot, next_pow2
from .product import ProductEmission, head_offset
from .tiling import Tiling

TL_DTYPES = {
    torch.bfloat16: "tl.bfloat16",
    torch.float16: "tl.float16",
    torch.float32: "tl.float32",
    torch.float64: "tl.float64",
    torch.float8_e4m3fn: "tl.float8e4nv",
    torch.float8_e5m2: "tl.float8e5",
    torch.uint8: "tl.uint8",
}
EMITTER_VERSION = "3"
# The [T] inputs read one element per token (an index, or a number): with ``strided_indices``
# each is read through its element stride.
PER_TOKEN = (Role.INDEX, Role.TOKEN_VALUE)


def static_parts(heads: int, chunk: int) -> list[tuple[int, int]]:
    """Cover ``heads`` with power-of-two chunks of at most ``chunk`` heads: 24, 16 -> 16 + 8."""
    parts, h0 = [], 0
    while h0 < heads:
        n = min(chunk, 1 << ((heads - h0).bit_length() - 1))
        n = 1 << (n.bit_length() - 1)
        parts.append((h0, n))
        h0 += n
    return parts


@dataclass(frozen=True)
class Block:
    """A block of a kernel's work: ``chain``'s static head ``parts`` in one program, or (with
    ``groups`` > 1, the decode schedule :attr:`Tiling.heads_per_program`) its heads in
    ``groups`` groups of ``group`` heads, one program each, the first head of a group computed
    from the program index."""

    chain: Chain
    parts: list[tuple[int, int]]
    groups: int = 1
    group: int = 0


def chunk_blocks(plan: KernelPlan, tiling: Tiling) -> list[Block]:
    """The program blocks of a kernel. In ``grid`` mode each block takes ``groups`` program
    indices along grid axis 1 (one per static chunk, or per head group with
    ``heads_per_program``); otherwise there is one block per chain."""
    blocks = []
    for chain, hc in zip(plan.chains, tiling.head_chunks):
        parts = static_parts(chain.heads, hc) if tiling.chunk_mode != "loop" else []
        grid = tiling.chunk_mode == "grid" and not chain.row_reductions
        groups = -(-chain.heads // hc)
        if grid and tiling.heads_per_program and groups > 1:
            blocks.append(Block(chain, [], groups, hc))
        elif grid:
            blocks += [Block(chain, [part]) for part in parts]
        else:
            blocks.append(Block(chain, parts))
    return blocks


def block_count(plan: KernelPlan, tiling: Tiling) -> int:
    """The program blocks per token tile: one per chunk block in ``grid`` mode (a block of
    head groups, one per group), else 1."""
    if tiling.chunk_mode != "grid":
        return 1
    return sum(b.groups for b in chunk_blocks(plan, tiling))


def grid_programs(plan: KernelPlan, tiling: Tiling) -> int:
    """The programs along grid axis 1 (per token tile): :func:`block_count`, or 1 where the
    persistent loop walks the blocks (:attr:`Tiling.persistent_blocks`)."""
    return 1 if tiling.persistent_blocks else block_count(plan, tiling)


ROUND_TO_BF16 = {
    # Hardware conversion: round to nearest even on NVIDIA (cvt.rn.bf16.f32) and Ascend.
    "native": (
        "@triton.jit",
        "def round_to_bf16(x):",
        '    """fp32 -> bf16, round to nearest even (the hardware conversion)."""',
        "    return x.to(tl.bfloat16)",
        "",
        "",
    ),
    # Triton's interpreter truncates fp32 -> bf16; round to nearest even on the bits instead.
    "bits": (
        "@triton.jit",
        "def round_to_bf16(x):",
        '    """fp32 -> bf16, round to nearest even on the bits '
        '(the interpreter\'s cast truncates)."""',
        "    bits = x.to(tl.uint32, bitcast=True)",
        "    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000",
        "    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True)).to(tl.bfloat16)",
        "",
        "",
    ),
}


FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
ROUND_TO_FP8E4M3 = {
    # Hardware conversion (cvt.rn.satfinite.e4m3x2.f32 on NVIDIA sm89+): nearest even, after a
    # clamp to +-448 that keeps NaN.
    "native": (
        "@triton.jit",
        "def round_to_fp8e4m3(x):",
        '    """fp32 -> float8_e4m3fn: clamp to +-448 (NaN kept), round to nearest even."""',
        f"    y = tl.minimum(tl.maximum(x, {-FP8_E4M3_MAX!r}), {FP8_E4M3_MAX!r})",
        "    return tl.where(x != x, x, y).to(tl.float8e4nv)",
        "",
        "",
    ),
    # Triton's interpreter converts fp32 -> fp8 with a round-half-up that loses the carry into
    # the exponent (31.5 -> 16); encode the E4M3 bits here instead: normals round to 3
    # mantissa bits on the fp32 bits (nearest even, the carry moves the exponent), subnormals
    # (|x| < 2^-6) to multiples of 2^-9 by the 2^23 trick, then a bit cast.
    "bits": (
        "@triton.jit",
        "def round_to_fp8e4m3(x):",
        '    """fp32 -> float8_e4m3fn: clamp to +-448 (NaN kept), round to nearest even, '
        'encoded on the bits."""',
        "    nan = x != x",
        f"    y = tl.minimum(tl.maximum(x, {-FP8_E4M3_MAX!r}), {FP8_E4M3_MAX!r})",
        "    sign = (y.to(tl.uint32, bitcast=True) >> 24) & 0x80",
        "    a = tl.abs(y)",
        "    bits = a.to(tl.uint32, bitcast=True)",
        "    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000",
        "    normal = (((bits >> 23) - 120) << 3) | ((bits >> 20) & 7)",
        "    subnormal = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)",
        "    code = tl.where(a < 0.015625, subnormal, normal)",
        "    code = tl.where(nan, 0x7F, code) | sign",
        "    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)",
        "",
        "",
    ),
}


FP8_E5M2_MAX = float(torch.finfo(torch.float8_e5m2).max)
# fp32 -> float8_e5m2, encoded on the fp32 bits on every target (as the E5M2 cache stores
# encode their bytes: one encoding everywhere, no compiler's conversion trusted): saturate to
# +-57344 keeping NaN, normals rounded to 2 mantissa bits (nearest even, the carry moves the
# exponent; bias 127 -> 15), subnormals (|x| < 2^-14) to multiples of 2^-16 by the 2^23 trick,
# then a bit cast.
ROUND_TO_FP8E5M2 = (
    "@triton.jit",
    "def round_to_fp8e5m2(x):",
    '    """fp32 -> float8_e5m2: clamp to +-57344 (NaN kept), round to nearest even, encoded '
    'on the bits."""',
    "    nan = x != x",
    f"    y = tl.minimum(tl.maximum(x, {-FP8_E5M2_MAX!r}), {FP8_E5M2_MAX!r})",
    "    sign = (y.to(tl.uint32, bitcast=True) >> 24) & 0x80",
    "    a = tl.abs(y)",
    "    bits = a.to(tl.uint32, bitcast=True)",
    "    bits = (bits + 0xFFFFF + ((bits >> 21) & 1)) & 0xFFE00000",
    "    small = tl.where(a < 0.00006103515625, a, 0.0)",
    "    subnormal = ((small * 65536.0 + 8388608.0) - 8388608.0).to(tl.uint32)",
    "    normal = (((bits >> 23) - 112) << 2) | ((bits >> 21) & 3)",
    "    code = tl.where(a < 0.00006103515625, subnormal, normal)",
    "    code = tl.where(nan, 0x7F, code) | sign",
    "    return code.to(tl.uint8).to(tl.float8e5, bitcast=True)",
    "",
    "",
)


@dataclass(frozen=True)
class EmittedKernel:
    """A kernel's generated source and what its code asks of the compiler: with
    ``rounding_points`` it rounds between steps (``EmitContext.round_point``), which a
    multiply-add contraction would skip, so it is compiled without one."""

    source: str
    rounding_points: bool


class KernelBuilder(ProductEmission):
    """Writes one kernel (:meth:`build`); emit rules see it as a :class:`fqr.core.EmitContext`.
    ``strided_outputs``: every output takes its head stride as a parameter, for ``[T, H, D]``
    output views whose heads sit at a stride; ``strided_indices``: every per-token input
    (positions, slots, per-token numbers) its element stride."""

    def __init__(
        self,
        plan: KernelPlan,
        tiling: Tiling,
        kernel_name: str,
        header: str,
        strided_outputs: bool = False,
        strided_indices: bool = False,
    ) -> None:
        self.plan, self.tiling, self.kernel_name, self.header = plan, tiling, kernel_name, header
        # Each output takes its head stride as a parameter (``out{i}_hstride``): heads that sit
        # at a stride in the caller's buffer (a [T, H, D] view of a wider [T, H, D'] row).
        self.strided_outputs = strided_outputs
        # Each per-token input (INDEX, TOKEN_VALUE) takes its element stride as a parameter
        # (``{name}_istride``): positions read through their stride (``positions[:, 0]`` of
        # a ``[T, 2]`` buffer), as indices or as numbers.
        self.strided_indices = strided_indices
        # The runtime length parameters of the INDEX inputs whose length is their own symbol
        # (not T): ``[N]`` with N <= T, read for tokens below N only (a slot mapping shorter
        # than the padded batch). Not specialised, as T is not.
        self.lengths: dict[int, str] = {}
        self.printer = ProgramPrinter(plan.program)
        self.printer.render()  # name every variable in program order, as the comment shows it
        self.pre: list[str] = []  # before the token loop (hoisted)
        self.body: list[str] = []  # inside the token loop
        self.indent = 2
        self._tile_at = 0  # where tile-scope lines go in body
        self._tile_indent = 2
        self._counter = 0
        self._hoisted: dict[tuple, object] = {}
        self._tile: dict[tuple, object] = {}
        self.values: dict[int, dict[str, str]] = {}
        self.arg_names: dict[int, str] = {}
        self._chain: Chain | None = None
        self.head_valid: str | None = None
        self.row_sumsq: dict[int, str] = {}  # id(var) -> its row statistic from a first pass
        self.uses_round_bf16 = False
        self.uses_round_fp8 = False
        self.uses_round_fp8e5m2 = False
        self.rounding_points = False  # round_point was emitted: no FMA contraction
        self.split_depth = 0  # chain-body lines under a split-K's last-range test
        self.aliases = plan.program.aliases()  # output index -> the input it updates in place
        self.head_tile = "1"  # heads in the current chunk's tiles (a literal)
        self.param_list: list[str] = []
        self.dense_strides: list[tuple[str, int]] = []  # (stride parameter, its row width)
        self._bind_params()

    @property
    def chain(self) -> Chain:
        assert self._chain is not None, "no chain is being emitted"
        return self._chain

    # -------------------------------------------------------------- names and text
    def fresh(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}{self._counter}"

    def emit(self, line: str) -> None:
        self.body.append("    " * self.indent + line)

    def emit_pre(self, line: str) -> None:
        self.pre.append("    " + line)

    def emit_tile(self, line: str) -> None:
        """A line at the top of the current token tile (before any chain)."""
        self.body.insert(self._tile_at, "    " * self._tile_indent + line)
        self._tile_at += 1

    def _open_tile_scope(self) -> None:
        self._tile_at, self._tile_indent = len(self.body), self.indent
        self._tile = {}

    def _tile_value(self, key: tuple, prefix: str, expr: Callable[[], str]) -> str:
        """A fresh name (``prefix`` and a number) bound to ``expr()`` at the top of the current
        token tile, once per tile and ``key``: later requests for ``key`` get that name."""
        if key not in self._tile:
            name = self.fresh(prefix)
            self.emit_tile(f"{name} = {expr()}")
            self._tile[key] = name
        return str(self._tile[key])

    def var_name(self, var: Var) -> str:
        return self.printer.name(var)

    def _bind_params(self) -> None:
        for v in self.plan.program.inputs:
            role = self.plan.input_role(v)
            base = f"{self.var_name(v)}_ptr"
            self.arg_names[id(v)] = base
            self.param_list.append(base)
            if role in (Role.VALUE, Role.TABLE, Role.HIDDEN):
                self.param_list.append(f"{self.var_name(v)}_stride")
                self.dense_strides.append((f"{self.var_name(v)}_stride", int(v.aval.shape[1])))
            if role is Role.TABLE:
                self.param_list.append(f"{self.var_name(v)}_rows")
            if role in PER_TOKEN and self.strided_indices:
                self.param_list.append(f"{self.var_name(v)}_istride")
            if role is Role.INDEX and v.aval.shape[0] != TOKENS:
                self.lengths[id(v)] = f"{self.var_name(v)}_len"
                self.param_list.append(self.lengths[id(v)])
            if role is Role.CACHE:  # block, row-in-block (and head) strides; rows in all blocks
                name = self.var_name(v)
                strides = [f"{name}_s{i}" for i in range(v.aval.ndim - 1)]
                self.param_list += [*strides, f"{name}_rows"]
        for i, o in enumerate(self.plan.program.outputs):
            if i not in self.aliases:  # an updated input is written through that input
                self.param_list += [f"out{i}_ptr", f"out{i}_stride"]
                self.dense_strides.append((f"out{i}_stride", int(o.aval.shape[1])))
                if self.strided_outputs:
                    self.param_list.append(f"out{i}_hstride")
                    head_dim = self.plan.chain_of[id(o)].head_dim
                    self.dense_strides.append((f"out{i}_hstride", head_dim))
        if self.tiling.uses_workspace:  # the split-K workspace and its per-tile counts
            self.param_list += ["ws_ptr", "count_ptr"]
        self.param_list += ["T", "BLOCK_T: tl.constexpr", "DENSE: tl.constexpr"]

    def cast(self, expr: str, dtype: torch.dtype) -> str:
        """``expr`` (fp32) rounded to ``dtype``, round-to-nearest-even on every target."""
        if dtype == torch.bfloat16:
            self.uses_round_bf16 = True
            return f"round_to_bf16({expr})"
        if dtype == torch.float8_e4m3fn:
            self.uses_round_fp8 = True
            return f"round_to_fp8e4m3({expr})"
        if dtype == torch.float8_e5m2:
            self.uses_round_fp8e5m2 = True
            return f"round_to_fp8e5m2({expr})"
        return f"({expr}).to({TL_DTYPES[dtype]})"

    def round_point(self, expr: str, dtype: torch.dtype) -> str:
        self.rounding_points = True
        return f"{self.cast(expr, dtype)}.to(tl.float32)"

    # -------------------------------------------------------------- index vectors
    def cols(self, padded: int) -> str:
        key = ("cols", padded)
        if key not in self._hoisted:
            name = f"cols{padded}"
            self.emit_pre(f"{name} = tl.arange(0, {padded})[None, None, :]")
            self._hoisted[key] = name
        return str(self._hoisted[key])

    def pair_cols(self, padded: int) -> tuple[str, str]:
        """([1,1,NPP,2] feature offsets 2i+k, [1,1,NPP,1] pair index) for a GPT-J pair tile."""
        key = ("pairs", padded)
        if key not in self._hoisted:
            idx, offs = f"pair{padded}", f"paircols{padded}"
            self.emit_pre(f"{idx} = tl.arange(0, {padded})[None, None, :, None]")
            self.emit_pre(f"{offs} = 2 * {idx} + tl.arange(0, 2)[None, None, None, :]")
            self._hoisted[key] = (offs, idx)
        offs, idx = self._hoisted[key]  # type: ignore[misc]
        return offs, idx

    def slot_offsets(self, slot: Slot) -> tuple[str, str | None, bool]:
        """(offset expression, extra mask or None, is_pair) for one slot, relative to a head."""
        if slot.kind == "contig":
            c = self.cols(slot.padded)
            mask = None if slot.padded == slot.count else f"({c} < {slot.count})"
            off = c if slot.start == 0 else f"({slot.start} + {c})"
            return off, mask, False
        offs, idx = self.pair_cols(slot.padded)
        mask = None if slot.padded == slot.count else f"({idx} < {slot.count})"
        off = offs if slot.start == 0 else f"({slot.start} + {offs})"
        return off, mask, True

    def _pair_row(self, slot: Slot) -> tuple[str, str | None]:
        """(offsets ``[1, 1, 2 * padded]`` of a pair slot's features as one contiguous row,
        the mask of its padding or None), for ``pair_access="reshape"``."""
        c = self.cols(2 * slot.padded)
        mask = None if slot.padded == slot.count else f"({c} < {2 * slot.count})"
        return (c if slot.start == 0 else f"({slot.start} + {c})"), mask

    # -------------------------------------------------------------- loads and stores
    def _load_slots(
        self,
        base: str,
        mask: str | None,
        layout: Layout,
        cast: bool,
        prefix: str,
        emit: Callable[[str], None],
        scalar_base: bool = False,
        lead: str = "BLOCK_T",
    ) -> dict[str, str]:
        """Load ``layout``'s slots at ``base`` (``[lead, heads, 1]``, or ``[1, 1, 1]`` with
        ``scalar_base``) as fp32 pieces (``cast``)."""
        pieces = {}
        for slot in layout.slots:
            if slot.kind == "pairs" and self.tiling.pair_access == "reshape":
                a, b = (self.fresh(f"{prefix}_{n}_") for n in slot.names)
                off, smask = self._pair_row(slot)
                m = " & ".join(x for x in (mask, smask) if x) or None
                load = f"tl.load({base} + {off}" + (f", mask={m}, other=0.0)" if m else ")")
                if cast:
                    load += ".to(tl.float32)"
                lead_heads = "1, 1" if scalar_base else f"{lead}, {self.head_tile}"
                emit(f"{a}, {b} = tl.split(tl.reshape({load}, [{lead_heads}, {slot.padded}, 2]))")
                pieces[slot.names[0]], pieces[slot.names[1]] = a, b
                continue
            off, smask, pair = self.slot_offsets(slot)
            m = mask
            if pair and m is not None:
                m = f"{m}[:, :, :, None]"
            m = " & ".join(x for x in (m, smask) if x) or None
            ptr = (
                f"{base}[:, :, :, None] + {off}" if pair and not scalar_base else f"{base} + {off}"
            )
            load = f"tl.load({ptr}" + (f", mask={m}, other=0.0)" if m else ")")
            if cast:
                load += ".to(tl.float32)"
            if pair:
                a, b = (self.fresh(f"{prefix}_{n}_") for n in slot.names)
                emit(f"{a}, {b} = tl.split({load})")
                pieces[slot.names[0]], pieces[slot.names[1]] = a, b
            else:
                name = self.fresh(f"{prefix}_{slot.names[0]}_")
                emit(f"{name} = {load}")
                pieces[slot.names[0]] = name
        return pieces

    def _store_slots(
        self,
        base: str,
        mask: str,
        layout: Layout,
        pieces: dict[str, str],
        dtype: torch.dtype | None,
        byte_size: int = 0,
    ) -> None:
        """Store ``pieces`` at ``base`` (rounded to ``dtype``; None: as they are). ``byte_size``:
        ``base`` is a byte address and each value (``byte_size`` bytes) is stored byte by byte
        (:meth:`_store`)."""
        cast = (lambda e: e) if dtype is None else (lambda e: self.cast(e, dtype))  # noqa: E731
        for slot in layout.slots:
            if slot.kind == "pairs" and self.tiling.pair_access == "reshape":
                off, smask = self._pair_row(slot)
                joined = f"tl.join({pieces[slot.names[0]]}, {pieces[slot.names[1]]})"
                shape = f"[BLOCK_T, {self.head_tile}, {2 * slot.padded}]"
                val = cast(f"tl.reshape({joined}, {shape})")
                m = f"{mask} & {smask}" if smask else mask
                self._store(base, off, val, m, byte_size)
                continue
            off, smask, pair = self.slot_offsets(slot)
            m = f"{mask}[:, :, :, None]" if pair else mask
            if smask:
                m = f"{m} & {smask}"
            if pair:
                val = cast(f"tl.join({pieces[slot.names[0]]}, {pieces[slot.names[1]]})")
                self._store(f"{base}[:, :, :, None]", off, val, m, byte_size)
            else:
                self._store(base, off, cast(pieces[slot.names[0]]), m, byte_size)

    def _store(self, base: str, off: str, val: str, mask: str, byte_size: int = 0) -> None:
        """``tl.store(base + off, val)``; with ``byte_size`` (the ``byte_stores="bytes"``
        tiling), ``base`` is a uint8 address: ``val``'s bits, byte ``k`` (little-endian) to
        ``base + byte_size * off + k``."""
        if not byte_size:
            at = base if off == "0" else f"{base} + {off}"
            self.emit(f"tl.store({at}, {val}, mask={mask})")
            return
        bits = self.fresh("bits")
        self.emit(f"{bits} = ({val}).to(tl.uint{8 * byte_size}, bitcast=True)")
        for k in range(byte_size):
            byte = f"({bits} >> {8 * k}) & 255" if k else f"{bits} & 255"
            at = base if off == "0" else f"{base} + {byte_size} * {off}"
            self.emit(f"tl.store({at}{f' + {k}' if k else ''}, ({byte}).to(tl.uint8), mask={mask})")

    def _source_slots(self, chain: Chain, mask: str, prefix: str) -> dict[str, str]:
        """The chain's source value in the current head tile as pieces: loaded from its packed
        row, or, for a product-sourced chain, computed (:meth:`_product_slots`)."""
        if chain.product is not None:
            return self._product_slots(chain, prefix)
        return self._load_slots(
            self._head_base(chain), mask, chain.head_layout, not chain.compute_free, prefix,
            self.emit,
        )  # fmt: skip

    # -------------------------------------------------------------- tile-scope values
    def _index(self, var: Var) -> str:
        """An INDEX input ``[T]`` (positions) as ``[BLOCK_T]`` (0 past the last token), read
        through its stride where the kernel takes one; an input of its own length ``[N]``
        reads the tokens below N only (:meth:`index_mask`)."""
        return self._tile_value(
            ("index", id(var)), "pos", lambda: self._per_token_load(var, self.index_mask(var), "0")
        )

    def index_mask(self, var: Var) -> str:
        """The tokens of the tile that INDEX input ``var`` has an entry for: ``tmask``, or
        for an input of its own length ``[N]`` also ``tok < N``."""
        length = self.lengths.get(id(var))
        if length is None:
            return "tmask"
        return self._tile_value(("imask", id(var)), "imask", lambda: f"tmask & (tok < {length})")

    def token_values(self, var: Var) -> str:
        return self._tile_value(
            ("tokval", id(var)),
            "tokval",
            lambda: self._per_token_load(var, "tmask", "1.0") + ".to(tl.float32)",
        )

    def _per_token_load(self, var: Var, mask: str, other: str) -> str:
        """``tl.load`` of the per-token input ``var`` (``[T]``: an INDEX or TOKEN_VALUE) at
        every token of the tile, through its element stride where the kernel takes one."""
        at = f"tok64 * {self.var_name(var)}_istride" if self.strided_indices else "tok"
        return f"tl.load({self.arg_names[id(var)]} + {at}, mask={mask}, other={other})"

    def gather(self, table: Var, index: Var, start: int, count: int, name: str = "g") -> str:
        row_key = ("row", id(table), id(index))
        if row_key not in self._tile:
            pos = self._index(index)
            t = self.var_name(table)
            ok, row = self.fresh("posok"), self.fresh(f"{t}row")
            valid = self.index_mask(index)
            # An index outside the table reads nothing and yields NaN: loud, never OOB.
            self.emit_tile(f"{ok} = (({valid} & ({pos} >= 0) & ({pos} < {t}_rows)))[:, None, None]")
            self.emit_tile(f"{row} = {t}_ptr + {pos}.to(tl.int64)[:, None, None] * {t}_stride")
            self._tile[row_key] = (ok, row)
        ok, row = self._tile[row_key]  # type: ignore[misc]
        padded = next_pow2(count)
        c = self.cols(padded)
        m = ok + ("" if padded == count else f" & ({c} < {count})")
        at = f"{row} + {c}" if start == 0 else f"{row} + {start} + {c}"
        return self._tile_value(
            ("gather", id(table), id(index), start, count),
            name,
            lambda: f"tl.load({at}, mask={m}, other=float('nan')).to(tl.float32)",
        )

    def scalar(self, var: Var) -> str:
        key = ("scalar", id(var))
        if key not in self._hoisted:
            name = self.fresh("scalar")
            self.emit_pre(f"{name} = tl.load({self.arg_names[id(var)]}).to(tl.float32)")
            self._hoisted[key] = name
        return str(self._hoisted[key])

    def _slot_row(self, cache: Var, slots: Var) -> tuple[str, str]:
        """(mask ``[BLOCK_T, 1, 1]`` of the tokens that store, address of their entries): the
        entry address of ``slots[t]`` in the buffer ``cache`` updates, once per token tile."""
        root = self.plan.cache_root(cache)
        key = ("slotrow", id(root), id(slots))
        if key not in self._tile:
            slot = self._index(slots)
            valid = self.index_mask(slots)  # a token past a shorter slot mapping: no store
            c = self.var_name(root)
            block_size = root.aval.shape[1]
            s64, ok, row = self.fresh("slot"), self.fresh("slotok"), self.fresh(f"{c}row")
            self.emit_tile(f"{s64} = {slot}.to(tl.int64)")
            # A negative slot is padding; one past the cache would be out of bounds: no store.
            self.emit_tile(f"{ok} = ({valid} & ({s64} >= 0) & ({s64} < {c}_rows))[:, None, None]")
            self.emit_tile(
                f"{row} = ({c}_ptr + ({s64} // {block_size}) * {c}_s0 + ({s64} % {block_size})"
                f" * {c}_s1)[:, None, None]"
            )
            self._tile[key] = (ok, row)
        ok, row = self._tile[key]  # type: ignore[misc]
        return ok, row

    def _byte_size(self, root: Var, dtype: torch.dtype) -> int:
        """The bytes of each ``dtype`` value stored one by one into ``root``'s entries (0: the
        value is stored whole, through a ``dtype`` pointer): a value wider than a byte, into a
        byte-layout entry, under the ``byte_stores="bytes"`` tiling."""
        wider = root.aval.dtype == torch.uint8 and dtype.itemsize > 1
        return dtype.itemsize if wider and self.tiling.byte_stores == "bytes" else 0

    def _entry_at(self, root: Var, row: str, offset: int, dtype: torch.dtype) -> str:
        """The address of entry element ``offset`` of ``row``, as a ``dtype`` pointer (a byte
        address where :meth:`_byte_size` stores byte by byte)."""
        at = row if offset == 0 else f"({row} + {offset})"
        if dtype == root.aval.dtype or self._byte_size(root, dtype):
            return at
        return f"{at}.to(tl.pointer_type({TL_DTYPES[dtype]}))"

    def scatter_rows(
        self,
        cache: Var,
        slots: Var,
        pieces: dict[str, str],
        *,
        offset: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Store ``pieces`` into the paged ``cache`` at ``slots[t]`` (see
        :meth:`fqr.core.EmitContext.scatter_rows`); the entry address is computed once per
        token tile, the head offset per chunk."""
        root = self.plan.cache_root(cache)
        dtype = root.aval.dtype if dtype is None else dtype
        ok, row = self._slot_row(cache, slots)
        mask, base = self.fresh("smask"), self.fresh("sbase")
        c = self.var_name(root)
        self.emit(f"{mask} = hmask & {ok}")
        if root.aval.ndim == 4:
            if offset or dtype != root.aval.dtype:
                raise PlanError(f"a 4-D cache {root.aval} stores whole heads of its own dtype")
            self.emit(f"{base} = {row} + hh * {c}_s2")
        else:
            size = self._byte_size(root, dtype)
            head = self.chain.head_dim * max(size, 1)
            self.emit(f"{base} = {self._entry_at(root, row, offset, dtype)} + hh * {head}")
            self._store_slots(base, mask, self.chain.head_layout, pieces, dtype, size)
            return
        self._store_slots(base, mask, self.chain.head_layout, pieces, dtype)

    def scatter_head_values(
        self, cache: Var, slots: Var, value: str, *, offset: int, dtype: torch.dtype
    ) -> None:
        """Store one number per head (see :meth:`fqr.core.EmitContext.scatter_head_values`)."""
        root = self.plan.cache_root(cache)
        if root.aval.ndim != 3:
            raise PlanError(f"per-head values are stored into a 3-D cache entry, not {root.aval}")
        ok, row = self._slot_row(cache, slots)
        mask, base = self.fresh("smask"), self.fresh("sbase")
        self.emit(f"{mask} = hmask & {ok}")
        size = self._byte_size(root, dtype)
        head = f"hh * {size}" if size else "hh"
        self.emit(f"{base} = {self._entry_at(root, row, offset, dtype)} + {head}")
        self._store(base, "0", self.cast(f"{value}[:, :, None]", dtype), mask, size)

    def head_sum(self, pieces: dict[str, str]) -> str:
        """sum over each head's features of ``pieces``, ``[BLOCK_T, heads]`` (layout padding
        left out: see :meth:`fqr.core.EmitContext.head_sum`)."""
        terms = []
        for slot in self.chain.head_layout.slots:
            for name in slot.names:
                v = pieces[name]
                if slot.padded != slot.count:
                    v = f"tl.where({self.cols(slot.padded)} < {slot.count}, {v}, 0.0)"
                terms.append(f"tl.sum({v}, 2)")
        out = self.fresh("hsum")
        self.emit(f"{out} = " + " + ".join(terms))
        return out

    def head_amax(self, var: Var) -> str:
        """max |x| over each head's features, ``[BLOCK_T, heads]`` (layout padding left out)."""
        pieces = self.pieces(var)
        terms = []
        for slot in self.chain.head_layout.slots:
            for name in slot.names:
                v = f"tl.abs({pieces[name]})"
                if slot.padded != slot.count:
                    v = f"tl.where({self.cols(slot.padded)} < {slot.count}, {v}, 0.0)"
                terms.append(f"tl.max({v}, 2)")
        out = self.fresh("amax")
        expr = terms[0]
        for t in terms[1:]:
            expr = f"tl.maximum({expr}, {t})"
        self.emit(f"{out} = {expr}")
        return out

    # -------------------------------------------------------------- chain values
    def pieces(self, var: Var) -> dict[str, str]:
        if id(var) not in self.values:
            chain = self.plan.chain_of[id(var)]
            if var is not chain.source:
                raise PlanError(f"value {self.var_name(var)} used before it was computed")
            self.values[id(var)] = self._source_slots(chain, "hmask", self.var_name(var))
        return self.values[id(var)]

    def set(self, var: Var, pieces: dict[str, str]) -> None:
        self.values[id(var)] = pieces

    def _role_of_row(self, role: Role) -> Role:
        # The row of a one-head value is that head: its vector is a head vector (hoisted).
        return Role.HEAD_VECTOR if role is Role.ROW_VECTOR and self.chain.heads == 1 else role

    def vector(self, var: Var, role: Role) -> dict[str, str]:
        """``[1, 1, NP]`` pieces of a head vector (hoisted), ``[1, HC, NP]`` of a row vector."""
        chain = self.chain
        role = self._role_of_row(role)
        if role is Role.HEAD_VECTOR:
            key = ("w", id(var), chain.layout)
            if key not in self._hoisted:
                self._hoisted[key] = self._load_slots(
                    self.arg_names[id(var)],
                    None,
                    chain.head_layout,
                    cast=True,
                    prefix=self.var_name(var) + "w",
                    emit=self.emit_pre,
                    scalar_base=True,
                )
            return dict(self._hoisted[key])  # type: ignore[call-overload]
        if role is not Role.ROW_VECTOR:
            raise PlanError(f"a vector operand must be a head or row vector, not a {role.value}")
        base = self.fresh("wbase")
        self.emit(f"{base} = {self.arg_names[id(var)]} + hh * {chain.head_dim}")
        return self._load_slots(
            base,
            self.head_valid,
            chain.head_layout,
            cast=True,
            prefix=self.var_name(var) + "w",
            emit=self.emit,
            lead="1",
        )

    def _group(self, over: Reduction) -> Reduction:
        return Reduction.HEAD if self.chain.heads == 1 else over

    def sum_squares(self, var: Var, over: Reduction) -> str:
        pieces = self.pieces(var)
        if self._group(over) is Reduction.HEAD:
            ss = self.fresh("sumsq")
            self.emit(f"{ss} = " + " + ".join(f"tl.sum({v} * {v}, 2)" for v in pieces.values()))
            return ss
        if id(var) in self.row_sumsq:  # the row is chunked: its first pass summed it
            return self.row_sumsq[id(var)]
        ss = self.fresh("sumsq")
        self.emit(
            f"{ss} = " + " + ".join(f"tl.sum(tl.sum({v} * {v}, 2), 1)" for v in pieces.values())
        )
        return ss

    def keepdims(self, over: Reduction) -> str:
        return "[:, :, None]" if self._group(over) is Reduction.HEAD else "[:, None, None]"

    # -------------------------------------------------------------- chain emission
    def _head_base(self, chain: Chain) -> str:
        return f"(row{chain.index} + {chain.section.offset} + {head_offset(chain.section)})"

    def emit_static_block(self, chain: Chain, parts: list[tuple[int, int]]) -> None:
        """A chain (or part of it) as static power-of-two head chunks, unmasked."""
        self._chain = chain
        self._emit_chain_header(chain, parts)
        if len(parts) > 1:
            self._emit_row_prepass(chain, None, None, parts)
        for h0, n in parts:
            self.head_tile = str(n)
            self.emit(f"hh = {f'{h0} + ' if h0 else ''}tl.arange(0, {n})[None, :, None]")
            self.head_valid = None
            self.emit("hmask = tmask[:, None, None]")
            self._emit_chain_body(chain)

    def emit_group_block(self, block: Block, first: int) -> None:
        """A chain's heads in ``block.groups`` groups of ``block.group`` (the decode schedule):
        program ``first + g`` of grid axis 1 holds heads ``[g * group, (g + 1) * group)``, the
        last group masked where the heads do not divide."""
        chain, group = block.chain, block.group
        self._chain = chain
        self._emit_chain_header(chain, group=block)
        self.head_tile = str(group)
        g = f"(block - {first})" if first else "block"
        self.emit(f"hh = {g} * {group} + tl.arange(0, {group})[None, :, None]")
        if chain.heads % group:
            self.head_valid = "hvalid"
            self.emit(f"hvalid = hh < {chain.heads}")
            self.emit("hmask = tmask[:, None, None] & hvalid")
        else:
            self.head_valid = None
            self.emit("hmask = tmask[:, None, None]")
        self._emit_chain_body(chain)

    def _emit_chain_header(
        self,
        chain: Chain,
        parts: list[tuple[int, int]] | None = None,
        group: Block | None = None,
    ) -> None:
        name = self.var_name(chain.source)
        src = self.var_name(chain.packed)
        where = (
            ""
            if not parts or parts == [(0, chain.heads)]
            else f", heads {' + '.join(f'[{h0}, {h0 + n})' for h0, n in parts)}"
        )
        if group is not None:
            where = f", {group.groups} programs of {group.group} heads"
        s = chain.section
        stride = "" if s.head_stride == s.head_dim else f", head stride {s.head_stride}"
        if s.grouped:
            stride += f", groups of {s.group_heads} heads {s.group_stride} apart"
        self.emit(
            f"# chain {chain.index}: {name} ({chain.heads} heads x {chain.head_dim}{stride}, "
            f"{chain.head_layout.tag}{where})"
        )
        if chain.product is None:  # a product-sourced chain reads its hidden states' rows
            self.emit(f"row{chain.index} = {src}_ptr + tok64[:, None, None] * {src}_stride")

    def _emit_chain_body(self, chain: Chain) -> None:
        self.values = {}
        self._store_if_output(chain.source)
        for e in chain.eqns:
            assert e.prim.lower is not None, f"{e.prim.name} has no emit rule"
            e.prim.lower(self, e)
            for out in e.outputs:
                self._store_if_output(out)
        self.indent -= self.split_depth  # out of a split-K's last-range test
        self.split_depth = 0

    def emit_chain(self, chain: Chain, head_chunk: int) -> None:
        """A chain in ``loop`` mode: a runtime loop over equal chunks, the last one masked."""
        self._chain = chain
        self._emit_chain_header(chain)
        chunked = head_chunk < chain.heads
        padded = next_pow2(head_chunk)
        self.head_tile = str(padded)
        if chunked:
            # The loops below reassign hh / hvalid / hmask: give them the loop's types first (an
            # earlier chain may have left other shapes, and Triton keeps loop-carried types).
            self.emit(f"hh = tl.arange(0, {padded})[None, :, None]")
            self.emit(f"hvalid = hh < {chain.heads}")
            self.emit("hmask = tmask[:, None, None] & hvalid")
            self._emit_row_prepass(chain, head_chunk, padded)
            self.emit(f"for h0 in range(0, {chain.heads}, {head_chunk}):")
            self.indent += 1
            self.emit(f"hh = h0 + tl.arange(0, {padded})[None, :, None]")
        else:
            self.emit(f"hh = tl.arange(0, {padded})[None, :, None]")
        if chunked or padded != chain.heads:
            self.head_valid = "hvalid"
            self.emit(f"hvalid = hh < {chain.heads}")
            self.emit("hmask = tmask[:, None, None] & hvalid")
        else:
            self.head_valid = None
            self.emit("hmask = tmask[:, None, None]")
        self._emit_chain_body(chain)
        if chunked:
            self.indent -= 1

    def _emit_row_prepass(
        self,
        chain: Chain,
        head_chunk: int | None,
        padded: int | None,
        parts: list[tuple[int, int]] | None = None,
    ) -> None:
        """A chunked row's sums of squares over all its heads, chunk by chunk, before the main
        pass (for each reduction over the whole row, see ``Chain.row_reductions``)."""
        self.row_sumsq = {}
        for e in chain.row_reductions:
            if chain.source not in e.inputs:
                raise PlanError(
                    f"{e.prim.name}: a reduction over a row processed in head chunks must read "
                    f"the loaded value directly"
                )
            if id(chain.source) in self.row_sumsq:
                continue
            acc = self.fresh("sumsq")
            self.emit(f"{acc} = tl.zeros([BLOCK_T], dtype=tl.float32)")
            if parts is None:
                self.emit(f"for h0 in range(0, {chain.heads}, {head_chunk}):")
                heads = [
                    (
                        f"h0 + tl.arange(0, {padded})[None, :, None]",
                        f"tmask[:, None, None] & (hh < {chain.heads})",
                    )
                ]
            else:
                heads = [
                    (f"{h0} + tl.arange(0, {n})[None, :, None]", "tmask[:, None, None]")
                    for h0, n in parts
                ]
            self.indent += parts is None
            for (hh, mask), tile in zip(
                heads, [padded] if parts is None else [n for _, n in parts]
            ):
                self.head_tile = str(tile)
                self.emit(f"hh = {hh}")
                self.emit(f"hmask = {mask}")
                pieces = self._source_slots(chain, "hmask", "pre")
                terms = " + ".join(f"tl.sum(tl.sum({p} * {p}, 2), 1)" for p in pieces.values())
                self.emit(f"{acc} += {terms}")
            self.indent -= parts is None
            self.row_sumsq[id(chain.source)] = acc

    def _store_if_output(self, var: Var) -> None:
        outs = self.plan.program.outputs
        for i, o in enumerate(outs):
            if o is var and i not in self.aliases:
                chain = self.chain
                base = self.fresh("obase")
                head_stride = f"out{i}_hstride" if self.strided_outputs else chain.head_dim
                self.emit(
                    f"{base} = out{i}_ptr + tok64[:, None, None] * out{i}_stride"
                    f" + hh * {head_stride}"
                )
                pieces = self.pieces(var)
                native = chain.compute_free and var is chain.source and chain.product is None
                self._store_slots(
                    base, "hmask", chain.head_layout, pieces, None if native else o.aval.dtype
                )

    # -------------------------------------------------------------- whole kernel
    def _token_loop(self) -> str:
        """The persistent loop over this program's token tiles (pipelined with
        :attr:`Tiling.pipeline_stages`), or over its (token tile, block) work items
        (:attr:`Tiling.persistent_blocks`)."""
        if self.tiling.persistent_blocks:
            blocks = block_count(self.plan, self.tiling)
            return f"for work in range(pid, tl.cdiv(T, BLOCK_T) * {blocks}, nprog):"
        stages = self.tiling.pipeline_stages
        if stages:
            return f"for t0 in tl.range(pid * BLOCK_T, T, nprog * BLOCK_T, num_stages={stages}):"
        return "for t0 in range(pid * BLOCK_T, T, nprog * BLOCK_T):"

    def _token_lines(self) -> None:
        if self.tiling.persistent_blocks:
            blocks = block_count(self.plan, self.tiling)
            self.emit(f"t0 = (work // {blocks}) * BLOCK_T")
            self.emit(f"block = work % {blocks}")
        self.emit("tok = t0 + tt")
        self.emit("tmask = tok < T")
        self.emit("tok64 = tok.to(tl.int64)")

    def build(self) -> EmittedKernel:
        """The kernel's source, and whether its code has rounding points."""
        mode = self.tiling.chunk_mode
        # Triton pipelines the loads of a loop's body, not those under a branch in it: a grid
        # kernel with a pipelined loop runs the loop inside each block's branch instead.
        loop_inside = mode == "grid" and bool(self.tiling.pipeline_stages)
        if self.tiling.persistent_blocks and (mode != "grid" or loop_inside):
            raise PlanError(
                "persistent_blocks walks grid mode's blocks in the token loop: it needs "
                "chunk_mode 'grid' and no pipeline_stages"
            )
        if loop_inside:
            self.indent = 1
        else:
            self._token_lines()
        if mode == "grid":
            # One program per (token tiles, block): each block loads what it needs itself.
            if not self.tiling.persistent_blocks:
                self.emit_pre("block = tl.program_id(1)")
            first = 0
            for i, block in enumerate(chunk_blocks(self.plan, self.tiling)):
                # blocks take program indices in order: a range test after the ones before
                end = first + block.groups
                test = f"block == {first}" if block.groups == 1 else f"block < {end}"
                self.emit(f"{'if' if i == 0 else 'elif'} {test}:")
                self.indent += 1
                if loop_inside:
                    self.emit(self._token_loop())
                    self.indent += 1
                    self._token_lines()
                self._open_tile_scope()
                if block.groups == 1:
                    self.emit_static_block(block.chain, block.parts)
                else:
                    self.emit_group_block(block, first)
                self.indent -= 1 + loop_inside
                first += block.groups
        else:
            self._open_tile_scope()
            for block in chunk_blocks(self.plan, self.tiling):
                if mode == "loop":
                    self.emit_chain(block.chain, self.tiling.head_chunks[block.chain.index])
                else:
                    self.emit_static_block(block.chain, block.parts)
        program_text = "\n".join("# " + line for line in str(self.plan.program).splitlines())
        params = ",\n    ".join(self.param_list)
        lines = [
            self.header,
            "#",
            program_text,
            "import triton",
            "import triton.language as tl",
            "",
            "",
            *(ROUND_TO_BF16[self.tiling.bf16_rounding] if self.uses_round_bf16 else ()),
            # A target whose bf16 conversion is not trusted (an interpreter) gets the bit-exact
            # fp8 encoder too: both casts are wrong in the same interpreters.
            *(ROUND_TO_FP8E4M3[self.tiling.bf16_rounding] if self.uses_round_fp8 else ()),
            *(ROUND_TO_FP8E5M2 if self.uses_round_fp8e5m2 else ()),
            "@triton.jit(do_not_specialize=["
            + ", ".join(f'"{n}"' for n in ("T", *self.lengths.values()))
            + "])",
            f"def {self.kernel_name}(\n    {params},\n):",
            "    pid = tl.program_id(0)",
            "    nprog = tl.num_programs(0)",
            *(
                (
                    "    tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible",
                    "    tl.extra.cuda.gdc_launch_dependents()",
                )
                if self.tiling.grid_dependency
                else ()
            ),
            "    tt = tl.arange(0, BLOCK_T)",
            "    if DENSE:  # every row stride equals its row width: constants, not arguments",
            *(f"        {name} = {width}" for name, width in self.dense_strides),
            *self.pre,
            *(() if loop_inside else ("    " + self._token_loop(),)),
            *self.body,
            "",
        ]
        return EmittedKernel("\n".join(lines), self.rounding_points)
