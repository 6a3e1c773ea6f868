"""The functional core: primitives, traced programs, and their interpretation.

A :class:`Primitive` is an object; the rules that give it meaning sit beside it, one per
interpretation, registered by the op module that defines it (``fqr/ops/*.py``), as in JAX:

* ``impl``     -- the reference implementation on torch tensors (any device, any float dtype;
                  it computes in the dtype it is given, so float64 in gives float64 math);
* ``abstract`` -- the shape/dtype rule: input :class:`Aval` s and params to output avals,
                  raising ``ValueError``/``TypeError`` that names the bad argument;
* ``lower``    -- the Triton lowering rule (``fqr/lowering``).

Calling an op on tensors runs ``impl``; calling it on :class:`Tracer` s (inside :func:`trace`)
records an :class:`Eqn` instead. A :class:`Program` prints like a jaxpr::

    { lambda a:bf16[T,6144] b:i64[T] c:f32[40960,128] d:bf16[128] e:bf16[128]. let
        f:bf16[T,4096] g:bf16[T,1024] h:bf16[T,1024] = split_qkv[d=128 hkv=8 hq=32] a
        ...
      in (k, l, h) }

The token dimension is the symbol ``"T"``: programs (and their kernels) are shape-polymorphic
in it, so a new batch size never retraces or recompiles.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

TOKENS = "T"

# The one dtype vocabulary of fqr: programs print with it, and the goldens, the CLI, the bench
# and the runtime name dtypes by it (``dtype_of("bf16")``, ``dtype_name(torch.float16)``).
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp64": torch.float64,
    "fp8e4m3": torch.float8_e4m3fn,
    "int32": torch.int32,
    "int64": torch.int64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ACTIVATION_DTYPE_NAMES = ("bf16", "fp16", "fp32")


def dtype_name(dtype: torch.dtype) -> str:
    """fqr's name of ``dtype`` (``torch.bfloat16`` -> ``"bf16"``)."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no fqr name; fqr knows {', '.join(DTYPES)}") from None


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype fqr calls ``name`` (``"bf16"`` -> ``torch.bfloat16``)."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}") from None


class TraceError(TypeError):
    """A traced function did something the functional core cannot represent."""


@dataclass(frozen=True)
class Aval:
    """Abstract value: a shape (ints, or ``"T"`` for the token dim) and a dtype."""

    shape: tuple
    dtype: torch.dtype

    def __str__(self):
        return f"{DTYPE_NAMES.get(self.dtype, str(self.dtype))}[{','.join(map(str, self.shape))}]"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @classmethod
    def of(cls, x: torch.Tensor | None, *leading) -> Aval | None:
        """The abstract value of ``x`` with its leading dims renamed (``"T"``, ``"P"``), or None."""
        if x is None:
            return None
        return cls(tuple(leading) + tuple(x.shape[len(leading) :]), x.dtype)


def spec(*shape, dtype=torch.bfloat16) -> Aval:
    """Argument spec for :func:`trace`, e.g. ``spec("T", 6144, dtype=torch.bfloat16)``."""
    return Aval(tuple(shape), dtype)


@dataclass(eq=False)
class Var:
    aval: Aval

    def __repr__(self):
        return f"Var({self.aval})"


@dataclass
class Eqn:
    prim: Primitive
    inputs: list  # Var or None (an optional operand that is absent)
    outputs: list[Var]
    params: dict


@dataclass
class Program:
    inputs: list[Var]
    eqns: list[Eqn]
    outputs: list[Var]
    input_names: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return ProgramPrinter(self).render()

    def fingerprint(self) -> str:
        """A stable text that identifies the program (for kernel-cache keys)."""
        if "_fingerprint" not in self.__dict__:
            self.__dict__["_fingerprint"] = str(self)
        return self.__dict__["_fingerprint"]


def _fmt_param(v) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, torch.dtype):
        return DTYPE_NAMES[v]
    return str(v)


class ProgramPrinter:
    def __init__(self, program: Program):
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


def _name_stream():
    letters = "abcdefghijklmnopqrstuvwxyz"
    for n in itertools.count(1):
        for combo in itertools.product(letters, repeat=n):
            yield "".join(combo)


