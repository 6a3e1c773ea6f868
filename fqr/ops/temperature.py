"""attn_temperature: Llama 4's position-dependent attention temperature on q (NoPE layers).

For token ``t`` at position ``p = positions[t]`` every feature of every head is scaled by::

    s(p) = log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1
    y = x * s(p)

This is vLLM's ``Llama4Attention._get_attn_scale`` and ``q = (q * attn_scale).to(q.dtype)``
(``vllm/model_executor/models/llama4.py``) and Hugging Face's ``Llama4TextAttention`` (``attn_scales
= log(floor((cache_position + 1) / floor_scale) + 1) * attn_scale + 1``,
``transformers/models/llama4/modeling_llama4.py``), applied on the layers without RoPE when
``attn_temperature_tuning`` is on; ``floor_scale`` and ``attn_scale`` come from the config
(8192 and 0.1 for Llama 4 Scout). Both models compute ``s`` in fp32 from the positions and round
the product once to q's dtype, which is also the ``fused`` contract: the op has no ``round_to``.
The statistic is computed in the kernel from the positions (exact in fp32 below 2^24), so the
op reads nothing but the value and the positions.
"""

from __future__ import annotations

import torch

from ..core import Aval, EmitContext, Eqn, HeadOp, Role, primitive
from .common import check_token_index, emit_elementwise

attn_temperature_p = primitive("attn_temperature")


def attn_temperature(x, positions, *, floor_scale: float, attn_scale: float):
    """See the module docstring."""
    return attn_temperature_p.bind(
        x, positions, floor_scale=float(floor_scale), attn_scale=float(attn_scale)
    )


@attn_temperature_p.def_abstract
def _temperature_abstract(x: Aval, positions: Aval, *, floor_scale, attn_scale):
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [T, heads*head_dim], got shape {list(x.shape)}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating tensor, got {x.dtype}")
    check_token_index("positions", positions, x)
    if not floor_scale > 0:
        raise ValueError(f"floor_scale must be > 0, got {floor_scale}")
    if not attn_scale == attn_scale or abs(attn_scale) == float("inf"):
        raise ValueError(f"attn_scale must be finite, got {attn_scale}")
    return Aval(x.shape, x.dtype)


@attn_temperature_p.def_impl
def _temperature_impl(x, positions, *, floor_scale, attn_scale):
    p = positions.to(x.dtype)  # the compute dtype: fp32 as the models (float64 in checks)
    s = torch.log(torch.floor((p + 1.0) / floor_scale) + 1.0) * attn_scale + 1.0
    return x * s[:, None]


@attn_temperature_p.def_facts
def _temperature_facts(x: Aval, positions: Aval, *, floor_scale, attn_scale) -> HeadOp:
    # elementwise with one number per token: any head width, any layout
    return HeadOp((Role.VALUE, Role.TOKEN_VALUE))


@attn_temperature_p.def_lowering
def _temperature_lowering(b: EmitContext, eqn: Eqn) -> None:
    x_var, pos_var = eqn.inputs
    assert x_var is not None and pos_var is not None
    p = eqn.params
    pos = b.token_values(pos_var)
    s = b.fresh("temp")
    b.emit(
        f"{s} = (tl.log(tl.floor(({pos} + 1.0) / {p['floor_scale']!r}) + 1.0)"
        f" * {p['attn_scale']!r} + 1.0)[:, None, None]"
    )
    emit_elementwise(b, eqn, x_var, lambda v: f"{v} * {s}")
