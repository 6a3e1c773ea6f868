"""The MLA KV prologue (``fqr.split_mla_rmsnorm_rope_cache``, DeepSeek-V3/V3.2, Kimi-K2,
DeepSeek-V2-Lite): against the float64 formulation on fresh inputs and the real YaRN tables in
every cache flavour, unfused bit for bit with vLLM's own chain, the cache updated in place,
bad arguments named, ``torch.ops.fqr``."""

from __future__ import annotations

import pytest
import torch

import fqr
from fqr.backends import BACKENDS
from fqr.numerics import compare_kind
from fqr.presets import get_preset
from fqr.prologue import checked_calls, forget_checked_calls, variant_of
from fqr.prologue.mla_kv import MLA_KV, SPLIT_MLA_RMSNORM_ROPE_CACHE

PRESETS = ("deepseek-v3", "deepseek-v3-fp8", "deepseek-v3.2", "kimi-k2", "deepseek-v2-lite")
MAX_POSITION = 1 << 16
BACKEND_NAMES = ["reference"] + (["interpret"] if BACKENDS["interpret"].available else [])


def _case(gen, name, tokens=6, tp=8, dtype=torch.bfloat16):
    preset = get_preset(name, tp)
    variant = variant_of(preset)
    table = preset.cos_sin_cache(MAX_POSITION)
    inputs = variant.draw(preset, tokens, dtype, gen, max_position=MAX_POSITION)
    return preset, variant, table, inputs


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("name", PRESETS)
def test_against_float64(gen, name, backend):
    preset, variant, table, inputs = _case(gen, name)
    before = inputs["kv_cache"].clone()
    exact = variant.expected(preset, inputs, table)
    outs = variant.run(preset, inputs, table, backend=backend)
    names = variant.outputs_of(preset)
    assert len(outs) == len(names) and ("q_c" in names) == (preset.params["q_lora_rank"] > 0)
    for n, out in zip(names, outs):
        c = compare_kind(
            variant.tolerance(n, preset), out, exact[n], head_dim=variant.head_dim(preset, n)
        )
        assert c.passed, f"{name} {n}: {c}"
    assert torch.equal(inputs["kv_cache"], before)  # run() works on a copy


@pytest.mark.parametrize("name", PRESETS)
def test_unfused_is_vllms_chain_bit_for_bit(gen, name):
    """numerics="unfused" on the reference backend equals vLLM's own unfused chain
    (q_a_layernorm / kv_a_layernorm, rotary_emb, concat_and_cache_mla / _ds_mla) bit for
    bit, the cache included."""
    preset, variant, table, inputs = _case(gen, name, tokens=7, tp=1)
    got = variant.run(preset, inputs, table, numerics="unfused", backend="reference")
    mine = dict(inputs, kv_cache=inputs["kv_cache"].clone())
    want = variant.eager(preset, table, torch.bfloat16)(mine)
    for n, a, b in zip(variant.outputs_of(preset), got, want):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), n


def test_cache_updated_in_place_and_other_entries_untouched(gen):
    """The public op writes the caller's cache (vLLM's in-place cache ops): the entries of the
    stored slots change, every other byte stays; padding slots store nothing."""
    preset, variant, table, inputs = _case(gen, "deepseek-v3.2", tokens=9)
    cache = inputs["kv_cache"]
    before = cache.clone()
    args = variant.arguments(preset, inputs, table, backend="reference")
    q_c, kv_c, k_pe = fqr.split_mla_rmsnorm_rope_cache(**args)
    assert q_c.shape == (9, 1536) and kv_c.shape == (9, 512) and k_pe.shape == (9, 64)
    slots = inputs["slot_mapping"]
    rows, was = cache.view(-1, 656), before.view(-1, 656)
    stored = slots[slots >= 0]
    assert (rows[stored] != was[stored]).any(dim=1).all()
    untouched = torch.ones(rows.shape[0], dtype=torch.bool)
    untouched[stored] = False
    assert torch.equal(rows[untouched], was[untouched])
    # the rope part of a stored entry is k_pe's bf16 bits
    t = int((slots >= 0).nonzero()[0])
    assert torch.equal(rows[slots[t], 528:].view(torch.bfloat16), k_pe[t])


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v3-fp8", "deepseek-v3.2"])
def test_a_shorter_slot_mapping_stores_only_its_tokens(gen, name, backend):
    """``slot_mapping [N < T]`` (vLLM pads a CUDA-graph batch to T and its cache kernels store
    ``slot_mapping.size(0)`` tokens): the first N tokens' entries are written, tokens ``t >=
    N`` write nothing (not even where their slot would have been), every output still has T
    rows, all against float64 (the cache flavours: model dtype, FP8, fp8_ds_mla)."""
    preset, variant, table, inputs = _case(gen, name, tokens=5)
    full = inputs["slot_mapping"]  # [5]: token 1 and 4 padding, tokens 0, 2, 3 a slot each
    assert bool(full[3] >= 0)  # token 3's slot is past N: nothing may be stored there
    inputs["slot_mapping"] = full[:3]
    before = inputs["kv_cache"].clone()
    exact = variant.expected(preset, inputs, table)
    outs = variant.run(preset, inputs, table, backend=backend)
    for n, out in zip(variant.outputs_of(preset), outs):
        c = compare_kind(
            variant.tolerance(n, preset), out, exact[n], head_dim=variant.head_dim(preset, n)
        )
        assert c.passed, f"{name} {n}: {c}"
    cache = outs[-1]
    rows, was = cache.view(-1, cache.shape[-1]), before.view(-1, before.shape[-1])
    changed = (rows.view(torch.uint8) != was.view(torch.uint8)).any(dim=1)
    stored = full[:3][full[:3] >= 0]
    assert set(changed.nonzero().flatten().tolist()) == set(stored.tolist())
    assert outs[0].shape[0] == 5  # q_c (and kv_c, k_pe) of every token


