"""``split_qkv_rope_rmsnorm``: Hunyuan's prologue, RoPE first, then a weighted RMSNorm of each
head of q and of k.

The composition (:func:`rope_rmsnorm_prologue`) is ``split_qkv`` -> ``rope`` -> ``rms_norm``
(with its weight) of q and k; the float64 reference is
:func:`fqr.reference.rope_rmsnorm_prologue`. The variant ``rope-rmsnorm`` binds Hunyuan's
presets (:mod:`.variant`). (Llama 4's weightless norm after RoPE is :mod:`.rope_l2norm`.)
"""

from __future__ import annotations

from .. import ops, reference
from ..peers import hunyuan_prologue
from . import params
from .blocks import round_to
from .declare import BACKEND, Output, declare, numerics
from .projected import projected
from .variant import CaseSpec, Variant, draw_row, register_variant, row_chain


def rope_rmsnorm_prologue(qkv, positions, cos_sin_cache, q_weight, k_weight, **s):
    """Split; rotate q and k; then RMS-normalise each head with its weight (traced into one
    program; ``s``: the declaration's statics). Unfused, the rotation rounds as HF's / vLLM's
    native rotation in the model dtype, the norm as ``HunYuanDenseV1RMSNorm``: ``round(round(x
    * rstd) * w)``."""
    d = s["head_dim"]
    q, k, v = ops.split_qkv(qkv, s["num_heads"], s["num_kv_heads"], d)
    rounding = round_to(qkv, s["numerics"])
    rotation = dict(head_dim=d, is_neox=s["is_neox"], round_to=rounding)
    q, k = (ops.rope(x, positions, cos_sin_cache, **rotation) for x in (q, k))
    norm = dict(eps=s["eps"], group_size=d, round_to=rounding)
    return ops.rms_norm(q, q_weight, **norm), ops.rms_norm(k, k_weight, **norm), v


SPLIT_QKV_ROPE_RMSNORM = declare(
    "split_qkv_rope_rmsnorm",
    rope_rmsnorm_prologue,
    (
        params.QKV,
        params.POSITIONS,
        params.COS_SIN_CACHE,
        params.Q_WEIGHT,
        params.K_WEIGHT,
        params.NUM_HEADS,
        params.NUM_KV_HEADS,
        params.HEAD_DIM,
        params.with_default(params.EPS, 1e-5),
        params.IS_NEOX,
        numerics("fused", ("fused", "unfused")),
        BACKEND,
    ),
    (Output("q"), Output("k"), Output("v", copy=True)),
    reference=reference.rope_rmsnorm_prologue,
    static_checks=(params.heads_divide,),
    doc=f"""
    Hunyuan's prologue: split the packed row; rotate q and k, then RMS-normalise each head
    with its weight; return new q, k, v (v a copy).

    Per head: ``y = rope(x) * rsqrt(mean(rope(x)^2) + eps) * w`` -- HF
    ``HunYuanDenseV1Attention`` / ``HunYuanMoEV1Attention`` (``apply_rotary_pos_emb``, then
    ``query_layernorm`` / ``key_layernorm``, ``eps = rms_norm_eps``; vLLM's HunYuan the same
    with ``use_qk_norm``). The reference it matches is
    :func:`fqr.reference.rope_rmsnorm_prologue`. ``numerics="unfused"`` rounds as those modules
    (the rotation in the model dtype, ``x * rstd`` rounded before the weight multiplies it).

    {params.EXAMPLE_WITH_TABLE}
        >>> qkv = torch.randn(2, (4 + 2 * 2) * 64, dtype=torch.bfloat16)
        >>> w = torch.ones(64, dtype=torch.bfloat16)
        >>> q, k, v = fqr.split_qkv_rope_rmsnorm(
        ...     qkv, torch.tensor([3, 4]), table, w, w, num_heads=4, num_kv_heads=2, head_dim=64
        ... )
        >>> q.float().view(2, 4, 64).pow(2).mean(-1).round().tolist()  # normalised after RoPE
        [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    """,
)
# the same op from the hidden states: x @ w_qkv.T, then this prologue (.projected)
SPLIT_QKV_ROPE_RMSNORM_PROJ = projected(
    SPLIT_QKV_ROPE_RMSNORM,
    f"""{params.EXAMPLE_WITH_TABLE}
        >>> x = torch.randn(2, 80, dtype=torch.bfloat16)
        >>> w_qkv = torch.randn((4 + 2 * 2) * 64, 80, dtype=torch.bfloat16)
        >>> w = torch.ones(64, dtype=torch.bfloat16)
        >>> q, k, v = fqr.split_qkv_rope_rmsnorm_proj(
        ...     x, w_qkv, torch.tensor([3, 4]), table, w, w, num_heads=4, num_kv_heads=2,
        ...     head_dim=64,
        ... )
        >>> q.float().view(2, 4, 64).pow(2).mean(-1).round().tolist()  # normalised after RoPE
        [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]""",
)

split_qkv_rope_rmsnorm = SPLIT_QKV_ROPE_RMSNORM.function


# ------------------------------------------------------------------------- the variant


def _kwargs(preset) -> dict:
    spec = preset.spec
    return dict(
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        eps=spec.eps,
        is_neox=spec.is_neox,
    )


# Hunyuan-A13B: RoPE (NeoX halves, NTK-alpha base), then the weighted per-head RMSNorm.
ROPE_RMSNORM = register_variant(
    Variant(
        "rope-rmsnorm",
        SPLIT_QKV_ROPE_RMSNORM,
        kwargs=_kwargs,
        draw_inputs=draw_row,
        eager_chain=row_chain(hunyuan_prologue),
        golden=(
            CaseSpec("hunyuan-a13b", "bf16", 5, tp=8),
            CaseSpec("hunyuan-a13b", "fp16", 3, "unfused", tp=8),
            CaseSpec("hunyuan-a13b", "bf16", 5, tp=16, hidden=200),  # projected form
        ),
    )
)
