"""rope: rotary position embedding with vLLM's ``cos_sin_cache`` layout.

``cos_sin_cache`` is ``[max_position, R]`` (R = rotary_dim <= head_dim, even): cos in columns
``[0, R/2)``, sin in ``[R/2, R)``. For token ``t`` with ``c, s = cache[positions[t]]`` split in
halves, and each head's first ``R`` features split into pairs ``(x1_i, x2_i)``::

    x1_i' = x1_i * c_i - x2_i * s_i
    x2_i' = x2_i * c_i + x1_i * s_i

NeoX style pairs feature ``i`` with ``i + R/2``; GPT-J style pairs ``2i`` with ``2i + 1``.
Features ``[R, D)`` pass through (partial rotary). This is vLLM's ``RotaryEmbedding.forward_native``
(``apply_rotary_emb_torch``).

``rotary_dim`` (``r``, even, ``2 <= r <= R``; default R) rotates only the first ``r`` features
of each head with the first ``r/2`` frequencies of the one table: ``c = row[:r/2]``, ``s =
row[R/2 : R/2 + r/2]`` (features ``[r, D)`` pass through). This is how vllm-ascend's MiniMax
indexer (``split_qkv_index_rmsnorm_rope``) rotates a head group narrower than the table: each
group over ``min(R, its head_dim)`` of the one ``cos_sin_cache``.

``round_to`` (a dtype, or None; the ``unfused`` contract) rounds where the model code rounds
when it runs RoPE on ``round_to`` tensors (``round`` = round to nearest even)::

    c, s = round(c), round(s)                          # the table in the activation dtype
    x1_i' = round(round(x1_i * c_i) - round(x2_i * s_i))
    x2_i' = round(round(x2_i * c_i) + round(x1_i * s_i))

vLLM casts ``cos_sin_cache`` to the query dtype (``RotaryEmbedding._match_cos_sin_cache_dtype``)
and computes exactly these two products and one sum per output (``apply_rotary_emb_torch``);
Hugging Face computes cos/sin in fp32, casts them to the activation dtype, and writes
``x * cos + rotate_half(x) * sin``, whose first half ``x1*c + (-x2)*s`` rounds to the same bits
(negation is exact). The table is gathered first and then cast: an fp32 table rounds once to
``round_to``, a table already in ``round_to`` is used as is. None is the fused contract (no
intermediate rounding).
"""

from __future__ import annotations

import torch

from ..core import Aval, EmitContext, Eqn, HeadLayout, HeadOp, Role, primitive
from .common import check_token_index, table_rows

rope_p = primitive("rope")


def rope(
    x,
    positions,
    cos_sin_cache,
    *,
    head_dim: int,
    is_neox: bool = True,
    round_to: torch.dtype | None = None,
    rotary_dim: int | None = None,
):
    """See the module docstring (``rotary_dim`` None: the table's width, and the equation
    prints as it always did)."""
    narrow = {} if rotary_dim is None else {"rotary_dim": rotary_dim}
    return rope_p.bind(
        x,
        positions,
        cos_sin_cache,
        d=int(head_dim),
        neox=bool(is_neox),
        round_to=round_to,
        **narrow,
    )


def rotary_width(cache: Aval, rotary_dim: int | None) -> int:
    """The features rotated: ``rotary_dim``, else the table's width R."""
    r = cache.shape[1]
    assert isinstance(r, int)
    return r if rotary_dim is None else rotary_dim


@rope_p.def_abstract
def _rope_abstract(x: Aval, positions: Aval, cache: Aval, *, d, neox, round_to, rotary_dim=None):
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [T, heads*head_dim], got shape {list(x.shape)}")
    if d < 1 or x.shape[1] % d:
        raise ValueError(f"head_dim {d} does not divide the width {x.shape[1]}")
    check_token_index("positions", positions, x)
    if cache.ndim != 2:
        raise ValueError(
            f"cos_sin_cache must be 2-D [max_position, rotary_dim], got {list(cache.shape)}"
        )
    if not cache.dtype.is_floating_point:
        raise TypeError(f"cos_sin_cache must be a floating tensor, got {cache.dtype}")
    r = cache.shape[1]
    if not isinstance(r, int) or r % 2 or r < 2:
        raise ValueError(f"rotary_dim (cos_sin_cache width) must be even and >= 2, got {r}")
    if rotary_dim is not None:
        if not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool):
            raise TypeError(f"rotary_dim must be an int, got {type(rotary_dim).__name__}")
        if rotary_dim % 2 or not 2 <= rotary_dim <= r:
            raise ValueError(
                f"rotary_dim must be even, >= 2 and at most the cos_sin_cache width {r}, got "
                f"{rotary_dim}"
            )
        if rotary_dim > d:
            raise ValueError(f"rotary_dim {rotary_dim} exceeds head_dim {d}")
    elif r > d:
        raise ValueError(f"rotary_dim (cos_sin_cache width) {r} exceeds head_dim {d}")
    return Aval(x.shape, x.dtype)


