"""``kv_cache_insert``: k and v written into the paged KV cache by slot, stand-alone (vLLM's
``reshape_and_cache_flash``).

The composition (:func:`kv_insert`) is two ``cache_insert`` (:mod:`fqr.ops.cache`), functional
updates of the caches that the public op donates, so the kernel stores in place. It takes what
vLLM's attention backends pass: ``key`` / ``value`` ``[T, Hkv, D]`` (views of the QKV output,
rows at any stride), the caches in the flash layout ``[num_blocks, block_size, Hkv, D]`` at any
strides (vLLM's ``NHC``, and its ``HNC`` as the permuted view), ``slot_mapping [N]`` with
``N <= T`` (``num_actual_tokens``), ``kv_cache_dtype`` ``"auto"``, ``"fp8"`` / ``"fp8_e4m3"`` (an
E4M3 cache: ``float8_e4m3fn``, or vLLM's ``uint8`` allocation of it) or ``"fp8_e5m2"`` with
``k_scale`` / ``v_scale`` (read for an FP8 cache, ignored with ``"auto"`` as vLLM ignores
them). The
float64 reference is :func:`fqr.reference.kv_cache_insert`; the variant ``kv-insert``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops, reference
from ..core import DTYPE_NAMES, Aval
from ..inputs import random_qkv, random_slot_mapping
from ..peers import vllm_reshape_and_cache_flash
from ..validate import ACTIVATION_DTYPES, check_row_stride, check_tensor
from . import params
from .declare import (
    BACKEND,
    Cache,
    Call,
    Tensor,
    TensorKind,
    declare,
    numerics,
)
from .variant import CaseSpec, Variant, register_variant

KV_CACHE_DTYPES = ("auto", *params.FP8_KV_CACHE_DTYPES)  # vLLM's names: E4M3 and E5M2


def kv_insert(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, **static):
    """k and v written into the paged caches by slot (traced into one program): returns the
    new ``(key_cache, value_cache)``, functional updates (:func:`fqr.ops.cache_insert`) that
    the kernel stores in place when donated."""
    encoding = params.cache_encoding(key_cache)  # E5M2 bytes
    key_cache = ops.cache_insert(key_cache, key, slot_mapping, k_scale, encoding=encoding)
    value_cache = ops.cache_insert(value_cache, value, slot_mapping, v_scale, encoding=encoding)
    return key_cache, value_cache


# ------------------------------------------------------------------------- the kinds


@dataclass(frozen=True)
class HeadRows(TensorKind):
    """``[T, heads, head_dim]`` activations (bf16/fp16/fp32) with the heads of a token back to
    back (head stride ``head_dim``, unit stride within a head) and rows at any stride (vLLM's
    ``key`` / ``value``: views of the QKV output); given to the program as the ``[T, heads *
    head_dim]`` view of the same memory. ``like``: another argument whose dtype and shape this
    one shares."""

    like: str | None = None
    leading = "T"
    token_dim = 0

    def check(self, name, x, call):
        check_tensor(name, x)
        if x.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D [T, num_kv_heads, head_size], got {list(x.shape)}"
            )
        if x.dtype not in ACTIVATION_DTYPES:
            raise TypeError(
                f"{name} must be bf16, fp16 or fp32, got {DTYPE_NAMES.get(x.dtype, x.dtype)}"
            )
        if self.like is not None:
            other = getattr(call, self.like)
            if x.dtype != other.dtype or x.shape != other.shape:
                raise ValueError(
                    f"{name} ({DTYPE_NAMES.get(x.dtype)} {list(x.shape)}) must match "
                    f"{self.like} ({DTYPE_NAMES.get(other.dtype)} {list(other.shape)})"
                )
        _, heads, head_dim = x.shape
        if heads < 1 or head_dim < 1:
            raise ValueError(f"{name} has no heads or features (shape {list(x.shape)})")
        if x.shape[0] and (x.stride(2) != 1 or (heads > 1 and x.stride(1) != head_dim)):
            raise ValueError(
                f"{name} must hold each token's heads back to back (strides [*, {head_dim}, 1]), "
                f"got strides {list(x.stride())}"
            )
        check_row_stride(name, x, heads * head_dim)

    def operands(self, x):
        return (x.view(x.shape[0], x.shape[1] * x.shape[2]),)

    def avals(self, x):
        return (Aval(("T", x.shape[1] * x.shape[2]), x.dtype),)


@dataclass(frozen=True)
class FlashCache(Cache):
    """A :class:`~fqr.prologue.declare.Cache` of ``kv_cache_dtype`` (vLLM's): ``"auto"`` the
    key's dtype; ``"fp8"`` / ``"fp8_e4m3"`` float8_e4m3fn, ``"fp8_e5m2"`` float8_e5m2, either
    as vLLM allocates it too (uint8 bytes), given to the program as
    :func:`fqr.prologue.params.fp8_cache_view` says (E4M3 as float8_e4m3fn, E5M2 as its
    bytes)."""

    def viewed_as(self, x, call):
        return params.fp8_cache_view(x, call.kv_cache_dtype)


def _cache_shape(call: Call):
    _, heads, head_dim = call.key.shape
    return (None, heads, head_dim), (
        f"[num_blocks, block_size, num_kv_heads={heads}, head_size={head_dim}] (key's heads)"
    )


def _cache_dtypes(call: Call):
    if call.kv_cache_dtype == "auto":
        return (call.key.dtype,)
    return (params.FP8_KV_CACHE_DTYPES[call.kv_cache_dtype], torch.uint8)


def _cache_dtype_text(call: Call) -> str:
    if call.kv_cache_dtype == "auto":
        return f"key's dtype {DTYPE_NAMES.get(call.key.dtype)} (kv_cache_dtype 'auto')"
    typed = DTYPE_NAMES.get(params.FP8_KV_CACHE_DTYPES[call.kv_cache_dtype])
    return f"{typed} or its uint8 bytes (kv_cache_dtype {call.kv_cache_dtype!r})"


def _cache(name: str, what: str) -> Tensor:
    return params.positional(
        name,
        FlashCache(shape=_cache_shape, dtypes=_cache_dtypes, dtype_text=_cache_dtype_text),
        donated=True,
        doc=f"``[num_blocks, block_size, Hkv, D]`` paged {what} cache (vLLM's flash layout "
        "``NHC``, or ``HNC`` as its permuted view: any strides with a contiguous last dim) of "
        "``kv_cache_dtype``; updated in place",
    )


KV_CACHE_INSERT = declare(
    "kv_cache_insert",
    kv_insert,
    (
        params.positional(
            "key",
            HeadRows(),
            doc="``[T, Hkv, D]`` keys, each token's heads back to back, rows at any stride",
        ),
        params.positional("value", HeadRows(like="key"), doc="``[T, Hkv, D]`` values, as key"),
        _cache("key_cache", "key"),
        _cache("value_cache", "value"),
        params.short_slot_mapping("key_cache", "key"),
        params.kv_cache_dtype_param(
            KV_CACHE_DTYPES,
            "vLLM's name of the caches' dtype: ``'auto'`` (key's dtype), ``'fp8'`` / "
            "``'fp8_e4m3'`` (E4M3: float8_e4m3fn, or uint8 bytes) or ``'fp8_e5m2'`` (E5M2: "
            "float8_e5m2, or uint8 bytes)",
        ),
        params.cache_scale("k_scale", "key", keyword=False, used=params.reads_cache_scale),
        params.cache_scale("v_scale", "value", keyword=False, used=params.reads_cache_scale),
        numerics(modes=("fused", "unfused")),
        BACKEND,
    ),
    params.KV_CACHE_OUTPUTS,
    reference=reference.kv_cache_insert,
    checks=(params.caches_match,),
    returns=lambda call, outs: None,
    doc="""
    Write each token's key and value heads into the paged KV cache by slot: vLLM's
    ``reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
    kv_cache_dtype, k_scale, v_scale)``, same argument order and meaning; returns None.

    For every token ``t < N`` (``slot_mapping`` is ``[N]``, ``N <= T``: vLLM takes the token
    count from the slot mapping, so a batch padded for CUDA graphs stores only its
    ``num_actual_tokens`` rows) with ``s = slot_mapping[t] >= 0``::

        key_cache[s // block_size, s % block_size, h, :]   = store(key[t, h])
        value_cache[s // block_size, s % block_size, h, :] = store(value[t, h])

    ``store`` rounds to the cache's dtype once (``kv_cache_dtype="auto"``: the key's dtype, a
    copy); an FP8 cache (``"fp8"``) stores ``e4m3(clamp(x / scale, -448, 448))`` with the
    float32 ``[1]`` per-tensor ``k_scale`` / ``v_scale`` (default 1; vLLM's
    ``scaled_convert``), ``"fp8_e5m2"`` ``e5m2(clamp(x / scale, -57344, 57344))``. With
    ``"auto"`` the scales are taken and ignored, as vLLM's kernel ignores the
    ``layer._k_scale`` / ``_v_scale`` its attention backends pass with every cache dtype
    (their form is checked: float32 ``[1]`` or 0-dim on the key's device; their value is not
    read). A
    negative slot writes nothing, rows no slot names keep their contents. The caches are updated
    in place (the composition is functional, :func:`fqr.ops.cache_insert`, and the op donates
    them). ``numerics`` changes nothing here (one rounding either way). The reference it matches
    is :func:`fqr.reference.kv_cache_insert`.

    Not expressed: vLLM's per-head scales (``kv_scale_type="attn_head"``, ``[Hkv]``) and NVFP4
    caches: refused by the checks.

    Example (CPU tensors: ``backend="auto"`` runs the reference backend)::

        >>> import torch, fqr
        >>> key = torch.randn(3, 2, 64, dtype=torch.bfloat16)  # 3 tokens, 2 kv heads of 64
        >>> value = torch.randn(3, 2, 64, dtype=torch.bfloat16)
        >>> key_cache = torch.randn(4, 16, 2, 64, dtype=torch.bfloat16)  # 4 blocks of 16
        >>> value_cache = torch.randn(4, 16, 2, 64, dtype=torch.bfloat16)
        >>> before = key_cache.clone()
        >>> fqr.kv_cache_insert(key, value, key_cache, value_cache, torch.tensor([17, -1, 5]),
        ...                     "auto")
        >>> torch.equal(key_cache[1, 1], key[0]), torch.equal(value_cache[0, 5], value[2])
        (True, True)
        >>> int((key_cache != before).any(-1).any(-1).sum())  # two rows written, slot -1 none
        2
    """,
)

kv_cache_insert = KV_CACHE_INSERT.function


# ------------------------------------------------------------------------- the variant


# a preset's cache_dtype -> vLLM's kv_cache_dtype
VLLM_CACHE_DTYPES = {"auto": "auto", "fp8e4m3": "fp8", "fp8e5m2": "fp8_e5m2"}


def _kwargs(preset) -> dict:
    return {"kv_cache_dtype": VLLM_CACHE_DTYPES[preset.params["cache_dtype"]]}


def _draw(variant, preset, tokens, dtype, generator, *, max_position, positions_dtype, bias):
    """key and value as vLLM's attention layer has them (``[T, Hkv, D]`` views of the QKV
    row, v with outliers past +-448), caches of twice the rows the tokens need (at least 32)
    holding random values (a row written where no slot names it shows), slots with every
    third one negative and the last token past a slot mapping one shorter than T (a CUDA-graph
    pad), random per-tensor scales for an FP8 cache."""
    spec = preset.spec
    qkv = random_qkv(spec, tokens, dtype, generator)
    hkv, d = spec.num_kv_heads, spec.head_dim
    key = qkv[:, spec.q_size : spec.q_size + spec.kv_size].view(tokens, hkv, d)
    value = qkv[:, spec.q_size + spec.kv_size :].view(tokens, hkv, d)
    value[:, :, ::7] *= 600.0  # past E4M3's +-448: the clamp is exercised
    # one cache for every small T (as in serving)
    caches = params.random_kv_caches(
        preset, dtype, generator, holds=max(tokens, 32),
        slot_mapping=lambda rows: _short_slot_mapping(tokens, rows, generator),
    )  # fmt: skip
    return {"key": key, "value": value} | caches


def _short_slot_mapping(tokens: int, rows: int, generator) -> torch.Tensor:
    """``[T - 1]`` slots (the last token a CUDA-graph pad; one slot at T = 1, drawn after an
    empty draw, as the golden cases were) of a cache of ``rows``, every third one padding."""
    slots = random_slot_mapping(max(tokens - 1, 0), rows, generator)
    if tokens == 1:
        slots = random_slot_mapping(1, rows, generator)
    return slots


def _eager(variant, preset, cos_sin_cache, dtype):
    def chain(inputs):
        vllm_reshape_and_cache_flash(
            inputs["key"],
            inputs["value"],
            inputs["key_cache"],
            inputs["value_cache"],
            inputs["slot_mapping"],
            inputs.get("k_scale"),
            inputs.get("v_scale"),
        )
        return inputs["key_cache"], inputs["value_cache"]

    return chain


# vLLM's reshape_and_cache_flash for a model's KV heads: a cache in the model dtype and an FP8
# E4M3 one with per-tensor scales (presets kv-insert*).
KV_INSERT = register_variant(
    Variant(
        "kv-insert",
        KV_CACHE_INSERT,
        kwargs=_kwargs,
        draw_inputs=_draw,
        eager_chain=_eager,
        params=params.PAGED_CACHE_FIELDS,
        check_preset=params.check_paged_cache_preset,
        reads_table=False,
        # an E5M2 cache is the program's uint8 bytes: held as the E5M2 values they are
        tolerances=lambda preset: (
            {n: "fp8-e5m2-bytes" for n in ("key_cache", "value_cache")}
            if preset.params["cache_dtype"] == "fp8e5m2"
            else {}
        ),
        golden=(
            CaseSpec("qwen3-8b-kv-insert-fp8", "bf16", 7, tp=2),
            CaseSpec("qwen3-8b-kv-insert", "fp16", 1, tp=8),
            CaseSpec("qwen3-8b-kv-insert-fp8-e5m2", "fp16", 1, tp=8),
        ),
    )
)
