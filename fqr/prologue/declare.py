"""A member of the prologue family is declared once; everything else is derived from it.

A :class:`Declaration` is one public fused op: its composition of :mod:`fqr.ops` (the function
that gets traced), its parameters with their kinds, its float64 reference
(:mod:`fqr.reference`) and its outputs. From that one record fqr derives, as JAX derives
``jit``/``bind``/abstract evaluation from one primitive and vLLM's ``direct_register_custom_op``
a torch op from one function:

=========================  ======================================================================
the public function        :attr:`Declaration.function`: the signature (generated source
                           with the parameters, defaults included: Python binds them), the
                           docstring (the declaration's, with the parameter list and the
                           backends appended)
validation                 every parameter's kind checks its argument (type, dtype, shape,
                           strides, device), errors naming the parameter, then the
                           declaration's relational checks, before any kernel runs
the fast path              a call whose argument metadata passed the checks once
                           (:class:`CheckedCall`, kept per static arguments and guarded by
                           torch's C++ ``TensorGuards``: dtype, device, sizes and strides but
                           the token dimension) skips the checks, the trace and the backend
                           lookup; the declaration's fast entry and each kept call's entry
                           are generated straight-line source, as the kernel backends' host
                           function is (:mod:`fqr.lowering.host`); it lives in
                           :mod:`fqr.prologue.checked`, with the version bump of the tensors a
                           run writes in place
``torch.ops.fqr.<name>``   the schema from the parameters (tensors first, then the static
                           arguments; ``out=``/``inplace``/``backend`` stay public-only), the
                           implementation the public function with ``backend="auto"``, the fake
                           the traced program's output avals (:func:`fqr.core.trace` is the
                           abstract evaluation); donated caches are ``Tensor(a!)``
golden cases, bench cells  through a :class:`Variant` (:mod:`fqr.prologue.variant`): a preset
lowering, Ascend sweep     bound to the declaration
=========================  ======================================================================

A declaration file (``fqr/prologue/<op>.py``) holds the composition, the :func:`declare` call and
the variants; adding a member of the family is a new file there (ARCHITECTURE.md, "How to add a
variant").
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any

import torch

from ..backends import AUTO_BACKENDS, BACKENDS, resolve_backend
from ..core import Aval, Program, trace
from ..ops.cache import overlaps_itself
from ..validate import (
    POSITION_DTYPES,
    byte_span,
    check_activation,
    check_choice,
    check_cos_sin_cache,
    check_finite_scalar,
    check_positions,
    check_positions_in_range,
    check_positive_int,
    check_row_stride,
    check_slots_in_range,
    check_tensor,
    check_vector,
    overlaps,
)
from .checked import _KEPT, CheckedCall, _compiled, _fast_entry, _Miss, _tuple_source

MISSING = inspect.Parameter.empty
# The program's symbol of a slot mapping's length N <= T (:class:`Slots` ``shorter``).
SLOTS = "N"

# ------------------------------------------------------------------------------ parameters


@dataclass(frozen=True)
class Param:
    """One parameter of a public op: its name, default (``MISSING``: required), whether it is
    keyword-only, the annotation the signature shows, and one line of documentation."""

    name: str
    default: Any = MISSING
    keyword: bool = True
    annotation: str = ""
    doc: str = ""

    @property
    def required(self) -> bool:
        return self.default is MISSING


@dataclass(frozen=True)
class Static(Param):
    """A scalar argument: checked by ``check(name, value)``, given to the composition as
    ``normalize(value)`` when ``program`` (a static of the traced program, part of its
    signature), to the torch op when ``torch_op`` (schema type ``schema``)."""

    check: Callable[[str, Any], None] = lambda name, value: None
    normalize: Callable[[Any], Any] = lambda value: value
    program: bool = True
    torch_op: bool = True
    schema: str = ""
    key: Callable[[Any], Any] | None = None  # a hashable stand-in in the call's key (a list)


@dataclass(frozen=True)
class Tensor(Param):
    """A tensor argument (``optional``: may be None). ``kind`` says what it is, how it is
    checked and how it enters the program (:class:`TensorKind`); ``donated``: the op updates it
    in place (a paged cache), its updated value is an output of the program that is not
    returned."""

    kind: TensorKind = field(default=None)  # type: ignore[assignment]
    optional: bool = False
    donated: bool = False
    torch_op: bool = True

    def __post_init__(self):
        if self.kind is None:
            raise TypeError(f"{self.name}: a Tensor parameter needs a kind")


@dataclass(frozen=True)
class Form(Param):
    """A public-only argument (``out=``, ``inplace``, ``backend``): not a program input, not in
    the torch op; the declaration's hooks read it."""

    check: Callable[[str, Any], None] = lambda name, value: None
    keyed: bool = True  # False: only whether it is given is part of the call's key (out=)


# ------------------------------------------------------------------------- tensor kinds


