"""The ops behind issue 15's norm variants, by their own rules: a norm without weight and the
attention temperature against fqr.reference's float64 formulas (which share no code with
fqr.ops), their shape rules' errors naming the argument, and the two RoPE tables the presets
add (Gemma 4's proportional one, Llama 4's llama3 scaling with equal band factors) against
formulas written here from vLLM's / Hugging Face's code."""

from __future__ import annotations

import math

import pytest
import torch

from fqr import ops, reference
from fqr.core import eval_program, spec, trace
from fqr.numerics import compare
from fqr.rope_cache import inverse_frequencies, rope_cos_sin_cache


def _act(width, dtype=torch.bfloat16):
    return spec("T", width, dtype=dtype)


@pytest.mark.parametrize("numerics", ["fused", "unfused"])
def test_weightless_norm_matches_float64(gen, numerics):
    t, d, heads = 7, 96, 3
    x = (torch.randn(t, heads * d, generator=gen, dtype=torch.float64) * 3 + 0.2).bfloat16()
    round_to = torch.bfloat16 if numerics == "unfused" else None

    def norm(v):
        return (ops.rms_norm(v, None, eps=1e-6, group_size=d, round_to=round_to),)

    (out,) = eval_program(trace(norm, _act(heads * d)), [x])
    expected = reference.rms_norm(x, eps=1e-6, group_size=d)
    assert compare(out, expected, head_dim=d, numerics=numerics).passed
    if numerics == "unfused":  # one rounding of the fp32 product, as vLLM's has_weight=False
        xf = x.float().reshape(t, heads, d)
        vllm = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
        assert torch.equal(out, vllm.reshape(t, heads * d))


def test_weightless_norm_refuses_bias_and_offset():
    b = spec(32)
    with pytest.raises(ValueError, match="without weight"):
        trace(lambda x, b: (ops.rms_norm(x, None, eps=1e-6, group_size=32, bias=b),), _act(64), b)
    with pytest.raises(ValueError, match="weight_offset"):
        trace(
            lambda x: (ops.rms_norm(x, None, eps=1e-6, group_size=32, weight_offset=1.0),),
            _act(64),
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attn_temperature_matches_float64(gen, dtype):
    t, width = 9, 80
    x = torch.randn(t, width, generator=gen, dtype=torch.float64).to(dtype)
    pos = torch.randint(0, 1 << 23, (t,), generator=gen)
    pos[:3] = torch.tensor([0, 8190, 8191])  # floor((p + 1) / 8192) = 0, 0, 1

    def temp(v, p):
        return (ops.attn_temperature(v, p, floor_scale=8192, attn_scale=0.1),)

    (out,) = eval_program(trace(temp, _act(width, dtype), spec("T", dtype=torch.int64)), [x, pos])
    scale = reference.attn_temperature(pos, floor_scale=8192, attn_scale=0.1)
    assert scale[0] == 1.0 and scale[1] == 1.0 and scale[2] == 1.0 + 0.1 * math.log(2)
    assert compare(out, x.double() * scale[:, None], head_dim=width).passed


@pytest.mark.parametrize(
    "kwargs, pos_dtype, match",
    [
        (dict(floor_scale=0.0, attn_scale=0.1), torch.int64, "floor_scale"),
        (dict(floor_scale=8192.0, attn_scale=float("nan")), torch.int64, "attn_scale"),
        (dict(floor_scale=8192.0, attn_scale=0.1), torch.float32, "positions"),
    ],
)
def test_attn_temperature_errors_name_the_argument(kwargs, pos_dtype, match):
    with pytest.raises((TypeError, ValueError), match=match):
        trace(
            lambda v, p: (ops.attn_temperature(v, p, **kwargs),),
            _act(16),
            spec("T", dtype=pos_dtype),
        )


def test_proportional_table_is_gemma4s():
    # vLLM Gemma4RotaryEmbedding / HF _compute_proportional_rope_parameters: rope_angles =
    # int(head_dim * 0.25) // 2 frequencies 1 / theta^(2i / head_dim), the others 0.
    head_dim, theta, positions = 512, 1e6, [0, 1, 777, 262143]
    cache = rope_cos_sin_cache(
        head_dim,
        4,
        theta,
        scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25},
        rows=torch.tensor(positions),
        dtype=torch.float64,
    )
    angles = 64
    for row, p in zip(cache, positions):
        for i in (0, 1, 31, 63):
            a = p / theta ** (2 * i / head_dim)
            assert row[i].item() == pytest.approx(math.cos(a), abs=1e-9)
            assert row[head_dim // 2 + i].item() == pytest.approx(math.sin(a), abs=1e-9)
        assert torch.equal(
            row[angles : head_dim // 2], torch.ones(head_dim // 2 - angles, dtype=torch.float64)
        )
        assert torch.equal(
            row[head_dim // 2 + angles :], torch.zeros(head_dim // 2 - angles, dtype=torch.float64)
        )


def test_llama3_scaling_with_equal_band_factors_is_llama4s():
    # Llama 4 Scout: factor 16, low = high = 1 -> no smooth band (vLLM: smooth = 0): each
    # frequency is divided by 16 when its wavelength exceeds 8192, kept otherwise.
    scaling = {
        "rope_type": "llama3",
        "factor": 16.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
    }
    inv = inverse_frequencies(128, 5e5, scaling)
    assert torch.isfinite(inv).all()
    for i in range(64):
        f = 1.0 / 5e5 ** (2 * i / 128)
        want = f / 16.0 if 2 * math.pi / f > 8192 else f
        assert inv[i].item() == pytest.approx(want, rel=1e-12)
