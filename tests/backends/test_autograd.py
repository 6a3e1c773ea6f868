"""One autograd policy for every backend (issue 14, finding 3): when an input requires grad
under grad mode, every backend returns outputs with a ``grad_fn`` whose backward is the
gradient of the op's math (the reference program differentiated), checked against directional
derivatives of the independent float64 formulation (central differences along random
directions); no backend silently drops the gradient. Under
``no_grad``/``inference_mode`` nothing is recorded."""

from __future__ import annotations

import pytest
import torch
from conftest import make_problem

import fqr
from fqr.backends import BACKENDS
from fqr.reference import prologue as exact_prologue

BACKEND_NAMES = ["reference", "interpret"]


def _require(backend):
    if not BACKENDS[backend].available:
        pytest.skip(BACKENDS[backend].unavailable_reason())


def _leaves(pb, names):
    """Fresh leaf copies of the problem's floating inputs; ``names`` require grad."""
    args = dict(zip(("qkv", "positions", "cos_sin_cache", "q_weight", "k_weight"), pb.args()))
    kwargs = pb.kwargs()
    for d in (args, kwargs):
        for k, v in d.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                d[k] = v.detach().clone().requires_grad_(k in names)
    return args, kwargs


def _float64_loss(pb, cotangents, name=None, direction=None, step=0.0) -> float:
    """``sum(out * cotangent)`` of the float64 formulation, with input ``name`` moved by
    ``step * direction``."""
    args, kwargs = _leaves(pb, ())
    for d in (args, kwargs):
        for k, v in d.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                d[k] = v.detach().to(torch.float64) + (step * direction if k == name else 0)
    outs = exact_prologue(*args.values(), **kwargs)
    return float(
        sum((o.to(torch.float64) * c.to(torch.float64)).sum() for o, c in zip(outs, cotangents))
    )


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("bias", [False, True])
def test_gradients_match_the_float64_formulation(gen, backend, bias):
    _require(backend)
    pb = make_problem(gen, tokens=5, head_dim=64, dtype=torch.float32, bias=bias, rotary_dim=32)
    names = ["qkv", "q_weight", "k_weight", "cos_sin_cache"] + (
        ["q_bias", "k_bias"] if bias else []
    )
    args, kwargs = _leaves(pb, names)
    outs = fqr.split_qkv_rmsnorm_rope(*args.values(), **kwargs, backend=backend)
    assert all(o.requires_grad and o.grad_fn is not None for o in outs)
    cotangents = [torch.randn(o.shape, generator=gen) for o in outs]
    sum((o * c).sum() for o, c in zip(outs, cotangents)).backward()
    # Directional derivatives: <grad, u> against a central difference of the float64
    # formulation along u (random directions, as gradcheck's fast mode).
    for name in names:
        got = (args | kwargs)[name].grad
        assert got is not None and got.dtype == torch.float32, name
        for _ in range(2):
            u = torch.randn(got.shape, generator=gen, dtype=torch.float64)
            h = 1e-6
            fd = (
                _float64_loss(pb, cotangents, name, u, h)
                - _float64_loss(pb, cotangents, name, u, -h)
            ) / (2 * h)
            ours = float((got.double() * u).sum())
            bound = 2e-5 * float((got.double() * u).abs().sum()) + 1e-7
            assert abs(ours - fd) <= bound, f"{name}: <grad, u> {ours} vs finite difference {fd}"


def test_every_backend_gives_the_same_gradient(gen):
    for name in BACKEND_NAMES:
        _require(name)
    pb = make_problem(gen, tokens=4, head_dim=64, weight_offset=1.0)
    grads = []
    for backend in BACKEND_NAMES:
        args, kwargs = _leaves(pb, ["qkv", "q_weight"])
        q, k, v = fqr.split_qkv_rmsnorm_rope(*args.values(), **kwargs, backend=backend)
        (q.float().square().sum() + k.float().sum() + v.float().sum()).backward()
        assert args["qkv"].grad.dtype == torch.bfloat16  # gradients in the input's dtype
        grads.append((args["qkv"].grad, args["q_weight"].grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_nothing_is_recorded_without_grad_mode(gen, backend):
    _require(backend)
    pb = make_problem(gen, tokens=3, head_dim=64)
    args, kwargs = _leaves(pb, ["qkv"])
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            outs = fqr.split_qkv_rmsnorm_rope(*args.values(), **kwargs, backend=backend)
        assert not any(o.requires_grad for o in outs)


def test_double_backward_is_a_clear_error(gen):
    pb = make_problem(gen, tokens=3, head_dim=64, dtype=torch.float32)
    args, kwargs = _leaves(pb, ["qkv"])
    q, _, _ = fqr.split_qkv_rmsnorm_rope(*args.values(), **kwargs, backend="reference")
    (g,) = torch.autograd.grad(q.square().sum(), args["qkv"], create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()


def test_backward_chunked_over_tokens_equals_one_piece(gen, monkeypatch):
    """The backward runs chunk by chunk (bounded memory): token-indexed gradients are placed,
    weight gradients summed over the chunks."""
    from fqr import backends

    pb = make_problem(gen, tokens=7, head_dim=64, dtype=torch.float32)
    names = ["qkv", "q_weight", "k_weight"]
    grads = []
    for chunk in (None, 2 * pb.qkv.shape[1]):  # one piece, then chunks of ~2 tokens
        if chunk:
            monkeypatch.setattr(backends, "REFERENCE_CHUNK_ELEMENTS", chunk)
        args, kwargs = _leaves(pb, names)
        outs = fqr.split_qkv_rmsnorm_rope(*args.values(), **kwargs, backend="reference")
        sum(o.square().sum() for o in outs).backward()
        grads.append([(args | kwargs)[n].grad for n in names])
    for name, whole, chunked in zip(names, *grads):
        torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6, msg=name)
