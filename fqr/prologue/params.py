"""The parameters the members of the prologue family share, declared once.

A declaration lists these (or a ``dataclasses.replace`` of one, for another default) in its
signature order; each carries its kind, its check (so one argument is checked and named the same
way by every op), its torch schema type and its line of documentation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..core import DTYPE_NAMES, KV_CACHE_FP8_DTYPES
from ..inputs import random_fp8_scales, random_paged_cache
from ..ops.fp8 import FP8_E4M3, FP8_E5M2
from ..ops.split import QKV_LAYOUTS, check_qkv_layout, codegen_shards
from ..validate import check_head_counts
from .declare import (
    BACKEND,
    MISSING,
    Cache,
    Call,
    Output,
    Positions,
    Rows,
    Scale,
    Slots,
    Static,
    Table,
    Tensor,
    Vector,
    choice,
    flag,
    positive_int,
    positive_real,
    real,
)

TENSOR = "torch.Tensor"
OPTIONAL_TENSOR = "torch.Tensor | None"


def positional(name: str, kind, doc: str, **more) -> Tensor:
    """The required positional tensor argument ``name`` of ``kind`` (``more``: other fields of
    :class:`~fqr.prologue.declare.Tensor`, e.g. ``donated=True`` for a cache updated in place)."""
    return Tensor(name, keyword=False, annotation=TENSOR, kind=kind, doc=doc, **more)


POSITIONS = positional(
    "positions",
    Positions(),
    doc="``[T]`` int32/int64 token positions, rows of ``cos_sin_cache`` (checked against its "
    "rows on the host for CPU tensors; on an accelerator the kernel rotates an out-of-range "
    "token by NaN)",
)
COS_SIN_CACHE = positional(
    "cos_sin_cache",
    Table(),
    doc="``[max_position, R]`` float RoPE table in vLLM's layout (cos in ``[0, R/2)``, sin in "
    "``[R/2, R)``; R = rotary_dim, even, at most head_dim); build it with "
    "``fqr.rope_cache.rope_cos_sin_cache`` or ``preset.cos_sin_cache()``",
)


def positions_of(rows: str) -> Tensor:
    """:data:`POSITIONS` of the tokens of the rows argument ``rows`` (an op without ``qkv``)."""
    return replace(POSITIONS, kind=Positions(rows_of=rows))


def mla_cos_sin_cache(rotary_dim, width: str) -> Tensor:
    """:data:`COS_SIN_CACHE` of an MLA op (the model's YaRN table): its rotary width at most
    ``rotary_dim(call)``, documented as ``width`` (what R is) instead of "at most head_dim"."""
    return replace(
        COS_SIN_CACHE,
        kind=Table(head_dim=rotary_dim),
        doc=COS_SIN_CACHE.doc.replace("at most head_dim", width)
        + " (the model's YaRN table: preset.cos_sin_cache())",
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
DEEPSEEK_IS_NEOX = replace(
    IS_NEOX, default=False, doc="NeoX halves instead of DeepSeek's GPT-J pairs"
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

# The norm and RoPE arguments of fqr.split_qkv_rmsnorm_rope after its heads, in its order; the
# members that take them as it does list them so (qk_rmsnorm_rope, the v-norm and mRoPE ops).
NORM_ROPE = (EPS, IS_NEOX, Q_BIAS, K_BIAS, WEIGHT_OFFSET)


def qkv_width(call: Call) -> tuple[int, str]:
    """The width of vLLM's packed ``[q | k | v]`` row, and how it is made (for the message)."""
    hq, hkv, d = call.num_heads, call.num_kv_heads, call.head_dim
    width = (hq + 2 * hkv) * d
    return width, f"(num_heads + 2*num_kv_heads) * head_dim = ({hq} + 2*{hkv}) * {d} = {width}"


QKV = positional(
    "qkv",
    Rows(width=qkv_width),
    doc="``[T, (Hq + 2*Hkv)*D]`` packed q | k | v rows, bf16/fp16/fp32; the row stride may "
    "exceed the width",
)


def _check_layout_name(name: str, value) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__}")
    if value not in ("qkv", "per-head") and codegen_shards(value) is None:
        raise ValueError(f"{name} must be one of {', '.join(QKV_LAYOUTS)}, got {value!r}")