class TensorKind:
    """How one tensor argument is checked and passed. Subclasses set :attr:`leading` (the
    symbol of its first dim in the program: ``"T"`` tokens, ``"P"`` table rows, ``"B"`` cache
    blocks, ``None`` a per-call tensor) and :attr:`token_dim`, and override the hooks."""

    leading: str | None = None
    token_dim: int | None = None  # the dim of T, for a token-indexed argument
    program_inputs: int = 1  # how many program inputs the argument gives
    used: Callable[[Call], bool] | None = None  # whether the program reads it (None: always)

    def check(self, name: str, x, call: Call) -> None:
        """Raise a ValueError/TypeError naming ``name`` when ``x`` is not acceptable."""

    def operands(self, x) -> tuple:
        """The program inputs this argument gives (the tensor itself by default)."""
        return (x,)

    def avals(self, x) -> tuple:
        leading = (self.leading,) if self.leading else ()
        return tuple(Aval.of(o, *leading) for o in self.operands(x))

    def viewed_as(self, x, call: Call) -> torch.dtype | None:
        """The dtype the argument enters the program as, a view of the same memory (vLLM's
        ``uint8`` FP8 cache as the float8 dtype its ``kv_cache_dtype`` names), decided by the
        call's static arguments and the argument's dtype (so the same for every call of one
        key); None: as given."""
        return None

    def per_call(self, name: str, x, call: Call) -> None:
        """Checks of values (not metadata) that run on every call (a CPU tensor's range)."""

    def guard_tensors(self, x) -> tuple:
        """The tensors of the argument the fast path's guard compares (itself by default)."""
        return (x,)

    def key(self, x):
        """What of a non-tensor argument joins the call's key (None: nothing)."""
        return None

    def guard_entries(self, x) -> list[tuple]:
        """``(tensor, sizes, strides, token_dim)`` of each of :meth:`guard_tensors`: sizes and
        strides None where they may change from call to call without changing the checks (the
        token dim)."""
        sizes: list = list(x.shape)
        if self.token_dim is not None:
            sizes[self.token_dim] = None
        return [(x, sizes, list(x.stride()), self.token_dim)]

    # What the fast path (fqr.prologue.checked) asks of a kind: which hooks it overrides
    def reads_values(self) -> bool:
        """Whether :meth:`per_call` checks anything (values read every call)."""
        return type(self).per_call is not TensorKind.per_call

    def guards_itself(self) -> bool:
        """Whether the guard compares the argument itself (:meth:`guard_tensors` not
        overridden)."""
        return type(self).guard_tensors is TensorKind.guard_tensors

    def passes_through(self) -> bool:
        """Whether the argument is its own one program input (:meth:`operands` not
        overridden)."""
        return type(self).operands is TensorKind.operands


def _token_count(call: Call) -> int:
    return call._tokens


@dataclass(frozen=True)
class Rows(TensorKind):
    """``[T, width]`` activation rows (bf16/fp16/fp32), unit stride along a row, rows not
    overlapping. ``width(call)``: ``(expected width, how it is made)`` for the message, or
    None; ``multiple_of``: a static name the width must be a multiple of; ``like``: another
    rows argument whose dtype and token count this one shares."""

    what: str = "[T, width]"
    width: Callable[[Call], tuple[int, str] | None] | None = None
    multiple_of: str | None = None
    like: str | None = None
    leading = "T"
    token_dim = 0

    def check(self, name, x, call):
        check_activation(name, x, self.what)
        if self.like is not None:
            other = getattr(call, self.like)
            if x.dtype != other.dtype:
                raise TypeError(
                    f"{name} must have {self.like}'s dtype {other.dtype}, got {x.dtype}"
                )
            if x.shape[0] != other.shape[0]:
                raise ValueError(
                    f"{name} has {x.shape[0]} tokens but {self.like} has {other.shape[0]}"
                )
        width = x.shape[1]
        if self.width is not None:
            expected = self.width(call)
            if expected is not None:
                width, layout = expected
                if x.shape[1] != width:
                    raise ValueError(f"{name} width {x.shape[1]} != {layout}")
        if self.multiple_of is not None:
            unit = getattr(call, self.multiple_of)
            if x.shape[1] % unit:
                raise ValueError(
                    f"{name} width {x.shape[1]} is not a multiple of {self.multiple_of} {unit}"
                )
        check_row_stride(name, x, width)


@dataclass(frozen=True)
class Positions(TensorKind):
    """``positions [T]`` int32/int64 at any stride (``positions[:, 0]`` of a ``[T, 2]``
    buffer, as MiniMax's callers pass them: the kernel reads them through their stride); with
    ``planes`` also ``[planes, T]`` (mRoPE: one row per plane, any strides), given to the
    program as ``planes`` inputs (a ``[T]`` tensor on every plane). ``table``: the table
    argument whose rows the positions
    index (range-checked on the host for CPU tensors; ``limit`` instead when there is no
    table). ``used(call)``: whether the program reads them (else checked and dropped)."""

    rows_of: str = "qkv"
    planes: int = 0
    table: str | None = "cos_sin_cache"
    limit: Callable[[Call], int | None] | None = None
    used: Callable[[Call], bool] | None = None
    leading = "T"
    token_dim = 0

    @property
    def program_inputs(self) -> int:  # type: ignore[override]
        return max(self.planes, 1)

    def check(self, name, x, call):
        tokens = _token_count(call)
        if self.planes and isinstance(x, torch.Tensor) and x.dim() == 2:
            if x.dtype not in POSITION_DTYPES:
                raise TypeError(f"{name} must be int32 or int64, got {x.dtype}")
            if x.shape != (self.planes, tokens):
                raise ValueError(
                    f"{name} must be [{self.planes}, T] or [T] with T = {tokens} "
                    f"({self.rows_of} rows), got shape {list(x.shape)}"
                )
            return
        if self.planes and isinstance(x, torch.Tensor) and x.dim() != 1:
            raise ValueError(
                f"{name} must be [{self.planes}, T] or [T] with T = {tokens} "
                f"({self.rows_of} rows), got shape {list(x.shape)}"
            )
        check_positions(x, tokens, rows_of=self.rows_of)

    def operands(self, x):
        if not self.planes:
            return (x,)
        return tuple(x.unbind(0)) if x.dim() == 2 else (x,) * self.planes

    def avals(self, x):
        plane = Aval.of(x[0] if self.planes and x.dim() == 2 else x, "T")
        return (plane,) * max(self.planes, 1)

    def guard_entries(self, x):
        if x.dim() == 2:  # [planes, T]: the plane stride is T's business, not the checks'
            return [(x, [x.shape[0], None], [None, x.stride(1)], 1)]
        return [(x, [None], [x.stride(0)], 0)]

    def range_limit(self, call) -> int | None:
        if self.table is not None and getattr(call, self.table) is not None:
            return getattr(call, self.table).shape[0]
        return self.limit(call) if self.limit is not None else None

    def per_call(self, name, x, call):
        limit = self.range_limit(call)
        if limit is not None and x.device.type == "cpu":
            check_positions_in_range(x, limit)


