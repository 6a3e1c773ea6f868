"""rms_norm: RMS-normalise every contiguous group of features of the last dim.

For each token and each group ``x`` of ``group_size`` features (group = head_dim: per-head
QK-norm as in Qwen3 / Gemma 3; group = the full q or k width: OLMo2)::

    y = x * rsqrt(mean(x^2) + eps) * (weight_offset + weight) + bias

``weight`` and ``bias`` have length ``group_size`` and are shared by all groups. This is
Hugging Face's ``Qwen3RMSNorm`` / vLLM's ``RMSNorm`` (offset 0) and ``Gemma3RMSNorm`` /
``GemmaRMSNorm`` (offset 1). With ``round_to=None`` (the ``fused`` contract) it is computed
without intermediate rounding.

``weight=None`` is a norm without weight, ``y = x * rsqrt(mean(x^2) + eps)`` (offset 0, no
bias): vLLM's ``RMSNorm(has_weight=False)``, Gemma 4's v norm (HF ``Gemma4RMSNorm(with_scale=
False)``) and Llama 4's QK norm (HF ``Llama4TextL2Norm``); unfused it rounds once,
``y = round(x * rstd)``, as those modules do (fp32 compute, one cast back).

``round_to`` (a dtype: the ``unfused`` contract) rounds where those modules round, the statistic
``rstd = rsqrt(sum(x^2) / group + eps)`` staying in fp32 (``round`` = round to nearest even to
``round_to``):

* offset 0 (vLLM ``RMSNorm.forward_static``, HF ``Qwen3RMSNorm`` / ``LlamaRMSNorm``)::

      y = round(round(x * rstd) * w)             # the weight multiplies in the model dtype

* offset != 0 (vLLM ``GemmaRMSNorm.forward_static``, HF ``Gemma3RMSNorm``)::

      y = round((x * rstd) * (offset + w))       # (offset + w) and both products in fp32

* a bias is one more rounded step, ``y = round(y + b)``.

``round_before_weight`` (None: offset == 0, the rules above) says whether ``x * rstd`` is
rounded before the weight multiplies it; False is Hugging Face's ``Olmo2RMSNorm`` (``y =
round(x * rstd * w)``, the weight in fp32), which vLLM's OLMo2 replaces by ``RMSNorm``.

Tensor parallelism splits a full-width group across ranks. Then each rank passes the
all-reduced per-token ``sum_sq`` of the whole group (``[T]``, float32) and ``count``, the
group's full width; ``weight`` and ``bias`` are this rank's slice (length = local width) and
``mean(x^2)`` becomes ``sum_sq / count``.
"""

from __future__ import annotations

import torch

from ..core import Aval, EmitContext, Eqn, HeadOp, Reduction, Role, primitive

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
    round_to: torch.dtype | None = None,
    round_before_weight: bool | None = None,
):
    """See the module docstring."""
    # round_to is a param only when set, round_before_weight only when it departs from the
    # offset's rule: fused programs (and their kernel-cache keys) print as they always have.
    rounding: dict = {} if round_to is None else {"round_to": round_to}
    if round_to is not None and round_before_weight is not None:
        if bool(round_before_weight) != (float(weight_offset) == 0.0):
            rounding["round_before_weight"] = bool(round_before_weight)
    return rms_norm_p.bind(
        x,
        weight,
        bias,
        sum_sq,
        eps=float(eps),
        group=int(group_size),
        offset=float(weight_offset),
        count=int(count or group_size),
        **rounding,
    )


@rms_norm_p.def_abstract
def _norm_abstract(
    x: Aval,
    w: Aval,
    b: Aval | None,
    sum_sq: Aval | None,
    *,
    eps,
    group,
    offset,
    count,
    round_to=None,
    round_before_weight=None,
):
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [T, width], got shape {list(x.shape)}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating tensor, got {x.dtype}")
    if not (eps > 0):
        raise ValueError(f"eps must be > 0, got {eps}")
    if group < 1 or x.shape[1] % group:
        raise ValueError(f"group_size {group} does not divide the width {x.shape[1]}")
    if w is None and (b is not None or offset != 0.0):
        raise ValueError("a norm without weight takes no bias and weight_offset 0")
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
    if round_to is not None and not round_to.is_floating_point:
        raise TypeError(f"round_to must be a floating dtype, got {round_to}")
    return Aval(x.shape, x.dtype)


def _rounds_before_weight(params: dict) -> bool:
    """Whether ``x * rstd`` is rounded before the weight (module docstring)."""
    flag = params.get("round_before_weight")
    return params["offset"] == 0.0 if flag is None else flag


