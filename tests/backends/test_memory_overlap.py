"""No tensor a call writes may share memory with anything else the call reads or writes
(issue 23.1, 23.2): the overlap is by address range (two storages over one allocation count as
one memory), across every argument of every declared op, checked before any kernel runs and on
every later call (the fast path); layouts that share a buffer without sharing a byte (column
slices of one row, the key and value halves of one ``[num_blocks, 2, ...]`` cache) still run,
checked against the float64 formulation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fqr
from fqr.numerics import compare_kind
from fqr.prologue import VARIANTS, variant_of
from fqr.validate import overlaps

BACKENDS_HERE = ["reference", "interpret"]


def _bytes_of(t: torch.Tensor) -> set[int]:
    """Every byte address ``t`` covers, by enumeration (the independent formulation)."""
    size, base, covered = t.element_size(), t.data_ptr(), set()
    for index in itertools.product(*(range(n) for n in t.shape)):
        start = base + sum(i * s for i, s in zip(index, t.stride())) * size
        covered.update(range(start, start + size))
    return covered


@st.composite
def _views(draw, buffer: torch.Tensor):
    dims = draw(st.integers(1, 3))
    shape = draw(st.lists(st.integers(1, 5), min_size=dims, max_size=dims))
    strides = draw(st.lists(st.integers(1, 40), min_size=dims, max_size=dims))
    reach = sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    offset = draw(st.integers(0, buffer.numel() - reach))
    return buffer.as_strided(shape, strides, offset)


_BUFFER = torch.zeros(2048)


@settings(max_examples=300, deadline=None)
@given(_views(_BUFFER), _views(_BUFFER))
def test_overlap_never_misses_a_shared_byte(a, b):
    if _bytes_of(a) & _bytes_of(b):
        assert overlaps(a, b) and overlaps(b, a)


def test_overlap_is_exact_on_the_layouts_real_callers_use():
    cache = torch.zeros(4, 2, 3, 5, 6)  # FlashInfer's [num_blocks, 2, block_size, H, D]
    row = torch.zeros(7, 30)  # q | k | v column slices of one row
    head_major = cache.permute(0, 2, 1, 3, 4)[:, :, 0]
    pairs = [
        (cache[:, 0], cache[:, 1]),
        (cache[:, 0, :, 1], cache[:, 0, :, 2]),
        (cache[..., :3], cache[..., 3:]),
        (row[:, :10], row[:, 10:]),
        (row[:, :10], row[1:, 5:]),
        (cache.flatten()[:100], cache.flatten()[99:]),
        (cache.view(torch.int16)[:, 0], cache[:, 1]),
        (cache.view(torch.int16)[:, 0], cache[:, 0]),
        (head_major, cache[:, 1]),
        (head_major, cache[:, 0]),
    ]
    for a, b in pairs:
        shared = bool(_bytes_of(a) & _bytes_of(b))
        assert overlaps(a, b) == shared and overlaps(b, a) == shared, (a.shape, b.shape)


def test_two_storages_over_one_array_are_one_memory():
    array = np.zeros((10, 8), dtype=np.float32)
    a, b = torch.from_numpy(array), torch.from_numpy(array)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert overlaps(a[:, :4], b[:, 2:]) and not overlaps(a[:, :4], b[:, 4:])
    other = torch.from_numpy(np.zeros((10, 8), dtype=np.float32))
    assert not overlaps(a, other)


# ------------------------------------------------------------------- every declared op


def _problem(name: str, gen: torch.Generator):
    """A variant's smallest preset: its inputs (fresh random values), the real RoPE table."""
    preset = next(p for p in fqr.PRESETS.values() if p.variant == name)
    preset = fqr.get_preset(preset.name, 8) if preset.num_heads % 8 == 0 else preset
    variant = variant_of(preset)
    table = preset.cos_sin_cache(min(preset.max_position, 4096))
    inputs = variant.draw(preset, 5, torch.bfloat16, gen, max_position=table.shape[0])
    return preset, variant, inputs, table


