"""``split-qkv-layout``: :func:`fqr.split_qkv_rmsnorm_rope` on a packed row as the checkpoint
stores it (``qkv_layout``), with no load-time permutation asked of the user.

GPT-NeoX (Pythia, GPT-NeoX-20B, GPT-NeoX-Japanese) and Persimmon keep each head's q, k and v
side by side (``"per-head"``); CodeGen keeps the four model-parallel shards it was trained with,
each ``[q | v | k]`` (``"codegen-mp4"``). vLLM permutes those weights to ``[q | k | v]`` when it
loads them; fqr reads the row where each head sits instead (:func:`fqr.ops.qkv_layout_sections`:
sections of stride ``3*D``, or of grouped heads), so the kernel is the split op's own. The
float64 reference splits the row with the models' own reshapes
(:func:`fqr.reference.split_qkv_layout`).
"""

from __future__ import annotations

from ..peers import checkpoint_row_prologue
from .split_qkv import SPLIT_QKV_RMSNORM_ROPE
from .variant import CaseSpec, Variant, draw_row, preset_layout, register_variant


def _kwargs(preset) -> dict:
    return preset.spec.kwargs(qkv_layout=preset_layout(preset))


def _eager(variant, preset, cos_sin_cache, dtype):
    spec, table, layout = preset.spec, cos_sin_cache.to(dtype), preset_layout(preset)

    def run(inputs):
        return checkpoint_row_prologue(
            inputs["qkv"], inputs["positions"], table, inputs.get("q_weight"),
            inputs.get("k_weight"), spec, layout,
        )  # fmt: skip

    return run


# Pythia (per-head rows, NeoX pairs over a quarter of each head) and CodeGen (four shards of
# [q | v | k], GPT-J pairs over 64 of 80 features): no QK norm; fused and unfused, TP views.
QKV_LAYOUT = register_variant(
    Variant(
        "split-qkv-layout",
        SPLIT_QKV_RMSNORM_ROPE,
        kwargs=_kwargs,
        draw_inputs=draw_row,
        eager_chain=_eager,
        params=("qkv_layout",),
        golden=(
            CaseSpec("pythia-6.9b", "bf16", 5, tp=8),
            CaseSpec("pythia-6.9b", "fp16", 3, "unfused", tp=8),
            CaseSpec("codegen-2b", "bf16", 3, tp=2),
            CaseSpec("codegen-2b", "fp32", 2, tp=4),
            # the projected form, with GPT-NeoX's qkv bias
            CaseSpec("pythia-6.9b", "bf16", 5, tp=16, hidden=80, qkv_bias=True),
        ),
    )
)