def test_without_q_lora_rank_q_c_is_none(gen):
    preset, variant, table, inputs = _case(gen, "deepseek-v2-lite")
    args = variant.arguments(preset, inputs, table, backend="reference")
    q_c, kv_c, k_pe = fqr.split_mla_rmsnorm_rope_cache(**args)
    assert q_c is None and kv_c.shape[1] == 512 and k_pe.shape[1] == 64


BAD = [
    ("kv_a width", "kv_a width", lambda a: dict(a, kv_a=a["kv_a"][:, :-64])),
    ("q_a_weight missing", "q_a_weight", lambda a: dict(a, q_a_weight=None)),
    ("q_a_weight length", "q_a_weight", lambda a: dict(a, q_a_weight=a["q_a_weight"][:-2])),
    ("kv_a_weight length", "kv_a_weight", lambda a: dict(a, kv_a_weight=a["kv_a_weight"][:8])),
    ("cache entry", "kv_cache", lambda a: dict(a, kv_cache=a["kv_cache"][..., :-1])),
    ("cache dtype", "kv_cache", lambda a: dict(a, kv_cache=a["kv_cache"].float())),
    ("scale of the wrong form", "k_scale", lambda a: dict(a, k_scale=torch.ones(2))),
    ("table width", "cos_sin_cache", lambda a: dict(a, cos_sin_cache=a["cos_sin_cache"][:, :32])),
    ("q_lora_rank", "q_lora_rank", lambda a: dict(a, q_lora_rank=-1)),
    ("kv_lora_rank", "kv_lora_rank", lambda a: dict(a, kv_lora_rank=0)),
    (
        "slots longer than T",
        "slot_mapping",
        lambda a: dict(a, slot_mapping=torch.cat([a["slot_mapping"], a["slot_mapping"][:1]])),
    ),
    ("slot past cache", "slot_mapping", lambda a: dict(a, slot_mapping=a["slot_mapping"] + 10**6)),
    ("positions", "positions", lambda a: dict(a, positions=a["positions"].float())),
]


