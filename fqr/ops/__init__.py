"""The pure ops of the attention prologue, one module per op family.

Each module defines a :class:`fqr.core.Primitive` with its rules beside it: reference ``impl``,
shape/dtype rule (``abstract``) and Triton lowering rule (``lower``).
"""

from .norm import rms_norm, rms_norm_p
from .precision import reduce_precision, reduce_precision_p
from .rope import rope, rope_p
from .split import split_qkv, split_qkv_p

__all__ = [
    "split_qkv",
    "rms_norm",
    "rope",
    "reduce_precision",
    "split_qkv_p",
    "rms_norm_p",
    "rope_p",
    "reduce_precision_p",
]
