"""The public ops of issue 15's norm variants (Gemma 4's v norm, Llama 4's rope then L2 norm and
its NoPE temperature): named argument errors before any kernel, the unfused mode equal bit for
bit to the models' own unfused chains (vLLM's code, fqr.peers), torch.ops.fqr registrations, and
each variant preset's eager chain (what ``fqr bench`` times) against the float64 reference."""

from __future__ import annotations

import pytest
import torch

import fqr
from fqr import reference
from fqr.numerics import compare
from fqr.peers import gemma4_prologue
from fqr.presets import get_preset
from fqr.prologue import variant_of

T = 5
MAX_POS = 1 << 14


def _inputs(preset, gen, dtype=torch.bfloat16, tokens=T):
    variant = variant_of(preset)
    return variant.draw(preset, tokens, dtype, gen, max_position=MAX_POS)


def _table(preset):
    return preset.cos_sin_cache(MAX_POS)


@pytest.mark.parametrize("name", ["gemma4-31b-sliding", "gemma4-31b-full"])
@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_vnorm_unfused_is_vllms_gemma4_chain(gen, name, backend):
    preset = get_preset(name, 8)
    x, cache = _inputs(preset, gen), _table(preset)
    out = variant_of(preset).run(preset, x, cache, numerics="unfused", backend=backend)
    vllm = gemma4_prologue(
        x["qkv"], x["positions"], cache.bfloat16(), x["q_weight"], x["k_weight"], preset.spec
    )
    expected = variant_of(preset).expected(preset, x, cache)
    for name_, o, v in zip("qkv", out, vllm):
        if backend == "reference":
            assert torch.equal(o, v), name_
        else:  # the kernel's fp32 sum of squares adds in another order (fqr.numerics): where
            # rstd moves by an fp32 ulp an element on a rounding boundary lands one ULP away,
            # which RoPE's cancellation can widen; the rest is the chain's bits
            assert (o != v).float().mean() < 0.01, name_
            c = compare(o, expected[name_], head_dim=preset.head_dim, numerics="unfused")
            assert c.passed, (name_, c)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_vnorm_unfused_hf_is_the_split_ops_with_vs_unfused_norm(gen, backend):
    """``unfused-hf`` (Hugging Face's Gemma 3n): q and k as the split op's ``unfused-hf``
    per-head norms (the weight multiplied in fp32, one rounding) and RoPE, v's weightless norm
    as ``unfused``; q and k differ from ``unfused`` (AFMoE's and Qwen3's roundings differ)."""
    preset = get_preset("gemma4-31b-sliding", 8)
    x, cache = _inputs(preset, gen), _table(preset)
    run = variant_of(preset).run
    hf = run(preset, x, cache, numerics="unfused-hf", backend=backend)
    vllm = run(preset, x, cache, numerics="unfused", backend=backend)
    split = fqr.split_qkv_rmsnorm_rope(
        x["qkv"], x["positions"], cache, x["q_weight"], x["k_weight"],
        **preset.spec.kwargs(numerics="unfused-hf", backend=backend),
    )  # fmt: skip
    assert torch.equal(hf[0], split[0]) and torch.equal(hf[1], split[1])
    assert torch.equal(hf[2], vllm[2])
    assert not (torch.equal(hf[0], vllm[0]) and torch.equal(hf[1], vllm[1]))


@pytest.mark.parametrize("name", ["llama4-scout", "llama4-scout-nope"])
def test_rope_l2norm_unfused_is_vllms_llama4_chain(gen, name):
    preset = get_preset(name, 8)
    x, cache = _inputs(preset, gen), _table(preset)
    variant = variant_of(preset)
    out = variant.run(preset, x, cache, numerics="unfused", backend="reference")
    vllm = variant.eager(preset, cache, torch.bfloat16)(x)
    for o, v in zip(out, vllm):
        assert torch.equal(o, v)


def test_rope_l2norm_unfused_hf_rounds_as_hugging_face(gen):
    # HF Llama 4: apply_rotary_emb as complex64 products of the fp32 q, one cast back
    # (type_as), then Llama4TextL2Norm on x.float(), one cast back.
    preset = get_preset("llama4-scout", 8)
    x, cache = _inputs(preset, gen), _table(preset)
    spec = preset.spec
    out = fqr.split_qkv_rope_l2norm(
        x["qkv"],
        x["positions"],
        cache,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        eps=spec.eps,
        numerics="unfused-hf",
        backend="reference",
    )
    rows = cache.index_select(0, x["positions"])
    half = spec.head_dim // 2
    freqs_cis = torch.complex(rows[:, :half], rows[:, half:])[:, None, :]
    q, k, _ = x["qkv"].split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    for got, part in ((out[0], q), (out[1], k)):
        heads = part.reshape(T, -1, spec.head_dim)
        z = torch.view_as_complex(heads.float().reshape(T, heads.shape[1], half, 2))
        rotated = torch.view_as_real(z * freqs_cis).flatten(-2).type_as(part)
        xf = rotated.float()
        hf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + spec.eps)).type_as(part)
        # fp32 rotations in another operation order: the rare element whose fp32 value sits
        # on a bf16 rounding boundary may differ; the rest are HF's bits
        assert (got != hf.reshape(T, -1)).float().mean() < 0.02
    expected = reference.rope_l2norm_prologue(
        x["qkv"], x["positions"], cache, **{k: v for k, v in spec.kwargs().items() if k in _L2}
    )
    for o, e in zip(out, expected):
        assert compare(o, e, head_dim=spec.head_dim, numerics="unfused").passed