@pytest.mark.parametrize("what,argument,override", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_are_named_before_anything_runs(gen, what, argument, override):
    preset, variant, table, inputs = _case(gen, "deepseek-v3")
    args = variant.arguments(preset, inputs, table, backend="reference")
    cache = inputs["kv_cache"].clone()
    with pytest.raises((ValueError, TypeError)) as info:
        fqr.split_mla_rmsnorm_rope_cache(**override(args))
    assert argument in str(info.value), info.value
    assert torch.equal(inputs["kv_cache"], cache)  # nothing was written


def test_fp8_ds_mla_needs_16_bit_rows(gen):
    preset, variant, table, inputs = _case(gen, "deepseek-v3.2")
    args = variant.arguments(preset, inputs, table, backend="reference")
    with pytest.raises(TypeError, match="kv_a must be bf16 or fp16, got fp32"):
        fqr.split_mla_rmsnorm_rope_cache(**dict(args, kv_a=args["kv_a"].float()))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_fp8_ds_mla_with_fp16_rows_stores_fp16_rope(gen, backend):
    """vLLM's host check for ``fp8_ds_mla`` takes any 2-byte kv_c / k_pe: fp16 rows store
    their rope part as fp16 (the entry's last 128 bytes are k_pe's fp16 bits); every output
    against float64."""
    preset, variant, table, inputs = _case(gen, "deepseek-v3.2", dtype=torch.float16)
    exact = variant.expected(preset, inputs, table)
    outs = variant.run(preset, inputs, table, backend=backend)
    for n, out in zip(variant.outputs_of(preset), outs):
        c = compare_kind(
            variant.tolerance(n, preset), out, exact[n], head_dim=variant.head_dim(preset, n)
        )
        assert c.passed, f"{n}: {c}"
    q_c, kv_c, k_pe, cache = outs
    assert k_pe.dtype == torch.float16
    slots = inputs["slot_mapping"]
    t = int((slots >= 0).nonzero()[0])
    assert torch.equal(cache.view(-1, 656)[slots[t], 528:].view(torch.float16), k_pe[t])


def test_new_token_counts_take_the_kept_call(gen):
    forget_checked_calls()
    for tokens in (3, 11, 5):
        preset, variant, table, inputs = _case(gen, "deepseek-v3-fp8", tokens=tokens)
        variant.run_in_place(preset, inputs, table, backend="reference")
    assert len(checked_calls(SPLIT_MLA_RMSNORM_ROPE_CACHE)) == 1


def test_torch_op_is_the_public_op_and_traces_symbolically(gen):
    preset, variant, table, inputs = _case(gen, "deepseek-v3")
    op, args = variant.torch_op(preset, inputs, table)
    schema = str(op._schema)
    assert "Tensor(a!) kv_cache" in schema and schema.endswith("-> (Tensor, Tensor, Tensor)")
    cache = inputs["kv_cache"]
    want_cache = cache.clone()
    want = variant.run_in_place(preset, dict(inputs, kv_cache=want_cache), table)
    got = op(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, want[:3]))
    assert torch.equal(cache, want_cache)  # the op updated the cache it was given
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        shapes = [tuple(o.shape) for o in op(*fake)]
    assert shapes == [tuple(o.shape) for o in want[:3]]


def test_golden_cases_cover_every_flavour():
    flavours = {get_preset(c.preset).params["cache_dtype"] for c in MLA_KV.golden}
    assert flavours == {"auto", "fp8", "fp8_ds_mla"}
    assert {get_preset(c.preset).params["q_lora_rank"] > 0 for c in MLA_KV.golden} == {
        True,
        False,
    }


# ------------------------------------------------ cache layouts (issue 23, finding 2)
# The MLA entry cache, in every flavour (the model dtype, FP8 E4M3, the uint8 fp8_ds_mla
# entry), at any strides with a contiguous entry: written where its strides say on every
# backend; one whose elements share memory is refused naming kv_cache before anything runs.


