"""``split_mla_rmsnorm_rope_cache``: the Multi-head Latent Attention KV prologue (DeepSeek-V2/V3/R1,
V3.2, Kimi-K2) in one kernel: split the fused ``q_a`` / ``kv_a`` projection row, RMS-normalise
``q_c`` and ``kv_c``, rotate ``k_pe``, write ``[kv_c | k_pe]`` into the paged MLA cache.

vLLM (``vllm/model_executor/layers/mla.py``, ``MultiHeadLatentAttentionWrapper.forward``)::

    q_c, kv_lora = fused_qkv_a_proj(hidden).split([q_lora_rank, kv_lora_rank + rope])
    q_c = q_a_layernorm(q_c)                         # RMSNorm over the 1536
    kv_c, k_pe = kv_lora.split([kv_lora_rank, rope])
    kv_c_normed = kv_a_layernorm(kv_c)               # RMSNorm over the 512
    ..., k_pe = rotary_emb(positions, ..., k_pe)     # one 64-wide head, GPT-J pairs, YaRN table
    # then the attention backend: concat_and_cache_mla(kv_c_normed, k_pe, kv_cache, slots, ...)

``concat_and_cache_mla`` (``csrc/cache_kernels.cu``) stores ``[kv_c | k_pe]`` at slot ``s`` of a
``[num_blocks, block_size, kv_lora_rank + rope]`` cache in the model dtype, or as FP8 E4M3 with a
per-tensor scale (``e4m3(clamp(x / k_scale, +-448))``); ``concat_and_cache_ds_mla`` writes
DeepSeek-V3.2's ``fp8_ds_mla`` entry into a ``uint8 [num_blocks, block_size, 656]`` cache: the 512
kv_c values as E4M3 in four tiles of 128, each divided by its own ``scale = max(amax / 448,
FLT_MIN)`` (float32, computed in the kernel), the four scales, then the 64 rope values in bf16.
DeepSeek-V2-Lite has no ``q_lora_rank``: the row is ``[kv_c | k_pe]`` and there is no ``q_c``.

The composition (:func:`mla_kv_prologue`) is ``split_heads`` -> ``rms_norm`` x 2 -> ``rope`` ->
the cache stores of the cache's flavour (:func:`fqr.ops.cache_insert` at a column,
:func:`fqr.ops.cache_insert_fp8_tiles`, :func:`fqr.ops.cache_insert_bytes`); the float64
reference is :func:`mla_kv_reference` (:func:`fqr.reference.mla_kv`,
:func:`fqr.reference.mla_cache_entry`, :func:`fqr.reference.ds_mla_entry`). The variant
``mla-kv`` binds the DeepSeek / Kimi presets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .. import ops, reference
from ..core import DTYPE_NAMES, Section
from ..inputs import random_heads, random_positions, random_slot_mapping
from ..ops.fp8 import FP8_E4M3 as FP8
from ..ops.fp8 import FP8_E5M2
from ..unfused import vllm_rms_norm, vllm_rotary_embedding
from ..validate import check_positive_int
from . import params
from .blocks import complex_rope_round_to, round_to
from .declare import (
    BACKEND,
    Cache,
    Call,
    Output,
    Rows,
    Scale,
    Static,
    Tensor,
    Vector,
    declare,
    numerics,
    positive_int,
)
from .variant import CaseSpec, Variant, register_variant

TILE = 128  # fp8_ds_mla: one float32 scale per 128 kv_c values (vLLM's)
BYTES = torch.uint8
DS_MLA = "fp8_ds_mla"
# The MLA cache layouts a program stores, by vLLM's kv_cache_dtype names ('fp8' is spelled
# 'fp8_e4m3': one program for both names): the composition's static ``kv_cache_dtype``
LAYOUTS = ("auto", "fp8_e4m3", "fp8_e5m2", DS_MLA)


def ds_mla_entry_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of an ``fp8_ds_mla`` entry: E4M3 values, a float32 scale per tile, bf16 rope."""
    return kv_lora_rank + 4 * (kv_lora_rank // TILE) + 2 * rope_dim


# ------------------------------------------------------------------------ the composition


def mla_kv_prologue(
    kv_a, positions, cos_sin_cache, q_a_weight, kv_a_weight, kv_cache, slot_mapping, k_scale,
    quant_scale_q, kpe_cache, **s,
):  # fmt: skip
    """Split ``[q_c | kv_c | k_pe]``, norm q_c and kv_c over their widths, rotate k_pe, store
    ``[kv_c | k_pe]`` into the cache (traced into one program): returns ``(q_c, kv_c, k_pe, new
    kv_cache)``, without ``q_c`` when ``q_lora_rank`` is 0. ``numerics="unfused"`` rounds to the
    model dtype where vLLM's ``RMSNorm.forward_native`` and rotary code round (an
    ``fp8_ds_mla`` tile's max is then taken over the rounded kv_c, as vLLM's cache kernel
    takes it over ``kv_c_normed``); ``"unfused-hf"`` as transformers' DeepSeek-V2: the norms
    as ``"unfused"``, k_pe's rotation an fp32 complex product rounded once
    (:func:`fqr.prologue.blocks.complex_rope_round_to`)."""
    q_lora_rank, kv_lora_rank, rope_dim = s["q_lora_rank"], s["kv_lora_rank"], s["qk_rope_head_dim"]
    eps, layout = s["eps"], s["kv_cache_dtype"]
    # fp8_ds_mla quantizes kv_c tile by tile: held as heads of one tile (its norm over the whole
    # width is then a reduction over the row of those heads)
    kv_heads = kv_lora_rank // TILE if layout == DS_MLA else 1
    sections = [Section(1, q_lora_rank, 0)] if q_lora_rank else []
    sections += [
        Section(kv_heads, kv_lora_rank // kv_heads, q_lora_rank),
        Section(1, rope_dim, q_lora_rank + kv_lora_rank),
    ]
    *q_c, kv_c, k_pe = ops.split_heads(kv_a, sections)
    rounding = round_to(kv_a, s["numerics"])
    kv_c = ops.rms_norm(kv_c, kv_a_weight, eps=eps, group_size=kv_lora_rank, round_to=rounding)
    k_pe = ops.rope(
        k_pe,
        positions,
        cos_sin_cache,
        head_dim=rope_dim,
        is_neox=s["is_neox"],
        round_to=complex_rope_round_to(kv_a, s["numerics"]),
    )
    caches = mla_cache_stores(
        kv_cache, kv_c, k_pe, slot_mapping, k_scale, rope_dtype=kv_a.dtype, kpe_cache=kpe_cache,
        kv_cache_dtype=layout,
    )  # fmt: skip
    if not q_lora_rank:
        return kv_c, k_pe, *caches
    q_c = ops.rms_norm(q_c[0], q_a_weight, eps=eps, group_size=q_lora_rank, round_to=rounding)
    if quant_scale_q is not None:  # FP8 q_c for an FP8 q_b_proj: fp8(clamp(q_c * scale))
        q_c = ops.quantize_fp8(q_c, quant_scale_q, multiply=True, dtype=s["quantize_dtype"])
    return q_c, kv_c, k_pe, *caches


def mla_cache_stores(
    kv_cache, kv_c, k_pe, slot_mapping, scale, *, rope_dtype, kv_cache_dtype: str, kpe_cache=None
):
    """``[kv_c | k_pe]`` stored into the paged MLA cache (traced; returns the new caches), the
    layout told by ``kv_cache_dtype`` (vLLM's name, as the call declares it: never by the
    operand's dtype, since a uint8 operand is either layout): ``'auto'`` / ``'fp8_e4m3'`` /
    ``'fp8_e5m2'`` are ``concat_and_cache_mla``, two :func:`fqr.ops.cache_insert` at columns
    0 and ``kv_lora_rank`` in the cache's dtype (FP8: the per-tensor ``scale``; E5M2: the
    uint8 operand holds float8_e5m2 bytes, ``encoding="e5m2"``), at any latent width;
    ``'fp8_ds_mla'`` is ``concat_and_cache_ds_mla``, :func:`fqr.ops.cache_insert_fp8_tiles`
    of kv_c (held as heads of one tile) then k_pe as ``rope_dtype`` values
    (:func:`fqr.ops.cache_insert_bytes`); with ``kpe_cache`` FlashInfer's two caches, kv_c
    into ``kv_cache`` (its ``ckv_cache``) and k_pe into ``kpe_cache``, one
    :func:`fqr.ops.cache_insert` each."""
    if kv_cache_dtype not in LAYOUTS:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(LAYOUTS)}, got {kv_cache_dtype!r}"
        )
    encoding = "e5m2" if kv_cache_dtype == "fp8_e5m2" else None
    kv_lora_rank = kv_c.shape[1]
    if kpe_cache is not None:
        return (
            ops.cache_insert(kv_cache, kv_c, slot_mapping, scale, column=0, encoding=encoding),
            ops.cache_insert(kpe_cache, k_pe, slot_mapping, scale, column=0, encoding=encoding),
        )
    if kv_cache_dtype == DS_MLA:
        cache = ops.cache_insert_fp8_tiles(
            kv_cache, kv_c, slot_mapping, tile=TILE, offset=0, scale_offset=kv_lora_rank
        )
        rope_at = kv_lora_rank + 4 * (kv_lora_rank // TILE)
        cache = ops.cache_insert_bytes(cache, k_pe, slot_mapping, offset=rope_at, dtype=rope_dtype)
        return (cache,)
    cache = ops.cache_insert(kv_cache, kv_c, slot_mapping, scale, column=0, encoding=encoding)
    last = ops.cache_insert(
        cache, k_pe, slot_mapping, scale, column=kv_lora_rank, encoding=encoding
    )
    return (last,)


def mla_cache_expected(
    kv_cache, kv_c, k_pe, slot_mapping, *, scale=None, rope_dtype, kv_cache_dtype: str,
    kpe_cache=None,
) -> tuple:  # fmt: skip
    """float64 expectation of :func:`mla_cache_stores`, the layout told by ``kv_cache_dtype``
    (vLLM's name): :func:`fqr.reference.mla_cache_entry` (a uint8 cache of a per-tensor FP8
    ``kv_cache_dtype`` read as the float8 values it holds by the caller first; FlashInfer's
    two caches as the two parts of one entry) at any latent width, or for ``'fp8_ds_mla'``
    :func:`fqr.reference.ds_mla_entry` packed with the cache's other entries decoded."""
    if kpe_cache is not None:  # [ckv | kpe] is the one entry's layout: expected, then cut
        bytes_of = [c.contiguous().view(BYTES) for c in (kv_cache, kpe_cache)]
        both = torch.cat(bytes_of, dim=-1).view(kv_cache.dtype)
        cache, _ = reference.mla_cache_entry(both, kv_c, k_pe, slot_mapping, scale=scale)
        width = kv_cache.shape[-1]
        return cache[..., :width].contiguous(), cache[..., width:].contiguous()
    if kv_cache_dtype == DS_MLA:
        entry = reference.ds_mla_entry(
            kv_cache, kv_c, k_pe, slot_mapping, tile=TILE, rope_dtype=rope_dtype
        )
        return (entry.packed(kv_cache),)
    cache, _ = reference.mla_cache_entry(kv_cache, kv_c, k_pe, slot_mapping, scale=scale)
    return (cache,)


@dataclass(frozen=True)
class KpeCache(Cache):
    """FlashInfer's ``kpe_cache [num_blocks, block_size, rope]``: ``kv_cache``'s blocks, block
    size and dtype (a uint8 FP8 pair read as the float8 values its ``kv_cache_dtype`` names)."""

    def viewed_as(self, x, call):
        return params.fp8_cache_view(x, cache_dtype_name(call))


# The kv_cache_dtype an MLA cache of each dtype is (an op without the argument): vLLM's names
DTYPE_CACHE_NAMES = {FP8: "fp8", FP8_E5M2: "fp8_e5m2", BYTES: "fp8_ds_mla"}


def cache_dtype_name(call: Call) -> str:
    """vLLM's ``kv_cache_dtype`` of the call's MLA cache: the argument where the op takes one,
    else what the cache's dtype says (``auto`` for the model dtype)."""
    name = getattr(call, "kv_cache_dtype", None)
    return name or DTYPE_CACHE_NAMES.get(call.kv_cache.dtype, "auto")


@dataclass(frozen=True)
class MlaCache(Cache):
    """The paged MLA cache: a per-tensor FP8 one enters the program as
    :func:`fqr.prologue.params.fp8_cache_view` says (E4M3 as float8_e4m3fn, vLLM's uint8
    allocation viewed so; E5M2 as its bytes), an ``fp8_ds_mla`` one as the bytes it is."""

    def viewed_as(self, x, call):
        return params.fp8_cache_view(x, cache_dtype_name(call))


def cache_statics(call: Call) -> dict:
    """The composition's ``kv_cache_dtype``: the cache's layout as the call declares it
    (:func:`cache_dtype_name`; ``'fp8'`` spelled ``'fp8_e4m3'``), which the stores read
    (:func:`mla_cache_stores`): a uint8 operand is E5M2 bytes or the ``fp8_ds_mla`` entry,
    and only the declared name tells them apart."""
    name = cache_dtype_name(call)
    return {"kv_cache_dtype": "fp8_e4m3" if name == "fp8" else name}


def two_caches_agree(call: Call) -> None:
    """``kpe_cache`` (when given) has ``kv_cache``'s blocks and dtype; the ``fp8_ds_mla``
    byte entry has no second cache."""
    kpe, kv = call.kpe_cache, call.kv_cache
    if kpe is None:
        return
    if kpe.shape[0] != kv.shape[0] or kpe.dtype != kv.dtype:
        raise ValueError(
            f"kpe_cache ({DTYPE_NAMES.get(kpe.dtype)} {list(kpe.shape)}) must have kv_cache's "
            f"blocks and dtype ({DTYPE_NAMES.get(kv.dtype)} {list(kv.shape)})"
        )


def kpe_cache_param(rope: Callable[[Call], int]) -> Tensor:
    """FlashInfer's second MLA cache, the rope part (``rope(call)`` wide), donated."""

    def entry(call: Call):
        bs, r = call.kv_cache.shape[1], rope(call)
        return (bs, r), f"[num_blocks, block_size = {bs} (kv_cache's), {r}] (k_pe's width)"

    return Tensor(
        "kpe_cache",
        None,
        annotation=params.OPTIONAL_TENSOR,
        kind=KpeCache(
            shape=entry,
            dtypes=lambda call: (call.kv_cache.dtype,),
            dtype_text=lambda call: f"kv_cache's dtype {DTYPE_NAMES.get(call.kv_cache.dtype)}",
            last="the entry",
        ),
        optional=True,
        donated=True,
        doc="FlashInfer's paged MLA layout in two caches: given, ``kv_cache`` is its "
        "``ckv_cache [num_blocks, block_size, kv_lora_rank]`` (kv_c) and this its ``kpe_cache "
        "[num_blocks, block_size, qk_rope_head_dim]`` (k_pe), same blocks and dtype (not "
        "fp8_ds_mla), updated in place",
    )


KPE_CACHE = kpe_cache_param(lambda call: call.qk_rope_head_dim)


def mla_kv_reference(
    kv_a, positions, cos_sin_cache, q_a_weight, kv_a_weight, kv_cache, slot_mapping, *,
    q_lora_rank, kv_lora_rank, eps=1e-6, is_neox=False, k_scale=None, quant_scale_q=None,
    quantize_dtype=None, kpe_cache=None,
):  # fmt: skip
    """float64 ``(q_c, kv_c, k_pe, expected kv_cache)`` (no ``q_c`` without ``q_lora_rank``):
    :func:`fqr.reference.mla_kv`, then the cache written as ``concat_and_cache_mla``
    (:func:`fqr.reference.mla_cache_entry`) or ``concat_and_cache_ds_mla``
    (:func:`fqr.reference.ds_mla_entry`, packed with the cache's other entries decoded)."""
    q_c, kv_c, k_pe = reference.mla_kv(
        kv_a,
        positions,
        cos_sin_cache,
        q_a_weight,
        kv_a_weight,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=kv_lora_rank,
        eps=eps,
        is_neox=is_neox,
    )
    caches = mla_cache_expected(
        kv_cache, kv_c, k_pe, slot_mapping, scale=k_scale, rope_dtype=kv_a.dtype,
        kv_cache_dtype=DTYPE_CACHE_NAMES.get(kv_cache.dtype, "auto"), kpe_cache=kpe_cache,
    )  # fmt: skip
    if quant_scale_q is not None:  # what the FP8 store of q_c rounds
        factor = quant_scale_q.detach().to(torch.float64).reshape(())
        q_c = reference.saturate_fp8(q_c * factor, None, quantize_dtype or FP8)
    return (*((q_c,) if q_lora_rank else ()), kv_c, k_pe, *caches)


# --------------------------------------------------------------------------- the checks


def _row_width(call: Call) -> tuple[int, str]:
    q, kv, r = call.q_lora_rank, call.kv_lora_rank, call.qk_rope_head_dim
    width = q + kv + r
    return width, f"q_lora_rank + kv_lora_rank + qk_rope_head_dim = {q} + {kv} + {r} = {width}"


def _ranks(call: Call) -> None:
    if type(call.q_lora_rank) is not int or call.q_lora_rank < 0:
        raise ValueError(
            f"q_lora_rank must be an int >= 0 (0: no q_c, DeepSeek-V2-Lite), "
            f"got {call.q_lora_rank!r}"
        )
    if (call.q_a_weight is None) != (call.q_lora_rank == 0):
        raise ValueError(
            "q_a_weight is required with q_lora_rank > 0 and must be None with q_lora_rank 0"
        )
    if call.quant_scale_q is not None and call.q_lora_rank == 0:
        raise ValueError("quant_scale_q quantizes q_c: it needs q_lora_rank > 0")
    params.check_quantize_dtype_needs_scale(call, "quant_scale_q")


def _entry(call: Call):
    """The cache entry the flavour needs (after the blocks), and how it is made."""
    kv, r = call.kv_lora_rank, call.qk_rope_head_dim
    if call.kpe_cache is not None:
        return (None, kv), f"[num_blocks, block_size, kv_lora_rank = {kv}] (with kpe_cache)"
    if isinstance(call.kv_cache, torch.Tensor) and call.kv_cache.dtype == BYTES:
        size = ds_mla_entry_bytes(kv, r)
        text = (
            f"[num_blocks, block_size, {size}] (fp8_ds_mla: kv_lora_rank E4M3 bytes + 4 bytes "
            f"per {TILE}-value tile + 2 * qk_rope_head_dim bf16 bytes)"
        )
        return (None, size), text
    return (None, kv + r), f"[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim = {kv + r}]"


def _cache_dtypes(call: Call):
    return (call.kv_a.dtype, FP8, FP8_E5M2, BYTES)


def _cache_dtype_text(call: Call) -> str:
    return (
        f"kv_a's dtype {DTYPE_NAMES.get(call.kv_a.dtype)}, fp8e4m3 (kv_cache_dtype 'fp8'), "
        f"fp8e5m2 ('fp8_e5m2') or uint8 ('fp8_ds_mla')"
    )


def _flavour(call: Call) -> None:
    """What the cache's dtype asks of the call."""
    if call.cos_sin_cache.shape[1] != call.qk_rope_head_dim:
        raise ValueError(
            f"cos_sin_cache width {call.cos_sin_cache.shape[1]} must be qk_rope_head_dim "
            f"{call.qk_rope_head_dim} (k_pe is rotated whole)"
        )
    if call.kv_cache.dtype == BYTES:
        check_ds_mla_call(call, "kv_a", call.kv_a, call.kv_lora_rank, "kv_lora_rank")


def _reads_k_scale(call: Call) -> bool:
    """Whether the program reads k_scale: a per-tensor FP8 cache's (E4M3 or E5M2)."""
    return call.kv_cache.dtype in (FP8, FP8_E5M2)


K_SCALE_WHAT = (
    "the per-tensor scale of a float8_e4m3fn or float8_e5m2 kv_cache, vLLM's kv_cache_dtype "
    + ", ".join(repr(name) for name in params.FP8_KV_CACHE_DTYPES)
)


def check_ds_mla_call(call: Call, name: str, rows, width: int, width_name: str) -> None:
    """What an ``fp8_ds_mla`` cache asks of a call: no second cache (the byte entry is one),
    16-bit rows ``name`` (the rope part is stored in the model dtype; vLLM's
    ``concat_and_cache_ds_mla`` checks ``itemsize() == 2``), kv_c of whole tiles (``width``,
    the message's ``width_name``)."""
    if call.kpe_cache is not None:
        raise ValueError("kpe_cache: the fp8_ds_mla (uint8) entry has no second cache")
    if rows.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(
            f"an fp8_ds_mla (uint8) kv_cache holds its rope part in the model dtype, 16 bits: "
            f"{name} must be bf16 or fp16, got {DTYPE_NAMES.get(rows.dtype)}"
        )
    if width % TILE:
        raise ValueError(f"{width_name} {width} is not a multiple of the fp8_ds_mla tile {TILE}")


def _returns(call: Call, outs: tuple):
    return outs if call.q_lora_rank else (None, *outs)


# ----------------------------------------------------------------------- the declaration

SPLIT_MLA_RMSNORM_ROPE_CACHE = declare(
    "split_mla_rmsnorm_rope_cache",
    mla_kv_prologue,
    (
        params.positional(
            "kv_a",
            Rows(width=_row_width),
            doc="``[T, q_lora_rank + kv_lora_rank + qk_rope_head_dim]``: the fused q_a / kv_a "
            "projection row ``[q_c | kv_c | k_pe]`` (``[kv_c | k_pe]`` without q_lora_rank), "
            "bf16/fp16/fp32",
        ),
        params.positions_of("kv_a"),
        params.mla_cos_sin_cache(lambda call: call.qk_rope_head_dim, "qk_rope_head_dim"),
        Tensor(
            "q_a_weight",
            keyword=False,
            annotation=params.OPTIONAL_TENSOR,
            kind=Vector(length=lambda call: call.q_lora_rank, what="q_lora_rank"),
            optional=True,
            doc="``[q_lora_rank]`` weight of q_a_layernorm (None without q_lora_rank)",
        ),
        params.positional(
            "kv_a_weight",
            Vector(length=lambda call: call.kv_lora_rank, what="kv_lora_rank"),
            doc="``[kv_lora_rank]`` weight of kv_a_layernorm",
        ),
        params.positional(
            "kv_cache",
            MlaCache(
                shape=_entry,
                dtypes=_cache_dtypes,
                dtype_text=_cache_dtype_text,
                last="the entry",
            ),
            donated=True,
            doc="the paged MLA cache, updated in place: ``[num_blocks, block_size, kv_lora_rank "
            "+ qk_rope_head_dim]`` in kv_a's dtype, float8_e4m3fn or float8_e5m2 (vLLM's "
            "'auto' / 'fp8' / 'fp8_e5m2'), or uint8 ``[num_blocks, block_size, 656]`` "
            "(DeepSeek-V3.2's 'fp8_ds_mla'); any strides with a contiguous last dim",
        ),
        params.short_slot_mapping(
            "kv_cache", "kv_a", note=", their q_c, kv_c and k_pe still returned"
        ),
        Static(
            "q_lora_rank",
            annotation="int",
            check=lambda name, value: None,  # 0 allowed: _ranks
            schema="int",
            doc="width of q_c (DeepSeek-V3: 1536; 0: no q_c, DeepSeek-V2-Lite)",
        ),
        Static(
            "kv_lora_rank",
            annotation="int",
            check=positive_int,
            schema="int",
            doc="width of kv_c, the latent (512)",
        ),
        Static(
            "qk_rope_head_dim",
            64,
            annotation="int",
            check=positive_int,
            schema="int",
            doc="width of k_pe, the one rotated key head (64)",
        ),
        params.EPS,
        params.DEEPSEEK_IS_NEOX,
        Tensor(
            "k_scale",
            None,
            annotation=params.OPTIONAL_TENSOR,
            kind=Scale(used=_reads_k_scale, what=K_SCALE_WHAT),
            optional=True,
            doc="float32 ``[1]`` or 0-dim per-tensor scale of a float8_e4m3fn / float8_e5m2 "
            "cache (default 1): stored ``fp8(clamp(x / k_scale, -max, max))``, as "
            "concat_and_cache_mla; with a model-dtype or fp8_ds_mla cache it is ignored, as "
            "vLLM's kernels ignore the ``layer._k_scale`` its MLA backends pass with every "
            "cache (its form is still checked, its value is not read)",
        ),
        params.quant_scale("quant_scale_q", "q_c is returned as FP8 (what an FP8 q_b_proj reads)"),
        KPE_CACHE,
        numerics(),
        params.quantize_dtype("quant_scale_q"),
        BACKEND,
    ),
    (
        Output("q_c", present=lambda call: bool(call.q_lora_rank)),
        Output("kv_c"),
        Output("k_pe", head_dim=lambda s: s["qk_rope_head_dim"]),
        Output("kv_cache", head_dim=lambda s: s["qk_rope_head_dim"]),
        Output(
            "kpe_cache",
            head_dim=lambda s: s["qk_rope_head_dim"],
            present=lambda call: call.kpe_cache is not None,
        ),
    ),
    reference=mla_kv_reference,
    static_checks=(_ranks,),
    checks=(_flavour, two_caches_agree),
    program_statics=cache_statics,
    returns=_returns,
    doc="""
    The Multi-head Latent Attention KV prologue of DeepSeek-V2/V3/R1/V3.2 and Kimi-K2, fused:
    from the fused q_a / kv_a projection row, ``q_c`` and ``kv_c`` RMS-normalised, ``k_pe``
    rotated, and ``[kv_c | k_pe]`` written into the paged MLA cache in place (vLLM's
    ``q_a_layernorm``, ``kv_a_layernorm``, ``rotary_emb`` and ``concat_and_cache_mla`` /
    ``concat_and_cache_ds_mla``). Returns new ``(q_c, kv_c_normed, k_pe)`` (``q_c`` None without
    q_lora_rank): q_c feeds q_b_proj, kv_c and k_pe the prefill path; the cache holds them for
    decode.

    Per token: ``q_c = x * rsqrt(mean(x^2) + eps) * w_q`` over its ``q_lora_rank`` features,
    ``kv_c`` the same over ``kv_lora_rank`` with ``w_kv``, ``k_pe`` rotated by the token's row
    of ``cos_sin_cache`` (GPT-J pairs: DeepSeek's). Then for each of the first N tokens
    (``slot_mapping [N]``, N <= T: vLLM's cache kernels store ``slot_mapping.size(0)`` tokens
    of a batch padded for CUDA graphs) whose slot ``s >= 0``:
    the cache entry ``[s // block_size, s % block_size]`` gets ``[kv_c | k_pe]`` in the
    cache's dtype (float8_e4m3fn: ``e4m3(clamp(x / k_scale, -448, 448))``; float8_e5m2:
    ``e5m2(clamp(x / k_scale, -57344, 57344))``), at any ``kv_lora_rank``; a uint8 cache gets
    the ``fp8_ds_mla`` entry (``kv_lora_rank`` a multiple of 128): kv_c in tiles of 128
    values, each stored as ``e4m3(clamp(x / scale, -448, 448))`` with ``scale = max(max|tile|
    / 448, FLT_MIN)`` (float32, stored after the values), then k_pe as bf16. Entries no slot
    names are left as they are. ``k_scale`` may be given with every cache (vLLM's MLA
    backends pass ``layer._k_scale`` always): an FP8 cache reads it, the others ignore it.
    The reference it matches is :func:`fqr.prologue.mla_kv.mla_kv_reference`.
    ``numerics="unfused"`` rounds where vLLM's native code rounds (each norm and the rotation
    in the model dtype; an ``fp8_ds_mla`` tile's max taken over the rounded kv_c);
    ``"unfused-hf"`` where transformers' DeepSeek-V2 rounds (its norms as ``"unfused"``, the
    rotation an fp32 complex product rounded once).

    With ``quant_scale_q`` (float32 ``[1]`` or 0-dim) q_c is returned as float8_e4m3fn,
    ``e4m3(clamp(q_c * quant_scale_q, -448, 448))`` (FlashInfer's convention for FP8 q: the
    factor multiplies), for an FP8 ``q_b_proj``; with ``quantize_dtype=torch.float8_e5m2`` as
    float8_e5m2, ``e5m2(clamp(q_c * quant_scale_q, -57344, 57344))``.

    Example (DeepSeek-V3's widths: q_lora_rank 1536, kv_lora_rank 512, k_pe 64, the YaRN table of
    ``fqr.get_preset("deepseek-v3").cos_sin_cache()``; CPU tensors run the reference backend)::

        >>> import torch, fqr
        >>> from fqr.rope_cache import rope_cos_sin_cache
        >>> table = rope_cos_sin_cache(64, 4096, 10000.0)  # [4096, 64]: k_pe's rotation
        >>> kv_a = torch.randn(2, 1536 + 512 + 64, dtype=torch.bfloat16)  # [q_c | kv_c | k_pe]
        >>> kv_cache = torch.zeros(4, 64, 512 + 64, dtype=torch.bfloat16)  # 4 blocks of 64
        >>> q_c, kv_c, k_pe = fqr.split_mla_rmsnorm_rope_cache(
        ...     kv_a, torch.tensor([0, 1]), table, torch.ones(1536), torch.ones(512), kv_cache,
        ...     torch.tensor([0, 65]), q_lora_rank=1536, kv_lora_rank=512,
        ... )
        >>> q_c.shape, kv_c.shape, k_pe.shape
        (torch.Size([2, 1536]), torch.Size([2, 512]), torch.Size([2, 64]))
        >>> torch.equal(kv_cache[1, 1], torch.cat([kv_c[1], k_pe[1]]))  # slot 65, in place
        True
    """,
)

split_mla_rmsnorm_rope_cache = SPLIT_MLA_RMSNORM_ROPE_CACHE.function


# ------------------------------------------------------------------------- the variant

MLA_PARAMS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "v_head_dim",
    "block_size",
    "cache_dtype",
)
CACHE_DTYPES = ("auto", *params.FP8_KV_CACHE_DTYPES, "fp8_ds_mla")  # vLLM's names