@dataclass(frozen=True)
class Table(TensorKind):
    """``cos_sin_cache [max_position, rotary_dim]`` (vLLM layout), floating, unit stride along
    a row; ``rotary_dim`` even and at most ``head_dim(call)`` (``bound``: its name in the
    message)."""

    head_dim: Callable[[Call], int] = lambda call: call.head_dim
    bound: str = "head_dim"
    leading = "P"

    def check(self, name, x, call):
        check_cos_sin_cache(x, self.head_dim(call), self.bound)


@dataclass(frozen=True)
class Vector(TensorKind):
    """A per-call ``[length]`` floating vector, contiguous (a norm weight or bias);
    ``length(call)`` and ``what`` (the message's name for that length)."""

    length: Callable[[Call], int] = lambda call: call.head_dim
    what: str | Callable[[Call], str] = "head_dim"

    def check(self, name, x, call):
        what = self.what if isinstance(self.what, str) else self.what(call)
        check_vector(name, x, self.length(call), what)


@dataclass(frozen=True)
class Cache(TensorKind):
    """A paged cache, updated in place: ``shape(call)`` the sizes after the blocks (with the
    message's description), dtypes ``dtypes(call)``, contiguous last dim; ``slots`` the
    argument holding the slot of each token's entry (what a call stores: one entry per slot
    ``>= 0``)."""

    shape: Callable[[Call], tuple[tuple[int, ...], str]] = None  # type: ignore[assignment]
    dtypes: Callable[[Call], tuple[torch.dtype, ...]] = None  # type: ignore[assignment]
    dtype_text: Callable[[Call], str] = lambda call: ""
    last: str = "head_dim"  # what the last dim is called in the message
    slots: str = "slot_mapping"
    leading = "B"

    def check(self, name, x, call):
        check_tensor(name, x)
        dims, text = self.shape(call)
        if x.dim() != len(dims) + 1 or tuple(x.shape[1:]) != tuple(
            d if d is not None else x.shape[i + 1] for i, d in enumerate(dims)
        ):
            raise ValueError(f"{name} must be {text}, got shape {list(x.shape)}")
        if x.shape[0] < 1 or any(n < 1 for n in x.shape[1:]):
            raise ValueError(f"{name} has no rows (shape {list(x.shape)})")
        if x.dtype not in self.dtypes(call):
            raise TypeError(f"{name} must be {self.dtype_text(call)}, got {_dtype_text(x.dtype)}")
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim ({self.last})")
        if overlaps_itself(x):  # expanded (stride 0) or as_strided: written in place
            raise ValueError(
                f"{name} overlaps itself: strides {list(x.stride())} of shape {list(x.shape)} "
                f"give two of its elements one address (an expanded or as_strided view); the "
                f"cache is written in place: pass one that holds each element once"
            )

    def avals(self, x):
        return (Aval(("B", *x.shape[1:]), x.dtype),)


@dataclass(frozen=True)
class Slots(TensorKind):
    """``slot_mapping [T]`` int32/int64 at any stride (negative: padding); the slots of the
    ``cache`` argument are range-checked on the host for CPU tensors. ``shorter``: ``[N]``
    with ``N <= T`` is accepted too (vLLM pads T for CUDA graphs and passes the
    ``num_actual_tokens`` slots): tokens ``t >= N`` store nothing. Its length is then its own
    symbol ``N`` in the program (a runtime argument of the kernel, as T is), the fast path
    guards it as free (not as T) and :meth:`per_call` checks ``N <= T`` on every call."""

    cache: str = "key_cache"
    rows_of: str = "qkv"
    shorter: bool = False
    symbol: str = SLOTS  # N's name in the program (an op with two mappings names each its own)

    @property
    def leading(self) -> str:  # type: ignore[override]
        return self.symbol if self.shorter else "T"

    token_dim = 0  # slot t is token t's (the first N tokens')

    def check(self, name, x, call):
        check_tensor(name, x)
        if x.dtype not in POSITION_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {x.dtype}")
        self._check_length(name, x, call)

    def _check_length(self, name, x, call):
        tokens = _token_count(call)
        if self.shorter:
            if x.dim() != 1 or x.shape[0] > tokens:
                raise ValueError(
                    f"{name} must be [N] with N <= T = {tokens} ({self.rows_of} rows; tokens "
                    f"t >= N are not stored), got shape {list(x.shape)}"
                )
        elif x.dim() != 1 or x.shape[0] != tokens:
            raise ValueError(
                f"{name} must be [T] with T = {tokens} ({self.rows_of} rows), "
                f"got shape {list(x.shape)}"
            )

    def guard_entries(self, x):
        if self.shorter:  # N is free in the guard; per_call checks N <= T
            return [(x, [None], [x.stride(0)], None)]
        return super().guard_entries(x)

    def per_call(self, name, x, call):
        if self.shorter:
            self._check_length(name, x, call)
        check_slots_in_range(x, getattr(call, self.cache), name)


