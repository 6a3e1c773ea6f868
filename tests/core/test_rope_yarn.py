"""YaRN tables (``fqr.rope_cache``, ``scaling={"rope_type": "yarn", ...}``) against a float64
formulation written here from the formulas of vLLM's ``DeepseekScalingRotaryEmbedding``
(``yarn_find_correction_range``, ``yarn_linear_ramp_mask``, ``yarn_get_mscale``), with plain
``math`` per element, not fqr's helpers: DeepSeek-V3's, DeepSeek-V2-Lite's and Kimi-K2's
parameters, and a ``mscale != mscale_all_dim`` case whose cos/sin multiplier is not 1.

Also: the fp32 table is the float64 one rounded once (the multiplier applied before the
rounding), the correction ranges of the three checkpoints as worked out by hand, the keys fqr
refuses, and Hugging Face's ``ROPE_INIT_FUNCTIONS["yarn"]`` on a ``DeepseekV3Config``.
"""

from __future__ import annotations

import math

import pytest
import torch

from fqr.presets import PRESETS
from fqr.rope_cache import cos_sin_scale, inverse_frequencies, rope_cos_sin_cache

R = 64  # qk_rope_head_dim of every MLA checkpoint

# name -> (theta, yarn scaling as the checkpoint's config.json has it, table rows)
CASES = {
    "deepseek-v3": (
        1e4,
        {
            "rope_type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        163840,
    ),
    "deepseek-v2-lite": (
        1e4,
        {
            "rope_type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        163840,
    ),
    "kimi-k2": (
        5e4,
        {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        131072,
    ),
    # no checkpoint: mscale != mscale_all_dim, so cos and sin are scaled by
    # (0.1 * 0.707 * ln 40 + 1) / (0.1 * ln 40 + 1) = 1.26081 / 1.36889 = 0.92104
    "mscale-0.707-over-1": (
        1e4,
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
        163840,
    ),
    # no checkpoint: d(beta_slow) = 64 ln(8192 / 2 pi) / (2 ln 500) = 36.9 -> high 37, past
    # R/2 - 1 = 31: vLLM (and HF) clamp the range to R - 1, so the ramp still ends at 37.
    "correction-range-past-the-pairs": (
        500.0,
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        65536,
    ),
}


def g(s: float, x: float) -> float:
    return 1.0 if s <= 1 else 0.1 * x * math.log(s) + 1.0


def multiplier(sc: dict) -> float:
    return g(sc["factor"], sc.get("mscale", 1.0)) / g(sc["factor"], sc.get("mscale_all_dim", 0.0))


def correction_range(theta: float, sc: dict) -> tuple[float, float]:
    def d(rotations):
        L = sc["original_max_position_embeddings"]
        return R * math.log(L / (2 * math.pi * rotations)) / (2 * math.log(theta))

    low = max(math.floor(d(sc.get("beta_fast", 32))), 0)
    high = min(math.ceil(d(sc.get("beta_slow", 1))), R - 1)
    return low, (high + 0.001 if high == low else high)


def frequency(i: int, theta: float, sc: dict) -> float:
    """f_i of the yarn table: the RoPE frequency blended between itself (extrapolation) and
    itself / factor (interpolation) by the linear ramp over the correction range."""
    base = 1.0 / theta ** (2 * i / R)
    low, high = correction_range(theta, sc)
    ramp = min(max((i - low) / (high - low), 0.0), 1.0)
    return base * (1.0 - ramp) + base / sc["factor"] * ramp


def positions(rows: int, gen: torch.Generator) -> list[int]:
    """Real positions across the table: around the original context and at the very end, and
    random ones."""
    fixed = [1, 2, 3, 7, 255, 4095, 4096, 4097, 65535, rows // 2 + 1, rows - 1]
    return fixed + torch.randint(1, rows, (16,), generator=gen).tolist()


def test_correction_ranges_of_the_checkpoints():
    # d(r) = 64 ln(4096 / (2 pi r)) / (2 ln theta): DeepSeek (theta 1e4) d(32) = 10.47 -> 10,
    # d(1) = 22.51 -> 23; Kimi-K2 (theta 5e4, beta_fast = beta_slow = 1) d(1) = 19.16 -> 19, 20.
    assert correction_range(*CASES["deepseek-v3"][:2]) == (10, 23)
    assert correction_range(*CASES["kimi-k2"][:2]) == (19, 20)
    assert correction_range(*CASES["correction-range-past-the-pairs"][:2]) == (19, 37)
    for name, (theta, sc, _) in CASES.items():
        inv = inverse_frequencies(R, theta, sc)
        low, high = correction_range(theta, sc)
        for i in range(R // 2):
            base = 1.0 / theta ** (2 * i / R)
            if i <= low:  # extrapolated: the frequency itself
                assert inv[i].item() == pytest.approx(base, rel=1e-14), (name, i)
            elif i >= high:  # interpolated: divided by the factor
                assert inv[i].item() == pytest.approx(base / sc["factor"], rel=1e-14), (name, i)
            else:
                assert base / sc["factor"] < inv[i].item() < base, (name, i)


@pytest.mark.parametrize("name", CASES)
def test_yarn_table_is_the_float64_formula(name, gen):
    theta, sc, rows = CASES[name]
    pos = positions(rows, gen)
    table = rope_cos_sin_cache(
        R, rows, theta, scaling=sc, dtype=torch.float64, rows=torch.tensor(pos)
    )
    assert table.shape == (len(pos), R) and table.dtype == torch.float64
    m = multiplier(sc)
    assert cos_sin_scale(sc) == pytest.approx(m, rel=1e-15)
    for row, p in zip(table.tolist(), pos):
        for i in range(R // 2):
            angle = p * frequency(i, theta, sc)
            # 1e-12 relative to the angle: the float64 rounding of p * f_i, nothing more
            tol = 1e-12 * (1.0 + angle)
            assert abs(row[i] - m * math.cos(angle)) <= tol, (p, i)
            assert abs(row[R // 2 + i] - m * math.sin(angle)) <= tol, (p, i)


def test_mscale_multiplies_cos_and_sin():
    theta, sc, rows = CASES["mscale-0.707-over-1"]
    m = (0.1 * 0.707 * math.log(40) + 1) / (0.1 * math.log(40) + 1)
    assert m == pytest.approx(0.92104, abs=1e-5)
    pos = torch.tensor([5, 4097, 163839])
    scaled = rope_cos_sin_cache(R, rows, theta, scaling=sc, dtype=torch.float64, rows=pos)
    unit = rope_cos_sin_cache(
        R, rows, theta, scaling=sc | {"mscale_all_dim": 0.707}, dtype=torch.float64, rows=pos
    )
    # the same angles; cos^2 + sin^2 = m^2 instead of 1
    torch.testing.assert_close(scaled, unit * m, rtol=1e-15, atol=0)
    radius = scaled[:, : R // 2] ** 2 + scaled[:, R // 2 :] ** 2
    torch.testing.assert_close(radius, torch.full_like(radius, m * m), rtol=1e-14, atol=0)


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "kimi-k2", "mscale-0.707-over-1"])
def test_fp32_table_is_the_float64_one_rounded_once(name, gen):
    theta, sc, rows = CASES[name]
    pos = torch.randint(0, rows, (4096,), generator=gen)
    wide = rope_cos_sin_cache(R, rows, theta, scaling=sc, dtype=torch.float64, rows=pos)
    narrow = rope_cos_sin_cache(R, rows, theta, scaling=sc, dtype=torch.float32, rows=pos)
    assert torch.equal(narrow, wide.to(torch.float32))


def test_deepseek_v3_preset_table_is_the_float64_one_rounded_once():
    """The whole 163840 x 64 table of the preset (``Preset.cos_sin_cache``)."""
    preset = PRESETS["deepseek-v3"]
    narrow = preset.cos_sin_cache()
    assert narrow.shape == (163840, 64) and narrow.dtype == torch.float32
    theta, sc, rows = CASES["deepseek-v3"]
    wide = rope_cos_sin_cache(R, rows, theta, scaling=sc, dtype=torch.float64)
    assert torch.equal(narrow, wide.to(torch.float32))


def test_missing_keys_take_vllms_defaults():
    # DeepseekScalingRotaryEmbedding: beta_fast 32, beta_slow 1, mscale 1, mscale_all_dim 0
    # (g = 1), attn_factor 1, extrapolation_factor 1
    short = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096}
    full = short | {"beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.0}
    pos = torch.tensor([3, 5000, 160001])
    torch.testing.assert_close(
        rope_cos_sin_cache(R, 0, 1e4, scaling=short, dtype=torch.float64, rows=pos),
        rope_cos_sin_cache(R, 0, 1e4, scaling=full, dtype=torch.float64, rows=pos),
        rtol=0,
        atol=0,
    )
    assert cos_sin_scale(short) == pytest.approx(0.1 * math.log(40.0) + 1.0, rel=1e-15)


def test_attn_and_extrapolation_factors():
    """vLLM's ``attn_factor`` multiplies the table; ``extrapolation_factor`` scales the
    extrapolation weight ``1 - ramp`` (0: every pair interpolated)."""
    theta, sc, _ = CASES["deepseek-v3"]
    assert cos_sin_scale(sc | {"attn_factor": 0.5}) == 0.5
    inv = inverse_frequencies(R, theta, sc | {"extrapolation_factor": 0.0})
    base = 1.0 / theta ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    torch.testing.assert_close(inv, base / 40, rtol=1e-14, atol=0)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"attention_factor": 1.0}, "attention_factor"),
    ],
)
def test_keys_vllm_does_not_read_are_refused(extra, message):
    theta, sc, _ = CASES["deepseek-v3"]
    with pytest.raises(ValueError, match=rf"scaling\['{message}'\]: a yarn scaling takes only"):
        rope_cos_sin_cache(R, 4, theta, scaling=sc | extra)


def test_factor_and_original_context_are_required():
    with pytest.raises(ValueError, match="missing factor"):
        inverse_frequencies(R, 1e4, {"rope_type": "yarn", "original_max_position_embeddings": 1})


def test_inverse_frequencies_and_scaling_agree_with_transformers():
    """Hugging Face's ``_compute_yarn_parameters`` (``ROPE_INIT_FUNCTIONS["yarn"]``) on a
    ``DeepseekV3Config`` holding each checkpoint's numbers. Expected to agree: the inverse
    frequencies (HF computes them in float32: to float32 precision) and the cos/sin multiplier
    (``attention_factor``: exactly, for these configs, which give both ``mscale`` and
    ``mscale_all_dim``). Not expected to agree, and not exercised: a config with only one of
    the two mscales (HF then ignores ``mscale``), or one with HF's ``attention_factor`` or
    ``truncate: false`` (fqr refuses them, as vLLM's DeepSeek path ignores them)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for name, (theta, sc, rows) in CASES.items():
        legacy = {k: v for k, v in sc.items() if k != "rope_type"} | {"type": "yarn"}
        config = transformers.DeepseekV3Config(
            rope_scaling=legacy, rope_theta=theta, max_position_embeddings=rows
        )
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        assert inv_freq.dtype == torch.float32 and inv_freq.shape == (R // 2,)
        ours = inverse_frequencies(R, theta, sc)
        torch.testing.assert_close(inv_freq.double(), ours, rtol=2e-7, atol=0, msg=name)
        assert attention_factor == pytest.approx(cos_sin_scale(sc), rel=1e-15), name


def test_truncate_false_agrees_with_transformers():
    """``truncate: false`` (gpt-oss's yarn): the correction range's ends unrounded, as Hugging
    Face's ``_compute_yarn_parameters`` reads it on a ``GptOssConfig`` (float32: to float32
    precision), and unlike the truncated table (which fqr built before)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    sc = {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096,
    }  # fmt: skip
    config = transformers.GptOssConfig(rope_parameters=sc | {"rope_theta": 150000.0})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = inverse_frequencies(config.head_dim, 150000.0, sc)
    torch.testing.assert_close(inv_freq.double(), ours, rtol=2e-7, atol=0)
    assert attention_factor == pytest.approx(cos_sin_scale(sc), rel=1e-15)
    truncated = inverse_frequencies(config.head_dim, 150000.0, sc | {"truncate": True})
    assert ((truncated - ours) / ours).abs().max() > 1e-2  # the ramp's frequencies move


def test_truncate_must_be_a_bool():
    _, sc, _ = CASES["deepseek-v3"]
    with pytest.raises(TypeError, match=r"scaling\['truncate'\] must be a bool"):
        rope_cos_sin_cache(R, 4, 1e4, scaling=sc | {"truncate": "no"})
