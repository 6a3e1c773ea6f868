"""``split_qkv_rmsnorm_rope_vnorm``: Gemma 4's prologue, v normalised per head without weight.

The composition (:func:`vnorm_prologue`) is the split op's per-head form (norm + RoPE of q and
k) plus ``rms_norm`` of v without weight; the float64 reference is
:func:`fqr.reference.vnorm_prologue`. The variant ``split-qkv-vnorm`` binds Gemma 4's presets
(:mod:`.variant`).
"""

from __future__ import annotations

from dataclasses import replace

from .. import ops, reference
from ..peers import gemma4_prologue
from . import params
from .blocks import round_to, split_head_norm_rope
from .declare import BACKEND, NUMERICS, Call, Output, declare, numerics
from .projected import projected
from .variant import CaseSpec, Variant, draw_row, head_kwargs, register_variant, row_chain


def vnorm_prologue(qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, **s):
    """Gemma 4: split, norm + RoPE of q and k (the split op's per-head form: the biases, when
    given, added after the weight and before RoPE), and v normalised per head without weight
    or bias (traced into one program; ``s``: the declaration's statics)."""
    weights, biases = (q_weight, k_weight), (q_bias, k_bias)
    q, k, v = split_head_norm_rope(qkv, positions, cos_sin_cache, weights, s, biases=biases)
    rounding = round_to(qkv, s["numerics"])
    v = ops.rms_norm(v, None, eps=s["eps"], group_size=s["head_dim"], round_to=rounding)
    return q, k, v


def _gemma4(call: Call) -> None:
    if call.cos_sin_cache is None:
        raise ValueError("cos_sin_cache is required (Gemma 4 rotates every layer)")


SPLIT_QKV_RMSNORM_ROPE_VNORM = declare(
    "split_qkv_rmsnorm_rope_vnorm",
    vnorm_prologue,
    (
        params.QKV,
        params.POSITIONS,
        replace(params.COS_SIN_CACHE, optional=True),  # required: _gemma4 says why
        params.Q_WEIGHT,
        params.K_WEIGHT,
        params.NUM_HEADS,
        params.NUM_KV_HEADS,
        params.HEAD_DIM,
        *params.NORM_ROPE,
        numerics("fused", NUMERICS),
        BACKEND,
    ),
    (Output("q"), Output("k"), Output("v")),
    reference=reference.vnorm_prologue,
    static_checks=(params.heads_divide, params.biases_together, _gemma4),
    doc=f"""
    Gemma 4's prologue: split the packed row, RMS-normalise and rotate q and k, and
    RMS-normalise v per head without weight; return new q, k, v.

    Arguments as :func:`fqr.split_qkv_rmsnorm_rope` with ``norm="head"`` (weights ``[D]``). Per
    head (``fqr.ops``): ``q, k = rope(x * rsqrt(mean(x^2) + eps) * (weight_offset + w) [+ b])``
    and ``v = v * rsqrt(mean(v^2) + eps)``, the same ``eps`` (the model's ``rms_norm_eps``);
    the optional ``q_bias``/``k_bias`` (``[D]``, given together) are added after the weight and
    before RoPE, as vllm-ascend's kernel adds them; v takes no bias. This is
    vLLM's ``Gemma4Attention.forward`` (``q_norm``, ``k_norm``, ``rotary_emb``, ``v_norm =
    RMSNorm(head_dim, has_weight=False)``) and vllm-ascend's ``split_qkv_rmsnorm_rope_vnorm``;
    the reference it matches is :func:`fqr.reference.vnorm_prologue`. Gemma 4's full-attention
    layers (head_dim 512) take their proportional RoPE table as a full-width ``cos_sin_cache``
    (:mod:`fqr.rope_cache`); their ``attention_k_eq_v`` checkpoints load k's weights into v's
    slot, so the row keeps its ``[q | k | v]`` layout. ``numerics="unfused"`` rounds where vLLM's
    native modules do (the v norm once, fp32 inside); ``"unfused-hf"`` as Hugging Face's
    Gemma 3n attention (``Gemma3nRMSNorm``): q's and k's norms multiply the weight in fp32 and
    round once, as the split op's ``unfused-hf`` per-head norms, v's and RoPE as ``unfused``.

    {params.EXAMPLE_WITH_TABLE}
        >>> qkv = torch.randn(2, (4 + 2 * 2) * 64, dtype=torch.bfloat16)
        >>> w = torch.ones(64, dtype=torch.bfloat16)
        >>> q, k, v = fqr.split_qkv_rmsnorm_rope_vnorm(
        ...     qkv, torch.tensor([0, 1]), table, w, w, num_heads=4, num_kv_heads=2, head_dim=64
        ... )
        >>> v.float().pow(2).mean(-1).round().tolist()  # v's heads RMS-normalised, no weight
        [1.0, 1.0]
    """,
)
# the same op from the hidden states: x @ w_qkv.T, then this prologue (.projected)
SPLIT_QKV_RMSNORM_ROPE_VNORM_PROJ = projected(
    SPLIT_QKV_RMSNORM_ROPE_VNORM,
    f"""{params.EXAMPLE_WITH_TABLE}
        >>> x = torch.randn(2, 80, dtype=torch.bfloat16)
        >>> w_qkv = torch.randn((4 + 2 * 2) * 64, 80, dtype=torch.bfloat16)
        >>> w = torch.ones(64, dtype=torch.bfloat16)
        >>> q, k, v = fqr.split_qkv_rmsnorm_rope_vnorm_proj(
        ...     x, w_qkv, torch.tensor([0, 7]), table, w, w, num_heads=4, num_kv_heads=2,
        ...     head_dim=64,
        ... )
        >>> v.shape
        torch.Size([2, 128])""",
)

split_qkv_rmsnorm_rope_vnorm = SPLIT_QKV_RMSNORM_ROPE_VNORM.function


# ------------------------------------------------------------------------- the variant


# Gemma 4's v norm: head_dim 256 (sliding layers) and 512 (full layers, the proportional table).
VNORM = register_variant(
    Variant(
        "split-qkv-vnorm",
        SPLIT_QKV_RMSNORM_ROPE_VNORM,
        kwargs=head_kwargs,
        draw_inputs=draw_row,
        eager_chain=row_chain(gemma4_prologue),
        golden=(
            CaseSpec("gemma4-31b-sliding", "bf16", 7, tp=8),
            CaseSpec("gemma4-31b-sliding", "fp16", 1, "unfused", tp=8),
            CaseSpec("gemma4-31b-sliding", "bf16", 5, "unfused-hf", tp=8),
            CaseSpec("gemma4-31b-full", "bf16", 7, tp=8, max_position=1 << 18),
            CaseSpec("gemma4-31b-full", "bf16", 1, "unfused", tp=8),
            # the projected form: v normalised from the unrounded product, head_dim 512 (a
            # shorter table: the whole one is 512 MB of fp32 to rebuild at each load)
            CaseSpec("gemma4-31b-full", "fp16", 1, tp=16, max_position=1 << 15, hidden=64),
        ),
    )
)
