"""``split_qkv_index_rmsnorm_rope_cache``: MiniMax-M3's whole sparse-attention prologue in one
kernel (vllm-ascend's ``minimax_qknorm_rope_cache``): norm + RoPE of q, k, index_q and index_k,
k and v written into the paged KV cache, index_k into its own index cache; returns q and
index_q.

The composition (:func:`index_cache_prologue`) is ``split_heads`` of the row (or of the main
row and a separate index projection) -> per-head norm + RoPE of the four head groups (each over
``min(R, its head_dim)``, :func:`.blocks.group_rotary_dim`) -> three ``cache_insert`` (k and v
into the 4-D caches by ``slot_mapping``, index_k into the 3-D index cache by
``index_slot_mapping``) -> ``quantize_fp8`` of index_q where the index cache is FP8 (E4M3 or
E5M2: index_q in the index cache's format). The float64
reference is :func:`fqr.reference.index_cache_prologue`.

:func:`minimax_qknorm_rope_cache` takes vllm-ascend's call as its callers write it (positional
order, ``num_actual_tokens``, slot mappings of at least ``num_actual_tokens`` entries,
``index_packed=``) and runs this declaration.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .. import ops, reference
from ..inputs import random_fp8_scales, random_index_row, random_paged_cache, random_slot_mapping
from ..ops.fp8 import FP8_E4M3, FP8_E5M2
from ..peers import minimax_index_cache_prologue
from ..validate import check_tensor
from . import params
from .blocks import index_split_norm_rope
from .declare import (
    BACKEND,
    Call,
    Output,
    Rows,
    Slots,
    Tensor,
    declare,
    numerics,
)
from .variant import CaseSpec, Variant, register_variant, spec_chain


def index_cache_prologue(
    qkv, positions, cos_sin_cache, q_weight, k_weight, index_q_weight, index_k_weight,
    key_cache, value_cache, index_cache, slot_mapping, index_slot_mapping, index_qkv, k_scale,
    v_scale, **s,
):  # fmt: skip
    """MiniMax-M3's prologue with its caches (traced into one program): the row ``[q | k | v
    | index_q | index_k]`` (or ``[q | k | v]`` and ``index_qkv = [index_q | index_k]``)
    split, q and k normalised per ``head_dim`` head, index_q and the one index_k head per
    ``index_head_dim`` head, all four rotated by the one table (each group over ``min(R, its
    head_dim)``), k and v inserted by ``slot_mapping``, index_k by ``index_slot_mapping``.
    Returns ``(q, index_q, new key_cache, new value_cache, new index_cache)``."""
    q, k, v, iq, ik = index_split_norm_rope(
        qkv, index_qkv, positions, cos_sin_cache, (q_weight, k_weight),
        (index_q_weight, index_k_weight), s,
    )  # fmt: skip
    encoding = params.cache_encoding(key_cache)  # E5M2 bytes
    key_cache = ops.cache_insert(key_cache, k, slot_mapping, k_scale, encoding=encoding)
    value_cache = ops.cache_insert(value_cache, v, slot_mapping, v_scale, encoding=encoding)
    index_fp8 = params.cache_fp8_dtype(index_cache)
    index_cache = ops.cache_insert(
        index_cache, ik, index_slot_mapping, encoding=params.cache_encoding(index_cache)
    )
    if index_fp8 is not None:  # index_q in the index cache's format, as the peer's
        iq = ops.quantize_fp8(iq, dtype=index_fp8)
    return q, iq, key_cache, value_cache, index_cache


def _main_width(call: Call) -> tuple[int, str]:
    if call.index_qkv is None:
        return params.index_row_width(call)
    width, text = params.qkv_width(call)
    return width, f"{text} (the index heads are in index_qkv)"


def _index_width(call: Call) -> tuple[int, str]:
    hi, di = call.num_index_heads, call.index_head_dim
    width = (hi + 1) * di
    return width, f"(num_index_heads + 1) * index_head_dim = ({hi} + 1) * {di} = {width}"


SCALED = " (scaled as ``weight_offset + w``)"  # the index weights' documentation


def _index_cache_shape(call: Call):
    di = call.index_head_dim
    return (None, di), f"[num_blocks, block_size, index_head_dim={di}]"


SPLIT_QKV_INDEX_RMSNORM_ROPE_CACHE = declare(
    "split_qkv_index_rmsnorm_rope_cache",
    index_cache_prologue,
    (
        replace(
            params.QKV,
            kind=Rows(what="[T, q | k | v (| index_q | index_k)]", width=_main_width),
            doc="``[T, (Hq + 2*Hkv)*D + (Hi + 1)*Di]``: the packed row ``[q | k | v | index_q | "
            "index_k]`` (Hi indexer q heads and ONE indexer k head, Di wide); ``[T, (Hq + "
            "2*Hkv)*D]`` when ``index_qkv`` is given; the row stride may exceed the width",
        ),
        params.POSITIONS,
        params.INDEX_COS_SIN_CACHE,
        replace(params.Q_WEIGHT, doc="``[head_dim]`` RMSNorm weight of q"),
        replace(params.K_WEIGHT, doc="``[head_dim]`` RMSNorm weight of k"),
        params.index_weight("index_q_weight", "index_q", what="index_head_dim", note=SCALED),
        params.index_weight("index_k_weight", "index_k", what="index_head_dim", note=SCALED),
        *params.KV_CACHES,
        params.positional(
            "index_cache",
            params.TypedCache(
                shape=_index_cache_shape,
                dtypes=params.cache_dtypes,
                dtype_text=params.cache_dtype_text,
                last="index_head_dim",
                slots="index_slot_mapping",
            ),
            donated=True,
            doc="``[num_blocks, block_size, Di]`` paged index-key cache (its own blocks and "
            "block size, any strides with a contiguous last dim) in qkv's dtype, "
            "float8_e4m3fn (saturated to +-448, no scale) or float8_e5m2 (+-57344); index_q "
            "is returned in its FP8 format; updated in place",
        ),
        params.positional(
            "slot_mapping",
            Slots(shorter=True),
            doc="``[N]`` (``N <= T``) int32/int64 slot of each of the first N tokens in "
            "key_cache and value_cache: block ``s // block_size``, row ``s % block_size``; "
            "negative: padding, nothing stored; tokens ``t >= N`` store nothing",
        ),
        params.positional(
            "index_slot_mapping",
            Slots(cache="index_cache", shorter=True, symbol="Ni"),
            doc="``[Ni]`` (``Ni <= T``) int32/int64 slot of each of the first Ni tokens' "
            "index_k in index_cache (its own block size); negative or ``t >= Ni``: nothing "
            "stored",
        ),
        params.NUM_HEADS,
        params.NUM_KV_HEADS,
        params.HEAD_DIM,
        params.NUM_INDEX_HEADS,
        replace(params.INDEX_HEAD_DIM, doc="features per indexer head (MiniMax-M3: head_dim)"),
        params.EPS,
        params.IS_NEOX,
        params.with_default(params.WEIGHT_OFFSET, 1.0),
        Tensor(
            "index_qkv",
            None,
            annotation=params.OPTIONAL_TENSOR,
            kind=Rows(what="[T, index_q | index_k]", width=_index_width, like="qkv"),
            optional=True,
            doc="``[T, (Hi + 1)*Di]`` the index projection ``[index_q | index_k]`` when it is "
            "a separate input (then qkv holds q | k | v only); qkv's dtype and tokens",
        ),
        *params.KV_SCALES,
        numerics(),
        BACKEND,
    ),
    (
        Output("q"),
        Output("index_q", head_dim=lambda s: s["index_head_dim"]),
        *params.KV_CACHE_OUTPUTS,
        Output("index_cache"),
    ),
    reference=reference.index_cache_prologue,
    static_checks=(params.heads_divide,),
    checks=(params.caches_agree,),
    doc="""
    MiniMax-M3's sparse-attention prologue with its paged caches, fused: vllm-ascend's
    ``minimax_qknorm_rope_cache`` (:func:`fqr.minimax_qknorm_rope_cache` takes its call as
    written). Returns new ``(q [T, Hq*D], index_q [T, Hi*Di])``; k and v go into the KV cache,
    index_k into the index cache, none of them is materialised.

    Per head of q and k (width D) and of index_q and index_k (width Di), with its own weight::

        y = x * rsqrt(mean(x^2) + eps) * (weight_offset + w)      # Gemma (1 + w) by default

    then NeoX (or GPT-J) RoPE of the first ``r = min(R, d)`` features of every head (``d`` its
    group's width), ``cos = row[:r/2]``, ``sin = row[R/2 : R/2 + r/2]`` of the one ``row =
    cos_sin_cache[positions]``. Then for every token ``t`` with ``s = slot_mapping[t] >= 0``
    (``t < N``) and ``u = index_slot_mapping[t] >= 0`` (``t < Ni``)::

        key_cache[s // bs, s % bs, h, :]    = store(k[t, h])
        value_cache[s // bs, s % bs, h, :]  = store(v[t, h])
        index_cache[u // ibs, u % ibs, :]   = store(index_k[t])

    ``bs`` and ``ibs`` the block sizes of the caches (they may differ). ``store`` rounds to the
    cache's dtype; an FP8 cache stores ``e4m3(clamp(x / scale, -448, 448))``, an E5M2 one
    ``e5m2(clamp(x / scale, -57344, 57344))`` (``k_scale`` / ``v_scale`` for the KV cache,
    default 1, ignored with a model-dtype KV cache as vLLM ignores them; the index cache
    takes none, as the peer's). A
    negative slot writes nothing, nor does a token past its mapping's length (``[N]`` and
    ``[Ni]``, at most T: vLLM pads T for CUDA graphs and passes the actual tokens' slots);
    rows no slot names keep their bytes. ``index_q`` is returned
    in the index cache's dtype (FP8: saturated to +-448 as E4M3, to +-57344 as E5M2), q in
    qkv's.

    The index heads come from the row after v, or from ``index_qkv`` (a separate projection,
    no concatenation). **The caches are updated in place** (donated, as
    :func:`fqr.split_qkv_rmsnorm_rope_cache`). The reference it matches is
    :func:`fqr.reference.index_cache_prologue`. ``numerics="unfused"`` rounds where the model's
    ``GemmaRMSNorm`` / ``rotary_emb`` chain does (k rounded to qkv's dtype before its store).

    Example (CPU tensors: ``backend="auto"`` runs the reference backend)::

        >>> import torch, fqr
        >>> from fqr.rope_cache import rope_cos_sin_cache
        >>> table = rope_cos_sin_cache(32, 4096, 5e6)  # rotary_dim 32 of head_dim 64
        >>> hq, hkv, d, hi, di = 4, 2, 64, 2, 48  # index heads narrower than the main ones
        >>> qkv = torch.randn(2, (hq + 2 * hkv) * d + (hi + 1) * di, dtype=torch.bfloat16)
        >>> w, wi = torch.zeros(d, dtype=torch.bfloat16), torch.zeros(di, dtype=torch.bfloat16)
        >>> key_cache = torch.zeros(2, 16, hkv, d, dtype=torch.bfloat16)  # 2 blocks of 16
        >>> value_cache = torch.zeros_like(key_cache)
        >>> index_cache = torch.zeros(2, 8, di, dtype=torch.bfloat16)  # its own blocks of 8
        >>> q, index_q = fqr.split_qkv_index_rmsnorm_rope_cache(
        ...     qkv, torch.tensor([0, 9]), table, w, w, wi, wi, key_cache, value_cache,
        ...     index_cache, torch.tensor([3, 20]), torch.tensor([1, 12]), num_heads=hq,
        ...     num_kv_heads=hkv, head_dim=d, num_index_heads=hi, index_head_dim=di)
        >>> q.shape, index_q.shape
        (torch.Size([2, 256]), torch.Size([2, 96]))
        >>> v = qkv[:, (hq + hkv) * d : (hq + 2 * hkv) * d]  # v is stored as it is
        >>> torch.equal(value_cache[1, 4].flatten(), v[1])
        True
    """,
)

split_qkv_index_rmsnorm_rope_cache = SPLIT_QKV_INDEX_RMSNORM_ROPE_CACHE.function


# --------------------------------------------------- vllm-ascend's call, as its callers write it


def _actual_slots(name: str, slots, num_actual_tokens: int):
    """The first ``num_actual_tokens`` entries of ``slots`` (a view: the op takes a mapping
    shorter than T and stores nothing for the tokens past it)."""
    check_tensor(name, slots)
    if slots.dim() != 1 or slots.shape[0] < num_actual_tokens:
        raise ValueError(
            f"{name} must be 1-D with at least num_actual_tokens = {num_actual_tokens} "
            f"entries, got shape {list(slots.shape)}"
        )
    return slots[:num_actual_tokens]


def minimax_qknorm_rope_cache(
    packed: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    index_q_weight: torch.Tensor,
    index_k_weight: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    index_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    index_slot_mapping: torch.Tensor,
    num_actual_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    num_index_heads: int,
    eps: float,
    index_packed: torch.Tensor | None = None,
    *,
    numerics: str = "fused",
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """vllm-ascend's ``minimax_qknorm_rope_cache(packed, cos_sin_cache, positions, q_weight,
    k_weight, index_q_weight, index_k_weight, key_cache, value_cache, index_cache,
    slot_mapping, index_slot_mapping, num_actual_tokens, num_q_heads, num_kv_heads,
    num_index_heads, eps, index_packed=None)``, run as
    :func:`fqr.split_qkv_index_rmsnorm_rope_cache` (its math and checks): Gemma ``(1 + w)``
    norms, NeoX RoPE, ``head_dim`` = ``index_head_dim`` = the length of ``q_weight`` (the
    peer's rule). Tokens ``t >= num_actual_tokens`` (graph padding) store nothing; the slot
    mappings need only their first ``num_actual_tokens`` entries (vLLM's slot mapping of the
    actual tokens). Returns ``(q, index_q)``."""
    check_tensor("packed", packed)
    check_tensor("q_weight", q_weight)
    if packed.dim() != 2:
        raise ValueError(f"packed must be 2-D [T, width], got shape {list(packed.shape)}")
    if q_weight.dim() != 1:
        raise ValueError(f"q_weight must be 1-D [head_dim], got shape {list(q_weight.shape)}")
    tokens, head_dim = packed.shape[0], q_weight.shape[0]
    if (
        not isinstance(num_actual_tokens, int)
        or isinstance(num_actual_tokens, bool)
        or not 0 <= num_actual_tokens <= tokens
    ):
        raise ValueError(
            f"num_actual_tokens must be an int in [0, T = {tokens}], got {num_actual_tokens!r}"
        )
    slots = _actual_slots("slot_mapping", slot_mapping, num_actual_tokens)
    index_slots = _actual_slots("index_slot_mapping", index_slot_mapping, num_actual_tokens)
    return split_qkv_index_rmsnorm_rope_cache(
        packed,
        positions,
        cos_sin_cache,
        q_weight,
        k_weight,
        index_q_weight,
        index_k_weight,
        key_cache,
        value_cache,
        index_cache,
        slots,
        index_slots,
        num_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_index_heads=num_index_heads,
        index_head_dim=head_dim,
        eps=eps,
        is_neox=True,
        weight_offset=1.0,
        index_qkv=index_packed,
        numerics=numerics,
        backend=backend,
    )


# ------------------------------------------------------------------------- the variant


def _check_preset(variant: Variant, preset) -> None:
    params.check_index_head_dim(preset)
    params.check_paged_cache_preset(variant, preset)


def _draw(variant, preset, tokens, dtype, generator, *, max_position, positions_dtype, bias):
    """MiniMax-M3's row (v with outliers past +-448), positions and weights
    (:func:`fqr.inputs.random_index_row`), then random-valued caches of twice the rows the
    tokens need (a stray write shows), the KV cache's and the index cache's own slot mappings
    (distinct slots, every third one padding, at other tokens), per-tensor scales for an FP8
    KV cache."""
    kw = params.index_head_kwargs(preset)
    spec, di, bs = preset.spec, kw["index_head_dim"], preset.params["block_size"]
    drawn = random_index_row(
        spec, tokens, kw["num_index_heads"], di, dtype, generator, max_position=max_position,
        positions_dtype=positions_dtype,
    )  # fmt: skip
    cache_dtype = params.CACHE_DTYPE_NAMES[preset.params["cache_dtype"]] or dtype
    blocks = -(-2 * tokens // bs) + 1  # twice the rows the tokens need, plus a block
    kv_entry = (bs, spec.num_kv_heads, spec.head_dim)
    drawn["key_cache"] = random_paged_cache(blocks, kv_entry, cache_dtype, generator)
    drawn["value_cache"] = random_paged_cache(blocks, kv_entry, cache_dtype, generator)
    drawn["index_cache"] = random_paged_cache(blocks, (bs, di), cache_dtype, generator)
    drawn["slot_mapping"] = random_slot_mapping(tokens, blocks * bs, generator)
    drawn["index_slot_mapping"] = random_slot_mapping(
        tokens, blocks * bs, generator, padding_from=2
    )
    if cache_dtype in (FP8_E4M3, FP8_E5M2):
        drawn |= random_fp8_scales(generator)
    return drawn


def _peer_kwargs(preset) -> dict:
    """What the peer takes besides the spec: the indexer heads."""
    return {k: v for k, v in params.index_head_kwargs(preset).items() if "index" in k}


# MiniMax-M3's whole sparse-attention prologue with its caches: bf16 and FP8 caches (the FP8
# index cache returns index_q in FP8), each cache with its own slot mapping.
INDEX_CACHE = register_variant(
    Variant(
        "index-cache",
        SPLIT_QKV_INDEX_RMSNORM_ROPE_CACHE,
        kwargs=params.index_head_kwargs,
        draw_inputs=_draw,
        eager_chain=spec_chain(minimax_index_cache_prologue, _peer_kwargs),
        params=("index_head_dim", *params.PAGED_CACHE_FIELDS),
        check_preset=_check_preset,
        golden=(
            CaseSpec("minimax-m3-index-cache", "bf16", 7, tp=8),
            CaseSpec("minimax-m3-index-cache-fp8", "bf16", 7, tp=8),
        ),
    )
)
