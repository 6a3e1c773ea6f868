"""MiniMax-M3's public ops (issue 15): split_qkv_index_rmsnorm_rope (indexer heads, FP8 E4M3
outputs) and split_qkv_rmsnorm_rope_cache (the paged KV-cache insert), against the float64
formulation on fresh random inputs and the model's real RoPE table; the unfused mode against
the model's own eager chain; the caches updated in place; argument errors; torch.ops.fqr."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import fqr
from fqr import reference
from fqr.backends import BACKENDS
from fqr.numerics import compare
from fqr.prologue.index_heads import INDEX_HEADS
from fqr.prologue.kv_cache import KV_CACHE

E4M3 = torch.float8_e4m3fn
MAX_POSITION = 1 << 14  # the real table's first rows (the full one is 2^20 rows)
needs_interpreter = pytest.mark.skipif(
    not BACKENDS["interpret"].available, reason=BACKENDS["interpret"].unavailable_reason() or ""
)


def index_preset(attn_fp8: bool, index_fp8: bool, tp: int = 8):
    p = fqr.get_preset("minimax-m3", tp)
    params = (("index_head_dim", 128), ("attn_fp8", attn_fp8), ("index_fp8", index_fp8))
    return replace(p, variant_params=params)


def draw(variant, preset, gen, tokens):
    inputs = variant.draw(preset, tokens, torch.bfloat16, gen, max_position=MAX_POSITION)
    return inputs, preset.cos_sin_cache(MAX_POSITION)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[x.element_size()])


@pytest.mark.parametrize("attn_fp8, index_fp8", [(False, False), (True, False), (False, True)])
def test_index_heads_against_float64(gen, attn_fp8, index_fp8):
    preset = index_preset(attn_fp8, index_fp8)
    inputs, table = draw(INDEX_HEADS, preset, gen, 9)
    outs = INDEX_HEADS.run(preset, inputs, table, backend="reference")
    weights = [inputs[n] for n in ("q_weight", "k_weight", "index_q_weight", "index_k_weight")]
    exact = reference.index_prologue(
        inputs["qkv"],
        inputs["positions"],
        table,
        *weights,
        num_heads=8,
        num_kv_heads=1,
        head_dim=128,
        num_index_heads=1,
        index_head_dim=128,
        eps=1e-6,
        weight_offset=1.0,
    )
    for name, out, e in zip(INDEX_HEADS.outputs, outs, exact):
        fp8 = attn_fp8 if name in ("q", "k", "v") else index_fp8
        assert out.dtype == (E4M3 if fp8 else torch.bfloat16), name
        c = compare(out, reference.saturate_fp8(e) if fp8 else e, head_dim=128)
        assert c.passed, f"{name}: {c}"
    v = outs[2].float()
    v_in = inputs["qkv"][:, 1152:1280]  # v: after q (8 x 128) and k (128).float()
    if attn_fp8:  # the outliers past +-448 saturate, the rest is the E4M3 of the input
        assert torch.equal(v, v_in.clamp(-448, 448).to(E4M3).float())
        assert v.abs().max() == 448
    else:
        assert torch.equal(v, v_in)


def test_index_heads_unfused_is_the_model_chain(gen):
    preset = index_preset(False, False, tp=4)
    inputs, table = draw(INDEX_HEADS, preset, gen, 7)
    fused = INDEX_HEADS.run(preset, inputs, table, backend="reference")
    unfused = INDEX_HEADS.run(preset, inputs, table, numerics="unfused", backend="reference")
    eager = INDEX_HEADS.eager(preset, table, torch.bfloat16)(inputs)
    exact = INDEX_HEADS.expected(preset, inputs, table)
    for name, u, e, f in zip(INDEX_HEADS.outputs, unfused, eager, fused):
        assert torch.equal(bits(u), bits(e)), name  # rounds where vLLM's chain rounds
        d = INDEX_HEADS.head_dim(preset, name)
        assert compare(e, exact[name], head_dim=d, numerics="unfused").passed, name
        if name != "v":  # the fused op rounds once: not the chain's bits
            assert not torch.equal(bits(f), bits(u)), name


def test_index_heads_fp8_unfused_is_the_model_chain(gen):
    preset = index_preset(True, True)
    inputs, table = draw(INDEX_HEADS, preset, gen, 5)
    eager = INDEX_HEADS.eager(preset, table, torch.bfloat16)(inputs)
    unfused = INDEX_HEADS.run(preset, inputs, table, numerics="unfused", backend="reference")
    for name, e, u in zip(INDEX_HEADS.outputs, eager, unfused):
        assert e.dtype == E4M3 and torch.equal(bits(e), bits(u)), name


def cache_preset(cache_dtype: str):
    p = fqr.get_preset("minimax-m3-kvcache", 8)
    return replace(p, variant_params=(("block_size", 128), ("cache_dtype", cache_dtype)))


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8e4m3"])
def test_cache_insert_updates_the_callers_caches_in_place(gen, cache_dtype):
    preset = cache_preset(cache_dtype)
    inputs, table = draw(KV_CACHE, preset, gen, 11)
    slots = inputs["slot_mapping"]
    assert (slots < 0).any() and (slots >= 0).any()
    key_cache, value_cache = inputs["key_cache"], inputs["value_cache"]
    before = key_cache.clone(), value_cache.clone()
    pointers = key_cache.data_ptr(), value_cache.data_ptr()
    q = fqr.split_qkv_rmsnorm_rope_cache(
        inputs["qkv"],
        inputs["positions"],
        table,
        inputs["q_weight"],
        inputs["k_weight"],
        key_cache,
        value_cache,
        slots,
        num_heads=8,
        num_kv_heads=1,
        head_dim=128,
        weight_offset=1.0,
        k_scale=inputs.get("k_scale"),
        v_scale=inputs.get("v_scale"),
        backend="reference",
    )
    assert (key_cache.data_ptr(), value_cache.data_ptr()) == pointers
    exact = KV_CACHE.expected(preset, inputs, table)
    assert compare(q, exact["q"], head_dim=128).passed
    _, written = reference.cache_insert(before[0], exact["q"][:, :128], slots)
    assert int(written.sum()) == int((slots >= 0).sum())
    for name, cache, old in zip(("key_cache", "value_cache"), (key_cache, value_cache), before):
        c = compare(cache, exact[name], head_dim=128)
        assert c.passed, f"{name}: {c}"
        assert torch.equal(bits(cache)[~written], bits(old)[~written]), name
        assert not torch.equal(bits(cache)[written], bits(old)[written]), name


def test_cache_insert_unfused_is_the_model_chain(gen):
    preset = cache_preset("fp8e4m3")
    inputs, table = draw(KV_CACHE, preset, gen, 7)
    unfused = KV_CACHE.run(preset, inputs, table, numerics="unfused", backend="reference")
    copies = dict(inputs, key_cache=inputs["key_cache"].clone())
    copies["value_cache"] = inputs["value_cache"].clone()
    eager = KV_CACHE.eager(preset, table, torch.bfloat16)(copies)
    for name, u, e in zip(KV_CACHE.outputs, unfused, eager):
        assert torch.equal(bits(u), bits(e)), name


@needs_interpreter
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8e4m3"])
def test_cache_insert_kernel_donates_the_caches(gen, cache_dtype):
    preset = cache_preset(cache_dtype)
    inputs, table = draw(KV_CACHE, preset, gen, 4)
    exact = KV_CACHE.expected(preset, inputs, table)
    key_cache, value_cache = inputs["key_cache"], inputs["value_cache"]
    pointer = key_cache.data_ptr()
    q = fqr.split_qkv_rmsnorm_rope_cache(
        inputs["qkv"],
        inputs["positions"],
        table,
        inputs["q_weight"],
        inputs["k_weight"],
        key_cache,
        value_cache,
        inputs["slot_mapping"],
        num_heads=8,
        num_kv_heads=1,
        head_dim=128,
        weight_offset=1.0,
        k_scale=inputs.get("k_scale"),
        v_scale=inputs.get("v_scale"),
        backend="interpret",
    )
    assert key_cache.data_ptr() == pointer
    assert compare(q, exact["q"], head_dim=128).passed
    assert compare(key_cache, exact["key_cache"], head_dim=128).passed
    assert compare(value_cache, exact["value_cache"], head_dim=128).passed


def cache_call(inputs, table, **overrides):
    kwargs = dict(
        num_heads=8,
        num_kv_heads=1,
        head_dim=128,
        weight_offset=1.0,
        k_scale=inputs.get("k_scale"),
        v_scale=inputs.get("v_scale"),
        backend="reference",
    )
    args = dict(
        qkv=inputs["qkv"],
        positions=inputs["positions"],
        cos_sin_cache=table,
        q_weight=inputs["q_weight"],
        k_weight=inputs["k_weight"],
        key_cache=inputs["key_cache"],
        value_cache=inputs["value_cache"],
        slot_mapping=inputs["slot_mapping"],
    )
    for k, v in overrides.items():
        (args if k in args else kwargs)[k] = v
    return fqr.split_qkv_rmsnorm_rope_cache(**args, **kwargs)


def test_cache_insert_argument_errors_name_the_argument(gen):
    preset = cache_preset("auto")
    inputs, table = draw(KV_CACHE, preset, gen, 5)
    kc = inputs["key_cache"]
    rows = kc.shape[0] * kc.shape[1]
    cases = [
        ({"key_cache": kc[..., :64]}, ValueError, "key_cache must be"),
        ({"value_cache": inputs["value_cache"].to(E4M3)}, ValueError, "value_cache"),
        ({"value_cache": kc}, ValueError, "key_cache overlaps value_cache in memory"),
        ({"k_scale": torch.ones(2)}, ValueError, "k_scale must be a float32 tensor of shape"),
        ({"slot_mapping": inputs["slot_mapping"].float()}, TypeError, "slot_mapping"),
        ({"slot_mapping": inputs["slot_mapping"].repeat(2)}, ValueError, "slot_mapping must be"),
        ({"slot_mapping": torch.full((5,), rows)}, ValueError, "slot_mapping names slot"),
        ({"key_cache": kc.to(torch.float16)}, TypeError, "key_cache must be"),
    ]
    before = kc.clone()
    for overrides, error, message in cases:
        with pytest.raises(error, match=message):
            cache_call(inputs, table, **overrides)
    assert torch.equal(kc, before)  # nothing ran
    cache_call(inputs, table)  # checked once: the next call takes the per-call path
    for overrides, message in (
        ({"slot_mapping": torch.tensor([0, 1, 2, 3, rows])}, "slot_mapping names slot"),
        ({"value_cache": kc}, "key_cache overlaps value_cache in memory"),
        ({"positions": torch.full((5,), 1 << 20)}, "positions"),
    ):
        with pytest.raises(ValueError, match=message):
            cache_call(inputs, table, **overrides)


def test_index_heads_argument_errors_name_the_argument(gen):
    preset = index_preset(False, False)
    inputs, table = draw(INDEX_HEADS, preset, gen, 3)

    def call(**overrides):
        args = dict(inputs, cos_sin_cache=table)
        kwargs = dict(num_heads=8, num_kv_heads=1, head_dim=128, num_index_heads=1)
        kwargs.update(index_head_dim=128, backend="reference")
        for k, v in overrides.items():
            (args if k in args else kwargs)[k] = v
        return fqr.split_qkv_index_rmsnorm_rope(**args, **kwargs)

    with pytest.raises(ValueError, match="qkv width"):
        call(num_index_heads=2)
    with pytest.raises(ValueError, match="index_q_weight must be"):
        call(index_q_weight=inputs["index_q_weight"][:64])
    with pytest.raises(TypeError, match="attn_fp8 must be a bool"):
        call(attn_fp8=1)
    with pytest.raises(ValueError, match="index_head_dim"):
        call(index_head_dim=0)


def test_torch_ops_registrations(gen):
    preset = cache_preset("auto")
    inputs, table = draw(KV_CACHE, preset, gen, 3)
    expected = KV_CACHE.run(preset, inputs, table, backend="reference")
    schema = str(torch.ops.fqr.split_qkv_rmsnorm_rope_cache.default._schema)
    assert "Tensor(a!) key_cache" in schema and "Tensor(b!) value_cache" in schema
    q, no_k = torch.ops.fqr.split_qkv_rmsnorm_rope_cache(
        inputs["qkv"],
        inputs["positions"],
        table,
        inputs["q_weight"],
        inputs["k_weight"],
        inputs["key_cache"],
        inputs["value_cache"],
        inputs["slot_mapping"],
        None,
        None,
        8,
        1,
        128,
        1e-6,
        True,
        1.0,
        "fused",
    )
    # the op returns (q, k); k is [T, 0] unless return_k (a mutating op returns plain tensors)
    assert no_k.shape == (3, 0)
    for got, want in zip((q, inputs["key_cache"], inputs["value_cache"]), expected):
        assert torch.equal(got, want)
    preset = index_preset(True, False)
    inputs, table = draw(INDEX_HEADS, preset, gen, 3)
    want = INDEX_HEADS.run(preset, inputs, table, backend="reference")
    got = torch.ops.fqr.split_qkv_index_rmsnorm_rope(
        *(inputs[n] for n in ("qkv", "positions")),
        table,
        *(inputs[n] for n in ("q_weight", "k_weight", "index_q_weight", "index_k_weight")),
        None,  # q_bias
        None,  # k_bias
        8,
        1,
        128,
        1,
        128,
        1e-6,
        True,
        1.0,
        True,
        False,
        "fused",
    )
    assert [g.dtype for g in got] == [E4M3] * 3 + [torch.bfloat16] * 2
    assert all(torch.equal(bits(g), bits(w)) for g, w in zip(got, want))


# ------------------------------------------------ cache layouts (issue 23, finding 2)
# "Any strides with a contiguous last dim": a head-major cache, one whose blocks are strided
# apart or whose heads are a slice of a wider buffer is written where its strides say, on every
# backend. A cache whose elements share memory (expanded: stride 0, or an as_strided view) is
# refused naming the argument before any backend runs: the reference raised a deep torch error
# after writing key_cache, the interpreter wrote it silently.

BACKEND_NAMES = ["reference"] + (["interpret"] if BACKENDS["interpret"].available else [])


def relayout(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """``cache``'s values in a fresh buffer of another memory layout (same shape)."""
    nb, bs, h, d = cache.shape
    if layout == "head-major":  # [nb, H, bs, D] viewed as [nb, bs, H, D]
        buf = torch.empty(nb, h, bs, d, dtype=cache.dtype).permute(0, 2, 1, 3)
    elif layout == "block-strided":  # [bs, nb, H, D] viewed as [nb, bs, H, D]
        buf = torch.empty(bs, nb, h, d, dtype=cache.dtype).permute(1, 0, 2, 3)
    else:  # "padded": the heads of a wider buffer, one block of padding in front
        buf = torch.empty(nb + 1, bs, h + 3, d, dtype=cache.dtype)[1:, :, 1 : h + 1]
    buf.copy_(cache)
    assert not buf.is_contiguous()
    return buf


