"""The parameters the members of the prologue family share, declared once.

A declaration lists these (or a ``dataclasses.replace`` of one, for another default) in its
signature order; each carries its kind, its check (so one argument is checked and named the same
way by every op), its torch schema type and its line of documentation.
"""

from __future__ import annotations

from dataclasses import replace

from ..validate import check_head_counts
from .declare import (
    BACKEND,
    MISSING,
    Call,
    Positions,
    Rows,
    Static,
    Table,
    Tensor,
    Vector,
    flag,
    positive_int,
    positive_real,
    real,
)

TENSOR = "torch.Tensor"
OPTIONAL_TENSOR = "torch.Tensor | None"

POSITIONS = Tensor(
    "positions",
    keyword=False,
    annotation=TENSOR,
    kind=Positions(),
    doc="``[T]`` int32/int64 token positions, rows of ``cos_sin_cache`` (checked against its "
    "rows on the host for CPU tensors; on an accelerator the kernel rotates an out-of-range "
    "token by NaN)",
)
COS_SIN_CACHE = Tensor(
    "cos_sin_cache",
    keyword=False,
    annotation=TENSOR,
    kind=Table(),
    doc="``[max_position, R]`` float RoPE table in vLLM's layout (cos in ``[0, R/2)``, sin in "
    "``[R/2, R)``; R = rotary_dim, even, at most head_dim); build it with "
    "``fqr.rope_cache.rope_cos_sin_cache`` or ``preset.cos_sin_cache()``",
)


def weight(name: str, of: str, *, keyword: bool = False, optional: bool = False) -> Tensor:
    """A per-head norm weight ``[head_dim]`` (float, contiguous; the activations' dtype or
    any float)."""
    return Tensor(
        name,
        None if optional else MISSING,
        keyword=keyword,
        annotation=OPTIONAL_TENSOR if optional else TENSOR,
        kind=Vector(),
        optional=optional,
        doc=f"``[head_dim]`` RMSNorm weight of {of} (scaled as ``weight_offset + w``); "
        "contiguous, any floating dtype (it need not be the activations')",
    )


def bias(name: str, of: str) -> Tensor:
    return Tensor(
        name,
        None,
        annotation=OPTIONAL_TENSOR,
        kind=Vector(),
        optional=True,
        doc=f"``[head_dim]`` bias added to {of} after the norm (given with the other bias)",
    )


Q_WEIGHT = weight("q_weight", "q")
K_WEIGHT = weight("k_weight", "k")
Q_BIAS = bias("q_bias", "q")
K_BIAS = bias("k_bias", "k")

NUM_HEADS = Static(
    "num_heads",
    annotation="int",
    check=positive_int,
    schema="int",
    doc="q heads (of this rank, under tensor parallelism)",
)
NUM_KV_HEADS = Static(
    "num_kv_heads",
    annotation="int",
    check=positive_int,
    schema="int",
    doc="k (and v) heads; num_heads must be a multiple",
)
HEAD_DIM = Static(
    "head_dim", annotation="int", check=positive_int, schema="int", doc="features per head"
)
EPS = Static(
    "eps",
    1e-6,
    annotation="float",
    check=positive_real,
    normalize=float,
    schema="float",
    doc="added to mean(x^2) under the square root (the model's rms_norm_eps)",
)
IS_NEOX = Static(
    "is_neox",
    True,
    annotation="bool",
    check=flag,
    schema="bool",
    doc="RoPE pairs: NeoX halves (i, i + R/2) when True, GPT-J neighbours (2i, 2i+1) when False",
)
WEIGHT_OFFSET = Static(
    "weight_offset",
    0.0,
    annotation="float",
    check=real,
    normalize=float,
    schema="float",
    doc="the norm scales by ``weight_offset + w`` (1.0: Gemma-style ``(1 + w)`` weights)",
)


def qkv_width(call: Call) -> tuple[int, str]:
    """The width of vLLM's packed ``[q | k | v]`` row, and how it is made (for the message)."""
    hq, hkv, d = call.num_heads, call.num_kv_heads, call.head_dim
    width = (hq + 2 * hkv) * d
    return width, f"(num_heads + 2*num_kv_heads) * head_dim = ({hq} + 2*{hkv}) * {d} = {width}"


QKV = Tensor(
    "qkv",
    keyword=False,
    annotation=TENSOR,
    kind=Rows(width=qkv_width),
    doc="``[T, (Hq + 2*Hkv)*D]`` packed q | k | v rows, bf16/fp16/fp32; the row stride may "
    "exceed the width",
)


def heads_divide(call: Call) -> None:
    """Grouped-query attention: q heads a multiple of kv heads."""
    check_head_counts(call.num_heads, call.num_kv_heads)


def biases_together(call: Call) -> None:
    if (call.q_bias is None) != (call.k_bias is None):
        raise ValueError("q_bias and k_bias must be given together")


def with_default(param, default):
    """``param`` with another default (a model family's)."""
    return replace(param, default=default)


__all__ = [
    "BACKEND",
    "COS_SIN_CACHE",
    "EPS",
    "HEAD_DIM",
    "IS_NEOX",
    "K_BIAS",
    "K_WEIGHT",
    "NUM_HEADS",
    "NUM_KV_HEADS",
    "POSITIONS",
    "QKV",
    "Q_BIAS",
    "Q_WEIGHT",
    "WEIGHT_OFFSET",
    "biases_together",
    "heads_divide",
    "qkv_width",
    "with_default",
]
