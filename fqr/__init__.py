"""fqr: fused QKV-split, RMSNorm and RoPE.

A JAX-style functional core (``fqr.ops``, ``fqr.core``) whose compositions are lowered to one
generated Triton kernel (``fqr.lowering``) for NVIDIA GPUs and Ascend NPUs, with golden-file
numerics (``fqr.golden``) and a vLLM-style multi-rank runtime (``fqr.runtime``).

Every public fused op (``fqr.split_qkv_rmsnorm_rope``, ...) is one declaration in
``fqr/prologue/``, exported here under its name. Follow one call:
:func:`split_qkv_rmsnorm_rope` (``fqr/prologue/split_qkv.py``) -> :func:`trace`
(``fqr/core.py``) -> :func:`lower` (``fqr/lowering``) -> generated source -> launch.
"""

from . import (
    fusion,  # noqa: F401  (the Inductor pass; fqr.prologue registers torch.ops.fqr.*)
    ops,
    presets,
)
from ._version import __version__
from .backends import BACKENDS, BackendUnavailable, available_backends
from .core import Aval, Program, TraceError, eval_program, spec, trace
from .logger import configure_from_env
from .lowering.bundle import KernelBundleError, use_kernel_bundle
from .presets import PRESETS, Preset, get_preset
from .projection import proj_dispatch
from .prologue import DECLARATIONS, NormStats, attention_prologue, minimax_qknorm_rope_cache
from .rope_cache import rope_cos_sin_cache

configure_from_env()

# The public fused ops, one per declaration (fqr.prologue.DECLARATIONS).
globals().update((name, decl.function) for name, decl in DECLARATIONS.items())

__all__ = [  # noqa: F822  (the declared ops are set above)
    *DECLARATIONS,
    "__version__",
    "attention_prologue",
    "minimax_qknorm_rope_cache",
    "proj_dispatch",
    "NormStats",
    "ops",
    "presets",
    "PRESETS",
    "Preset",
    "get_preset",
    "trace",
    "spec",
    "Aval",
    "Program",
    "TraceError",
    "eval_program",
    "rope_cos_sin_cache",
    "BACKENDS",
    "BackendUnavailable",
    "available_backends",
    "lower",
    "jit",
    "use_kernel_bundle",
    "KernelBundleError",
]


def __getattr__(name):
    # The lowering imports triton lazily; keep `import fqr` light and triton-free.
    if name in ("lower", "jit"):
        from . import lowering

        return getattr(lowering, name)
    raise AttributeError(f"module 'fqr' has no attribute {name!r}")