def overlapping(cache: torch.Tensor, how: str) -> torch.Tensor:
    """A cache of ``cache``'s shape whose elements share memory, holding ``cache``'s values
    where it can."""
    nb, bs, h, d = cache.shape
    if how == "expanded":  # every block is block 0
        return cache[:1].clone().expand(nb, bs, h, d)
    # as_strided: consecutive rows half a row apart
    buf = cache.clone().reshape(-1)
    return buf.as_strided((nb, bs, h, d), (bs * h * d // 2, h * d // 2, d, 1))


def cache_problem(gen, cache_dtype: str, tokens: int = 9):
    preset = replace(
        fqr.get_preset("minimax-m3-kvcache", 2),
        variant_params=(("block_size", 16), ("cache_dtype", cache_dtype)),
    )
    inputs, table = draw(KV_CACHE, preset, gen, tokens)
    assert preset.spec.num_kv_heads == 2
    return preset, inputs, table


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8e4m3"])
@pytest.mark.parametrize("layout", ["head-major", "block-strided", "padded"])
def test_a_strided_cache_is_written_where_its_strides_say(gen, layout, cache_dtype, backend):
    preset, inputs, table = cache_problem(gen, cache_dtype)
    exact = KV_CACHE.expected(preset, inputs, table)  # float64, from the contiguous caches
    caches = {n: relayout(inputs[n], layout) for n in ("key_cache", "value_cache")}
    before = {n: c.clone() for n, c in caches.items()}
    slots = inputs["slot_mapping"]
    q = cache_call(inputs, table, **caches, **preset.spec.head_kwargs(), backend=backend)
    assert compare(q, exact["q"], head_dim=128).passed
    _, written = reference.cache_insert(before["key_cache"], exact["q"][:, :256], slots)
    assert int(written.sum()) == int((slots >= 0).sum()) > 0
    for name, cache in caches.items():
        c = compare(cache, exact[name], head_dim=128)
        assert c.passed, f"{layout} {name}: {c}"
        assert torch.equal(bits(cache)[~written], bits(before[name])[~written]), name


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("how", ["expanded", "as_strided"])
@pytest.mark.parametrize("name", ["key_cache", "value_cache"])
def test_a_cache_whose_elements_share_memory_is_refused(gen, name, how, backend):
    preset, inputs, table = cache_problem(gen, "auto")
    kwargs = dict(preset.spec.head_kwargs(), backend=backend)
    cache_call(inputs, table, **kwargs)  # a good call first: the next is not its fast path
    bad = overlapping(inputs[name], how)
    caches = {n: bad if n == name else inputs[n] for n in ("key_cache", "value_cache")}
    before = {n: c.clone() for n, c in caches.items()}
    with pytest.raises(ValueError, match=rf"^{name} overlaps itself"):
        cache_call(inputs, table, **caches, **kwargs)
    for n, c in caches.items():
        assert torch.equal(bits(c), bits(before[n])), f"{n} was written"


@pytest.mark.parametrize(
    "backend", ["reference", pytest.param("interpret", marks=needs_interpreter)]
)
@pytest.mark.parametrize(
    "head_dim, index_head_dim, is_neox", [(64, 48, True), (32, 64, False), (64, 32, False)]
)
def test_each_head_group_rotates_the_tables_first_frequencies(
    gen, backend, head_dim, index_head_dim, is_neox
):
    """A 64-wide table over groups of other widths (issue 26 item 2): each group rotates min(R,
    its head_dim) features by the table's first frequencies (vllm-ascend's indexer), the main
    heads or the index heads the narrower; checked against the float64 reference."""
    hq, hkv, hi, t, rows = 4, 2, 2, 5, 1 << 12
    d, di = head_dim, index_head_dim
    qkv = torch.randn(t, (hq + 2 * hkv) * d + (hi + 1) * di, generator=gen).bfloat16()
    positions = torch.randint(0, rows, (t,), generator=gen)
    table = fqr.rope_cos_sin_cache(64, rows, 5e6)
    weights = [(0.2 * torch.randn(n, generator=gen)).bfloat16() for n in (d, d, di, di)]
    statics = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, num_index_heads=hi)
    statics.update(index_head_dim=di, eps=1e-6, is_neox=is_neox)
    exact = reference.index_prologue(qkv, positions, table, *weights, **statics)
    outs = fqr.split_qkv_index_rmsnorm_rope(
        qkv, positions, table, *weights, **statics, backend=backend
    )
    for name, out, e in zip(("q", "k", "v", "index_q", "index_k"), outs, exact):
        c = compare(out, e, head_dim=d if name in ("q", "k", "v") else di)
        assert c.passed, f"{name}: {c}"
    wider = r"cos_sin_cache width .*96 exceeds max\(head_dim, index_head_dim\) 64"
    with pytest.raises(ValueError, match=wider):
        wide = fqr.rope_cos_sin_cache(96, rows, 5e6)
        fqr.split_qkv_index_rmsnorm_rope(qkv, positions, wide, *weights, **statics)


def test_the_fast_paths_write_check_sees_caches_that_share_memory(gen):
    """A repeat call (its kept call's straight-line entry compares the written caches' byte
    spans with every other argument's) refuses a value cache that is another view of the key
    cache's memory, as the full checks do, and runs the halves of one buffer, whether apart
    (spans apart) or interleaved (spans meet: the exact check decides)."""
    preset = cache_preset("auto")
    inputs, table = draw(KV_CACHE, preset, gen, 5)
    kc, vc = inputs["key_cache"], inputs["value_cache"]
    cache_call(inputs, table)  # checked and kept: the next calls take the fast path
    with pytest.raises(ValueError, match="key_cache overlaps value_cache in memory"):
        cache_call(inputs, table, value_cache=kc[:])
    with pytest.raises(ValueError, match="key_cache overlaps value_cache in memory"):
        cache_call(inputs, table, value_cache=kc.view(torch.int16).view(kc.dtype))
    want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
    cache_call(inputs, table, key_cache=want_k, value_cache=want_v)
    halves = torch.zeros(2, *kc.shape, dtype=kc.dtype)
    interleaved = torch.zeros(kc.shape[0], 2, *kc.shape[1:], dtype=kc.dtype)
    for key_cache, value_cache in ((halves[0], halves[1]), (interleaved[:, 0], interleaved[:, 1])):
        for _ in range(2):  # the full checks, then the fast path
            key_cache.zero_(), value_cache.zero_()
            cache_call(inputs, table, key_cache=key_cache, value_cache=value_cache)
            assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)