@rms_norm_p.def_impl
def _norm_impl(
    x, w, b, sum_sq, *, eps, group, offset, count, round_to=None, round_before_weight=None
):
    t, n = x.shape
    g = x.reshape(t, n // group, group)
    if sum_sq is None:
        ms = g.square().mean(dim=-1, keepdim=True)
    else:
        ms = (sum_sq.to(x.dtype) / count).reshape(t, 1, 1)
    w = torch.ones((), dtype=x.dtype) if w is None else w.to(x.dtype)
    if round_to is None:
        y = g * torch.rsqrt(ms + eps) * (offset + w)
        if b is not None:
            y = y + b.to(x.dtype)
        return y.reshape(t, n)

    def rnd(v):
        return v.to(round_to).to(x.dtype)

    normed = g * torch.rsqrt(ms + eps)
    before = _rounds_before_weight(dict(offset=offset, round_before_weight=round_before_weight))
    # without a weight w is 1: round(round(normed) * 1) is one rounding, as the modules do
    y = rnd(rnd(normed) * (offset + w)) if before else rnd(normed * (offset + w))
    if b is not None:
        y = rnd(y + b.to(x.dtype))
    return y.reshape(t, n)


@rms_norm_p.def_facts
def _norm_facts(x: Aval, w: Aval, b: Aval | None, sum_sq: Aval | None, **params) -> HeadOp:
    group = params["group"]
    if group != x.shape[1]:  # per head (QK-norm): the group is one head
        return HeadOp(
            (
                Role.VALUE,
                Role.HEAD_VECTOR if w is not None else None,
                Role.HEAD_VECTOR if b is not None else None,
                None,
            ),
            head_dim=group,
            reduction=Reduction.HEAD,
        )
    # The whole row (OLMo2): the statistic is summed in the kernel, or given per token.
    return HeadOp(
        (
            Role.VALUE,
            Role.ROW_VECTOR if w is not None else None,
            Role.ROW_VECTOR if b is not None else None,
            Role.TOKEN_VALUE if sum_sq is not None else None,
        ),
        reduction=None if sum_sq is not None else Reduction.ROW,
    )


@rms_norm_p.def_lowering
def _norm_lowering(b: EmitContext, eqn: Eqn) -> None:
    x_var, w_var, bias_var, sumsq_var = eqn.inputs
    assert x_var is not None
    facts = eqn.facts()
    assert isinstance(facts, HeadOp)
    p = eqn.params
    x = b.pieces(x_var)
    r = b.fresh("rstd")
    if sumsq_var is not None:
        stat = b.token_values(sumsq_var)
        b.emit(f"{r} = tl.rsqrt({stat} / {p['count']} + {p['eps']!r})[:, None, None]")
    else:
        assert facts.reduction is not None
        stat = b.sum_squares(x_var, facts.reduction)
        b.emit(f"{r} = tl.rsqrt({stat} / {p['count']} + {p['eps']!r}){b.keepdims(facts.reduction)}")
    weight_role, bias_role = facts.operands[1], facts.operands[2]
    w = b.vector(w_var, weight_role) if w_var is not None and weight_role is not None else None
    bias = b.vector(bias_var, bias_role) if bias_var is not None and bias_role else None
    round_to = p.get("round_to")

    def rnd(e: str) -> str:
        return e if round_to is None else b.round_point(e, round_to)

    out = {}
    for name, v in x.items():
        if w is None:
            scale = None
        elif p["offset"] == 0.0:
            scale = w[name]
        else:
            scale = f"({p['offset']!r} + {w[name]})"
        y = b.fresh(f"{b.var_name(eqn.outputs[0])}_{name}_")
        if scale is None:  # no weight: one rounding in either contract
            b.emit(f"{y} = " + rnd(f"{v} * {r}"))
        elif round_to is None:
            b.emit(f"{y} = {v} * {r} * {scale}" + (f" + {bias[name]}" if bias else ""))
        else:  # the unfused rounding points (module docstring)
            normed = rnd(f"{v} * {r}") if _rounds_before_weight(p) else f"{v} * {r}"
            b.emit(f"{y} = " + rnd(f"{normed} * {scale}"))
            if bias:
                y_bias = b.fresh(f"{y}_bias")
                b.emit(f"{y_bias} = " + rnd(f"{y} + {bias[name]}"))
                y = y_bias
        out[name] = y
    b.set(eqn.outputs[0], out)