@dataclass(frozen=True)
class Scale(TensorKind):
    """A per-tensor FP8 scale: float32 ``[1]``, or 0-dim (``torch.tensor(0.1)``, as vLLM's
    tests and layers hold it; the program reads it as the ``[1]`` view of the same memory),
    finite and > 0 (checked on the host for a CPU scale, as positions and slots are).
    ``used(call)``: whether the call's program reads it (else its form is checked and its
    value is neither read nor checked: a scale the engine passes where its own kernel
    ignores it); ``what``: what it scales, in every message about it."""

    used: Callable[[Call], bool] | None = None
    what: str = ""

    def _what(self) -> str:
        return f" ({self.what})" if self.what else ""

    def check(self, name, x, call):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}{self._what()}")
        if x.shape not in ((1,), ()) or x.dtype != torch.float32:
            raise ValueError(
                f"{name} must be a float32 tensor of shape [1] (or 0-dim), got {x.dtype} "
                f"{list(x.shape)}{self._what()}"
            )

    def operands(self, x):
        return (x if x.dim() else x.reshape(1),)

    def per_call(self, name, x, call):
        if x.device.type == "cpu":
            value = float(x.reshape(-1)[0])
            if not (0 < value < float("inf")):
                raise ValueError(f"{name} must be finite and > 0, got {value}{self._what()}")


def _dtype_text(dtype: torch.dtype) -> str:
    from ..core import DTYPE_NAMES

    return DTYPE_NAMES.get(dtype, str(dtype))


# ------------------------------------------------------------------ common static kinds


def positive_int(name: str, value) -> None:
    check_positive_int(name, value)


def optional_positive_int(name: str, value) -> None:
    if value is not None:
        check_positive_int(name, value)


def real(name: str, value) -> None:
    check_finite_scalar(name, value)


def positive_real(name: str, value) -> None:
    check_finite_scalar(name, value, positive=True)


def flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def choice(*options: str) -> Callable[[str, Any], None]:
    def check(name: str, value) -> None:
        check_choice(name, value, options)

    return check


NUMERICS = ("fused", "unfused", "unfused-hf")


def _check_backend(name: str, value) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__}")


def numerics(default: str = "fused", modes: tuple[str, ...] = NUMERICS) -> Static:
    return Static(
        "numerics",
        default,
        annotation="str",
        check=choice(*modes),
        schema="str",
        doc=f"numerics contract: {', '.join(modes)} (fqr.numerics)",
    )


BACKEND = Form(
    "backend",
    "auto",
    annotation="str",
    check=_check_backend,
    doc="where it runs: auto ("
    + ", ".join(f"{BACKENDS[b].name} on {d}" for d, b in AUTO_BACKENDS.items())
    + ", reference elsewhere) or one of "
    + ", ".join(BACKENDS),
)


# ------------------------------------------------------------------------------ outputs


@dataclass(frozen=True)
class Output:
    """One output of the program: ``copy`` (a bit-for-bit copy of input values, compared
    bitwise), ``head_dim(statics)`` the head width it is compared head by head with (default
    the ``head_dim`` static), ``present(call)`` whether the call has it (default always),
    ``into``: the output is stored into views of that (donated) argument, in place, and the
    argument is what is compared (``name`` is then the argument's)."""

    name: str
    copy: bool = False
    head_dim: Callable[[dict], int] | None = None
    present: Callable[[Call], bool] | None = None
    into: str | None = None  # written into this (donated) argument in place, not returned


# ----------------------------------------------------------------------------- the record


@dataclass(frozen=True)
class PerCallChecks:
    """What :meth:`Declaration.per_call` runs for the calls of one key: the arguments whose
    kind checks values every call (``TensorKind.per_call``), the declaration's value checks
    that apply, and the arguments the program reads (what a written tensor must not
    overlap)."""

    kinds: tuple[Tensor, ...]
    value_checks: tuple[Callable[[Call], None], ...]
    read: tuple[Tensor, ...]


class Call:
    """The bound arguments of one call, by name (``call.qkv``), without copying them."""

    __slots__ = ("_values", "_index", "_tokens")

    def __init__(self, index: dict[str, int], values: list):
        self._index, self._values = index, values
        self._tokens = 0

    def __getattr__(self, name: str):
        try:
            return self._values[self._index[name]]
        except KeyError:
            raise AttributeError(name) from None


def _call_class(name: str, params: Sequence[Param]) -> type[Call]:
    """The :class:`Call` of one declaration: a slot per parameter, filled when bound (generated
    source: one assignment of every argument), so that the checks' and hooks' ``call.qkv`` is
    an attribute read."""
    names = [p.name for p in params]
    source = (
        "def __init__(self, index, values):\n"
        "    self._index, self._values = index, values\n"
        "    self._tokens = 0\n"
        f"    {_tuple_source([f'self.{n}' for n in names])} = values\n"
    )
    init = _compiled(source, "__init__", {}, f"<fqr {name} call>")
    return type(f"Call[{name}]", (Call,), {"__slots__": tuple(names), "__init__": init})


