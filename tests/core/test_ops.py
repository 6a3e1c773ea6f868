"""The pure ops and the reference backend against the independent float64 formulation
(``fqr.reference``: norm by its formula, RoPE as complex multiplication), on fresh random
inputs and real RoPE tables."""

from __future__ import annotations

import pytest
import torch
from conftest import make_problem
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fqr
from fqr import ops, reference
from fqr.numerics import compare
from fqr.prologue import NormStats
from fqr.rope_cache import rope_cos_sin_cache

F64 = dict(atol=1e-12, rtol=1e-12)
HEAD_DIMS = (64, 80, 96, 128, 192, 256)


def _randn(gen, *shape, scale=2.0):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def test_split_qkv_returns_new_contiguous_head_slices(gen):
    hq, hkv, d, t = 6, 2, 80, 7
    qkv = _randn(gen, t, (hq + 2 * hkv) * d).to(torch.bfloat16)
    before = qkv.clone()
    q, k, v = ops.split_qkv(qkv, hq, hkv, d)
    heads = qkv.reshape(t, hq + 2 * hkv, d)
    assert torch.equal(q, heads[:, :hq].reshape(t, -1))
    assert torch.equal(k, heads[:, hq : hq + hkv].reshape(t, -1))
    assert torch.equal(v, heads[:, hq + hkv :].reshape(t, -1))
    for out in (q, k, v):
        assert (
            out.is_contiguous()
            and out.untyped_storage().data_ptr() != qkv.untyped_storage().data_ptr()
        )
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("weight_offset,bias", [(0.0, False), (1.0, False), (0.0, True)])
def test_rms_norm_per_head_float64(gen, head_dim, weight_offset, bias):
    x = _randn(gen, 5, 3 * head_dim)
    w = _randn(gen, head_dim, scale=0.2) + (0.0 if weight_offset else 1.0)
    b = _randn(gen, head_dim, scale=0.05) if bias else None
    got = ops.rms_norm(x, w, eps=1e-6, group_size=head_dim, bias=b, weight_offset=weight_offset)
    want = reference.rms_norm(
        x, w, eps=1e-6, group_size=head_dim, bias=b, weight_offset=weight_offset
    )
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, **F64)


