"""The functional core: primitives, traced programs, and their interpretation.

A :class:`Primitive` is an object; the rules that give it meaning sit beside it, one per
interpretation, registered by the op module that defines it (``fqr/ops/*.py``), as in JAX:

* ``impl``     -- the reference implementation on torch tensors (any device, any float dtype;
                  it computes in the dtype it is given, so float64 in gives float64 math);
* ``abstract`` -- the shape/dtype rule: input :class:`Aval` s and params to output avals,
                  raising ``ValueError``/``TypeError`` that names the bad argument;
* ``facts``    -- the lowering facts: what the kernel planner (``fqr/lowering/plan.py``) must
                  know to fuse the op, as data (:class:`Views` for an op whose outputs are
                  head-structured views of a packed row, :class:`HeadOp` for an op that
                  transforms one head-structured value head by head);
* ``lower``    -- the emit rule: writes the op's lines of Triton source through the
                  :class:`EmitContext` the lowering hands it.

The lowering never tests a primitive's name: it asks the primitive's ``facts`` and calls its
``lower`` rule, so a new op is one file in ``fqr/ops/`` (see ARCHITECTURE.md, "How to add an op").

Calling an op on tensors runs ``impl``; calling it on :class:`Tracer` s (inside :func:`trace`)
records an :class:`Eqn` instead. A :class:`Program` prints like a jaxpr::

    { lambda a:bf16[T,6144] b:int64[T] c:fp32[P,128] d:bf16[128] e:bf16[128]. let
        f:bf16[T,4096] g:bf16[T,1024] h:bf16[T,1024] =
            split_heads[sections=(32x128@0,8x128@4096,8x128@5120)] a
        i:bf16[T,4096] = rms_norm[count=128 eps=1e-06 group=128 offset=0.0] f d _ _
        ...
      in (k, l, h) }

(the printer writes each equation on one line).

The token dimension is the symbol ``"T"``: programs (and their kernels) are shape-polymorphic
in it, so a new batch size never retraces or recompiles.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

TOKENS = "T"

_Key = TypeVar("_Key")
_Value = TypeVar("_Value")


def lookup(
    table: Mapping[_Key, _Value], name: _Key, what: str, *, extra_choices: Sequence[str] = ()
) -> _Value:
    """``table[name]`` from one of fqr's registries (backends, targets, chips, variants,
    presets, dtypes, ...). A name that is not a key (an unhashable one included) is a ValueError
    naming the argument ``what`` and listing the choices, ``extra_choices`` (names the caller
    resolves before the lookup, such as ``auto``) first:
    ``backend must be one of auto, reference, interpret, got 'x'``."""
    try:
        return table[name]
    except (KeyError, TypeError):
        choices = ", ".join(str(choice) for choice in (*extra_choices, *table))
        raise ValueError(f"{what} must be one of {choices}, got {name!r}") from None


# The one dtype vocabulary of fqr: programs print with it, and the goldens, the CLI, the bench
# and the runtime name dtypes by it (``dtype_of("bf16")``, ``dtype_name(torch.float16)``).
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp64": torch.float64,
    "fp8e4m3": torch.float8_e4m3fn,
    "fp8e5m2": torch.float8_e5m2,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,  # a byte-layout cache entry (``fqr.ops.byte_cache``)
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
# vLLM's ``kv_cache_dtype`` names of a per-tensor FP8 cache -> the float8 dtype it holds (vLLM
# allocates such a cache as uint8 bytes).
KV_CACHE_FP8_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
ACTIVATION_DTYPE_NAMES = ("bf16", "fp16", "fp32")


def dtype_name(dtype: torch.dtype) -> str:
    """fqr's name of ``dtype`` (``torch.bfloat16`` -> ``"bf16"``)."""
    return lookup(DTYPE_NAMES, dtype, "dtype")


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype fqr calls ``name`` (``"bf16"`` -> ``torch.bfloat16``)."""
    return lookup(DTYPES, name, "dtype")


class TraceError(TypeError):
    """A traced function did something the functional core cannot represent."""


@dataclass(frozen=True)
class Aval:
    """Abstract value: a shape (ints, or ``"T"`` for the token dim) and a dtype."""

    shape: tuple[int | str, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{DTYPE_NAMES.get(self.dtype, str(self.dtype))}[{','.join(map(str, self.shape))}]"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @classmethod
    def of(cls, x: torch.Tensor | None, *leading: str) -> Aval | None:
        """The abstract value of ``x`` with its leading dims renamed (``"T"``, ``"P"``), or None."""
        if x is None:
            return None
        return cls(tuple(leading) + tuple(x.shape[len(leading) :]), x.dtype)


def spec(*shape: int | str, dtype: torch.dtype = torch.bfloat16) -> Aval:
    """Argument spec for :func:`trace`, e.g. ``spec("T", 6144, dtype=torch.bfloat16)``."""
    return Aval(tuple(shape), dtype)


@dataclass(eq=False)
class Var:
    aval: Aval

    def __repr__(self) -> str:
        return f"Var({self.aval})"


@dataclass
class Eqn:
    prim: Primitive
    inputs: list[Var | None]  # None: an optional operand that is absent
    outputs: list[Var]
    params: dict[str, Any]

    def facts(self) -> Views | HeadOp | Product | None:
        """The primitive's lowering facts for this equation (None: the primitive has none)."""
        if self.prim.facts is None:
            return None
        avals = [None if v is None else v.aval for v in self.inputs]
        return self.prim.facts(*avals, **self.params)