_L2 = ("num_heads", "num_kv_heads", "head_dim", "eps", "is_neox")


@pytest.mark.parametrize(
    "name", ["gemma4-31b-sliding", "gemma4-31b-full", "llama4-scout", "llama4-scout-nope"]
)
def test_each_variant_presets_eager_chain_meets_the_unfused_contract(gen, name):
    preset = get_preset(name, 8)
    x, cache = _inputs(preset, gen, torch.float16), _table(preset)
    variant = variant_of(preset)
    expected = variant.expected(preset, x, cache)
    eager = variant.eager(preset, cache, torch.float16)(x)
    assert len(eager) == len(variant.outputs)
    for out_name, o in zip(variant.outputs, eager):
        if out_name in variant.copies:
            assert torch.equal(o, expected[out_name].to(o.dtype))
        else:
            c = compare(o, expected[out_name], head_dim=preset.head_dim, numerics="unfused")
            assert c.passed, (out_name, c)


def test_torch_ops_are_the_public_ops(gen):
    preset = get_preset("gemma4-31b-full", 8)
    x, cache = _inputs(preset, gen), _table(preset)
    s = preset.spec
    args = (x["qkv"], x["positions"], cache, x["q_weight"], x["k_weight"])
    got = torch.ops.fqr.split_qkv_rmsnorm_rope_vnorm(
        *args, None, None, s.num_heads, s.num_kv_heads, s.head_dim, s.eps, s.is_neox, 0.0, "fused"
    )
    want = fqr.split_qkv_rmsnorm_rope_vnorm(
        *args, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim
    )
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    nope = get_preset("llama4-scout-nope", 8).spec
    y = _inputs(get_preset("llama4-scout-nope", 8), gen)
    got = torch.ops.fqr.split_qkv_rope_l2norm(
        y["qkv"], y["positions"], None, 5, 1, 128, 1e-5, False, 8192.0, 0.1, "fused"
    )
    want = fqr.split_qkv_rope_l2norm(
        y["qkv"],
        y["positions"],
        None,
        num_heads=nope.num_heads,
        num_kv_heads=nope.num_kv_heads,
        head_dim=nope.head_dim,
        floor_scale=8192.0,
    )
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_nope_without_temperature_copies_the_row(gen):
    preset = get_preset("llama4-scout-nope", 8)
    x = _inputs(preset, gen)
    s = preset.spec
    q, k, v = fqr.split_qkv_rope_l2norm(
        x["qkv"], None, None, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=128
    )
    assert torch.equal(torch.cat([q, k, v], dim=1), x["qkv"])


def _vnorm(qkv, positions, cache, w, **kw):
    args = dict(num_heads=2, num_kv_heads=1, head_dim=64) | kw
    return fqr.split_qkv_rmsnorm_rope_vnorm(qkv, positions, cache, w, w, **args)


def _l2(qkv, positions, cache, **kw):
    return fqr.split_qkv_rope_l2norm(
        qkv, positions, cache, **(dict(num_heads=2, num_kv_heads=1, head_dim=64) | kw)
    )


def test_bad_arguments_are_named_before_any_kernel():
    qkv = torch.randn(3, 4 * 64).bfloat16()
    pos = torch.tensor([0, 5, 9])
    cache = fqr.rope_cos_sin_cache(64, 16, 1e4)
    w = torch.ones(64).bfloat16()
    with pytest.raises(ValueError, match="cos_sin_cache"):
        _vnorm(qkv, pos, None, w)
    with pytest.raises(ValueError, match="qkv width"):
        _vnorm(qkv[:, :-64], pos, cache, w)
    with pytest.raises(ValueError, match="q_weight"):
        fqr.split_qkv_rmsnorm_rope_vnorm(
            qkv, pos, cache, w[:32], w, num_heads=2, num_kv_heads=1, head_dim=64
        )
    with pytest.raises(ValueError, match="numerics"):
        _l2(qkv, pos, cache, numerics="fast")
    with pytest.raises(ValueError, match="floor_scale"):
        _l2(qkv, pos, None, floor_scale=-1.0)
    with pytest.raises(TypeError, match="attn_scale"):
        _l2(qkv, pos, None, floor_scale=8192.0, attn_scale="0.1")
    with pytest.raises(ValueError, match="positions"):
        _l2(qkv, None, None, floor_scale=8192.0)
    with pytest.raises(ValueError, match="positions"):  # beyond the table
        _l2(qkv, torch.tensor([0, 5, 16]), cache)
    with pytest.raises(ValueError, match="positions"):  # not exact as fp32 numbers
        _l2(qkv, torch.tensor([0, 5, 1 << 24]), None, floor_scale=8192.0)
