"""RMSNorm after RoPE with a weight (Hunyuan): ``split_qkv_rope_rmsnorm`` on the reference and
interpreted-kernel backends against the float64 formulation; the unfused contract equal to the
model's own chain (:func:`fqr.peers.hunyuan_prologue`) bit for bit on the reference backend; the
order matters (norm then rope is another result); bad weights refused."""

from __future__ import annotations

import pytest
import torch
from conftest import real_table

import fqr
from fqr import reference
from fqr.numerics import compare
from fqr.peers import hunyuan_prologue
from fqr.presets import PrologueSpec

BF16 = torch.bfloat16


def _call(gen, t=5, hq=4, hkv=2, d=32, rotary=32):
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=gen, dtype=torch.float64) * 2).to(BF16)
    positions = torch.randint(0, 1000, (t,), generator=gen)
    w = [(1 + 0.3 * torch.randn(d, generator=gen, dtype=torch.float64)).to(BF16) for _ in range(2)]
    heads = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d)
    return (qkv, positions, real_table(rotary, 1024, 1e4), *w), heads


@pytest.mark.parametrize("backend", ["reference", "interpret"])
@pytest.mark.parametrize("numerics", ["fused", "unfused"])
def test_rope_then_the_weighted_norm(gen, backend, numerics):
    args, heads = _call(gen, rotary=16)  # partial rotary
    q, k, v = fqr.split_qkv_rope_rmsnorm(*args, **heads, numerics=numerics, backend=backend)
    eq, ek, ev = reference.rope_rmsnorm_prologue(*args, **heads)
    d = heads["head_dim"]
    assert compare(q, eq, head_dim=d, numerics=numerics).passed
    assert compare(k, ek, head_dim=d, numerics=numerics).passed
    assert torch.equal(v, ev)
    # the other order (the norm first, then RoPE) is another result
    qkv, positions, table, qw, kw = args
    other = reference.prologue(qkv, positions, table, qw, kw, **heads, eps=1e-5)
    assert not compare(q, other[0], head_dim=d, numerics=numerics).passed


def test_unfused_is_the_models_chain_bit_for_bit(gen):
    args, heads = _call(gen)
    ours = fqr.split_qkv_rope_rmsnorm(*args, **heads, numerics="unfused", backend="reference")
    spec = PrologueSpec(**heads, rotary_dim=32, eps=1e-5)
    qkv, positions, table, qw, kw = args
    theirs = hunyuan_prologue(qkv, positions, table.to(BF16), qw, kw, spec)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_a_weight_of_another_length_is_refused(gen):
    args, heads = _call(gen)
    bad = (*args[:3], torch.ones(16, dtype=BF16), args[4])
    with pytest.raises(ValueError, match="q_weight"):
        fqr.split_qkv_rope_rmsnorm(*bad, **heads)
