"""The projected form of a prologue: the same op, starting from the hidden states.

``projected(DECL)`` derives from a declaration whose first parameter is the packed row ``qkv``
a second public op, ``<name>_proj``, whose first parameters are instead

* ``x [T, K]``: the hidden states (bf16/fp16/fp32),
* ``w_qkv [N, K]``: the packed ``[q | k | v]`` projection weight of this rank (vLLM's
  ``QKVParallelLinear.weight``), contiguous, ``x``'s dtype, ``N`` the width the prologue's
  ``qkv`` must have,
* ``qkv_bias [N] | None``: its bias (Qwen2's ``qkv_proj`` has one), contiguous, ``x``'s dtype,

and every other parameter as the prologue takes it. Its composition is the prologue's on
``fqr.ops.linear(x, w_qkv, qkv_bias)``, so it is one traced program: the packed row is the
fp32 accumulator, never rounded to the activation dtype (the pair ``torch.matmul`` + the
prologue rounds it once more). Its float64 reference is :func:`fqr.reference.project` then the
prologue's reference: ``x @ w_qkv.T (+ qkv_bias)`` in float64, then the prologue in float64.

The checks are the prologue's own: its static and tensor relations run on the projected call,
in which ``qkv`` stands for a ``meta`` tensor ``[T, N]`` of ``x``'s dtype (so a check reading
``call.qkv``'s shape or dtype reads the projection's), and the arguments the projected form does
not take (``inplace``, ``out=``, ``norm_stats``: they address a packed row a projected call
never materialises) stand at their defaults. Its ``numerics`` is ``"fused"`` only (the unfused
modes round qkv as the model's unfused chain does: that is ``torch.matmul`` then the prologue).

Where it runs: the reference backend (``fqr.core.eval_program``: fp32 product, then the
prologue, rounded once), and every kernel backend as ONE generated kernel, the GEMM with the
prologue as its epilogue (``fqr.lowering.product``): on the triton and interpret backends
a GEMV at T = 1, and at T = 2 where the weights are at most 16 MiB (each weight tile times x
as a column, K in split-K ranges: one 256-wide step each, or 512 in pipelined 64-wide steps
where that would make more than 128 programs), split-K on tensor cores at T <= 16 and
64-token tensor-core tiles after; on the Ascend backends (ascend, ascend-interpret,
ascend-on-cuda) the cube-unit lowering (``fqr.lowering.ascend.ascend_product_tiling``:
``tl.dot`` on the cube, the epilogue on the vector cores, one program per AI core walking
(token tile, head group) items with each K loop whole, tiles sized from the UB and the cube's
L0A/L0B/L0C/L1; a head too wide for them is refused with one line naming the numbers before
anything runs).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

import torch

from .. import ops, reference
from ..validate import check_tensor
from .declare import Call, Declaration, Param, Rows, Static, Tensor, TensorKind, numerics

# The prologue's arguments the projected form does not take (they address the packed row a
# projected call never materialises, or round it as the unfused chain does), at their defaults.
DROPPED = ("inplace", "out", "norm_stats")
# The projected form's numerics: fused only (the unfused modes round qkv as the model's chain
# does: that is torch.matmul then the prologue op).
NUMERICS = numerics("fused", ("fused",))
SUFFIX = "_proj"
OWN = ("x", "w_qkv", "qkv_bias")  # the projected form's own parameters


@dataclass(frozen=True)
class Weight(TensorKind):
    """``w_qkv [N, K]``: ``x``'s dtype, ``K`` x's width, contiguous; ``N`` the prologue's packed
    row width (``width(call)``: ``(N, how it is made)``)."""

    width: object = None  # Callable[[Call], tuple[int, str]]
    x: str = "x"

    def check(self, name, w, call):
        check_tensor(name, w)
        x = getattr(call, self.x)
        if w.dim() != 2:
            raise ValueError(f"{name} must be 2-D [N, K], got shape {list(w.shape)}")
        if w.dtype != x.dtype:
            raise TypeError(f"{name} must have {self.x}'s dtype {x.dtype}, got {w.dtype}")
        if w.shape[1] != x.shape[1]:
            raise ValueError(
                f"{name} has K = {w.shape[1]} columns but {self.x} has {x.shape[1]} features"
            )
        n, made = self.width(call)  # type: ignore[operator]
        if w.shape[0] != n:
            raise ValueError(f"{name} has {w.shape[0]} rows != {made}")
        if not w.is_contiguous():
            raise ValueError(f"{name} must be contiguous [N, K], got strides {list(w.stride())}")


@dataclass(frozen=True)
class Bias(TensorKind):
    """``qkv_bias [N]``: ``w_qkv``'s dtype, contiguous, one entry per row of ``w_qkv``."""

    weight: str = "w_qkv"

    def check(self, name, b, call):
        check_tensor(name, b)
        w = getattr(call, self.weight)
        if b.dim() != 1 or b.shape[0] != w.shape[0]:
            raise ValueError(
                f"{name} must be [N] with N = {w.shape[0]} ({self.weight}'s rows), got shape "
                f"{list(b.shape)}"
            )
        if b.dtype != w.dtype:
            raise TypeError(f"{name} must have {self.weight}'s dtype {w.dtype}, got {b.dtype}")
        if b.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")


