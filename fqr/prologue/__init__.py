"""The public fused ops of the prologue family, each declared once.

=======================================  ====================================================
:func:`split_qkv_rmsnorm_rope`           packed ``qkv`` -> new q, k, v: split, norm, RoPE
                                         (vLLM's packed form; :mod:`.split_qkv`)
:func:`qk_rmsnorm_rope`                  separate q, k -> new q, k (Hugging Face's
                                         separate projections; :mod:`.qk`)
:func:`split_qkv_rmsnorm_mrope`          Qwen3-VL / Qwen3.5: multimodal RoPE, the output
                                         gate (:mod:`.mrope`)
:func:`split_qkv_rmsnorm_rope_vnorm`     Gemma 4: v normalised too (:mod:`.vnorm`)
:func:`split_qkv_rope_l2norm`            Llama 4: RoPE then the L2 norm; NoPE layers'
                                         temperature (:mod:`.rope_l2norm`)
:func:`split_qkv_index_rmsnorm_rope`     MiniMax-M3's indexer heads, FP8 outputs
                                         (:mod:`.index_heads`)
:func:`split_qkv_rmsnorm_rope_cache`     norm + RoPE + the paged KV-cache insert
                                         (:mod:`.kv_cache`)
=======================================  ====================================================

Each module holds one declaration (:mod:`.declare`): the composition of :mod:`fqr.ops` that
gets traced, the parameters with their kinds, the float64 reference, the outputs, and the
variants that bind presets to it (:mod:`.variant`). The public function, its checks and fast
path, ``torch.ops.fqr.<op>`` and its fake, the golden cases, the bench cells, ``fqr lower`` and
the Ascend sweep all derive from it. Follow one call: ``fqr.split_qkv_rmsnorm_rope`` ->
:meth:`.declare.Declaration.call` (checks, then :func:`fqr.core.trace` of the composition) ->
``Backend.launch`` -> :func:`fqr.lowering.lower` -> generated source -> launch.
"""

# The declarations register in this order (the order variants and golden cases are listed in).
# isort: off
from . import split_qkv, qk, mrope, vnorm, rope_l2norm, index_heads, kv_cache

# isort: on
from .declare import DECLARATIONS, CheckedCall, Declaration, checked_calls, forget_checked_calls
from .index_heads import index_heads_prologue, split_qkv_index_rmsnorm_rope
from .kv_cache import cache_prologue, split_qkv_rmsnorm_rope_cache
from .mrope import mrope_attention_prologue, split_qkv_rmsnorm_mrope
from .qk import qk_norm_rope_prologue, qk_rmsnorm_rope
from .rope_l2norm import rope_l2norm_prologue, split_qkv_rope_l2norm
from .split_qkv import NormStats, attention_prologue, split_qkv_rmsnorm_rope
from .variant import (
    VARIANTS,
    CaseSpec,
    Variant,
    get_variant,
    golden_cases,
    program_of,
    register_variant,
    variant_of,
)
from .vnorm import split_qkv_rmsnorm_rope_vnorm, vnorm_prologue

__all__ = [
    "DECLARATIONS",
    "VARIANTS",
    "CaseSpec",
    "CheckedCall",
    "Declaration",
    "NormStats",
    "Variant",
    "attention_prologue",
    "cache_prologue",
    "checked_calls",
    "forget_checked_calls",
    "get_variant",
    "golden_cases",
    "index_heads",
    "index_heads_prologue",
    "kv_cache",
    "mrope",
    "mrope_attention_prologue",
    "program_of",
    "qk",
    "qk_norm_rope_prologue",
    "qk_rmsnorm_rope",
    "register_variant",
    "rope_l2norm",
    "rope_l2norm_prologue",
    "split_qkv",
    "split_qkv_index_rmsnorm_rope",
    "split_qkv_rmsnorm_mrope",
    "split_qkv_rmsnorm_rope",
    "split_qkv_rmsnorm_rope_cache",
    "split_qkv_rmsnorm_rope_vnorm",
    "split_qkv_rope_l2norm",
    "variant_of",
    "vnorm",
    "vnorm_prologue",
]
