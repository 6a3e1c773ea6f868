"""The public fused ops of the prologue family, each declared once.

=======================================  ====================================================
:func:`split_qkv_rmsnorm_rope`           packed ``qkv`` -> new q, k, v: split, norm, RoPE
                                         (vLLM's packed form; :mod:`.split_qkv`)
:func:`qk_rmsnorm_rope`                  separate q, k -> new q, k (Hugging Face's
                                         separate projections; :mod:`.qk`)
:func:`split_qkv_rmsnorm_mrope`          Qwen3-VL / Qwen3.5: multimodal RoPE, the output
                                         gate (:mod:`.mrope`)
:func:`qk_rope`, :func:`qk_mrope`        separate q, k -> new q, k: RoPE / multimodal RoPE
                                         without a norm (vLLM's ``rotary_emb``;
                                         :mod:`.qk_rope`)
:func:`split_qkv_rmsnorm_rope_vnorm`     Gemma 4: v normalised too (:mod:`.vnorm`)
:func:`split_qkv_rope_l2norm`            Llama 4: RoPE then the L2 norm; NoPE layers'
                                         temperature (:mod:`.rope_l2norm`)
:func:`split_qkv_layernorm_rope`         Persimmon / Chameleon: LayerNorm on q and k
                                         (:mod:`.qk_layernorm`)
:func:`split_qkv_rope_rmsnorm`           Hunyuan: RoPE then a weighted RMSNorm
                                         (:mod:`.rope_rmsnorm`)
:func:`split_qkv_index_rmsnorm_rope`     MiniMax-M3's indexer heads, FP8 outputs
                                         (:mod:`.index_heads`)
:func:`split_qkv_rmsnorm_rope_cache`     norm + RoPE + the paged KV-cache insert
                                         (:mod:`.kv_cache`)
:func:`kv_cache_insert`                  the paged KV-cache insert alone (vLLM's
                                         ``reshape_and_cache_flash``; :mod:`.kv_insert`)
=======================================  ====================================================

:func:`split_qkv_index_rmsnorm_rope_cache` (:mod:`.index_cache`) is MiniMax-M3's prologue whole:
the indexer heads, k and v into the KV cache and index_k into its own index cache, q and index_q
returned; :func:`minimax_qknorm_rope_cache` takes vllm-ascend's call to it as written.

Each module holds one declaration (:mod:`.declare`): the composition of :mod:`fqr.ops` that
gets traced, the parameters with their kinds, the float64 reference, the outputs, and the
variants that bind presets to it (:mod:`.variant`). The public function, its checks and fast
path, ``torch.ops.fqr.<op>`` and its fake, the golden cases, the bench cells, ``fqr lower`` and
the Ascend sweep all derive from it. Follow one call: ``fqr.split_qkv_rmsnorm_rope`` ->
:meth:`.declare.Declaration.call` (checks, then :func:`fqr.core.trace` of the composition) ->
``Backend.launch`` -> :func:`fqr.lowering.lower` -> generated source -> launch.
"""

import importlib
import pkgutil

from .declare import DECLARATIONS, CheckedCall, Declaration, checked_calls, forget_checked_calls
from .split_qkv import NormStats, attention_prologue
from .variant import (
    VARIANTS,
    CaseSpec,
    Variant,
    get_variant,
    golden_cases,
    presets_of,
    program_of,
    register_variant,
    variant_of,
)

# The machinery; every other module of the package is one declaration, imported here (in name
# order, after split_qkv, the base op) so that it registers: a new member of the family is a
# new file, nothing else.
MACHINERY = ("blocks", "declare", "params", "projected", "variant")
DECLARATION_MODULES = tuple(
    name
    for name in sorted(m.name for m in pkgutil.iter_modules(__path__))
    if name not in MACHINERY and name != "split_qkv"
)
for _name in DECLARATION_MODULES:
    importlib.import_module(f"{__name__}.{_name}")
del _name

# Each declared op's public function, by its name (fqr.split_qkv_rmsnorm_rope, ...).
globals().update((name, decl.function) for name, decl in DECLARATIONS.items())
# vllm-ascend's MiniMax call as its callers write it, run by split_qkv_index_rmsnorm_rope_cache
from .index_cache import minimax_qknorm_rope_cache  # noqa: E402

__all__ = [  # noqa: F822  (the declared functions are set above)
    *DECLARATIONS, "DECLARATIONS", "VARIANTS", "CaseSpec", "CheckedCall", "Declaration",
    "NormStats", "Variant", "attention_prologue", "checked_calls", "forget_checked_calls",
    "get_variant", "golden_cases", "minimax_qknorm_rope_cache", "presets_of", "program_of",
    "register_variant", "variant_of",
]  # fmt: skip
