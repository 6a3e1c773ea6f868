"""``split_qkv_rope_l2norm``: Llama 4's prologue, RoPE first, then a weightless L2 norm; on its
NoPE layers neither, q scaled by the attention temperature.

The composition (:func:`rope_l2norm_prologue`) is ``split_qkv`` -> ``rope`` -> ``rms_norm``
without weight of q and k, or on NoPE layers ``attn_temperature`` of q; the float64 reference is
:func:`fqr.reference.rope_l2norm_prologue`. Variants ``rope-l2norm`` and ``nope-temperature``
bind Llama 4's presets (:mod:`.variant`).
"""

from __future__ import annotations

from dataclasses import replace

from .. import ops, reference
from ..peers import llama4_prologue
from ..validate import check_finite_scalar
from . import params
from .blocks import round_to
from .declare import BACKEND, Call, Output, Positions, Static, declare, numerics
from .projected import projected
from .variant import CaseSpec, Variant, draw_row, register_variant

MAX_TEMPERATURE_POSITION = 1 << 24  # positions are exact as fp32 numbers below this
# A NoPE layer's preset fields: the attention temperature's (the op's statics of those names)
TEMPERATURE_FIELDS = ("floor_scale", "attn_scale")


def rope_l2norm_prologue(qkv, positions, cos_sin_cache, **s):
    """Llama 4: split; on RoPE layers (a ``cos_sin_cache``) rotate q and k, then L2-normalise
    each head without weight; on NoPE layers (None) neither, and with ``floor_scale`` q scaled
    by the attention temperature (traced into one program). Unfused, vLLM rounds after the
    rotation (``rope``'s ``round_to``) and once after the norm (fp32 ``qk_norm(q.float())``);
    Hugging Face rotates in fp32 and rounds once (``unfused-hf``: the rotation exact, then one
    ``reduce_precision``)."""
    d = s["head_dim"]
    q, k, v = ops.split_qkv(qkv, s["num_heads"], s["num_kv_heads"], d)
    rounding = round_to(qkv, s["numerics"])
    if cos_sin_cache is not None:
        hf = s["numerics"] == "unfused-hf"
        rotation = dict(head_dim=d, is_neox=s["is_neox"], round_to=None if hf else rounding)
        rotated = [ops.rope(x, positions, cos_sin_cache, **rotation) for x in (q, k)]
        if hf:
            rotated = [ops.reduce_precision(x, qkv.dtype) for x in rotated]
        q, k = (
            ops.rms_norm(x, None, eps=s["eps"], group_size=d, round_to=rounding) for x in rotated
        )
    if s.get("floor_scale") is not None:
        scale = dict(floor_scale=s["floor_scale"], attn_scale=s["attn_scale"])
        q = ops.attn_temperature(q, positions, **scale)
    return q, k, v


def _reads_positions(call: Call) -> bool:
    return call.cos_sin_cache is not None or call.floor_scale is not None


def _temperature(call: Call) -> None:
    if call.floor_scale is not None:
        check_finite_scalar("floor_scale", call.floor_scale, positive=True)
        check_finite_scalar("attn_scale", call.attn_scale)
        if call.positions is None:
            raise ValueError("positions is required with floor_scale (the temperature)")
    if call.cos_sin_cache is not None and call.positions is None:
        raise ValueError("positions is required with a cos_sin_cache (None only without RoPE)")


def _program_statics(call: Call) -> dict:
    if call.floor_scale is None:
        return {}
    return {"floor_scale": float(call.floor_scale), "attn_scale": float(call.attn_scale)}