def _row_width(decl: Declaration):
    """The width of the prologue's packed row for a call, and how it is made."""
    kind = decl.params[0].kind
    width = getattr(kind, "width", None)
    if width is None:
        raise ValueError(f"{decl.name}: its qkv's kind names no width; it has no projected form")
    return width


def _of_x(p: Param) -> Param:
    """A prologue parameter as the projected form takes it: its numerics fused only, a
    token-indexed argument counted against ``x``'s rows (its messages say so)."""
    if p.name == "numerics":
        return NUMERICS
    kind = getattr(p, "kind", None)
    if getattr(kind, "rows_of", None) == "qkv":
        return replace(p, kind=replace(kind, rows_of="x"))  # type: ignore[type-var]
    return p


def _projected_params(decl: Declaration) -> tuple[Param, ...]:
    """``x``, ``w_qkv``, the prologue's positional parameters after ``qkv``, ``qkv_bias`` (the
    first keyword-only one), then the prologue's other parameters."""
    rest = [_of_x(p) for p in decl.params[1:] if p.name not in DROPPED]
    positional = [p for p in rest if not p.keyword]
    keyword = [p for p in rest if p.keyword]
    return (
        Tensor(
            "x",
            keyword=False,
            annotation="torch.Tensor",
            kind=Rows(what="[T, hidden]"),
            doc="``[T, K]`` hidden states (bf16/fp16/fp32), unit stride along a row",
        ),
        Tensor(
            "w_qkv",
            keyword=False,
            annotation="torch.Tensor",
            kind=Weight(width=_row_width(decl)),
            doc="``[N, K]`` packed projection weight (vLLM's ``qkv_proj.weight``), x's dtype, "
            f"contiguous; N the width of {decl.name}'s qkv",
        ),
        *positional,
        Tensor(
            "qkv_bias",
            None,
            annotation="torch.Tensor | None",
            kind=Bias(),
            optional=True,
            doc="``[N]`` projection bias (Qwen2's ``qkv_proj.bias``), x's dtype, or None",
        ),
        *keyword,
    )


def _reference(decl: Declaration, params: tuple[Param, ...]):
    """``decl.reference`` on :func:`fqr.reference.project`'s float64 row, with the signature
    of the projected parameters it takes (so :meth:`Declaration.reference_kwargs` finds
    them)."""
    base = inspect.signature(decl.reference).parameters

    def projected_reference(x, w_qkv, qkv_bias=None, **kwargs):
        qkv = reference.project(x, w_qkv, qkv_bias)
        return decl.reference(qkv, **kwargs)

    names = [p.name for p in params if p.name in base and p.name not in OWN]
    projected_reference.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter("x", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter("w_qkv", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter("qkv_bias", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
            *(
                inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=base[n].default)
                for n in names
            ),
        ]
    )
    projected_reference.__doc__ = (
        f"float64 :func:`fqr.reference.project`, then ``{decl.reference.__name__}``."
    )
    return projected_reference


