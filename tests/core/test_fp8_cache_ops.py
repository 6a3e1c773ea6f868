"""quantize_fp8 and cache_insert (fqr/ops/fp8.py, fqr/ops/cache.py): their impl rules against
the independent float64 formulation (fqr.reference: saturate_fp8, e4m3_round, cache_insert),
the E4M3 rounding itself against torch's float8_e4m3fn cast of the float64 value (the oracle),
and the shape rules' errors naming the argument."""

from __future__ import annotations

import pytest
import torch

from fqr import ops, reference
from fqr.core import Aval, trace
from fqr.numerics import compare, ordered_bits

E4M3 = torch.float8_e4m3fn


def e4m3_grid() -> torch.Tensor:
    """Every finite float8_e4m3fn value, ascending, as float64."""
    values = torch.arange(256, dtype=torch.uint8).view(E4M3).to(torch.float64)
    return values[~values.isnan()].unique()


def oracle(x64: torch.Tensor) -> torch.Tensor:
    return x64.to(E4M3).to(torch.float64)


# ----------------------------------------------------------------------- E4M3 rounding


def test_e4m3_round_keeps_every_grid_value():
    grid = e4m3_grid()
    assert grid.numel() == 253 and grid.max() == 448 and grid.min() == -448  # +-0 merged
    assert torch.equal(reference.e4m3_round(grid), grid)


def test_e4m3_round_ties_to_even_like_the_oracle():
    grid = e4m3_grid()
    mid = (grid[:-1] + grid[1:]) / 2  # exact ties, subnormal and normal binades
    got = reference.e4m3_round(mid)
    assert torch.equal(got, oracle(mid))
    even = (ordered_bits(got.to(E4M3)) % 2) == 0  # ties land on the even code
    assert bool(even.all())


def test_e4m3_round_random_values_across_binades(gen):
    mag = torch.exp2(torch.empty(20000, dtype=torch.float64).uniform_(-12, 8.8, generator=gen))
    x = (mag * torch.randn(20000, generator=gen, dtype=torch.float64).sign()).clamp(-448, 448)
    assert torch.equal(reference.e4m3_round(x), oracle(x))


def test_saturate_fp8_clamps_scales_and_keeps_nan():
    x = torch.tensor([1e6, -1e6, float("inf"), -float("inf"), float("nan"), 3.0])
    y = reference.saturate_fp8(x, torch.tensor([0.5]))
    assert y[:4].tolist() == [448.0, -448.0, 448.0, -448.0]
    assert y[4].isnan() and y[5] == 6.0


# ----------------------------------------------------------------------- quantize_fp8


@pytest.mark.parametrize("scale", [None, 0.037])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_fp8_impl_matches_float64(gen, dtype, scale):
    x = (torch.randn(9, 96, generator=gen) * torch.exp2(torch.randn(9, 1, generator=gen) * 4)).to(
        dtype
    )
    x[0, :4] = torch.tensor([1e4, -1e4, 500.0, -449.0]).to(dtype)  # saturates
    s = None if scale is None else torch.tensor([scale])
    out = ops.quantize_fp8(x, s)
    assert out.dtype == E4M3 and out.shape == x.shape
    expected = reference.saturate_fp8(x, s)
    c = compare(out, expected, head_dim=32)
    assert c.passed, c
    assert out[0, :4].tolist() == [448.0, -448.0, 448.0, -448.0]  # saturated, with a scale too
    # the correctly rounded value almost everywhere (fp32 x / scale may round a tie away)
    exact = reference.e4m3_round(expected)
    assert (out.to(torch.float64) == exact).float().mean() > 0.99


def test_quantize_fp8_keeps_nan():
    out = ops.quantize_fp8(torch.tensor([[float("nan"), 1.0]]))
    assert out.to(torch.float32)[0, 0].isnan() and out.to(torch.float32)[0, 1] == 1.0


def test_quantize_fp8_shape_rule_names_the_argument():
    x = Aval(("T", 64), torch.bfloat16)
    with pytest.raises(ValueError, match="scale must be a float32 tensor of shape \\[1\\]"):
        trace(ops.quantize_fp8, x, Aval((2,), torch.float32))
    with pytest.raises(ValueError, match="scale"):
        trace(ops.quantize_fp8, x, Aval((1,), torch.bfloat16))
    with pytest.raises(ValueError, match="x must be 2-D"):
        trace(ops.quantize_fp8, Aval(("T", 4, 16), torch.bfloat16), None)


# ----------------------------------------------------------------------- cache_insert


def poisoned_cache(blocks, block_size, heads, head_dim, dtype):
    return torch.full((blocks, block_size, heads, head_dim), float("nan")).to(dtype)


