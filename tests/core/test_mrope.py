"""mRoPE and the gated row: the op's impl against the independent float64 formulation, text-only
positions as plain RoPE bit for bit, the public op's argument checks, the variants' unfused mode
against the models' own eager chains, and the presets' config numbers."""

from __future__ import annotations

import pytest
import torch
from conftest import real_table

import fqr
from fqr import ops, reference
from fqr.numerics import compare
from fqr.prologue import variant_of

F64 = torch.float64

# (rotary_dim, head_dim, sections, interleaved, neox): Qwen3-VL, Qwen3.5's partial rotary,
# Qwen2-VL's contiguous sections, GPT-J pairs, an empty section
LAYOUTS = [
    (128, 128, (24, 20, 20), True, True),
    (64, 256, (11, 11, 10), True, True),
    (128, 128, (16, 24, 24), False, True),
    (32, 64, (6, 5, 5), True, False),
    (16, 32, (8, 0, 0), False, True),
]


def planes(gen, tokens, max_position, text_every=3):
    positions = torch.randint(0, max_position, (3, tokens), generator=gen)
    positions[1:, ::text_every] = positions[0, ::text_every]
    return positions


@pytest.mark.parametrize("rotary, d, sections, interleaved, neox", LAYOUTS)
def test_impl_matches_float64_reference(gen, rotary, d, sections, interleaved, neox):
    tokens, heads = 9, 3
    cache = real_table(rotary, 512, 1e6)
    x = torch.randn(tokens, heads * d, generator=gen, dtype=F64)
    positions = planes(gen, tokens, 512)
    got = ops.mrope(
        x,
        *positions,
        cache,
        head_dim=d,
        mrope_section=sections,
        mrope_interleaved=interleaved,
        is_neox=neox,
    )
    want = reference.mrope(
        x,
        positions,
        cache,
        head_dim=d,
        mrope_section=sections,
        interleaved=interleaved,
        is_neox=neox,
    )
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    # the planes matter: moving the h plane changes exactly the frequencies it owns
    if sections[1]:
        moved = positions.clone()
        moved[1] = (moved[1] + 1) % 512
        other = reference.mrope(
            x,
            moved,
            cache,
            head_dim=d,
            mrope_section=sections,
            interleaved=interleaved,
            is_neox=neox,
        )
        assert not torch.allclose(other, want)


