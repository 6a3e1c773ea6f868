"""The unfused peers of ``fqr bench`` compute the prologue: checked on CPU against the float64
formulation (``fqr.reference.prologue``) under the ``unfused`` contract, on fresh random
inputs and the models' real RoPE tables."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from fqr import reference
from fqr.numerics import compare
from fqr.peers import PEER_NAMES, PrologueShape, build_peer, peer_unavailable_reason
from fqr.presets import get_preset

MAX_POSITION = 4096  # rows of the real table the tests index (the table is the model's own)


def _inputs(preset, dtype, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, preset.qkv_width, generator=g).to(dtype)
    positions = torch.randint(0, MAX_POSITION, (tokens,), generator=g)
    if preset.norm == "none":
        return qkv, positions, None, None
    q_len = preset.head_dim if preset.norm == "head" else preset.q_size
    k_len = preset.head_dim if preset.norm == "head" else preset.kv_size
    centre = 0.0 if preset.weight_offset else 1.0
    qw = (centre + 0.2 * torch.randn(q_len, generator=g)).to(dtype)
    kw = (centre + 0.2 * torch.randn(k_len, generator=g)).to(dtype)
    return qkv, positions, qw, kw


def _check(preset, shape, peer_fn, dtype, tokens, seed):
    cache = preset.cos_sin_cache(max_position=MAX_POSITION)
    qkv, positions, qw, kw = _inputs(preset, dtype, tokens, seed)
    q, k, v = peer_fn(qkv, positions, qw, kw)
    eq, ek, ev = reference.prologue(
        qkv,
        positions,
        cache,
        qw,
        kw,
        num_heads=preset.num_heads,
        num_kv_heads=preset.num_kv_heads,
        head_dim=preset.head_dim,
        eps=preset.eps,
        is_neox=preset.is_neox,
        weight_offset=preset.weight_offset,
        norm=preset.norm,
    )
    d = preset.head_dim
    return (
        compare(q, eq, head_dim=d, numerics="unfused"),
        compare(k, ek, head_dim=d, numerics="unfused"),
        compare(v, ev, head_dim=d, bitwise=True),
        (q, k, v),
        qkv,
    )


# Per-head norm (Qwen3), Gemma (1 + w), partial rotary (Qwen3.5), full-width norm (OLMo2),
# no norm with llama3 scaling (Llama 3.1), GPT-J pairs with partial rotary (GLM-4).
PRESETS = ["qwen3-8b", "gemma3-27b", "qwen3.5-27b", "olmo2-7b", "llama3-8b", "glm4-9b"]


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_eager_peer_matches_float64(name, dtype):
    preset = get_preset(name)
    shape = PrologueShape.of_preset(preset)
    fn = build_peer("eager", shape, preset.cos_sin_cache(max_position=MAX_POSITION), dtype)
    cq, ck, cv, (q, k, v), qkv = _check(
        preset, shape, fn, dtype, tokens=23, seed=11 + PRESETS.index(name)
    )
    assert cq.passed, cq
    assert ck.passed, ck
    assert cv.passed, cv
    assert q.dtype == k.dtype == v.dtype == dtype
    # vLLM hands attention the strided v view of qkv, it does not copy it.
    assert v.data_ptr() == qkv.data_ptr() + (preset.q_size + preset.kv_size) * qkv.element_size()


def test_a_wrong_peer_fails_the_check():
    """The check above can fail: GPT-J pairs on a NeoX model are caught."""
    preset = get_preset("qwen3-8b")
    wrong = dataclasses.replace(PrologueShape.of_preset(preset), is_neox=False)
    fn = build_peer("eager", wrong, preset.cos_sin_cache(max_position=MAX_POSITION), torch.bfloat16)
    cq, ck, cv, _, _ = _check(preset, wrong, fn, torch.bfloat16, tokens=9, seed=5)
    assert not cq.passed and not ck.passed and cq.bad > 0
    assert cv.passed  # v is untouched by RoPE


def test_compile_peer_matches_float64():
    """``torch.compile`` of the eager peer (Inductor on CPU here), token dim dynamic: ~20 s."""
    preset = get_preset("qwen3-0.6b")
    shape = PrologueShape.of_preset(preset)
    fn = build_peer(
        "compile", shape, preset.cos_sin_cache(max_position=MAX_POSITION), torch.bfloat16
    )
    for tokens, seed in ((17, 1), (40, 2)):  # the second size reuses the dynamic-T graph
        cq, ck, cv, _, _ = _check(preset, shape, fn, torch.bfloat16, tokens, seed)
        assert cq.passed and ck.passed and cv.passed, (cq, ck, cv)


def test_peer_names_are_checked():
    shape = PrologueShape.of_preset(get_preset("qwen3-8b"))
    with pytest.raises(ValueError, match="peer must be one of"):
        peer_unavailable_reason("flashinfer", shape)
    assert set(PEER_NAMES) == {"eager", "compile", "liger"}
    assert peer_unavailable_reason("eager", shape) is None


@pytest.mark.skipif(
    importlib.util.find_spec("liger_kernel") is not None, reason="liger_kernel is installed here"
)
def test_liger_without_liger_kernel_says_so():
    shape = PrologueShape.of_preset(get_preset("qwen3-8b"))
    assert "not installed" in peer_unavailable_reason("liger", shape)
    with pytest.raises(ValueError, match="liger"):
        build_peer("liger", shape, torch.zeros(4, 128), torch.bfloat16)


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger_kernel")
def test_liger_refuses_partial_rotary():
    shape = PrologueShape.of_preset(get_preset("qwen3.5-27b"))
    assert "partial rotary" in peer_unavailable_reason("liger", shape)


@pytest.mark.gpu
@pytest.mark.skipif(
    importlib.util.find_spec("liger_kernel") is None or not torch.cuda.is_available(),
    reason="needs liger_kernel and a CUDA GPU",
)
@pytest.mark.parametrize("name", ["qwen3-8b", "gemma3-27b", "olmo2-7b", "llama3-8b"])
def test_liger_peer_matches_float64(name):
    preset = get_preset(name)
    shape = PrologueShape.of_preset(preset)
    cache = preset.cos_sin_cache(max_position=MAX_POSITION)
    fn = build_peer("liger", shape, cache.cuda(), torch.bfloat16)

    def on_gpu(qkv, positions, qw, kw):
        out = fn(
            qkv.cuda(),
            positions.cuda(),
            None if qw is None else qw.cuda(),
            None if kw is None else kw.cuda(),
        )
        return tuple(o.cpu() for o in out)

    cq, ck, cv, _, _ = _check(preset, shape, on_gpu, torch.bfloat16, tokens=33, seed=3)
    assert cq.passed and ck.passed and cv.passed, (cq, ck, cv)
