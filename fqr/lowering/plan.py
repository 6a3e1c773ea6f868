"""Program -> kernel plan: which values are per-head tiles, how each head is held in registers.

The fused kernel keeps every head-structured value ``[T, H*D]`` of the program in registers as
3-D tiles ``[BLOCK_T, heads, features]``. A *chain* is the tree of equations that starts at one
such value (a view of a packed input, or an activation input) and transforms it head by head;
q, k and v of the attention prologue are three chains.

The plan knows no primitive: it reads each equation's lowering facts (``fqr.core``):

* :class:`~fqr.core.Views` -- the outputs are sections of a packed program input: each starts a
  chain at that section's columns (offset, head stride);
* :class:`~fqr.core.Product` -- the output is a packed row computed as ``x @ w.T (+ bias)``
  of program inputs (the QKV projection): a view of it starts chains as a view of a packed
  input does, each chain recording its :class:`ProductSource` (the emitter computes a head's
  columns where the head is first used, the prologue being the product's epilogue);
* :class:`~fqr.core.HeadOp` -- the equation joins the chain of its VALUE operand; its other
  operands take their :class:`~fqr.core.Role` (vectors, per-token values, index, table), its
  ``head_dim`` must be the chain's, its ``layout`` request decides how the chain's heads are
  held, its ``reduction`` over the whole row is recorded on the chain (when the row is
  processed in head chunks, the emitter sums it in a first pass);
* :class:`~fqr.core.PagedStore` -- a HeadOp whose output is not a per-head value but its
  CACHE operand updated (rows written through a slot mapping): it joins its value's chain
  (the rows are stored where the value is in registers) and its output aliases the cache
  input (:meth:`~fqr.core.Program.aliases`), recorded in :attr:`KernelPlan.stores`. A store
  whose cache is the output of an earlier store writes into the same buffer
  (:attr:`KernelPlan.cache_roots`); the stores into one buffer form a line (each cache value
  updated once, only the last one an output) and write disjoint entry fields
  (:attr:`KernelPlan.cache_fields`), so the order in which chains store does not matter.

How a head is held (its :class:`Layout`), from the chain's layout request:

* NeoX: piece ``a`` = features ``[0, R/2)``, ``b`` = ``[R/2, R)`` (two contiguous loads);
* GPT-J: ``a``/``b`` = even/odd features of ``[0, R)``, loaded as one contiguous pair tile and
  split in registers (``tl.split``), so loads stay vectorised;
* pass-through pieces ``p0, p1, ..`` = ``[R, D)`` (partial rotary), or the whole head without a
  request: runs as wide as the halves when that takes few pieces (pieces of one shape combine
  without layout conversions), else power-of-two runs (a bounded number: a narrow table on a
  wide head is masked, never cut feature by feature).

Elementwise rules work piece by piece; reductions sum over all pieces.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..core import (
    TOKENS,
    EntryField,
    Eqn,
    HeadLayout,
    HeadOp,
    PagedStore,
    Product,
    Program,
    Reduction,
    Role,
    Section,
    Var,
    Views,
)

# Pass-through in runs as wide as the rotated halves only while that takes at most this many
# pieces (Qwen3.5: D=256, R=64 -> 6 runs of 32); beyond it, power-of-two runs.
MAX_EQUAL_RUNS = 8


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pow2_parts(start: int, count: int, min_part: int = 16) -> list[tuple[int, int]]:
    """Split ``count`` features into power-of-two runs (the last one padded when small), so
    that a 192-wide pass-through is 128 + 64 registers rather than 256 with a quarter masked.
    At most ``log2(count) + 1`` runs."""
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

    @property
    def padded_elems(self) -> int:
        """fp32 registers the slot takes per head (a pair tile holds two per pair)."""
        return self.padded * (2 if self.kind == "pairs" else 1)


@dataclass(frozen=True)
class Layout:
    head_dim: int
    rotary_dim: int  # 0 when the chain has no layout request
    style: str  # "neox", "gptj" or "plain"

    @functools.cached_property
    def slots(self) -> tuple[Slot, ...]:
        d, r = self.head_dim, self.rotary_dim
        if self.style == "plain":
            return tuple(
                Slot("contig", (f"p{i}",), start, n)
                for i, (start, n) in enumerate(pow2_parts(0, d))
            )
        half = r // 2
        rot: tuple[Slot, ...]
        if self.style == "neox":
            rot = (Slot("contig", ("a",), 0, half), Slot("contig", ("b",), half, half))
        else:
            rot = (Slot("pairs", ("a", "b"), 0, half),)
        equal_runs = (d - r) // half
        if (
            self.style == "neox"
            and (d - r) % half == 0
            and half == next_pow2(half)
            and equal_runs <= MAX_EQUAL_RUNS
        ):
            # Pass-through in runs as wide as the rotated halves: every piece then has the same
            # shape, so the norm's per-head sums combine without layout conversions.
            parts = [(start, half) for start in range(r, d, half)]
        else:
            parts = pow2_parts(r, d - r)
        return rot + tuple(
            Slot("contig", (f"p{i}",), start, n) for i, (start, n) in enumerate(parts)
        )

    @property
    def padded_elems(self) -> int:
        """fp32 registers one head takes in this layout (its slots, padded)."""
        return sum(slot.padded_elems for slot in self.slots)

    @property
    def tag(self) -> str:
        return "plain" if self.style == "plain" else f"{self.style}{self.rotary_dim}"


@dataclass(frozen=True)
class ProductSource:
    """The packed row of a product-sourced chain: ``hidden @ weight.T (+ bias)`` of program
    inputs (:class:`fqr.core.Product`), ``depth`` (K) the length of each dot product."""

    hidden: Var
    weight: Var
    bias: Var | None

    @property
    def depth(self) -> int:
        return int(self.hidden.aval.shape[1])


@dataclass
class Chain:
    """A per-head value and the equations that transform it (see module docstring)."""

    index: int
    source: Var  # a view's output or a program input
    packed: Var  # the program input the chain's heads are loaded from
    section: Section  # where the heads are in a row of ``packed``
    eqns: list[Eqn] = field(default_factory=list)
    layout: Layout | None = None
    row_reductions: list[Eqn] = field(default_factory=list)  # sums over the whole row
    product: ProductSource | None = None  # the packed row is a product computed in the kernel

    @property
    def heads(self) -> int:
        return self.section.heads

    @property
    def head_dim(self) -> int:
        return self.section.head_dim

    @property
    def compute_free(self) -> bool:
        return not self.eqns

    @property
    def width(self) -> int:
        return self.section.width

    @property
    def padded_heads(self) -> int:
        return next_pow2(self.heads)

    @property
    def head_layout(self) -> Layout:
        assert self.layout is not None, "the plan sets every chain's layout"
        return self.layout

    def operands(self, role: Role) -> list[Var]:
        """The operands the chain's equations read in ``role`` (in program order)."""
        found = []
        for e in self.eqns:
            facts = e.facts()
            assert isinstance(facts, HeadOp)
            found += [v for v, r in zip(e.inputs, facts.operands) if r is role and v is not None]
        return found


