"""``split_qkv_index_rmsnorm_rope``: MiniMax-M3's sparse-attention prologue with its
lightning-indexer heads (vllm-ascend's ``split_qkv_index_rmsnorm_rope``), FP8 outputs (E4M3,
or E5M2 with ``quantize_dtype``) when asked.

The composition (:func:`index_heads_prologue`) is ``split_heads`` in five -> per-head norm +
RoPE of q, k, index_q and index_k -> ``quantize_fp8`` where asked; the float64 reference is
:func:`fqr.reference.index_prologue`. The variant ``index-heads`` binds MiniMax-M3's presets
(:mod:`.variant`).
"""

from __future__ import annotations

from dataclasses import replace

from .. import ops, reference
from ..inputs import random_index_row
from ..peers import minimax_index_prologue
from . import params
from .blocks import index_split_norm_rope
from .declare import (
    BACKEND,
    Output,
    Rows,
    Static,
    Vector,
    declare,
    flag,
    numerics,
)
from .projected import projected
from .variant import CaseSpec, Variant, register_variant, spec_chain


def index_heads_prologue(
    qkv, positions, cos_sin_cache, q_weight, k_weight, index_q_weight, index_k_weight, q_bias,
    k_bias, **s,
):  # fmt: skip
    """MiniMax-M3's sparse-attention prologue (traced into one program): the row ``[q | k | v
    | index_q | index_k]`` split in five, q and k normalised per ``head_dim`` head (plus
    ``q_bias``/``k_bias`` when given, after the weight, before RoPE), index_q and the one
    index_k head per ``index_head_dim`` head, all four rotated by the same table, each group
    over ``min(R, its head_dim)`` features (:func:`.blocks.group_rotary_dim`);
    ``attn_fp8`` / ``index_fp8`` saturate q, k, v / index_q, index_k to the range of
    ``quantize_dtype`` (E4M3 +-448, E5M2 +-57344) and store them in it."""
    q, k, v, iq, ik = index_split_norm_rope(
        qkv, None, positions, cos_sin_cache, (q_weight, k_weight),
        (index_q_weight, index_k_weight), s, biases=(q_bias, k_bias),
    )  # fmt: skip
    attn, index = [q, k, v], [iq, ik]
    dtype = s["quantize_dtype"]
    if s["attn_fp8"]:
        attn = [ops.quantize_fp8(x, dtype=dtype) for x in attn]
    if s["index_fp8"]:
        index = [ops.quantize_fp8(x, dtype=dtype) for x in index]
    return (*attn, *index)


_HEAD_WEIGHT = Vector(what="its head_dim")


def _fp8_asked(call) -> None:
    params.check_quantize_dtype_asked(
        call, "attn_fp8 / index_fp8 ask", call.attn_fp8 or call.index_fp8,
        "attn_fp8=True or index_fp8=True",
    )  # fmt: skip


