"""The peer features (no RoPE, v's own head count and head_dim, padded heads, in place) on the
reference backend and the interpreted kernel (``support.peer_cases``; the ascend-interpret run
is ``tests/ascend/test_ascend_peer_features.py``), and their argument checks."""

from __future__ import annotations

import pytest
import torch
from support.peer_cases import HKV, HQ, PEER_CASES, D, check_peer_case, check_q_only, peer_inputs

import fqr
from fqr.backends import BACKENDS

BACKENDS_HERE = [
    "reference",
    pytest.param(
        "interpret",
        marks=pytest.mark.skipif(
            not BACKENDS["interpret"].available,
            reason=BACKENDS["interpret"].unavailable_reason() or "",
        ),
    ),
]


@pytest.mark.parametrize("backend", BACKENDS_HERE)
@pytest.mark.parametrize("case", PEER_CASES, ids=lambda c: c.name)
def test_peer_feature_meets_the_contract(gen, case, backend):
    check_peer_case(case, backend, gen)


def _call(gen, **changes):
    case = next(c for c in PEER_CASES if c.name == "inplace")
    _, qkv, positions, table, qw, kw = peer_inputs(case, gen)
    args = dict(qkv=qkv, positions=positions, cos_sin_cache=table, q_weight=qw, k_weight=kw)
    kwargs = dict(num_heads=HQ, num_kv_heads=HKV, head_dim=D, backend="reference")
    for name, value in changes.items():
        (args if name in args else kwargs)[name] = value
    before = qkv.clone()
    try:
        fqr.split_qkv_rmsnorm_rope(*args.values(), **kwargs)
    finally:
        assert torch.equal(qkv.view(torch.int16), before.view(torch.int16)), "written anyway"


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(positions=None), "positions is required with a cos_sin_cache"),
        (dict(inplace=1), "inplace must be a bool"),
        (dict(inplace=True, head_stride=40), "inplace=True needs heads back to back"),
        (dict(head_stride=16), "head_stride 16 is smaller than a head"),
        (dict(head_stride=0), "head_stride must be >= 1"),
        (dict(num_v_heads=0), "num_v_heads must be >= 1"),
        (dict(v_head_dim=2.5), "v_head_dim must be an int"),
        (dict(num_v_heads=3), r"qkv width 256 != num_heads\*head_dim .* = 288"),
        (dict(head_stride=40), r"qkv width 256 != \(num_heads \+ num_kv_heads \+ num_v_heads\)"),
    ],
)
def test_bad_peer_arguments_are_refused_naming_them(gen, changes, message):
    with pytest.raises((ValueError, TypeError), match=message):
        _call(gen, **changes)


def test_inplace_refuses_inputs_that_require_grad(gen):
    case = next(c for c in PEER_CASES if c.name == "inplace")
    _, qkv, positions, table, qw, kw = peer_inputs(case, gen)
    qkv = qkv.clone().requires_grad_()
    with pytest.raises(ValueError, match="inplace=True cannot write into qkv"):
        fqr.split_qkv_rmsnorm_rope(
            qkv,
            positions,
            table,
            qw,
            kw,
            num_heads=HQ,
            num_kv_heads=HKV,
            head_dim=D,
            inplace=True,
        )


def test_inplace_with_no_tokens_returns_empty_views(gen):
    qkv = torch.empty(0, (HQ + 2 * HKV) * D, dtype=torch.bfloat16)
    w = torch.ones(D, dtype=torch.bfloat16)
    q, k, v = fqr.split_qkv_rmsnorm_rope(
        qkv, None, None, w, w, num_heads=HQ, num_kv_heads=HKV, head_dim=D, inplace=True
    )
    assert (q.shape, k.shape, v.shape) == ((0, HQ * D), (0, HKV * D), (0, HKV * D))


@pytest.mark.parametrize("backend", BACKENDS_HERE)
@pytest.mark.parametrize("numerics", ["fused", "unfused"])
def test_q_alone_is_normalised_and_rotated(gen, backend, numerics):
    check_q_only(backend, gen, numerics)


def test_q_alone_refuses_k_weights(gen):
    q = torch.randn(2, HQ * D).to(torch.bfloat16)
    w = torch.ones(D, dtype=torch.bfloat16)
    table = torch.ones(8, D)
    with pytest.raises(ValueError, match="k_weight must be None when k is None"):
        fqr.qk_rmsnorm_rope(q, None, torch.zeros(2, dtype=torch.long), table, w, w, head_dim=D)
