"""``qk_rope`` and ``qk_mrope``: RoPE and multimodal RoPE of separate q and k, without a norm.

vLLM's ``RotaryEmbedding.forward(positions, query, key)`` and
``MRotaryEmbedding.forward(positions, query, key)`` (its ``triton_mrope`` kernel; vllm-ascend
runs the same kernel): ``q [T, Hq*D]`` and ``k [T, Hkv*D]`` rotated by the rows of one
``cos_sin_cache`` (R = its width = vLLM's ``rotary_dim``; features past R pass through). The
compositions are ``rope`` (:func:`qk_rope_prologue`) and ``mrope`` (:func:`qk_mrope_prologue`)
of q and of k; the float64 references are :func:`fqr.reference.qk_rope` and
:func:`fqr.reference.qk_mrope`. Variants ``qk-rope`` (presets ``llama3-8b-qk-rope``,
``glm4-9b-qk-rope``: models whose prologue is RoPE alone) and ``qk-mrope``
(``qwen3-vl-8b-qk-mrope``, ``qwen3.5-27b-qk-mrope``): the models' fields, this op
(:mod:`fqr.presets`).
"""

from __future__ import annotations

from dataclasses import replace

from .. import ops, reference
from ..inputs import random_heads, random_positions
from ..unfused import vllm_mrotary_embedding, vllm_rotary_embedding
from . import params
from .blocks import multimodal_rope, round_to
from .declare import BACKEND, Output, Positions, declare, numerics
from .mrope import (
    MROPE_FIELDS,
    MROPE_INTERLEAVED,
    MROPE_POSITIONS,
    MROPE_SECTION,
    check_preset_section,
    random_position_planes,
    section_fits,
)
from .qk import K_ROWS, Q_POSITIONS, Q_ROWS, returns_q_alone
from .variant import CaseSpec, Variant, register_variant

ROPE_NUMERICS = numerics("fused", ("fused", "unfused"))
OUTPUTS = (Output("q"), Output("k", present=lambda call: call.k is not None))


def qk_rope_prologue(q, k, positions, cos_sin_cache, **s):
    """RoPE of q and of k (traced into one program); ``k`` None: ``(q,)``."""
    rope = dict(head_dim=s["head_dim"], is_neox=s["is_neox"], round_to=round_to(q, s["numerics"]))
    return tuple(ops.rope(x, positions, cos_sin_cache, **rope) for x in (q, k) if x is not None)


def qk_mrope_prologue(q, k, positions_t, positions_h, positions_w, cos_sin_cache, **s):
    """Multimodal RoPE of q and of k from the three position planes (traced into one
    program); ``k`` None: ``(q,)``."""
    planes = (positions_t, positions_h, positions_w)
    q, k = multimodal_rope((q, k), planes, cos_sin_cache, s)
    return (q,) if k is None else (q, k)


QK_ROPE = declare(
    "qk_rope",
    qk_rope_prologue,
    (
        Q_ROWS,
        K_ROWS,
        Q_POSITIONS,
        params.COS_SIN_CACHE,
        params.HEAD_DIM,
        params.IS_NEOX,
        ROPE_NUMERICS,
        BACKEND,
    ),
    OUTPUTS,
    reference=reference.qk_rope,
    returns=returns_q_alone,
    doc=f"""
    Rotate the first R features of each head of ``q [T, Hq*D]`` and ``k [T, Hkv*D]`` by the
    token's row of ``cos_sin_cache`` (R its width); return new contiguous ``q`` and ``k``
    (``k=None``: ``(q, None)``). vLLM's ``RotaryEmbedding.forward(positions, query, key)``.

    Math per pair ``(x1, x2)`` of a head (NeoX: ``i, i + R/2``; GPT-J: ``2i, 2i + 1``) with
    ``c, s = cos_sin_cache[positions[t]]`` halves: ``x1' = x1*c - x2*s``, ``x2' = x2*c + x1*s``.
    The reference it matches is :func:`fqr.reference.qk_rope`; ``numerics="unfused"`` rounds
    where vLLM's ``forward_native`` does (the table in the activation dtype, every product and
    sum rounded: :mod:`fqr.ops.rope`).

    {params.EXAMPLE_WITH_TABLE}
        >>> q = torch.randn(2, 4 * 64, dtype=torch.bfloat16)  # 4 q heads of 64
        >>> k = torch.randn(2, 2 * 64, dtype=torch.bfloat16)  # 2 kv heads
        >>> q2, k2 = fqr.qk_rope(q, k, torch.tensor([0, 7]), table, head_dim=64)
        >>> torch.equal(q2[0], q[0]), torch.equal(q2[1], q[1])  # position 0 does not rotate
        (True, False)
    """,
)