@dataclass
class Program:
    inputs: list[Var]
    eqns: list[Eqn]
    outputs: list[Var]

    def __str__(self) -> str:
        return ProgramPrinter(self).render()

    def aliases(self) -> dict[int, int]:
        """Output index -> input index, for each output that is an updated copy of an input
        (a :class:`PagedStore`'s cache): a kernel writes it in place into that input's buffer.
        Stores chain: a store whose cache operand is the output of an earlier store updates
        the same input (:meth:`store_roots`)."""
        if "_aliases" in self.__dict__:
            return dict(self.__dict__["_aliases"])
        inputs = {id(v): i for i, v in enumerate(self.inputs)}
        roots = self.store_roots()
        aliased: dict[int, int] = {}
        for i, out in enumerate(self.outputs):
            root = roots.get(id(out))
            if root is not None and id(root) in inputs:
                aliased[i] = inputs[id(root)]
        self.__dict__["_aliases"] = aliased
        return dict(aliased)

    def store_roots(self) -> dict[int, Var]:
        """``id(var)`` -> the program input it is an updated copy of, for each output of a
        :class:`PagedStore` (the cache it wrote into, followed back through earlier stores
        to the input buffer they all update)."""
        roots: dict[int, Var] = {}
        for e, facts in self.eqn_facts():
            if isinstance(facts, PagedStore):
                cache = e.inputs[facts.cache_operand]
                if cache is not None:
                    roots[id(e.outputs[0])] = roots.get(id(cache), cache)
        return roots

    def eqn_facts(self) -> list[tuple[Eqn, Views | HeadOp | Product | None]]:
        """Each equation with its primitive's lowering facts."""
        return [(e, e.facts()) for e in self.eqns]

    def fingerprint(self) -> str:
        """A stable text that identifies the program (for kernel-cache keys)."""
        if "_fingerprint" not in self.__dict__:
            self.__dict__["_fingerprint"] = str(self)
        return self.__dict__["_fingerprint"]


def _fmt_param(v: Any) -> str:
    if isinstance(v, tuple):
        return "(" + ",".join(map(_fmt_param, v)) + ")"
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, torch.dtype):
        return DTYPE_NAMES[v]
    return str(v)


class ProgramPrinter:
    def __init__(self, program: Program) -> None:
        self.program = program
        self.names: dict[int, str] = {}
        self._letters = _name_stream()

    def name(self, v: Var | None) -> str:
        if v is None:
            return "_"
        if id(v) not in self.names:
            self.names[id(v)] = next(self._letters)
        return self.names[id(v)]

    def typed(self, v: Var) -> str:
        return f"{self.name(v)}:{v.aval}"

    def render(self) -> str:
        p = self.program
        head = " ".join(self.typed(v) for v in p.inputs)
        lines = [f"{{ lambda {head}. let"]
        for e in p.eqns:
            outs = " ".join(self.typed(v) for v in e.outputs)
            params = " ".join(f"{k}={_fmt_param(v)}" for k, v in sorted(e.params.items()))
            ins = " ".join(self.name(v) for v in e.inputs)
            lines.append(f"    {outs} = {e.prim.name}[{params}] {ins}")
        lines.append(f"  in ({', '.join(self.name(v) for v in p.outputs)}) }}")
        return "\n".join(lines)


