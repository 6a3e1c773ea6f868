"""The unfused peers of ``fqr bench`` compute the prologue: checked on CPU against the float64
formulation (``fqr.reference.prologue``) under the ``unfused`` contract, on fresh random
inputs and the models' real RoPE tables."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from fqr import reference
from fqr.inputs import random_inputs
from fqr.numerics import compare
from fqr.peers import PEER_NAMES, build_peer, peer_unavailable_reason
from fqr.presets import get_preset

MAX_POSITION = 4096  # rows of the real table the tests index (the table is the model's own)


def _check(preset, peer_fn, dtype, tokens, seed):
    cache = preset.cos_sin_cache(max_position=MAX_POSITION)
    x = random_inputs(preset.spec, tokens, dtype, torch.Generator().manual_seed(seed), cache)
    q, k, v = peer_fn(x.qkv, x.positions, x.q_weight, x.k_weight)
    eq, ek, ev = reference.prologue(*x.args(), **x.kwargs())
    d = preset.head_dim
    return (
        compare(q, eq, head_dim=d, numerics="unfused"),
        compare(k, ek, head_dim=d, numerics="unfused"),
        compare(v, ev, head_dim=d, bitwise=True),
        (q, k, v),
        x.qkv,
    )


# Per-head norm (Qwen3), Gemma (1 + w), head_dim 256 (Gemma 3 1B), full-width norm (OLMo2),
# no norm with llama3 scaling (Llama 3.1), GPT-J pairs with partial rotary (GLM-4). (Qwen3.5
# is a gated mRoPE variant: its eager chain is the variant's, tests/core/test_mrope.py.)
PRESETS = ["qwen3-8b", "gemma3-27b", "gemma3-1b", "olmo2-7b", "llama3-8b", "glm4-9b"]


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_eager_peer_matches_float64(name, dtype):
    preset = get_preset(name)
    spec = preset.spec
    fn = build_peer("eager", spec, preset.cos_sin_cache(max_position=MAX_POSITION), dtype)
    cq, ck, cv, (q, k, v), qkv = _check(preset, fn, dtype, tokens=23, seed=11 + PRESETS.index(name))
    assert cq.passed, cq
    assert ck.passed, ck
    assert cv.passed, cv
    assert q.dtype == k.dtype == v.dtype == dtype
    # vLLM hands attention the strided v view of qkv, it does not copy it.
    assert (
        v.data_ptr()
        == qkv.data_ptr() + (preset.spec.q_size + preset.spec.kv_size) * qkv.element_size()
    )


def test_a_wrong_peer_fails_the_check():
    """The check above can fail: GPT-J pairs on a NeoX model are caught."""
    preset = get_preset("qwen3-8b")
    wrong = dataclasses.replace(preset.spec, is_neox=False)
    fn = build_peer("eager", wrong, preset.cos_sin_cache(max_position=MAX_POSITION), torch.bfloat16)
    cq, ck, cv, _, _ = _check(preset, fn, torch.bfloat16, tokens=9, seed=5)
    assert not cq.passed and not ck.passed and cq.bad > 0
    assert cv.passed  # v is untouched by RoPE


def test_compile_peer_matches_float64():
    """``torch.compile`` of the eager peer (Inductor on CPU here), token dim dynamic: ~20 s."""
    preset = get_preset("qwen3-0.6b")
    spec = preset.spec
    fn = build_peer(
        "compile", spec, preset.cos_sin_cache(max_position=MAX_POSITION), torch.bfloat16
    )
    for tokens, seed in ((17, 1), (40, 2)):  # the second size reuses the dynamic-T graph
        cq, ck, cv, _, _ = _check(preset, fn, torch.bfloat16, tokens, seed)
        assert cq.passed and ck.passed and cv.passed, (cq, ck, cv)


def test_peer_names_are_checked():
    spec = get_preset("qwen3-8b").spec
    with pytest.raises(ValueError, match="peer must be one of"):
        peer_unavailable_reason("flashinfer", spec)
    assert set(PEER_NAMES) == {"eager", "compile", "liger"}
    assert peer_unavailable_reason("eager", spec) is None


@pytest.mark.skipif(
    importlib.util.find_spec("liger_kernel") is not None, reason="liger_kernel is installed here"
)
def test_liger_without_liger_kernel_says_so():
    spec = get_preset("qwen3-8b").spec
    assert "not installed" in peer_unavailable_reason("liger", spec)
    with pytest.raises(ValueError, match="liger"):
        build_peer("liger", spec, torch.zeros(4, 128), torch.bfloat16)


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger_kernel")
def test_liger_refuses_partial_rotary():
    spec = get_preset("glm4-9b").spec
    assert "partial rotary" in peer_unavailable_reason("liger", spec)


@pytest.mark.gpu
@pytest.mark.skipif(
    importlib.util.find_spec("liger_kernel") is None or not torch.cuda.is_available(),
    reason="needs liger_kernel and a CUDA GPU",
)
@pytest.mark.parametrize("name", ["qwen3-8b", "gemma3-27b", "olmo2-7b", "llama3-8b"])
def test_liger_peer_matches_float64(name):
    preset = get_preset(name)
    spec = preset.spec
    cache = preset.cos_sin_cache(max_position=MAX_POSITION)
    fn = build_peer("liger", spec, cache.cuda(), torch.bfloat16)

    def on_gpu(qkv, positions, qw, kw):
        out = fn(
            qkv.cuda(),
            positions.cuda(),
            None if qw is None else qw.cuda(),
            None if kw is None else kw.cuda(),
        )
        return tuple(o.cpu() for o in out)

    cq, ck, cv, _, _ = _check(preset, on_gpu, torch.bfloat16, tokens=33, seed=3)
    assert cq.passed and ck.passed and cv.passed, (cq, ck, cv)
