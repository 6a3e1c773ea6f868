"""linear: the QKV projection, ``x @ w.T (+ bias)``, as a primitive of the core.

``linear(x [T, K], w [N, K], bias [N] | None) -> [T, N]``: vLLM's ``QKVParallelLinear``
(``F.linear(x, w_qkv, bias)``, the packed ``[q | k | v]`` weight of one TP rank), Hugging
Face's ``q_proj`` / ``k_proj`` / ``v_proj`` concatenated along N. Its output is the packed row a
prologue's ``split_qkv`` cuts into heads, so every declared prologue gains a form that starts
from the hidden states (:func:`fqr.prologue.projected.projected`).

Math: ``y[t, n] = sum_k x[t, k] * w[n, k] (+ bias[n])``. The impl computes in the dtype it is
given (fp32 under :func:`fqr.core.eval_program`, float64 for float64 inputs) and never rounds
between the product and the ops that follow: in a traced program the projection's value is the
fp32 accumulator, rounded once with the program's outputs (the fused contract). The float64
reference it matches is :func:`fqr.reference.project`.

Lowering: its facts are a :class:`fqr.core.Product` (x the hidden states, w the weight, bias
per column): the kernel computes each head that a ``split_heads`` cuts from the row as the
fp32 dot products of its columns over K, where the head is first used, and runs the prologue
on that accumulator (the GEMM's epilogue, :mod:`fqr.lowering.emit`).
"""

from __future__ import annotations

import torch

from ..core import Aval, Product, Role, primitive

linear_p = primitive("linear")


def linear(x, w, bias=None):
    """``x [T, K] @ w[N, K].T (+ bias [N])`` (module docstring)."""
    return linear_p.bind(x, w, bias)


@linear_p.def_abstract
def _abstract(x: Aval, w: Aval, bias: Aval | None) -> Aval:
    if x.ndim != 2:
        raise ValueError(f"linear: x must be 2-D [T, K], got {x}")
    if w.ndim != 2:
        raise ValueError(f"linear: w must be 2-D [N, K], got {w}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"linear: x has K = {x.shape[1]} features but w has {w.shape[1]}")
    if bias is not None and (bias.ndim != 1 or bias.shape[0] != w.shape[0]):
        raise ValueError(f"linear: bias must be [N] with N = {w.shape[0]}, got {bias}")
    return Aval((x.shape[0], w.shape[0]), x.dtype)


@linear_p.def_impl
def _impl(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    dtype = torch.promote_types(x.dtype, w.dtype)
    y = x.to(dtype) @ w.to(dtype).T
    return y if bias is None else y + bias.to(dtype)


@linear_p.def_facts
def _facts(x: Aval, w: Aval, bias: Aval | None) -> Product:
    return Product((Role.HIDDEN, Role.WEIGHT, None if bias is None else Role.BIAS))