QK_MROPE = declare(
    "qk_mrope",
    qk_mrope_prologue,
    (
        Q_ROWS,
        K_ROWS,
        replace(MROPE_POSITIONS, kind=Positions(planes=3, rows_of="q")),
        params.COS_SIN_CACHE,
        params.HEAD_DIM,
        MROPE_SECTION,
        MROPE_INTERLEAVED,
        params.IS_NEOX,
        ROPE_NUMERICS,
        BACKEND,
    ),
    OUTPUTS,
    reference=reference.qk_mrope,
    checks=(section_fits,),
    returns=returns_q_alone,
    doc="""
    Rotate ``q [T, Hq*D]`` and ``k [T, Hkv*D]`` by multimodal RoPE; return new contiguous
    ``q`` and ``k`` (``k=None``: ``(q, None)``). vLLM's ``MRotaryEmbedding.forward(positions,
    query, key)`` (``triton_mrope``; vllm-ascend's ``triton_mrope`` test).

    Each frequency ``i < R/2`` takes its cos and sin from the row of one plane's position
    (``positions [3, T]``: temporal, height, width; ``[T]``: plain RoPE), chosen by
    ``mrope_section`` as vLLM reads it (:mod:`fqr.ops.mrope`): contiguous sections in order
    (summing to R/2), or interleaved (h at ``i % 3 == 1`` below ``3*h``, w at ``i % 3 == 2``
    below ``3*w``, t elsewhere). The rotation is :func:`fqr.qk_rope`'s. The reference it
    matches is :func:`fqr.reference.qk_mrope`; ``numerics="unfused"`` rounds where vLLM's
    ``MRotaryEmbedding.forward_native`` does.

    Example (CPU tensors: ``backend="auto"`` runs the reference backend)::

        >>> import torch, fqr
        >>> from fqr.rope_cache import rope_cos_sin_cache
        >>> table = rope_cos_sin_cache(64, 4096, 5e6)  # rotary_dim 64: 32 frequencies
        >>> q = torch.randn(2, 4 * 64, dtype=torch.bfloat16)
        >>> k = torch.randn(2, 2 * 64, dtype=torch.bfloat16)
        >>> text = torch.tensor([[5, 9]] * 3)  # a text token: the same position on all planes
        >>> q2, k2 = fqr.qk_mrope(q, k, text, table, head_dim=64, mrope_section=[12, 10, 10],
        ...                       mrope_interleaved=True)
        >>> q1, k1 = fqr.qk_rope(q, k, text[0], table, head_dim=64)  # plain RoPE
        >>> torch.equal(q2, q1), torch.equal(k2, k1)
        (True, True)
    """,
)

qk_rope = QK_ROPE.function
qk_mrope = QK_MROPE.function


# ------------------------------------------------------------------------ the variants


def _draw(variant, preset, tokens, dtype, generator, *, max_position, positions_dtype, bias):
    """q and k (every head at its own magnitude) and the positions: ``[T]`` covering the
    table's ends (RoPE), or :func:`~fqr.prologue.mrope.random_position_planes` (mRoPE)."""
    spec = preset.spec
    q = random_heads(tokens, spec.num_heads, spec.head_dim, dtype, generator)
    k = random_heads(tokens, spec.num_kv_heads, spec.head_dim, dtype, generator)
    if variant.declaration is QK_MROPE:
        positions = random_position_planes(tokens, max_position, generator, dtype=positions_dtype)
    else:
        positions = random_positions(
            tokens, max_position, generator, dtype=positions_dtype, cover_ends=True
        )
    return {"q": q, "k": k, "positions": positions}


def _rope_kwargs(preset) -> dict:
    return dict(head_dim=preset.head_dim, is_neox=preset.is_neox)


def _mrope_kwargs(preset) -> dict:
    fields = preset.params
    return _rope_kwargs(preset) | dict(
        mrope_section=tuple(fields["mrope_section"]),
        mrope_interleaved=bool(fields["mrope_interleaved"]),
    )


def _eager_rope(variant, preset, cos_sin_cache, dtype):
    """vLLM's ``RotaryEmbedding.forward_native`` with the table in the model dtype."""
    table, kw = cos_sin_cache.to(dtype), _rope_kwargs(preset)

    def run(inputs):
        q, k, positions = inputs["q"], inputs["k"], inputs["positions"]
        return vllm_rotary_embedding(positions, q, k, kw["head_dim"], table, kw["is_neox"])

    return run


def _eager_mrope(variant, preset, cos_sin_cache, dtype):
    """vLLM's ``MRotaryEmbedding.forward_native`` with the table in the model dtype."""
    table, kw = cos_sin_cache.to(dtype), _mrope_kwargs(preset)
    layout = (kw["is_neox"], kw["mrope_section"], kw["mrope_interleaved"])

    def run(inputs):
        q, k, positions = inputs["q"], inputs["k"], inputs["positions"]
        return vllm_mrotary_embedding(positions, q, k, kw["head_dim"], table, *layout)

    return run


K_GIVEN = {"k": True}  # the variants' calls rotate q and k (k decides the output k)

# Llama 3 (no QK norm: its prologue is RoPE alone) and GLM-4 (partial rotary, GPT-J pairs).
QK_ROPE_VARIANT = register_variant(
    Variant(
        "qk-rope",
        QK_ROPE,
        kwargs=_rope_kwargs,
        draw_inputs=_draw,
        eager_chain=_eager_rope,
        pins=K_GIVEN,
        golden=(
            CaseSpec("llama3-8b-qk-rope", "bf16", 7, tp=2),
            CaseSpec("glm4-9b-qk-rope", "fp16", 5, "unfused"),
        ),
    )
)
# Qwen3-VL (interleaved sections) and Qwen3.5 (interleaved, partial rotary).
QK_MROPE_VARIANT = register_variant(
    Variant(
        "qk-mrope",
        QK_MROPE,
        kwargs=_mrope_kwargs,
        draw_inputs=_draw,
        eager_chain=_eager_mrope,
        params=MROPE_FIELDS,
        check_preset=lambda variant, preset: check_preset_section(preset),
        pins=K_GIVEN,
        golden=(
            CaseSpec("qwen3-vl-8b-qk-mrope", "bf16", 7, tp=4),
            CaseSpec("qwen3.5-27b-qk-mrope", "bf16", 3, "unfused"),
        ),
    )
)
