"""``qk_rmsnorm_rope``: per-head RMSNorm + RoPE of separate q and k (Hugging Face's separate
projections; the no-split sibling of ``split_qkv_rmsnorm_rope``).

The composition (:func:`qk_norm_rope_prologue`) is ``rms_norm`` -> ``rope`` of q and of k; the
float64 reference is :func:`fqr.reference.qk_prologue`. ``k=None`` is q alone (vLLM's
``rotary_emb(positions, q, None)`` after ``q_norm``, as Gemma 4's KV-shared and MTP draft layers
run it). This module has no preset variant: the fusion pass and the drop-in examples call it.
"""

from __future__ import annotations

from .. import reference
from . import params
from .blocks import head_norm_rope
from .declare import BACKEND, MISSING, Call, Output, Rows, Tensor, Vector, declare, numerics


def qk_norm_rope_prologue(q, k, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, **s):
    """Per-head norm + RoPE of separate q and k (traced into one program); ``k`` None: q
    alone, the output ``(q,)``."""
    weights, biases = (q_weight, k_weight), (q_bias, k_bias)
    q, k = head_norm_rope(q, k, positions, cos_sin_cache, weights, s, biases=biases)
    return (q,) if k is None else (q, k)


def _q_alone(call: Call) -> None:
    if call.k is None:
        for other in ("k_weight", "k_bias"):
            if getattr(call, other) is not None:
                raise ValueError(f"{other} must be None when k is None (q alone)")
    elif call.k_weight is None:
        raise ValueError("k_weight is required when norm='head'")
    if call.q_bias is not None and call.k is not None and call.k_bias is None:
        raise ValueError("q_bias and k_bias must be given together")
    if call.k_bias is not None and call.q_bias is None:
        raise ValueError("q_bias and k_bias must be given together")


def returns_q_alone(call: Call, outs: tuple):
    """``(q, k)``, or ``(q, None)`` for q alone."""
    return (outs[0], None) if call.k is None else tuple(outs)


Q_ROWS = params.positional(
    "q",
    Rows(what="[T, heads*head_dim]", multiple_of="head_dim"),
    doc="``[T, Hq*D]`` q rows (bf16/fp16/fp32)",
)
K_ROWS = Tensor(
    "k",
    MISSING,
    keyword=False,
    annotation=params.OPTIONAL_TENSOR,
    kind=Rows(what="[T, heads*head_dim]", multiple_of="head_dim", like="q"),
    optional=True,
    doc="``[T, Hkv*D]`` k rows in q's dtype, or None: q alone",
)
Q_POSITIONS = params.positions_of("q")

QK_RMSNORM_ROPE = declare(
    "qk_rmsnorm_rope",
    qk_norm_rope_prologue,
    (
        Q_ROWS,
        K_ROWS,
        Q_POSITIONS,
        params.COS_SIN_CACHE,
        params.Q_WEIGHT,
        Tensor(
            "k_weight",
            MISSING,
            keyword=False,
            annotation=params.OPTIONAL_TENSOR,
            kind=Vector(),
            optional=True,
            doc="``[head_dim]`` RMSNorm weight of k (None with k None)",
        ),
        params.HEAD_DIM,
        *params.NORM_ROPE,
        numerics(),
        BACKEND,
    ),
    (Output("q"), Output("k", present=lambda call: call.k is not None)),
    reference=reference.qk_prologue,
    static_checks=(_q_alone,),
    returns=returns_q_alone,
    doc=f"""
    RMS-normalise each head of ``q [T, Hq*D]`` and ``k [T, Hkv*D]``, then rotate them.

    Same math, arguments and numerics modes as :func:`fqr.split_qkv_rmsnorm_rope` with
    ``norm="head"``, minus the split (reference: :func:`fqr.reference.qk_prologue`). Returns
    new contiguous ``q`` and ``k`` in q's dtype.

    ``k=None`` (with ``k_weight``/``k_bias`` None): q alone, returned as ``(q, None)`` -- vLLM's
    ``rotary_emb(positions, q, None)`` after ``q_norm``, as Gemma 4's KV-shared and MTP draft
    layers run it (their keys come from another layer's cache).

    {params.EXAMPLE_WITH_TABLE}
        >>> q = torch.randn(2, 4 * 64, dtype=torch.bfloat16)  # 4 q heads of 64
        >>> k = torch.randn(2, 2 * 64, dtype=torch.bfloat16)  # 2 kv heads
        >>> w = torch.ones(64, dtype=torch.bfloat16)
        >>> q, k = fqr.qk_rmsnorm_rope(q, k, torch.tensor([5, 9]), table, w, w, head_dim=64)
        >>> q.shape, k.shape
        (torch.Size([2, 256]), torch.Size([2, 128]))
    """,
)

qk_rmsnorm_rope = QK_RMSNORM_ROPE.function
