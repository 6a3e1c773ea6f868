"""``out=(q, k, v)`` of :func:`fqr.split_qkv_rmsnorm_rope`: the outputs written into caller
buffers (as vLLM's kernels take theirs), checked against the independent float64 formulation
(:func:`fqr.reference.prologue`) on fresh random inputs and a real RoPE table, into NaN-poisoned
views of one wider buffer (strided rows) so an unwritten element or a write outside a view
shows; and every bad buffer refused by name before anything is written."""

from __future__ import annotations

import pytest
import torch
from support.peer_cases import HKV, HQ, PEER_CASES, D, peer_inputs

import fqr
from fqr import reference
from fqr.backends import BACKENDS
from fqr.numerics import compare

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
HV, DV = 1, 48  # v with its own head count and width: out[2] has its own width
CASE = next(c for c in PEER_CASES if c.name == "v-heads-and-dim")
WIDTHS = (HQ * D, HKV * D, HV * DV)
GAP = 3  # poisoned columns between and after the views


def _inputs(gen):
    _, qkv, positions, table, qw, kw = peer_inputs(CASE, gen)
    return qkv, positions, table, qw, kw


def _poisoned_views(tokens: int, dtype=torch.bfloat16):
    """A NaN buffer ``[T, q | gap | k | gap | v | gap]`` and the three views into it."""
    buffer = torch.full((tokens, sum(WIDTHS) + 3 * GAP), float("nan"), dtype=dtype)
    views, start = [], 0
    for width in WIDTHS:
        views.append(buffer[:, start : start + width])
        start += width + GAP
    return buffer, tuple(views)


def _call(qkv, positions, table, qw, kw, **kwargs):
    kwargs.setdefault("backend", "reference")
    return fqr.split_qkv_rmsnorm_rope(
        qkv,
        positions,
        table,
        qw,
        kw,
        num_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        num_v_heads=HV,
        v_head_dim=DV,
        **kwargs,
    )


@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_out_writes_the_caller_buffers(gen, backend):
    qkv, positions, table, qw, kw = _inputs(gen)
    buffer, views = _poisoned_views(qkv.shape[0])
    got = _call(qkv, positions, table, qw, kw, backend=backend, out=views)
    assert all(g is v for g, v in zip(got, views))
    exact = reference.prologue(
        qkv.clone(), positions, table, qw, kw, num_heads=HQ, num_kv_heads=HKV, head_dim=D,
        num_v_heads=HV, v_head_dim=DV,
    )  # fmt: skip
    for name, out, want in zip("qk", views, exact):
        c = compare(out, want, head_dim=D)
        assert c.passed and c.nonfinite == 0, (name, backend, c)
    assert torch.equal(views[2].view(torch.int16), exact[2].view(torch.int16))
    gaps = torch.ones(buffer.shape[1], dtype=torch.bool)
    start = 0
    for width in WIDTHS:
        gaps[start : start + width] = False
        start += width + GAP
    assert buffer[:, gaps].isnan().all(), "a column outside the views was written"


def test_out_with_no_tokens_returns_the_buffers(gen):
    qkv, positions, table, qw, kw = _inputs(gen)
    _, views = _poisoned_views(0)
    got = _call(qkv[:0], positions[:0], table, qw, kw, out=views)
    assert all(g is v for g, v in zip(got, views))


def _bad(views, tokens):
    """Each bad ``out`` and the message naming what is wrong."""
    q, k, v = views
    wide = torch.empty(tokens, WIDTHS[0] * 2, dtype=torch.bfloat16)
    return [
        ((q, k), r"out must be a tuple of 3 tensors \(q, k, v\), got tuple of 2"),
        ((q, k, "v"), r"out\[2\] \(v\) must be a torch.Tensor, got str"),
        ((q, k[:, :-1], v), rf"out\[1\] \(k\) must have shape \[{tokens}, {WIDTHS[1]}\]"),
        ((q.float(), k, v), r"out\[0\] \(q\) must be torch.bfloat16 \(qkv's dtype\)"),
        ((q, k, v.to("meta")), r"out\[2\] \(v\) is on meta, qkv on cpu"),
        ((wide[:, ::2], k, v), r"out\[0\] \(q\) must have unit stride in its last dim"),
        (
            (q, k, torch.empty(1, WIDTHS[2], dtype=torch.bfloat16).expand(tokens, -1)),
            r"out\[2\] \(v\) rows overlap",
        ),
        (
            (q, wide[:, 3 : 3 + WIDTHS[1]], wide[:, : WIDTHS[2]]),
            r"out\[2\] \(v\) overlaps out\[1\]",
        ),
    ]


def test_bad_out_is_refused_by_name_before_a_write(gen):
    qkv, positions, table, qw, kw = _inputs(gen)
    before = qkv.clone()
    buffer, views = _poisoned_views(qkv.shape[0])
    for out, message in _bad(views, qkv.shape[0]):
        with pytest.raises((ValueError, TypeError), match=message):
            _call(qkv, positions, table, qw, kw, out=out)
    assert buffer.isnan().all() and torch.equal(qkv.view(torch.int16), before.view(torch.int16))


def test_out_overlapping_qkv_or_with_inplace_or_grad_is_refused(gen):
    qkv, positions, table, qw, kw = _inputs(gen)
    _, views = _poisoned_views(qkv.shape[0])
    into_qkv = (qkv[:, : WIDTHS[0]], views[1], views[2])
    with pytest.raises(ValueError, match=r"out\[0\] \(q\) overlaps qkv in memory"):
        _call(qkv, positions, table, qw, kw, out=into_qkv)
    with pytest.raises(ValueError, match="out= and inplace=True both say where q and k go"):
        _call(qkv, positions, table, qw, kw, out=views, inplace=True)
    with pytest.raises(ValueError, match="out= cannot record gradients"):
        _call(qkv, positions, table, qw.requires_grad_(), kw, out=views)
    assert views[0].isnan().all()


def test_an_out_buffer_that_requires_grad_is_refused(gen):
    """Written without recording gradients, silently on interpret before (issue 23.8)."""
    qkv, positions, table, qw, kw = _inputs(gen)
    _, views = _poisoned_views(qkv.shape[0])
    leaf = torch.full_like(views[1], float("nan")).requires_grad_()
    with pytest.raises(ValueError, match=r"out\[1\] \(k\) requires grad"):
        _call(qkv, positions, table, qw, kw, out=(views[0], leaf, views[2]))
    assert views[0].isnan().all() and leaf.isnan().all()