class Declaration:
    """One public fused op of the prologue family (module docstring).

    ``composition(*program inputs, **statics)``: the function traced into the op's program
    (operands in parameter order, an absent optional tensor as None; statics by keyword);
    ``params``: the public signature, in order; ``outputs``: the program's outputs;
    ``reference``: the float64 formulation (:mod:`fqr.reference`), called with the same
    argument names (a parameter it does not take is left out); ``static_checks`` and
    ``checks``: relational checks over the bound arguments (a :class:`Call`), after the
    scalar arguments' own and after every tensor's own; ``value_checks``: ``(when, check)``
    pairs, checks of addresses or grad mode that run on every call they apply to (``when``:
    read from the call's key; distinct caches, ``out=`` buffers);
    ``returns(call, outputs)``: what the public function returns from the outputs that are not
    donated updates (default: those, a single one bare); ``out(call)``: caller buffers the
    outputs are written into (``out=``, ``inplace``), or None; ``writes(call)``: the caller's
    memory the call writes besides the donated arguments, as ``(name, tensor)`` pairs (no
    written tensor may share a byte with another argument: :meth:`check_writes`);
    ``program_statics(call)``:
    static arguments of the composition that no parameter gives directly; ``doc``: the
    public docstring.
    """

    def __init__(
        self,
        name: str,
        composition: Callable,
        params: Sequence[Param],
        outputs: Sequence[Output],
        *,
        reference: Callable,
        doc: str,
        checks: Sequence[Callable[[Call], None]] = (),
        static_checks: Sequence[Callable[[Call], None]] = (),
        value_checks: Sequence[tuple[Callable[[Call], bool], Callable[[Call], None]]] = (),
        returns: Callable[[Call, tuple], Any] | None = None,
        out: Callable[[Call], list | None] | None = None,
        writes: Callable[[Call], list[tuple[str, torch.Tensor]]] | None = None,
        program_statics: Callable[[Call], dict] | None = None,
        torch_op: bool = True,
    ):
        self.name = name
        self.composition = composition
        self.params = tuple(params)
        self.outputs = tuple(outputs)
        self.reference = reference
        self.checks = tuple(checks)
        self.static_checks = tuple(static_checks)
        self.value_checks = tuple(value_checks)
        self._returns = returns
        self._out = out
        self._writes = writes
        self._program_statics = program_statics
        self.doc = inspect.cleandoc(doc)
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"{name}: parameter names repeat: {names}")
        self.index = {p.name: i for i, p in enumerate(self.params)}
        self.tensor_params = [p for p in self.params if isinstance(p, Tensor)]
        self.static_params = [p for p in self.params if isinstance(p, Static)]
        # the key of a call: every scalar argument (forms included) with its type, and which
        # tensors (and unkeyed forms such as out=) are given
        self._keyed_at = [
            i
            for i, p in enumerate(self.params)
            if isinstance(p, Static) or (isinstance(p, Form) and p.keyed)
        ]
        self._key_of = tuple(
            (j, p.key)
            for j, p in enumerate(self.params[i] for i in self._keyed_at)
            if isinstance(p, Static) and p.key is not None
        )
        self._presence_at = [
            i
            for i, p in enumerate(self.params)
            if isinstance(p, Tensor) or (isinstance(p, Form) and not p.keyed)
        ]
        # tensor arguments whose guard tensors are not the argument itself (fqr.NormStats)
        self._complex = tuple(
            (self.index[p.name], p.kind) for p in self.tensor_params if not p.kind.guards_itself()
        )
        self._positional = [p.name for p in self.params if not p.keyword]
        self._defaults = [p.default for p in self.params]
        self._anchor = next(
            p.name for p in self.tensor_params if p.kind.token_dim is not None
        )  # the first token-indexed argument: T is its first size
        self._calls: dict[tuple, list[CheckedCall]] = {}
        self._lock = threading.Lock()
        self._call_class = _call_class(name, self.params)
        self._fast = _fast_entry(self)
        self.function = self._make_function()
        self.torch_op_name = name if torch_op else None
        if torch_op:
            _register_torch_op(self)

    def __repr__(self) -> str:
        return f"Declaration({self.name})"

    # -------------------------------------------------------------- the signature
    def signature(self) -> inspect.Signature:
        params = []
        for p in self.params:
            kind = (
                inspect.Parameter.KEYWORD_ONLY
                if p.keyword
                else inspect.Parameter.POSITIONAL_OR_KEYWORD
            )
            params.append(
                inspect.Parameter(
                    p.name, kind, default=p.default, annotation=p.annotation or MISSING
                )
            )
        return inspect.Signature(params)

    def _make_function(self) -> Callable:
        """The public function: generated source with the op's own signature (Python binds the
        arguments, defaults included, and raises its own ``TypeError`` for a bad call), whose
        body hands the argument list, in parameter order, to :meth:`call`."""
        names = [p.name for p in self.params]
        namespace: dict[str, Any] = {"_DECL": self}
        parts: list[str] = []
        for i, p in enumerate(self.params):
            if p.keyword and "*" not in parts:
                parts.append("*")
            if p.required:
                parts.append(p.name)
            else:
                namespace[f"_D{i}"] = p.default
                parts.append(f"{p.name}=_D{i}")
        source = (
            f"def {self.name}({', '.join(parts)}):\n    return _DECL.call([{', '.join(names)}])\n"
        )
        op = _compiled(source, self.name, namespace, f"<fqr {self.name}>")
        op.__qualname__ = self.name
        op.__module__ = "fqr"
        op.__doc__ = self.docstring()
        op.__signature__ = self.signature()  # type: ignore[attr-defined]
        op.declaration = self  # type: ignore[attr-defined]
        op.source = source  # type: ignore[attr-defined]
        return op

    def docstring(self) -> str:
        lines = [self.doc, "", "Parameters:", ""]
        for p in self.params:
            default = "" if p.required else f" = {p.default!r}"
            lines.append(f"* ``{p.name}``{default}: {p.doc}")
        return "\n".join(lines)

    def bind(self, args: tuple, kwargs: dict) -> list:
        """The arguments in parameter order, defaults filled in (``TypeError`` as Python
        raises it for a bad call)."""
        n = len(args)
        if n > len(self._positional):
            raise TypeError(
                f"{self.name}() takes {len(self._positional)} positional arguments but {n} "
                f"were given"
            )
        values = [*args, *self._defaults[n:]]
        index = self.index
        for key, value in kwargs.items():
            i = index.get(key)
            if i is None:
                raise TypeError(f"{self.name}() got an unexpected keyword argument {key!r}")
            if i < n:
                raise TypeError(f"{self.name}() got multiple values for argument {key!r}")
            values[i] = value
        if id(MISSING) in map(id, values):  # by identity: `in` would compare tensors by value
            missing = [p.name for p, v in zip(self.params, values) if v is MISSING]
            raise TypeError(f"{self.name}() missing required argument: {missing[0]!r}")
        return values

    def bound(self, values: list) -> Call:
        return self._call_class(self.index, values)

    # -------------------------------------------------------------- validation
    def validate(self, call: Call, *, values_too: bool = True) -> None:
        """Every check of the op, before anything runs: the scalar arguments, the relations
        among them, each tensor's kind, the relations among the tensors, every tensor on the
        first token-indexed one's device, then (``values_too``) the checks of values."""
        for p in self.params:
            if isinstance(p, (Static, Form)):
                p.check(p.name, getattr(call, p.name))
        for check in self.static_checks:
            check(call)
        anchor = getattr(call, self._anchor)
        check_tensor(self._anchor, anchor)
        call._tokens = anchor.shape[0] if anchor.dim() else 0
        for p in self.tensor_params:
            x = getattr(call, p.name)
            if x is None:
                if not p.optional:
                    raise ValueError(f"{p.name} is required")
                continue
            p.kind.check(p.name, x, call)
        for check in self.checks:
            check(call)
        device = anchor.device
        for p in self.tensor_params:
            x = getattr(call, p.name)
            for t in () if x is None else p.kind.guard_tensors(x):
                if t.device != device:
                    raise ValueError(f"{p.name} is on {t.device} but {self._anchor} is on {device}")
        if values_too:
            self.per_call(call)

    def per_call(self, call: Call, checks: PerCallChecks | None = None) -> None:
        """The checks that read values (ranges of CPU positions and slots) or addresses
        (distinct caches, ``out=`` buffers): the fast path runs them on every call, with the
        ``checks`` of its key (:meth:`per_call_checks`, else found for ``call``)."""
        if checks is None:
            checks = self.per_call_checks(call)
        for p in checks.kinds:
            p.kind.per_call(p.name, getattr(call, p.name), call)
        for check in checks.value_checks:
            check(call)
        self.check_writes(call, checks.read)

    def per_call_checks(self, call: Call) -> PerCallChecks:
        """Which of :meth:`per_call`'s checks apply to ``call``: decided by its static
        arguments and which tensors it is given, so the same for every call of its key."""
        read = tuple(p for p in self.tensor_params if self.used(p, call))
        return PerCallChecks(
            kinds=tuple(p for p in read if p.kind.reads_values()),
            value_checks=tuple(check for when, check in self.value_checks if when(call)),
            read=read,
        )

    def written(self, call: Call) -> list[tuple[str, torch.Tensor]]:
        """The caller's tensors the call writes: donated arguments, then ``writes(call)``."""
        written = [
            (p.name, getattr(call, p.name))
            for p in self.tensor_params
            if p.donated and getattr(call, p.name) is not None
        ]
        return written if self._writes is None else written + self._writes(call)

    def check_writes(self, call: Call, read: Sequence[Tensor] | None = None) -> None:
        """No tensor the call writes shares a byte of memory with another argument or another
        written tensor (by address: views of one buffer, two storages over one allocation);
        otherwise a write would change what the call still reads. Every call that writes.
        ``read``: the arguments the program reads (default: found for ``call``)."""
        written = self.written(call)
        if not written:
            return
        if read is None:
            read = [p for p in self.tensor_params if self.used(p, call)]
        others = [(p.name, t) for p in read for t in p.kind.guard_tensors(getattr(call, p.name))]
        # each tensor's first and last byte once: most pairs are told apart by their spans
        spans = {id(t): byte_span(t) for _, t in others + written if t.numel()}
        for i, (name, t) in enumerate(written):
            if id(t) not in spans:
                continue
            first, last = spans[id(t)]
            for other, u in others + written[:i]:
                span = spans.get(id(u))
                if span is None or other == name or span[0] > last or first > span[1]:
                    continue
                if overlaps(t, u):
                    raise ValueError(
                        f"{name} overlaps {other} in memory (the call writes {name}): "
                        "give them separate memory"
                    )

    # -------------------------------------------------------------- the program
    def statics(self, call: Call) -> dict:
        """The composition's static arguments for a validated call."""
        statics = {
            p.name: p.normalize(getattr(call, p.name)) for p in self.static_params if p.program
        }
        if self._program_statics is not None:
            statics.update(self._program_statics(call))
        return statics

    def used(self, p: Tensor, call: Call) -> bool:
        """Whether the program reads argument ``p`` (given, and its kind's ``used(call)``)."""
        used = p.kind.used
        return getattr(call, p.name) is not None and (used is None or used(call))

    def as_given_to_program(self, p: Tensor, call: Call):
        """Argument ``p`` of ``call`` as the program takes it (its kind's
        :meth:`TensorKind.viewed_as` view, else itself)."""
        x = getattr(call, p.name)
        dtype = p.kind.viewed_as(x, call)
        return x if dtype is None else x.view(dtype)

    def avals(self, call: Call) -> tuple:
        avals: list = []
        for p in self.tensor_params:
            if self.used(p, call):
                avals.extend(p.kind.avals(self.as_given_to_program(p, call)))
            else:
                avals.extend((None,) * p.kind.program_inputs)
        return tuple(avals)

    def program(self, call: Call) -> Program:
        """The op's program for a validated call (traced once per signature). Sizes that are
        symbolic under ``torch.compile`` (the fake) are specialised, but the token count and
        the table's rows, which the program keeps symbolic."""
        avals = tuple(
            None if a is None else Aval(tuple(_static_size(n) for n in a.shape), a.dtype)
            for a in self.avals(call)
        )
        static = tuple(sorted(self.statics(call).items()))
        return _traced(self.composition, (avals, static))

    def program_for(self, *args, **kwargs) -> Program:
        """The program a call with these arguments runs (their metadata checked as the call
        checks it; the values, which do not shape the program, are not read)."""
        call = self.bound(self.bind(args, kwargs))
        self.validate(call, values_too=False)
        return self.program(call)

    def operands(self, call: Call) -> list:
        """The program's input tensors of a call, in order."""
        ops: list = []
        for p in self.tensor_params:
            if self.used(p, call):
                ops.extend(p.kind.operands(self.as_given_to_program(p, call)))
        return ops

    # -------------------------------------------------------------- the call
    def call(self, values: list) -> Any:
        """Run one call: the fast path when its static arguments and tensor metadata passed
        the checks before (:func:`_fast_entry`), else the full checks, the trace and the
        backend's binding, kept for the next calls."""
        found = self._fast(values)
        if type(found) is not _Miss:
            return found
        call = self.bound(values)
        self.validate(call)
        program = self.program(call)
        backend = getattr(call, "backend", "auto")
        resolved = resolve_backend(backend, getattr(call, self._anchor).device)
        checked = CheckedCall(self, program, resolved, call)
        if found.key is not None:
            checked.keep(self, found.key)
        return checked.enter(values, True)

    def returns(self, call: Call, outs: tuple) -> Any:
        """What the public function returns from the outputs that are not donated updates."""
        if self._returns is not None:
            return self._returns(call, outs)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def out(self, call: Call) -> list | None:
        return None if self._out is None else self._out(call)

    def reference_kwargs(self, values: dict) -> dict:
        """``values`` restricted to the parameters the reference takes."""
        accepted = inspect.signature(self.reference).parameters
        return {k: v for k, v in values.items() if k in accepted}