SPLIT_QKV_INDEX_RMSNORM_ROPE = declare(
    "split_qkv_index_rmsnorm_rope",
    index_heads_prologue,
    (
        replace(
            params.QKV,
            kind=Rows(what="[T, q | k | v | index_q | index_k]", width=params.index_row_width),
            doc="``[T, (Hq + 2*Hkv)*D + (Hi + 1)*Di]``: the packed row ``[q | k | v | index_q | "
            "index_k]``, Hi indexer q heads and ONE indexer k head shared by them, both Di wide",
        ),
        params.POSITIONS,
        params.INDEX_COS_SIN_CACHE,
        replace(params.Q_WEIGHT, kind=_HEAD_WEIGHT),
        replace(params.K_WEIGHT, kind=_HEAD_WEIGHT),
        params.index_weight("index_q_weight", "index_q", what="its head_dim"),
        params.index_weight("index_k_weight", "index_k", what="its head_dim"),
        params.NUM_HEADS,
        params.NUM_KV_HEADS,
        params.HEAD_DIM,
        replace(params.NUM_INDEX_HEADS, doc="indexer q heads (MiniMax-M3: as many as kv heads)"),
        params.INDEX_HEAD_DIM,
        params.EPS,
        params.IS_NEOX,
        params.Q_BIAS,
        params.K_BIAS,
        params.with_default(params.WEIGHT_OFFSET, 1.0),
        Static(
            "attn_fp8",
            False,
            annotation="bool",
            check=flag,
            schema="bool",
            doc="q, k, v returned as FP8 of ``quantize_dtype``: float8_e4m3fn (the default), "
            "clamp(y, -448, 448) rounded to nearest even; float8_e5m2, clamp(y, -57344, 57344)",
        ),
        Static(
            "index_fp8",
            False,
            annotation="bool",
            check=flag,
            schema="bool",
            doc="index_q, index_k returned as FP8 of ``quantize_dtype`` likewise",
        ),
        numerics(),
        params.quantize_dtype("attn_fp8`` / ``index_fp8", "give"),
        BACKEND,
    ),
    (
        Output("q"),
        Output("k"),
        Output("v"),  # a copy, but an FP8 one saturates: compared like the others
        Output("index_q", head_dim=lambda s: s["index_head_dim"]),
        Output("index_k", head_dim=lambda s: s["index_head_dim"]),
    ),
    reference=reference.index_prologue,
    static_checks=(params.heads_divide, params.biases_together, _fp8_asked),
    doc=f"""
    MiniMax-M3's sparse-attention prologue with its lightning-indexer heads, fused: vllm-
    ascend's ``split_qkv_index_rmsnorm_rope``. Returns new ``(q, k, v, index_q, index_k)``.

    Per head of q and k (width D) and of index_q and index_k (width Di), with its own weight
    (``[D]``, ``[D]``, ``[Di]``, ``[Di]``)::

        y = x * rsqrt(mean(x^2) + eps) * (weight_offset + w)      # Gemma (1 + w) by default

    plus, for q and k only, ``q_bias``/``k_bias`` (``[D]``, optional, given together) added to
    ``y`` before RoPE, as vllm-ascend's kernel adds them (the index heads and v take none);
    then NeoX (or GPT-J) RoPE of the first ``r = min(R, d)`` features of every head of all
    four, ``d`` the group's head width (D for q and k, Di for index_q and index_k), R the
    ``cos_sin_cache`` width (R <= max(D, Di)), from the same rows ``row =
    cos_sin_cache[positions]`` (MiniMax-M3's one ``rotary_emb`` for both): ``cos = row[:r/2]``,
    ``sin = row[R/2 : R/2 + r/2]``, as vllm-ascend's kernel rotates each group (index head_dim
    48 under a 64- or 128-wide table rotates 48 features); v is copied. ``attn_fp8``: q, k and v are
    returned as ``float8_e4m3fn``, ``clamp(y, -448, 448)`` rounded to nearest-even E4M3;
    ``index_fp8`` the same for index_q and index_k. The scale is 1, as vllm-ascend's kernel
    writes it (``clamp(y, -448, 448).to(float8_e4m3fn)``, no scale argument). With
    ``quantize_dtype=torch.float8_e5m2`` (FlashInfer's argument of that name) those outputs
    are ``float8_e5m2`` instead, ``clamp(y, -57344, 57344)`` rounded to nearest-even E5M2
    (values past 448 keep their magnitude). Otherwise the
    outputs are in qkv's dtype: q ``[T, Hq*D]``, k and v ``[T, Hkv*D]``, index_q ``[T,
    Hi*Di]``, index_k ``[T, Di]``.

    The reference it matches is :func:`fqr.reference.index_prologue`. ``numerics`` as
    :func:`fqr.split_qkv_rmsnorm_rope` (``unfused``: vLLM's ``GemmaRMSNorm`` then
    ``RotaryEmbedding.forward_native`` in the model dtype, then clamp and cast for FP8).
    ``quantize_dtype`` given without ``attn_fp8`` or ``index_fp8`` is refused (it would be
    unused).

    {params.EXAMPLE_WITH_TABLE}
        >>> width = (4 + 2 * 2) * 64 + (2 + 1) * 64  # q | k | v | 2 index_q heads | index_k
        >>> qkv = torch.randn(2, width, dtype=torch.bfloat16)
        >>> w = torch.zeros(64, dtype=torch.bfloat16)  # (1 + w) weights: weight_offset=1.0
        >>> q, k, v, index_q, index_k = fqr.split_qkv_index_rmsnorm_rope(
        ...     qkv, torch.tensor([0, 1]), table, w, w, w, w, num_heads=4, num_kv_heads=2,
        ...     head_dim=64, num_index_heads=2, index_head_dim=64, attn_fp8=True,
        ... )
        >>> q.dtype, index_q.dtype, index_q.shape, index_k.shape
        (torch.float8_e4m3fn, torch.bfloat16, torch.Size([2, 128]), torch.Size([2, 64]))
    """,
)
# the same op from the hidden states: x @ w_qkv.T, then this prologue (.projected)
SPLIT_QKV_INDEX_RMSNORM_ROPE_PROJ = projected(
    SPLIT_QKV_INDEX_RMSNORM_ROPE,
    f"""{params.EXAMPLE_WITH_TABLE}
        >>> x = torch.randn(2, 80, dtype=torch.bfloat16)
        >>> w_qkv = torch.randn((4 + 2 * 2) * 64 + (2 + 1) * 64, 80, dtype=torch.bfloat16)
        >>> w = torch.zeros(64, dtype=torch.bfloat16)  # (1 + w) weights: weight_offset=1.0
        >>> q, k, v, index_q, index_k = fqr.split_qkv_index_rmsnorm_rope_proj(
        ...     x, w_qkv, torch.tensor([0, 1]), table, w, w, w, w, num_heads=4, num_kv_heads=2,
        ...     head_dim=64, num_index_heads=2, index_head_dim=64, attn_fp8=True,
        ... )
        >>> q.dtype, index_q.dtype, index_q.shape, index_k.shape
        (torch.float8_e4m3fn, torch.bfloat16, torch.Size([2, 128]), torch.Size([2, 64]))""",
)

