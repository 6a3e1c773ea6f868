"""The mRoPE compositions as interpreted fused kernels: poisoned outputs against float64 (both
section layouts, the gated row), and text-only positions giving the plain RoPE kernel's bits."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from support.programs import check_reference_and_kernel

import fqr
from fqr import reference
from fqr.prologue import variant_of


@pytest.mark.parametrize(
    "name, sections, interleaved, bias",
    [
        ("qwen3-vl-8b", (24, 20, 20), True, False),
        ("qwen3-vl-8b", (16, 24, 24), False, True),  # Qwen2-VL's contiguous sections
        ("qwen3.5-27b", (11, 11, 10), True, False),  # gate heads, partial rotary, (1 + w)
    ],
)
def test_kernel_against_float64(gen, name, sections, interleaved, bias):
    fields = (("mrope_section", sections), ("mrope_interleaved", interleaved))
    p = replace(fqr.get_preset(name), variant_params=fields).shard(8)
    variant = variant_of(p)
    cache = p.cos_sin_cache(1024)
    inputs = variant.draw(p, 5, torch.bfloat16, gen, max_position=1024, bias=bias)
    program = variant.program(p, torch.bfloat16, bias=bias)
    exact = variant.expected(p, inputs, cache)
    copies = [i for i, n in enumerate(variant.outputs) if n in variant.copies]
    check_reference_and_kernel(
        program,
        variant.program_args(p, inputs, cache),
        [exact[n] for n in variant.outputs],
        [p.head_dim] * len(variant.outputs),
        copies,
    )


@pytest.mark.parametrize("name", ["qwen3-vl-8b", "qwen3.5-27b"])
def test_text_positions_give_the_rope_kernel_bits(gen, name):
    p = fqr.get_preset(name, 8)
    variant = variant_of(p)
    cache = p.cos_sin_cache(1024)
    inputs = variant.draw(p, 3, torch.bfloat16, gen, max_position=1024)
    text = inputs["positions"][0].contiguous()
    got = variant.run(p, dict(inputs, positions=text), cache, backend="interpret")
    qkv = inputs["qkv"]
    if variant.pins["output_gate"]:  # the same q, k, v heads without the gate columns
        d, hq = p.head_dim, p.num_heads
        q = qkv[:, : 2 * hq * d].reshape(3, hq, 2, d)[:, :, 0].reshape(3, -1)
        qkv = torch.cat([q, qkv[:, 2 * hq * d :]], dim=1)
    plain = fqr.split_qkv_rmsnorm_rope(
        qkv,
        text,
        cache,
        inputs["q_weight"],
        inputs["k_weight"],
        **p.spec.kwargs(backend="interpret"),
    )
    for n, a, b in zip("qkv", got, plain):
        assert torch.equal(a, b), n
    # and the plain rotation is what float64 expects of text tokens
    q64 = reference.prologue(
        qkv, text, cache, inputs["q_weight"], inputs["k_weight"], **p.spec.kwargs()
    )[0]
    assert fqr.numerics.compare(got[0], q64, head_dim=p.head_dim).passed


@pytest.mark.parametrize("name", ["qwen3-vl-8b", "qwen3.5-27b"])
def test_unfused_kernel_is_the_models_eager_chain_bit_for_bit(gen, name):
    p = fqr.get_preset(name, 8)
    variant = variant_of(p)
    cache = p.cos_sin_cache(1024)
    inputs = variant.draw(p, 3, torch.bfloat16, gen, max_position=1024)
    got = variant.run(p, inputs, cache, numerics="unfused", backend="interpret")
    eager = variant.eager(p, cache, torch.bfloat16)(inputs)
    for n, a, b in zip(variant.outputs, got, eager):
        assert torch.equal(a, b), n