def _static_size(n):
    return n if isinstance(n, (int, str)) else int(n)


@lru_cache(maxsize=512)
def _traced(fn, signature: tuple) -> Program:
    avals, static = signature
    return trace(fn, *avals, **dict(static))


# ------------------------------------------------------------------------- checked calls
# (the kept calls, their generated entries and the fast entry: fqr.prologue.checked)


def forget_checked_calls() -> None:
    """Drop every kept call of every op (the next calls check, trace and bind again)."""
    for decl in DECLARATIONS.values():
        with decl._lock:
            decl._calls.clear()
    _KEPT[0] = 0


def checked_calls(decl: Declaration) -> list[CheckedCall]:
    """The calls of ``decl`` kept so far (most recent first for each key)."""
    return [c for kept in decl._calls.values() for c in kept]


# ----------------------------------------------------------------------------- registry

DECLARATIONS: dict[str, Declaration] = {}


def declare(
    name: str, composition: Callable, params: Sequence[Param], outputs, **kw
) -> Declaration:
    """Declare the public op ``name`` (:class:`Declaration`), register it (and its
    ``torch.ops.fqr`` op) and return it; ``declaration.function`` is the public function."""
    if name in DECLARATIONS:
        raise ValueError(f"op {name!r} is already declared")
    decl = Declaration(name, composition, params, outputs, **kw)
    DECLARATIONS[name] = decl
    return decl


