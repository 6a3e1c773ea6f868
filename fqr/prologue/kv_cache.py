"""``split_qkv_rmsnorm_rope_cache``: norm + RoPE of q and k, then k and v written into the
paged KV cache by slot (vllm-ascend's ``minimax_qknorm_rope_cache`` for the main heads, vLLM's
``reshape_and_cache_flash`` fused in, vLLM's ``fused_qk_norm_rope_kvcache``); returns q (and
k with ``return_k``).

The composition (:func:`cache_prologue`) is the split op's per-head form followed by two
``cache_insert``: functional updates of the caches, which the public op donates so the kernel
stores in place. The float64 reference is :func:`fqr.reference.cache_prologue`. The variant
``kv-cache`` binds MiniMax-M3's presets (:mod:`.variant`).
"""

from __future__ import annotations

from .. import ops, reference
from ..inputs import (
    random_norm_params,
    random_positions,
    random_qkv,
    random_slot_mapping,
    with_outliers,
)
from ..peers import minimax_cache_prologue
from . import params
from .blocks import split_head_norm_rope
from .declare import (
    BACKEND,
    Output,
    Slots,
    Static,
    declare,
    flag,
    numerics,
)
from .variant import CaseSpec, Variant, head_kwargs, register_variant, spec_chain


def cache_prologue(
    qkv, positions, cos_sin_cache, q_weight, k_weight, key_cache, value_cache, slot_mapping,
    k_scale, v_scale, **s,
):  # fmt: skip
    """Norm + RoPE of q and k, then k and v written into the paged caches by slot (traced into
    one program): returns ``(q, new key_cache, new value_cache)`` (``(q, k, ...)`` with
    ``return_k``), the caches functional updates (:func:`fqr.ops.cache_insert`) that the kernel
    stores in place when donated."""
    return_k = s.pop("return_k")
    q, k, v = split_head_norm_rope(qkv, positions, cos_sin_cache, (q_weight, k_weight), s)
    encoding = params.cache_encoding(key_cache)  # E5M2 bytes
    key_cache = ops.cache_insert(key_cache, k, slot_mapping, k_scale, encoding=encoding)
    value_cache = ops.cache_insert(value_cache, v, slot_mapping, v_scale, encoding=encoding)
    return (q, *((k,) if return_k else ()), key_cache, value_cache)


RETURN_K = Static(
    "return_k",
    False,
    annotation="bool",
    check=flag,
    schema="bool",
    doc="also return the normalised, rotated ``k [T, Hkv*D]`` of every token (vLLM's "
    "``fused_qk_norm_rope_kvcache`` writes q and k of all T tokens, stored or not): returns "
    "``(q, k)``",
)