def _alias_into(target: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor with ``like``'s dtype, shape, strides and values, placed at the start of
    ``target``'s memory (written over it)."""
    alias = torch.empty(0, dtype=like.dtype).set_(
        target.untyped_storage(), 0, like.shape, like.stride()
    )
    alias.copy_(like)
    return alias


WRITING = [n for n, v in VARIANTS.items() if v.donated]


@pytest.mark.parametrize("backend", BACKENDS_HERE)
@pytest.mark.parametrize("name", WRITING)
def test_a_read_argument_inside_a_written_one_is_refused(gen, name, backend):
    """For every op that writes an argument in place and every other tensor argument that fits
    in the written one's memory: placed there, it is refused by name before anything runs, on
    the first call and on a repeat of a call that passed (the fast path)."""
    preset, variant, inputs, table = _problem(name, gen)
    tried = 0
    for written in sorted(variant.donated & inputs.keys()):
        target = inputs[written]
        for other, x in inputs.items():
            if other == written or not isinstance(x, torch.Tensor) or not x.numel():
                continue
            if x.nbytes > target.untyped_storage().nbytes() or x.stride()[-1:] != (1,):
                continue
            variant.run(preset, inputs, table, backend=backend)  # passes: kept for the fast path
            given = variant.donated & inputs.keys()  # an optional cache may be absent
            hostile = dict(inputs, **{n: inputs[n].clone() for n in given})
            hostile[other] = _alias_into(hostile[written], x)
            before = hostile[written].clone()
            pair = rf"({written} overlaps {other}|{other} overlaps {written}) in memory"
            with pytest.raises(ValueError, match=pair):
                variant.run_in_place(preset, hostile, table, backend=backend)
            assert torch.equal(hostile[written].view(torch.uint8), before.view(torch.uint8))
            tried += 1
    assert tried, f"{name}: no argument fits in a written one"


def _qkv_problem(gen):
    preset = fqr.get_preset("qwen3-0.6b")
    spec = preset.spec
    table = preset.cos_sin_cache(4096)
    width = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    qkv = torch.randn(5, width, generator=gen)  # fp32, the table's dtype
    positions = torch.randint(0, 4096, (5,), generator=gen)
    qw = 1 + 0.1 * torch.randn(spec.head_dim, generator=gen)
    kw = 1 + 0.1 * torch.randn(spec.head_dim, generator=gen)
    kwargs = dict(num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)
    return (qkv, positions, table, qw, kw), kwargs


@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_out_buffers_inside_any_input_are_refused(gen, backend):
    """``out=`` buffers over the table (where later rows would read overwritten values) or over
    qkv through a second storage of the same memory: refused by name, nothing written."""
    (qkv, positions, table, qw, kw), kwargs = _qkv_problem(gen)
    q_w, k_w = kwargs["num_heads"] * 128, kwargs["num_kv_heads"] * 128
    table_rows = table.reshape(-1)[: 5 * (q_w + 2 * k_w)].view(5, -1)
    in_table = (table_rows[:, :q_w], table_rows[:, q_w : q_w + k_w], table_rows[:, q_w + k_w :])
    with pytest.raises(ValueError, match=r"out\[0\] \(q\) overlaps cos_sin_cache in memory"):
        fqr.split_qkv_rmsnorm_rope(
            qkv, positions, table, qw, kw, **kwargs, out=in_table, backend=backend
        )
    array = qkv.numpy().copy()
    floats = torch.from_numpy(array)
    second = torch.from_numpy(array)  # another storage over the same memory
    out = tuple(torch.empty(5, w) for w in (q_w, k_w, k_w))
    with pytest.raises(ValueError, match=r"out\[1\] \(k\) overlaps qkv in memory"):
        fqr.split_qkv_rmsnorm_rope(
            floats,
            positions,
            table,
            qw,
            kw,
            **kwargs,
            out=(out[0], second[:, :k_w], out[2]),
            backend=backend,
        )
    assert torch.equal(floats, qkv)


@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_inplace_with_an_input_inside_qkv_is_refused(gen, backend):
    (qkv, positions, table, qw, kw), kwargs = _qkv_problem(gen)
    weight_in_qkv = qkv.view(-1)[-128:]
    weight_in_qkv.copy_(qw)
    before = qkv.clone()
    with pytest.raises(ValueError, match="qkv overlaps q_weight in memory"):
        fqr.split_qkv_rmsnorm_rope(
            qkv, positions, table, weight_in_qkv, kw, **kwargs, inplace=True, backend=backend
        )
    assert torch.equal(qkv, before)


def _cache_problem(gen):
    preset = next(p for p in fqr.PRESETS.values() if p.variant == "kv-cache")
    variant = variant_of(preset)
    table = preset.cos_sin_cache(4096)
    inputs = variant.draw(preset, 5, torch.bfloat16, gen, max_position=table.shape[0])
    return preset, variant, inputs, table


@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_caches_one_block_apart_in_one_buffer_are_refused(gen, backend):
    preset, variant, inputs, table = _cache_problem(gen)
    key = inputs["key_cache"]
    blocks = key.shape[0]
    buffer = torch.zeros(2 * blocks - 1, *key.shape[1:], dtype=key.dtype)
    hostile = dict(inputs, key_cache=buffer[:blocks], value_cache=buffer[blocks - 1 :])
    with pytest.raises(ValueError, match="key_cache overlaps value_cache in memory"):
        variant.run_in_place(preset, hostile, table, backend=backend)
    assert not buffer.any()


@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_key_and_value_halves_of_one_cache_buffer_run(gen, backend):
    """vLLM's ``[2, num_blocks, ...]`` and FlashInfer's ``[num_blocks, 2, ...]`` single
    buffer: the halves share no byte, so they run, and match the float64 formulation."""
    preset, variant, inputs, table = _cache_problem(gen)
    key = inputs["key_cache"]
    expected = variant.expected(preset, inputs, table)
    for stacked, half in (
        (torch.stack([key, inputs["value_cache"]]), lambda b, i: b[i]),
        (torch.stack([key, inputs["value_cache"]], 1), lambda b, i: b[:, i]),
    ):
        halves = dict(inputs, key_cache=half(stacked, 0), value_cache=half(stacked, 1))
        outs = variant.run_in_place(preset, halves, table, backend=backend)
        for n, o in zip(variant.outputs_of(preset), outs):
            kind, d = variant.tolerance(n, preset), variant.head_dim(preset, n)
            assert compare_kind(kind, o, expected[n], head_dim=d).passed, n