def relayout(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """``cache``'s values in a fresh buffer of another memory layout (same shape)."""
    nb, bs, width = cache.shape
    if layout == "block-strided":  # [bs, nb, entry] viewed as [nb, bs, entry]
        buf = torch.empty(bs, nb, width, dtype=cache.dtype).permute(1, 0, 2)
    else:  # "padded": entries of a wider row, one block of padding in front
        buf = torch.empty(nb + 1, bs, width + 32, dtype=cache.dtype)[1:, :, 16 : 16 + width]
    buf.copy_(cache)
    assert not buf.is_contiguous()
    return buf


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("layout", ["block-strided", "padded"])
@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v3-fp8", "deepseek-v3.2"])
def test_a_strided_cache_is_written_where_its_strides_say(gen, name, layout, backend):
    preset, variant, table, inputs = _case(gen, name, tokens=70)  # 70 tokens: several blocks
    assert inputs["kv_cache"].shape[0] > 1
    exact = variant.expected(preset, inputs, table)  # float64, from the contiguous cache
    cache = relayout(inputs["kv_cache"], layout)
    before = cache.clone()
    args = variant.arguments(preset, dict(inputs, kv_cache=cache), table, backend=backend)
    outs = fqr.split_mla_rmsnorm_rope_cache(**args)
    got = dict(zip(("q_c", "kv_c", "k_pe"), outs), kv_cache=cache.contiguous())
    for n in variant.outputs_of(preset):
        c = compare_kind(
            variant.tolerance(n, preset), got[n], exact[n], head_dim=variant.head_dim(preset, n)
        )
        assert c.passed, f"{name} {layout} {n}: {c}"
    slots = inputs["slot_mapping"]
    rows, was = cache.reshape(-1, cache.shape[-1]), before.reshape(-1, cache.shape[-1])
    untouched = torch.ones(rows.shape[0], dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(rows[untouched].view(torch.uint8), was[untouched].view(torch.uint8))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("how", ["expanded", "as_strided"])
@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v3.2"])
def test_a_cache_whose_elements_share_memory_is_refused(gen, name, how, backend):
    preset, variant, table, inputs = _case(gen, name, tokens=70)
    nb, bs, width = inputs["kv_cache"].shape
    if how == "expanded":  # every block is block 0
        bad = inputs["kv_cache"][:1].clone().expand(nb, bs, width)
    else:  # consecutive entries half an entry apart
        flat = inputs["kv_cache"].clone().reshape(-1)
        bad = flat.as_strided((nb, bs, width), (bs * width // 2, width // 2, 1))
    variant.run_in_place(preset, dict(inputs), table, backend=backend)  # a good call first
    before = bad.clone()
    args = variant.arguments(preset, dict(inputs, kv_cache=bad), table, backend=backend)
    with pytest.raises(ValueError, match=r"^kv_cache overlaps itself"):
        fqr.split_mla_rmsnorm_rope_cache(**args)
    assert torch.equal(bad.view(torch.uint8), before.view(torch.uint8))  # nothing was written


# ------------------------------------------------------------- FP8 q_c (quant_scale_q)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_fp8_q_c_against_float64(gen, backend):
    """quant_scale_q given: q_c comes back as float8_e4m3fn, ``e4m3(clamp(q_c * scale))``
    within one E4M3 ULP of float64 (some values saturate), the rest as without it."""
    preset = get_preset("deepseek-v3.2-fp8-q", 8)
    variant = variant_of(preset)
    table = preset.cos_sin_cache(MAX_POSITION)
    inputs = variant.draw(preset, 5, torch.bfloat16, gen, max_position=MAX_POSITION)
    exact = variant.expected(preset, inputs, table)
    assert bool((exact["q_c"].abs() == 448).any())  # the clamp is exercised
    outs = variant.run(preset, inputs, table, backend=backend)
    assert outs[0].dtype == torch.float8_e4m3fn and outs[1].dtype == torch.bfloat16
    for n, out in zip(variant.outputs_of(preset), outs):
        c = compare_kind(
            variant.tolerance(n, preset), out, exact[n], head_dim=variant.head_dim(preset, n)
        )
        assert c.passed, f"{n}: {c}"


def test_fp8_q_c_unfused_is_the_eager_chain_bit_for_bit(gen):
    preset = get_preset("deepseek-v3.2-fp8-q")
    variant = variant_of(preset)
    table = preset.cos_sin_cache(MAX_POSITION)
    inputs = variant.draw(preset, 7, torch.bfloat16, gen, max_position=MAX_POSITION)
    got = variant.run(preset, inputs, table, numerics="unfused", backend="reference")
    want = variant.eager(preset, table, torch.bfloat16)(
        dict(inputs, kv_cache=inputs["kv_cache"].clone())
    )
    for n, a, b in zip(variant.outputs_of(preset), got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), n


def test_fp8_q_c_needs_q_c(gen):
    preset, variant, table, inputs = _case(gen, "deepseek-v2-lite")
    args = variant.arguments(preset, inputs, table, backend="reference")
    with pytest.raises(ValueError, match="quant_scale_q quantizes q_c: it needs q_lora_rank"):
        fqr.split_mla_rmsnorm_rope_cache(**dict(args, quant_scale_q=torch.tensor(2.0)))


# ------------------------------------------- FlashInfer's two caches (ckv_cache, kpe_cache)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("form", ["two tensors", "views of one buffer", "fp8"])
def test_two_caches_against_float64(gen, form, backend):
    """``kpe_cache`` given: kv_c goes into ``kv_cache [B, bs, 512]`` (FlashInfer's ckv_cache),
    k_pe into ``kpe_cache [B, bs, 64]``: as two tensors, as the two column views of one
    ``[B, bs, 576]`` buffer (what FlashInfer's MLA wrapper is often given), or as an FP8
    E4M3 pair with a per-tensor scale; every output against float64, no other byte of the
    caches changed."""
    preset = get_preset("deepseek-v3-two-caches", 8)
    variant = variant_of(preset)
    table = preset.cos_sin_cache(MAX_POSITION)
    inputs = variant.draw(preset, 5, torch.bfloat16, gen, max_position=MAX_POSITION)
    if form == "views of one buffer":
        buffer = torch.cat([inputs["kv_cache"], inputs["kpe_cache"]], dim=-1)
        inputs |= {"kv_cache": buffer[..., :512], "kpe_cache": buffer[..., 512:]}
    if form == "fp8":
        inputs |= {n: inputs[n].to(torch.float8_e4m3fn) for n in ("kv_cache", "kpe_cache")}
        inputs["k_scale"] = torch.tensor([0.02])
    before = {n: inputs[n].clone() for n in ("kv_cache", "kpe_cache")}
    exact = variant.expected(preset, inputs, table)
    outs = variant.run(preset, inputs, table, backend=backend)
    names = variant.outputs_of(preset)
    assert names[-2:] == ("kv_cache", "kpe_cache")
    for n, out in zip(names, outs, strict=True):
        c = compare_kind("contract", out, exact[n], head_dim=variant.head_dim(preset, n))
        assert c.passed, f"{form} {n}: {c}"
    slots = inputs["slot_mapping"]
    stored = set(slots[slots >= 0].tolist())
    for n, out in zip(names[-2:], outs[-2:]):
        rows, was = out.view(-1, out.shape[-1]), before[n].view(-1, out.shape[-1])
        changed = (rows.view(torch.uint8) != was.view(torch.uint8)).any(dim=1)
        assert set(changed.nonzero().flatten().tolist()) == stored, n


@pytest.mark.parametrize(
    "change,argument",
    [
        (lambda a: dict(kpe_cache=a["kpe_cache"][:, :32]), "kpe_cache"),  # block size
        (lambda a: dict(kpe_cache=a["kpe_cache"][..., :32]), "kpe_cache"),  # width
        (lambda a: dict(kpe_cache=a["kpe_cache"].float()), "kpe_cache"),  # dtype
        (lambda a: dict(kpe_cache=torch.cat([a["kpe_cache"]] * 2)), "kpe_cache"),  # blocks
        (lambda a: dict(kv_cache=torch.cat([a["kv_cache"], a["kpe_cache"]], -1)), "kv_cache"),
        (lambda a: dict(kpe_cache=a["kv_cache"][..., :64]), "kv_cache overlaps kpe_cache"),
    ],
)
def test_two_caches_bad_arguments_are_named(gen, change, argument):
    preset = get_preset("deepseek-v3-two-caches", 8)
    variant = variant_of(preset)
    table = preset.cos_sin_cache(MAX_POSITION)
    inputs = variant.draw(preset, 3, torch.bfloat16, gen, max_position=MAX_POSITION)
    args = variant.arguments(preset, inputs, table, backend="reference")
    kept = args["kv_cache"].clone()
    with pytest.raises((TypeError, ValueError), match=argument):
        fqr.split_mla_rmsnorm_rope_cache(**dict(args, **change(args)))
    assert torch.equal(args["kv_cache"], kept)


def test_fp8_ds_mla_has_no_second_cache(gen):
    preset, variant, table, inputs = _case(gen, "deepseek-v3.2")
    args = variant.arguments(preset, inputs, table, backend="reference")
    kpe = torch.zeros(args["kv_cache"].shape[0], 64, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="kpe_cache"):
        fqr.split_mla_rmsnorm_rope_cache(**dict(args, kpe_cache=kpe))


def test_two_caches_torch_op_updates_both(gen):
    """``torch.ops.fqr.split_mla_rmsnorm_rope_cache`` takes ``kpe_cache`` as a mutable optional
    tensor (``Tensor(b!)?``) and updates both caches as the public op does."""
    preset = get_preset("deepseek-v3-two-caches", 8)
    variant = variant_of(preset)
    table = preset.cos_sin_cache(MAX_POSITION)
    inputs = variant.draw(preset, 3, torch.bfloat16, gen, max_position=MAX_POSITION)
    op, args = variant.torch_op(preset, inputs, table)
    assert "Tensor(b!)? kpe_cache" in str(op._schema)
    want = variant.run(preset, inputs, table, backend="reference")
    q_c, kv_c, k_pe = op(*args)
    assert torch.equal(inputs["kv_cache"], want[3]) and torch.equal(inputs["kpe_cache"], want[4])
    assert torch.equal(q_c, want[0]) and torch.equal(k_pe, want[2])
