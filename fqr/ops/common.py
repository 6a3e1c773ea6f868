"""Rules several ops share: the check of a ``[T]`` index operand, the table rows of the
tokens, an elementwise emit rule."""

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


def table_rows(cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``cache[positions]`` (``[T, R]``), a position outside ``[0, rows)`` giving a NaN row, as
    the kernels' masked gather does. The ops' checks refuse such a position on the host
    before any backend runs; on an accelerator, where they are not read back, an index past
    the table would end in a device-side assert that poisons the process's CUDA context."""
    index = positions.long()
    inside = ((index >= 0) & (index < cache.shape[0]))[:, None]
    rows = cache.index_select(0, index.clamp(0, cache.shape[0] - 1))
    nan = torch.tensor(float("nan"), dtype=rows.dtype, device=rows.device)
    return torch.where(inside, rows, nan)


def emit_elementwise(b: EmitContext, eqn: Eqn, x_var: Var, expr: Callable[[str], str]) -> None:
    """Bind the equation's output to ``expr(piece)`` of each piece of ``x_var`` (fp32)."""
    out = {}
    for name, v in b.pieces(x_var).items():
        y = b.fresh(f"{b.var_name(eqn.outputs[0])}_{name}_")
        b.emit(f"{y} = {expr(v)}")
        out[name] = y
    b.set(eqn.outputs[0], out)
