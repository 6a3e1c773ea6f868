"""The emission of a product-sourced chain (the projected form, issue 40): the QKV GEMM whose
N tile is one head group, the traced prologue as its epilogue.

:class:`ProductEmission` is the part of :class:`fqr.lowering.emit.KernelBuilder` that writes a
chain's source value when its packed row is ``x @ w.T (+ bias)`` (``Chain.product``, from a
:class:`fqr.core.Product`) instead of a load: for each slot of the head layout (RoPE's halves,
GPT-J's even and odd features, the pass-through runs) the weight rows it multiplies, the dot
products accumulated over K in fp32 (``tl.dot`` per K step added by an fp32 add, or a summed
broadcast product), split-K's ranges joined through an fp32 workspace and an atomic count
(:attr:`fqr.lowering.tiling.Tiling.split_k`), the bias added. The chain's emit rules then run on
those pieces as on loaded ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..core import Section, Var
from .plan import Chain, Layout, Slot
from .tiling import Tiling


def head_offset(section: Section) -> str:
    """Where head ``hh`` of ``section`` starts, past its offset, in a row of the packed
    value (heads in groups, CodeGen's model-parallel shards: :class:`fqr.core.Section`)."""
    if section.grouped:
        g = section.group_heads
        return f"(hh // {g}) * {section.group_stride} + (hh % {g}) * {section.head_stride}"
    return f"hh * {section.head_stride}"


def broadcast_step(acc: str, wk: str, xk: str) -> str:
    """One K step as a broadcast product summed over K: ``acc [T, width] += sum_k xk [T, k] *
    wk [k, width]``, any token tile and width."""
    return f"{acc} += tl.sum({xk}[:, :, None] * {wk}.to(tl.float32)[None, :, :], 1)"


class ProductEmission:
    """Mixed into :class:`fqr.lowering.emit.KernelBuilder` (whose state it uses: ``tiling``,
    ``head_tile``, ``head_valid``, ``split_depth``, ``emit``, ``fresh``, ``cols``, the
    argument names)."""

    if TYPE_CHECKING:  # what it uses of KernelBuilder
        tiling: Tiling
        head_tile: str
        head_valid: str | None
        split_depth: int
        indent: int
        arg_names: dict[int, str]

        def emit(self, line: str) -> None: ...
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
        ) -> dict[str, str]: ...
        def fresh(self, prefix: str) -> str: ...
        def cols(self, padded: int) -> str: ...
        def var_name(self, var: Var) -> str: ...

    def _weight_rows(self, chain: Chain, slot: Slot, second: bool) -> tuple[str, str | None]:
        """(the rows of the weight ``[1, heads, padded]`` that a slot's piece (``second``: a
        pair slot's odd features) multiplies by, the mask of the rows that exist or None)."""
        c = self.cols(slot.padded)
        feature = c if slot.kind == "contig" else f"2 * {c}{' + 1' if second else ''}"
        head = head_offset(chain.section)
        rows = f"({chain.section.offset + slot.start} + {head} + {feature})"
        masks = [self.head_valid] if self.head_valid else []
        if slot.padded != slot.count:
            masks.append(f"({c} < {slot.count})")
        return rows, " & ".join(masks) or None

    def _dot_takes(self, padded: int) -> bool:
        """Whether the target's ``tl.dot`` takes a piece ``padded`` wide per head of this
        head tile, at the tiling's token tile (:attr:`Tiling.min_dot`)."""
        smallest = self.tiling.min_dot
        return self.tiling.block_t >= smallest and int(self.head_tile) * padded >= smallest

    def _product_slots(self, chain: Chain, prefix: str) -> dict[str, str]:
        """The pieces of a product-sourced chain's heads in the current head tile: for each
        slot, ``x[tok, :] @ w[rows, :].T (+ bias[rows])`` accumulated in fp32 over K in steps
        of :attr:`Tiling.block_k` (``tl.dot``, or a summed broadcast product with
        ``product_dot="fma"``), one shared load of x per step."""
        product = chain.product
        assert product is not None
        depth, step = product.depth, self.tiling.block_k
        assert step, "a kernel with a product has a K step (Tiling.block_k)"
        x = self.var_name(product.hidden)
        w = self.arg_names[id(product.weight)]
        heads = self.head_tile
        mma = self.tiling.product_dot == "mma"
        # An interpreter (whose casts are wrong: ``bf16_rounding="bits"``) multiplies bf16
        # tiles wrongly in ``tl.dot``: there the operands go to fp32 first, which is exact (a
        # product of two bf16 or fp16 values fits fp32's mantissa).
        interpreted = self.tiling.bf16_rounding == "bits"
        is_fp32 = product.hidden.aval.dtype == torch.float32
        widen = mma and not is_fp32 and (interpreted or self.tiling.product_operands == "tf32")
        precision = "ieee" if is_fp32 or interpreted else "tf32"
        splits = self.tiling.split_k
        self.emit(f"# {x} @ w.T for these heads: K = {depth} in steps of {step}")
        xrow = self.fresh("xrow")
        self.emit(f"{xrow} = {x}_ptr + tok64[:, None] * {x}_stride")
        parts = []  # (piece name, rows, row mask, accumulator, weight-row offsets, its mask)
        for slot in chain.head_layout.slots:
            for i, piece in enumerate(slot.names):
                rows, rmask = self._weight_rows(chain, slot, second=i == 1)
                width = f"{heads} * {slot.padded}"
                acc, flat = self.fresh(f"acc_{piece}_"), self.fresh("wrow")
                self.emit(f"{flat} = tl.reshape({rows}, [{width}]).to(tl.int64) * {depth}")
                fmask = None
                if rmask is not None:
                    fmask = self.fresh("wmask")
                    full = f"({rmask}) & ({rows} >= 0)"  # broadcast to the tile's shape
                    self.emit(f"{fmask} = tl.reshape({full}, [{width}])")
                self.emit(f"{acc} = tl.zeros([BLOCK_T, {width}], dtype=tl.float32)")
                parts.append((piece, rows, rmask, acc, flat, fmask, slot.padded))
        if mma:
            # Each K step's product is added to the accumulator by an fp32 add (promoted, as
            # DeepSeek-V3 does for its FP8 GEMMs): a tensor-core chain accumulating all of K
            # left bf16-ULP errors on the H200. Its dot starts from a zero Triton cannot see
            # as a constant, which would fold the add back into the dot.
            self.emit("unfolded_zero = T.to(tl.float32) * 0.0")
        stages = self.tiling.k_stages
        loop = f"tl.range({{}}, num_stages={stages})" if stages else "range({})"
        if splits > 1:
            per_split = -(-depth // splits)
            span = -(-per_split // step) * step  # each range: whole steps
            self.emit(f"ksplit = tl.program_id(2)  # K range [{span} * ksplit, + {span})")
            bounds = f"ksplit * {span}, ksplit * {span} + {span}, {step}"
        else:
            bounds = f"0, {depth}, {step}"
        self.emit(f"for k0 in {loop.format(bounds)}:")
        self.indent += 1
        self.emit(f"kk = k0 + tl.arange(0, {step})")
        ragged = depth % step != 0 or (splits > 1 and depth % (splits * step) != 0)
        kx = f" & (kk < {depth})[None, :]" if ragged else ""
        self.emit(
            f"xk = tl.load({xrow} + kk[None, :], mask=tmask[:, None]{kx}, other=0.0)"
            + ("" if mma and not widen else ".to(tl.float32)")
        )
        xk_fp32 = "xk" if widen or not mma or is_fp32 else "xk.to(tl.float32)"
        for _, _, _, acc, flat, fmask, padded in parts:
            wk = self.fresh("wk")
            masks = [m for m in (f"{fmask}[None, :]" if fmask else None,
                                 f"(kk < {depth})[:, None]" if ragged else None) if m]  # fmt: skip
            m = f", mask={' & '.join(masks)}, other=0.0" if masks else ""
            self.emit(f"{wk} = tl.load({w} + {flat}[None, :] + kk[:, None]{m})")
            if mma and self._dot_takes(padded):
                how = f', input_precision="{precision}"' if widen or is_fp32 else ""
                operand = f"{wk}.to(tl.float32)" if widen else wk
                zero = f"tl.zeros_like({acc}) + unfolded_zero"
                self.emit(f"{acc} += tl.dot(xk, {operand}, {zero}{how})")
            elif mma:  # a piece narrower than the target's dot takes: a broadcast product
                self.emit(broadcast_step(acc, wk, xk_fp32))
            else:
                self._gemv_step(acc, wk, xk_fp32, step)
        self.indent -= 1
        if self.tiling.uses_workspace:
            self._join_splits(product.weight, parts)
        pieces = {}
        bias = product.bias
        biases = {}
        if bias is not None:
            # the bias's rows of these heads read as the chain's rows are (a GPT-J pair slot
            # as a pair tile, split), never through a stride-2 index: Triton-Ascend's
            # interleave lowering refuses one with a constant odd offset
            first = f"{chain.section.offset} + {head_offset(chain.section)}"
            at = f"{self.arg_names[id(bias)]} + ({first})"
            biases = self._load_slots(
                at, self.head_valid, chain.head_layout, True, f"{prefix}_bias", self.emit, lead="1"
            )
        for piece, _, _, acc, _, _, padded in parts:
            name = self.fresh(f"{prefix}_{piece}_")
            # one head: a new axis, not a reshape (on the H200 a tl.reshape of tl.dot's
            # accumulator gave values off by up to 2^-8 of the head, Triton 3.6)
            value = (
                f"{acc}[:, None, :]"
                if heads == "1"
                else f"tl.reshape({acc}, [BLOCK_T, {heads}, {padded}])"
            )
            if biases:
                value += f" + {biases[piece]}"
            self.emit(f"{name} = {value}")
            pieces[piece] = name
        return pieces

    def _gemv_step(self, acc: str, wk: str, xk: str, step: int) -> None:
        """One K step of ``product_dot="fma"``: for one token, the weight tile ``wk [step,
        width]`` times x as a column, summed over K in the tile's own layout (within threads,
        then warp shuffles); a broadcast over a token axis staged every weight tile through
        shared memory on the H200, so it is kept for a tile of several tokens only (a loop
        over the tile's tokens with the weight tile kept in registers was 10-100x slower
        there, docs/PERFORMANCE.md)."""
        column = f"tl.reshape({xk}, [{step}])[:, None]"
        self.emit("if BLOCK_T == 1:")
        self.emit(f"    {acc} += tl.sum({wk}.to(tl.float32) * {column}, 0)[None, :]")
        self.emit("else:")
        self.emit(f"    {broadcast_step(acc, wk, xk)}")

    def _join_splits(self, weight: Var, parts: list) -> None:
        """Split-K: this program's partial sums to the workspace ``[split_k, tokens, N]``
        (fp32, tokens padded to whole tiles), then an atomic count per (token tile, program
        block); the program that counts last sums every range in order (the same sum whoever
        is last) into the accumulators and runs the rest of the chain, under ``if``: the
        chain body's indent stays one deeper until :meth:`_emit_chain_body` ends."""
        width = int(weight.aval.shape[0])
        splits = self.tiling.split_k
        self.emit("padded_t = tl.cdiv(T, BLOCK_T) * BLOCK_T")
        places = []  # per accumulator: (its tile's address in range ``{r}``, its mask)
        for _, _, _, acc, flat, fmask, _ in parts:
            m = f"tmask[:, None] & {fmask}[None, :]" if fmask else "tmask[:, None]"
            cols = f"({flat} // {int(weight.aval.shape[1])})[None, :]"
            at = f"ws_ptr + ({{r}} * padded_t + tok64[:, None]) * {width} + {cols}"
            places.append((acc, at, m))
            self.emit(f"tl.store({at.format(r='ksplit')}, {acc}, mask={m})")
        self.emit("tl.debug_barrier()  # every thread's partial sums stored before the count")
        self.emit("count_at = count_ptr + (t0 // BLOCK_T) * tl.num_programs(1) + block")
        self.emit('arrived = tl.atomic_add(count_at, 1, sem="acq_rel", scope="gpu")')
        self.emit(f"if arrived == {splits - 1}:  # the last range: sum them all, in order")
        self.indent += 1
        self.emit("tl.atomic_xchg(count_at, 0)  # the count ready for the next launch")
        for acc, at, m in places:
            self.emit(f"{acc} = tl.zeros_like({acc})")
            # unrolled, so that every range's load is in flight at once; from L2 (.cg: this
            # SM's L1 may hold no line of them, the acquire above orders them after the count)
            self.emit(f"for part in tl.static_range({splits}):")
            load = f'tl.load({at.format(r="part")}, mask={m}, other=0.0, cache_modifier=".cg")'
            self.emit(f"    {acc} += {load}")
        self.split_depth += 1
