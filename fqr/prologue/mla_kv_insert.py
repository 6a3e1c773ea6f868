"""``mla_cache_insert``: ``[kv_c | k_pe]`` written into the paged MLA cache by slot, stand-alone
(vLLM's ``concat_and_cache_mla`` / ``concat_and_cache_ds_mla``, ``csrc/cache_kernels.cu``).

vLLM's MLA attention backends call, once per layer, after the model's own ``kv_a_layernorm``
and rotary embedding (``vllm/v1/attention/backends/mla/common.py``)::

    ops.concat_and_cache_mla(k_c_normed, k_pe.squeeze(1), kv_cache, slot_mapping,
                             kv_cache_dtype=self.kv_cache_dtype, scale=layer._k_scale)

It stores ``kv_c`` as given (already normalised), unlike :func:`fqr.split_mla_rmsnorm_rope_cache`,
which normalises and rotates first: this op is for a caller whose kv_c and k_pe come from
elsewhere (as :func:`fqr.kv_cache_insert` is for ``reshape_and_cache_flash``). The composition
(:func:`mla_insert`) is the stores of the MLA prologue, :func:`fqr.prologue.mla_kv.
mla_cache_stores`; the float64 reference is :func:`mla_insert_reference`
(:func:`fqr.reference.mla_cache_entry`, :func:`fqr.reference.ds_mla_entry`). The variant
``mla-insert`` binds the DeepSeek presets (``deepseek-v3-mla-insert``, ...).
"""

from __future__ import annotations

import torch

from .. import ops
from ..core import DTYPE_NAMES, Section
from ..inputs import random_heads, random_slot_mapping
from ..ops.fp8 import FP8_E5M2
from . import params
from .declare import (
    BACKEND,
    Call,
    Output,
    Rows,
    Scale,
    Tensor,
    declare,
    numerics,
)
from .mla_kv import (
    BYTES,
    DS_MLA,
    MLA_PARAMS,
    TILE,
    MlaCache,
    cache_statics,
    check_ds_mla_call,
    check_mla_preset,
    ds_mla_entry_bytes,
    kpe_cache_param,
    mla_cache_expected,
    mla_cache_stores,
    mla_tolerances,
    random_mla_cache,
    two_caches_agree,
    vllm_concat_and_cache_mla,
)
from .variant import CaseSpec, Variant, register_variant

# vLLM's kv_cache_dtype names this op takes: the model dtype, a per-tensor E4M3 cache (a
# float8_e4m3fn tensor or, as vLLM allocates it, its uint8 bytes), V3.2's byte entry
MLA_CACHE_DTYPES = ("auto", *params.FP8_KV_CACHE_DTYPES, DS_MLA)


