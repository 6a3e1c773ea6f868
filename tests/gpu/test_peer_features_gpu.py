"""The peer features of :func:`fqr.split_qkv_rmsnorm_rope` on the compiled CUDA kernel (skipped
without a GPU; issue 18, item 5; formerly ``scripts/gpu_peers_numerics.py``): no RoPE, v with
its own head count and head_dim, padded heads, the in-place form and q rotated alone, each
against the independent float64 formulation (:func:`fqr.reference.prologue`) under the
numerics contract with every unread column of the row NaN (:mod:`support.peer_cases`, the
cases the CPU backends run in ``tests/backends/test_peer_features.py``); and the in-place form
at a serving batch, where the kernel takes its large-T variant."""

from __future__ import annotations

import pytest
import torch
from support.devices import GPU_DEVICE, has_values, rope_table
from support.peer_cases import PEER_CASES, check_peer_case, check_q_only
from support.peer_ports import ON_TRITON

import fqr
from fqr import reference
from fqr.bench.checks import check_row_index
from fqr.inputs import random_inputs
from fqr.numerics import compare

pytestmark = ON_TRITON


@pytest.mark.parametrize("case", PEER_CASES, ids=lambda c: c.name)
def test_peer_feature_on_the_gpu(gen, case):
    check_peer_case(case, "triton", gen, device=GPU_DEVICE)


def test_q_alone_on_the_gpu(gen):
    check_q_only("triton", gen, device=GPU_DEVICE)


SERVING_TOKENS = 16384  # the large-T kernel variant (above 8,192)


def test_in_place_at_a_serving_batch(gen):
    """Qwen3-8B bf16 at :data:`SERVING_TOKENS` tokens: ``inplace=True`` writes the same q and
    k bits into qkv as the out-of-place call returns, leaves v and every byte after k as they
    were, and those q and k rows (the first and last 64 and a random sample) are within the
    fused contract of float64."""
    tokens = SERVING_TOKENS
    p = fqr.get_preset("qwen3-8b")
    drawn = random_inputs(p.spec, tokens, torch.bfloat16, gen, rope_table(p))
    rows = check_row_index(tokens, 1024, gen, gen.device)
    exact = reference.prologue(
        drawn.qkv[rows], drawn.positions[rows], *drawn.args()[2:], **drawn.kwargs()
    )
    before = drawn.qkv.clone().view(torch.int16)
    x = drawn.to(GPU_DEVICE)
    x.qkv = x.qkv.clone()  # written in place below
    q, k, v = fqr.split_qkv_rmsnorm_rope(*x.args(), **x.kwargs(backend="triton"))
    qi, ki, vi = fqr.split_qkv_rmsnorm_rope(*x.args(), **x.kwargs(backend="triton", inplace=True))
    if not has_values(q, k, v, qi, ki, vi):
        return
    assert qi.data_ptr() == x.qkv.data_ptr(), "in place: q is a view of qkv"
    for name, a, b in (("q", qi, q), ("k", ki, k)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{name}: other bits"
    qk_width = p.spec.q_size + p.spec.kv_size
    assert torch.equal(x.qkv.view(torch.int16)[:, qk_width:], before[:, qk_width:])
    assert torch.equal(vi.view(torch.int16), v.view(torch.int16))
    for name, out, ex in (("q", qi, exact[0]), ("k", ki, exact[1])):
        c = compare(out[rows], ex, head_dim=p.head_dim)
        assert c.passed, f"{name} in place against float64: {c}"