def test_rms_norm_full_width_and_sharded_statistic_float64(gen):
    x = _randn(gen, 9, 3 * 96)
    w = 1.0 + _randn(gen, 3 * 96, scale=0.2)
    torch.testing.assert_close(
        ops.rms_norm(x, w, eps=1e-5, group_size=3 * 96),
        reference.rms_norm(x, w, eps=1e-5, group_size=3 * 96),
        **F64,
    )
    # A TP shard: the statistic covers this shard plus features held by other ranks.
    others = _randn(gen, 9, 5 * 96)
    sum_sq = (x.square().sum(-1) + others.square().sum(-1)).float()
    got = ops.rms_norm(x, w, eps=1e-5, group_size=3 * 96, sum_sq=sum_sq, count=8 * 96)
    want = reference.rms_norm(x, w, eps=1e-5, group_size=3 * 96, sum_sq=sum_sq, count=8 * 96)
    torch.testing.assert_close(got, want, **F64)
    unsharded = reference.rms_norm(
        torch.cat([x, others], -1), torch.cat([w, w, w[: 2 * 96]]), eps=1e-5, group_size=8 * 96
    )[:, : 3 * 96]
    torch.testing.assert_close(got, unsharded, atol=1e-6, rtol=1e-6)  # sum_sq went through fp32


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5, 0.25])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rope_float64(gen, head_dim, rotary_fraction, is_neox):
    rotary_dim = int(head_dim * rotary_fraction) // 2 * 2
    max_position = 40961
    cache = rope_cos_sin_cache(rotary_dim, max_position, 1e6)
    x = _randn(gen, 7, 3 * head_dim)
    positions = torch.randint(0, max_position, (7,), generator=gen)
    got = ops.rope(x, positions, cache, head_dim=head_dim, is_neox=is_neox)
    want = reference.rope(x, positions, cache, head_dim=head_dim, is_neox=is_neox)
    torch.testing.assert_close(got, want, **F64)
    heads = x.reshape(7, 3, head_dim)
    assert torch.equal(got.reshape(7, 3, head_dim)[..., rotary_dim:], heads[..., rotary_dim:])


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim, table_width", [(48, 64), (48, 128), (64, 128)])
def test_rope_narrower_rotary_dim_takes_the_first_frequencies(gen, head_dim, table_width, is_neox):
    """rotary_dim r < the table width R (the MiniMax indexer's narrow head group): the first r
    features turn by the first r/2 frequencies of the R-wide table, cos = row[:r/2], sin =
    row[R/2 : R/2 + r/2], checked against the angles pos * theta^(-2i/R) in float64."""
    r, theta, max_position = head_dim, 1e7, 1 << 16
    cache = rope_cos_sin_cache(table_width, max_position, theta)
    x = _randn(gen, 5, 2 * head_dim)
    pos = torch.randint(0, max_position, (5,), generator=gen)
    got = ops.rope(x, pos, cache, head_dim=head_dim, is_neox=is_neox, rotary_dim=r)
    inv_freq = theta ** (-torch.arange(0, r, 2, dtype=torch.float64) / table_width)
    angle = pos.double()[:, None, None] * inv_freq
    heads = x.double().reshape(5, 2, head_dim)
    if is_neox:
        x1, x2 = heads[..., : r // 2], heads[..., r // 2 : r]
    else:
        x1, x2 = heads[..., 0:r:2], heads[..., 1:r:2]
    o1 = x1 * angle.cos() - x2 * angle.sin()
    o2 = x2 * angle.cos() + x1 * angle.sin()
    rotated = torch.cat([o1, o2], -1) if is_neox else torch.stack([o1, o2], -1).flatten(-2)
    want = torch.cat([rotated, heads[..., r:]], -1).reshape(5, -1)
    # the table is fp32 (cos/sin rounded once): the angles' float64 values within 1e-6
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


def test_rope_rotary_dim_errors_name_it(gen):
    cache = rope_cos_sin_cache(64, 128, 1e4)
    x, pos = _randn(gen, 2, 96), torch.tensor([0, 5])
    for bad, message in ((47, "even"), (0, "even"), (80, "at most the cos_sin_cache width 64")):
        with pytest.raises(ValueError, match=message):
            ops.rope(x, pos, cache, head_dim=48, rotary_dim=bad)
    with pytest.raises(ValueError, match="rotary_dim 64 exceeds head_dim 48"):
        ops.rope(x, pos, cache, head_dim=48, rotary_dim=64)
    with pytest.raises(ValueError, match="cos_sin_cache width.* 64 exceeds head_dim 48"):
        ops.rope(x, pos, cache, head_dim=48)
    with pytest.raises(TypeError, match="rotary_dim must be an int"):
        ops.rope(x, pos, cache, head_dim=48, rotary_dim=48.0)


def test_gptj_is_neox_on_interleaved_features(gen):
    """GPT-J pairs (2i, 2i+1); NeoX pairs (i, i+R/2): the same rotation up to a permutation."""
    d, r = 128, 64
    cache = rope_cos_sin_cache(r, 8192, 1e4)
    x = _randn(gen, 4, 2 * d)
    pos = torch.randint(0, 8192, (4,), generator=gen)
    perm = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, d)])
    inv = torch.argsort(perm)
    x_neox = x.reshape(4, 2, d)[..., perm].reshape(4, -1)
    for rope in (ops.rope, reference.rope):
        gptj = rope(x, pos, cache, head_dim=d, is_neox=False)
        neox = rope(x_neox, pos, cache, head_dim=d, is_neox=True).reshape(4, 2, d)[..., inv]
        torch.testing.assert_close(gptj, neox.reshape(4, -1), **F64)