def mla_insert(kv_c, k_pe, kv_cache, slot_mapping, scale, kpe_cache, *, kv_cache_dtype, **static):
    """``[kv_c | k_pe]`` of the first N tokens written into the cache (FlashInfer's two caches:
    kv_c into ``kv_cache``, k_pe into ``kpe_cache``), traced into one program: returns the
    new caches (donated: the kernel stores in place). ``kv_cache_dtype`` (the call's, vLLM's
    name; never the operand's dtype: an E5M2 cache enters as bytes too) says the layout; an
    ``fp8_ds_mla`` cache quantizes kv_c tile by tile: it is held as heads of one tile."""
    if kv_cache_dtype == DS_MLA:
        tiles = kv_c.shape[1] // TILE
        (kv_c,) = ops.split_heads(kv_c, [Section(tiles, TILE, 0)])
    return mla_cache_stores(
        kv_cache, kv_c, k_pe, slot_mapping, scale, rope_dtype=k_pe.dtype, kpe_cache=kpe_cache,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip


def mla_insert_reference(
    kv_c, k_pe, kv_cache, slot_mapping, *, kv_cache_dtype="auto", scale=None, kpe_cache=None
) -> tuple[torch.Tensor, ...]:
    """float64 expected cache after the call: :func:`fqr.prologue.mla_kv.mla_cache_expected`
    of the first N tokens in the layout ``kv_cache_dtype`` names (a uint8 cache of a
    per-tensor FP8 ``kv_cache_dtype`` read as the float8 values it holds); ``scale`` is read
    only where that layout has a per-tensor scale (vLLM passes one always)."""
    typed = params.FP8_KV_CACHE_DTYPES.get(kv_cache_dtype)

    def as_typed(cache):
        return cache.view(typed) if typed is not None and cache.dtype == BYTES else cache

    return mla_cache_expected(
        as_typed(kv_cache), kv_c, k_pe, slot_mapping, scale=scale if typed is not None else None,
        rope_dtype=k_pe.dtype, kv_cache_dtype=kv_cache_dtype,
        kpe_cache=None if kpe_cache is None else as_typed(kpe_cache),
    )  # fmt: skip


# --------------------------------------------------------------------------- the checks


def _entry(call: Call):
    """The cache entry ``kv_cache_dtype`` needs (after the blocks), and how it is made."""
    kv, r = call.kv_c.shape[1], call.k_pe.shape[1]
    if call.kpe_cache is not None:
        return (None, kv), f"[num_blocks, block_size, kv_c width = {kv}] (with kpe_cache)"
    if call.kv_cache_dtype == DS_MLA:
        size = ds_mla_entry_bytes(kv, r)
        return (None, size), (
            f"[num_blocks, block_size, {size}] (fp8_ds_mla: kv_c's {kv} E4M3 bytes + 4 bytes "
            f"per {TILE}-value tile + k_pe's {r} 16-bit values)"
        )
    return (None, kv + r), f"[num_blocks, block_size, kv_c width + k_pe width = {kv + r}]"


def _cache_dtypes(call: Call):
    if call.kv_cache_dtype == "auto":
        return (call.kv_c.dtype,)
    if call.kv_cache_dtype == DS_MLA:
        return (BYTES,)
    return (params.FP8_KV_CACHE_DTYPES[call.kv_cache_dtype], BYTES)


def _cache_dtype_text(call: Call) -> str:
    name = call.kv_cache_dtype
    if name == "auto":
        return f"kv_c's dtype {DTYPE_NAMES.get(call.kv_c.dtype)} (kv_cache_dtype 'auto')"
    if name == DS_MLA:
        return "uint8 (kv_cache_dtype 'fp8_ds_mla')"
    typed = DTYPE_NAMES.get(params.FP8_KV_CACHE_DTYPES[name])
    return f"{typed} or its uint8 bytes (kv_cache_dtype {name!r})"


def _flavour(call: Call) -> None:
    """What ``kv_cache_dtype`` asks of the call: 16-bit rows and whole tiles for
    ``fp8_ds_mla``. (A scale is taken with every dtype, as vLLM's MLA backends pass
    ``layer._k_scale`` with every one: read for a per-tensor FP8 cache, ignored otherwise.)"""
    if call.kv_cache_dtype == DS_MLA:
        check_ds_mla_call(call, "kv_c", call.kv_c, call.kv_c.shape[1], "kv_c width")


# ----------------------------------------------------------------------- the declaration

MLA_CACHE_INSERT = declare(
    "mla_cache_insert",
    mla_insert,
    (
        params.positional(
            "kv_c",
            Rows(what="[T, kv_lora_rank]"),
            doc="``[T, kv_lora_rank]`` the latent as the cache takes it (already normalised), "
            "bf16/fp16/fp32; the row stride may exceed the width (a view of the kv_a output)",
        ),
        params.positional(
            "k_pe",
            Rows(what="[T, qk_rope_head_dim]", like="kv_c"),
            doc="``[T, qk_rope_head_dim]`` the rotated key part (vLLM's ``k_pe.squeeze(1)``), "
            "kv_c's dtype; rows at any stride",
        ),
        params.positional(
            "kv_cache",
            MlaCache(
                shape=_entry, dtypes=_cache_dtypes, dtype_text=_cache_dtype_text, last="the entry"
            ),
            donated=True,
            doc="the paged MLA cache, updated in place: ``[num_blocks, block_size, kv_lora_rank "
            "+ qk_rope_head_dim]`` in kv_c's dtype (``'auto'``) or FP8 (``'fp8'``: "
            "float8_e4m3fn, ``'fp8_e5m2'``: float8_e5m2, or vLLM's uint8 allocation of either), "
            "or uint8 ``[num_blocks, block_size, 656]`` (``'fp8_ds_mla'``); any strides with a "
            "contiguous last dim",
        ),
        params.short_slot_mapping("kv_cache", "kv_c"),
        params.kv_cache_dtype_param(
            MLA_CACHE_DTYPES,
            "vLLM's name of the cache's dtype: ``'auto'`` (kv_c's), ``'fp8'`` / ``'fp8_e4m3'`` "
            "(E4M3, per-tensor scale), ``'fp8_e5m2'`` (E5M2, per-tensor scale) or "
            "``'fp8_ds_mla'`` (DeepSeek-V3.2's 656-byte entry)",
        ),
        Tensor(
            "scale",
            None,
            keyword=False,
            annotation=params.OPTIONAL_TENSOR,
            kind=Scale(
                used=params.reads_cache_scale,
                what=params.FP8_SCALE_WHAT,
            ),
            optional=True,
            doc="float32 ``[1]`` or 0-dim per-tensor scale (vLLM's ``layer._k_scale``, which "
            "its MLA backends pass with every dtype): read for ``'fp8'`` / ``'fp8_e4m3'`` / "
            "``'fp8_e5m2'`` (default 1: stored ``fp8(clamp(x / scale, -max, max))``, as "
            "concat_and_cache_mla), ignored for ``'auto'`` and ``'fp8_ds_mla'`` as vLLM's "
            "kernels ignore it there (its form is still checked, its value is not read)",
        ),
        kpe_cache_param(lambda call: call.k_pe.shape[1]),
        numerics(modes=("fused", "unfused")),
        BACKEND,
    ),
    (
        Output("kv_cache", head_dim=lambda s: s["rotary_dim"]),
        Output(
            "kpe_cache",
            head_dim=lambda s: s["rotary_dim"],
            present=lambda call: call.kpe_cache is not None,
        ),
    ),
    reference=mla_insert_reference,
    checks=(_flavour, two_caches_agree),
    program_statics=cache_statics,
    returns=lambda call, outs: None,
    doc="""
    Write each token's ``[kv_c | k_pe]`` into the paged MLA cache by slot: vLLM's
    ``concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale)`` and,
    for ``kv_cache_dtype="fp8_ds_mla"``, ``concat_and_cache_ds_mla``; same argument order and
    meaning; returns None. kv_c is stored as given (no norm: that is
    :func:`fqr.split_mla_rmsnorm_rope_cache`, the whole prologue in one kernel).

    For every token ``t < N`` (``slot_mapping`` is ``[N]``, ``N <= T``: vLLM takes the token
    count from the slot mapping) with ``s = slot_mapping[t] >= 0``, the entry ``kv_cache[s //
    block_size, s % block_size]`` becomes

    * ``'auto'``: ``[kv_c[t] | k_pe[t]]`` (a copy);
    * ``'fp8'`` / ``'fp8_e4m3'``: ``e4m3(clamp([kv_c[t] | k_pe[t]] / scale, -448, 448))``
      with the float32 per-tensor ``scale`` (``[1]`` or 0-dim, default 1; vLLM's
      ``scaled_convert``), into a float8_e4m3fn cache or its uint8 bytes;
    * ``'fp8_e5m2'``: the same with ``e5m2(clamp(..., -57344, 57344))``, into a float8_e5m2
      cache or its uint8 bytes;
    * ``'fp8_ds_mla'`` (uint8 entry of ``L + 4 * L / 128 + 2 * R`` bytes, L a multiple of
      128): kv_c in tiles of 128 values, each stored ``e4m3(clamp(x / s_j, -448, 448))`` with
      ``s_j = max(max|tile_j| / 448, FLT_MIN)`` (float32), the ``L / 128`` scales as float32
      after the values, then k_pe's 16-bit values (bf16 or fp16, the rows' dtype).

    The layout is the one ``kv_cache_dtype`` names, at any latent width L (an E5M2 cache is
    uint8 bytes as an ``fp8_ds_mla`` one is: the dtype never decides). ``scale`` is taken
    with every dtype, as vLLM's MLA backends pass ``scale=layer._k_scale`` whatever the
    cache: the per-tensor FP8 names read it; ``'auto'`` and ``'fp8_ds_mla'`` ignore it, as
    vLLM's kernels do (the latter computes its tiles' scales itself).

    With ``kpe_cache`` (FlashInfer's paged MLA layout, ``append_paged_mla_kv_cache``'s
    ``ckv_cache`` / ``kpe_cache``, addressed here by slot): ``kv_cache [num_blocks, block_size,
    L]`` gets ``store(kv_c[t])`` and ``kpe_cache [num_blocks, block_size, R]`` gets
    ``store(k_pe[t])``, same store as above ('auto' or FP8; not 'fp8_ds_mla').

    A negative slot writes nothing; entries no slot names keep their contents. The caches are
    updated in place. ``numerics`` changes nothing here (one rounding either way). The
    reference it matches is :func:`fqr.prologue.mla_kv_insert.mla_insert_reference`.

    Example (CPU tensors: ``backend="auto"`` runs the reference backend)::

        >>> import torch, fqr
        >>> kv_c = torch.randn(3, 512, dtype=torch.bfloat16)  # 3 tokens, kv_lora_rank 512
        >>> k_pe = torch.randn(3, 64, dtype=torch.bfloat16)
        >>> kv_cache = torch.zeros(2, 16, 512 + 64, dtype=torch.bfloat16)  # 2 blocks of 16
        >>> fqr.mla_cache_insert(kv_c, k_pe, kv_cache, torch.tensor([17, -1]), "auto")
        >>> torch.equal(kv_cache[1, 1], torch.cat([kv_c[0], k_pe[0]]))  # slot 17
        True
        >>> int(kv_cache.ne(0).any(-1).sum())  # token 1 padding, token 2 past N = 2
        1
    """,
)

mla_cache_insert = MLA_CACHE_INSERT.function


# ------------------------------------------------------------------------- the variant


def _kwargs(preset) -> dict:
    return {"kv_cache_dtype": preset.params["cache_dtype"]}


def _draw(variant, preset, tokens, dtype, generator, *, max_position, positions_dtype, bias):
    """kv_c (tiles of different magnitudes, some past +-448 / scale) and k_pe as views of one
    ``[T, kv_lora_rank + rope]`` row (vLLM splits the kv_a output), a cache of random entries
    of twice the entries the tokens need (a block at least) as vLLM allocates it (an FP8 cache
    as uint8 bytes), slots one shorter than T (the last token a CUDA-graph pad; T at T <= 1),
    every third one padding, and an FP8 cache's scale 0-dim, as vLLM's layers hold it."""
    p = preset.params
    kv, r = p["kv_lora_rank"], preset.head_dim
    tiles = kv // TILE if kv % TILE == 0 else 1
    row = torch.cat(
        [
            random_heads(tokens, tiles, kv // tiles, dtype, generator),
            random_heads(tokens, 1, r, dtype, generator),
        ],
        dim=1,
    )
    bs = p["block_size"]
    blocks = max(1, -(-2 * tokens // bs))
    cache = random_mla_cache(preset, blocks, dtype, generator)
    if p["cache_dtype"] in params.FP8_KV_CACHE_DTYPES:
        cache = cache.view(BYTES)
    slots = random_slot_mapping(tokens - 1 if tokens > 1 else tokens, blocks * bs, generator)
    drawn = {"kv_c": row[:, :kv], "k_pe": row[:, kv:], "kv_cache": cache, "slot_mapping": slots}
    if p["cache_dtype"] in params.FP8_KV_CACHE_DTYPES:
        unit = torch.rand((), generator=generator, dtype=torch.float64, device=generator.device)
        drawn["scale"] = (0.004 + 0.004 * unit).float()
    return drawn


def _eager(variant, preset, cos_sin_cache, dtype):
    cache_dtype = preset.params["cache_dtype"]

    def chain(inputs):
        vllm_concat_and_cache_mla(
            inputs["kv_c"],
            inputs["k_pe"],
            inputs["kv_cache"],
            inputs["slot_mapping"],
            cache_dtype,
            inputs.get("scale"),
        )
        return (inputs["kv_cache"],)

    return chain


def _tolerances(preset) -> dict[str, str]:
    typed = params.FP8_KV_CACHE_DTYPES.get(preset.params["cache_dtype"])
    if typed is not None:  # vLLM's uint8 allocation, read as the FP8 values it holds
        return {"kv_cache": "fp8-e5m2-bytes" if typed == FP8_E5M2 else "fp8-e4m3-bytes"}
    return mla_tolerances(preset)


MLA_INSERT = register_variant(
    Variant(
        "mla-insert",
        MLA_CACHE_INSERT,
        kwargs=_kwargs,
        draw_inputs=_draw,
        eager_chain=_eager,
        params=MLA_PARAMS,
        check_preset=check_mla_preset,
        reads_table=False,
        tolerances=_tolerances,
        # every cache flavour: the model dtype, FP8 E4M3 bytes with a 0-dim scale, fp8_ds_mla
        # from fp16 rows (bf16: the mla-kv cases); slots one shorter than T. Each case holds
        # a 64-entry block's expectation in float64 (~340 KB): one per flavour.
        golden=(
            CaseSpec("deepseek-v3-mla-insert", "bf16", 5),
            CaseSpec("deepseek-v3-fp8-mla-insert", "fp16", 7),
            CaseSpec("deepseek-v3.2-mla-insert", "fp16", 3),
            CaseSpec("deepseek-v3-fp8-e5m2-mla-insert", "bf16", 4),
        ),
    )
)
