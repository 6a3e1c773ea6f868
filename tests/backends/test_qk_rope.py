"""``fqr.qk_rope`` / ``fqr.qk_mrope`` (issue 26.7a): RoPE and mRoPE of separate q and k without
a norm. Against the float64 references on fresh inputs and real tables, on every CPU backend;
``numerics="unfused"`` against vLLM's own ``forward_native`` bit for bit; q alone; text
positions as plain RoPE; bad arguments named before anything runs."""

from __future__ import annotations

import pytest
import torch
from conftest import real_table

import fqr
from fqr import reference
from fqr.numerics import compare
from fqr.unfused import vllm_mrotary_embedding, vllm_rotary_embedding

BACKENDS = ["reference", "interpret"]
HQ, HKV, D, R, ROWS = 4, 2, 64, 48, 700  # partial rotary: features past R pass through


def _qk(gen, tokens=5, dtype=torch.bfloat16):
    q = (torch.randn(tokens, HQ * D, generator=gen) * 2).to(dtype)
    k = (torch.randn(tokens, HKV * D, generator=gen) * 3).to(dtype)
    return q, k


def _planes(gen, tokens):
    positions = torch.randint(0, ROWS, (3, tokens), generator=gen)
    positions[1:, ::3] = positions[0, ::3]  # text tokens
    return positions


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_neox", [True, False])
def test_qk_rope_matches_float64_and_vllm_unfused(gen, backend, is_neox):
    table = real_table(R, ROWS, 1e4)
    q, k = _qk(gen)
    positions = torch.randint(0, ROWS, (5,), generator=gen)
    kw = dict(head_dim=D, is_neox=is_neox, backend=backend)
    outs = fqr.qk_rope(q, k, positions, table, **kw)
    exact = reference.qk_rope(q, k, positions, table, head_dim=D, is_neox=is_neox)
    for out, ref in zip(outs, exact):
        assert compare(out, ref, head_dim=D).passed
        assert torch.equal(out.view(5, -1, D)[..., R:], ref.view(5, -1, D)[..., R:].to(out.dtype))
    unfused = fqr.qk_rope(q, k, positions, table, numerics="unfused", **kw)
    vllm = vllm_rotary_embedding(positions, q, k, D, table.to(q.dtype), is_neox)
    for out, want in zip(unfused, vllm):
        assert torch.equal(out, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "section, interleaved", [((16, 24, 24), True), ((4, 4, 16), False), ((8, 8, 8), True)]
)
def test_qk_mrope_matches_float64_and_vllm_unfused(gen, backend, section, interleaved):
    """(16, 24, 24) interleaved over R/2 = 24 frequencies: h and w run out of frequencies
    (vLLM reads it; 8/8/8 are taken), as do the sums of (8, 8, 8)."""
    table = real_table(R, ROWS, 1e4)
    q, k = _qk(gen, tokens=7)
    positions = _planes(gen, 7)
    kw = dict(head_dim=D, mrope_section=section, mrope_interleaved=interleaved)
    outs = fqr.qk_mrope(q, k, positions, table, backend=backend, **kw)
    exact = reference.qk_mrope(q, k, positions, table, **kw)
    for out, ref in zip(outs, exact):
        assert compare(out, ref, head_dim=D).passed
    unfused = fqr.qk_mrope(q, k, positions, table, backend=backend, numerics="unfused", **kw)
    vllm = vllm_mrotary_embedding(positions, q, k, D, table.to(q.dtype), True, section, interleaved)
    for out, want in zip(unfused, vllm):
        assert torch.equal(out, want)


def test_q_alone_and_text_positions_are_plain_rope(gen):
    table = real_table(R, ROWS, 1e4)
    q, k = _qk(gen)
    pos = torch.randint(0, ROWS, (5,), generator=gen)
    plain_q, plain_k = fqr.qk_rope(q, k, pos, table, head_dim=D, backend="reference")
    q_alone, none = fqr.qk_rope(q, None, pos, table, head_dim=D, backend="reference")
    assert none is None and torch.equal(q_alone, plain_q)
    for section, interleaved in (((24, 20, 20), True), ((8, 8, 8), False)):
        for positions in (pos, pos.expand(3, -1).contiguous()):
            mq, mk = fqr.qk_mrope(
                q,
                k,
                positions,
                table,
                head_dim=D,
                mrope_section=section,
                mrope_interleaved=interleaved,
                backend="reference",
            )
            assert torch.equal(mq, plain_q) and torch.equal(mk, plain_k)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(q=lambda a: a["q"][:, :-1]), ValueError, "q width 255 is not a multiple of head_dim"),
        (dict(k=lambda a: a["k"].float()), TypeError, "k must have q's dtype"),
        (dict(k=lambda a: a["k"][:3]), ValueError, "k has 3 tokens but q has 5"),
        (dict(positions=lambda a: a["positions"][:2]), ValueError, "positions must be \\[3, T\\]"),
        (dict(positions=lambda a: a["positions"] + ROWS), ValueError, "positions out of range"),
        (dict(cos_sin_cache=lambda a: a["cos_sin_cache"][:, :-1]), ValueError, "cos_sin_cache"),
        (dict(mrope_section=(8, 8, 9)), ValueError, "must sum to rotary_dim/2 = 24 \\(contiguous"),
        (dict(mrope_section=(8, -1, 17)), ValueError, "three non-negative ints"),
        (dict(mrope_section=(8, 16)), ValueError, "mrope_section must be three ints"),
        (dict(mrope_interleaved=1), TypeError, "mrope_interleaved must be a bool"),
        (dict(is_neox="yes"), TypeError, "is_neox must be a bool"),
        (dict(numerics="unfused-hf"), ValueError, "numerics"),
    ],
)
def test_bad_arguments_are_named_before_anything_runs(gen, change, error, message):
    q, k = _qk(gen)
    args = dict(q=q, k=k, positions=_planes(gen, 5), cos_sin_cache=real_table(R, ROWS, 1e4))
    kwargs = dict(head_dim=D, mrope_section=(8, 8, 8), mrope_interleaved=False)
    for name, value in change.items():
        if callable(value):
            args[name] = value(args)
        else:
            kwargs[name] = value
    with pytest.raises(error, match=message):
        fqr.qk_mrope(**args, **kwargs, backend="interpret")
