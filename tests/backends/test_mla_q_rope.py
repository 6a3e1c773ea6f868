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
    assert op(*args) is None
    assert torch.equal(inputs["q"], want)
