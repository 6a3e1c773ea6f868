"""reduce_precision: round a value to a storage dtype and keep computing in the wider one.

Inside a fused program every intermediate stays in fp32; ``reduce_precision[dtype=bf16]``
is a rounding as its own equation, where a composition writes a value to a bf16 tensor between
two ops (JAX's ``lax.reduce_precision``). The ``unfused`` prologue does not need it: its
roundings sit inside the ops whose model code rounds (``rms_norm`` and ``rope``'s
``round_to``), at the points :mod:`fqr.numerics` lists.
"""

from __future__ import annotations

import torch

from ..core import Aval, EmitContext, Eqn, HeadOp, Role, primitive
from .common import emit_elementwise

reduce_precision_p = primitive("reduce_precision")


def reduce_precision(x, dtype: torch.dtype):
    return reduce_precision_p.bind(x, dtype=dtype)


@reduce_precision_p.def_abstract
def _rp_abstract(x: Aval, *, dtype):
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be floating, got {dtype}")
    return Aval(x.shape, x.dtype)


@reduce_precision_p.def_impl
def _rp_impl(x, *, dtype):
    return x.to(dtype).to(x.dtype)


@reduce_precision_p.def_facts
def _rp_facts(x: Aval, *, dtype) -> HeadOp:
    return HeadOp((Role.VALUE,))  # elementwise: any head width, any layout


@reduce_precision_p.def_lowering
def _rp_lowering(b: EmitContext, eqn: Eqn) -> None:
    x_var = eqn.inputs[0]
    assert x_var is not None
    dtype = eqn.params["dtype"]
    emit_elementwise(b, eqn, x_var, lambda v: b.round_point(v, dtype))
