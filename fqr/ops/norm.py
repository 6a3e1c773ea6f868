"""rms_norm: RMS-normalise every contiguous group of features of the last dim.

For each token and each group ``x`` of ``group_size`` features (group = head_dim: per-head
QK-norm as in Qwen3 / Gemma 3; group = the full q or k width: OLMo2)::

    y = x * rsqrt(mean(x^2) + eps) * (weight_offset + weight) + bias

``weight`` and ``bias`` have length ``group_size`` and are shared by all groups. This is
Hugging Face's ``Qwen3RMSNorm`` / vLLM's ``RMSNorm`` (offset 0) and ``GemmaRMSNorm`` (offset 1)
computed without intermediate rounding.

Tensor parallelism splits a full-width group across ranks. Then each rank passes the
all-reduced per-token ``sum_sq`` of the whole group (``[T]``, float32) and ``count``, the
group's full width; ``weight`` and ``bias`` are this rank's slice (length = local width) and
``mean(x^2)`` becomes ``sum_sq / count``.
"""

from __future__ import annotations

import torch

from ..core import Aval, primitive

rms_norm_p = primitive("rms_norm")


def rms_norm(
    x,
    weight,
    *,
    eps: float,
    group_size: int,
    bias=None,
    weight_offset: float = 0.0,
    sum_sq=None,
    count: int | None = None,
):
    """See the module docstring."""
    return rms_norm_p.bind(
        x,
        weight,
        bias,
        sum_sq,
        eps=float(eps),
        group=int(group_size),
        offset=float(weight_offset),
        count=int(count or group_size),
    )


@rms_norm_p.def_abstract
def _norm_abstract(
    x: Aval, w: Aval, b: Aval | None, sum_sq: Aval | None, *, eps, group, offset, count
):
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [T, width], got shape {list(x.shape)}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating tensor, got {x.dtype}")
    if not (eps > 0):
        raise ValueError(f"eps must be > 0, got {eps}")
    if group < 1 or x.shape[1] % group:
        raise ValueError(f"group_size {group} does not divide the width {x.shape[1]}")
    for name, t in (("weight", w), ("bias", b)):
        if t is None:
            continue
        if t.shape != (group,):
            raise ValueError(f"{name} must have shape [{group}] (group_size), got {list(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if sum_sq is not None:
        if group != x.shape[1]:
            raise ValueError("sum_sq (an external statistic) needs group_size == the local width")
        if sum_sq.shape != (x.shape[0],) or sum_sq.dtype != torch.float32:
            raise ValueError(f"sum_sq must be float32 [T], got {sum_sq}")
        if count < group:
            raise ValueError(f"count {count} must be >= the local width {group}")
    elif count != group:
        raise ValueError("count is only meaningful with sum_sq")
    return Aval(x.shape, x.dtype)


@rms_norm_p.def_impl
def _norm_impl(x, w, b, sum_sq, *, eps, group, offset, count):
    t, n = x.shape
    g = x.reshape(t, n // group, group)
    if sum_sq is None:
        ms = g.square().mean(dim=-1, keepdim=True)
    else:
        ms = (sum_sq.to(x.dtype) / count).reshape(t, 1, 1)
    y = g * torch.rsqrt(ms + eps) * (offset + w.to(x.dtype))
    if b is not None:
        y = y + b.to(x.dtype)
    return y.reshape(t, n)


@rms_norm_p.def_lowering
def _norm_lowering(b, eqn):
    x_var, w_var, bias_var, sumsq_var = eqn.inputs
    p = eqn.params
    x = b.pieces(x_var)
    chain = b.chain
    full = p["group"] == chain.width and p["group"] != chain.head_dim
    r = b.fresh("rstd")
    if sumsq_var is not None:
        stat = b.token_values(sumsq_var)
        b.emit(f"{r} = tl.rsqrt({stat} / {p['count']} + {p['eps']!r})[:, None, None]")
    elif full:
        stat = b.full_width_sumsq(eqn)
        if stat is None:
            stat = b.fresh("sumsq")
            b.emit(
                f"{stat} = " + " + ".join(f"tl.sum(tl.sum({v} * {v}, 2), 1)" for v in x.values())
            )
        b.emit(f"{r} = tl.rsqrt({stat} / {p['count']} + {p['eps']!r})[:, None, None]")
    else:
        ss = b.fresh("sumsq")
        b.emit(f"{ss} = " + " + ".join(f"tl.sum({v} * {v}, 2)" for v in x.values()))
        b.emit(f"{r} = tl.rsqrt({ss} / {p['group']} + {p['eps']!r})[:, :, None]")
    w = b.weight_pieces(w_var, per_head=not full)
    bias = b.weight_pieces(bias_var, per_head=not full) if bias_var is not None else None
    out = {}
    for name, v in x.items():
        scale = w[name] if p["offset"] == 0.0 else f"({p['offset']!r} + {w[name]})"
        y = b.fresh(f"{b.var_name(eqn.outputs[0])}_{name}_")
        b.emit(f"{y} = {v} * {r} * {scale}" + (f" + {bias[name]}" if bias else ""))
        out[name] = y
    b.set(eqn.outputs[0], out)
