"""The stand-alone MLA cache insert (``fqr.mla_cache_insert``, vLLM's ``concat_and_cache_mla`` /
``concat_and_cache_ds_mla``): against the float64 formulation on fresh inputs in every cache
flavour (the model dtype, FP8 E4M3 as a float8 tensor or vLLM's uint8 bytes with a ``[1]`` or
0-dim scale, ``fp8_ds_mla`` from bf16 and fp16 rows), vLLM's own torch chain bit for bit, the
cache updated in place and nothing else touched, shorter slot mappings, bad arguments named
before anything runs, ``torch.ops.fqr``."""

from __future__ import annotations

import pytest
import torch

import fqr
from fqr.backends import BACKENDS
from fqr.numerics import compare_kind
from fqr.ops.fp8 import FP8_E4M3
from fqr.presets import get_preset
from fqr.prologue import variant_of

PRESETS = ("deepseek-v3-mla-insert", "deepseek-v3-fp8-mla-insert", "deepseek-v3.2-mla-insert")
BACKEND_NAMES = ["reference"] + (["interpret"] if BACKENDS["interpret"].available else [])
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _case(gen, name, tokens=6, dtype=torch.bfloat16):
    preset = get_preset(name)
    variant = variant_of(preset)
    return preset, variant, variant.draw(preset, tokens, dtype, gen, max_position=1)


def _check(variant, preset, inputs, outs):
    exact = variant.expected(preset, inputs, None)
    (cache,) = outs
    c = compare_kind(
        variant.tolerance("kv_cache", preset),
        cache,
        exact["kv_cache"],
        head_dim=variant.head_dim(preset, "kv_cache"),
    )
    assert c.passed, f"{preset.name}: {c}"


def _stored_entries(before, after) -> set[int]:
    rows, was = after.view(-1, after.shape[-1]), before.view(-1, before.shape[-1])
    changed = (rows.view(torch.uint8) != was.view(torch.uint8)).any(dim=1)
    return set(changed.nonzero().flatten().tolist())


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("name", PRESETS)
def test_against_float64(gen, name, dtype, backend):
    """Every flavour as vLLM allocates it (an FP8 cache as uint8 bytes with a 0-dim scale),
    slots one shorter than T: the entries of the first N tokens' slots hold the float64
    ``[kv_c | k_pe]`` within the contract, no other byte of the cache changes."""
    preset, variant, inputs = _case(gen, name, dtype=DTYPES[dtype])
    before = inputs["kv_cache"].clone()
    outs = variant.run(preset, inputs, None, backend=backend)
    _check(variant, preset, inputs, outs)
    slots = inputs["slot_mapping"]
    assert slots.shape[0] == 5  # T = 6: the last token is a CUDA-graph pad
    assert _stored_entries(before, outs[0]) == set(slots[slots >= 0].tolist())
    assert torch.equal(inputs["kv_cache"], before)  # run() works on a copy


@pytest.mark.parametrize("name", PRESETS)
def test_reference_is_vllms_chain_bit_for_bit(gen, name):
    """The reference backend stores what vLLM's own torch chain of the op stores, bit for bit
    (one rounding of each value either way)."""
    preset, variant, inputs = _case(gen, name, tokens=7)
    (got,) = variant.run(preset, inputs, None, backend="reference")
    mine = dict(inputs, kv_cache=inputs["kv_cache"].clone())
    (want,) = variant.eager(preset, None, torch.bfloat16)(mine)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("scale_shape", [(), (1,)], ids=["0-dim", "[1]"])
@pytest.mark.parametrize("as_bytes", [True, False], ids=["uint8", "float8_e4m3fn"])
def test_fp8_cache_forms_store_the_same_bytes(gen, as_bytes, scale_shape, backend):
    """vLLM's FP8 MLA cache is uint8 and its scale 0-dim (``torch.tensor(0.1)`` in its tests);
    a float8_e4m3fn cache and a ``[1]`` scale are the same call: every form stores the same
    bytes, the caller's cache in place, within one E4M3 ULP of float64."""
    preset, variant, inputs = _case(gen, "deepseek-v3-fp8-mla-insert", tokens=4)
    cache = inputs["kv_cache"] if as_bytes else inputs["kv_cache"].view(FP8_E4M3)
    scale = inputs["scale"].reshape(scale_shape)
    kept = cache.clone()
    args = (inputs["kv_c"], inputs["k_pe"], cache, inputs["slot_mapping"], "fp8", scale)
    assert fqr.mla_cache_insert(*args, backend=backend) is None
    assert cache.dtype == (torch.uint8 if as_bytes else FP8_E4M3)
    _check(variant, preset, dict(inputs, kv_cache=kept.view(torch.uint8)), (cache,))
    reference_cache = kept.clone()
    fqr.mla_cache_insert(*args[:2], reference_cache, *args[3:], backend="reference")
    assert torch.equal(cache.view(torch.uint8), reference_cache.view(torch.uint8))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_a_strided_cache_and_row_views_are_read_and_written_where_they_are(gen, backend):
    """kv_c and k_pe as vLLM has them (views of the kv_a row, rows at a wider stride) and a
    cache whose blocks are a view of a larger buffer: stored where the strides say."""
    preset, variant, inputs = _case(gen, "deepseek-v3-mla-insert", tokens=5)
    row = torch.cat([inputs["kv_c"], inputs["k_pe"], inputs["kv_c"][:, :8]], dim=1)
    kv_c, k_pe = row[:, :512], row[:, 512:576]
    big = torch.randn(inputs["kv_cache"].shape[0], 64, 2, 576, generator=gen).bfloat16()
    cache = big[:, :, 1]  # every entry at a stride of two entries
    before = big.clone()
    expected = variant.expected(preset, dict(inputs, kv_cache=cache), None)["kv_cache"]
    fqr.mla_cache_insert(kv_c, k_pe, cache, inputs["slot_mapping"], backend=backend)
    assert torch.equal(big[:, :, 0], before[:, :, 0])  # the other half untouched
    c = compare_kind("contract", cache, expected, head_dim=64)
    assert c.passed, c