def slots_with_padding(gen, tokens, capacity):
    slots = torch.randperm(capacity, generator=gen)[:tokens]
    slots[1] = -1  # vLLM's padding slot
    slots[-1] = -1
    return slots


def check_cache(out, expected, written, original):
    """Written rows within the contract of their dtype; every other row bit for bit."""
    d = out.shape[-1]
    got = out[written].reshape(-1, d)
    c = compare(got, expected[written].reshape(-1, d), head_dim=d)
    assert c.passed, c
    bits = torch.int8 if out.dtype == E4M3 else torch.int16
    assert torch.equal(out[~written].view(bits), original[~written].view(bits))


@pytest.mark.parametrize(
    "cache_dtype,scale", [(torch.bfloat16, None), (torch.float16, None), (E4M3, None), (E4M3, 0.02)]
)
def test_cache_insert_impl_matches_float64(gen, cache_dtype, scale):
    blocks, block_size, heads, d, t = 6, 4, 2, 32, 9
    x = (torch.randn(t, heads * d, generator=gen) * 3).to(torch.bfloat16)
    cache = poisoned_cache(blocks, block_size, heads, d, cache_dtype)
    slots = slots_with_padding(gen, t, blocks * block_size)
    s = None if scale is None else torch.tensor([scale])
    out = ops.cache_insert(cache, x, slots, s)
    assert out.dtype == cache_dtype and out.shape == cache.shape
    assert cache.to(torch.float32).isnan().all()  # functional: the input is not written
    expected, written = reference.cache_insert(cache, x, slots, scale=s)
    assert int(written.sum()) == t - 2
    check_cache(out, expected, written, cache)


def test_cache_insert_reference_refuses_a_slot_past_the_cache(gen):
    cache = poisoned_cache(2, 4, 1, 16, torch.bfloat16)
    x = torch.randn(2, 16).to(torch.bfloat16)
    with pytest.raises(ValueError, match="slot_mapping names slot 8"):
        ops.cache_insert(cache, x, torch.tensor([0, 8]))


def test_cache_insert_shape_rule_names_the_argument():
    cache = Aval(("B", 16, 2, 64), torch.bfloat16)
    x, slots = Aval(("T", 128), torch.bfloat16), Aval(("T",), torch.int64)

    def run(c, v, s, scale=None):
        return trace(ops.cache_insert, c, v, s, scale)

    run(cache, x, slots)  # fine
    with pytest.raises(ValueError, match="scale applies only to a float8_e4m3fn cache or an E5M2"):
        run(cache, x, slots, Aval((1,), torch.float32))
    with pytest.raises(ValueError, match="cache must be 4-D .* or 3-D"):
        run(Aval(("B", 16 * 128), torch.bfloat16), x, slots)
    with pytest.raises(ValueError, match="column applies to a 3-D"):
        trace(lambda c, v, s: ops.cache_insert(c, v, s, column=0), cache, x, slots)
    with pytest.raises(ValueError, match="num_kv_heads \\* head_dim"):
        run(cache, Aval(("T", 192), torch.bfloat16), slots)
    with pytest.raises(TypeError, match="slot_mapping must be int32 or int64"):
        run(cache, x, Aval(("T",), torch.float32))
    with pytest.raises(ValueError, match="slot_mapping must be \\[T\\]"):
        run(cache, x, Aval(("T", 2), torch.int64))
    with pytest.raises(TypeError, match="cache must be bf16, fp16, fp32 or float8_e4m3fn"):
        run(Aval(("B", 16, 2, 64), torch.int8), x, slots)


def test_unfused_fp8_outputs_get_the_model_dtypes_bound_where_it_is_wider():
    """An unfused chain's FP8 output is E4M3 of a bf16-rounded value: an element small in its
    head may sit several E4M3 steps off (those steps are finer than the chain's bf16 error);
    the fused contract stays one E4M3 step."""
    from fqr.numerics import compare

    exact = torch.tensor([[100.0, 0.011, -3.0, 0.5]], dtype=torch.float64)
    out = exact.to(torch.float8_e4m3fn).clone()
    out.view(torch.int8)[0, 1] += 3  # 3 E4M3 steps off, 2e-5 of the head's max
    assert not compare(out, exact, head_dim=4).passed
    c = compare(out, exact, head_dim=4, numerics="unfused")
    assert c.passed and c.tolerance == "<=1 e4m3 ulp or <=0.031 x head max"
    out.view(torch.int8)[0, 0] += 2  # 100 two steps off: 16 / 100 > 2^-5
    assert not compare(out, exact, head_dim=4, numerics="unfused").passed
