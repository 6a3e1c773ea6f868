"""``split_qkv_rmsnorm_mrope``: Qwen3-VL / Qwen3.5's prologue with multimodal RoPE (and
Qwen3.5's output gate): vllm-ascend's ``split_qkv_rmsnorm_mrope``.

The composition (:func:`mrope_attention_prologue`) is ``split_heads`` (with the gate: each q
head followed by its gate head) -> per-head ``rms_norm`` of q and k -> ``mrope`` of both from
the three position planes; v and the gate are copies. The float64 reference is
:func:`fqr.reference.mrope_prologue`. Variants ``mrope`` (Qwen3-VL) and ``mrope-gate``
(Qwen3.5) bind the presets (:mod:`.variant`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .. import ops, reference
from ..core import Section
from ..inputs import random_norm_inputs, random_positions, random_qkv
from ..peers import vllm_mrope_prologue
from ..validate import check_mrope_section
from . import params
from .blocks import multimodal_rope, round_to
from .declare import BACKEND, Call, Output, Positions, Rows, Static, declare, flag, numerics
from .projected import projected
from .variant import CaseSpec, Variant, register_variant


def mrope_attention_prologue(
    qkv, positions_t, positions_h, positions_w, cos_sin_cache, q_weight, k_weight, q_bias,
    k_bias, **s,
):  # fmt: skip
    """Qwen3-VL / Qwen3.5 (traced into one program): split the row (with ``output_gate``,
    each q head followed by its gate head, ``[q_0 g_0 q_1 g_1 ... | k | v]``), per-head
    RMSNorm of q and k, multimodal RoPE of both from the three position planes; returns
    ``(q, k, v)`` or ``(q, k, v, gate)``, v and the gate copies of the row."""
    hq, hkv, d, gated = s["num_heads"], s["num_kv_heads"], s["head_dim"], s["output_gate"]
    q_end = (2 if gated else 1) * hq * d
    sections = [
        Section(hq, d, 0, 2 * d if gated else d),
        Section(hkv, d, q_end),
        Section(hkv, d, q_end + hkv * d),
    ]
    if gated:
        sections.append(Section(hq, d, d, 2 * d))
    q, k, v, *gate = ops.split_heads(qkv, sections)
    rounding = round_to(qkv, s["numerics"])
    norm = dict(eps=s["eps"], group_size=d, weight_offset=s["weight_offset"], round_to=rounding)
    planes = (positions_t, positions_h, positions_w)
    # each of q and k normalised, then rotated (the traced order the golden kernels record)
    q, k = (
        multimodal_rope((ops.rms_norm(x, w, bias=b, **norm),), planes, cos_sin_cache, s)[0]
        for x, w, b in ((q, q_weight, q_bias), (k, k_weight, k_bias))
    )
    return (q, k, v, *gate)


def gated_width(call: Call) -> tuple[int, str]:
    hq, hkv, d = call.num_heads, call.num_kv_heads, call.head_dim
    gate = "2*" if call.output_gate else ""
    width = ((2 if call.output_gate else 1) * hq + 2 * hkv) * d
    text = f"({gate}num_heads + 2*num_kv_heads) * head_dim = ({gate}{hq} + 2*{hkv}) * {d} = {width}"
    return width, text + (" (each q head followed by its gate head)" if call.output_gate else "")


def section_fits(call: Call) -> None:
    """``mrope_section`` as :func:`fqr.validate.check_mrope_section` reads it for the table
    width."""
    check_mrope_section(call.mrope_section, call.mrope_interleaved, call.cos_sin_cache.shape[1])


def _section_key(value):
    """The call's key of ``mrope_section``: a list keys as its elements with their types."""
    if isinstance(value, (tuple, list)):
        return type(value), tuple((type(s), s) for s in value)
    return value


MROPE_POSITIONS = replace(
    params.POSITIONS,
    kind=Positions(planes=3),
    doc="``[3, T]`` (temporal, height, width planes, each contiguous along T) or ``[T]`` "
    "(text: one position on every plane, plain RoPE bit for bit), int32/int64",
)
MROPE_SECTION = Static(
    "mrope_section",
    annotation="tuple[int, int, int] | list[int]",
    check=lambda name, value: None,  # with the table width: section_fits
    normalize=tuple,
    key=_section_key,
    schema="int[]",
    doc="(t, h, w) sections (the model's rope_scaling mrope_section): contiguous, the "
    "frequencies of each plane, summing to R/2; interleaved, h takes every third "
    "frequency from 1 below 3*h, w from 2 below 3*w, t the rest (vLLM's reading)",
)
MROPE_INTERLEAVED = Static(
    "mrope_interleaved",
    False,
    annotation="bool",
    check=flag,
    schema="bool",
    doc="the sections interleaved over the frequencies (Qwen3-VL, Qwen3.5; "
    "fqr.ops.mrope says which plane each frequency reads)",
)