def test_rope_preserves_pair_lengths(gen):
    """|rotated pair| = |pair| * sqrt(cos^2 + sin^2) of the (fp32-rounded) table row."""
    d = 96
    cache = rope_cos_sin_cache(d, 1 << 18, 1e7)
    pos = torch.randint(0, 1 << 18, (6,), generator=gen)
    x = _randn(gen, 6, d)
    y = ops.rope(x, pos, cache, head_dim=d)
    row = cache[pos].double()
    gain = (row[:, : d // 2] ** 2 + row[:, d // 2 :] ** 2).sqrt()
    length = lambda v: (v[:, : d // 2] ** 2 + v[:, d // 2 :] ** 2).sqrt()  # noqa: E731
    torch.testing.assert_close(length(y), length(x) * gain, **F64)


@pytest.mark.parametrize("norm", ["head", "full", "none"])
def test_ops_composition_float64_matches_reference_prologue(gen, norm):
    p = make_problem(
        gen,
        tokens=7,
        num_heads=6,
        num_kv_heads=2,
        head_dim=80,
        rotary_dim=40,
        dtype=torch.float32,
        bias=norm != "none",
        norm=norm,
        is_neox=False,
    )
    to64 = lambda t: None if t is None else t.double()  # noqa: E731
    x, w_q, w_k = to64(p.qkv), to64(p.q_weight), to64(p.k_weight)
    got = fqr.attention_prologue(
        x,
        p.positions,
        p.cos_sin_cache,
        w_q,
        w_k,
        to64(p.q_bias),
        to64(p.k_bias),
        None,
        None,
        numerics="fused",
        **p.spec.kwargs(),
    )
    want = reference.prologue(
        x,
        p.positions,
        p.cos_sin_cache,
        w_q,
        w_k,
        q_bias=to64(p.q_bias),
        k_bias=to64(p.k_bias),
        **p.spec.kwargs(),
    )
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.double(), **F64)


def _check_reference(p, numerics="fused", norm_stats=None):
    q, k, v = fqr.split_qkv_rmsnorm_rope(
        *p.args(), **p.kwargs(numerics=numerics, norm_stats=norm_stats), backend="reference"
    )
    eq, ek, ev = reference.prologue(*p.args(), **p.kwargs(norm_stats=norm_stats))
    d = p.spec.head_dim
    for out, exact in ((q, eq), (k, ek)):
        assert out.dtype == p.qkv.dtype and out.is_contiguous()
        c = compare(out, exact, head_dim=d, numerics=numerics)
        assert c.passed, c
    assert torch.equal(v, ev)
    return q, k


CONFIGS = {  # odd, non-power-of-two shapes; the variations of the presets
    "qwen3-like": dict(num_heads=5, num_kv_heads=1, head_dim=128),
    "gemma-1+w-d256": dict(num_heads=4, num_kv_heads=1, head_dim=256, weight_offset=1.0),
    "partial-quarter-pos2^18": dict(
        num_heads=3,
        num_kv_heads=3,
        head_dim=256,
        rotary_dim=64,
        weight_offset=1.0,
        max_position=1 << 18,
    ),
    "gptj-half-no-norm": dict(
        num_heads=6, num_kv_heads=2, head_dim=128, rotary_dim=64, is_neox=False, norm="none"
    ),
    "full-width-norm-bias": dict(num_heads=3, num_kv_heads=3, head_dim=96, norm="full", bias=True),
    "d80-bias": dict(num_heads=6, num_kv_heads=2, head_dim=80, bias=True),
    "d192-gptj": dict(num_heads=2, num_kv_heads=1, head_dim=192, is_neox=False),
    "d64": dict(num_heads=8, num_kv_heads=4, head_dim=64),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_reference_backend_meets_fused_contract(gen, config, dtype):
    _check_reference(
        make_problem(gen, tokens=9, dtype=dtype, **{"max_position": 40961, **CONFIGS[config]})
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reference_backend_unfused_within_bound_and_rounded(gen, dtype):
    p = make_problem(gen, tokens=33, dtype=dtype, bias=True)
    fused = _check_reference(p, "fused")
    unfused = _check_reference(p, "unfused")
    assert any(not torch.equal(a, b) for a, b in zip(fused, unfused)), (
        "unfused mode changed nothing"
    )


def test_reference_backend_sharded_full_norm(gen):
    p = make_problem(gen, tokens=7, num_heads=2, num_kv_heads=2, head_dim=128, norm="full")
    others = torch.randn(7, 6 * 128, generator=gen, dtype=torch.float64)
    q_sq = p.qkv[:, :256].double().square().sum(-1) + others.square().sum(-1)
    k_sq = p.qkv[:, 256:512].double().square().sum(-1) + others[:, :256].square().sum(-1) * 2
    stats = NormStats(q_sq.float(), k_sq.float(), 8 * 128, 8 * 128)
    _check_reference(p, norm_stats=stats)


def test_ops_do_not_write_their_inputs(problem):
    before = [t.clone() for t in problem.args()]
    fqr.split_qkv_rmsnorm_rope(*problem.args(), **problem.kwargs(), backend="reference")
    for b, a in zip(before, problem.args()):
        assert torch.equal(a, b)


def test_row_stride_larger_than_width(gen):
    p = make_problem(gen, tokens=6, dtype=torch.float16)
    wide = torch.full((6, p.qkv.shape[1] + 40), float("nan"), dtype=p.qkv.dtype)
    wide[:, : p.qkv.shape[1]] = p.qkv
    p.qkv = wide[:, : p.qkv.shape[1]]
    _check_reference(p)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.data(),
    head_dim=st.sampled_from(HEAD_DIMS),
    group=st.integers(1, 4),
    num_kv_heads=st.integers(1, 3),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    numerics=st.sampled_from(["fused", "unfused"]),
    norm=st.sampled_from(["head", "full", "none"]),
    is_neox=st.booleans(),
    weight_offset=st.sampled_from([0.0, 1.0]),
    tokens=st.integers(1, 9),
)
def test_reference_backend_random_configs(
    gen, data, head_dim, group, num_kv_heads, dtype, numerics, norm, is_neox, weight_offset, tokens
):
    rotary_dim = data.draw(st.integers(1, head_dim // 2)) * 2
    bias = norm != "none" and data.draw(st.booleans())
    theta = data.draw(st.sampled_from([1e4, 5e5, 1e6, 1e7]))
    p = make_problem(
        gen,
        tokens=tokens,
        num_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        dtype=dtype,
        is_neox=is_neox,
        bias=bias,
        weight_offset=weight_offset,
        norm=norm,
        theta=theta,
        max_position=data.draw(st.sampled_from([1, 7, 4099, 40961])),
    )
    _check_reference(p, numerics)