def _args(gen, name):
    preset, variant, inputs = _case(gen, name)
    return preset, variant, variant.arguments(preset, inputs, None, backend="reference")


V3, FP8, DS = PRESETS
F64_SCALE = torch.ones((), dtype=torch.float64)
BAD = [
    ("dtype name", V3, "kv_cache_dtype", dict(kv_cache_dtype="fp4")),
    ("scale on auto, not float32", V3, "scale", dict(scale=torch.ones(1, dtype=torch.float16))),
    ("scale shape", FP8, "scale", dict(scale=torch.ones(2))),
    ("scale dtype", FP8, "scale", dict(scale=F64_SCALE)),
    ("scale zero", FP8, "scale", dict(scale=torch.zeros(()))),
    ("scale on ds_mla, not a tensor", DS, "scale", dict(scale=1.0)),
    ("cache width", V3, "kv_cache", lambda a: dict(kv_cache=a["kv_cache"][..., :-2])),
    ("cache dtype", V3, "kv_cache", lambda a: dict(kv_cache=a["kv_cache"].float())),
    ("fp8 cache as auto", FP8, "kv_cache", dict(kv_cache_dtype="auto", scale=None)),
    ("ds_mla entry", DS, "kv_cache", lambda a: dict(kv_cache=a["kv_cache"][..., :576])),
    ("ds_mla fp32", DS, "kv_c", lambda a: dict(kv_c=a["kv_c"].float(), k_pe=a["k_pe"].float())),
    ("k_pe dtype", V3, "k_pe", lambda a: dict(k_pe=a["k_pe"].half())),
    ("k_pe tokens", V3, "k_pe", lambda a: dict(k_pe=a["k_pe"][:-1])),
    ("slots longer than T", V3, "slot_mapping", lambda a: dict(slot_mapping=torch.arange(7))),
    ("slot past cache", V3, "slot_mapping", lambda a: dict(slot_mapping=a["slot_mapping"] + 10**6)),
]  # fmt: skip


@pytest.mark.parametrize("what,name,argument,change", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_are_named_before_anything_runs(gen, what, name, argument, change):
    preset, variant, args = _args(gen, name)
    cache = args["kv_cache"].clone()
    changed = change(args) if callable(change) else change
    with pytest.raises((ValueError, TypeError)) as info:
        fqr.mla_cache_insert(**dict(args, **changed))
    assert argument in str(info.value), info.value
    assert torch.equal(args["kv_cache"], cache)  # nothing was written


def test_torch_op_is_the_public_op(gen):
    preset, variant, inputs = _case(gen, "deepseek-v3.2-mla-insert", tokens=3)
    op, args = variant.torch_op(preset, inputs, None)
    assert "Tensor(a!) kv_cache" in str(op._schema)
    cache = inputs["kv_cache"]
    before = cache.clone()
    op(*args)
    (expected,) = variant.run(preset, dict(inputs, kv_cache=before), None, backend="reference")
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("name", ["deepseek-v3-mla-insert", "deepseek-v3-fp8-mla-insert"])
def test_two_caches_take_kv_c_and_k_pe_apart(gen, name, backend):
    """FlashInfer's layout: ``kpe_cache`` given, kv_c goes into ``kv_cache [B, bs, 512]`` and
    k_pe into ``kpe_cache [B, bs, 64]`` (an FP8 pair as vLLM-style uint8 bytes with a 0-dim
    scale): the bytes the one-cache call stores in its entry, cut in two."""
    preset, variant, inputs = _case(gen, name, tokens=4)
    one = inputs["kv_cache"]
    kv, kpe = one[..., :512].clone(), one[..., 512:].clone()
    args = dict(variant.arguments(preset, inputs, None), backend=backend)
    fqr.mla_cache_insert(**dict(args, kv_cache=kv, kpe_cache=kpe))
    fqr.mla_cache_insert(**dict(args, backend="reference"))  # the one-cache call, into `one`
    assert torch.equal(kv, one[..., :512]) and torch.equal(kpe, one[..., 512:])
