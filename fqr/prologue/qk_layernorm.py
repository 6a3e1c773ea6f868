"""``split_qkv_layernorm_rope``: LayerNorm (mean-subtracting, with weight and bias) of each head
of q and of k, then RoPE: Persimmon's and Chameleon's prologue.

The composition (:func:`layernorm_prologue`) is ``split_qkv`` (any ``qkv_layout``: Persimmon's
row is per head) -> ``layer_norm`` of q and of k per head -> ``rope`` of both; v is a copy. The
float64 reference is :func:`fqr.reference.layernorm_prologue`. The variant ``qk-layernorm``
binds Persimmon's and Chameleon's presets (:mod:`.variant`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .. import ops, reference
from ..peers import hf_layernorm_prologue
from . import params
from .blocks import round_to
from .declare import BACKEND, Call, Output, Static, Tensor, Vector, choice, declare, numerics
from .projected import projected
from .variant import CaseSpec, Variant, preset_layout, register_variant

NORM_WEIGHTS = ("shared", "per-head")


def layernorm_prologue(
    qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, **s
):  # fmt: skip
    """Split (``qkv_layout``), LayerNorm each head of q and of k, rotate both (traced into one
    program; ``s``: the declaration's statics). ``numerics="unfused"`` rounds where Hugging
    Face's modules round: ``nn.LayerNorm`` once (``norm_weights="shared"``), Chameleon's norm,
    weight and bias each once (``"per-head"``); RoPE as vLLM's / HF's native rotation."""
    d = s["head_dim"]
    q, k, v = ops.split_qkv(qkv, s["num_heads"], s["num_kv_heads"], d, layout=s["qkv_layout"])
    rounding = round_to(qkv, s["numerics"])
    norm = dict(
        eps=s["eps"],
        group_size=d,
        round_to=rounding,
        round_before_weight=s["norm_weights"] == "per-head",
    )
    q = ops.layer_norm(q, q_weight, q_bias, **norm)
    k = ops.layer_norm(k, k_weight, k_bias, **norm)
    rotation = dict(head_dim=d, is_neox=s["is_neox"], round_to=rounding)
    q, k = (ops.rope(x, positions, cos_sin_cache, **rotation) for x in (q, k))
    return q, k, v


def _length(which: str):
    def length(call: Call) -> int:
        if call.norm_weights == "shared":
            return call.head_dim
        heads = call.num_heads if which == "q" else call.num_kv_heads
        return heads * call.head_dim

    return length


def _what(call: Call) -> str:
    return "head_dim" if call.norm_weights == "shared" else "the heads' features (H * head_dim)"


def _affine(name: str, of: str, optional: bool) -> Tensor:
    kind = Vector(length=_length(of), what=_what)
    what = "weight" if name.endswith("weight") else "bias"
    return Tensor(
        name,
        None if optional else params.MISSING,
        keyword=False,
        annotation=params.OPTIONAL_TENSOR if optional else params.TENSOR,
        kind=kind,
        optional=optional,
        doc=f"LayerNorm {what} of {of}: ``[head_dim]`` shared by every head "
        "(norm_weights='shared'), or each head's own, ``[H * head_dim]`` (norm_weights="
        "'per-head'); contiguous, any floating dtype",
    )


def _checks(call: Call) -> None:
    params.heads_divide(call)
    params.biases_together(call)
    params.layout_fits(call)


SPLIT_QKV_LAYERNORM_ROPE = declare(
    "split_qkv_layernorm_rope",
    layernorm_prologue,
    (
        replace(params.QKV, doc=params.QKV.doc + "; in the layout qkv_layout names"),
        params.POSITIONS,
        params.COS_SIN_CACHE,
        _affine("q_weight", "q", False),
        _affine("k_weight", "k", False),
        _affine("q_bias", "q", True),
        _affine("k_bias", "k", True),
        params.NUM_HEADS,
        params.NUM_KV_HEADS,
        params.HEAD_DIM,
        params.with_default(params.EPS, 1e-5),
        params.IS_NEOX,
        Static(
            "norm_weights",
            "shared",
            annotation="str",
            check=choice(*NORM_WEIGHTS),
            schema="str",
            doc="'shared': one [head_dim] weight and bias for every head (Persimmon's "
            "nn.LayerNorm(head_dim)); 'per-head': each head its own (Chameleon's "
            "ChameleonLayerNorm((H, head_dim)): statistics per head, weight and bias [H, D] "
            "applied after the norm)",
        ),
        params.QKV_LAYOUT,
        numerics("fused", ("fused", "unfused")),
        BACKEND,
    ),
    (Output("q"), Output("k"), Output("v", copy=True)),
    reference=reference.layernorm_prologue,
    static_checks=(_checks,),
    doc=f"""
    Persimmon's and Chameleon's prologue: split the packed row, LayerNorm each head of q and
    of k (mean-subtracting, with weight and bias), rotate them; return new q, k, v (v a copy).

    Per head (:mod:`fqr.ops.layer_norm`): ``y = (x - mean) / sqrt(mean((x - mean)^2) + eps) *
    w + b``, then RoPE on the first R features (R = the ``cos_sin_cache`` width; Persimmon
    rotates half of each head, NeoX pairs). ``norm_weights="shared"``: Persimmon's
    ``q_layernorm = nn.LayerNorm(head_dim, eps=layer_norm_eps)``; ``"per-head"``: Chameleon's
    ``ChameleonLayerNorm((num_heads, head_dim))`` (eps 1e-5 whatever the config says; weight
    and bias ``[H * D]``). ``qkv_layout="per-head"`` reads Persimmon's ``query_key_value``
    row as stored (``view(T, H, 3, D)``). The reference it matches is
    :func:`fqr.reference.layernorm_prologue`. ``numerics="unfused"`` rounds where the Hugging
    Face modules round (``nn.LayerNorm`` once; Chameleon's norm, weight and bias each once;
    the rotation in the model dtype).

    {params.EXAMPLE_WITH_TABLE}
        >>> qkv = torch.randn(2, 3 * 4 * 64, dtype=torch.bfloat16)
        >>> w, b = torch.ones(64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16)
        >>> q, k, v = fqr.split_qkv_layernorm_rope(
        ...     qkv, torch.tensor([0, 1]), table, w, w, b, b, num_heads=4, num_kv_heads=4,
        ...     head_dim=64, qkv_layout="per-head",
        ... )
        >>> torch.equal(v, qkv.view(2, 4, 3, 64)[:, :, 2].reshape(2, -1))  # each head's v
        True
    """,
)
# the same op from the hidden states: x @ w_qkv.T, then this prologue (.projected)
SPLIT_QKV_LAYERNORM_ROPE_PROJ = projected(
    SPLIT_QKV_LAYERNORM_ROPE,
    f"""{params.EXAMPLE_WITH_TABLE}
        >>> x = torch.randn(2, 80, dtype=torch.bfloat16)
        >>> w_qkv = torch.randn(3 * 4 * 64, 80, dtype=torch.bfloat16)  # Persimmon's per-head row
        >>> w, b = torch.ones(64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16)
        >>> q, k, v = fqr.split_qkv_layernorm_rope_proj(
        ...     x, w_qkv, torch.tensor([0, 1]), table, w, w, b, b, num_heads=4, num_kv_heads=4,
        ...     head_dim=64, qkv_layout="per-head",
        ... )
        >>> q.shape, k.shape, v.shape
        (torch.Size([2, 256]), torch.Size([2, 256]), torch.Size([2, 256]))""",
)

split_qkv_layernorm_rope = SPLIT_QKV_LAYERNORM_ROPE.function


# ------------------------------------------------------------------------- the variant


def _kwargs(preset) -> dict:
    spec = preset.spec
    return dict(
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        eps=spec.eps,
        is_neox=spec.is_neox,
        norm_weights=preset.params["norm_weights"],
        qkv_layout=preset_layout(preset),
    )


def _draw(variant, preset, tokens, dtype, generator, *, max_position, positions_dtype, bias):
    """qkv and positions (:func:`fqr.inputs.random_row`), then weights and biases of the
    preset's shape (``[D]`` shared, ``[H * D]`` per head), drawn around 1 and 0."""
    from ..inputs import random_row

    drawn = random_row(
        preset.spec, tokens, dtype, generator, max_position=max_position,
        positions_dtype=positions_dtype,
    )  # fmt: skip
    spec, per_head = preset.spec, preset.params["norm_weights"] == "per-head"
    for which, heads in (("q", spec.num_heads), ("k", spec.num_kv_heads)):
        n = heads * spec.head_dim if per_head else spec.head_dim
        for name, centre in (("weight", 1.0), ("bias", 0.0)):
            x = centre + 0.3 * torch.randn(
                n, generator=generator, dtype=torch.float64, device=generator.device
            )
            drawn[f"{which}_{name}"] = x.to(dtype)
    return drawn


def _eager(variant, preset, cos_sin_cache, dtype):
    kw, table = _kwargs(preset), cos_sin_cache.to(dtype)

    def run(inputs):
        return hf_layernorm_prologue(inputs, table, **kw)

    return run


# Persimmon (its per-head row, shared weights, half of each head rotated) and Chameleon
# ([q | k | v], each head's own weight and bias): fused and unfused, TP views.
QK_LAYERNORM = register_variant(
    Variant(
        "qk-layernorm",
        SPLIT_QKV_LAYERNORM_ROPE,
        kwargs=_kwargs,
        draw_inputs=_draw,
        eager_chain=_eager,
        params=("qkv_layout", "norm_weights"),
        golden=(
            CaseSpec("persimmon-8b", "bf16", 5, tp=16),
            CaseSpec("persimmon-8b", "bf16", 3, "unfused", tp=16),
            CaseSpec("chameleon-7b", "bf16", 3, tp=8),
            CaseSpec("chameleon-7b", "fp16", 3, "unfused", tp=8),
            CaseSpec("chameleon-7b", "fp16", 3, tp=16, hidden=200, qkv_bias=True),  # projected
        ),
    )
)