def check_mla_preset(variant: Variant, preset) -> None:
    p = preset.params
    for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "block_size"):
        try:
            check_positive_int(name, p[name])
        except (TypeError, ValueError) as e:
            raise ValueError(f"preset {preset.name}: {e}") from None
    if type(p["q_lora_rank"]) is not int or p["q_lora_rank"] < 0:
        raise ValueError(f"preset {preset.name}: q_lora_rank must be an int >= 0")
    if p["cache_dtype"] not in CACHE_DTYPES:
        raise ValueError(
            f"preset {preset.name}: cache_dtype must be one of {', '.join(CACHE_DTYPES)}, "
            f"got {p['cache_dtype']!r}"
        )
    if preset.rotary_dim != preset.head_dim:
        raise ValueError(f"preset {preset.name}: an MLA preset's head is its rope part, whole")


def _kwargs(preset) -> dict:
    p = preset.params
    return dict(
        q_lora_rank=p["q_lora_rank"],
        kv_lora_rank=p["kv_lora_rank"],
        qk_rope_head_dim=preset.head_dim,
        eps=preset.eps,
        is_neox=preset.is_neox,
    )


def random_mla_cache(preset, blocks: int, dtype: torch.dtype, generator: torch.Generator):
    """A cache of random entries (an entry written where no slot names it shows): values of
    the cache's dtype; for ``fp8_ds_mla`` well-formed random entries (E4M3 values, positive
    float32 scales, rope values in the 16-bit model dtype, bf16 otherwise)."""
    p, bs = preset.params, preset.params["block_size"]
    kv, r, device = p["kv_lora_rank"], preset.head_dim, generator.device

    def normal(*shape):
        return torch.randn(shape, generator=generator, dtype=torch.float64, device=device)

    if p["cache_dtype"] != "fp8_ds_mla":
        typed = params.FP8_KV_CACHE_DTYPES.get(p["cache_dtype"], dtype)
        return normal(blocks, bs, kv + r).to(typed)
    values = (normal(blocks, bs, kv) * 50).to(FP8).view(BYTES)
    scales = (normal(blocks, bs, kv // TILE).abs() + 0.01).float().view(BYTES)
    rope_dtype = dtype if dtype == torch.float16 else torch.bfloat16
    rope = normal(blocks, bs, r).to(rope_dtype).view(BYTES)
    return torch.cat([values, scales, rope], dim=-1).contiguous()


def _draw(variant, preset, tokens, dtype, generator, *, max_position, positions_dtype, bias):
    """The row (q_c, kv_c in tiles of different magnitudes, k_pe), positions (the table's
    ends covered), the two norm weights, a cache of twice the entries the tokens need (a
    block at least), slots with every third one negative (padding), a per-tensor scale for an
    FP8 cache."""
    p = preset.params
    q, kv, r = p["q_lora_rank"], p["kv_lora_rank"], preset.head_dim
    device = generator.device
    q_c = random_heads(tokens, 1, q, dtype, generator) if q else None
    tiles = kv // TILE if kv % TILE == 0 else 1  # tiles of different magnitudes
    kv_c = random_heads(tokens, tiles, kv // tiles, dtype, generator)
    k_pe = random_heads(tokens, 1, r, dtype, generator)
    kv_a = torch.cat([x for x in (q_c, kv_c, k_pe) if x is not None], dim=1)
    positions = random_positions(
        tokens, max_position, generator, dtype=positions_dtype, cover_ends=True
    )

    def weight(n):
        noise = torch.randn(n, generator=generator, dtype=torch.float64, device=device)
        return (1 + 0.2 * noise).to(dtype)

    bs = p["block_size"]
    blocks = max(1, -(-2 * tokens // bs))  # twice the entries the tokens need, one block at least
    cache = random_mla_cache(preset, blocks, dtype, generator)
    slots = random_slot_mapping(tokens, blocks * bs, generator)
    drawn = {
        "kv_a": kv_a,
        "positions": positions,
        **({"q_a_weight": weight(q)} if q else {}),
        "kv_a_weight": weight(kv),
        "kv_cache": cache,
        "slot_mapping": slots,
    }
    if p["cache_dtype"] in params.FP8_KV_CACHE_DTYPES:  # values past +-max / scale: clamped
        scale = torch.rand(1, generator=generator, dtype=torch.float64, device=device)
        drawn["k_scale"] = (0.004 + 0.004 * scale).float()
    return drawn


def vllm_mla_kv(
    inputs: dict,
    cos_sin_cache: torch.Tensor,
    *,
    q_lora_rank,
    kv_lora_rank,
    qk_rope_head_dim,
    eps,
    is_neox,
    cache_dtype,
):
    """The model's own unfused chain, as vLLM's ``MultiHeadLatentAttentionWrapper.forward`` and
    its attention backend write it: ``split``, ``q_a_layernorm`` / ``kv_a_layernorm``
    (``RMSNorm.forward_native``), ``rotary_emb`` on k_pe (``forward_native``, the table held in
    the model dtype), then ``concat_and_cache_mla`` / ``concat_and_cache_ds_mla`` as torch
    stores into the given cache (updated in place). Returns ``(q_c, kv_c, k_pe, kv_cache)``."""
    kv_a, positions, slots = inputs["kv_a"], inputs["positions"], inputs["slot_mapping"]
    cache = inputs["kv_cache"]
    q_c, kv_c, k_pe = kv_a.split([q_lora_rank, kv_lora_rank, qk_rope_head_dim], dim=-1)
    kv_c = vllm_rms_norm(kv_c, inputs["kv_a_weight"], eps)
    _, k_pe = vllm_rotary_embedding(positions, k_pe, k_pe, qk_rope_head_dim, cos_sin_cache, is_neox)
    vllm_concat_and_cache_mla(kv_c, k_pe, cache, slots, cache_dtype, inputs.get("k_scale"))
    outs = (kv_c, k_pe, cache)
    return (vllm_rms_norm(q_c, inputs["q_a_weight"], eps), *outs) if q_lora_rank else outs


def vllm_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale):
    """vLLM's ``concat_and_cache_mla`` / ``concat_and_cache_ds_mla`` as torch stores into
    ``kv_cache`` (in place): the first ``N = slot_mapping.size(0)`` tokens, a negative slot
    none; ``"fp8_ds_mla"``: per 128-value tile ``scale = max(amax / 448, FLT_MIN)``, the
    values ``e4m3(clamp(x / scale))``, the scales, then k_pe's 16-bit bits; an FP8
    ``kv_cache_dtype`` (a float8_e4m3fn cache or its uint8 bytes): ``e4m3(clamp(x /
    scale))`` of ``[kv_c | k_pe]``; ``"auto"``: the values as they are."""
    keep = slot_mapping >= 0
    n = slot_mapping.shape[0]
    rows = kv_cache.view(-1, kv_cache.shape[-1])
    kv_c, k_pe, slots = kv_c[:n][keep], k_pe[:n][keep], slot_mapping[keep]
    if kv_cache_dtype == "fp8_ds_mla":
        tiles = kv_c.float().view(kv_c.shape[0], -1, TILE)
        tile_scale = (tiles.abs().amax(dim=-1) / 448.0).clamp_min(torch.finfo(torch.float32).tiny)
        values = (tiles / tile_scale[..., None]).clamp(-448.0, 448.0).to(FP8).view(BYTES)
        rope = k_pe.contiguous().view(BYTES)
        rows[slots] = torch.cat([values.flatten(1), tile_scale.view(BYTES), rope], dim=-1)
        return
    entry = torch.cat([kv_c, k_pe], dim=-1)
    typed = params.FP8_KV_CACHE_DTYPES.get(kv_cache_dtype)
    if typed is not None:  # saturating, as __NV_SATFINITE: E4M3 +-448, E5M2 +-57344
        top = torch.finfo(typed).max
        entry = (entry.float() / scale).clamp(-top, top).to(typed)
        rows = rows.view(typed)
    rows[slots] = entry


def _eager(variant, preset, cos_sin_cache, dtype):
    kw = _kwargs(preset)
    table = cos_sin_cache.to(dtype)
    cache_dtype = preset.params["cache_dtype"]
    return lambda inputs: vllm_mla_kv(inputs, table, cache_dtype=cache_dtype, **kw)


def mla_tolerances(preset) -> dict[str, str]:
    return {"kv_cache": "fp8-ds-mla"} if preset.params["cache_dtype"] == "fp8_ds_mla" else {}


POS_2_18 = 1 << 18
MLA_KV = register_variant(
    Variant(
        "mla-kv",
        SPLIT_MLA_RMSNORM_ROPE_CACHE,
        kwargs=_kwargs,
        draw_inputs=_draw,
        eager_chain=_eager,
        params=MLA_PARAMS,
        check_preset=check_mla_preset,
        pins=lambda preset: {"q_lora_rank": 1 if preset is None else preset.params["q_lora_rank"]},
        tolerances=mla_tolerances,
        # every cache flavour, with and without q_c, the YaRN tables to 2^18, fused and unfused
        golden=(
            CaseSpec("deepseek-v3", "bf16", 7, max_position=POS_2_18),
            CaseSpec("deepseek-v3-fp8", "bf16", 7, tp=16),
            CaseSpec("deepseek-v3.2", "bf16", 7, tp=8),
            CaseSpec("deepseek-v3.2", "bf16", 5, "unfused"),
            CaseSpec("kimi-k2", "fp16", 7, tp=4, max_position=POS_2_18),
            CaseSpec("deepseek-v2-lite", "fp32", 3, "unfused", tp=2),
        ),
    )
)


# --------------------------------------------------- FP8 q_c (quant_scale_q): a variant of its own


def _draw_fp8_q(variant, preset, tokens, dtype, generator, **kw):
    """:func:`_draw`, then a 0-dim ``quant_scale_q`` in ``[100, 200)`` (q_c's largest
    products pass +-448: the clamp is exercised)."""
    drawn = _draw(variant, preset, tokens, dtype, generator, **kw)
    unit = torch.rand((), generator=generator, dtype=torch.float64, device=generator.device)
    return drawn | {"quant_scale_q": (100 + 100 * unit).float()}


def _eager_fp8_q(variant, preset, cos_sin_cache, dtype):
    chain = _eager(variant, preset, cos_sin_cache, dtype)

    def run(inputs):
        q_c, *rest = chain(inputs)
        scaled = (q_c.float() * inputs["quant_scale_q"]).clamp(-448.0, 448.0)
        return (scaled.to(FP8), *rest)

    return run


# The MLA prologue with an FP8 q_c (the input of an FP8 q_b_proj), per-tensor factor
MLA_KV_FP8_Q = register_variant(
    replace(
        MLA_KV,
        name="mla-kv-fp8-q",
        draw_inputs=_draw_fp8_q,
        eager_chain=_eager_fp8_q,
        golden=(CaseSpec("deepseek-v3.2-fp8-q", "bf16", 3, tp=8),),
    )
)


# ------------------------------------------- FlashInfer's two caches (ckv_cache, kpe_cache)


def _draw_two_caches(variant, preset, tokens, dtype, generator, **kw):
    """:func:`_draw`, its cache's random entries cut into FlashInfer's two caches, each a
    tensor of its own (``ckv_cache [B, bs, kv_lora_rank]``, ``kpe_cache [B, bs, rope]``)."""
    drawn = _draw(variant, preset, tokens, dtype, generator, **kw)
    both, width = drawn["kv_cache"], preset.params["kv_lora_rank"]
    return drawn | {
        "kv_cache": both[..., :width].contiguous(),
        "kpe_cache": both[..., width:].contiguous(),
    }


def flashinfer_append_paged_mla_kv_cache(kv_c, k_pe, ckv_cache, kpe_cache, slot_mapping, scale):
    """FlashInfer's ``append_paged_mla_kv_cache`` as torch stores (its pages addressed by
    slot: ``page * page_size + offset``): kv_c into ``ckv_cache``, k_pe into ``kpe_cache``, in
    place, for the first ``slot_mapping.size(0)`` tokens with a slot >= 0 (an FP8 pair:
    ``e4m3(clamp(x / scale))``, the convention of vLLM's FP8 caches)."""
    keep = slot_mapping >= 0
    n = slot_mapping.shape[0]
    slots = slot_mapping[keep]
    for cache, x in ((ckv_cache, kv_c), (kpe_cache, k_pe)):
        values = x[:n][keep]
        if cache.dtype == FP8:
            values = (values.float() / scale).clamp(-448.0, 448.0).to(FP8)
        cache.view(-1, cache.shape[-1])[slots] = values


def _eager_two_caches(variant, preset, cos_sin_cache, dtype):
    kw = _kwargs(preset)
    table = cos_sin_cache.to(dtype)

    def run(inputs):
        kv_a, positions = inputs["kv_a"], inputs["positions"]
        q, kv, r = kw["q_lora_rank"], kw["kv_lora_rank"], kw["qk_rope_head_dim"]
        q_c, kv_c, k_pe = kv_a.split([q, kv, r], dim=-1)
        kv_c = vllm_rms_norm(kv_c, inputs["kv_a_weight"], kw["eps"])
        _, k_pe = vllm_rotary_embedding(positions, k_pe, k_pe, r, table, kw["is_neox"])
        caches = (inputs["kv_cache"], inputs["kpe_cache"])
        flashinfer_append_paged_mla_kv_cache(
            kv_c, k_pe, *caches, inputs["slot_mapping"], inputs.get("k_scale")
        )
        q_c = vllm_rms_norm(q_c, inputs["q_a_weight"], kw["eps"])
        return (q_c, kv_c, k_pe, *caches)

    return run


# The MLA prologue into FlashInfer's paged MLA layout: the latent and the rope part in two caches
MLA_KV_TWO_CACHES = register_variant(
    replace(
        MLA_KV,
        name="mla-kv-two-caches",
        draw_inputs=_draw_two_caches,
        eager_chain=_eager_two_caches,
        pins=lambda preset: {
            "q_lora_rank": 1 if preset is None else preset.params["q_lora_rank"],
            "kpe_cache": 1,
        },
        tolerances=None,
        golden=(CaseSpec("deepseek-v3-two-caches", "bf16", 5, tp=8),),
    )
)
