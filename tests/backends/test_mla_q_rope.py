"""The MLA query rotation (``fqr.mla_q_rope``): q's rope parts rotated in place against the
float64 formulation on the real YaRN tables, its nope parts untouched bit for bit, unfused bit
for bit with vLLM's ``q[..., nope:] = rotary_emb(...)``, bad arguments named before q is
touched, ``torch.ops.fqr.mla_q_rope`` mutating q."""

from __future__ import annotations

import pytest
import torch

import fqr
from fqr.backends import BACKENDS
from fqr.numerics import compare
from fqr.presets import get_preset
from fqr.prologue import get_variant, variant_of

VARIANT = get_variant("mla-q-rope")
MAX_POSITION = 1 << 16
BACKEND_NAMES = ["reference"] + (["interpret"] if BACKENDS["interpret"].available else [])


def _case(gen, name, tokens=5, tp=8, dtype=torch.bfloat16):
    preset = get_preset(f"{name}-q-rope", tp)
    assert variant_of(preset) is VARIANT
    table = preset.cos_sin_cache(MAX_POSITION)
    inputs = VARIANT.draw(preset, tokens, dtype, gen, max_position=MAX_POSITION)
    return preset, table, inputs


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize(
    "name,dtype", [("deepseek-v3", torch.bfloat16), ("kimi-k2", torch.float16)]
)
def test_rotates_the_rope_parts_in_place(gen, name, dtype, backend):
    preset, table, inputs = _case(gen, name, dtype=dtype)
    q = inputs["q"]
    before = q.clone()
    (exact,) = VARIANT.expected(preset, inputs, table).values()
    kw = VARIANT.kwargs(preset)
    got = fqr.mla_q_rope(q, inputs["positions"], table, backend=backend, **kw)
    assert got is q
    c = compare(q, exact, head_dim=VARIANT.head_dim(preset, "q"))
    assert c.passed, c
    heads, was = q.view(5, preset.num_heads, 192), before.view(5, preset.num_heads, 192)
    assert torch.equal(heads[..., :128], was[..., :128])  # the nope parts: not a bit changed
    assert not torch.equal(heads[..., 128:], was[..., 128:])


def test_rows_wider_than_the_heads(gen):
    """q may be a row-strided view (a wider projection buffer): only its heads' rope columns
    change, the columns past its width too stay."""
    preset, table, inputs = _case(gen, "deepseek-v3", tokens=4)
    wide = torch.randn(4, inputs["q"].shape[1] + 64, dtype=torch.float64).to(torch.bfloat16)
    wide[:, : inputs["q"].shape[1]] = inputs["q"]
    before = wide.clone()
    q = wide[:, : inputs["q"].shape[1]]
    (exact,) = VARIANT.expected(preset, inputs, table).values()
    fqr.mla_q_rope(q, inputs["positions"], table, backend="reference", **VARIANT.kwargs(preset))
    assert compare(q, exact, head_dim=192).passed
    assert torch.equal(wide[:, -64:], before[:, -64:])


def test_unfused_is_vllms_in_place_rotation_bit_for_bit(gen):
    preset, table, inputs = _case(gen, "deepseek-v3", tokens=6, tp=16)
    (got,) = VARIANT.run(preset, inputs, table, numerics="unfused", backend="reference")
    (want,) = VARIANT.eager(preset, table, torch.bfloat16)(dict(inputs, q=inputs["q"].clone()))
    assert torch.equal(got, want)


BAD = [
    ("q width", "q width", lambda a: dict(a, q=a["q"][:, :-64])),
    ("num_heads", "num_heads", lambda a: dict(a, num_heads=0)),
    ("nope", "qk_nope_head_dim", lambda a: dict(a, qk_nope_head_dim=-1)),
    ("table", "cos_sin_cache", lambda a: dict(a, cos_sin_cache=a["cos_sin_cache"][:, :63])),
    ("positions", "positions", lambda a: dict(a, positions=a["positions"][:-1])),
    ("range", "positions", lambda a: dict(a, positions=a["positions"] + MAX_POSITION)),
    ("grad", "grad", lambda a: dict(a, q=a["q"].clone().requires_grad_())),
]


