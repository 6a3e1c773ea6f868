"""Pieces of compositions several members of the family share (traced like any composition)."""

from __future__ import annotations

from .. import ops


def norm_then_rope(
    q,
    k,
    positions,
    cos_sin_cache,
    weights,
    biases=(None, None),
    *,
    groups,
    sums=(None, None),
    counts=(None, None),
    head_dim,
    eps,
    is_neox,
    weight_offset,
    numerics,
    full_norm=False,
):
    """RMSNorm of q and of k over groups of ``groups[i]`` features (no norm when ``groups`` is
    None), then RoPE of both (none without a ``cos_sin_cache``: a NoPE layer); ``k`` None: q
    alone. ``numerics="unfused"`` rounds to q's dtype where the model code does, in the norm
    and in every RoPE step (:mod:`fqr.ops.norm`, :mod:`fqr.ops.rope`)."""
    round_to = q.dtype if numerics.startswith("unfused") else None
    # HF's OLMo2 (full-width norms): the weight multiplies in fp32 (one rounding), and RoPE runs
    # in fp32 with fp32 cos/sin, rounded once (fqr.numerics, "unfused-hf")
    hf_full_norm = numerics == "unfused-hf" and full_norm
    values = [q, k]
    if groups is not None:
        values = [
            None
            if x is None
            else ops.rms_norm(
                x,
                w,
                eps=eps,
                group_size=g,
                bias=b,
                weight_offset=weight_offset,
                sum_sq=ss,
                count=n,
                round_to=round_to,
                round_before_weight=False if hf_full_norm else None,
            )
            for x, w, b, g, ss, n in zip(values, weights, biases, groups, sums, counts)
        ]
    if cos_sin_cache is not None:
        rope = dict(head_dim=head_dim, is_neox=is_neox, round_to=None if hf_full_norm else round_to)
        values = [
            None if x is None else ops.rope(x, positions, cos_sin_cache, **rope) for x in values
        ]
    return values[0], values[1]


def round_to(x, numerics: str):
    """The dtype ``numerics="unfused"`` rounds to (``x``'s), else None (the fused contract)."""
    return x.dtype if numerics.startswith("unfused") else None


def head_norm_rope(
    q, k, positions, cos_sin_cache, weights, s: dict, *, biases=(None, None), head_dim=None
):
    """Per-head RMSNorm + RoPE of q and k (:func:`norm_then_rope` over heads of ``head_dim``,
    default the call's) with the call's static arguments ``s`` (``eps``, ``is_neox``,
    ``weight_offset``, ``numerics``)."""
    d = head_dim or s["head_dim"]
    return norm_then_rope(
        q,
        k,
        positions,
        cos_sin_cache,
        weights,
        biases,
        groups=(d, d),
        head_dim=d,
        eps=s["eps"],
        is_neox=s["is_neox"],
        weight_offset=s.get("weight_offset", 0.0),
        numerics=s["numerics"],
    )


def split_head_norm_rope(qkv, positions, cos_sin_cache, weights, s: dict, *, biases=(None, None)):
    """vLLM's packed ``[q | k | v]`` row split (``num_heads``, ``num_kv_heads``,
    ``head_dim`` of ``s``), then :func:`head_norm_rope` of q and k (``biases`` added after the
    norm, before RoPE): ``(q, k, v)``."""
    q, k, v = ops.split_qkv(qkv, s["num_heads"], s["num_kv_heads"], s["head_dim"])
    q, k = head_norm_rope(q, k, positions, cos_sin_cache, weights, s, biases=biases)
    return q, k, v