@dataclass
class KernelPlan:
    program: Program
    chains: list[Chain]
    chain_of: dict[int, Chain]  # id(var) -> chain holding it
    roles: dict[int, Role]  # id(program input) -> how the kernel reads it
    stores: dict[int, Chain] = field(default_factory=dict)  # id(paged store output) -> chain
    # id(a cache value: a CACHE input or a store's output) -> the program input it updates
    cache_roots: dict[int, Var] = field(default_factory=dict)
    # id(cache input) -> the entry fields its stores write (empty: a 4-D cache's whole rows)
    cache_fields: dict[int, tuple[EntryField, ...]] = field(default_factory=dict)

    @property
    def products(self) -> bool:
        """Whether a chain's packed row is a product computed in the kernel (the projected
        form: the kernel is a GEMM with the prologue as its epilogue)."""
        return any(c.product is not None for c in self.chains)

    def input_role(self, var: Var) -> Role | None:
        """How the kernel reads a program input (None: an input nothing reads)."""
        return self.roles.get(id(var))

    def cache_root(self, var: Var) -> Var:
        """The program input (the buffer) a cache value updates: itself for an input."""
        return self.cache_roots.get(id(var), var)

    @property
    def wide_byte_fields(self) -> bool:
        """Whether a store puts values wider than a byte into a byte-layout (``uint8``) cache
        entry (a target whose compiler refuses pointer casts between widths stores them byte by
        byte: ``Tiling.byte_stores``)."""
        return any(
            f.dtype.itemsize > 1
            for v in self.program.inputs
            if v.aval.dtype == torch.uint8
            for f in self.cache_fields.get(id(v), ())
        )

    def stored_dtypes(self, cache: Var) -> set:
        """The dtypes the kernel stores into the cache input ``cache`` (its own dtype, and
        those of the fields a byte-layout entry holds)."""
        fields = self.cache_fields.get(id(cache), ())
        return {f.dtype for f in fields} if fields else {cache.aval.dtype}


class PlanError(ValueError):
    """The program is outside what the fused lowering supports; the message says why."""