class Primitive:
    """A named operation; its interpretation rules are attached by the module defining it."""

    def __init__(self, name: str, multiple_results: bool = False):
        self.name = name
        self.multiple_results = multiple_results
        self.impl: Callable | None = None
        self.abstract: Callable | None = None
        self.lower: Callable | None = None

    def __repr__(self):
        return f"Primitive({self.name})"

    def def_impl(self, fn):
        self.impl = fn
        return fn

    def def_abstract(self, fn):
        self.abstract = fn
        return fn

    def def_lowering(self, fn):
        self.lower = fn
        return fn

    def bind(self, *args, **params):
        trace = _find_trace(args)
        if trace is not None:
            return trace.record(self, args, params)
        # Eager call: validate with the same shape rule as tracing, compute in at least fp32,
        # round once to the output dtype (the fused contract, one op at a time).
        avals = [None if a is None else Aval(tuple(a.shape), a.dtype) for a in args]
        out_avals = self.abstract(*avals, **params)
        ins = [None if a is None else _upcast(a, torch.float32) for a in args]
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

    def __init__(self, trace: Trace, var: Var):
        self._trace = trace
        self.var = var

    @property
    def shape(self):
        return self.var.aval.shape

    @property
    def dtype(self):
        return self.var.aval.dtype

    @property
    def ndim(self):
        return self.var.aval.ndim

    def __repr__(self):
        return f"Tracer({self.var.aval})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        raise TraceError(
            f"unsupported torch op torch.{name} on a traced value: fqr can trace only its own "
            f"primitives ({', '.join(sorted(PRIMITIVES))})"
        )

    def __getattr__(self, attr):
        raise TraceError(
            f"unsupported torch op Tensor.{attr} on a traced value: fqr can trace only its own "
            f"primitives ({', '.join(sorted(PRIMITIVES))})"
        )


def _unsupported_operator(opname):
    def method(self, *args):
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
    def __init__(self):
        self.eqns: list[Eqn] = []

    def new_input(self, aval: Aval) -> Tracer:
        return Tracer(self, Var(aval))

    def record(self, prim: Primitive, args, params) -> Any:
        in_vars = []
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


def _find_trace(args) -> Trace | None:
    for a in args:
        if isinstance(a, Tracer):
            return a._trace
    return None


def trace(fn: Callable, *arg_specs: Aval | torch.Tensor | None, **static) -> Program:
    """Run ``fn(*args, **static)`` on abstract values and return the :class:`Program` it builds.

    ``arg_specs`` are :class:`Aval` s (see :func:`spec`), tensors (their leading dim becomes the
    symbolic token dim ``T`` when it is 2-D activation-like: pass an Aval to be explicit), or
    ``None`` for an absent optional operand. ``static`` keyword arguments are passed through
    unchanged (head counts, eps, flags).
    """
    tr = Trace()
    args, inputs, names = [], [], []
    for i, s in enumerate(arg_specs):
        if s is None:
            args.append(None)
            continue
        aval = s if isinstance(s, Aval) else Aval(tuple(s.shape), s.dtype)
        t = tr.new_input(aval)
        args.append(t)
        inputs.append(t.var)
        names.append(f"arg{i}")
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
    return Program(inputs, tr.eqns, out_vars, names)


# ------------------------------------------------------------------------- interpretation


def eval_program(
    program: Program,
    args: Sequence[torch.Tensor | None],
    compute_dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Evaluate ``program`` with the primitives' reference ``impl`` rules.

    Floating inputs are upcast to ``compute_dtype`` (never downcast: float64 inputs stay float64)
    and every intermediate stays there; outputs are rounded once to their declared dtype. This is
    the ``fused`` numerics contract; explicit ``reduce_precision`` equations add the roundings of
    the ``unfused`` mode. ``args`` holds one entry per non-None program input, in order.
    """
    if len(args) != len(program.inputs):
        raise TypeError(f"program takes {len(program.inputs)} inputs, got {len(args)}")
    env: dict[int, torch.Tensor] = {}
    for var, a in zip(program.inputs, args):
        env[id(var)] = _upcast(a, compute_dtype)
    for e in program.eqns:
        ins = [None if v is None else env[id(v)] for v in e.inputs]
        out = e.prim.impl(*ins, **e.params)
        outs = out if e.prim.multiple_results else (out,)
        for v, o in zip(e.outputs, outs):
            env[id(v)] = o
    return [env[id(v)].to(v.aval.dtype) for v in program.outputs]


def _upcast(x: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    if x.is_floating_point() and torch.finfo(x.dtype).bits < torch.finfo(compute_dtype).bits:
        return x.to(compute_dtype)
    return x