# ------------------------------------------------------------------------ torch.ops.fqr

LIBRARY = torch.library.Library("fqr", "DEF")
# The devices the op runs on: the reference rules on CPU, the kernels on CUDA and on NPUs
# (torch_npu's tensors dispatch as PrivateUse1).
DISPATCH_KEYS = ("CPU", "CUDA", "PrivateUse1")


def _schema_type(p: Param) -> str:
    if isinstance(p, Tensor):
        if p.donated:  # an optional cache updated in place: a mutable optional tensor
            return "Tensor(a!)?" if p.optional else "Tensor(a!)"
        return "Tensor?" if p.optional else "Tensor"
    assert isinstance(p, Static)
    return p.schema


def torch_op_params(decl: Declaration) -> list[Param]:
    """The parameters of ``torch.ops.fqr.<name>``, in schema order: the tensors, then the
    static arguments the op takes (``Static.torch_op``)."""
    tensors = [p for p in decl.tensor_params if p.torch_op]
    statics = [p for p in decl.static_params if p.torch_op]
    return [*tensors, *statics]


def _schema(decl: Declaration) -> str:
    params = torch_op_params(decl)
    aliases = iter("abcdefghijklmnopqrstuvwxyz")
    # defaults for the trailing run of parameters that have one (a schema allows no other)
    first_default = len(params)
    while first_default and not params[first_default - 1].required:
        first_default -= 1
    parts = []
    for i, p in enumerate(params):
        kind = _schema_type(p)
        if kind.startswith("Tensor(a!)"):
            kind = kind.replace("(a!)", f"({next(aliases)}!)")
        default = ""
        if i >= first_default:
            default = "=" + ("None" if p.default is None else _schema_default(p.default))
        parts.append(f"{kind} {p.name}{default}")
    returns = _schema_returns(decl)
    return f"({', '.join(parts)}) -> {returns}"


