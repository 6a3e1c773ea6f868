"""Graph fusion: the fused prologue as torch custom ops, and an Inductor pass that puts them
into real model code.

* ``torch.ops.fqr.split_qkv_rmsnorm_rope`` / ``torch.ops.fqr.qk_rmsnorm_rope`` (and every
  other member of the family): derived from the ops' declarations (:mod:`fqr.prologue.declare`),
  registered when ``fqr`` is imported;
* :func:`qk_rmsnorm_rope`: the no-split prologue for models with separate q/k projections
  (defined beside the split one in :mod:`fqr.prologue`, importable from here too);
* :func:`backend` / :class:`FusionPass` (:mod:`fqr.fusion.fusion_pass`): rewrite vLLM- and
  Hugging Face-style unfused prologues (:mod:`fqr.unfused`) with the patterns of
  :mod:`fqr.fusion.patterns`;
* :mod:`fqr.fusion.coalesce`: the split coalescing the pass runs before matching;
* :mod:`fqr.fusion.models`, :mod:`fqr.fusion.evaluate`: small vLLM-style models and the
  fused-vs-unfused comparison behind ``fqr fuse``;
* :mod:`fqr.fusion.hf_models`, :mod:`fqr.fusion.compiled`: Hugging Face Qwen3 and the
  vLLM-shaped stack compiled with and without the pass on a GPU (``fqr fuse --device cuda``).

Supported: torch 2.11 and newer.

Mark the token dimension dynamic with ``torch._dynamo.mark_dynamic`` (as vLLM does) rather than
``torch.compile(dynamic=True)``: the latter also turns float attributes such as a norm's eps into
graph inputs, and a pattern cannot read a runtime eps.

The pattern and backend modules import Inductor; they load on first use.
"""

from ..prologue.qk import qk_norm_rope_prologue, qk_rmsnorm_rope

__all__ = [
    "qk_rmsnorm_rope",
    "qk_norm_rope_prologue",
    "backend",
    "FusionPass",
    "FusionBackend",
    "FusionStats",
    "fusion_patterns",
]


def __getattr__(name):
    if name in ("backend", "FusionPass", "FusionBackend", "FusionStats", "fusion_patterns"):
        from . import fusion_pass

        return getattr(fusion_pass, name)
    raise AttributeError(f"module 'fqr.fusion' has no attribute {name!r}")