def test_interleaved_frequency_planes_are_qwen3_vl_s():
    # HF Qwen3VLTextRotaryEmbedding.apply_interleaved_mrope: t h w t h w ... for (24, 20, 20)
    from fqr.ops.mrope import frequency_planes

    planes_ = frequency_planes(64, (24, 20, 20), True)
    assert planes_[:6] == [0, 1, 2, 0, 1, 2] and planes_[57:] == [0, 1, 2, 0, 0, 0, 0]
    assert [planes_.count(p) for p in range(3)] == [24, 20, 20]
    assert frequency_planes(32, (11, 11, 10), True)[29:] == [2, 0, 1]
    assert frequency_planes(8, (4, 2, 2), False) == [0, 0, 0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize(
    "half, sections, counts",
    [
        (64, (16, 24, 24), [22, 21, 21]),  # vLLM's fused_qk_norm_mrope test, interleaved
        (64, (32, 32, 32), [22, 21, 21]),  # vllm-ascend's triton_mrope test (R 128)
        (32, (24, 20, 20), [11, 11, 10]),  # vllm-ascend's split_qkv_rmsnorm_mrope test (R 64)
        (64, (4, 30, 30), [22, 21, 21]),
        (64, (40, 8, 8), [48, 8, 8]),
        (64, (64, 0, 0), [64, 0, 0]),
    ],
)
def test_interleaved_sections_are_read_as_vllm_reads_them(half, sections, counts):
    """vLLM's ``apply_interleaved_rope``: h where ``i % 3 == 1 and i < 3*h``, w where
    ``i % 3 == 2 and i < 3*w``, t elsewhere, whatever the sizes sum to."""
    from fqr.ops.mrope import frequency_planes
    from fqr.validate import check_mrope_section

    i = torch.arange(half)
    on_h = (i % 3 == 1) & (i < 3 * sections[1])
    on_w = (i % 3 == 2) & (i < 3 * sections[2])
    vllm = torch.where(on_w, 2, torch.where(on_h, 1, 0)).tolist()
    planes_ = frequency_planes(half, sections, True)
    assert planes_ == vllm
    assert [planes_.count(p) for p in range(3)] == counts
    check_mrope_section(sections, True, 2 * half)  # an op takes them
    if sum(sections) != half:  # a model's config must sum (vLLM's MRotaryEmbedding asserts)
        with pytest.raises(ValueError, match="vLLM's MRotaryEmbedding asserts it"):
            check_mrope_section(sections, True, 2 * half, config=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("round_to", [None, "dtype"])
def test_text_positions_are_plain_rope_bit_for_bit(gen, dtype, round_to):
    rt = dtype if round_to else None
    for rotary, d, sections, interleaved, neox in LAYOUTS:
        cache = real_table(rotary, 300, 5e6)
        x = torch.randn(5, 2 * d, generator=gen).to(dtype)
        pos = torch.randint(0, 300, (5,), generator=gen)
        plain = ops.rope(x, pos, cache, head_dim=d, is_neox=neox, round_to=rt)
        multi = ops.mrope(
            x,
            pos,
            pos.clone(),
            pos.clone(),
            cache,
            head_dim=d,
            mrope_section=sections,
            mrope_interleaved=interleaved,
            is_neox=neox,
            round_to=rt,
        )
        assert torch.equal(plain, multi)


def test_shape_rule_names_the_sections():
    from fqr.core import Aval, trace

    def f(x, a, b, c, cache):
        return ops.mrope(x, a, b, c, cache, head_dim=128, mrope_section=(20, 20, 20))

    pos = Aval(("T",), torch.int64)
    with pytest.raises(ValueError, match="mrope_section"):
        trace(f, Aval(("T", 256), torch.bfloat16), pos, pos, pos, Aval(("P", 128), torch.float32))


# ------------------------------------------------------------------------ the public op


def call_inputs(gen, preset, tokens=4, dtype=torch.bfloat16):
    variant = variant_of(preset)
    cache = preset.cos_sin_cache(4096)
    inputs = variant.draw(preset, tokens, dtype, gen, max_position=4096)
    return variant, cache, inputs


def op_kwargs(preset, **extra):
    fields = preset.params
    return (
        dict(
            num_heads=preset.num_heads,
            num_kv_heads=preset.num_kv_heads,
            head_dim=preset.head_dim,
            mrope_section=fields["mrope_section"],
            mrope_interleaved=fields["mrope_interleaved"],
            weight_offset=preset.weight_offset,
            output_gate=preset.variant == "mrope-gate",
            backend="reference",
        )
        | extra
    )


@pytest.mark.parametrize("name", ["qwen3-vl-8b", "qwen3.5-27b"])
def test_public_op_matches_float64_and_copies_v_and_gate(gen, name):
    p = fqr.get_preset(name, 4)
    variant, cache, x = call_inputs(gen, p)
    outs = fqr.split_qkv_rmsnorm_mrope(
        x["qkv"], x["positions"], cache, x["q_weight"], x["k_weight"], **op_kwargs(p)
    )
    want = reference.mrope_prologue(
        x["qkv"],
        x["positions"],
        cache,
        x["q_weight"],
        x["k_weight"],
        **{k: v for k, v in op_kwargs(p).items() if k != "backend"},
    )
    assert len(outs) == len(variant.outputs) == len(want)
    for n, o, w in zip(variant.outputs, outs, want):
        c = compare(o, w, head_dim=p.head_dim, bitwise=n in variant.copies)
        assert c.passed, f"{n}: {c}"
    if p.variant == "mrope-gate":  # gate head h is the D columns after q head h
        d = p.head_dim
        row = x["qkv"].view(4, -1)[:, : 2 * p.num_heads * d].view(4, p.num_heads, 2, d)
        assert torch.equal(outs[3], row[:, :, 1].reshape(4, -1))
    # no tokens: empty outputs of the right widths
    empty = fqr.split_qkv_rmsnorm_mrope(
        x["qkv"][:0], x["positions"][:, :0], cache, x["q_weight"], x["k_weight"], **op_kwargs(p)
    )
    assert [e.shape for e in empty] == [(0, o.shape[1]) for o in outs]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(positions=lambda x: x["positions"][:2]), "positions must be \\[3, T\\]"),
        (dict(positions=lambda x: x["positions"].float()), "positions must be int32 or int64"),
        (
            dict(mrope_section=(24, 20, 21), mrope_interleaved=False),
            "mrope_section .* must sum to rotary_dim/2 = 64 \\(contiguous sections",
        ),
        (dict(mrope_section=(24, -1, 41)), "three non-negative ints"),
        (dict(mrope_section=(24, 20)), "mrope_section must be three ints"),
        (dict(mrope_interleaved=1), "mrope_interleaved must be a bool"),
        (dict(output_gate=True), "qkv width 6144 != \\(2\\*num_heads"),
        (dict(output_gate="yes"), "output_gate must be a bool"),
        (dict(q_weight=lambda x: None), "q_weight is required"),
        (dict(positions=lambda x: x["positions"] + 4096), "positions out of range"),
    ],
)
def test_bad_arguments_are_named_before_anything_runs(gen, change, message):
    p = fqr.get_preset("qwen3-vl-8b")
    _, cache, x = call_inputs(gen, p)
    args = dict(positions=x["positions"], q_weight=x["q_weight"])
    kwargs = op_kwargs(p)
    for k, v in change.items():
        if k in args:
            args[k] = v(x)
        else:
            kwargs[k] = v
    with pytest.raises((ValueError, TypeError), match=message):
        fqr.split_qkv_rmsnorm_mrope(
            x["qkv"], args["positions"], cache, args["q_weight"], x["k_weight"], **kwargs
        )


