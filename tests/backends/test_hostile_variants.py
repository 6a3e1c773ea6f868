"""Hostile arguments to every declared op (issue 23): hypothesis draws a variant, one of its
presets, a token count and a dtype, the variant's fresh random inputs and the preset's real
RoPE table; then, in two examples of three, one hostile change to one argument, derived from
the parameter's declaration (a string for a tensor, the wrong dtype, one element short, a meta
tensor; a list, NaN, -1 or an unknown name for a scalar). A hostile call is refused with a
ValueError/TypeError naming that argument before any backend launches, and nothing it would
write (a donated cache, q rotated in place) changes; a valid one meets each output's tolerance
against the float64 formulation (outputs NaN-poisoned before the kernel runs).

Examples per backend: ``FQR_HYPOTHESIS_EXAMPLES`` (default 60: under a minute in CI).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_hostile_args import EXAMPLES, poisoned_outputs_and_counted_launches

import fqr
from fqr.backends import BACKENDS
from fqr.numerics import compare_kind
from fqr.prologue import VARIANTS, presets_of, variant_of
from fqr.prologue.declare import Form, Slots, Static

SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MAX_POSITION = 4096


def _small(name: str):
    """The preset at the largest TP of 8, 4, 2, 1 it splits at (interpreted kernels stay
    small); the variant's name for every preset that runs it."""
    for tp in (8, 4, 2, 1):
        try:
            return fqr.get_preset(name, tp)
        except ValueError:
            continue
    raise AssertionError(f"{name} splits at no TP")


PRESETS_OF = {variant: presets_of(variant) for variant in VARIANTS}


def _tensor_changes(x, param, tokens: int) -> list[tuple[str, object]]:
    """Hostile replacements of a tensor argument ``x`` (None: an absent optional one) of
    ``param``; a slot mapping that may be shorter than T (vLLM's CUDA-graph padding) is made
    one element longer than T instead (padded with -1 from its own length, which the draw may
    already have made shorter than T)."""
    changes: list[tuple[str, object]] = [("a str", "garbage")]
    if not isinstance(x, torch.Tensor):
        return changes
    wrong = torch.float32 if not x.is_floating_point() else torch.int32
    changes.append((f"dtype {wrong}", x.to(wrong)))
    if isinstance(param.kind, Slots) and param.kind.shorter:
        padding = x.new_full((tokens + 1 - x.shape[0],), -1)
        changes.append(("one element longer than T", torch.cat([x, padding])))
    elif x.dim() and x.shape[-1]:
        changes.append(("one element short", x[..., :-1]))
    changes.append(("a meta tensor", x.to("meta")))
    return changes


def _static_changes(value) -> list[tuple[str, object]]:
    changes: list[tuple[str, object]] = [("a list", [value])]
    if isinstance(value, bool) or value is None:
        return changes
    if isinstance(value, int):
        changes.append(("-1", -1))
    elif isinstance(value, float):
        changes.append(("NaN", math.nan))
    elif isinstance(value, str):
        changes.append(("an unknown name", "nope"))
    return changes


@st.composite
def calls(draw):
    name = draw(st.sampled_from(sorted(VARIANTS)))
    preset = _small(draw(st.sampled_from(PRESETS_OF[name])))
    variant = variant_of(preset)
    dtypes = (
        [torch.bfloat16]
        if preset.variant_params and dict(preset.variant_params).get("cache_dtype") == "fp8_ds_mla"
        else [torch.bfloat16, torch.float16, torch.float32]
    )
    dtype = draw(st.sampled_from(dtypes))
    tokens = draw(st.sampled_from([0, 1, 2, 5]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    table = preset.cos_sin_cache(MAX_POSITION)
    inputs = variant.draw(preset, tokens, dtype, gen, max_position=MAX_POSITION)
    change = None
    if draw(st.integers(0, 2)) > 0:
        args = variant.arguments(preset, inputs, table)
        params = [
            p
            for p in variant.declaration.params
            if not isinstance(p, Form) and (not isinstance(p, Static) or p.name in args)
        ]
        param = draw(st.sampled_from(params))
        value = args.get(param.name)
        options = (
            _static_changes(value)
            if isinstance(param, Static)
            else _tensor_changes(value, param, tokens)[: None if param is params[0] else 3]
        )
        what, hostile = draw(st.sampled_from(options))
        change = (param.name, what, hostile)
    return preset, variant, inputs, table, change


def _check(preset, variant, inputs, table, change, backend):
    if change is None:
        expected = variant.expected(preset, inputs, table)
        with poisoned_outputs_and_counted_launches():
            outs = variant.run(preset, inputs, table, backend=backend)
        for n, o in zip(variant.outputs_of(preset), outs):
            kind, d = variant.tolerance(n, preset), variant.head_dim(preset, n)
            c = compare_kind(kind, o, expected[n], head_dim=d)
            assert c.passed, f"{preset.name} {n}: {c}"
        event(f"ran: {variant.name}")
        return
    name, what, hostile = change
    copies = {n: inputs[n].clone() for n in variant.donated if n in inputs}
    args = variant.arguments(preset, dict(inputs, **copies), table, backend=backend)
    args[name] = hostile
    before = {n: c.clone() for n, c in copies.items()}
    with poisoned_outputs_and_counted_launches() as launches:
        with pytest.raises((ValueError, TypeError)) as refused:
            variant.declaration.function(**args)
    assert name in str(refused.value), f"{name} = {what}: {refused.value!r} does not name it"
    assert launches[0] == 0, f"{name} = {what}: refused after a backend launched"
    for n, c in copies.items():
        assert torch.equal(c.view(torch.uint8), before[n].view(torch.uint8)), f"{n} written"
    event(f"refused: {variant.name} {what}")


@pytest.mark.parametrize("backend", ["reference", "interpret"])
@SETTINGS
@given(c=calls())
def test_any_call_of_any_op_is_refused_clearly_or_meets_its_tolerance(backend, c):
    if not BACKENDS[backend].available:
        pytest.skip(BACKENDS[backend].unavailable_reason())
    _check(*c, backend)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
@pytest.mark.parametrize("name", ["minimax-m3-kvcache-fp8", "deepseek-v3-fp8"])
def test_an_fp8_scale_must_be_finite_and_positive(gen, name, bad, backend):
    """A scale of 0, -1, NaN or inf stored ±448, sign-flipped values or NaN rows (issue
    23.8): refused naming it, on the first call and on a repeat of a good one (the fast
    path), with the cache untouched."""
    preset = _small(name)
    variant = variant_of(preset)
    table = preset.cos_sin_cache(MAX_POSITION)
    inputs = variant.draw(preset, 5, torch.bfloat16, gen, max_position=MAX_POSITION)
    scales = sorted(n for n in inputs if n.endswith("_scale"))
    assert scales
    for scale in scales:
        for warm in (False, True):
            if warm:
                variant.run(preset, inputs, table, backend=backend)
            hostile = dict(inputs, **{scale: torch.tensor([bad])})
            donated = [n for n in variant.donated if n in inputs]  # an optional cache: absent
            hostile.update({n: inputs[n].clone() for n in donated})
            before = {n: hostile[n].clone() for n in donated}
            with pytest.raises(ValueError, match=rf"{scale} must be finite and > 0"):
                variant.run_in_place(preset, hostile, table, backend=backend)
            for n in donated:
                assert torch.equal(hostile[n].view(torch.uint8), before[n].view(torch.uint8))