def plan_program(program: Program) -> KernelPlan:
    chains: list[Chain] = []
    chain_of: dict[int, Chain] = {}
    roles: dict[int, Role] = {}
    stores: dict[int, Chain] = {}
    cache_roots: dict[int, Var] = {}
    cache_stores: dict[int, list[tuple[str, tuple[EntryField, ...]]]] = {}
    updated: set[int] = set()  # cache values a store has already updated
    input_ids = {id(v) for v in program.inputs}
    printer_names = {id(v): f"input {i}" for i, v in enumerate(program.inputs)}
    products: dict[int, ProductSource] = {}  # id(a product's output) -> how it is computed

    def assign(var: Var, role: Role, prim: str) -> None:
        if id(var) not in input_ids:
            raise PlanError(
                f"{prim}: its {role.value} operand must be a program input, not a computed value"
            )
        if roles.setdefault(id(var), role) is not role:
            raise PlanError(
                f"{printer_names[id(var)]} is read as a {roles[id(var)].value} and as a "
                f"{role.value}"
            )

    def new_chain(var: Var, packed: Var, section: Section) -> Chain:
        c = Chain(len(chains), var, packed, section)
        chains.append(c)
        chain_of[id(var)] = c
        return c

    for e, facts in program.eqn_facts():
        name = e.prim.name
        if facts is None:
            raise PlanError(f"{name} has no lowering facts: it cannot be part of a fused kernel")
        if isinstance(facts, Product):
            products[id(e.outputs[0])] = _product_source(e, facts, assign)
            continue
        if isinstance(facts, Views):
            src = e.inputs[0]
            product = None if src is None else products.get(id(src))
            if product is None:
                if src is None or id(src) not in input_ids or src.aval.shape[0] != TOKENS:
                    raise PlanError(
                        f"{name} must read a [T, width] program input (a packed row) or a "
                        f"product's output"
                    )
                assign(src, Role.VALUE, name)
            assert src is not None
            for out, section in zip(e.outputs, facts.sections):
                new_chain(out, src, section).product = product
            continue
        x = e.inputs[facts.value_operand]
        assert x is not None
        if id(x) in products:
            raise PlanError(
                f"{name}: a product's output is cut into heads by a view before any op reads it"
            )
        if id(x) not in chain_of:
            if id(x) not in input_ids or x.aval.ndim != 2 or x.aval.shape[0] != TOKENS:
                raise PlanError(f"{name}: its operand must be a [T, width] activation")
            assign(x, Role.VALUE, name)
            width = x.aval.shape[1]
            assert isinstance(width, int)
            d = _infer_head_dim(program, x, width)
            new_chain(x, x, Section(width // d, d))
        chain = chain_of[id(x)]
        if facts.head_dim is not None and facts.head_dim != chain.head_dim:
            raise PlanError(
                f"{name} works on heads of {facts.head_dim} features, but its operand holds "
                f"heads of {chain.head_dim} (it must be head_dim, or the whole width "
                f"{chain.width} for a reduction over the row)"
            )
        for v, role in zip(e.inputs, facts.operands):
            if v is None or role is None or role is Role.VALUE:
                continue
            if role is Role.CACHE and isinstance(facts, PagedStore):
                root = _store_cache(v, name, facts, cache_roots, updated, stores)
                if root is v:
                    assign(v, role, name)
                cache_stores.setdefault(id(root), []).append((name, facts.fields))
                continue
            assign(v, role, name)
        if facts.reduction is Reduction.ROW and chain.heads > 1:
            chain.row_reductions.append(e)
        chain.eqns.append(e)
        for out in e.outputs:
            if isinstance(facts, PagedStore):
                stores[id(out)] = chain  # the updated cache: written by the rule, not a value
                cache = e.inputs[facts.cache_operand]
                assert cache is not None
                cache_roots[id(out)] = cache_roots.get(id(cache), cache)
            else:
                chain_of[id(out)] = chain

    for c in chains:
        requests: set[HeadLayout] = set()
        for e in c.eqns:
            facts = e.facts()
            assert isinstance(facts, HeadOp)
            if facts.layout is not None:
                requests.add(facts.layout)
        if len(requests) > 1:
            raise PlanError(
                f"one value is asked for two register layouts: "
                f"{sorted((r.style, r.rotary_dim) for r in requests)}"
            )
        if requests:
            (req,) = requests
            c.layout = Layout(c.head_dim, req.rotary_dim, req.style)
        else:
            c.layout = Layout(c.head_dim, 0, "plain")
    for v in program.outputs:
        if id(v) not in chain_of and id(v) not in stores:
            raise PlanError("every program output must be a per-head value computed in the kernel")
        if id(v) in updated:
            raise PlanError(
                "a cache that a later store updates cannot also be an output: the kernel "
                "keeps one buffer per cache (return the last store's output)"
            )
    cache_fields = {}
    for v in program.inputs:
        if id(v) in cache_stores:
            cache_fields[id(v)] = _check_fields(v, cache_stores[id(v)])
    return KernelPlan(program, chains, chain_of, roles, stores, cache_roots, cache_fields)


def _product_source(e: Eqn, facts: Product, assign) -> ProductSource:
    """The :class:`ProductSource` of a :class:`fqr.core.Product` equation, its operands
    assigned their roles: the hidden states ``[T, K]``, the weight ``[N, K]`` (N the output's
    width), the bias ``[N]`` or None."""
    name = e.prim.name
    hidden_at, weight_at = facts.operand(Role.HIDDEN), facts.operand(Role.WEIGHT)
    bias_at = facts.operand(Role.BIAS)
    if hidden_at is None or weight_at is None:
        raise PlanError(f"{name}: a product needs a hidden-states and a weight operand")
    x, w = e.inputs[hidden_at], e.inputs[weight_at]
    bias = None if bias_at is None else e.inputs[bias_at]
    assert x is not None and w is not None
    depth = x.aval.shape[1] if x.aval.ndim == 2 else None
    if x.aval.shape[0] != TOKENS or not isinstance(depth, int):
        raise PlanError(f"{name}: its hidden states must be [T, K] with K fixed, got {x.aval}")
    if w.aval.ndim != 2 or w.aval.shape[1] != depth:
        raise PlanError(f"{name}: its weight must be [N, {depth}], got {w.aval}")
    for v, role in zip(e.inputs, facts.operands):
        if v is not None and role is not None:
            assign(v, role, name)
    return ProductSource(x, w, bias)


def _store_cache(
    cache: Var,
    prim: str,
    facts: PagedStore,
    roots: dict[int, Var],
    updated: set[int],
    stores: dict[int, Chain],
) -> Var:
    """The buffer a store writes: its CACHE operand, a program input, or the output of an
    earlier store (then that store's buffer). Each cache value is updated once: a second store
    of the same value would need a copy of the buffer."""
    if id(cache) in updated:
        raise PlanError(
            f"{prim}: its cache was already updated by another store; chain the stores (each "
            f"store's cache the previous store's output)"
        )
    updated.add(id(cache))
    if id(cache) in stores:
        return roots[id(cache)]
    if cache.aval.ndim not in (3, 4):
        raise PlanError(f"{prim}: a paged cache is 3-D or 4-D, got {cache.aval}")
    return cache


def _check_fields(
    cache: Var, stores: list[tuple[str, tuple[EntryField, ...]]]
) -> tuple[EntryField, ...]:
    """The fields the stores into ``cache`` write: in the entry, each aligned to its dtype,
    none overlapping another (a store without fields writes whole rows: it must be alone)."""
    if len(stores) > 1 and any(not fields for _, fields in stores):
        raise PlanError(
            f"{len(stores)} stores write whole rows of one cache {cache.aval}: they would "
            f"overlap (entry fields are for a [blocks, block_size, entry] cache)"
        )
    itemsize = cache.aval.dtype.itemsize
    entry = cache.aval.shape[-1]
    assert isinstance(entry, int)
    spans = []
    for prim, fields in stores:
        for f in fields:
            start, end = f.byte_range(itemsize)
            if f.offset < 0 or f.count < 1 or end > entry * itemsize:
                raise PlanError(
                    f"{prim}: field {f} (bytes [{start}, {end})) is outside the "
                    f"{entry * itemsize}-byte entry of {cache.aval}"
                )
            if start % f.dtype.itemsize:
                raise PlanError(f"{prim}: field {f} starts at byte {start}, not {f.dtype} aligned")
            spans.append((start, end, prim, f))
    spans.sort(key=lambda s: (s[0], s[1]))
    for (_, end, p1, f1), (start, _, p2, f2) in zip(spans, spans[1:]):
        if start < end:
            raise PlanError(
                f"{p1} ({f1}) and {p2} ({f2}) write overlapping bytes of one cache entry"
            )
    return tuple(f for *_, f in spans)


def _infer_head_dim(program: Program, start: Var, width: int) -> int:
    """head_dim of an activation input: from the facts of the ops downstream, else the width."""
    members, found = {id(start)}, []
    for e, facts in program.eqn_facts():
        if not isinstance(facts, HeadOp):
            continue
        x = e.inputs[facts.value_operand]
        if x is not None and id(x) in members:
            members.update(id(o) for o in e.outputs)
            if facts.head_dim is not None:
                found.append(facts.head_dim)
    if len(set(found)) > 1:
        raise PlanError(f"inconsistent head_dim for one value: {sorted(set(found))}")
    return found[0] if found else width