SPLIT_QKV_RMSNORM_MROPE = declare(
    "split_qkv_rmsnorm_mrope",
    mrope_attention_prologue,
    (
        replace(
            params.QKV,
            kind=Rows(width=gated_width),
            doc="``[T, (Hq + 2*Hkv)*D]`` packed rows, or with ``output_gate`` Qwen3.5's gated "
            "row ``[T, (2*Hq + 2*Hkv)*D]`` (``[q_0 g_0 q_1 g_1 ... | k | v]``)",
        ),
        MROPE_POSITIONS,
        params.COS_SIN_CACHE,
        params.Q_WEIGHT,
        params.K_WEIGHT,
        params.NUM_HEADS,
        params.NUM_KV_HEADS,
        params.HEAD_DIM,
        MROPE_SECTION,
        MROPE_INTERLEAVED,
        *params.NORM_ROPE,
        Static(
            "output_gate",
            False,
            annotation="bool",
            check=flag,
            schema="bool",
            doc="Qwen3.5's gated attention: the row holds a gate head after each q head, "
            "returned as a fourth output (copied)",
        ),
        numerics(),
        BACKEND,
    ),
    (
        Output("q"),
        Output("k"),
        Output("v", copy=True),
        Output("gate", copy=True, present=lambda call: call.output_gate),
    ),
    reference=reference.mrope_prologue,
    static_checks=(params.heads_divide, params.biases_together),
    checks=(section_fits,),
    doc=f"""
    Split the packed row, RMS-normalise q and k per head, rotate them by multimodal RoPE;
    return new ``q, k, v`` (and ``gate`` with ``output_gate``). vllm-ascend's
    ``split_qkv_rmsnorm_mrope`` (Qwen3-VL, Qwen3.5), with fqr's argument names and numerics.

    Weights (and optional biases) ``[D]`` scale by ``weight_offset + w`` (1.0: Qwen3.5's
    ``(1 + w)`` norms). Returns contiguous ``q [T, Hq*D]``, ``k``, ``v [T, Hkv*D]`` and
    ``gate [T, Hq*D]`` in qkv's dtype, v and the gate copied bit for bit.

    Math per head: ``y = x * rsqrt(mean(x^2) + eps) * (weight_offset + w) + b``, then the
    rotation of the first R features by each frequency's plane angle; the reference it matches
    is :func:`fqr.reference.mrope_prologue`. ``numerics`` as :func:`fqr.split_qkv_rmsnorm_rope`
    (``"unfused"`` rounds where vLLM's ``RMSNorm`` / ``GemmaRMSNorm`` and
    ``MRotaryEmbedding.forward_native`` round).

    {params.EXAMPLE_WITH_TABLE}
        >>> qkv = torch.randn(2, (4 + 2 * 2) * 64, dtype=torch.bfloat16)
        >>> w = torch.ones(64, dtype=torch.bfloat16)
        >>> positions = torch.tensor([[7, 7], [0, 1], [0, 0]])  # [3, T]: temporal, height, width
        >>> q, k, v = fqr.split_qkv_rmsnorm_mrope(
        ...     qkv, positions, table, w, w, num_heads=4, num_kv_heads=2, head_dim=64,
        ...     mrope_section=(16, 8, 8), mrope_interleaved=True,  # sums to rotary_dim / 2
        ... )
        >>> q.shape, k.shape, v.shape
        (torch.Size([2, 256]), torch.Size([2, 128]), torch.Size([2, 128]))
    """,
)
# the same op from the hidden states: x @ w_qkv.T, then this prologue (.projected)
SPLIT_QKV_RMSNORM_MROPE_PROJ = projected(
    SPLIT_QKV_RMSNORM_MROPE,
    f"""{params.EXAMPLE_WITH_TABLE}
        >>> x = torch.randn(2, 80, dtype=torch.bfloat16)
        >>> w_qkv = torch.randn((4 + 2 * 2) * 64, 80, dtype=torch.bfloat16)
        >>> w = torch.ones(64, dtype=torch.bfloat16)
        >>> positions = torch.tensor([[7, 7], [0, 1], [0, 0]])  # [3, T]: temporal, height, width
        >>> q, k, v = fqr.split_qkv_rmsnorm_mrope_proj(
        ...     x, w_qkv, positions, table, w, w, num_heads=4, num_kv_heads=2, head_dim=64,
        ...     mrope_section=(16, 8, 8), mrope_interleaved=True,
        ... )
        >>> q.shape, k.shape, v.shape
        (torch.Size([2, 256]), torch.Size([2, 128]), torch.Size([2, 128]))""",
)

