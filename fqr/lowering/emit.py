"""Kernel plan + target profile -> Triton source text.

The emitted kernel is persistent: program ``pid`` handles token tiles ``pid, pid + NPROG, ...``
of ``BLOCK_T`` tokens, so the token count ``T`` is a runtime argument (``do_not_specialize``:
a new batch size never recompiles) and the launcher picks the grid. Inside a tile, each chain
(q, k, v) is processed head-chunk by head-chunk (one chunk of all heads unless the target's
on-chip budget needs more), as 3-D register tiles ``[BLOCK_T, heads, features]``.

The text for each primitive comes from its lowering rule (``fqr/ops/*.py``), which calls the
:class:`KernelBuilder` helpers below: ``pieces`` (a value's register tiles, loading a split view
on first use), ``weight_pieces`` (a ``[D]`` or full-width vector, hoisted out of the token loop
when it does not depend on the head chunk), ``cos_sin`` (the token tile's RoPE rows, loaded once
and shared by every head and chain), ``set`` (bind an equation's result).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import Eqn, ProgramPrinter, Var
from .plan import Chain, KernelPlan, Layout, PlanError, Slot, next_pow2

TL_DTYPES = {
    torch.bfloat16: "tl.bfloat16",
    torch.float16: "tl.float16",
    torch.float32: "tl.float32",
    torch.float64: "tl.float64",
}
EMITTER_VERSION = "1"


@dataclass(frozen=True)
class Tiling:
    """How the emitted kernel tiles the work (chosen by the target profile)."""

    block_t: int  # tokens per tile
    head_chunks: tuple[int, ...]  # heads per chunk, one entry per chain (== heads: no chunking)
    bf16_rounding: str = "native"  # how fp32 -> bf16 is rounded: native | bits (see ROUND_TO_BF16)
    # How a chain wider than its chunk is covered: "loop" (a runtime loop over equal chunks, the
    # last one masked), "unroll" (static power-of-two chunks, no masking) or "grid" (each static
    # chunk is its own program along grid axis 1; a full-width-norm chain stays in one program).
    chunk_mode: str = "loop"


def static_parts(heads: int, chunk: int) -> list[tuple[int, int]]:
    """Cover ``heads`` with power-of-two chunks of at most ``chunk`` heads: 24, 16 -> 16 + 8."""
    parts, h0 = [], 0
    while h0 < heads:
        n = min(chunk, 1 << ((heads - h0).bit_length() - 1))
        n = 1 << (n.bit_length() - 1)
        parts.append((h0, n))
        h0 += n
    return parts


def has_full_norm(chain: Chain) -> bool:
    return any(
        e.prim.name == "rms_norm"
        and e.params["group"] == chain.width
        and e.params["group"] != chain.head_dim
        and e.inputs[3] is None
        for e in chain.eqns
    )


def chunk_blocks(plan: KernelPlan, tiling: Tiling) -> list[tuple[Chain, list[tuple[int, int]]]]:
    """The program blocks of a kernel: (chain, its static head parts). In ``grid`` mode each
    block is one program index along grid axis 1; otherwise there is one block per chain."""
    blocks = []
    for chain, hc in zip(plan.chains, tiling.head_chunks):
        parts = static_parts(chain.heads, hc) if tiling.chunk_mode != "loop" else []
        if tiling.chunk_mode == "grid" and not has_full_norm(chain):
            blocks += [(chain, [part]) for part in parts]
        else:
            blocks.append((chain, parts))
    return blocks


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


class KernelBuilder:
    def __init__(self, plan: KernelPlan, tiling: Tiling, kernel_name: str, header: str):
        self.plan, self.tiling, self.kernel_name, self.header = plan, tiling, kernel_name, header
        self.printer = ProgramPrinter(plan.program)
        self.printer.render()  # name every variable in program order, as the comment shows it
        self.pre: list[str] = []  # before the token loop (hoisted)
        self.body: list[str] = []  # inside the token loop
        self.indent = 2
        self._counter = 0
        self._hoisted: dict[tuple, object] = {}
        self._tile: dict[tuple, object] = {}
        self.values: dict[int, dict[str, str]] = {}
        self.arg_names: dict[int, str] = {}
        self.chain: Chain | None = None
        self.full_sumsq: dict[int, str] = {}
        self.uses_round_bf16 = False
        self.param_list: list[str] = []
        self._bind_params()

    # -------------------------------------------------------------- names and text
    def fresh(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}{self._counter}"

    def emit(self, line: str) -> None:
        self.body.append("    " * self.indent + line)

    def emit_pre(self, line: str) -> None:
        self.pre.append("    " + line)

    def var_name(self, v: Var) -> str:
        return self.printer.name(v)

    def _bind_params(self) -> None:
        for v in self.plan.program.inputs:
            role = self.plan.input_role(v)
            base = f"{self.var_name(v)}_ptr"
            self.arg_names[id(v)] = base
            self.param_list.append(base)
            if role in ("activation", "table"):
                self.param_list.append(f"{self.var_name(v)}_stride")
            if role == "table":
                self.param_list.append(f"{self.var_name(v)}_rows")
        for i in range(len(self.plan.program.outputs)):
            self.param_list.append(f"out{i}_ptr")
        self.param_list += ["T", "BLOCK_T: tl.constexpr"]

    def cast(self, expr: str, dtype: torch.dtype) -> str:
        """``expr`` (fp32) rounded to ``dtype``, round-to-nearest-even on every target."""
        if dtype == torch.bfloat16:
            self.uses_round_bf16 = True
            return f"round_to_bf16({expr})"
        return f"({expr}).to({TL_DTYPES[dtype]})"

    # -------------------------------------------------------------- index vectors
    def cols(self, padded: int) -> str:
        key = ("cols", padded)
        if key not in self._hoisted:
            name = f"cols{padded}"
            self.emit_pre(f"{name} = tl.arange(0, {padded})[None, None, :]")
            self._hoisted[key] = name
        return self._hoisted[key]

    def pair_cols(self, padded: int) -> tuple[str, str]:
        """([1,1,NPP,2] feature offsets 2i+k, [1,1,NPP,1] pair index) for a GPT-J pair tile."""
        key = ("pairs", padded)
        if key not in self._hoisted:
            idx, offs = f"pair{padded}", f"paircols{padded}"
            self.emit_pre(f"{idx} = tl.arange(0, {padded})[None, None, :, None]")
            self.emit_pre(f"{offs} = 2 * {idx} + tl.arange(0, 2)[None, None, None, :]")
            self._hoisted[key] = (offs, idx)
        return self._hoisted[key]

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

    # -------------------------------------------------------------- loads and stores
    def _load_slots(
        self,
        base: str,
        mask: str | None,
        layout: Layout,
        cast: bool,
        prefix: str,
        emit,
        scalar_base: bool = False,
    ) -> dict[str, str]:
        pieces = {}
        for slot in layout.slots:
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
    ) -> None:
        cast = (lambda e: e) if dtype is None else (lambda e: self.cast(e, dtype))  # noqa: E731
        for slot in layout.slots:
            off, smask, pair = self.slot_offsets(slot)
            m = f"{mask}[:, :, :, None]" if pair else mask
            if smask:
                m = f"{m} & {smask}"
            if pair:
                val = cast(f"tl.join({pieces[slot.names[0]]}, {pieces[slot.names[1]]})")
                self.emit(f"tl.store({base}[:, :, :, None] + {off}, {val}, mask={m})")
            else:
                self.emit(f"tl.store({base} + {off}, {cast(pieces[slot.names[0]])}, mask={m})")

    # -------------------------------------------------------------- per-tile values
    def positions(self, var: Var) -> str:
        key = ("tok", id(var))
        if key not in self._tile:
            name = self.fresh("pos")
            self.emit(f"{name} = tl.load({self.arg_names[id(var)]} + tok, mask=tmask, other=0)")
            self._tile[key] = name
        return self._tile[key]

    def token_values(self, var: Var) -> str:
        """A per-token fp32 input ``[T]`` (e.g. an all-reduced statistic) as ``[BLOCK_T]``."""
        key = ("tokf", id(var))
        if key not in self._tile:
            name = self.fresh("tokval")
            self.emit(
                f"{name} = tl.load({self.arg_names[id(var)]} + tok, mask=tmask, other=1.0)"
                f".to(tl.float32)"
            )
            self._tile[key] = name
        return self._tile[key]

    def _emit_tile_values(self, eqns) -> None:
        for e in eqns:
            if e.prim.name == "rope":
                self.cos_sin(e.inputs[1], e.inputs[2])
            for v in e.inputs[1:]:
                if (
                    v is not None
                    and self.plan.input_role(v) == "tokens"
                    and v.aval.dtype.is_floating_point
                ):
                    self.token_values(v)

    def cos_sin(self, positions: Var, cache: Var) -> tuple[str, str]:
        """``[BLOCK_T, 1, R/2]`` cos and sin rows of this tile's positions (loaded once)."""
        key = ("cs", id(positions), id(cache))
        if key not in self._tile:
            r = cache.aval.shape[1]
            half = r // 2
            pos = self.positions(positions)
            c = self.cols(next_pow2(half))
            cos, sin, row = self.fresh("cos"), self.fresh("sin"), self.fresh("csrow")
            name = self.var_name(cache)
            ok = self.fresh("posok")
            # A position outside the table reads nothing and rotates by NaN: loud, never OOB.
            self.emit(f"{ok} = ((tmask & ({pos} >= 0) & ({pos} < {name}_rows)))[:, None, None]")
            self.emit(f"{row} = {name}_ptr + {pos}.to(tl.int64)[:, None, None] * {name}_stride")
            m = ok + ("" if next_pow2(half) == half else f" & ({c} < {half})")
            self.emit(f"{cos} = tl.load({row} + {c}, mask={m}, other=float('nan')).to(tl.float32)")
            self.emit(
                f"{sin} = tl.load({row} + {half} + {c}, mask={m}, other=float('nan'))"
                ".to(tl.float32)"
            )
            self._tile[key] = (cos, sin)
        return self._tile[key]

    # -------------------------------------------------------------- chain values
    def pieces(self, var: Var) -> dict[str, str]:
        if id(var) not in self.values:
            chain = self.plan.chain_of[id(var)]
            if var is not chain.source:
                raise PlanError(f"value {self.var_name(var)} used before it was computed")
            self.values[id(var)] = self._load_slots(
                self.src_base,
                "hmask",
                chain.layout,
                cast=not chain.compute_free,
                prefix=self.var_name(var),
                emit=self.emit,
            )
        return self.values[id(var)]

    def set(self, var: Var, pieces: dict[str, str]) -> None:
        self.values[id(var)] = pieces

    def weight_pieces(self, var: Var, per_head: bool) -> dict[str, str]:
        """A weight/bias vector in the chain's layout: ``[1,1,NP]`` per head, or ``[1,HC,NP]``."""
        chain = self.chain
        if per_head:
            key = ("w", id(var), chain.layout)
            if key not in self._hoisted:
                self._hoisted[key] = self._load_slots(
                    self.arg_names[id(var)],
                    None,
                    chain.layout,
                    cast=True,
                    prefix=self.var_name(var) + "w",
                    emit=self.emit_pre,
                    scalar_base=True,
                )
            return self._hoisted[key]
        base = self.fresh("wbase")
        self.emit(f"{base} = {self.arg_names[id(var)]} + hh * {chain.head_dim}")
        return self._load_slots(
            base,
            self.head_valid,
            chain.layout,
            cast=True,
            prefix=self.var_name(var) + "w",
            emit=self.emit,
        )

    def full_width_sumsq(self, eqn: Eqn) -> str | None:
        """The prepass statistic of a chunked full-width norm (None: compute it in place)."""
        return self.full_sumsq.get(id(eqn))

    # -------------------------------------------------------------- chain emission
    def emit_static_block(self, chain: Chain, parts: list[tuple[int, int]]) -> None:
        """A chain (or part of it) as static power-of-two head chunks, unmasked."""
        self.chain = chain
        self._emit_chain_header(chain, parts)
        if len(parts) > 1 and has_full_norm(chain):
            self._emit_full_norm_prepass(chain, None, None, parts)
        for h0, n in parts:
            self.emit(f"hh = {f'{h0} + ' if h0 else ''}tl.arange(0, {n})[None, :, None]")
            self.head_valid = None
            self.emit("hmask = tmask[:, None, None]")
            self._emit_chain_body(chain)

    def _emit_chain_header(self, chain: Chain, parts=None) -> None:
        name = self.var_name(chain.source)
        src = self.var_name(chain.view_of) if chain.view_of is not None else name
        where = (
            ""
            if not parts or parts == [(0, chain.heads)]
            else f", heads {' + '.join(f'[{h0}, {h0 + n})' for h0, n in parts)}"
        )
        self.emit(
            f"# chain {chain.index}: {name} ({chain.heads} heads x {chain.head_dim}, "
            f"{chain.layout.tag}{where})"
        )
        self.emit(f"row{chain.index} = {src}_ptr + tok64[:, None, None] * {src}_stride")

    def _emit_chain_body(self, chain: Chain) -> None:
        self.src_base = f"(row{chain.index} + {chain.col_offset} + hh * {chain.head_dim})"
        self.values = {}
        self._store_if_output(chain.source)
        for e in chain.eqns:
            e.prim.lower(self, e)
            for out in e.outputs:
                self._store_if_output(out)

    def emit_chain(self, chain: Chain, head_chunk: int) -> None:
        """A chain in ``loop`` mode: a runtime loop over equal chunks, the last one masked."""
        self.chain = chain
        self._emit_chain_header(chain)
        chunked = head_chunk < chain.heads
        padded = next_pow2(head_chunk)
        if chunked:
            self._emit_full_norm_prepass(chain, head_chunk, padded)
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

    def _emit_full_norm_prepass(
        self,
        chain: Chain,
        head_chunk: int | None,
        padded: int | None,
        parts: list[tuple[int, int]] | None = None,
    ) -> None:
        """Sum of squares of a whole full-width-norm row, chunk by chunk, before the main pass."""
        for e in chain.eqns:
            if (
                e.prim.name != "rms_norm"
                or e.params["group"] != chain.width
                or e.inputs[3] is not None
            ):
                continue
            if e.inputs[0] is not chain.source:
                raise PlanError("a chunked full-width norm must read the loaded value directly")
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
            for hh, mask in heads:
                self.emit(f"hh = {hh}")
                self.emit(f"hmask = {mask}")
                base = f"(row{chain.index} + {chain.col_offset} + hh * {chain.head_dim})"
                pieces = self._load_slots(base, "hmask", chain.layout, True, "pre", self.emit)
                terms = " + ".join(f"tl.sum(tl.sum({p} * {p}, 2), 1)" for p in pieces.values())
                self.emit(f"{acc} += {terms}")
            self.indent -= parts is None
            self.full_sumsq[id(e)] = acc

    def _store_if_output(self, var: Var) -> None:
        outs = self.plan.program.outputs
        for i, o in enumerate(outs):
            if o is var:
                chain = self.chain
                base = self.fresh("obase")
                self.emit(
                    f"{base} = out{i}_ptr + tok64[:, None, None] * {chain.width}"
                    f" + hh * {chain.head_dim}"
                )
                pieces = self.pieces(var)
                native = chain.compute_free and var is chain.source
                self._store_slots(
                    base, "hmask", chain.layout, pieces, None if native else o.aval.dtype
                )

    # -------------------------------------------------------------- whole kernel
    def build(self) -> str:
        self.emit("tok = t0 + tt")
        self.emit("tmask = tok < T")
        self.emit("tok64 = tok.to(tl.int64)")
        mode = self.tiling.chunk_mode
        if mode == "grid":
            # One program per (token tiles, block): each block loads what it needs itself.
            self.emit_pre("block = tl.program_id(1)")
            for i, (chain, parts) in enumerate(chunk_blocks(self.plan, self.tiling)):
                self.emit(f"{'if' if i == 0 else 'elif'} block == {i}:")
                self.indent += 1
                self._tile = {}
                self._emit_tile_values(chain.eqns)
                self.emit_static_block(chain, parts)
                self.indent -= 1
        else:
            # Tile-scope values first, so that chunk loops below only read them.
            self._emit_tile_values(self.plan.program.eqns)
            for chain, parts in chunk_blocks(self.plan, self.tiling):
                if mode == "loop":
                    self.emit_chain(chain, self.tiling.head_chunks[chain.index])
                else:
                    self.emit_static_block(chain, parts)
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
            '@triton.jit(do_not_specialize=["T"])',
            f"def {self.kernel_name}(\n    {params},\n):",
            "    pid = tl.program_id(0)",
            "    nprog = tl.num_programs(0)",
            "    tt = tl.arange(0, BLOCK_T)",
            *self.pre,
            "    for t0 in range(pid * BLOCK_T, T, nprog * BLOCK_T):",
            *self.body,
            "",
        ]
        return "\n".join(lines)


def emit_source(plan: KernelPlan, tiling: Tiling, kernel_name: str, header: str) -> str:
    return KernelBuilder(plan, tiling, kernel_name, header).build()
