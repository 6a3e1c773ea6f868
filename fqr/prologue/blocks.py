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
    rotary_dim=None,
):
    """RMSNorm of q and of k over groups of ``groups[i]`` features (no norm when ``groups`` is
    None), then RoPE of both (none without a ``cos_sin_cache``: a NoPE layer) over the first
    ``rotary_dim`` features (None: the table's width; :func:`fqr.ops.rope`); ``k`` None: q
    alone. ``numerics="unfused"`` rounds to q's dtype where the model code does, in the norm
    and in every RoPE step (:mod:`fqr.ops.norm`, :mod:`fqr.ops.rope`)."""
    round_to = q.dtype if numerics.startswith("unfused") else None
    # "unfused-hf" (fqr.numerics): Hugging Face's RMSNorms that multiply the weight in fp32
    # (one rounding: OLMo 2's full-width norms, AFMoE's per-head ones); with the full-width
    # norms (HF's OLMo2) RoPE also runs in fp32 with fp32 cos/sin, rounded once
    hf_norm = numerics == "unfused-hf"
    hf_full_norm = hf_norm and full_norm
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
                round_before_weight=False if hf_norm else None,
            )
            for x, w, b, g, ss, n in zip(values, weights, biases, groups, sums, counts)
        ]
    if cos_sin_cache is not None:
        rope = dict(
            head_dim=head_dim,
            is_neox=is_neox,
            round_to=None if hf_full_norm else round_to,
            rotary_dim=rotary_dim,
        )
        values = [
            None if x is None else ops.rope(x, positions, cos_sin_cache, **rope) for x in values
        ]
    return values[0], values[1]


def round_to(x, numerics: str):
    """The dtype ``numerics="unfused"`` rounds to (``x``'s), else None (the fused contract)."""
    return x.dtype if numerics.startswith("unfused") else None


def complex_rope_round_to(x, numerics: str):
    """The rounding of a rotation whose ``numerics="unfused-hf"`` is Hugging Face's fp32
    complex product rounded once (DeepSeek-V2's ``apply_rotary_emb``: ``view_as_complex`` of
    the fp32 pairs times the fp32 ``freqs_cis``, then ``type_as``): None there (the rotation
    exact in fp32, one rounding at the store), else :func:`round_to`."""
    return None if numerics == "unfused-hf" else round_to(x, numerics)


def group_rotary_dim(cos_sin_cache, head_dim: int) -> int | None:
    """The rotary width of a head group ``head_dim`` wide under a table R wide: ``min(R,
    head_dim)`` (vllm-ascend's MiniMax indexer rotates each group so), as :func:`fqr.ops.rope`'s
    ``rotary_dim`` (None where the whole table fits, the default; no table: None)."""
    if cos_sin_cache is None:
        return None
    return head_dim if cos_sin_cache.shape[1] > head_dim else None


def head_norm_rope(
    q,
    k,
    positions,
    cos_sin_cache,
    weights,
    s: dict,
    *,
    biases=(None, None),
    head_dim=None,
    rotary_dim=None,
):
    """Per-head RMSNorm + RoPE of q and k (:func:`norm_then_rope` over heads of ``head_dim``,
    default the call's, rotating ``rotary_dim`` features, default the table's width) with the
    call's static arguments ``s`` (``eps``, ``is_neox``, ``weight_offset``, ``numerics``)."""
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
        rotary_dim=rotary_dim,
    )


def split_head_norm_rope(qkv, positions, cos_sin_cache, weights, s: dict, *, biases=(None, None)):
    """vLLM's packed ``[q | k | v]`` row split (``num_heads``, ``num_kv_heads``,
    ``head_dim`` of ``s``), then :func:`head_norm_rope` of q and k (``biases`` added after the
    norm, before RoPE): ``(q, k, v)``."""
    q, k, v = ops.split_qkv(qkv, s["num_heads"], s["num_kv_heads"], s["head_dim"])
    q, k = head_norm_rope(q, k, positions, cos_sin_cache, weights, s, biases=biases)
    return q, k, v


def index_split_norm_rope(
    qkv, index_qkv, positions, cos_sin_cache, weights, index_weights, s: dict, *,
    biases=(None, None),
):  # fmt: skip
    """MiniMax-M3's heads: the row ``[q | k | v | index_q | index_k]`` split (or ``[q | k |
    v]`` and ``index_qkv = [index_q | index_k]``: Hi index q heads and one index k head,
    ``index_head_dim`` wide), q and k normalised per ``head_dim`` head (``biases`` after the
    weight) and index_q / index_k per ``index_head_dim`` head, every group rotated over
    ``min(R, its head_dim)`` features of the one table (:func:`group_rotary_dim`). Returns
    ``(q, k, v, index_q, index_k)``."""
    hq, hkv, d = s["num_heads"], s["num_kv_heads"], s["head_dim"]
    hi, di = s["num_index_heads"], s["index_head_dim"]
    main = (
        ops.Section(hq, d, 0),
        ops.Section(hkv, d, hq * d),
        ops.Section(hkv, d, (hq + hkv) * d),
    )
    if index_qkv is None:
        at = (hq + 2 * hkv) * d
        q, k, v, iq, ik = ops.split_heads(
            qkv, (*main, ops.Section(hi, di, at), ops.Section(1, di, at + hi * di))
        )
    else:
        q, k, v = ops.split_heads(qkv, main)
        iq, ik = ops.split_heads(index_qkv, (ops.Section(hi, di, 0), ops.Section(1, di, hi * di)))
    q, k = head_norm_rope(
        q, k, positions, cos_sin_cache, weights, s, biases=biases,
        rotary_dim=group_rotary_dim(cos_sin_cache, d),
    )  # fmt: skip
    iq, ik = head_norm_rope(
        iq, ik, positions, cos_sin_cache, index_weights, s, head_dim=di,
        rotary_dim=group_rotary_dim(cos_sin_cache, di),
    )  # fmt: skip
    return q, k, v, iq, ik


def multimodal_rope(values, planes, cos_sin_cache, s: dict):
    """``ops.mrope`` of each of ``values`` (None passes) by the three position ``planes``,
    with the call's ``head_dim``, ``mrope_section``, ``mrope_interleaved``, ``is_neox`` and
    ``numerics`` (``"unfused"`` rounds every RoPE step to the first value's dtype)."""
    rotation = dict(
        head_dim=s["head_dim"],
        mrope_section=s["mrope_section"],
        mrope_interleaved=s["mrope_interleaved"],
        is_neox=s["is_neox"],
        round_to=round_to(values[0], s["numerics"]),
    )
    return tuple(
        None if x is None else ops.mrope(x, *planes, cos_sin_cache, **rotation) for x in values
    )