QKV_LAYOUT = Static(
    "qkv_layout",
    "qkv",
    annotation="str",
    check=_check_layout_name,
    schema="str",
    doc="how the packed row holds the heads, read as the checkpoint stores it: 'qkv' "
    "(vLLM's [q | k | v]); 'per-head' (GPT-NeoX, Persimmon: [q_h | k_h | v_h] for each head h "
    "in turn); 'codegen-mpN' (CodeGen: N model-parallel shards, each [q | v | k] of "
    "num_heads/N heads; CodeGen's is 'codegen-mp4'). Other than 'qkv': num_kv_heads == "
    "num_heads (fqr.ops.qkv_layout_sections)",
)


def layout_fits(call: Call) -> None:
    """A ``qkv_layout`` other than ``"qkv"`` fits the head counts (:data:`QKV_LAYOUT`)."""
    if call.qkv_layout != "qkv":
        check_qkv_layout(call.qkv_layout, call.num_heads, call.num_kv_heads)


def heads_divide(call: Call) -> None:
    """Grouped-query attention: q heads a multiple of kv heads."""
    check_head_counts(call.num_heads, call.num_kv_heads)


def biases_together(call: Call) -> None:
    if (call.q_bias is None) != (call.k_bias is None):
        raise ValueError("q_bias and k_bias must be given together")


def with_default(param, default):
    """``param`` with another default (a model family's)."""
    return replace(param, default=default)


# The opening of a public op's runnable ``Example::`` (tests/docs/test_docstring_examples.py
# runs it) for the ops every backend runs: where a CPU or CUDA example runs. A declaration's
# ``doc`` (an f-string) places it on a line of its own; its first line takes the docstring's
# indentation, the next ones carry their own.
EXAMPLE_HEADING = (
    'Example (CPU tensors: ``backend="auto"`` runs the reference backend, ``"interpret"`` the\n'
    "    generated kernel under Triton's interpreter; CUDA tensors run the compiled kernel)::"
)
# ... then the example's imports and its RoPE table (rotary_dim 64, 4096 positions).
EXAMPLE_WITH_TABLE = f"""{EXAMPLE_HEADING}

        >>> import torch, fqr
        >>> from fqr.rope_cache import rope_cos_sin_cache
        >>> table = rope_cos_sin_cache(64, 4096, 10000.0)  # rotary_dim 64, 4096 positions"""