SPLIT_QKV_RMSNORM_ROPE_CACHE = declare(
    "split_qkv_rmsnorm_rope_cache",
    cache_prologue,
    (
        params.QKV,
        params.POSITIONS,
        params.COS_SIN_CACHE,
        params.Q_WEIGHT,
        params.K_WEIGHT,
        *params.KV_CACHES,
        params.positional(
            "slot_mapping",
            Slots(shorter=True),
            doc="``[N]`` int32/int64 slot of each of the first N <= T tokens: block ``s // "
            "block_size``, row ``s % block_size``; negative: padding, nothing stored; tokens "
            "``t >= N`` (a batch padded for CUDA graphs) are not stored",
        ),
        params.NUM_HEADS,
        params.NUM_KV_HEADS,
        params.HEAD_DIM,
        params.EPS,
        params.IS_NEOX,
        params.WEIGHT_OFFSET,
        *params.KV_SCALES,
        numerics(),
        RETURN_K,
        BACKEND,
    ),
    (
        Output("q"),
        Output("k", present=lambda call: call.return_k),
        *params.KV_CACHE_OUTPUTS,
    ),
    reference=reference.cache_prologue,
    static_checks=(params.heads_divide,),
    checks=(params.caches_agree,),
    doc=f"""
    Split the packed QKV row, RMS-normalise and rotate q and k, and write k and v into the
    paged KV cache (vllm-ascend's ``minimax_qknorm_rope_cache`` for the main heads, vLLM's
    ``reshape_and_cache_flash`` fused in); returns the new ``q [T, Hq*D]``, or with
    ``return_k=True`` ``(q, k)``, k ``[T, Hkv*D]`` as it is before the cache store (vLLM's
    ``fused_qk_norm_rope_kvcache``: q and k of every token into its ``q_out`` / ``k_out``;
    ``.view(T, H, D)`` gives its shapes).

    q and k: the math of :func:`fqr.split_qkv_rmsnorm_rope` (per-head norm, ``(weight_offset +
    w)``, RoPE of the first R features), for all T tokens. Then for every token ``t < N``
    (``slot_mapping`` is ``[N]``, ``N <= T``: vLLM pads T for CUDA graphs and passes the
    ``num_actual_tokens`` slots, as its ``reshape_and_cache_flash`` takes its token count
    from the slot mapping) with ``s = slot_mapping[t] >= 0``, block ``s // block_size``, row
    ``s % block_size``::

        key_cache[s // bs, s % bs, h, :]   = store(k[t, h])
        value_cache[s // bs, s % bs, h, :] = store(v[t, h])

    ``store`` rounds to the cache's dtype; an FP8 cache stores ``e4m3(clamp(x / scale, -448,
    448))`` with the float32 ``[1]`` ``k_scale`` / ``v_scale``, default 1 (vLLM's FP8 KV-cache
    convention). A negative slot (padding) writes nothing; rows no slot names are left as they
    are; two tokens naming one slot is the caller's error (vLLM's scheduler never does it) and
    leaves either row.

    **The caches are updated in place**, as vLLM's cache ops update the caller's cache: the
    composition is functional (:func:`fqr.ops.cache_insert` returns the new cache) and the
    public op donates the caller's buffers, so the kernel stores straight into them (the
    reference backend copies the functional result back). The reference it matches is
    :func:`fqr.reference.cache_prologue`. ``numerics="unfused"`` rounds k to qkv's dtype before
    the cache store, as the model's ``k_norm`` / ``rotary_emb`` / ``reshape_and_cache`` chain
    does.

    {params.EXAMPLE_WITH_TABLE}
        >>> qkv = torch.randn(3, (4 + 2 * 2) * 64, dtype=torch.bfloat16)
        >>> w = torch.ones(64, dtype=torch.bfloat16)
        >>> key_cache = torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16)  # 2 blocks of 16 slots
        >>> value_cache = torch.zeros_like(key_cache)
        >>> slots = torch.tensor([17, -1, 3])  # token 1 is padding: written nowhere
        >>> q = fqr.split_qkv_rmsnorm_rope_cache(
        ...     qkv, torch.tensor([0, 1, 2]), table, w, w, key_cache, value_cache, slots,
        ...     num_heads=4, num_kv_heads=2, head_dim=64,
        ... )
        >>> torch.equal(value_cache[1, 1].flatten(), qkv[0, 384:])  # slot 17: block 1, row 1
        True
    """,
)

split_qkv_rmsnorm_rope_cache = SPLIT_QKV_RMSNORM_ROPE_CACHE.function


# ------------------------------------------------------------------------- the variant


def _draw(variant, preset, tokens, dtype, generator, *, max_position, positions_dtype, bias):
    """The row (v with outliers past +-448), positions, weights, caches of twice the rows the
    tokens need holding random values (a row written where no slot names it shows), slots with
    every third one negative (padding), random per-tensor scales for an FP8 cache."""
    spec = preset.spec
    v_at = spec.q_size + spec.kv_size
    qkv = with_outliers(
        random_qkv(spec, tokens, dtype, generator), slice(v_at, v_at + spec.kv_size), generator
    )
    positions = random_positions(
        tokens, max_position, generator, dtype=positions_dtype, cover_ends=True
    )
    q_weight, k_weight, _, _ = random_norm_params(spec, dtype, generator)
    drawn = {"qkv": qkv, "positions": positions, "q_weight": q_weight, "k_weight": k_weight}
    caches = params.random_kv_caches(
        preset, dtype, generator, holds=tokens,
        slot_mapping=lambda rows: random_slot_mapping(tokens, rows, generator),
    )  # fmt: skip
    return drawn | caches


# MiniMax-M3's KV-cache insert: bf16 and FP8 caches, every third slot negative.
KV_CACHE = register_variant(
    Variant(
        "kv-cache",
        SPLIT_QKV_RMSNORM_ROPE_CACHE,
        kwargs=head_kwargs,
        draw_inputs=_draw,
        eager_chain=spec_chain(minimax_cache_prologue),
        params=params.PAGED_CACHE_FIELDS,
        check_preset=params.check_paged_cache_preset,
        golden=(
            CaseSpec("minimax-m3-kvcache", "bf16", 7, tp=8),
            CaseSpec("minimax-m3-kvcache-fp8", "bf16", 7, tp=8),
        ),
    )
)
