"""FP8 E5M2 caches wherever E4M3 ones are accepted (vLLM's ``kv_cache_dtype="fp8_e5m2"``,
FlashInfer's ``quantize_dtype=torch.float8_e5m2``): ``fqr.kv_cache_insert``,
``fqr.split_qkv_rmsnorm_rope_cache`` (and the MiniMax index-cache op's k / v caches, the same
parameters), ``fqr.split_mla_rmsnorm_rope_cache`` and ``fqr.mla_cache_insert``, as float8_e5m2
tensors or vLLM's uint8 bytes. Each stores ``e5m2(clamp(x / scale, -57344, 57344))``: within
one E5M2 ULP of float64 (the contract), and byte for byte what torch's own conversion of the
saturated fp32 value gives, on the reference backend and the interpreted kernel (whose bytes
are encoded on the fp32 bits, one encoding for every target); values past the E5M2 range and
below its normal range (subnormals) included."""

from __future__ import annotations

import pytest
import torch

import fqr
from fqr import reference
from fqr.backends import BACKENDS
from fqr.numerics import compare_kind
from fqr.presets import get_preset
from fqr.prologue import variant_of

E5M2 = torch.float8_e5m2
BACKEND_NAMES = ["reference"] + (["interpret"] if BACKENDS["interpret"].available else [])
MAX_POSITION = 1 << 16


def _torch_e5m2(x: torch.Tensor, scale) -> torch.Tensor:
    """torch's conversion of the saturated fp32 ``x / scale``: the bytes the store must give."""
    y = (x.float() / scale).clamp(-57344.0, 57344.0)
    return y.to(E5M2).view(torch.uint8)


