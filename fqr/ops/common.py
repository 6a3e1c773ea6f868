"""Rules several ops share: the check of a ``[T]`` index operand, an elementwise emit rule."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..core import Aval, EmitContext, Eqn, Var


def check_token_index(name: str, index: Aval, x: Aval) -> None:
    """``index`` is a ``[T]`` int32/int64 operand of ``x [T, ...]``'s token count."""
    if index.ndim != 1 or index.shape[0] != x.shape[0]:
        raise ValueError(f"{name} must be [T] with T = {x.shape[0]}, got {list(index.shape)}")
    if index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {index.dtype}")


def emit_elementwise(b: EmitContext, eqn: Eqn, x_var: Var, expr: Callable[[str], str]) -> None:
    """Bind the equation's output to ``expr(piece)`` of each piece of ``x_var`` (fp32)."""
    out = {}
    for name, v in b.pieces(x_var).items():
        y = b.fresh(f"{b.var_name(eqn.outputs[0])}_{name}_")
        b.emit(f"{y} = {expr(v)}")
        out[name] = y
    b.set(eqn.outputs[0], out)
