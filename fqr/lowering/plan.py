"""Program -> kernel plan: which values are per-head tiles, how each tile is split into pieces.

The fused kernel keeps every head-structured value ``[T, H*D]`` of the program in registers as
3-D tiles ``[BLOCK_T, heads, features]``. A *chain* is the tree of equations that starts at one
such value (a ``split_qkv`` output, or an activation input) and transforms it head by head
(``rms_norm``, ``reduce_precision``, ``rope``); q, k and v are three chains.

RoPE decides how a chain's head is held (its :class:`Layout`):

* NeoX: piece ``a`` = features ``[0, R/2)``, ``b`` = ``[R/2, R)`` (two contiguous loads);
* GPT-J: ``a``/``b`` = even/odd features of ``[0, R)``, loaded as one contiguous pair tile and
  split in registers (``tl.split``), so loads stay vectorised;
* pass-through pieces ``p0, p1, ..`` = ``[R, D)`` (partial rotary) in power-of-two runs, or
  the whole head without RoPE.

Elementwise rules work piece by piece; reductions (the norm) sum over all pieces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core import TOKENS, Eqn, Program, Var


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pow2_parts(start: int, count: int, min_part: int = 16) -> list[tuple[int, int]]:
    """Split ``count`` features into power-of-two runs (the last one padded when small), so
    that a 192-wide pass-through is 128 + 64 registers rather than 256 with a quarter masked."""
    parts = []
    while count > 0:
        n = 1 << (count.bit_length() - 1)
        if n != count and count - n < min_part:
            n = count  # a small remainder: pad this run instead of adding a tiny one
        parts.append((start, n))
        start, count = start + n, count - n
    return parts


@dataclass(frozen=True)
class Slot:
    """One load/store unit of a head: ``contig`` (names=(piece,)) or ``pairs`` (names=(a, b))."""

    kind: str
    names: tuple[str, ...]
    start: int  # first feature of the slot within the head
    count: int  # features (contig) or pairs (pairs)

    @property
    def padded(self) -> int:
        return next_pow2(self.count)


@dataclass(frozen=True)
class Layout:
    head_dim: int
    rotary_dim: int  # 0 when the chain has no RoPE
    style: str  # "neox", "gptj" or "plain"

    @property
    def slots(self) -> tuple[Slot, ...]:
        d, r = self.head_dim, self.rotary_dim
        if self.style == "plain":
            return tuple(
                Slot("contig", (f"p{i}",), start, n)
                for i, (start, n) in enumerate(pow2_parts(0, d))
            )
        half = r // 2
        if self.style == "neox":
            rot = (Slot("contig", ("a",), 0, half), Slot("contig", ("b",), half, half))
        else:
            rot = (Slot("pairs", ("a", "b"), 0, half),)
        if rot[0].kind != "pairs" and (d - r) % half == 0 and half == next_pow2(half):
            # Pass-through in runs as wide as the rotated halves: every piece then has the same
            # shape, so the norm's per-head sums combine without layout conversions.
            parts = [(start, half) for start in range(r, d, half)]
        else:
            parts = pow2_parts(r, d - r)
        return rot + tuple(
            Slot("contig", (f"p{i}",), start, n) for i, (start, n) in enumerate(parts)
        )

    @property
    def tag(self) -> str:
        return "plain" if self.style == "plain" else f"{self.style}{self.rotary_dim}"


@dataclass
class Chain:
    """A per-head value and the equations that transform it (see module docstring)."""

    index: int
    source: Var  # split output or program input
    view_of: Var | None  # the packed input a split output is a view of
    col_offset: int  # first column of this value in that input
    heads: int
    head_dim: int
    eqns: list[Eqn] = field(default_factory=list)
    layout: Layout | None = None

    @property
    def compute_free(self) -> bool:
        return not self.eqns

    @property
    def width(self) -> int:
        return self.heads * self.head_dim

    @property
    def padded_heads(self) -> int:
        return next_pow2(self.heads)


@dataclass
class KernelPlan:
    program: Program
    chains: list[Chain]
    chain_of: dict[int, Chain]  # id(var) -> chain holding it

    def input_role(self, var: Var) -> str:
        """activation | tokens (positions, per-token stats) | table (cos_sin_cache) | vector."""
        shape = var.aval.shape
        if shape and shape[0] == TOKENS:
            return "activation" if len(shape) == 2 else "tokens"
        if len(shape) == 2:
            return "table"
        return "vector"


class PlanError(ValueError):
    """The program is outside what the fused lowering supports; the message says why."""


def plan_program(program: Program) -> KernelPlan:
    chains: list[Chain] = []
    chain_of: dict[int, Chain] = {}
    input_ids = {id(v) for v in program.inputs}

    def new_chain(var: Var, view_of, offset, heads, d) -> Chain:
        c = Chain(len(chains), var, view_of, offset, heads, d)
        chains.append(c)
        chain_of[id(var)] = c
        return c

    for e in program.eqns:
        name = e.prim.name
        if name == "split_qkv":
            src = e.inputs[0]
            if id(src) not in input_ids:
                raise PlanError("split_qkv must read a program input (the packed QKV activation)")
            hq, hkv, d = e.params["hq"], e.params["hkv"], e.params["d"]
            for out, heads, off in zip(e.outputs, (hq, hkv, hkv), (0, hq * d, (hq + hkv) * d)):
                new_chain(out, src, off, heads, d)
            continue
        x = e.inputs[0]
        if id(x) not in chain_of:
            if id(x) not in input_ids or x.aval.shape[0] != TOKENS:
                raise PlanError(f"{name}: its operand must be a [T, width] activation")
            width = x.aval.shape[1]
            d = _infer_head_dim(program, x, width)
            new_chain(x, x, 0, width // d, d)
        chain = chain_of[id(x)]
        if name == "rope" and e.params["d"] != chain.head_dim:
            raise PlanError(
                f"rope head_dim {e.params['d']} != the value's head_dim {chain.head_dim}"
            )
        if name == "rms_norm":
            g = e.params["group"]
            if g not in (chain.head_dim, chain.width):
                raise PlanError(
                    f"rms_norm group_size {g} must be head_dim ({chain.head_dim}) or the "
                    f"whole width ({chain.width})"
                )
        chain.eqns.append(e)
        for out in e.outputs:
            chain_of[id(out)] = chain

    for c in chains:
        ropes = {
            (e.inputs[2].aval.shape[1], e.params["neox"]) for e in c.eqns if e.prim.name == "rope"
        }
        if len(ropes) > 1:
            raise PlanError(f"one value is rotated with two different rope settings: {ropes}")
        if ropes:
            ((r, neox),) = ropes
            c.layout = Layout(c.head_dim, r, "neox" if neox else "gptj")
        else:
            c.layout = Layout(c.head_dim, 0, "plain")
    for v in program.outputs:
        if id(v) not in chain_of:
            raise PlanError("every program output must be a per-head value computed in the kernel")
    return KernelPlan(program, chains, chain_of)


def _infer_head_dim(program: Program, start: Var, width: int) -> int:
    """head_dim of an activation input: from a rope or per-head norm downstream, else the width."""
    members, found = {id(start)}, []
    for e in program.eqns:
        if e.inputs and e.inputs[0] is not None and id(e.inputs[0]) in members:
            members.update(id(o) for o in e.outputs)
            if e.prim.name == "rope":
                found.append(e.params["d"])
            elif e.prim.name == "rms_norm" and e.params["group"] != width:
                found.append(e.params["group"])
    if len(set(found)) > 1:
        raise PlanError(f"inconsistent head_dim for one value: {sorted(set(found))}")
    return found[0] if found else width
