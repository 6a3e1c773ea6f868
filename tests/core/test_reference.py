"""The float64 formulation itself (``fqr.reference``), against second formulations written here
in real arithmetic: the pieces every check in fqr trusts."""

from __future__ import annotations

import pytest
import torch

from fqr import reference
from fqr.core import Section
from fqr.rope_cache import rope_cos_sin_cache

F64 = dict(atol=1e-12, rtol=1e-12)


def _randn(gen, *shape, scale=2.0):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim,rotary_dim", [(128, 128), (80, 40), (256, 64)])
def test_rope_is_the_real_rotation_of_pairs(gen, is_neox, head_dim, rotary_dim):
    """(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) on each pair; features past R unchanged."""
    cache = rope_cos_sin_cache(rotary_dim, 40961, 1e6)
    positions = torch.randint(0, 40961, (6,), generator=gen)
    x = _randn(gen, 6, 3 * head_dim).to(torch.bfloat16)
    got = reference.rope(x, positions, cache, head_dim=head_dim, is_neox=is_neox)
    heads = x.double().reshape(6, 3, head_dim)
    half = rotary_dim // 2
    cos = cache[positions, :half].double()[:, None, :]
    sin = cache[positions, half:].double()[:, None, :]
    if is_neox:
        x1, x2 = heads[..., :half], heads[..., half:rotary_dim]
    else:
        x1, x2 = heads[..., 0:rotary_dim:2], heads[..., 1:rotary_dim:2]
    y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    want = heads.clone()
    if is_neox:
        want[..., :half], want[..., half:rotary_dim] = y1, y2
    else:
        want[..., 0:rotary_dim:2], want[..., 1:rotary_dim:2] = y1, y2
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want.reshape(6, -1), **F64)


def test_rotate_takes_angle_rows_from_any_source(gen):
    """``rope`` is ``rotate`` by the table's rows: rows from elsewhere (mRoPE) rotate alike."""
    cache = rope_cos_sin_cache(64, 4096, 1e4)
    positions = torch.randint(0, 4096, (5,), generator=gen)
    x = _randn(gen, 5, 2 * 64)
    rows = cache.index_select(0, positions)
    torch.testing.assert_close(
        reference.rotate(x, rows, head_dim=64),
        reference.rope(x, positions, cache, head_dim=64),
        atol=0,
        rtol=0,
    )


@pytest.mark.parametrize("group_size", [64, 3 * 64])
def test_rms_norm_by_its_formula(gen, group_size):
    x = _randn(gen, 4, 3 * 64).to(torch.float16)
    w = 1.0 + _randn(gen, group_size, scale=0.2)
    b = _randn(gen, group_size, scale=0.05)
    got = reference.rms_norm(x, w, eps=1e-6, group_size=group_size, bias=b, weight_offset=0.5)
    for t in range(4):
        for g in range(3 * 64 // group_size):
            v = x[t, g * group_size : (g + 1) * group_size].double()
            rms = (sum(float(e) ** 2 for e in v) / group_size + 1e-6) ** 0.5
            want = v / rms * (0.5 + w) + b
            torch.testing.assert_close(got[t, g * group_size : (g + 1) * group_size], want, **F64)


def test_weightless_norm_has_unit_mean_square(gen):
    """No weight (Llama 4's L2 norm, Gemma 4's v norm): each group's mean square is
    ``ms / (ms + eps)``, and a weight of ones changes nothing."""
    x = _randn(gen, 5, 4 * 32)
    eps = 1e-3
    y = reference.rms_norm(x, eps=eps, group_size=32)
    ms = x.reshape(5, 4, 32).square().mean(-1)
    torch.testing.assert_close(y.reshape(5, 4, 32).square().mean(-1), ms / (ms + eps), **F64)
    ones = torch.ones(32, dtype=torch.float64)
    torch.testing.assert_close(y, reference.rms_norm(x, ones, eps=eps, group_size=32), **F64)


def test_sharded_statistic_needs_its_count(gen):
    x = _randn(gen, 2, 64)
    with pytest.raises(ValueError, match="count"):
        reference.rms_norm(x, eps=1e-6, group_size=64, sum_sq=x.square().sum(-1))


def test_split_row_gathers_each_section_by_its_layout(gen):
    """Sections with their own head counts, head_dims, offsets and head strides: Qwen3.5's q
    heads interleaved with gate heads, k and v after them, MiniMax-style indexer heads of
    another head_dim, padding between; a section past the row's end is refused."""
    d, di = 32, 16
    sections = (
        Section(3, d, 0, 2 * d),  # q0 g0 q1 g1 q2 g2: q is every other head
        Section(3, d, d, 2 * d),  # the gates
        Section(1, d, 6 * d),  # k
        Section(1, d, 7 * d),  # v
        Section(2, di, 8 * d + 4, di + 4),  # indexer q heads, each followed by 4 pad columns
    )
    width = 8 * d + 4 + 2 * (di + 4)
    row = _randn(gen, 3, width).to(torch.bfloat16)
    q, gate, k, v, index_q = reference.split_row(row, sections)
    heads = row[:, : 6 * d].reshape(3, 3, 2, d)
    assert torch.equal(q, heads[:, :, 0].reshape(3, -1))
    assert torch.equal(gate, heads[:, :, 1].reshape(3, -1))
    assert torch.equal(k, row[:, 6 * d : 7 * d]) and torch.equal(v, row[:, 7 * d : 8 * d])
    padded = row[:, 8 * d + 4 :].reshape(3, 2, di + 4)[..., :di]
    assert torch.equal(index_q, padded.reshape(3, -1))
    assert q.dtype == torch.bfloat16 and q.is_contiguous()
    with pytest.raises(ValueError, match="reaches column"):
        reference.split_row(row[:, : width - 5], sections)  # the last 4 columns are padding


def test_prologue_copies_v_and_leaves_inputs(gen):
    cache = rope_cos_sin_cache(32, 512, 1e4)
    qkv = _randn(gen, 3, (2 + 2) * 32).to(torch.bfloat16)
    before = qkv.clone()
    positions = torch.randint(0, 512, (3,), generator=gen)
    w = torch.ones(32, dtype=torch.bfloat16)
    q, k, v = reference.prologue(
        qkv, positions, cache, w, w, num_heads=2, num_kv_heads=1, head_dim=32
    )
    assert (q.dtype, k.dtype, v.dtype) == (torch.float64, torch.float64, torch.bfloat16)
    assert torch.equal(v, qkv[:, 96:]) and v.data_ptr() != qkv.data_ptr()
    assert torch.equal(qkv, before)