def test_the_checked_call_is_reused_and_still_checks_positions_on_cpu(gen):
    p = fqr.get_preset("qwen3-vl-8b", 8)
    _, cache, x = call_inputs(gen, p)
    kw = op_kwargs(p)
    fqr.split_qkv_rmsnorm_mrope(x["qkv"], x["positions"], cache, x["q_weight"], x["k_weight"], **kw)
    bad = x["positions"].clone()
    bad[2, 1] = -1
    with pytest.raises(ValueError, match="positions out of range"):
        fqr.split_qkv_rmsnorm_mrope(x["qkv"], bad, cache, x["q_weight"], x["k_weight"], **kw)


# ------------------------------------------------------------------ variants and presets


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["qwen3-vl-8b", "qwen3.5-27b"])
def test_unfused_mode_is_the_models_eager_chain_bit_for_bit(gen, name, dtype):
    """vLLM's own chain (RMSNorm or GemmaRMSNorm, MRotaryEmbedding.forward_native) written in
    the variant's ``eager`` and fqr's unfused numerics round at the same points."""
    p = fqr.get_preset(name, 2)
    variant, cache, x = call_inputs(gen, p, tokens=6, dtype=dtype)
    eager = variant.eager(p, cache, dtype)(x)
    unfused = variant.run(p, x, cache, numerics="unfused", backend="reference")
    exact = variant.expected(p, x, cache)
    for n, a, b in zip(variant.outputs, eager, unfused):
        assert torch.equal(a, b), n
        c = compare(a, exact[n], head_dim=p.head_dim, bitwise=n in variant.copies)
        assert c.max_abs < 0.1 * exact[n].abs().max().item() or n in variant.copies


def test_presets_carry_the_model_configs():
    vl, q35 = fqr.get_preset("qwen3-vl-8b"), fqr.get_preset("qwen3.5-27b")
    assert (vl.num_heads, vl.num_kv_heads, vl.head_dim, vl.rotary_dim) == (32, 8, 128, 128)
    assert vl.rope_theta == 5e6 and vl.params["mrope_section"] == (24, 20, 20)
    assert vl.variant == "mrope" and vl.params["mrope_interleaved"] is True
    assert (q35.num_heads, q35.num_kv_heads, q35.head_dim, q35.rotary_dim) == (24, 4, 256, 64)
    assert q35.rope_theta == 1e7 and q35.weight_offset == 1.0
    assert q35.variant == "mrope-gate" and q35.params["mrope_section"] == (11, 11, 10)
    assert variant_of(q35).outputs == ("q", "k", "v", "gate")


def test_torch_op_is_the_public_op_and_traces_with_a_symbolic_token_count(gen):
    p = fqr.get_preset("qwen3.5-27b", 8)
    variant, cache, x = call_inputs(gen, p, tokens=3)
    kw = op_kwargs(p)
    del kw["backend"]
    args = (x["qkv"], x["positions"], cache, x["q_weight"], x["k_weight"], None, None)
    statics = [kw[k] for k in ("num_heads", "num_kv_heads", "head_dim")]
    statics += [list(kw["mrope_section"]), kw["mrope_interleaved"], 1e-6, True]
    statics += [kw["weight_offset"], kw["output_gate"], "fused"]
    got = torch.ops.fqr.split_qkv_rmsnorm_mrope(*args, *statics)
    want = variant.run(p, x, cache, backend="reference")
    assert len(got) == 4 and all(torch.equal(a, b) for a, b in zip(got, want))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(t) if t is not None else None for t in args]
        shapes = [o.shape for o in torch.ops.fqr.split_qkv_rmsnorm_mrope(*fake, *statics)]
    assert shapes == [o.shape for o in want]
