"""Issue 41 items 2 and 3 on the compiled CUDA kernel (skipped without a GPU; on ``meta`` in the
bundle build): MiniMax-M3's FP8 E5M2 outputs (``quantize_dtype=torch.float8_e5m2`` of
``split_qkv_index_rmsnorm_rope``; index_q and the index cache of a float8_e5m2 index cache) at
the model's preset shapes, each against the float64 reference computed on the device (within
one E5M2 ULP, exactly +-57344 past the range, values past E4M3's 448 kept), new outputs in
NaN-poisoned memory; and the scales vLLM passes with a model-dtype cache (``kv_cache_insert``
with 'auto', the fused KV / index-cache ops with bf16 caches): the same bytes as without them.
One token count (257: several token tiles, a ragged last one), few shapes: each distinct kernel
is a compile. The CPU backends run the same forms in ``tests/backends/test_minimax_e5m2.py``
and ``test_vllm_cache_scales.py``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from support.devices import GPU_DEVICE, has_values, launch_copies, rope_table
from support.peer_ports import ON_TRITON

import fqr
from fqr.bench.checks import poison_free_memory
from fqr.numerics import compare
from fqr.prologue import variant_of

pytestmark = ON_TRITON

TOKENS = 257
MAX_POSITION = 1 << 17
E5M2 = torch.float8_e5m2
GIB = 1 << 30


def _poison() -> None:
    poison_free_memory(256 << 20, torch.device(GPU_DEVICE))  # unwritten outputs show NaN


def _check_e5m2(out, exact, head_dim: int, name: str) -> None:
    """``out`` (float8_e5m2) against float64 ``exact``: the contract, the clamp at +-57344,
    values past E4M3's range kept (on the device; nothing on ``meta``)."""
    assert out.dtype == E5M2 and out.shape == exact.shape, name
    if not has_values(out, exact):
        return
    c = compare(out, exact, head_dim=head_dim)
    assert c.passed and c.nonfinite == 0, f"{name}: {c}"
    got = out.double()
    past = exact.abs() >= 57344
    assert torch.equal(got[past], exact[past].sign() * 57344), name
    kept = (exact.abs() > 480) & ~past
    assert bool((got[kept].abs() > 448).all()), name


def _index_heads_preset(tp: int):
    return fqr.get_preset("minimax-m3-fp8", tp)  # attn_fp8 and index_fp8


@pytest.mark.gpu_memory(GIB)
@pytest.mark.parametrize("tp", [8, 4])
def test_index_heads_e5m2_outputs(gen, tp):
    """MiniMax-M3's indexer prologue with every output in E5M2 (v with outliers past 448)."""
    preset = _index_heads_preset(tp)
    variant = variant_of(preset)
    decl = variant.declaration
    table = rope_table(preset, MAX_POSITION)
    inputs = variant.draw(preset, TOKENS, torch.bfloat16, gen, max_position=table.shape[0])
    args = variant.arguments(preset, inputs, table, quantize_dtype=E5M2)
    exact = decl.reference(**decl.reference_kwargs(args)) if has_values(table) else None
    for _ in range(2):  # the second call takes the kept call's bound launcher
        _poison()
        outs = variant.run(preset, inputs, table, backend="triton", quantize_dtype=E5M2)
        assert len(outs) == 5
        for name, out in zip(variant.outputs_of(preset), outs):
            assert out.dtype == E5M2, name
            if exact is not None:
                e = exact[variant.outputs_of(preset).index(name)]
                _check_e5m2(out, e, variant.head_dim(preset, name), name)
    if exact is not None:  # v's outliers reach past 448: E5M2 keeps what E4M3 clamped
        assert bool((exact[2].abs() > 480).any())


def _index_cache_preset(cache_dtype: str):
    p = fqr.get_preset("minimax-m3-index-cache", 8)
    return replace(
        p,
        variant_params=(("index_head_dim", 128), ("block_size", 128), ("cache_dtype", cache_dtype)),
    )


