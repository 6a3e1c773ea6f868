"""Issue 15's norm variants as compositions: Gemma 4's weightless v norm, Llama 4's rope then L2
norm, and its NoPE layers' attention temperature, each traced, run on the reference interpreter
and as the interpreted kernel into NaN-poisoned outputs, against the independent float64
formulation (fqr.reference) on fresh inputs and real RoPE tables (the proportional and the
llama3-scaled ones the presets use)."""

from __future__ import annotations

import pytest
import torch
from support.compositions import POS, positions, randn, table_spec
from support.programs import check_reference_and_kernel

from fqr import ops, reference
from fqr.backends import BACKENDS
from fqr.core import spec, trace
from fqr.prologue.rope_l2norm import rope_l2norm_prologue
from fqr.prologue.vnorm import vnorm_prologue
from fqr.rope_cache import rope_cos_sin_cache

needs_interpreter = pytest.mark.skipif(
    not BACKENDS["interpret"].available, reason=BACKENDS["interpret"].unavailable_reason() or ""
)
MAX_POS = 4099
PROPORTIONAL = {"rope_type": "proportional", "partial_rotary_factor": 0.25}
LLAMA4 = {
    "rope_type": "llama3",
    "factor": 16.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
}


def _act(width, dtype=torch.bfloat16):
    return spec("T", width, dtype=dtype)


@needs_interpreter
@pytest.mark.parametrize("head_dim, scaling, bias", [(64, PROPORTIONAL, False), (32, None, True)])
def test_vnorm_composition(gen, head_dim, scaling, bias):
    hq, hkv, d, t = 3, 2, head_dim, 5
    cache = rope_cos_sin_cache(d, MAX_POS, 1e6, scaling=scaling)
    static = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, eps=1e-6, is_neox=True)
    program = trace(
        vnorm_prologue,
        _act((hq + 2 * hkv) * d),
        POS,
        table_spec(d),
        spec(d),
        spec(d),
        spec(d) if bias else None,  # q_bias, k_bias: added after the weight, before RoPE
        spec(d) if bias else None,
        weight_offset=0.0,
        numerics="fused",
        **static,
    )
    qkv = randn(gen, t, (hq + 2 * hkv) * d, scale=3.0, centre=0.5)
    qw, kw = randn(gen, d, scale=0.3, centre=1.0), randn(gen, d, scale=0.3, centre=1.0)
    qb, kb = (randn(gen, d, scale=0.5, centre=0.0) if bias else None for _ in "qk")
    pos = positions(gen, t)
    expected = reference.vnorm_prologue(qkv, pos, cache, qw, kw, q_bias=qb, k_bias=kb, **static)
    inputs = (qkv, pos, cache, qw, kw) + ((qb, kb) if bias else ())
    check_reference_and_kernel(program, inputs, list(expected), [d] * 3)


@needs_interpreter
@pytest.mark.parametrize("is_neox", [False, True])
def test_rope_then_l2norm_composition(gen, is_neox):
    hq, hkv, d, t = 5, 1, 64, 6
    cache = rope_cos_sin_cache(d, MAX_POS, 5e5, scaling=LLAMA4)
    static = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, eps=1e-5, is_neox=is_neox)
    program = trace(
        rope_l2norm_prologue,
        _act((hq + 2 * hkv) * d),
        POS,
        table_spec(d),
        numerics="fused",
        **static,
    )
    qkv = randn(gen, t, (hq + 2 * hkv) * d, scale=2.0)
    pos = positions(gen, t)
    expected = reference.rope_l2norm_prologue(qkv, pos, cache, **static)
    check_reference_and_kernel(program, (qkv, pos, cache), list(expected), [d] * 3, copies=(2,))


@needs_interpreter
@pytest.mark.parametrize("floor_scale, top", [(8192.0, 1 << 22), (4.0, 64)])
def test_nope_temperature_composition(gen, floor_scale, top):
    # floor_scale 4 with positions below 64: five tokens cross several floors of (p + 1) / 4.
    hq, hkv, d, t = 3, 2, 48, 5
    static = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, eps=1e-5, is_neox=False)
    temperature = dict(floor_scale=floor_scale, attn_scale=0.1)
    program = trace(
        rope_l2norm_prologue,
        _act((hq + 2 * hkv) * d, torch.float16),
        POS,
        None,
        numerics="fused",
        **static,
        **temperature,
    )
    qkv = randn(gen, t, (hq + 2 * hkv) * d, scale=2.0, dtype=torch.float16)
    pos = torch.randint(0, top, (t,), generator=gen)
    pos[0] = top - 1
    expected = reference.rope_l2norm_prologue(qkv, pos, None, **static, **temperature)
    assert (reference.attn_temperature(pos, **temperature) > 1).any()  # a real scale, not 1
    check_reference_and_kernel(program, (qkv, pos), list(expected), [d] * 3, copies=(1, 2))


@needs_interpreter
def test_weightless_full_width_norm(gen):
    # A norm over the whole row without weight (a ROW reduction with no vector operand).
    t, width = 4, 3 * 40

    def full(x):
        return (ops.rms_norm(x, None, eps=1e-6, group_size=width),)

    program = trace(full, _act(width))
    x = randn(gen, t, width, scale=4.0)
    expected = reference.rms_norm(x, eps=1e-6, group_size=width)
    check_reference_and_kernel(program, (x,), [expected], [40])
