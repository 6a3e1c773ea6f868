"""The variant framework: a variant registered from a test file goes through the golden storage
(regen, manifest, load, check) and the shared call path without code of its own there."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fqr import golden, reference
from fqr.golden import CaseSpec, load_case, regen
from fqr.presets import PRESETS, Preset
from fqr.prologue import (
    VARIANTS,
    checked_calls,
    forget_checked_calls,
    get_variant,
    presets_of,
    program_of,
    variant_of,
)
from fqr.prologue.split_qkv import SPLIT_QKV, SPLIT_QKV_RMSNORM_ROPE


@pytest.fixture
def test_variant(monkeypatch):
    """split-qkv under another name with a field of its own: a variant made outside fqr."""
    variant = replace(SPLIT_QKV, name="test-split-qkv-tagged", params=("tag",), golden=())
    monkeypatch.setitem(VARIANTS, variant.name, variant)
    preset = replace(
        PRESETS["qwen3-0.6b"],
        name="test-variant-preset",
        variant=variant.name,
        variant_params=(("tag", 3),),
    )
    monkeypatch.setitem(PRESETS, preset.name, preset)
    cases = (CaseSpec(preset.name, "bf16", 7),)
    monkeypatch.setattr(golden, "CASES", cases)
    return variant, preset


def test_every_preset_has_a_registered_variant_with_its_fields():
    for p in PRESETS.values():
        assert variant_of(p).name == p.variant


def test_variant_fields_are_checked_by_name():
    p = replace(PRESETS["qwen3-8b"], variant_params=(("mrope_section", (1, 2, 3)),))
    with pytest.raises(ValueError, match="mrope_section"):
        variant_of(p)
    with pytest.raises(ValueError, match="^variant must be one of .*, got 'nope'$"):
        get_variant("nope")


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3.5-27b", "minimax-m3-kvcache", "olmo2-7b"])
def test_the_preset_program_is_the_program_the_public_op_runs(gen, name):
    """What ``fqr lower``, the golden kernels and the Ascend sweep show (program_of) is the
    program a real call of the preset's public op traces and runs."""
    p = PRESETS[name]
    variant = variant_of(p)
    table = p.cos_sin_cache(64)
    inputs = variant.draw(p, 5, torch.bfloat16, gen, max_position=64)
    forget_checked_calls()
    variant.run(p, inputs, table, backend="reference")
    (call,) = checked_calls(variant.declaration)
    assert str(call.program) == str(program_of(p))
    assert variant.declaration is not SPLIT_QKV_RMSNORM_ROPE or name in ("qwen3-8b", "olmo2-7b")


def test_a_variant_case_round_trips_through_the_golden_files(tmp_path, test_variant):
    variant, preset = test_variant
    entries = regen(tmp_path, kernels=False)
    (entry,) = entries
    assert entry["variant"] == variant.name and entry["variant_params"] == {"tag": 3}
    assert entry["tolerance_kinds"] == {"q": "contract", "k": "contract", "v": "bitwise"}
    case = load_case(entry["name"], tmp_path)
    outputs = case.run("reference")
    checks = case.check(*outputs)
    assert set(checks) == {"q", "k", "v"} and all(c.passed for c in checks.values())
    # The expectation is the float64 reference of the stored inputs, not of fqr.ops.
    exact = reference.prologue(
        case.inputs["qkv"],
        case.inputs["positions"],
        case.cos_sin_cache,
        case.inputs["q_weight"],
        case.inputs["k_weight"],
        **preset.spec.kwargs(),
    )
    assert torch.equal(exact[0], case.expected["q"])
    # A wrong output fails its check.
    q, k, v = outputs
    bad_v = v.clone()
    bad_v.view(torch.int16)[0, 0] ^= 1
    assert not case.check(q, k, bad_v)["v"].passed
    # A second regen writes the same bytes.
    again = regen(tmp_path, kernels=False)
    assert again[0]["sha256"] == entry["sha256"]


