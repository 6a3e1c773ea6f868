"""layer_norm: LayerNorm (mean-subtracting) of every head of a value, with weight and bias.

For each token and each group ``x`` of ``group_size`` features (a head)::

    mean = sum(x) / n,   var = sum((x - mean)^2) / n          (n = group_size, biased)
    y = (x - mean) * rsqrt(var + eps) * w + b

``weight`` and ``bias`` (both optional, the same shape) are ``[group_size]`` (one vector every
head shares: Persimmon's ``q_layernorm = nn.LayerNorm(head_dim)``) or ``[width]`` (each head its
own: Chameleon's ``ChameleonLayerNorm((num_heads, head_dim))``, whose statistics are per head
and whose ``weight``/``bias`` are ``[num_heads, head_dim]``). With ``round_to=None`` (the
``fused`` contract) it is computed without intermediate rounding.

``round_to`` (a dtype: the ``unfused`` contract) rounds where Hugging Face's modules round:

* ``round_before_weight=False``: ``nn.LayerNorm`` with its affine (Persimmon): torch's own
  ``F.layer_norm(x, (n,), w, b, eps)`` in ``round_to`` -- one rounding, at the end, of torch's
  fp32 computation;
* ``round_before_weight=True``: ``ChameleonLayerNorm.forward``: ``y = F.layer_norm(x, (n,),
  eps=eps)`` (rounded), then ``round(y * w)``, then ``round(... + b)``, each a torch op in
  ``round_to``.

The ``unfused`` impl calls torch's ``F.layer_norm`` in ``round_to`` (the module's own op: its
fp32 moments are torch's, so the reference backend equals the model bit for bit); the kernel
computes the two-pass moments in fp32 itself and lands within one ULP of it. The float64
formulation is :func:`fqr.reference.layer_norm`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core import Aval, EmitContext, Eqn, HeadOp, Reduction, Role, primitive

layer_norm_p = primitive("layer_norm")


def layer_norm(
    x,
    weight=None,
    bias=None,
    *,
    eps: float,
    group_size: int,
    round_to: torch.dtype | None = None,
    round_before_weight: bool = False,
):
    """See the module docstring."""
    rounding: dict = {}
    if round_to is not None:
        rounding = {"round_to": round_to, "round_before_weight": bool(round_before_weight)}
    return layer_norm_p.bind(x, weight, bias, eps=float(eps), group=int(group_size), **rounding)


@layer_norm_p.def_abstract
def _layer_norm_abstract(
    x: Aval, w: Aval | None, b: Aval | None, *, eps, group, round_to=None, round_before_weight=None
):
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [T, width], got shape {list(x.shape)}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating tensor, got {x.dtype}")
    if not (eps > 0):
        raise ValueError(f"eps must be > 0, got {eps}")
    width = x.shape[1]
    if group < 1 or width % group:
        raise ValueError(f"group_size {group} does not divide the width {width}")
    shapes = []
    for name, t in (("weight", w), ("bias", b)):
        if t is None:
            continue
        if t.ndim != 1 or t.shape[0] not in (group, width):
            raise ValueError(
                f"{name} must have shape [{group}] (group_size) or [{width}] (one vector per "
                f"head), got {list(t.shape)}"
            )
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
        shapes.append(t.shape)
    if len(set(shapes)) > 1:
        raise ValueError(f"weight and bias must have one shape, got {[list(s) for s in shapes]}")
    if round_to is not None and not round_to.is_floating_point:
        raise TypeError(f"round_to must be a floating dtype, got {round_to}")
    return Aval(x.shape, x.dtype)


def _heads(v: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype):
    """A weight or bias as ``[heads or 1, group]`` in ``dtype`` (None stays None)."""
    return None if v is None else v.to(dtype).reshape(-1, shape[1]).expand(*shape)


@layer_norm_p.def_impl
def _layer_norm_impl(x, w, b, *, eps, group, round_to=None, round_before_weight=None):
    t, n = x.shape
    g = x.reshape(t, n // group, group)
    shape = (n // group, group)
    if round_to is None:
        mean = g.mean(dim=-1, keepdim=True)
        c = g - mean
        y = c * torch.rsqrt((c * c).mean(dim=-1, keepdim=True) + eps)
        if w is not None:
            y = y * _heads(w, shape, x.dtype)
        if b is not None:
            y = y + _heads(b, shape, x.dtype)
        return y.reshape(t, n)
    # the module's own torch ops in the model dtype (module docstring)
    xr = g.to(round_to)
    if not round_before_weight:
        if w is None or w.shape[0] == group:  # nn.LayerNorm: torch's op, one rounding
            wr = None if w is None else w.to(round_to)
            br = None if b is None else b.to(round_to)
            return F.layer_norm(xr, (group,), wr, br, eps).to(x.dtype).reshape(t, n)
        y = F.layer_norm(g, (group,), None, None, eps) * _heads(w, shape, x.dtype)
        if b is not None:
            y = y + _heads(b, shape, x.dtype)
        return y.to(round_to).to(x.dtype).reshape(t, n)
    y = F.layer_norm(xr, (group,), None, None, eps)
    if w is not None:
        y = y * _heads(w, shape, round_to)
    if b is not None:
        y = y + _heads(b, shape, round_to)
    return y.to(x.dtype).reshape(t, n)


@layer_norm_p.def_facts
def _layer_norm_facts(x: Aval, w: Aval | None, b: Aval | None, **params) -> HeadOp:
    group = params["group"]

    def role(v: Aval | None) -> Role | None:
        if v is None:
            return None
        return Role.HEAD_VECTOR if v.shape[0] == group else Role.ROW_VECTOR

    return HeadOp((Role.VALUE, role(w), role(b)), head_dim=group, reduction=Reduction.HEAD)


@layer_norm_p.def_lowering
def _layer_norm_lowering(b: EmitContext, eqn: Eqn) -> None:
    x_var, w_var, bias_var = eqn.inputs
    assert x_var is not None
    facts = eqn.facts()
    assert isinstance(facts, HeadOp)
    p = eqn.params
    n = p["group"]
    x = b.pieces(x_var)
    mean = b.fresh("mean")
    b.emit(f"{mean} = ({b.head_sum(x)} / {n})[:, :, None]")
    centred = {}
    for name, v in x.items():
        c = b.fresh(f"{b.var_name(eqn.outputs[0])}_{name}_c")
        b.emit(f"{c} = {v} - {mean}")
        centred[name] = c
    r = b.fresh("rstd")
    var = b.head_sum({name: f"{c} * {c}" for name, c in centred.items()})
    b.emit(f"{r} = tl.rsqrt({var} / {n} + {p['eps']!r})[:, :, None]")
    w = b.vector(w_var, facts.operands[1]) if w_var is not None and facts.operands[1] else None
    bias = (
        b.vector(bias_var, facts.operands[2])
        if bias_var is not None and facts.operands[2]
        else None
    )
    round_to = p.get("round_to")
    separate = bool(p.get("round_before_weight"))

    def rnd(e: str) -> str:
        return e if round_to is None else b.round_point(e, round_to)

    out = {}
    for name, c in centred.items():
        y = b.fresh(f"{b.var_name(eqn.outputs[0])}_{name}_")
        if round_to is not None and separate:  # Chameleon: three torch ops, three roundings
            expr = rnd(f"{c} * {r}")
            if w is not None:
                expr = rnd(f"{expr} * {w[name]}")
            if bias is not None:
                expr = rnd(f"{expr} + {bias[name]}")
        else:  # fused, or nn.LayerNorm's one rounding at the end
            expr = f"{c} * {r}" + (f" * {w[name]}" if w else "")
            expr = rnd(expr + (f" + {bias[name]}" if bias else ""))
        b.emit(f"{y} = {expr}")
        out[name] = y
    b.set(eqn.outputs[0], out)