def _name_stream() -> Iterator[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    for n in itertools.count(1):
        for combo in itertools.product(letters, repeat=n):
            yield "".join(combo)


# ------------------------------------------------------------------------- lowering facts
#
# What the kernel planner asks of a primitive, as plain data. The fused kernel holds every
# head-structured value ``[T, H*D]`` as register tiles ``[tokens, heads, features]``; a primitive
# either makes such values out of a packed row (:class:`Views`) or transforms one of them head by
# head (:class:`HeadOp`), reading its other operands in one of the :class:`Role` s below.


@dataclass(frozen=True)
class Section:
    """One head-structured view of a packed ``[T, W]`` row: ``heads`` heads of ``head_dim``
    features, head ``h`` at columns ``[offset + h*head_stride, offset + h*head_stride + head_dim)``.

    ``head_stride`` defaults to ``head_dim`` (heads back to back); a larger stride skips columns
    between heads: padded heads ``[T, H, D + pad]``, or heads interleaved with another view's
    (Qwen3.5's gate: q head ``h`` then gate head ``h``, both views of stride ``2*D``; GPT-NeoX's
    per-head ``[q_h | k_h | v_h]``: three views of stride ``3*D``). It prints as
    ``HxD@offset`` (``/stride`` added when heads are not back to back).

    ``group_heads`` (0: one group of all heads) puts the heads in groups of that many, each
    group ``group_stride`` columns after the previous one: head ``h`` starts at ``offset +
    (h // group_heads) * group_stride + (h % group_heads) * head_stride`` (CodeGen's row of four
    model-parallel shards ``[q_g | v_g | k_g]``); it prints ``:G/group_stride`` after the rest.
    """

    heads: int
    head_dim: int
    offset: int = 0
    head_stride: int = 0  # 0: head_dim
    group_heads: int = 0  # 0: heads (one group)
    group_stride: int = 0  # columns from one group's first head to the next group's

    def __post_init__(self) -> None:
        for name in ("heads", "head_dim", "offset", "head_stride", "group_heads", "group_stride"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"section {name} must be an int, got {v!r}")
        if self.heads < 1 or self.head_dim < 1 or self.offset < 0:
            raise ValueError(
                f"a section needs heads >= 1, head_dim >= 1 and offset >= 0, got {self!s}"
            )
        if self.head_stride == 0:
            object.__setattr__(self, "head_stride", self.head_dim)
        if self.head_stride < self.head_dim:
            raise ValueError(
                f"section {self!s}: head_stride {self.head_stride} < head_dim {self.head_dim} "
                f"(heads would overlap)"
            )
        if self.group_heads in (0, self.heads):  # one group: the plain layout
            object.__setattr__(self, "group_heads", 0)
            object.__setattr__(self, "group_stride", 0)
            return
        if self.group_heads < 0 or self.heads % self.group_heads:
            raise ValueError(
                f"section {self!s}: group_heads {self.group_heads} does not divide heads "
                f"{self.heads}"
            )
        span = (self.group_heads - 1) * self.head_stride + self.head_dim
        if self.group_stride < span:
            raise ValueError(
                f"section {self!s}: group_stride {self.group_stride} < a group's span {span} "
                "(groups would overlap)"
            )

    @property
    def grouped(self) -> bool:
        """Whether the heads sit in several groups (:attr:`group_heads`)."""
        return self.group_heads != 0

    @property
    def width(self) -> int:
        """Features of the view: ``heads * head_dim``."""
        return self.heads * self.head_dim

    def head_start(self, h: int) -> int:
        """The packed row's column where head ``h`` starts."""
        if not self.grouped:
            return self.offset + h * self.head_stride
        g, i = divmod(h, self.group_heads)
        return self.offset + g * self.group_stride + i * self.head_stride

    @property
    def end(self) -> int:
        """One past the last column of the packed row the view reads."""
        return self.head_start(self.heads - 1) + self.head_dim

    def head_columns(self) -> Iterator[tuple[int, int]]:
        """``(first column, one past the last)`` of each head in the packed row."""
        for h in range(self.heads):
            start = self.head_start(h)
            yield start, start + self.head_dim

    def __str__(self) -> str:
        stride = "" if self.head_stride == self.head_dim else f"/{self.head_stride}"
        groups = f":{self.group_heads}/{self.group_stride}" if self.grouped else ""
        return f"{self.heads}x{self.head_dim}@{self.offset}{stride}{groups}"


def qkv_sections(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    num_v_heads: int | None = None,
    v_head_dim: int | None = None,
    head_stride: int | None = None,
) -> tuple[Section, ...]:
    """The ``[q | k | v]`` row of vLLM's packed QKV projection: heads back to back, or every
    head ``head_stride`` columns from the last (a padded ``[T, heads, head_stride]`` layout);
    v may have its own head count and head_dim (default: k's)."""
    hv = num_kv_heads if num_v_heads is None else num_v_heads
    dv = head_dim if v_head_dim is None else v_head_dim
    if head_stride is None:
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        return (
            Section(num_heads, head_dim, 0),
            Section(num_kv_heads, head_dim, q_size),
            Section(hv, dv, q_size + kv_size),
        )
    s = head_stride
    return (
        Section(num_heads, head_dim, 0, s),
        Section(num_kv_heads, head_dim, num_heads * s, s),
        Section(hv, dv, (num_heads + num_kv_heads) * s, s),
    )


class Role(enum.Enum):
    """How a per-head op reads one operand (:attr:`HeadOp.operands`)."""

    VALUE = "value"  # the [T, H*D] value it transforms, held as per-head register tiles
    HEAD_VECTOR = "head vector"  # [D]: the same vector for every head (QK-norm weight)
    ROW_VECTOR = "row vector"  # [H*D]: one entry per feature of the whole row (OLMo2's weight)
    TOKEN_VALUE = "token value"  # [T] number read as fp32: a statistic, or positions as numbers
    INDEX = "index"  # [T] int: one row number per token (positions, a slot mapping)
    TABLE = "table"  # [rows, width]: rows gathered by an INDEX operand (cos_sin_cache)
    SCALAR = "scalar"  # [1] float: one number for the whole call (a per-tensor scale)
    CACHE = "cache"  # [blocks, block_size, heads, head_dim] or [blocks, block_size, entry]
    HIDDEN = "hidden states"  # [T, K]: the rows a Product multiplies (K static)
    WEIGHT = "weight"  # [N, K], contiguous: the matrix a Product multiplies by (transposed)
    BIAS = "bias"  # [N]: one number per column of a Product's output


class Reduction(enum.Enum):
    """The group over which a per-head op sums the squares of its value (a norm's statistic)."""

    HEAD = "head"  # each head on its own: [T, H] sums
    ROW = "row"  # the whole row of the value (all heads): [T] sums


@dataclass(frozen=True)
class HeadLayout:
    """How an op needs a head held in registers: its first ``rotary_dim`` features as two
    pieces ``a`` and ``b`` of ``rotary_dim / 2`` features each, pairing feature ``i`` with
    ``i + R/2`` (``"neox"``) or ``2i`` with ``2i + 1`` (``"gptj"``); the other features of the
    head are pass-through pieces. Without a request a head is held as plain pieces."""

    rotary_dim: int
    style: str  # "neox" | "gptj"

    def __post_init__(self) -> None:
        if self.style not in ("neox", "gptj"):
            raise ValueError(f"layout style must be 'neox' or 'gptj', got {self.style!r}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and >= 2, got {self.rotary_dim}")


@dataclass(frozen=True)
class Views:
    """Facts of a primitive whose outputs are head-structured views of operand 0, a packed
    ``[T, W]`` activation: one :class:`Section` per output. It emits no code: each output is
    loaded from the packed row where it is first used."""

    sections: tuple[Section, ...]


@dataclass(frozen=True)
class Product:
    """Facts of a primitive whose output is a packed row ``[T, N]`` computed as a matrix
    product of program inputs: ``y[t, n] = sum_k x[t, k] * w[n, k] (+ bias[n])``, the operands
    in the roles :attr:`Role.HIDDEN` (x), :attr:`Role.WEIGHT` (w) and :attr:`Role.BIAS` (bias,
    None where absent). The kernel never holds ``y`` whole: a :class:`Views` equation cuts it
    into heads as it cuts a packed input, and each head is computed where it is first used, its
    columns' dot products accumulated in fp32 over K (the prologue then runs on the
    accumulator, the GEMM's epilogue)."""

    operands: tuple[Role | None, ...]

    def operand(self, role: Role) -> int | None:
        """The index of the operand in ``role`` (None: the op has none)."""
        found = [i for i, r in enumerate(self.operands) if r is role]
        return found[0] if found else None


@dataclass(frozen=True)
class HeadOp:
    """Facts of a primitive that transforms one head-structured value head by head.

    ``operands``: the :class:`Role` of each operand (None where an optional one is absent);
    exactly one is :attr:`Role.VALUE`, and the op's outputs are head-structured like it.
    ``head_dim``: the head width the op assumes (None: any, e.g. an elementwise op).
    ``layout``: the register layout the op needs (RoPE's pairs), or None.
    ``reduction``: the group over which the op sums the squares of its value (a norm), or None.
    """

    operands: tuple[Role | None, ...]
    head_dim: int | None = None
    layout: HeadLayout | None = None
    reduction: Reduction | None = None

    @property
    def value_operand(self) -> int:
        (index,) = [i for i, r in enumerate(self.operands) if r is Role.VALUE]
        return index


@dataclass(frozen=True)
class EntryField:
    """A part of a paged cache's entry that a :class:`PagedStore` writes: ``count`` values of
    ``dtype`` stored back to back from element ``offset`` of the entry (in the cache's own
    elements: bytes for a ``uint8`` cache, whose entry then holds values of other dtypes at
    byte offsets). It prints as ``dtype[count]@offset``."""

    offset: int
    dtype: torch.dtype
    count: int

    def byte_range(self, cache_itemsize: int) -> tuple[int, int]:
        """``(first byte, one past the last)`` of the field within the entry."""
        start = self.offset * cache_itemsize
        return start, start + self.count * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{DTYPE_NAMES.get(self.dtype, str(self.dtype))}[{self.count}]@{self.offset}"


@dataclass(frozen=True)
class PagedStore(HeadOp):
    """Facts of a primitive that writes the heads of its VALUE operand into a paged cache: a
    functional update (``cache.at[slots].set(value)``, as in JAX) whose one output is the
    updated cache.

    ``operands`` gives exactly one :attr:`Role.CACHE`, one :attr:`Role.INDEX` (the slot
    mapping ``[T]``: token ``t`` goes to block ``slot // block_size``, row ``slot %
    block_size``; a negative slot writes nothing, as vLLM's padding slots) and the VALUE. The
    cache is

    * ``[blocks, block_size, heads, head_dim]`` (``fields`` empty): the value's heads are the
      cache's heads, the whole entry is written;
    * ``[blocks, block_size, entry]``: an entry per slot, of which the store writes the
      :class:`EntryField` s in ``fields`` (the value's features at a column offset; values of
      other dtypes at byte offsets of a ``uint8`` entry). Several stores may fill one entry:
      a store's CACHE operand may be the output of an earlier store (the stores chain, and
      all update one buffer), as long as their fields do not overlap.

    The CACHE operand is a program input or the output of an earlier store. The output
    aliases the input at the start of the chain (:meth:`Program.aliases`): the lowering
    stores in place into the buffer it is given, which the caller donates or copies first;
    the emit rule hands what it stores to :meth:`EmitContext.scatter_rows` (and
    :meth:`EmitContext.scatter_head_values`).
    """

    fields: tuple[EntryField, ...] = ()

    @property
    def cache_operand(self) -> int:
        (index,) = [i for i, r in enumerate(self.operands) if r is Role.CACHE]
        return index

    @property
    def slots_operand(self) -> int:
        (index,) = [i for i, r in enumerate(self.operands) if r is Role.INDEX]
        return index


class EmitContext(Protocol):
    """What an emit rule (``prim.lower(b, eqn)``) may ask of the kernel being written.

    Values are held as *pieces*: a dict from piece name to the name of a ``[BLOCK_T, heads,
    features]`` fp32 tile (``a``/``b`` for the pair halves of a :class:`HeadLayout`, ``p0``,
    ``p1`` ... for the other features). A rule reads its value's pieces, emits lines that
    compute new pieces (``fresh`` names), and binds them to its outputs with ``set``.
    """

    def pieces(self, var: Var) -> dict[str, str]:
        """The pieces of a head-structured value (loaded from the packed row on first use)."""
        ...

    def set(self, var: Var, pieces: dict[str, str]) -> None:
        """Bind an output of the equation to its pieces."""
        ...

    def vector(self, var: Var, role: Role) -> dict[str, str]:
        """A HEAD_VECTOR ``[D]`` or ROW_VECTOR ``[H*D]`` operand as fp32 pieces that broadcast
        against the value's pieces (a head vector is loaded once, before the token loop)."""
        ...

    def token_values(self, var: Var) -> str:
        """A TOKEN_VALUE ``[T]`` operand as an fp32 ``[BLOCK_T]`` tile (loaded once per tile)."""
        ...

    def gather(self, table: Var, index: Var, start: int, count: int, name: str = "g") -> str:
        """Columns ``[start, start + count)`` of ``table[index[t]]`` as an fp32 ``[BLOCK_T, 1,
        count]`` tile (padded to a power of two; ``name`` prefixes its variable), loaded once per
        token tile and shared by every value; an index outside the table reads NaN, never out of
        bounds."""
        ...

    def scalar(self, var: Var) -> str:
        """A SCALAR ``[1]`` operand as an fp32 scalar (loaded once, before the token loop)."""
        ...

    def scatter_rows(
        self,
        cache: Var,
        slots: Var,
        pieces: dict[str, str],
        *,
        offset: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Store ``pieces`` (fp32, the layout of the value being transformed) into the paged
        ``cache`` at ``slots[t]``, rounded to ``dtype`` (default: the cache's dtype); a token
        with a negative slot (or past T) stores nothing. A 4-D cache: head ``h`` of the value
        is head ``h`` of the row (``offset`` 0). A 3-D cache ``[blocks, block_size, entry]``:
        the value's features go back to back as ``dtype`` elements from entry element
        ``offset`` (the cache's elements: a byte offset into a ``uint8`` entry, whose address
        is then read as a ``dtype`` pointer), head ``h`` at ``offset`` + ``h * head_dim``
        ``dtype`` elements. ``cache`` may be the output of an earlier store: the same buffer."""
        ...

    def scatter_head_values(
        self, cache: Var, slots: Var, value: str, *, offset: int, dtype: torch.dtype
    ) -> None:
        """Store ``value``, an fp32 ``[BLOCK_T, heads]`` tile (one number per head of the value
        being transformed, e.g. a per-head scale), into the 3-D paged ``cache`` at
        ``slots[t]``: head ``h``'s number as the ``dtype`` element ``h`` counted from entry
        element ``offset`` (as :meth:`scatter_rows` addresses it), rounded to ``dtype``."""
        ...

    def head_amax(self, var: Var) -> str:
        """The largest ``|x|`` over each head's features of a value (``[BLOCK_T, heads]``; the
        padding of the register layout is left out)."""
        ...

    def head_sum(self, pieces: dict[str, str]) -> str:
        """The sum over each head's features of ``pieces`` (fp32 tiles in the layout of the
        value being transformed, e.g. a function of its pieces), ``[BLOCK_T, heads]``; the
        padding of the register layout is left out (a LayerNorm's mean and centred variance)."""
        ...

    def sum_squares(self, var: Var, over: Reduction) -> str:
        """The sum of squares of a value over each head (``[BLOCK_T, heads]``) or over its whole
        row (``[BLOCK_T]``, accumulated over head chunks when the row is processed in chunks)."""
        ...

    def keepdims(self, over: Reduction) -> str:
        """The index suffix that broadcasts a :meth:`sum_squares` result against the pieces."""
        ...

    def fresh(self, prefix: str) -> str:
        """A new variable name."""
        ...

    def var_name(self, var: Var) -> str:
        """The name of a program variable, as the program text prints it."""
        ...

    def emit(self, line: str) -> None:
        """Append one line of source at the current point of the kernel body."""
        ...

    def cast(self, expr: str, dtype: torch.dtype) -> str:
        """``expr`` (fp32) rounded to ``dtype`` (round to nearest even on every target)."""
        ...

    def round_point(self, expr: str, dtype: torch.dtype) -> str:
        """``expr`` (fp32) rounded to ``dtype`` and read back as fp32: a rounding point of a
        contract that rounds between steps (``numerics="unfused"``). The kernel keeps it: a
        multiply and an add are never contracted into one FMA across it."""
        ...


FactsRule = Callable[..., "Views | HeadOp | Product"]
EmitRule = Callable[[EmitContext, Eqn], None]


class Primitive:
    """A named operation; its interpretation rules are attached by the module defining it."""

    def __init__(self, name: str, multiple_results: bool = False) -> None:
        self.name = name
        self.multiple_results = multiple_results
        self.impl: Callable[..., Any] | None = None
        self.abstract: Callable[..., Any] | None = None
        self.facts: FactsRule | None = None
        self.lower: EmitRule | None = None

    def __repr__(self) -> str:
        return f"Primitive({self.name})"

    def def_impl(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        self.impl = fn
        return fn

    def def_abstract(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        self.abstract = fn
        return fn

    def def_facts(self, fn: FactsRule) -> FactsRule:
        self.facts = fn
        return fn

    def def_lowering(self, fn: EmitRule) -> EmitRule:
        self.lower = fn
        return fn

    def bind(self, *args: Any, **params: Any) -> Any:
        trace = _find_trace(args)
        if trace is not None:
            return trace.record(self, args, params)
        assert self.abstract is not None and self.impl is not None, f"{self.name}: no rules"
        # Eager call: validate with the same shape rule as tracing, compute in at least fp32,
        # round once to the output dtype (the fused contract, one op at a time).
        avals = [None if a is None else Aval(tuple(a.shape), a.dtype) for a in args]
        out_avals = self.abstract(*avals, **params)
        facts = self.facts(*avals, **params) if self.facts is not None else None
        roles = facts.operands if isinstance(facts, HeadOp) else (None,) * len(args)
        ins = [  # a table stays in its dtype: the impl gathers rows, then casts them
            None if a is None else a if role is Role.TABLE else _upcast(a, torch.float32)
            for a, role in zip(args, roles)
        ]
        out = self.impl(*ins, **params)
        if not self.multiple_results:
            return out.to(out_avals.dtype)
        return tuple(o.to(av.dtype) for o, av in zip(out, out_avals))


PRIMITIVES: dict[str, Primitive] = {}


def primitive(name: str, multiple_results: bool = False) -> Primitive:
    prim = Primitive(name, multiple_results)
    PRIMITIVES[name] = prim
    return prim


# ----------------------------------------------------------------------------- tracing


class Tracer:
    """An abstract value flowing through a traced function.

    Only fqr primitives accept tracers; any torch operation on one fails with
    :class:`TraceError` naming that operation.
    """

    def __init__(self, trace: Trace, var: Var) -> None:
        self._trace = trace
        self.var = var

    @property
    def shape(self) -> tuple[int | str, ...]:
        return self.var.aval.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.var.aval.dtype

    @property
    def ndim(self) -> int:
        return self.var.aval.ndim

    def __repr__(self) -> str:
        return f"Tracer({self.var.aval})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        raise TraceError(
            f"unsupported torch op torch.{name} on a traced value: fqr can trace only its own "
            f"primitives ({', '.join(sorted(PRIMITIVES))})"
        )

    def __getattr__(self, attr: str) -> Any:
        raise TraceError(
            f"unsupported torch op Tensor.{attr} on a traced value: fqr can trace only its own "
            f"primitives ({', '.join(sorted(PRIMITIVES))})"
        )


def _unsupported_operator(opname: str) -> Callable[..., Any]:
    def method(self: Tracer, *args: Any) -> Any:
        raise TraceError(
            f"unsupported torch op {opname} on a traced value: fqr can trace only its own "
            f"primitives ({', '.join(sorted(PRIMITIVES))})"
        )

    return method


for _op in (
    "add",
    "sub",
    "mul",
    "truediv",
    "pow",
    "matmul",
    "neg",
    "getitem",
    "radd",
    "rsub",
    "rmul",
    "rtruediv",
    "iter",
    "len",
    "bool",
    "float",
    "int",
):
    setattr(Tracer, f"__{_op}__", _unsupported_operator(f"Tensor.__{_op}__"))


class Trace:
    def __init__(self) -> None:
        self.eqns: list[Eqn] = []

    def new_input(self, aval: Aval) -> Tracer:
        return Tracer(self, Var(aval))

    def record(self, prim: Primitive, args: Sequence[Any], params: dict[str, Any]) -> Any:
        assert prim.abstract is not None, f"{prim.name} has no shape rule"
        in_vars: list[Var | None] = []
        for i, a in enumerate(args):
            if a is None:
                in_vars.append(None)
            elif isinstance(a, Tracer):
                if a._trace is not self:
                    raise TraceError(f"{prim.name}: operand {i} belongs to another trace")
                in_vars.append(a.var)
            else:
                raise TraceError(
                    f"{prim.name}: operand {i} is a concrete {type(a).__name__}; inside fqr.trace "
                    f"every tensor must be an argument of the traced function"
                )
        out_avals = prim.abstract(*[None if v is None else v.aval for v in in_vars], **params)
        if not prim.multiple_results:
            out_avals = [out_avals]
        outs = [Var(av) for av in out_avals]
        self.eqns.append(Eqn(prim, in_vars, outs, dict(params)))
        tracers = [Tracer(self, v) for v in outs]
        return tuple(tracers) if prim.multiple_results else tracers[0]


def _find_trace(args: Sequence[Any]) -> Trace | None:
    for a in args:
        if isinstance(a, Tracer):
            return a._trace
    return None


def trace(fn: Callable[..., Any], *arg_specs: Aval | torch.Tensor | None, **static: Any) -> Program:
    """Run ``fn(*args, **static)`` on abstract values and return the :class:`Program` it builds.

    ``arg_specs`` are :class:`Aval` s (see :func:`spec`), tensors (their leading dim becomes the
    symbolic token dim ``T`` when it is 2-D activation-like: pass an Aval to be explicit), or
    ``None`` for an absent optional operand. ``static`` keyword arguments are passed through
    unchanged (head counts, eps, flags).
    """
    tr = Trace()
    args: list[Tracer | None] = []
    inputs: list[Var] = []
    for s in arg_specs:
        if s is None:
            args.append(None)
            continue
        aval = s if isinstance(s, Aval) else Aval(tuple(s.shape), s.dtype)
        t = tr.new_input(aval)
        args.append(t)
        inputs.append(t.var)
    out = fn(*args, **static)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    out_vars = []
    for o in outs:
        if not isinstance(o, Tracer) or o._trace is not tr:
            raise TraceError(
                f"traced function returned {type(o).__name__}; it must return values "
                f"computed by fqr primitives"
            )
        out_vars.append(o.var)
    return Program(inputs, tr.eqns, out_vars)


# ------------------------------------------------------------------------- interpretation


def eval_program(
    program: Program,
    args: Sequence[torch.Tensor],
    compute_dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Evaluate ``program`` with the primitives' reference ``impl`` rules.

    Floating inputs are upcast to ``compute_dtype`` (never downcast: float64 inputs stay float64)
    and every intermediate stays there; outputs are rounded once to their declared dtype. This is
    the ``fused`` numerics contract; rounding equations (``reduce_precision``, and the
    ``round_to`` of ``rms_norm`` / ``rope``) add the roundings of the ``unfused`` mode.
    ``args`` holds one entry per non-None program input, in order.

    An input that every equation reads as a :attr:`Role.TABLE` stays in its own dtype: the impl
    gathers the rows it needs, then casts them (a 262,144-row bf16 RoPE table is never copied
    to fp32 whole for a one-token call).
    """
    if len(args) != len(program.inputs):
        raise TypeError(f"program takes {len(program.inputs)} inputs, got {len(args)}")
    env: dict[int, torch.Tensor] = {}
    tables = _table_inputs(program)
    for var, a in zip(program.inputs, args):
        env[id(var)] = a if id(var) in tables else _upcast(a, compute_dtype)
    for e in program.eqns:
        assert e.prim.impl is not None, f"{e.prim.name} has no impl rule"
        ins = [None if v is None else env[id(v)] for v in e.inputs]
        out = e.prim.impl(*ins, **e.params)
        outs = out if e.prim.multiple_results else (out,)
        for v, o in zip(e.outputs, outs):
            env[id(v)] = o
    return [env[id(v)].to(v.aval.dtype) for v in program.outputs]


def _table_roles(eqn: Eqn) -> list[bool]:
    """For each operand of ``eqn``: whether its facts read it as a gathered :attr:`Role.TABLE`."""
    facts = eqn.facts()
    if not isinstance(facts, HeadOp):
        return [False] * len(eqn.inputs)
    return [role is Role.TABLE for role in facts.operands]


def _table_inputs(program: Program) -> set[int]:
    """ids of the program inputs that are read only as tables (never upcast whole)."""
    tables: set[int] = set()
    others: set[int] = set()
    for e in program.eqns:
        for v, is_table in zip(e.inputs, _table_roles(e)):
            if v is not None:
                (tables if is_table else others).add(id(v))
    return tables - others


def _upcast(x: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    if x.is_floating_point() and torch.finfo(x.dtype).bits < torch.finfo(compute_dtype).bits:
        return x.to(compute_dtype)
    return x