def test_entries_record_their_variant():
    """Each entry records the variant it runs: its preset's (an op a layer calls beside its
    own prologue is a preset of its own: llama3-8b-qk-rope)."""
    for e in golden.list_cases():
        assert e["variant"] == PRESETS[e["preset"]].variant
    assert {e["variant"] for e in golden.list_cases()} >= {
        SPLIT_QKV.name, "mrope", "mrope-gate", "qk-rope", "qk-mrope"
    }  # fmt: skip


def test_a_wrong_preset_field_is_refused_as_a_preset():
    with pytest.raises(ValueError):
        Preset("x", "x", 3, 2, 128, 1e6, 10)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_new_token_counts_reuse_the_checked_call(gen, name):
    """Every variant's fast path holds across token counts (issue 23.6: mRoPE's planar
    ``[3, T]`` positions were keyed through a stride that holds T, so each new T added an
    entry to the table all ops share)."""
    p = PRESETS[presets_of(name)[0]]
    variant = variant_of(p)
    table = p.cos_sin_cache(64)
    forget_checked_calls()
    for tokens in (2, 3, 5, 9, 17):
        inputs = variant.draw(p, tokens, torch.bfloat16, gen, max_position=64)
        variant.run(p, inputs, table, backend="reference")
    assert len(checked_calls(variant.declaration)) == 1


OPCHECK_PRESETS = [
    *((presets_of(name)[0], name) for name in sorted(VARIANTS)),
    # no q_lora_rank: an absent output of an op that mutates its cache
    ("deepseek-v2-lite", "mla-kv"),
]


@pytest.mark.parametrize("name, variant_name", OPCHECK_PRESETS)
def test_every_torch_op_passes_opcheck_and_returns_new_memory(gen, name, variant_name):
    """``torch.library.opcheck`` (schema, fake, autograd registration, AOT dispatch: an op
    that mutates its cache and returns an optional output once failed it as ``Tensor[]``),
    and no returned tensor shares memory with an argument."""
    p = PRESETS[name]
    variant = variant_of(p)
    table = p.cos_sin_cache(64)
    inputs = variant.draw(p, 5, torch.bfloat16, gen, max_position=64)
    op, args = variant.torch_op(p, inputs, table)
    torch.library.opcheck(op, args)
    result = op(*args)
    given = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    for out in result if isinstance(result, tuple) else (result,):
        if isinstance(out, torch.Tensor):
            assert out.untyped_storage().data_ptr() not in given


def _smallest(name: str) -> Preset:
    """The variant's first preset at the largest TP of 8, 4, 2, 1 it splits at."""
    from fqr.presets import get_preset

    base = presets_of(name)[0]
    for tp in (8, 4, 2, 1):
        try:
            return get_preset(base, tp)
        except ValueError:
            continue
    raise AssertionError(f"{base} splits at no TP")


def _through_a_stride(positions: torch.Tensor) -> torch.Tensor:
    """The same positions read through a stride: ``[T]`` as column 0 of a ``[T, 2]`` buffer
    (MiniMax's ``positions[:, 0]``), ``[planes, T]`` as the transpose of a ``[T, planes]``
    buffer (each plane at stride ``planes``)."""
    if positions.dim() == 1:
        return torch.stack([positions, torch.full_like(positions, -7)], 1)[:, 0]
    return positions.t().contiguous().t()


@pytest.mark.parametrize("backend", ["reference", "interpret"])
@pytest.mark.parametrize(
    "name",
    sorted(n for n, v in VARIANTS.items() if "positions" in v.declaration.index),
)
def test_strided_positions_give_every_variant_the_same_outputs(gen, name, backend):
    """Issue 26.6: every op reads its positions through their stride (the Positions kind and
    the lowering's index loads: shared machinery), bit for bit what contiguous positions
    give, on the reference backend and through the kernel."""
    p = _smallest(name)
    variant = variant_of(p)
    table = p.cos_sin_cache(64)
    inputs = variant.draw(p, 3, torch.bfloat16, gen, max_position=64)
    strided = _through_a_stride(inputs["positions"])
    assert strided.stride(-1) != 1 and torch.equal(strided, inputs["positions"])
    want = variant.run(p, inputs, table, backend=backend)
    got = variant.run(p, dict(inputs, positions=strided), table, backend=backend)
    for n, g, w in zip(variant.outputs_of(p), got, want):
        assert torch.equal(g, w), n
