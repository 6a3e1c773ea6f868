"""The comparison and the cache references as the GPU suite runs them (issue 37): where the data
is, in pieces of bounded size, the same result as in one piece."""

from __future__ import annotations

import pytest
import torch

import fqr.numerics as numerics
from fqr import reference
from fqr.numerics import compare


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("numerics_mode", ["fused", "unfused"])
def test_compare_in_pieces_is_compare_in_one(gen, dtype, numerics_mode, monkeypatch):
    """Every field of the result is the same with pieces of 3 heads as in one piece, on
    outputs with a few elements pushed outside the contract and one NaN."""
    exact = torch.randn(37, 4 * 16, generator=gen, dtype=torch.float64) * 3
    out = exact.to(dtype)
    out[5, 7] = out[5, 7] * 1.01 + 0.5
    out[30, 60] = float("nan")
    whole = compare(out, exact, head_dim=16, numerics=numerics_mode)
    monkeypatch.setattr(numerics, "COMPARE_CHUNK", 3 * 16)
    pieces = compare(out, exact, head_dim=16, numerics=numerics_mode)
    assert pieces == whole and not whole.passed and whole.nonfinite == 1 and whole.bad >= 1


def test_compare_moves_the_expectation_to_the_output(gen):
    """An expectation elsewhere (a golden file's, on the CPU) is moved where the output is:
    on meta the comparison reaches the host copy of its numbers, which meta has not."""
    exact = torch.randn(4, 32, generator=gen, dtype=torch.float64)
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"):
        compare(exact.to(torch.bfloat16).to("meta"), exact, head_dim=16)
    assert compare(exact.to(torch.bfloat16), exact, head_dim=16).passed


def test_cache_insert_keeps_the_later_token_of_a_slot_named_twice(gen):
    """One indexed store does what the loop over the tokens did: a slot named twice holds the
    later token's row; a negative slot writes nothing; ``written`` marks the rows."""
    cache = torch.randn(2, 4, 1, 8, generator=gen).to(torch.bfloat16)
    x = torch.randn(4, 8, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([5, -1, 5, 2])
    expected, written = reference.cache_insert(cache, x, slots)
    rows = expected.reshape(8, 8)
    assert torch.equal(rows[5], x[2].double()) and torch.equal(rows[2], x[3].double())
    assert written.reshape(-1).nonzero().flatten().tolist() == [2, 5]
    untouched = [r for r in range(8) if r not in (2, 5)]
    assert torch.equal(rows[untouched], cache.reshape(8, 8)[untouched].double())