def _schema_default(value) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


@cache
def _returned(decl: Declaration) -> tuple[Output, ...]:
    """The outputs the op returns: all but the donated arguments' updates."""
    donated = {p.name for p in decl.tensor_params if p.donated}
    return tuple(o for o in decl.outputs if o.name not in donated and o.into is None)


@cache
def _mutates(decl: Declaration) -> bool:
    """Whether the op updates an argument in place (a donated cache)."""
    return any(p.donated for p in decl.tensor_params)


def _schema_returns(decl: Declaration) -> str:
    """What the op returns: :func:`_returned`, ``Tensor?`` where an output is present only in
    some calls (None in the others); nothing when every output is written in place. An op
    that mutates an argument returns a ``[T, 0]`` tensor for an absent output instead (torch
    functionalizes a mutating custom op only when it returns plain tensors)."""
    returned = _returned(decl)
    if not returned:
        return "()"
    mutates = _mutates(decl)
    types = ["Tensor?" if o.present is not None and not mutates else "Tensor" for o in returned]
    return types[0] if len(types) == 1 else "(" + ", ".join(types) + ")"


def _as_schema_returns(decl: Declaration, call: Call, result) -> Any:
    """The public function's ``result`` as the schema returns it: one entry per returned
    output, None (or ``[T, 0]`` for a mutating op) where the call has none."""
    returned = _returned(decl)
    if not returned:
        return None
    if len(returned) == 1:
        return result
    if isinstance(result, torch.Tensor):  # the one output this call has, returned bare
        result = (result,)
    got = [r for r in result if r is not None]
    mutates = _mutates(decl)
    rows = getattr(call, decl._anchor)
    values = []
    for o in returned:
        if o.present is None or o.present(call):
            values.append(got.pop(0))
        else:
            values.append(rows.new_empty(rows.shape[0], 0) if mutates else None)
    return tuple(values)


def _torch_values(decl: Declaration) -> Callable[[tuple], list]:
    """How the arguments of ``torch.ops.fqr.<name>`` (schema order, all given: the dispatcher
    fills in the defaults) become the public function's, in parameter order; the parameters
    the op does not take keep their defaults (``backend``: "auto")."""
    at = [decl.index[p.name] for p in torch_op_params(decl)]
    left_out = [p.name for p in decl.params if p.required and decl.index[p.name] not in at]
    if left_out:
        raise TypeError(f"{decl.name}: torch.ops.fqr would leave out {left_out[0]!r}")
    defaults = decl._defaults

    def values(args: tuple) -> list:
        bound = list(defaults)
        for i, arg in zip(at, args):
            bound[i] = arg
        return bound

    return values


def _torch_impl(decl: Declaration) -> Callable:
    """The implementation of ``torch.ops.fqr.<name>``, generated as straight-line source: the
    arguments in schema order (:func:`torch_op_params`) go to :meth:`Declaration.call` in
    parameter order, those not passed and the parameters the op does not take as their
    defaults (as :func:`_torch_values` places them); the result as the schema returns it."""
    names = [p.name for p in torch_op_params(decl)]
    _torch_values(decl)  # refuses an op that would leave out a required parameter
    ns: dict[str, Any] = {"_DECL": decl, "_AS_SCHEMA_RETURNS": _as_schema_returns}
    ns.update((f"_D{i}", p.default) for i, p in enumerate(decl.params))
    values = [p.name if p.name in names else f"_D{i}" for i, p in enumerate(decl.params)]
    # the dispatcher may pass fewer arguments than the schema has: the rest are their defaults
    signature = [f"{name}=_D{decl.index[name]}" for name in names]
    returned = _returned(decl)
    lines = [
        f"def impl({', '.join(signature)}):",
        f"    values = [{', '.join(values)}]",
        "    result = _DECL.call(values)",
    ]
    if any(o.present is not None for o in returned):
        lines.append("    return _AS_SCHEMA_RETURNS(_DECL, _DECL.bound(values), result)")
    else:
        lines.append("    return result" if returned else "    return None")
    source = "\n".join(lines) + "\n"
    impl = _compiled(source, "impl", ns, f"<fqr torch.ops.fqr.{decl.name}>")
    impl.source = source  # type: ignore[attr-defined]
    return impl


def _torch_fake(decl: Declaration):
    values_of = _torch_values(decl)

    def fake(*args):
        values = values_of(args)
        call = decl.bound(values)
        decl.validate(call, values_too=False)
        program = decl.program(call)
        rows = getattr(call, decl._anchor)
        tokens = rows.shape[0]
        donated = program.aliases()
        outs = tuple(
            rows.new_empty(tokens, v.aval.shape[1], dtype=v.aval.dtype)
            for i, v in enumerate(program.outputs)
            if i not in donated
        )
        return _as_schema_returns(decl, call, decl.returns(call, outs))

    return fake


def _register_torch_op(decl: Declaration) -> None:
    """``torch.ops.fqr.<name>`` (vLLM's ``direct_register_custom_op``: ``Library.define`` with
    the derived schema, the public function for every dispatch key, the fake for tracing). The
    ops are inference ops, as vLLM's are: no autograd kernel is registered (the public functions
    carry the autograd policy, :class:`fqr.backends.DifferentiableRun`)."""
    LIBRARY.define(decl.name + _schema(decl))
    impl = _torch_impl(decl)
    for key in DISPATCH_KEYS:
        LIBRARY.impl(decl.name, impl, key)
    LIBRARY._register_fake(decl.name, _torch_fake(decl))