split_qkv_rmsnorm_mrope = SPLIT_QKV_RMSNORM_MROPE.function


# ------------------------------------------------------------------------ the variants


# The preset fields an mRoPE variant reads (checked by check_preset_section).
MROPE_FIELDS = ("mrope_section", "mrope_interleaved")


def check_preset_section(preset) -> None:
    """A preset's ``mrope_section`` as a model config gives it (vLLM's ``MRotaryEmbedding``
    asserts the sum of interleaved sections too)."""
    fields = preset.params
    try:
        check_mrope_section(
            list(fields["mrope_section"]),
            fields["mrope_interleaved"],
            preset.rotary_dim,
            config=True,
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"preset {preset.name}: {e}") from None


def _check_preset(variant: Variant, preset) -> None:
    check_preset_section(preset)
    if preset.norm != "head":
        raise ValueError(f"preset {preset.name}: variant {variant.name!r} needs norm='head'")


def _kwargs(gated: bool):
    def kwargs(preset) -> dict:
        fields = preset.params
        return preset.spec.head_kwargs(
            mrope_section=tuple(fields["mrope_section"]),
            mrope_interleaved=bool(fields["mrope_interleaved"]),
            output_gate=gated,
        )

    return kwargs


def random_position_planes(tokens, max_position, generator, *, dtype) -> torch.Tensor:
    """``[3, T]`` positions: every third token text (three equal planes), the others image
    tokens (three planes drawn apart; token 0 reads the table's last row)."""
    planes = [
        random_positions(tokens, max_position, generator, dtype=dtype, cover_ends=p == 0)
        for p in range(3)
    ]
    positions = torch.stack(planes)
    positions[1:, ::3] = positions[0, ::3]  # text tokens
    return positions


def _draw(variant, preset, tokens, dtype, generator, *, max_position, positions_dtype, bias):
    """The packed row (with the gate heads when the variant has them), positions ``[3, T]``
    where every third token is text (three equal planes) and the others image tokens (three
    planes drawn apart; token 0 reads the table's last row), the norm weights (and biases)."""
    spec = preset.spec
    gated = variant.pins["output_gate"]
    heads = replace(spec, num_heads=2 * spec.num_heads) if gated else spec
    qkv = random_qkv(heads, tokens, dtype, generator)
    positions = random_position_planes(tokens, max_position, generator, dtype=positions_dtype)
    drawn = {"qkv": qkv, "positions": positions}
    return drawn | random_norm_inputs(spec, dtype, generator, bias=bias)


def _eager(variant, preset, cos_sin_cache, dtype):
    kw = variant.kwargs(preset)
    table = cos_sin_cache.to(dtype)
    return lambda inputs: vllm_mrope_prologue(inputs, table, **kw)


def _mrope_variant(name: str, gated: bool) -> Variant:
    return register_variant(
        Variant(
            name,
            SPLIT_QKV_RMSNORM_MROPE,
            kwargs=_kwargs(gated),
            draw_inputs=_draw,
            eager_chain=_eager,
            params=MROPE_FIELDS,
            check_preset=_check_preset,
            pins={"output_gate": gated},
            has_bias=True,
            golden=GATED_CASES if gated else CASES,
        )
    )


# Qwen3-VL: interleaved sections, text and image tokens, TP views, unfused numerics, int32
# positions, bias. Qwen3.5: its gated attention with interleaved mRoPE, partial rotary, (1 + w).
CASES = (
    CaseSpec("qwen3-vl-8b", "bf16", 7),
    CaseSpec("qwen3-vl-8b", "fp16", 5, "unfused", tp=2),
    CaseSpec("qwen3-vl-8b", "bf16", 3, tp=8, bias=True, positions_dtype="int32"),
    CaseSpec("qwen3-vl-8b", "bf16", 7, tp=16, hidden=200, qkv_bias=True),  # projected form
)
GATED_CASES = (
    CaseSpec("qwen3.5-27b", "bf16", 7),
    CaseSpec("qwen3.5-27b", "fp16", 7, tp=8, bias=True),
    CaseSpec("qwen3.5-27b", "fp32", 1, "unfused"),
    CaseSpec("qwen3.5-27b", "bf16", 3, tp=8, hidden=80),  # projected form
)
MROPE = _mrope_variant("mrope", gated=False)
MROPE_GATE = _mrope_variant("mrope-gate", gated=True)