SPLIT_QKV_ROPE_L2NORM = declare(
    "split_qkv_rope_l2norm",
    rope_l2norm_prologue,
    (
        params.QKV,
        replace(
            params.POSITIONS,
            kind=Positions(
                used=_reads_positions,
                limit=lambda call: MAX_TEMPERATURE_POSITION,
            ),
            optional=True,
            annotation=params.OPTIONAL_TENSOR,
            doc=params.POSITIONS.doc + "; read by the temperature on NoPE layers (below 2^24)",
        ),
        replace(
            params.COS_SIN_CACHE,
            optional=True,
            annotation=params.OPTIONAL_TENSOR,
            doc=params.COS_SIN_CACHE.doc + "; None: a NoPE layer (no rotation, no norm)",
        ),
        params.NUM_HEADS,
        params.NUM_KV_HEADS,
        params.HEAD_DIM,
        params.with_default(params.EPS, 1e-5),
        params.with_default(params.IS_NEOX, False),
        Static(
            "floor_scale",
            None,
            annotation="float | None",
            program=False,  # given to the composition only when set: _program_statics
            schema="float?",
            doc="NoPE layers: the attention temperature's floor scale (the config's, 8192; "
            "vLLM attn_temperature_tuning)",
        ),
        Static(
            "attn_scale",
            0.1,
            annotation="float",
            program=False,
            schema="float",
            doc="the temperature's scale: q times log(floor((p + 1) / floor_scale) + 1) * "
            "attn_scale + 1",
        ),
        numerics(),
        BACKEND,
    ),
    (Output("q"), Output("k"), Output("v", copy=True)),
    reference=reference.rope_l2norm_prologue,
    static_checks=(params.heads_divide, _temperature),
    program_statics=_program_statics,
    doc=f"""
    Llama 4's prologue: split the packed row; rotate q and k, then L2-normalise each head
    without weight; return new q, k, v (v a copy).

    Per head: ``y = rope(x) * rsqrt(mean(rope(x)^2) + eps)`` -- HF ``Llama4TextL2Norm`` (``eps
    = rms_norm_eps``) after ``apply_rotary_emb``, vLLM's ``qk_norm = RMSNorm(head_dim,
    has_weight=False)`` after ``rotary_emb``. ``is_neox=False`` (default): Hugging Face's
    layout, whose rotation is a complex multiplication of interleaved pairs ``(2i, 2i+1)``;
    vLLM permutes the checkpoint's q/k rows at load (``permute_qk_weight_for_rotary``) and
    rotates NeoX halves, ``is_neox=True``.

    ``cos_sin_cache=None`` is a NoPE layer (every fourth layer of Llama 4): no rotation and no
    norm (vLLM: ``use_qk_norm and not nope``); ``floor_scale`` (the config's, 8192) then scales
    q by the attention temperature ``log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1``
    (vLLM ``Llama4Attention._get_attn_scale``, on with ``attn_temperature_tuning``;
    :mod:`fqr.ops.temperature`), positions below 2^24. The reference it matches is
    :func:`fqr.reference.rope_l2norm_prologue`. ``numerics="unfused"`` rounds as vLLM's code
    (the rotation in the model dtype, the norm once), ``"unfused-hf"`` as Hugging Face's (the
    rotation in fp32, rounded once, then the norm once).

    {params.EXAMPLE_WITH_TABLE}
        >>> qkv = torch.randn(2, (4 + 2 * 2) * 64, dtype=torch.bfloat16)
        >>> heads = dict(num_heads=4, num_kv_heads=2, head_dim=64)
        >>> q, k, v = fqr.split_qkv_rope_l2norm(qkv, torch.tensor([3, 4]), table, **heads)
        >>> q.shape, k.shape, v.shape
        (torch.Size([2, 256]), torch.Size([2, 128]), torch.Size([2, 128]))
        >>> q, k, v = fqr.split_qkv_rope_l2norm(  # a NoPE layer: q scaled by the temperature
        ...     qkv, torch.tensor([3, 9000]), None, floor_scale=8192.0, **heads
        ... )
        >>> torch.equal(k, qkv[:, 256:384])
        True
    """,
)
# the same op from the hidden states: x @ w_qkv.T, then this prologue (.projected)
SPLIT_QKV_ROPE_L2NORM_PROJ = projected(
    SPLIT_QKV_ROPE_L2NORM,
    f"""{params.EXAMPLE_WITH_TABLE}
        >>> x = torch.randn(2, 80, dtype=torch.bfloat16)
        >>> w_qkv = torch.randn((4 + 2 * 2) * 64, 80, dtype=torch.bfloat16)
        >>> q, k, v = fqr.split_qkv_rope_l2norm_proj(
        ...     x, w_qkv, torch.tensor([3, 4]), table, num_heads=4, num_kv_heads=2, head_dim=64
        ... )
        >>> q.shape, k.shape, v.shape
        (torch.Size([2, 256]), torch.Size([2, 128]), torch.Size([2, 128]))""",
)

split_qkv_rope_l2norm = SPLIT_QKV_ROPE_L2NORM.function


# ------------------------------------------------------------------------ the variants


def _kwargs(preset) -> dict:
    spec = preset.spec
    kwargs = dict(
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        eps=spec.eps,
        is_neox=spec.is_neox,
    )
    if "floor_scale" in preset.params:  # a NoPE layer: the temperature
        p = preset.params
        kwargs.update(floor_scale=float(p["floor_scale"]), attn_scale=float(p["attn_scale"]))
    return kwargs


def _eager(variant, preset, cos_sin_cache, dtype):
    spec = preset.spec
    table = cos_sin_cache.to(dtype) if variant.reads_table else None
    temperature = {k: v for k, v in _kwargs(preset).items() if k in TEMPERATURE_FIELDS}

    def run(inputs):
        return llama4_prologue(inputs["qkv"], inputs["positions"], table, spec, **temperature)

    return run


POS_2_18 = 1 << 18
# Llama 4's rope-then-L2 (GPT-J pairs, llama3 scaling) and its NoPE layers' attention
# temperature (positions up to 2^18: floor((p + 1) / 8192) from 0 to 32).
ROPE_L2NORM = register_variant(
    Variant(
        "rope-l2norm",
        SPLIT_QKV_ROPE_L2NORM,
        kwargs=_kwargs,
        draw_inputs=draw_row,
        eager_chain=_eager,
        golden=(
            CaseSpec("llama4-scout", "bf16", 7, tp=8, max_position=POS_2_18),
            CaseSpec(
                "llama4-scout",
                "fp16",
                7,
                "unfused",
                tp=8,
                max_position=POS_2_18,
                positions_dtype="int32",
            ),
            CaseSpec("llama4-scout", "bf16", 7, tp=8, max_position=POS_2_18, hidden=80),
        ),
    )
)
NOPE_TEMPERATURE = register_variant(
    Variant(
        "nope-temperature",
        SPLIT_QKV_ROPE_L2NORM,
        kwargs=_kwargs,
        draw_inputs=draw_row,
        eager_chain=_eager,
        params=TEMPERATURE_FIELDS,
        copies_too=frozenset({"k"}),  # no rotation, no norm: k is the row's
        reads_table=False,
        golden=(
            CaseSpec("llama4-scout-nope", "bf16", 7, tp=8, max_position=POS_2_18),
            CaseSpec("llama4-scout-nope", "fp32", 1, tp=4, max_position=POS_2_18),
            # projected: k is the product rounded once, not a copy
            CaseSpec("llama4-scout-nope", "fp32", 3, tp=8, max_position=POS_2_18, hidden=80),
        ),
    )
)
