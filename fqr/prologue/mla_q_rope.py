"""``mla_q_rope``: the Multi-head Latent Attention query rotation, in place: after ``q_b_proj``
each of the q heads is ``[nope | rope]`` (DeepSeek-V3: 128 + 64) and only the trailing rope part
is rotated, where it is, as vLLM's ``MultiHeadLatentAttentionWrapper.forward`` does::

    q = q.view(-1, num_heads, qk_nope_head_dim + qk_rope_head_dim)
    q[..., qk_nope_head_dim:], k_pe = rotary_emb(positions, q[..., qk_nope_head_dim:], k_pe)

(k_pe is rotated by :func:`fqr.split_mla_rmsnorm_rope_cache`). The composition
(:func:`mla_q_rope_prologue`) is ``split_heads`` of the rope parts (a head stride of the whole
head) -> ``rope``; the kernel stores the rotated parts back into q through a ``[T, H, rope]``
view of it (its heads at the whole head's stride), so the nope columns are neither read nor
written. The float64 reference is :func:`mla_q_rope_reference`. The variant ``mla-q-rope``
binds the DeepSeek / Kimi presets.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .. import ops, reference
from ..core import Section
from ..inputs import random_heads, random_positions
from ..unfused import vllm_rotary_embedding
from . import params
from .blocks import complex_rope_round_to
from .declare import BACKEND, Call, Output, Rows, Static, declare, numerics
from .mla_kv import MLA_PARAMS, check_mla_preset
from .variant import CaseSpec, Variant, register_variant


def mla_q_rope_prologue(
    q, positions, cos_sin_cache, quant_scale_q, *, num_heads, qk_nope_head_dim, is_neox, numerics,
    quantize_dtype=torch.float8_e4m3fn,
):  # fmt: skip
    """The rope part of every ``[nope | rope]`` head of ``q``, rotated (traced into one
    program): returns the rotated parts ``[T, H * rope]``, which the call stores back into q;
    with ``quant_scale_q`` the nope parts and the rotated parts, each times the scale, as FP8
    of ``quantize_dtype`` (E4M3 or E5M2: FlashInfer's ``mla_rope_quantize_fp8`` q outputs),
    and q is not written."""
    rope_dim = cos_sin_cache.shape[1]
    head = qk_nope_head_dim + rope_dim
    rope_part = Section(num_heads, rope_dim, qk_nope_head_dim, head)
    if quant_scale_q is None:
        (pe,) = ops.split_heads(q, [rope_part])
    else:
        nope, pe = ops.split_heads(q, [Section(num_heads, qk_nope_head_dim, 0, head), rope_part])
    pe = ops.rope(
        pe,
        positions,
        cos_sin_cache,
        head_dim=rope_dim,
        is_neox=is_neox,
        round_to=complex_rope_round_to(q, numerics),
    )
    if quant_scale_q is None:
        return (pe,)
    return tuple(
        ops.quantize_fp8(x, quant_scale_q, multiply=True, dtype=quantize_dtype) for x in (nope, pe)
    )


def mla_q_rope_reference(
    q, positions, cos_sin_cache, *, num_heads, qk_nope_head_dim, is_neox=False,
    quant_scale_q=None, quantize_dtype=None,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """float64 q after the call: each head's nope part as it was, its rope part rotated by
    the token's row of ``cos_sin_cache`` (:func:`fqr.reference.rotate` of the
    :func:`fqr.reference.split_row` rope sections); with ``quant_scale_q`` the nope parts and
    the rotated parts, each ``clamp(x * quant_scale_q, +-max)`` of ``quantize_dtype`` (448
    E4M3, the default; 57344 E5M2): what the FP8 store rounds,
    :func:`fqr.reference.saturate_fp8`."""
    rope_dim = cos_sin_cache.shape[1]
    head = qk_nope_head_dim + rope_dim
    (pe,) = reference.split_row(q, [Section(num_heads, rope_dim, qk_nope_head_dim, head)])
    rows = reference.cos_sin_rows(cos_sin_cache, positions)
    rotated = reference.rotate(pe, rows, head_dim=rope_dim, is_neox=is_neox)
    if quant_scale_q is not None:
        factor = quant_scale_q.detach().to(torch.float64).reshape(())
        (nope,) = reference.split_row(q, [Section(num_heads, qk_nope_head_dim, 0, head)])
        dtype = quantize_dtype or torch.float8_e4m3fn
        return tuple(reference.saturate_fp8(x * factor, None, dtype) for x in (nope, rotated))
    out = q.detach().to(torch.float64).clone().view(q.shape[0], num_heads, head)
    out[..., qk_nope_head_dim:] = rotated.view(q.shape[0], num_heads, rope_dim)
    return (out.view(q.shape[0], num_heads * head),)


def non_negative_int(name: str, value) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def _width(call: Call) -> tuple[int, str] | None:
    if not isinstance(call.cos_sin_cache, torch.Tensor) or call.cos_sin_cache.dim() != 2:
        return None  # the table's own check names it
    h, nope, r = call.num_heads, call.qk_nope_head_dim, call.cos_sin_cache.shape[1]
    width = h * (nope + r)
    return width, (
        f"num_heads * (qk_nope_head_dim + rope width) = {h} * ({nope} + {r}) = {width} (the "
        f"rope width is cos_sin_cache's)"
    )


def _rope_views(call: Call) -> list | None:
    """Where the rotated parts go: q's own rope columns, as a ``[T, H, rope]`` view (the FP8
    form: new outputs, None)."""
    if call.quant_scale_q is not None:
        return None
    h, nope = call.num_heads, call.qk_nope_head_dim
    q = call.q
    return [q.view(q.shape[0], h, q.shape[1] // h)[:, :, nope:]]


def _fp8_form(call: Call) -> None:
    params.check_quantize_dtype_needs_scale(call, "quant_scale_q")
    if call.quant_scale_q is not None and call.qk_nope_head_dim < 1:
        raise ValueError(
            "quant_scale_q returns q_nope and q_pe: qk_nope_head_dim must be >= 1 with it"
        )


def _fp8(call) -> bool:
    return call.quant_scale_q is not None


def _no_grad(call: Call) -> None:
    inputs = (call.q, call.positions, call.cos_sin_cache)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        raise ValueError(
            "mla_q_rope rotates q in place: no input may require grad under grad mode; "
            "use torch.no_grad()"
        )


MLA_Q_ROPE = declare(
    "mla_q_rope",
    mla_q_rope_prologue,
    (
        params.positional(
            "q",
            Rows(what="[T, num_heads * (nope + rope)]", width=_width),
            donated=True,
            doc="``[T, H * (qk_nope_head_dim + rope)]``, q_b_proj's output (bf16/fp16/fp32), "
            "each head ``[nope | rope]``; its rope parts are rotated in place (the row "
            "stride may exceed the width)",
        ),
        params.positions_of("q"),
        # any even width: the rope part is R
        params.mla_cos_sin_cache(lambda call: 1 << 30, "the rope part of a head"),
        params.NUM_HEADS,
        Static(
            "qk_nope_head_dim",
            annotation="int",
            check=non_negative_int,
            schema="int",
            doc="features before the rope part of each head (DeepSeek-V3: 128)",
        ),
        params.DEEPSEEK_IS_NEOX,
        params.quant_scale(
            "quant_scale_q",
            "the nope and rope parts of every q head, as new FP8 (``quantize_dtype``) ``q_nope "
            "[T, H * nope]`` and ``q_pe [T, H * rope]`` (q is then not written)",
        ),
        numerics(),
        params.quantize_dtype("quant_scale_q"),
        BACKEND,
    ),
    (
        Output(
            "q",
            into="q",
            head_dim=lambda s: s["qk_nope_head_dim"] + s["rotary_dim"],
            present=lambda call: not _fp8(call),
        ),
        Output("q_nope", head_dim=lambda s: s["qk_nope_head_dim"], present=_fp8),
        Output("q_pe", head_dim=lambda s: s["rotary_dim"], present=_fp8),
    ),
    reference=mla_q_rope_reference,
    static_checks=(_fp8_form,),
    value_checks=((lambda call: True, _no_grad),),
    out=_rope_views,
    returns=lambda call, outs: outs if _fp8(call) else call.q,
    doc="""
    Rotate the rope part of every MLA query head in place and return ``q``: each head of ``q
    [T, H * (nope + R)]`` is ``[nope | rope]`` and its last R features (R = the
    ``cos_sin_cache`` width, DeepSeek's 64) are rotated by the token's row of the table (GPT-J
    pairs by default, as DeepSeek); the nope features are neither read nor written. vLLM's
    ``q[..., nope:], k_pe = rotary_emb(positions, q[..., nope:], k_pe)`` after ``q_b_proj``
    (``MultiHeadLatentAttentionWrapper.forward``). The reference it matches is
    :func:`fqr.prologue.mla_q_rope.mla_q_rope_reference`; ``numerics="unfused"`` rotates in the
    model dtype as vLLM's ``rotary_emb.forward_native``, ``"unfused-hf"`` in fp32 rounded once
    as transformers' DeepSeek-V2 (``apply_rotary_emb``, a complex product).

    With ``quant_scale_q`` (a float32 ``[1]`` or 0-dim tensor) the call is FlashInfer's
    ``mla_rope_quantize_fp8`` for q: it returns new float8_e4m3fn ``(q_nope [T, H * nope],
    q_pe [T, H * R])``, ``e4m3(clamp(x * quant_scale_q, -448, 448))`` of each head's nope part
    and of its rotated rope part (FlashInfer multiplies by its ``quant_scale_q``), and q is
    not written; with ``quantize_dtype=torch.float8_e5m2`` (FlashInfer's argument of that
    name) they are float8_e5m2, ``e5m2(clamp(x * quant_scale_q, -57344, 57344))``.

    Example (DeepSeek-V3 at TP 8: 16 heads of 128 + 64; its table is
    ``fqr.get_preset("deepseek-v3").cos_sin_cache()``; CPU tensors run the reference backend)::

        >>> import torch, fqr
        >>> from fqr.rope_cache import rope_cos_sin_cache
        >>> table = rope_cos_sin_cache(64, 4096, 10000.0)
        >>> q = torch.randn(2, 16 * (128 + 64), dtype=torch.bfloat16)
        >>> nope = q.view(2, 16, 192)[:, :, :128].clone()
        >>> out = fqr.mla_q_rope(q, torch.tensor([3, 4]), table, num_heads=16, qk_nope_head_dim=128)
        >>> out.data_ptr() == q.data_ptr(), torch.equal(q.view(2, 16, 192)[:, :, :128], nope)
        (True, True)
    """,
)

mla_q_rope = MLA_Q_ROPE.function


# ------------------------------------------------------------------------- the variant


def _kwargs(preset) -> dict:
    return dict(
        num_heads=preset.num_heads,
        qk_nope_head_dim=preset.params["qk_nope_head_dim"],
        is_neox=preset.is_neox,
    )


def _draw(variant, preset, tokens, dtype, generator, *, max_position, positions_dtype, bias):
    """q_b_proj's output (every head's nope and rope parts at their own magnitudes) and the
    positions (the table's ends covered)."""
    h, nope, r = preset.num_heads, preset.params["qk_nope_head_dim"], preset.head_dim
    parts = [random_heads(tokens, h, d, dtype, generator).view(tokens, h, d) for d in (nope, r)]
    q = torch.cat(parts, dim=-1).reshape(tokens, h * (nope + r))
    positions = random_positions(
        tokens, max_position, generator, dtype=positions_dtype, cover_ends=True
    )
    return {"q": q.contiguous(), "positions": positions}


def vllm_mla_q_rope(inputs: dict, cos_sin_cache, *, num_heads, qk_nope_head_dim, is_neox):
    """vLLM's in-place rotation of q's rope parts: ``q[..., nope:] = rotary_emb(...)``
    (``RotaryEmbedding.forward_native`` in the model dtype); returns the updated q."""
    q, positions = inputs["q"], inputs["positions"]
    r = cos_sin_cache.shape[1]
    heads = q.view(q.shape[0], num_heads, qk_nope_head_dim + r)
    pe = heads[..., qk_nope_head_dim:]
    pe_rows = pe.contiguous()
    rotated, _ = vllm_rotary_embedding(positions, pe_rows, pe_rows, r, cos_sin_cache, is_neox)
    heads[..., qk_nope_head_dim:] = rotated.view(pe.shape)
    return (q,)


def _eager(variant, preset, cos_sin_cache, dtype):
    table, kw = cos_sin_cache.to(dtype), _kwargs(preset)
    return lambda inputs: vllm_mla_q_rope(inputs, table, **kw)


MLA_Q_ROPE_VARIANT = register_variant(
    Variant(
        "mla-q-rope",
        MLA_Q_ROPE,
        kwargs=_kwargs,
        draw_inputs=_draw,
        eager_chain=_eager,
        params=MLA_PARAMS,
        check_preset=check_mla_preset,
        # q = q_b_proj(q_c) (q_lora_rank features), or q_proj(hidden) without q_lora_rank
        projection_in=lambda p: dict(p.variant_params)["q_lora_rank"] or p.hidden_size,
        golden=(
            CaseSpec("deepseek-v3-q-rope", "bf16", 7, tp=8, max_position=1 << 18),
            CaseSpec("deepseek-v3-q-rope", "bf16", 1, "unfused", tp=16),
            CaseSpec("kimi-k2-q-rope", "fp16", 5, tp=8),
            CaseSpec("deepseek-v2-lite-q-rope", "fp32", 3, tp=2),
        ),
    )
)


# ------------------------------------------ FP8 q out: FlashInfer's mla_rope_quantize_fp8 (q)


def _draw_fp8(variant, preset, tokens, dtype, generator, **kw):
    """:func:`_draw`, then a 0-dim ``quant_scale_q`` in ``[100, 200)`` (the largest products
    pass +-448: the clamp is exercised)."""
    drawn = _draw(variant, preset, tokens, dtype, generator, **kw)
    unit = torch.rand((), generator=generator, dtype=torch.float64, device=generator.device)
    return drawn | {"quant_scale_q": (100 + 100 * unit).float()}


def flashinfer_mla_q_rope_fp8(inputs: dict, cos_sin_cache, *, num_heads, qk_nope_head_dim, is_neox):
    """The unfused chain of FlashInfer's ``mla_rope_quantize_fp8`` for q: the rope parts
    rotated as vLLM's ``rotary_emb`` rotates them (model dtype), then the nope and rope parts
    each ``(x.float() * quant_scale_q)`` saturated to E4M3 (a new tensor each; q as given)."""
    q, scale = inputs["q"], inputs["quant_scale_q"]
    r = cos_sin_cache.shape[1]
    (rotated,) = vllm_mla_q_rope(dict(inputs, q=q.clone()), cos_sin_cache, num_heads=num_heads,
                                 qk_nope_head_dim=qk_nope_head_dim, is_neox=is_neox)  # fmt: skip
    heads = rotated.view(q.shape[0], num_heads, qk_nope_head_dim + r)
    parts = (heads[..., :qk_nope_head_dim], heads[..., qk_nope_head_dim:])
    return tuple(
        (x.float() * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).reshape(q.shape[0], -1)
        for x in parts
    )


def _eager_fp8(variant, preset, cos_sin_cache, dtype):
    table, kw = cos_sin_cache.to(dtype), _kwargs(preset)
    return lambda inputs: flashinfer_mla_q_rope_fp8(inputs, table, **kw)


# FlashInfer's FP8 q of MLA attention (mla_rope_quantize_fp8's q_nope_out / q_rope_out): the
# same op with quant_scale_q; its outputs are new FP8 tensors (a second variant: its outputs)
MLA_Q_ROPE_FP8_VARIANT = register_variant(
    replace(
        MLA_Q_ROPE_VARIANT,
        name="mla-q-rope-fp8",
        draw_inputs=_draw_fp8,
        eager_chain=_eager_fp8,
        pins={"quant_scale_q": 1},
        golden=(CaseSpec("deepseek-v3-q-rope-fp8", "bf16", 5, tp=8, max_position=1 << 18),),
    )
)