def _composition(decl: Declaration, params: tuple[Param, ...]):
    """The prologue's composition on ``linear(x, w_qkv, qkv_bias)``, the dropped tensor
    arguments absent. The program's operands come in the projected parameters' order; the
    prologue's in its own."""
    mine = [(p.name, p.kind.program_inputs) for p in params if isinstance(p, Tensor)]
    theirs = [(p.name, p.kind.program_inputs) for p in decl.tensor_params[1:]]

    def projected_composition(*operands, **statics):
        given: dict = {}
        at = 0
        for name, count in mine:
            given[name] = operands[at : at + count]
            at += count
        (x,), (w_qkv,), (qkv_bias,) = given["x"], given["w_qkv"], given["qkv_bias"]
        row = [ops.linear(x, w_qkv, qkv_bias)]
        for name, count in theirs:
            row.extend(given.get(name, (None,) * count))
        return decl.composition(*row, **statics)

    projected_composition.__name__ = f"{decl.composition.__name__}{SUFFIX}"
    return projected_composition


class _Standing:
    """The prologue's ``qkv`` in a projected call: a ``meta`` tensor ``[T, N]`` of x's dtype."""

    def __get__(self, call, owner=None):
        if call is None:
            return self
        return torch.empty(
            (call.x.shape[0], call.w_qkv.shape[0]), dtype=call.x.dtype, device="meta"
        )


class ProjectedDeclaration(Declaration):
    """A declaration derived by :func:`projected` (module docstring); ``base`` the prologue."""

    base: Declaration

    def __init__(self, decl: Declaration, example: str):
        self.base = decl
        params = _projected_params(decl)
        dropped = {p.name: p for p in decl.params if p.name in DROPPED}
        defaults = {name: p.default for name, p in dropped.items()}
        dropped_statics = {
            name: p.normalize(p.default)
            for name, p in dropped.items()
            if isinstance(p, Static) and p.program
        }

        def program_statics(call: Call) -> dict:
            statics = dict(dropped_statics)
            if decl._program_statics is not None:
                statics.update(decl._program_statics(call))
            return statics

        super().__init__(
            decl.name + SUFFIX,
            _composition(decl, params),
            params,
            tuple(replace(o, copy=False) for o in decl.outputs),
            reference=_reference(decl, params),
            doc=_doc(decl, example),
            static_checks=decl.static_checks,
            checks=decl.checks,
            value_checks=decl.value_checks,
            returns=decl._returns,
            program_statics=program_statics,
        )
        # the prologue's checks and hooks read call.qkv and the dropped arguments
        base_call = self._call_class
        namespace: dict = {"qkv": _Standing(), **defaults}
        self._call_class = type(base_call.__name__, (base_call,), namespace)


def _doc(decl: Declaration, example: str) -> str:
    return f"""
    ``{decl.name}`` from the hidden states: ``qkv = x @ w_qkv.T (+ qkv_bias)``, then
    ``{decl.name}`` of that row, in one program (:mod:`fqr.prologue.projected`): the packed
    row is the fp32 accumulator of the product, never rounded to the activation dtype, and
    the outputs are rounded once (the fused contract of the float64 composition
    ``fqr.reference.project`` then ``{decl.reference.__name__}``; see :mod:`fqr.numerics`
    for the bound of the fp32 accumulation). The other arguments are ``{decl.name}``'s; its
    ``inplace``, ``out=`` and ``norm_stats`` are not taken, and ``numerics`` is "fused" only.
    On every kernel backend it is one kernel: the GEMM with the prologue as its epilogue
    (triton, interpret: a GEMV in split-K ranges at T <= 2, split-K at T <= 16, 64-token
    tensor-core tiles after; the Ascend backends: the cube unit's tl.dot, each program's K
    loop whole).

    {example}
    """


def projected(decl: Declaration, example: str) -> ProjectedDeclaration:
    """Declare and register ``decl``'s projected form ``<name>_proj`` (module docstring);
    ``example``: its docstring's runnable ``Example::`` (``params.EXAMPLE_WITH_TABLE`` and
    ``>>>`` lines, indented as a declaration's ``doc``)."""
    from .declare import DECLARATIONS

    if not decl.params or decl.params[0].name != "qkv":
        raise ValueError(f"{decl.name}: its first parameter is not qkv; it has no projected form")
    name = decl.name + SUFFIX
    if name in DECLARATIONS:
        raise ValueError(f"op {name!r} is already declared")
    proj = ProjectedDeclaration(decl, example)
    DECLARATIONS[name] = proj
    return proj