split_qkv_index_rmsnorm_rope = SPLIT_QKV_INDEX_RMSNORM_ROPE.function


# ------------------------------------------------------------------------- the variant


def _check_preset(variant: Variant, preset) -> None:
    params.check_index_head_dim(preset)
    for name in ("attn_fp8", "index_fp8"):
        if not isinstance(preset.params[name], bool):
            raise ValueError(f"preset {preset.name}: {name} must be a bool")


def _kwargs(preset) -> dict:
    """MiniMax-M3's static arguments (:func:`.params.index_head_kwargs`) and its FP8 outputs."""
    p = preset.params
    return params.index_head_kwargs(preset, attn_fp8=p["attn_fp8"], index_fp8=p["index_fp8"])


def _draw(variant, preset, tokens, dtype, generator, *, max_position, positions_dtype, bias):
    kw = _kwargs(preset)
    return random_index_row(
        preset.spec, tokens, kw["num_index_heads"], kw["index_head_dim"], dtype, generator,
        max_position=max_position, positions_dtype=positions_dtype,
    )  # fmt: skip


def _peer_kwargs(preset) -> dict:
    """What the peer takes besides the spec: the indexer heads and the FP8 outputs."""
    return {k: v for k, v in _kwargs(preset).items() if "index" in k or "fp8" in k}


# MiniMax-M3's indexer heads: bf16 and FP8 E4M3 outputs (v with outliers past +-448).
INDEX_HEADS = register_variant(
    Variant(
        "index-heads",
        SPLIT_QKV_INDEX_RMSNORM_ROPE,
        kwargs=_kwargs,
        draw_inputs=_draw,
        eager_chain=spec_chain(minimax_index_prologue, _peer_kwargs),
        params=("index_head_dim", "attn_fp8", "index_fp8"),
        check_preset=_check_preset,
        golden=(
            CaseSpec("minimax-m3", "bf16", 7, tp=8),
            CaseSpec("minimax-m3", "bf16", 1, "unfused", tp=4),
            CaseSpec("minimax-m3-fp8", "bf16", 7, tp=8),
            # the projected form (a shorter table: 2^20 rows whole at each load)
            CaseSpec("minimax-m3", "bf16", 7, tp=16, max_position=1 << 16, hidden=80),
        ),
    )
)
