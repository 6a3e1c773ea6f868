"""The pure ops of the attention prologue, one module per op family.

Each module defines a :class:`fqr.core.Primitive` with its rules beside it: reference ``impl``,
shape/dtype rule (``abstract``), lowering facts (``facts``: what the kernel planner needs) and
emit rule (``lower``: the lines of Triton source). ARCHITECTURE.md, "How to add an op".
"""

from ..core import Section
from .byte_cache import (
    cache_insert_bytes,
    cache_insert_bytes_p,
    cache_insert_fp8_tiles,
    cache_insert_fp8_tiles_p,
)
from .cache import cache_insert, cache_insert_p
from .fp8 import quantize_fp8, quantize_fp8_p
from .layer_norm import layer_norm, layer_norm_p
from .mrope import mrope, mrope_p
from .norm import rms_norm, rms_norm_p
from .precision import reduce_precision, reduce_precision_p
from .projection import linear, linear_p
from .rope import rope, rope_p
from .split import (
    QKV_LAYOUTS,
    check_qkv_layout,
    codegen_shards,
    qkv_layout_sections,
    split_heads,
    split_heads_p,
    split_qkv,
)
from .temperature import attn_temperature, attn_temperature_p

__all__ = [
    "Section",
    "split_heads",
    "split_qkv",
    "QKV_LAYOUTS",
    "check_qkv_layout",
    "codegen_shards",
    "qkv_layout_sections",
    "rms_norm",
    "linear",
    "linear_p",
    "layer_norm",
    "layer_norm_p",
    "rope",
    "reduce_precision",
    "quantize_fp8",
    "cache_insert",
    "split_heads_p",
    "rms_norm_p",
    "rope_p",
    "reduce_precision_p",
    "mrope",
    "mrope_p",
    "quantize_fp8_p",
    "cache_insert_p",
    "cache_insert_bytes",
    "cache_insert_bytes_p",
    "cache_insert_fp8_tiles",
    "cache_insert_fp8_tiles_p",
    "attn_temperature",
    "attn_temperature_p",
]
