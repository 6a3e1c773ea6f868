"""The per-call fast path of the public ops (issue 12): a call whose argument metadata passed the
checks once skips them, yet every bad input is still refused, with the slow path's message,
before any kernel runs; and new token counts never re-check, re-trace or recompile."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import make_problem
from test_validation import BAD_INPUTS, _call

import fqr
from fqr.numerics import compare
from fqr.prologue import checked, checked_calls, declare, forget_checked_calls
from fqr.prologue.split_qkv import SPLIT_QKV_RMSNORM_ROPE
from fqr.reference import prologue as reference_prologue


def _refusal(call):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    return type(info.value), str(info.value)


@pytest.mark.parametrize("name,argument,override", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_warm_fast_path_refuses_what_the_slow_path_refuses(gen, name, argument, override):
    """Same problem shape as the bad call, checked and kept first: the bad call must still
    raise, with the same type and message as on a cold cache (where the full checks run)."""
    p = make_problem(gen, tokens=7)
    forget_checked_calls()
    cold = _refusal(lambda: _call(p, **override(p)))
    _call(p)  # the valid call: its metadata is kept
    assert checked_calls(SPLIT_QKV_RMSNORM_ROPE), "the valid call was not kept"
    warm = _refusal(lambda: _call(p, **override(p)))
    assert warm == cold, name


@pytest.mark.parametrize("tokens", [0, 1, 2, 9])
def test_bad_input_refused_at_every_token_count(gen, tokens):
    """T = 0 / 1 / more are separate keys (checks read them): each still refuses bad input."""
    p = make_problem(gen, tokens=tokens)
    forget_checked_calls()
    _call(p)
    bad_width = p.qkv.new_empty(tokens, p.qkv.shape[1] - 128)
    assert "qkv width" in _refusal(lambda: _call(p, qkv=bad_width))[1]
    assert "num_heads" in _refusal(lambda: _call(p, num_heads=True))[1]
    assert "eps" in _refusal(lambda: _call(p, eps=float("nan")))[1]


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_strided_positions_after_a_contiguous_call_are_read_through_their_stride(gen, backend):
    """Refused once (the kernel read ``ptr + t``); issue 26.6: a strided call is a new kept
    call (the guard holds strides) whose kernel reads the positions through their stride, bit
    for bit what the contiguous call gave."""
    p = make_problem(gen, tokens=6)
    forget_checked_calls()
    want = _call(p, backend=backend)
    strided = torch.stack([p.positions, -p.positions], 1)[:, 0]
    for _ in range(2):  # the full checks, then the fast path
        got = _call(p, positions=strided, backend=backend)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert len(checked_calls(SPLIT_QKV_RMSNORM_ROPE)) == 2


def test_qk_op_warm_refusals_match_cold(gen):
    p = make_problem(gen, tokens=5, num_heads=4, num_kv_heads=2, head_dim=128)
    q, k = p.qkv[:, :512].contiguous(), p.qkv[:, 512:768].contiguous()
    good = dict(head_dim=128, backend="reference")
    bad_calls = {
        "k-dtype": lambda: fqr.qk_rmsnorm_rope(
            q, k.float(), p.positions, p.cos_sin_cache, p.q_weight, p.k_weight, **good
        ),
        "k-tokens": lambda: fqr.qk_rmsnorm_rope(
            q, k[:4], p.positions, p.cos_sin_cache, p.q_weight, p.k_weight, **good
        ),
        "positions-range": lambda: fqr.qk_rmsnorm_rope(
            q, k, p.positions + 10**6, p.cos_sin_cache, p.q_weight, p.k_weight, **good
        ),
        "weight": lambda: fqr.qk_rmsnorm_rope(
            q, k, p.positions, p.cos_sin_cache, p.q_weight[:64], p.k_weight, **good
        ),
        "numerics": lambda: fqr.qk_rmsnorm_rope(
            q, k, p.positions, p.cos_sin_cache, p.q_weight, p.k_weight, numerics="x", **good
        ),
    }
    forget_checked_calls()
    cold = {name: _refusal(call) for name, call in bad_calls.items()}
    fqr.qk_rmsnorm_rope(q, k, p.positions, p.cos_sin_cache, p.q_weight, p.k_weight, **good)
    warm = {name: _refusal(call) for name, call in bad_calls.items()}
    assert warm == cold


def test_new_token_counts_skip_checks_and_tracing(gen, monkeypatch):
    """Once T > 1 has been checked, other T > 1 cost no check and no trace; results stay
    right (against float64) on each fresh input."""
    calls = {"check": 0, "trace": 0}
    decl = SPLIT_QKV_RMSNORM_ROPE
    check, trace = decl.validate, decl.program

    def counting_check(*a, **k):
        calls["check"] += 1
        return check(*a, **k)

    def counting_trace(*a, **k):
        calls["trace"] += 1
        return trace(*a, **k)

    monkeypatch.setattr(decl, "validate", counting_check)
    monkeypatch.setattr(decl, "program", counting_trace)
    forget_checked_calls()
    for tokens in (3, 17, 64, 5):
        p = make_problem(gen, tokens=tokens)
        q, k, v = _call(p)
        exact = reference_prologue(*p.args(), **p.kwargs())
        for i, (out, want) in enumerate(zip((q, k, v), exact)):
            assert compare(out, want, head_dim=128, bitwise=i == 2).passed, (tokens, i)
    assert calls == {"check": 1, "trace": 1}


def test_full_norm_stats_calls_are_keyed_with_their_counts(gen):
    """norm_stats' counts are part of the key: a count below the local width is refused even
    after a valid call with the same tensors."""
    p = make_problem(gen, tokens=4, norm="full")
    t = p.qkv.shape[0]
    sums = torch.rand(t, generator=gen) * 100 + 1
    good = fqr.NormStats(sums, sums.clone(), 4 * 128 * 2, 2 * 128 * 2)
    forget_checked_calls()
    _call(p, norm_stats=good)
    small = fqr.NormStats(sums, sums.clone(), 4, 2 * 128 * 2)
    assert "count" in _refusal(lambda: _call(p, norm_stats=small))[1]
    assert "norm_stats" in _refusal(lambda: _call(p, norm_stats=(sums, sums)))[1]


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_the_fast_path_never_compares_tensors_by_value(gen, monkeypatch, backend):
    """A repeat call reads only metadata and pointers: no ``Tensor.__eq__`` (binding once
    tested ``MISSING in values``, an elementwise comparison of every tensor argument, which on
    CUDA cost a kernel launch per argument and ~100 us per call)."""
    p = make_problem(gen, tokens=7)
    forget_checked_calls()
    _call(p, backend=backend)

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was compared by value")

    monkeypatch.setattr(torch.Tensor, "__eq__", refuse)
    _call(p, backend=backend)


def test_one_tensor_as_both_weights_takes_the_fast_path(gen):
    """Tied (or unit) norm weights: the same tensor as ``q_weight`` and ``k_weight``. The first
    call checks and keeps; every repeat takes the fast path (no checks again, no new kept
    call), and a later call with two distinct weights is its own kept call."""
    p = make_problem(gen, tokens=4)
    tied = p.q_weight.clone()
    validations = []
    validate = SPLIT_QKV_RMSNORM_ROPE.validate

    def counting(call, **kwargs):
        validations.append(call)
        return validate(call, **kwargs)

    forget_checked_calls()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SPLIT_QKV_RMSNORM_ROPE, "validate", counting)
        want = _call(p, q_weight=tied, k_weight=tied)
        for _ in range(3):
            got = _call(p, q_weight=tied, k_weight=tied)
            assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert len(validations) == 1 and len(checked_calls(SPLIT_QKV_RMSNORM_ROPE)) == 1
        _call(p, q_weight=tied, k_weight=tied.clone())  # two tensors: another kept call
        _call(p, q_weight=tied, k_weight=tied.clone())
        assert len(validations) == 2 and len(checked_calls(SPLIT_QKV_RMSNORM_ROPE)) == 2
        _call(p, q_weight=tied, k_weight=tied)  # the tied call still matches its own
        assert len(validations) == 2
        op = torch.ops.fqr.split_qkv_rmsnorm_rope.default
        qkv, positions, table = p.args()[:3]
        for _ in range(3):  # the torch op (backend "auto": another key), tied
            op(qkv, positions, table, tied, tied, **p.kwargs())
        assert len(validations) == 3
    forget_checked_calls()


def test_the_kept_call_budget_counts_entries_held(gen, monkeypatch):
    """Replacing a key's oldest kept call (``MAX_PER_KEY`` held) spends no budget: the budget
    is the number of kept calls held across every op; once it is spent a full key still takes
    its newest call, a new key keeps none; forgetting them resets it."""
    monkeypatch.setattr(checked, "MAX_PER_KEY", 2)
    monkeypatch.setattr(checked, "MAX_CHECKED_CALLS", 2)
    forget_checked_calls()
    p = make_problem(gen, tokens=4)

    def strided(stride):  # one key, a new guard for each stride of the positions
        wide = torch.zeros(p.positions.shape[0], stride, dtype=p.positions.dtype)
        wide[:, 0] = p.positions
        return wide[:, 0]

    for stride in range(1, 7):
        _call(p, positions=strided(stride))
    assert declare._KEPT[0] == 2
    validations = []
    validate = SPLIT_QKV_RMSNORM_ROPE.validate
    monkeypatch.setattr(
        SPLIT_QKV_RMSNORM_ROPE, "validate", lambda *a, **k: validations.append(validate(*a, **k))
    )
    _call(p, positions=strided(6))  # kept last, over a spent budget: the fast path
    _call(p, positions=strided(5))
    assert not validations
    _call(p, eps=1e-5)  # a new key: checked and run, not kept
    assert len(checked_calls(SPLIT_QKV_RMSNORM_ROPE)) == 2 and declare._KEPT[0] == 2
    forget_checked_calls()
    assert declare._KEPT[0] == 0 and not checked_calls(SPLIT_QKV_RMSNORM_ROPE)


def test_the_generated_public_function_binds_as_its_signature_says(gen):
    """The public function is generated with the op's parameters: a bad call is Python's own
    ``TypeError`` naming the argument; positional and keyword arguments, defaults included,
    reach the op alike (the same kept call)."""
    p = make_problem(gen, tokens=3)
    op = fqr.split_qkv_rmsnorm_rope
    assert str(inspect.signature(op)) == str(SPLIT_QKV_RMSNORM_ROPE.signature())
    for bad, named in (
        (lambda: _call(p, bogus=1), "bogus"),
        (lambda: op(p.qkv, p.positions, **p.kwargs()), "q_weight"),
        (lambda: op(*p.args(), p.qkv, **p.kwargs()), "positional"),
        (lambda: op(*p.args()), "num_heads"),
        (lambda: op(*p.args(), qkv=p.qkv, **p.kwargs()), "multiple values for argument .qkv"),
    ):
        with pytest.raises(TypeError, match=named):
            bad()
    forget_checked_calls()
    by_keyword = dict(zip(("qkv", "positions", "cos_sin_cache", "q_weight", "k_weight"), p.args()))
    want = op(**by_keyword, **p.kwargs(), backend="reference")
    got = _call(p)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert len(checked_calls(SPLIT_QKV_RMSNORM_ROPE)) == 1
