"""One autograd policy for the tensors a declared op writes in place (issue 41, RELIABILITY.md
section 2): a kernel's stores (the interpreter's, a GPU's) went through a pointer torch does
not see, so a backward that saved the cache ran on the overwritten values (the issue: grad
sum 48 where the truth is 0), while the reference backend's ``copy_`` advanced the version
counter and torch raised "modified by an inplace operation". Every run of a declared op now
advances the version counter of every tensor it wrote (donated caches, q rotated in place,
``out=`` buffers): the same error on every backend, the first call and the fast path alike,
and nothing asked of inference tensors (they have no counter)."""

from __future__ import annotations

import pytest
import torch
from support.mla_widths import insert_call, prologue_call

import fqr
from fqr.backends import BACKENDS
from fqr.rope_cache import rope_cos_sin_cache

BACKEND_NAMES = ["reference"] + (["interpret"] if BACKENDS["interpret"].available else [])
INPLACE = "modified by an inplace operation"


def _mla_insert(gen, backend):
    call = insert_call(gen, 96, 32, 16, "auto", tokens=3, backend=backend)
    return call.args["kv_cache"], lambda cache: fqr.mla_cache_insert(
        **dict(call.args, kv_cache=cache)
    )


def _mla_prologue(gen, backend):
    call = prologue_call(gen, 96, 32, 16, "auto", tokens=3, backend=backend)
    return call.args["kv_cache"], lambda cache: fqr.split_mla_rmsnorm_rope_cache(
        **dict(call.args, kv_cache=cache)
    )


def _kv_insert(gen, backend):
    key, value = (torch.randn(3, 2, 16, generator=gen).bfloat16() for _ in range(2))
    caches = [torch.randn(2, 4, 2, 16, generator=gen).bfloat16() for _ in range(2)]
    slots = torch.tensor([5, -1, 2])

    def run(cache):
        fqr.kv_cache_insert(key, value, cache, caches[1], slots, backend=backend)

    return caches[0], run


def _q_rope(gen, backend):
    table = rope_cos_sin_cache(32, 64, 1e4)
    q = torch.randn(3, 2 * (16 + 32), generator=gen).bfloat16()
    positions = torch.tensor([0, 7, 63])

    def run(q):
        fqr.mla_q_rope(q, positions, table, num_heads=2, qk_nope_head_dim=16, backend=backend)

    return q, run


OPS = {"mla_cache_insert": _mla_insert, "split_mla_rmsnorm_rope_cache": _mla_prologue,
       "kv_cache_insert": _kv_insert, "mla_q_rope": _q_rope}  # fmt: skip


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("op", OPS)
def test_a_backward_that_saved_the_written_tensor_raises_on_every_backend(gen, op, backend):
    """``loss = (cache * w).sum()`` saves the cache for w's gradient; the op then writes the
    cache in place: backward raises torch's in-place error on every backend, on the first
    call and on the kept call's fast path."""
    written, run = OPS[op](gen, backend)
    for _ in range(2):  # the second call takes the kept call's entry
        w = torch.ones_like(written, requires_grad=True)
        loss = (written * w).sum()
        version = written._version
        run(written)
        assert written._version > version
        with pytest.raises(RuntimeError, match=INPLACE):
            loss.backward()


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_an_out_buffer_written_by_the_kernel_advances_its_version(gen, backend):
    qkv = torch.randn(3, (4 + 2 * 2) * 64, generator=gen).bfloat16()
    table = rope_cos_sin_cache(64, 64, 1e6)
    weights = (torch.ones(64, dtype=torch.bfloat16),) * 2
    out = tuple(torch.empty(3, n * 64, dtype=torch.bfloat16) for n in (4, 2, 2))
    versions = [t._version for t in out]
    fqr.split_qkv_rmsnorm_rope(qkv, torch.tensor([1, 2, 3]), table, *weights, num_heads=4,
                               num_kv_heads=2, head_dim=64, out=out, backend=backend)  # fmt: skip
    assert all(t._version > v for t, v in zip(out, versions))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_inference_tensors_are_written_without_a_counter(gen, backend):
    """Under inference_mode (vLLM's) the caches are inference tensors: no counter, no error."""
    with torch.inference_mode():
        written, run = _mla_insert(gen, backend)
        before = written.clone()
        run(written)
        assert not torch.equal(written, before)