__all__ = [
    "BACKEND",
    "COS_SIN_CACHE",
    "EPS",
    "EXAMPLE_HEADING",
    "EXAMPLE_WITH_TABLE",
    "HEAD_DIM",
    "IS_NEOX",
    "K_BIAS",
    "K_WEIGHT",
    "NORM_ROPE",
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


# ------------------------------------------------------------ paged KV caches (vLLM's flash layout)


# vLLM's kv_cache_dtype names of a per-tensor FP8 cache -> the float8 dtype it holds (vLLM
# allocates such a cache as uint8 bytes).
FP8_KV_CACHE_DTYPES = KV_CACHE_FP8_DTYPES
# What a per-tensor cache scale is, in every message about it: the dtypes and the names that
# read one
FP8_SCALE_WHAT = (
    "the per-tensor scale of an FP8 cache: float8_e4m3fn or float8_e5m2, kv_cache_dtype "
    + ", ".join(repr(name) for name in FP8_KV_CACHE_DTYPES)
)


def _cache_shape(call: Call):
    hkv, d = call.num_kv_heads, call.head_dim
    return (None, hkv, d), (f"[num_blocks, block_size, num_kv_heads={hkv}, head_dim={d}]")


def cache_dtypes(call: Call):
    """The dtypes a paged cache of a ``qkv`` op may have: qkv's, or FP8 E4M3 or E5M2."""
    return (call.qkv.dtype, FP8_E4M3, FP8_E5M2)


def cache_dtype_text(call: Call) -> str:
    """:func:`cache_dtypes` as the message names them."""
    return f"qkv's dtype {DTYPE_NAMES.get(call.qkv.dtype)}, fp8e4m3 or fp8e5m2"


# vLLM's kv_cache_dtype of a typed FP8 cache (an op without the argument)
FP8_CACHE_NAMES = {FP8_E4M3: "fp8", FP8_E5M2: "fp8_e5m2"}


@dataclass(frozen=True)
class TypedCache(Cache):
    """A paged cache whose dtype says what it holds (no ``kv_cache_dtype`` argument): an E5M2
    one enters the program as its bytes (:func:`fp8_cache_view`)."""

    def viewed_as(self, x, call):
        return fp8_cache_view(x, FP8_CACHE_NAMES.get(x.dtype))


PAGED_CACHE = TypedCache(shape=_cache_shape, dtypes=cache_dtypes, dtype_text=cache_dtype_text)


def caches_match(call: Call) -> None:
    """key_cache and value_cache of one dtype and the same blocks and block size."""
    key, value = call.key_cache, call.value_cache
    if value.dtype != key.dtype or value.shape[:2] != key.shape[:2]:
        raise ValueError(
            f"value_cache ({DTYPE_NAMES.get(value.dtype)} {list(value.shape)}) must "
            f"match key_cache ({DTYPE_NAMES.get(key.dtype)} {list(key.shape)})"
        )


def caches_agree(call: Call) -> None:
    """:func:`caches_match` (a scale with a model-dtype cache is taken and ignored:
    :func:`reads_typed_cache_scale`)."""
    caches_match(call)


def reads_typed_cache_scale(call: Call) -> bool:
    """Whether a call whose cache dtype says what it holds (:class:`TypedCache`, no
    ``kv_cache_dtype``) reads its per-tensor ``k_scale`` / ``v_scale``: an FP8 key_cache
    (E4M3 or E5M2). With a model-dtype cache the scale is taken and ignored, as vLLM's
    ``reshape_and_cache_flash`` ignores the ``layer._k_scale`` its attention layers pass with
    every cache (its form is still checked; its value is not read)."""
    return call.key_cache.dtype in (FP8_E4M3, FP8_E5M2)


def reads_cache_scale(call: Call) -> bool:
    """Whether a call with vLLM's ``kv_cache_dtype`` reads its per-tensor scale: a
    per-tensor FP8 name (:data:`FP8_KV_CACHE_DTYPES`: 'fp8', 'fp8_e4m3', 'fp8_e5m2'); with
    any other name ('auto', 'fp8_ds_mla') the scale vLLM passes is taken and ignored, as its
    kernels ignore it (its form is still checked; its value is not read)."""
    return call.kv_cache_dtype in FP8_KV_CACHE_DTYPES


def paged_cache(name: str, what: str) -> Tensor:
    """The donated paged ``what`` cache ``name`` in vLLM's flash layout."""
    return positional(
        name,
        PAGED_CACHE,
        donated=True,
        doc=f"``[num_blocks, block_size, Hkv, D]`` paged {what} cache (vLLM's flash layout, any "
        "strides with a contiguous last dim) in qkv's dtype, float8_e4m3fn or float8_e5m2; updated "
        "in place",
    )


def cache_scale(
    name: str, of: str, *, keyword: bool = True, used=reads_typed_cache_scale
) -> Tensor:
    """The optional per-tensor scale ``name`` of an FP8 ``of`` cache (k_scale, v_scale),
    read where ``used(call)`` (an FP8 cache: :func:`reads_typed_cache_scale`, or
    :func:`reads_cache_scale` for an op with ``kv_cache_dtype``), else taken and ignored."""
    return Tensor(
        name,
        None,
        keyword=keyword,
        annotation=OPTIONAL_TENSOR,
        kind=Scale(used=used, what=FP8_SCALE_WHAT),
        optional=True,
        doc=f"float32 ``[1]`` or 0-dim per-tensor scale of an FP8 {of} cache (default 1): "
        "stored ``fp8(clamp(x / scale, -max, max))`` (E4M3 +-448, E5M2 +-57344), vLLM's "
        "convention; with a model-dtype cache it is ignored, as vLLM's kernels ignore the "
        "``layer._k_scale`` / ``_v_scale`` its attention layers pass with every cache (its "
        "form is still checked, its value is not read)",
    )


def quant_scale(name: str, what: str) -> Tensor:
    """The optional per-tensor factor ``name`` of an FP8 output (FlashInfer's convention: the
    value is multiplied by it, ``e4m3(clamp(x * scale, -448, 448))``); ``what``: what it
    quantizes, for the line of documentation."""
    return Tensor(
        name,
        None,
        annotation=OPTIONAL_TENSOR,
        kind=Scale(),
        optional=True,
        doc=f"float32 ``[1]`` or 0-dim per-tensor factor (FlashInfer's ``{name}``: multiplied, "
        f"``e4m3(clamp(x * {name}, -448, 448))``); given: {what}",
    )


QUANTIZE_DTYPES = (FP8_E4M3, FP8_E5M2)


def _check_quantize_dtype(name: str, value) -> None:
    if value is not None and not (isinstance(value, torch.dtype) and value in QUANTIZE_DTYPES):
        raise TypeError(
            f"{name} must be torch.float8_e4m3fn or torch.float8_e5m2 (None: float8_e4m3fn), "
            f"got {value!r}"
        )


def quantize_dtype(asks: str, gives: str = "gives") -> Static:
    """FlashInfer's ``quantize_dtype``: the FP8 format of the outputs the argument(s) ``asks``
    turn on (``quant_scale_q``, :func:`quant_scale`; MiniMax-M3's ``attn_fp8`` / ``index_fp8``
    flags, ``gives="give"``); None is float8_e4m3fn. The composition takes it as the static
    ``quantize_dtype``, a torch dtype (an E4M3 program is the one of before)."""
    return Static(
        "quantize_dtype",
        None,
        annotation="torch.dtype | None",
        check=_check_quantize_dtype,
        normalize=lambda value: FP8_E4M3 if value is None else value,
        schema="ScalarType?",
        doc=f"the FP8 format of the outputs ``{asks}`` {gives} (FlashInfer's "
        "``quantize_dtype``): ``torch.float8_e4m3fn`` (None, the default; clamped to +-448) or "
        f"``torch.float8_e5m2`` (clamped to +-57344); only with ``{asks}``",
    )


def check_quantize_dtype_asked(call: Call, asks: str, asked: bool, give: str) -> None:
    """``quantize_dtype`` names the format of FP8 outputs: given where no argument asks for
    them (``asked`` False; ``asks`` names the argument(s), ``give`` how to ask) it would be
    silently unused, so it is refused."""
    if call.quantize_dtype is not None and not asked:
        raise ValueError(
            f"quantize_dtype applies to the FP8 outputs {asks} for: give {give} or leave "
            "quantize_dtype None"
        )


def check_quantize_dtype_needs_scale(call: Call, scale: str) -> None:
    """:func:`check_quantize_dtype_asked` of the factor argument ``scale``
    (:func:`quant_scale`)."""
    check_quantize_dtype_asked(
        call,
        f"{scale} asks",
        getattr(call, scale) is not None,
        f"{scale} (torch.tensor(1.0) for no scaling)",
    )


# The key and value caches of a prologue that stores k and v (donated: updated in place), the
# per-tensor scales of FP8 ones, in their signature order, and the caches' outputs.
KV_CACHES = (paged_cache("key_cache", "key"), paged_cache("value_cache", "value"))
KV_SCALES = (cache_scale("k_scale", "key"), cache_scale("v_scale", "value"))
KV_CACHE_OUTPUTS = (Output("key_cache"), Output("value_cache"))  # donated: not returned


def fp8_cache_view(x, kv_cache_dtype: str | None) -> torch.dtype | None:
    """How an FP8 cache of ``kv_cache_dtype`` enters a program (a
    :meth:`~fqr.prologue.declare.TensorKind.viewed_as` rule): E4M3 as float8_e4m3fn (vLLM's
    uint8 allocation viewed so), E5M2 as its uint8 bytes (the store encodes them,
    ``fqr.ops.cache_insert(..., encoding="e5m2")``); anything else as given."""
    typed = FP8_KV_CACHE_DTYPES.get(kv_cache_dtype or "")
    if typed == FP8_E4M3 and x.dtype == torch.uint8:
        return FP8_E4M3
    if typed == FP8_E5M2 and x.dtype == FP8_E5M2:
        return torch.uint8
    return None


def cache_encoding(cache) -> str | None:
    """The ``encoding`` of :func:`fqr.ops.cache_insert` for a program's cache operand: a
    uint8 cache of a per-tensor FP8 ``kv_cache_dtype`` holds E5M2 bytes (an E4M3 one enters
    as float8_e4m3fn, :func:`fp8_cache_view`)."""
    return "e5m2" if cache.dtype == torch.uint8 else None


def cache_fp8_dtype(cache) -> torch.dtype | None:
    """The FP8 format a program's cache operand holds (an E4M3 cache enters as
    float8_e4m3fn, an E5M2 one as its uint8 bytes, :func:`fp8_cache_view`); None: the model
    dtype."""
    return {FP8_E4M3: FP8_E4M3, torch.uint8: FP8_E5M2}.get(cache.dtype)


# A preset's cache_dtype -> the cache's dtype (None: the model dtype, vLLM's "auto").
CACHE_DTYPE_NAMES = {"auto": None, "fp8e4m3": FP8_E4M3, "fp8e5m2": FP8_E5M2}
# The preset fields a paged-cache variant reads (checked by check_paged_cache_preset).
PAGED_CACHE_FIELDS = ("block_size", "cache_dtype")


def check_paged_cache_preset(variant, preset) -> None:
    """A paged-cache preset's ``block_size`` (an int >= 1) and ``cache_dtype``."""
    p = preset.params
    if not isinstance(p["block_size"], int) or p["block_size"] < 1:
        raise ValueError(f"preset {preset.name}: block_size must be an int >= 1")
    if p["cache_dtype"] not in CACHE_DTYPE_NAMES:
        raise ValueError(
            f"preset {preset.name}: cache_dtype must be one of "
            f"{', '.join(CACHE_DTYPE_NAMES)}, got {p['cache_dtype']!r}"
        )


def random_kv_caches(preset, dtype, generator, *, holds: int, slot_mapping) -> dict:
    """A paged-cache preset's cache arguments for one call, drawn in this order: ``key_cache``
    and ``value_cache`` ``[blocks, block_size, Hkv, D]`` of twice the rows ``holds`` tokens
    need plus a block, holding random values in the preset's ``cache_dtype`` (``"auto"``:
    ``dtype``; :func:`fqr.inputs.random_paged_cache`), ``slot_mapping(rows)`` over their rows,
    and for an FP8 cache per-tensor ``k_scale`` / ``v_scale`` (:func:`fqr.inputs.
    random_fp8_scales`)."""
    spec, bs = preset.spec, preset.params["block_size"]
    cache_dtype = CACHE_DTYPE_NAMES[preset.params["cache_dtype"]] or dtype
    blocks = -(-2 * holds // bs) + 1
    entry = (bs, spec.num_kv_heads, spec.head_dim)
    drawn = {
        "key_cache": random_paged_cache(blocks, entry, cache_dtype, generator),
        "value_cache": random_paged_cache(blocks, entry, cache_dtype, generator),
        "slot_mapping": slot_mapping(blocks * bs),
    }
    if cache_dtype in (FP8_E4M3, FP8_E5M2):
        drawn |= random_fp8_scales(generator)
    return drawn


# ------------------------------------------------------- MiniMax-M3's lightning-indexer heads


def check_index_head_dim(preset) -> None:
    """A MiniMax-M3 preset's ``index_head_dim``: an even int >= 2."""
    di = preset.params["index_head_dim"]
    if not isinstance(di, int) or isinstance(di, bool) or di < 2 or di % 2:
        raise ValueError(
            f"preset {preset.name}: index_head_dim must be an even int >= 2 (its heads rotate "
            f"min(rotary_dim {preset.rotary_dim}, index_head_dim) features), got {di!r}"
        )


def index_head_kwargs(preset, **more) -> dict:
    """A MiniMax-M3 preset's static arguments (and ``more``): as many indexer q heads as kv
    heads, sharded alike (vllm-ascend ``MiniMaxM3SparseAttention``); the one index_k head is
    on every rank."""
    spec = preset.spec
    return spec.head_kwargs(
        num_index_heads=spec.num_kv_heads, index_head_dim=preset.params["index_head_dim"], **more
    )


def index_row_width(call: Call) -> tuple[int, str]:
    """The width of MiniMax-M3's packed ``[q | k | v | index_q | index_k]`` row (Hi indexer q
    heads and one indexer k head, ``index_head_dim`` wide), and how it is made."""
    hq, hkv, d = call.num_heads, call.num_kv_heads, call.head_dim
    hi, di = call.num_index_heads, call.index_head_dim
    width = (hq + 2 * hkv) * d + (hi + 1) * di
    return width, (
        f"(num_heads + 2*num_kv_heads) * head_dim + (num_index_heads + 1) * index_head_dim = "
        f"({hq} + 2*{hkv}) * {d} + ({hi} + 1) * {di} = {width}"
    )


NUM_INDEX_HEADS = Static(
    "num_index_heads", annotation="int", check=positive_int, schema="int", doc="indexer q heads"
)
INDEX_HEAD_DIM = Static(
    "index_head_dim",
    annotation="int",
    check=positive_int,
    schema="int",
    doc="features per indexer head",
)
INDEX_COS_SIN_CACHE = replace(
    COS_SIN_CACHE,
    # each head group rotates min(R, its head_dim): R may pass the narrower group
    kind=Table(
        head_dim=lambda call: max(call.head_dim, call.index_head_dim),
        bound="max(head_dim, index_head_dim)",
    ),
    doc="``[max_position, R]`` cos | sin rows (vLLM layout), R even and at most "
    "max(head_dim, index_head_dim): each head group rotates min(R, its head_dim)",
)


def index_weight(name: str, of: str, *, what: str, note: str = "") -> Tensor:
    """The ``[index_head_dim]`` RMSNorm weight ``name`` of the indexer heads ``of`` (``what``:
    the message's name for its length; ``note``: the rest of its line of documentation)."""
    return replace(
        weight(name, of),
        kind=Vector(length=lambda call: call.index_head_dim, what=what),
        doc=f"``[index_head_dim]`` RMSNorm weight of {of}{note}",
    )


# ------------------------------------------------ vLLM's cache arguments (cache kernels' order)


def short_slot_mapping(cache: str, rows_of: str, note: str = "") -> Tensor:
    """vLLM's ``slot_mapping [N]``, ``N <= T`` (its cache kernels store
    ``slot_mapping.size(0)`` tokens: a batch padded for CUDA graphs stores its first N) of the
    argument ``cache``, for the tokens of ``rows_of``; ``note``: more of its documentation."""
    return positional(
        "slot_mapping",
        Slots(cache=cache, rows_of=rows_of, shorter=True),
        doc="``[N]`` int32/int64 slot of each of the first N <= T tokens: block ``s // "
        "block_size``, row ``s % block_size``; negative: padding, nothing stored; tokens "
        f"``t >= N`` are not stored (vLLM's padded CUDA-graph batches){note}",
    )


def kv_cache_dtype_param(choices: tuple[str, ...], doc: str) -> Static:
    """vLLM's positional ``kv_cache_dtype`` string (default ``"auto"``), one of ``choices``."""
    return Static(
        "kv_cache_dtype",
        "auto",
        keyword=False,
        annotation="str",
        check=choice(*choices),
        program=False,
        schema="str",
        doc=doc,
    )
