"""Bad input to ``fqr.split_qkv_rmsnorm_rope``: a ValueError/TypeError naming the argument, raised
before any kernel runs (issue 2, item 8); empty T returns empty outputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_problem

import fqr
from fqr.backends import BackendUnavailable


def _call(p, **override):
    args = dict(zip(("qkv", "positions", "cos_sin_cache", "q_weight", "k_weight"), p.args()))
    kwargs = p.kwargs()
    for name, value in override.items():
        (args if name in args else kwargs)[name] = value
    kwargs.setdefault("backend", "reference")
    return fqr.split_qkv_rmsnorm_rope(*args.values(), **kwargs)


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


# (test id, argument the message must name, override builder on a problem p)
BAD_INPUTS = [
    ("qkv-1d", "qkv", lambda p: dict(qkv=p.qkv[0])),
    ("qkv-3d", "qkv", lambda p: dict(qkv=p.qkv[None])),
    ("qkv-width", "qkv width", lambda p: dict(qkv=p.qkv[:, :-128])),
    ("qkv-int", "qkv", lambda p: dict(qkv=p.qkv.to(torch.int32))),
    ("qkv-float64", "qkv", lambda p: dict(qkv=p.qkv.double())),
    ("qkv-not-tensor", "qkv", lambda p: dict(qkv=p.qkv.tolist())),
    ("qkv-noncontiguous-last-dim", "qkv", lambda p: dict(qkv=p.qkv.t().contiguous().t())),
    ("heads-do-not-divide", "num_heads", lambda p: dict(num_heads=3, num_kv_heads=2)),
    ("num-heads-zero", "num_heads", lambda p: dict(num_heads=0)),
    ("num-kv-heads-float", "num_kv_heads", lambda p: dict(num_kv_heads=2.0)),
    ("head-dim-bool", "head_dim", lambda p: dict(head_dim=True)),
    ("eps-zero", "eps", lambda p: dict(eps=0.0)),
    ("is-neox-int", "is_neox", lambda p: dict(is_neox=1)),
    ("norm-kind", "norm", lambda p: dict(norm="layer")),
    ("numerics-mode", "numerics", lambda p: dict(numerics="fast")),
    ("backend-unknown", "backend", lambda p: dict(backend="cuda-graph")),
    ("positions-2d", "positions", lambda p: dict(positions=p.positions[None])),
    ("positions-length", "positions", lambda p: dict(positions=p.positions[:-1])),
    ("positions-float", "positions", lambda p: dict(positions=p.positions.float())),
    (
        "positions-negative",
        "positions",
        lambda p: dict(positions=torch.cat([p.positions[:-1], torch.tensor([-1])])),
    ),
    (
        "positions-past-table",
        "positions",
        lambda p: dict(positions=torch.full_like(p.positions, p.cos_sin_cache.shape[0])),
    ),
    ("cache-1d", "cos_sin_cache", lambda p: dict(cos_sin_cache=p.cos_sin_cache[:, 0])),
    ("cache-int", "cos_sin_cache", lambda p: dict(cos_sin_cache=p.cos_sin_cache.to(torch.int32))),
    (
        "rotary-dim-odd",
        "rotary_dim",
        lambda p: dict(cos_sin_cache=p.cos_sin_cache[:, :63].contiguous()),
    ),
    (
        "rotary-dim-too-large",
        "rotary_dim",
        lambda p: dict(cos_sin_cache=torch.cat([p.cos_sin_cache] * 2, 1)),
    ),
    ("q-weight-length", "q_weight", lambda p: dict(q_weight=p.q_weight[:-2])),
    ("k-weight-2d", "k_weight", lambda p: dict(k_weight=p.k_weight[None])),
    ("q-weight-int", "q_weight", lambda p: dict(q_weight=p.q_weight.to(torch.int64))),
    ("k-weight-missing", "k_weight", lambda p: dict(k_weight=None)),
    ("weight-with-norm-none", "q_weight", lambda p: dict(norm="none")),
    ("q-bias-alone", "q_bias", lambda p: dict(q_bias=p.q_weight.clone())),
    (
        "k-bias-length",
        "k_bias",
        lambda p: dict(q_bias=p.q_weight.clone(), k_bias=p.k_weight[:5].clone()),
    ),
    ("q-weight-other-device", "q_weight", lambda p: dict(q_weight=_meta(p.q_weight))),
    ("positions-other-device", "positions", lambda p: dict(positions=_meta(p.positions))),
    ("cache-other-device", "cos_sin_cache", lambda p: dict(cos_sin_cache=_meta(p.cos_sin_cache))),
    ("weight-offset-str", "weight_offset", lambda p: dict(weight_offset="1")),
]


@pytest.mark.parametrize("name,argument,override", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_names_the_argument(problem, name, argument, override):
    with pytest.raises((ValueError, TypeError)) as info:
        _call(problem, **override(problem))
    assert argument in str(info.value), f"{name}: message does not name {argument!r}: {info.value}"


@pytest.mark.parametrize(
    "name,argument,override", BAD_INPUTS[:6], ids=[b[0] for b in BAD_INPUTS[:6]]
)
def test_bad_input_is_reported_before_the_backend_is_touched(problem, name, argument, override):
    """An unavailable backend would raise BackendUnavailable: the argument check comes first."""
    kwargs = override(problem)
    kwargs.setdefault("backend", "ascend")
    with pytest.raises((ValueError, TypeError)) as info:
        _call(problem, **kwargs)
    assert not isinstance(info.value, BackendUnavailable)
    assert argument in str(info.value)


def test_full_norm_weight_must_span_the_projection(gen):
    p = make_problem(gen, norm="full")
    with pytest.raises(ValueError, match="q_weight"):
        _call(p, q_weight=p.q_weight[: p.spec.head_dim])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_empty_tokens_return_empty_outputs(gen, dtype):
    p = make_problem(gen, tokens=0, dtype=dtype)
    q, k, v = _call(p)
    hq, hkv, d = p.spec.num_heads, p.spec.num_kv_heads, p.spec.head_dim
    assert (q.shape, k.shape, v.shape) == ((0, hq * d), (0, hkv * d), (0, hkv * d))
    assert q.dtype == k.dtype == v.dtype == dtype


SHARED_BAD_STATICS = [
    ("head_dim", dict(head_dim=0)),
    ("eps", dict(eps=-1.0)),
    ("is_neox", dict(is_neox=1)),
    ("weight_offset", dict(weight_offset="1")),
]


@pytest.mark.parametrize("argument,bad", SHARED_BAD_STATICS, ids=[b[0] for b in SHARED_BAD_STATICS])
def test_both_ops_and_the_spec_name_a_bad_parameter_alike(problem, argument, bad):
    """One set of checks: the split op, the no-split op and PrologueSpec say the same thing."""
    messages = []
    for call in (
        lambda: _call(problem, **bad),
        lambda: fqr.qk_rmsnorm_rope(
            problem.qkv[:, :512].contiguous(),
            problem.qkv[:, 512:768].contiguous(),
            problem.positions,
            problem.cos_sin_cache,
            problem.q_weight,
            problem.k_weight,
            **{**dict(head_dim=128), **bad},
            backend="reference",
        ),
        lambda: dataclasses.replace(problem.spec, **bad),
    ):
        with pytest.raises((ValueError, TypeError)) as info:
            call()
        messages.append(str(info.value))
    assert messages[0].startswith(argument) and len(set(messages)) == 1, messages