def narrowed_rows(rows, rotary_dim: int | None):
    """Table rows ``[T, R]`` (cos | sin) narrowed to the first ``rotary_dim / 2`` frequencies:
    ``[T, rotary_dim]`` = ``row[:r/2] | row[R/2 : R/2 + r/2]`` (the rows as they are when
    ``rotary_dim`` is None)."""
    if rotary_dim is None or rotary_dim == rows.shape[1]:
        return rows
    half, h = rows.shape[1] // 2, rotary_dim // 2
    return torch.cat([rows[:, :h], rows[:, half : half + h]], dim=1)


@rope_p.def_impl
def _rope_impl(x, positions, cache, *, d, neox, round_to, rotary_dim=None):
    rows = narrowed_rows(table_rows(cache, positions), rotary_dim)
    return rotate_by_rows(x, rows, d=d, neox=neox, round_to=round_to)


def rotate_by_rows(x, rows, *, d: int, neox: bool, round_to):
    """The rotation of ``x [T, H*d]`` by per-token table rows ``[T, R]`` (cos | sin, in the
    table's stored dtype: cast to x's here), as the module docstring states it; shared with
    the ops that pick each token's rows otherwise (``fqr.ops.mrope``)."""
    rnd = (lambda v: v.to(round_to).to(x.dtype)) if round_to is not None else (lambda v: v)
    t, n = x.shape
    r = rows.shape[1]
    heads = x.reshape(t, n // d, d)
    rot, passthrough = heads[..., :r], heads[..., r:]
    cs = rows.to(x.dtype)
    cos = rnd(cs[:, None, : r // 2])
    sin = rnd(cs[:, None, r // 2 :])
    if neox:
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    o1 = rnd(rnd(x1 * cos) - rnd(x2 * sin))
    o2 = rnd(rnd(x2 * cos) + rnd(x1 * sin))
    rotated = torch.cat([o1, o2], -1) if neox else torch.stack([o1, o2], -1).flatten(-2)
    return torch.cat([rotated, passthrough], -1).reshape(t, n)


@rope_p.def_facts
def _rope_facts(
    x: Aval, positions: Aval, cache: Aval, *, d, neox, round_to, rotary_dim=None
) -> HeadOp:
    return HeadOp(
        (Role.VALUE, Role.INDEX, Role.TABLE),
        head_dim=d,
        layout=HeadLayout(rotary_width(cache, rotary_dim), "neox" if neox else "gptj"),
    )


@rope_p.def_lowering
def _rope_lowering(b: EmitContext, eqn: Eqn) -> None:
    # The layout (facts) holds the pairs as pieces a (x1) and b (x2); the rest passes through.
    x_var, pos_var, cache_var = eqn.inputs
    assert x_var is not None and pos_var is not None and cache_var is not None
    # A narrower rotary_dim r takes the first r/2 frequencies of each half of the table.
    x = b.pieces(x_var)
    sin_at = rotary_width(cache_var.aval, None) // 2
    half = rotary_width(cache_var.aval, eqn.params.get("rotary_dim")) // 2
    cos = b.gather(cache_var, pos_var, 0, half, name="cos")
    sin = b.gather(cache_var, pos_var, sin_at, half, name="sin")
    emit_rotation(b, eqn, x, cos, sin)


def emit_rotation(b: EmitContext, eqn: Eqn, x: dict[str, str], cos: str, sin: str) -> None:
    """The rotation's lines for the value pieces ``x`` (layout pieces ``a``, ``b``) by the
    ``[BLOCK_T, 1, R/2]`` tiles ``cos`` and ``sin``, rounding as ``eqn.params["round_to"]``
    says; binds ``eqn.outputs[0]``. Shared with ``fqr.ops.mrope``."""
    rt = eqn.params["round_to"]
    if rt is not None:

        def rnd(e: str) -> str:
            return b.round_point(e, rt)

        c, s = b.fresh("cosr"), b.fresh("sinr")
        b.emit(f"{c} = {rnd(cos)}")
        b.emit(f"{s} = {rnd(sin)}")
        cos, sin = c, s
    else:

        def rnd(e: str) -> str:
            return e

    a, bb = x["a"], x["b"]
    name = b.var_name(eqn.outputs[0])
    a2, b2 = b.fresh(f"{name}_a_"), b.fresh(f"{name}_b_")
    a_cos, b_sin = rnd(f"{a} * {cos}"), rnd(f"{bb} * {sin}")
    b_cos, a_sin = rnd(f"{bb} * {cos}"), rnd(f"{a} * {sin}")
    b.emit(f"{a2} = " + rnd(f"{a_cos} - {b_sin}"))
    b.emit(f"{b2} = " + rnd(f"{b_cos} + {a_sin}"))
    b.set(eqn.outputs[0], dict(x, a=a2, b=b2))