@pytest.mark.gpu_memory(GIB)
def test_an_e5m2_index_cache(gen):
    """KV and index caches in float8_e5m2 (with per-tensor KV scales): index_q returned in
    E5M2, every cache within one E5M2 ULP of float64, rows no slot names unchanged."""
    preset = _index_cache_preset("fp8e5m2")
    variant = variant_of(preset)
    table = rope_table(preset, MAX_POSITION)
    inputs = variant.draw(preset, TOKENS, torch.bfloat16, gen, max_position=table.shape[0])
    assert inputs["index_cache"].dtype == E5M2
    exact = variant.expected(preset, inputs, table) if has_values(table) else None
    for _ in range(2):
        _poison()
        outs = variant.run(preset, launch_copies(inputs), table, backend="triton")
        names = variant.outputs_of(preset)
        got = dict(zip(names, outs))
        assert got["index_q"].dtype == E5M2
        if exact is None:
            continue
        _check_e5m2(got["index_q"], exact["index_q"], 128, "index_q")
        for name in ("key_cache", "value_cache", "index_cache"):
            d = variant.head_dim(preset, name)
            out, e = got[name], exact[name]
            c = compare(out.reshape(-1, d), e.reshape(-1, d), head_dim=d)
            assert c.passed and c.nonfinite == 0, f"{name}: {c}"


@pytest.mark.gpu_memory(GIB)
def test_kv_cache_insert_takes_vllms_scales_with_auto(gen):
    """vLLM's ``reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
    "auto", layer._k_scale, layer._v_scale)`` at MiniMax-M3's KV heads: the caches equal the
    call without scales, byte for byte (the scales' values are not read)."""
    preset = fqr.get_preset("minimax-m3-kvcache", 8)
    variant = variant_of(preset)
    inputs = variant.draw(preset, TOKENS, torch.bfloat16, gen, max_position=1 << 10)
    spec = preset.spec
    qkv = inputs["qkv"]
    shape = (TOKENS, spec.num_kv_heads, spec.head_dim)
    key = qkv[:, spec.q_size : spec.q_size + spec.kv_size].view(shape)
    value = qkv[:, spec.q_size + spec.kv_size :].view(shape)
    scales = [torch.tensor(v, device=GPU_DEVICE) for v in (0.1, float("nan"))]
    want = [inputs[n].clone() for n in ("key_cache", "value_cache")]
    fqr.kv_cache_insert(key, value, *want, inputs["slot_mapping"], "auto", None, None,
                        backend="triton")  # fmt: skip
    for scale in scales:
        got = [inputs[n].clone() for n in ("key_cache", "value_cache")]
        fqr.kv_cache_insert(key, value, *got, inputs["slot_mapping"], "auto", scale, scale,
                            backend="triton")  # fmt: skip
        if has_values(*got):
            assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.gpu_memory(GIB)
@pytest.mark.parametrize("name", ["minimax-m3-kvcache", "minimax-m3-index-cache"])
def test_fused_cache_ops_take_scales_with_a_bf16_cache(gen, name):
    """The fused KV-cache / index-cache ops with vLLM's layer scales ([1] float32) and bf16
    caches: outputs and caches equal the call without them."""
    preset = fqr.get_preset(name, 8)
    variant = variant_of(preset)
    table = rope_table(preset, MAX_POSITION)
    inputs = variant.draw(preset, TOKENS, torch.bfloat16, gen, max_position=table.shape[0])
    assert "k_scale" not in inputs  # a bf16 cache: the draw gives none
    layer_scale = torch.full((1,), 0.37, device=GPU_DEVICE)
    want = variant.run(preset, launch_copies(inputs), table, backend="triton")
    with_scales = dict(launch_copies(inputs), k_scale=layer_scale, v_scale=layer_scale.clone())
    got = variant.run(preset, with_scales, table, backend="triton")
    assert len(got) == len(want)
    if has_values(*got):
        for n, g, w in zip(variant.outputs_of(preset), got, want):
            assert torch.equal(g, w), n