@pytest.mark.parametrize("what,argument,override", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_are_named_before_q_is_touched(gen, what, argument, override):
    preset, table, inputs = _case(gen, "deepseek-v3")
    args = dict(inputs, cos_sin_cache=table, **VARIANT.kwargs(preset), backend="reference")
    bad = override(args)
    before = bad["q"].detach().clone()
    with pytest.raises((ValueError, TypeError)) as info:
        fqr.mla_q_rope(**bad)
    assert argument in str(info.value), info.value
    assert torch.equal(bad["q"].detach(), before)


def test_torch_op_mutates_q(gen):
    preset, table, inputs = _case(gen, "deepseek-v3")
    op, args = VARIANT.torch_op(preset, inputs, table)
    assert str(op._schema).startswith("fqr::mla_q_rope(Tensor(a!) q")
    (want,) = VARIANT.run(preset, inputs, table)
    # the schema returns the FP8 form's (q_nope, q_pe); the in-place form has neither: [T, 0]
    assert [tuple(t.shape) for t in op(*args)] == [(5, 0), (5, 0)]
    assert torch.equal(inputs["q"], want)


# ------------------------------------------- FP8 q out (FlashInfer's mla_rope_quantize_fp8)

FP8_VARIANT = get_variant("mla-q-rope-fp8")


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("scale_shape", [(), (1,)], ids=["0-dim", "[1]"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp8_q_out_is_flashinfers_quantized_q(gen, dtype, scale_shape, backend):
    """``quant_scale_q`` given: new float8_e4m3fn q_nope and q_pe, each ``e4m3(clamp(x *
    quant_scale_q))`` of the nope part and of the rotated rope part (some values past +-448:
    the clamp runs), within one E4M3 ULP of float64; q is not written."""
    preset = get_preset("deepseek-v3-q-rope-fp8", 8)
    assert variant_of(preset) is FP8_VARIANT
    table = preset.cos_sin_cache(MAX_POSITION)
    inputs = FP8_VARIANT.draw(preset, 5, dtype, gen, max_position=MAX_POSITION)
    inputs["quant_scale_q"] = inputs["quant_scale_q"].reshape(scale_shape)
    q = inputs["q"]
    before = q.clone()
    exact = FP8_VARIANT.expected(preset, inputs, table)
    args = FP8_VARIANT.arguments(preset, inputs, table, backend=backend)
    q_nope, q_pe = fqr.mla_q_rope(**args)
    assert torch.equal(q, before)
    assert (q_nope.dtype, q_pe.dtype) == (torch.float8_e4m3fn,) * 2
    assert q_nope.shape == (5, 16 * 128) and q_pe.shape == (5, 16 * 64)
    saturated = torch.cat([exact["q_nope"], exact["q_pe"]], dim=1).abs() == 448
    assert bool(saturated.any())  # the clamp is exercised
    for name, out in (("q_nope", q_nope), ("q_pe", q_pe)):
        c = compare(out, exact[name], head_dim=FP8_VARIANT.head_dim(preset, name))
        assert c.passed, f"{name}: {c}"


def test_fp8_q_out_unfused_is_the_eager_chain_bit_for_bit(gen):
    """numerics="unfused" on the reference backend stores what the eager chain (vLLM's
    rotation in the model dtype, then ``(x.float() * quant_scale_q)`` saturated to E4M3)
    stores, bit for bit."""
    preset = get_preset("deepseek-v3-q-rope-fp8", 8)
    table = preset.cos_sin_cache(MAX_POSITION)
    inputs = FP8_VARIANT.draw(preset, 6, torch.bfloat16, gen, max_position=MAX_POSITION)
    got = FP8_VARIANT.run(preset, inputs, table, numerics="unfused", backend="reference")
    want = FP8_VARIANT.eager(preset, table, torch.bfloat16)(inputs)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_fp8_q_out_multiplies_by_the_scale(gen):
    """FlashInfer multiplies by quant_scale_q (vLLM's cache scales divide): a scale of 2
    doubles what a scale of 1 stores (exact for E4M3 normals below the clamp: a power of
    two)."""
    preset = get_preset("deepseek-v3-q-rope-fp8", 16)
    table = preset.cos_sin_cache(MAX_POSITION)
    inputs = FP8_VARIANT.draw(preset, 3, torch.bfloat16, gen, max_position=MAX_POSITION)
    args = FP8_VARIANT.arguments(preset, inputs, table, backend="reference")
    one = fqr.mla_q_rope(**dict(args, quant_scale_q=torch.tensor(1.0)))
    two = fqr.mla_q_rope(**dict(args, quant_scale_q=torch.tensor(2.0)))
    for a, b in zip(one, two):
        small = (a.float().abs() < 200) & (a.float().abs() > 2**-6)  # x normal
        assert torch.equal(b.float()[small], 2 * a.float()[small]) and bool(small.any())


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(quant_scale_q=0.5), "quant_scale_q"),
        (dict(quant_scale_q=torch.ones(2)), "quant_scale_q must be a float32 tensor"),
        (dict(quant_scale_q=torch.zeros(1)), "quant_scale_q must be finite and > 0"),
        (dict(qk_nope_head_dim=0), "qk_nope_head_dim must be >= 1 with it"),
    ],
)
def test_fp8_q_out_bad_arguments_are_named(gen, change, message):
    preset = get_preset("deepseek-v3-q-rope-fp8", 16)
    table = preset.cos_sin_cache(MAX_POSITION)
    inputs = FP8_VARIANT.draw(preset, 2, torch.bfloat16, gen, max_position=MAX_POSITION)
    args = FP8_VARIANT.arguments(preset, inputs, table, backend="reference")
    if "qk_nope_head_dim" in change:
        args["q"] = args["q"].view(2, 8, 192)[:, :, 128:].reshape(2, 8 * 64)
    with pytest.raises((TypeError, ValueError), match=message):
        fqr.mla_q_rope(**dict(args, **change))