def _wide_range(x: torch.Tensor, gen) -> torch.Tensor:
    """``x`` with some elements far past E5M2's range and some in its subnormal range."""
    x = x.clone()
    flat = x.view(-1)
    picks = torch.randperm(flat.numel(), generator=gen)[:64]
    flat[picks[:16]] = (flat[picks[:16]].float() * 1e5).to(x.dtype)
    flat[picks[16:48]] = (flat[picks[16:48]].float() * 1e-6).to(x.dtype)
    return x


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("as_bytes", [True, False], ids=["uint8", "float8_e5m2"])
def test_kv_cache_insert_e5m2(gen, as_bytes, backend):
    key = _wide_range(torch.randn(9, 2, 64, generator=gen).bfloat16() * 30, gen)
    value = torch.randn(9, 2, 64, generator=gen).bfloat16() * 300
    caches = [torch.randn(4, 16, 2, 64, generator=gen).to(E5M2) for _ in range(2)]
    if as_bytes:
        caches = [c.view(torch.uint8) for c in caches]
    slots = torch.randperm(64, generator=gen)[:8]
    slots[1] = -1
    k_scale = torch.tensor(0.5)
    exact = reference.kv_cache_insert(
        key, value, *caches, slots, kv_cache_dtype="fp8_e5m2", k_scale=k_scale
    )
    written = [c.clone() for c in caches]
    fqr.kv_cache_insert(key, value, *written, slots, "fp8_e5m2", k_scale, None, backend=backend)
    keep = slots >= 0
    for x, scale, out, want in zip((key, value), (0.5, 1.0), written, exact):
        rows, want_rows = out.reshape(64, 128), want.reshape(64, 128)
        c = compare_kind("fp8-e5m2-bytes", rows, want_rows, head_dim=64)
        assert c.passed and c.max_ulp == 0, c
        got = out.view(torch.uint8).view(64, 2, 64)[slots[keep]]
        assert torch.equal(got, _torch_e5m2(x[:8][keep], scale))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_split_qkv_rmsnorm_rope_cache_e5m2(gen, backend):
    """The KV-cache prologue (vLLM's fused_qk_norm_rope_kvcache) with float8_e5m2 caches and
    per-tensor scales: every output against float64."""
    preset = get_preset("minimax-m3-kvcache-fp8", 8)
    variant = variant_of(preset)
    table = preset.cos_sin_cache(MAX_POSITION)
    inputs = variant.draw(preset, 5, torch.bfloat16, gen, max_position=MAX_POSITION)
    inputs |= {n: inputs[n].float().to(E5M2) for n in ("key_cache", "value_cache")}
    exact = variant.expected(preset, inputs, table)
    outs = variant.run(preset, inputs, table, backend=backend)
    for n, out in zip(variant.outputs_of(preset), outs):
        assert out.dtype in (torch.bfloat16, E5M2), n
        c = compare_kind("contract", out, exact[n], head_dim=variant.head_dim(preset, n))
        assert c.passed, f"{n}: {c}"


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_mla_prologue_e5m2(gen, backend):
    """split_mla_rmsnorm_rope_cache with a float8_e5m2 ``[kv_c | k_pe]`` cache and k_scale."""
    preset = get_preset("deepseek-v3-fp8", 16)
    variant = variant_of(preset)
    table = preset.cos_sin_cache(MAX_POSITION)
    inputs = variant.draw(preset, 5, torch.bfloat16, gen, max_position=MAX_POSITION)
    inputs["kv_cache"] = inputs["kv_cache"].float().to(E5M2)
    inputs["k_scale"] = torch.tensor([2e-5])  # kv_c / k_pe values past 57344 * 2e-5: saturated
    exact = variant.expected(preset, inputs, table)
    assert bool((exact["kv_cache"].abs() == 57344).any())
    outs = variant.run(preset, inputs, table, backend=backend)
    assert outs[-1].dtype == E5M2
    for n, out in zip(variant.outputs_of(preset), outs):
        c = compare_kind("contract", out, exact[n], head_dim=variant.head_dim(preset, n))
        assert c.passed, f"{n}: {c}"


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("as_bytes", [True, False], ids=["uint8", "float8_e5m2"])
def test_mla_cache_insert_e5m2(gen, as_bytes, backend):
    """mla_cache_insert(..., "fp8_e5m2", scale): vLLM's concat_and_cache_mla into an E5M2
    cache; the bytes are torch's conversion of the saturated values."""
    preset = get_preset("deepseek-v3-fp8-e5m2-mla-insert")
    variant = variant_of(preset)
    inputs = variant.draw(preset, 6, torch.bfloat16, gen, max_position=1)
    inputs["kv_c"] = _wide_range(inputs["kv_c"], gen)
    if not as_bytes:
        inputs["kv_cache"] = inputs["kv_cache"].view(E5M2)
    before = inputs["kv_cache"].clone()
    (out,) = variant.run(preset, inputs, None, backend=backend)
    exact = variant.expected(preset, inputs, None)["kv_cache"]
    c = compare_kind("fp8-e5m2-bytes", out, exact, head_dim=64)
    assert c.passed and c.max_ulp == 0, c
    slots, scale = inputs["slot_mapping"], float(inputs["scale"])
    keep = slots >= 0
    entry = torch.cat([inputs["kv_c"], inputs["k_pe"]], dim=1)[:5][keep]
    got = out.view(torch.uint8).view(-1, 576)[slots[keep]]
    assert torch.equal(got, _torch_e5m2(entry, scale))
    untouched = torch.ones(out.shape[0] * out.shape[1], dtype=torch.bool)
    untouched[slots[keep]] = False
    rows, was = out.view(torch.uint8).view(-1, 576), before.view(torch.uint8).view(-1, 576)
    assert torch.equal(rows[untouched], was[untouched])


def test_an_e5m2_cache_needs_its_name(gen):
    """An E5M2 cache given with kv_cache_dtype 'fp8' (E4M3) is refused naming the cache."""
    preset = get_preset("deepseek-v3-fp8-e5m2-mla-insert")
    variant = variant_of(preset)
    inputs = variant.draw(preset, 3, torch.bfloat16, gen, max_position=1)
    args = variant.arguments(preset, inputs, None, backend="reference")
    with pytest.raises(TypeError, match="kv_cache must be fp8e4m3 or its uint8 bytes"):
        e5m2_cache = args["kv_cache"].view(E5M2)
        fqr.mla_cache_insert(**dict(args, kv_cache=e5m2_cache, kv_cache_dtype="fp8"))
