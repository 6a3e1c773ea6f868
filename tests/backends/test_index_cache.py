"""split_qkv_index_rmsnorm_rope_cache (issue 26, item 8) and fqr.minimax_qknorm_rope_cache (its
vllm-ascend call): against the float64 formulation (:func:`fqr.reference.index_cache_prologue`)
on fresh random inputs and a real RoPE table, with an index head_dim narrower than the table
(each group rotates min(R, its head_dim), item 2), NeoX and GPT-J, bf16 and FP8 caches of
their own block sizes, the index projection packed or separate; rows no slot names keep their
bytes; argument errors name the argument before anything runs."""

from __future__ import annotations

import pytest
import torch

import fqr
from fqr import reference
from fqr.numerics import compare
from fqr.peers import minimax_index_prologue
from fqr.presets import PrologueSpec
from fqr.prologue.declare import torch_op_params
from fqr.prologue.index_cache import SPLIT_QKV_INDEX_RMSNORM_ROPE_CACHE
from fqr.rope_cache import rope_cos_sin_cache

E4M3 = torch.float8_e4m3fn
HQ, HKV, HI, D, DI, R, T = 4, 1, 2, 64, 48, 64, 6
BS, IBS, MAX_POS = 4, 8, 512
MAIN = (HQ + 2 * HKV) * D
STATICS = dict(num_heads=HQ, num_kv_heads=HKV, head_dim=D, num_index_heads=HI, index_head_dim=DI)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def draw(gen, fp8: bool = False) -> dict:
    """Fresh inputs: v with outliers past +-448, caches of random values (a stray write shows),
    slots with padding, the two caches' own block sizes, FP8 scales where the cache is FP8."""
    qkv = torch.randn(T, MAIN + (HI + 1) * DI, generator=gen)
    qkv[:, (HQ + HKV) * D : MAIN] *= 600  # v past the E4M3 range
    cache_dtype = E4M3 if fp8 else torch.bfloat16
    inputs = {
        "qkv": qkv.bfloat16(),
        "positions": torch.randint(0, MAX_POS, (T,), generator=gen),
        "cos_sin_cache": rope_cos_sin_cache(R, MAX_POS, 5e6),
        **{
            name: (1 + 0.2 * torch.randn(n, generator=gen)).bfloat16()
            for name, n in (("q_weight", D), ("k_weight", D), ("index_q_weight", DI))
        },
        "index_k_weight": (1 + 0.2 * torch.randn(DI, generator=gen)).bfloat16(),
        "key_cache": torch.randn(4, BS, HKV, D, generator=gen).to(cache_dtype),
        "value_cache": torch.randn(4, BS, HKV, D, generator=gen).to(cache_dtype),
        "index_cache": torch.randn(2, IBS, DI, generator=gen).to(cache_dtype),
        "slot_mapping": torch.tensor([3, -1, 15, 0, 9, -1]),
        "index_slot_mapping": torch.tensor([-1, 14, 2, 7, -1, 15]),
    }
    if fp8:
        inputs["k_scale"] = torch.tensor([0.5])
        inputs["v_scale"] = torch.tensor([2.0])
    return inputs


def call(inputs: dict, **kwargs):
    return fqr.split_qkv_index_rmsnorm_rope_cache(**inputs, **(STATICS | kwargs))


@pytest.mark.parametrize("backend", ["reference", "interpret"])
@pytest.mark.parametrize(
    "fp8, is_neox, separate",
    [(False, True, False), (False, False, True), (True, True, True), (True, False, False)],
)
def test_index_cache_against_float64(gen, backend, fp8, is_neox, separate):
    inputs = draw(gen, fp8)
    exact = reference.index_cache_prologue(**inputs, **STATICS, eps=1e-6, is_neox=is_neox)
    before = {k: inputs[k].clone() for k in ("key_cache", "value_cache", "index_cache")}
    if separate:
        row = inputs.pop("qkv")
        inputs["qkv"], inputs["index_qkv"] = row[:, :MAIN], row[:, MAIN:]
    q, iq = call(inputs, is_neox=is_neox, backend=backend)
    assert q.dtype == torch.bfloat16 and iq.dtype == (E4M3 if fp8 else torch.bfloat16)
    assert compare(q, exact[0], head_dim=D).passed
    c = compare(iq, exact[1], head_dim=DI)
    assert c.passed, f"index_q: {c}"
    caches = ("key_cache", "value_cache", "index_cache")
    for name, want, slots in zip(
        caches, exact[2:], ("slot_mapping",) * 2 + ("index_slot_mapping",)
    ):
        got, old = inputs[name], before[name]
        written = torch.zeros(got.shape[0] * got.shape[1], dtype=torch.bool)
        named = inputs[slots]
        written[named[named >= 0]] = True
        width = got.shape[-1]
        rows = lambda x: x.reshape(-1, x[0, 0].numel())  # noqa: E731
        c = compare(rows(got)[written], rows(want)[written], head_dim=width)
        assert c.passed, f"{name}: {c}"
        assert torch.equal(bits(rows(got)[~written]), bits(rows(old)[~written])), name


def test_the_index_group_rotates_its_own_width(gen):
    """Index head_dim 48 under a 64-wide table: the index heads' features [0, 48) turn by the
    table's first 24 frequencies (cos = row[:24], sin = row[32:56]): the float64 reference on
    a table whose columns past them are NaN gives the same index_q, and the op's output is
    finite (a kernel reading another column of the table would give NaN)."""
    inputs = draw(gen)
    table = inputs["cos_sin_cache"].clone()
    table[:, 24:32] = float("nan")
    table[:, 56:] = float("nan")
    poisoned = dict(inputs, cos_sin_cache=table, slot_mapping=torch.full((T,), -1))
    index_only = reference.index_cache_prologue(**poisoned, **STATICS, eps=1e-6)[1]
    exact = reference.index_cache_prologue(**inputs, **STATICS, eps=1e-6)[1]
    assert torch.equal(index_only, exact)
    for backend in ("reference", "interpret"):
        _, iq = call(dict(poisoned), backend=backend)
        assert torch.isfinite(iq.float()).all() and compare(iq, exact, head_dim=DI).passed


def test_argument_errors_name_the_argument(gen):
    inputs = draw(gen)
    kc, ic = inputs["key_cache"], inputs["index_cache"]
    row = inputs["qkv"]
    cases = [
        ({"num_index_heads": 3}, ValueError, "qkv width"),
        ({"index_qkv": row[:, MAIN:]}, ValueError, "qkv width .* index heads are in index_qkv"),
        ({"qkv": row[:, :MAIN], "index_qkv": row[:, MAIN:].half()}, TypeError, "index_qkv must"),
        ({"qkv": row[:, :MAIN], "index_qkv": row[:3, MAIN:]}, ValueError, "index_qkv has 3"),
        ({"qkv": row[:, :MAIN], "index_qkv": row[:, MAIN:-8]}, ValueError, "index_qkv width"),
        ({"index_cache": ic[..., :32]}, ValueError, "index_cache must be .*index_head_dim=48"),
        ({"index_cache": ic[:, :, None]}, ValueError, "index_cache must be"),
        ({"index_cache": ic.half()}, TypeError, "index_cache must be"),
        (
            {"index_cache": torch.zeros(2, IBS, 2 * DI).bfloat16()[..., ::2]},
            ValueError,
            "index_cache must be contiguous in its last dim",
        ),
        ({"index_cache": kc.view(-1)[: ic.numel()].view(ic.shape)}, ValueError, "overlaps"),
        ({"index_slot_mapping": torch.full((T,), 16)}, ValueError, "index_slot_mapping names"),
        ({"index_slot_mapping": torch.zeros(T + 1).long()}, ValueError, "index_slot_mapping"),
        (
            {"cos_sin_cache": rope_cos_sin_cache(96, 8, 1e4)},
            ValueError,
            r"cos_sin_cache width \(rotary_dim\) 96 exceeds max\(head_dim, index_head_dim\) 64",
        ),
        ({"index_k_weight": inputs["index_k_weight"][:32]}, ValueError, "index_k_weight must be"),
    ]
    before = [x.clone() for x in (kc, inputs["value_cache"], ic)]
    for overrides, error, message in cases:
        with pytest.raises(error, match=message):
            args = dict(inputs)
            kwargs = {k: overrides.pop(k) for k in list(overrides) if k in STATICS}
            call(args | overrides, backend="reference", **kwargs)
    for x, old in zip((kc, inputs["value_cache"], ic), before):
        assert torch.equal(bits(x), bits(old))  # nothing ran


def test_the_peer_call_stores_only_its_actual_tokens(gen):
    """fqr.minimax_qknorm_rope_cache as vllm-ascend's callers write it: slot mappings of
    num_actual_tokens entries (or longer), tokens past them store nothing, q and index_q for
    every token; the caller's slot mappings are read, never written."""
    inputs = draw(gen)
    d = dict(inputs)
    weights = [d[k] for k in ("q_weight", "k_weight", "index_q_weight", "index_k_weight")]
    d["index_q_weight"] = d["index_k_weight"] = d["q_weight"]  # the peer: one head_dim
    n, hd = 4, D
    packed = torch.randn(T, MAIN + (HI + 1) * hd, generator=gen).bfloat16()
    index_cache = torch.randn(2, IBS, hd, generator=gen).bfloat16()
    long_slots = torch.tensor([3, -1, 15, 0, 9, 10, 11])  # longer than T: read up to n
    short_index = torch.tensor([-1, 14, 2, 7])
    kept = long_slots.clone(), short_index.clone()
    key, value, index = inputs["key_cache"], inputs["value_cache"], index_cache
    expected = reference.index_cache_prologue(
        packed, d["positions"], d["cos_sin_cache"], weights[0], weights[1], weights[0],
        weights[0], key.clone(), value.clone(), index.clone(),
        torch.tensor([3, -1, 15, 0, -1, -1]), torch.tensor([-1, 14, 2, 7, -1, -1]),
        num_heads=HQ, num_kv_heads=HKV, head_dim=hd, num_index_heads=HI, index_head_dim=hd,
        eps=1e-6,
    )  # fmt: skip
    q, iq = fqr.minimax_qknorm_rope_cache(
        packed, d["cos_sin_cache"], d["positions"], weights[0], weights[1], weights[0],
        weights[0], key, value, index, long_slots, short_index, n, HQ, HKV, HI, 1e-6,
        backend="interpret",
    )  # fmt: skip
    assert torch.equal(long_slots, kept[0]) and torch.equal(short_index, kept[1])
    assert compare(q, expected[0], head_dim=hd).passed
    assert compare(iq, expected[1], head_dim=hd).passed
    for got, want in zip((key, value, index), expected[2:]):
        assert compare(got, want.to(torch.float64), head_dim=hd).passed
    bad = [
        (dict(num_actual_tokens=T + 1), "num_actual_tokens must be an int in \\[0, T = 6\\]"),
        (dict(num_actual_tokens=True), "num_actual_tokens"),
        (dict(index_slot_mapping=short_index[:3]), "index_slot_mapping must be 1-D with at least"),
    ]
    args = dict(
        packed=packed, cos_sin_cache=d["cos_sin_cache"], positions=d["positions"],
        q_weight=weights[0], k_weight=weights[1], index_q_weight=weights[0],
        index_k_weight=weights[0], key_cache=key, value_cache=value, index_cache=index,
        slot_mapping=long_slots, index_slot_mapping=short_index, num_actual_tokens=n,
        num_q_heads=HQ, num_kv_heads=HKV, num_index_heads=HI, eps=1e-6,
    )  # fmt: skip
    for overrides, message in bad:
        with pytest.raises(ValueError, match=message):
            fqr.minimax_qknorm_rope_cache(**(args | overrides), backend="reference")


@pytest.mark.parametrize("fp8, separate", [(False, True), (True, False)])
def test_the_torch_op_passes_opcheck_and_returns_new_memory(gen, fp8, separate):
    """``torch.ops.fqr.split_qkv_index_rmsnorm_rope_cache``: ``torch.library.opcheck`` (schema
    with three mutated caches, fake, autograd registration, AOT dispatch), index_q in the index
    cache's dtype, no returned tensor sharing memory with an argument."""
    decl = SPLIT_QKV_INDEX_RMSNORM_ROPE_CACHE
    inputs = draw(gen, fp8)
    if separate:
        row = inputs.pop("qkv")
        inputs["qkv"], inputs["index_qkv"] = row[:, :MAIN].contiguous(), row[:, MAIN:].contiguous()
    bound = decl.bind((), inputs | STATICS)
    args = [bound[decl.index[p.name]] for p in torch_op_params(decl)]
    op = torch.ops.fqr.split_qkv_index_rmsnorm_rope_cache.default
    # torch's schema check compares FP8 outputs with a CPU multiply it lacks for float8: the
    # other three checks for the FP8 caches
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(op, args, **(dict(test_utils=utils) if fp8 else {}))
    q, iq = op(*args)
    assert q.shape == (T, HQ * D) and iq.shape == (T, HI * DI)
    assert iq.dtype == (E4M3 if fp8 else torch.bfloat16)
    given = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    assert not {q.untyped_storage().data_ptr(), iq.untyped_storage().data_ptr()} & given


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_unfused_is_the_model_chain(gen, backend):
    """``numerics="unfused"``: q, index_q and the stored k, v, index_k are the bits of
    MiniMax-M3's own chain (vllm-ascend's fallback: ``GemmaRMSNorm`` and ``rotary_emb`` in
    bf16, :func:`fqr.peers.minimax_index_prologue`) stored by slot on the reference backend;
    the interpreted kernel is within one ULP of a head's largest element on under 1%."""
    d = 64
    spec = PrologueSpec(HQ, HKV, d, 32, eps=1e-6, is_neox=True, weight_offset=1.0)
    table = rope_cos_sin_cache(32, MAX_POS, 5e6)
    inputs = {
        "qkv": torch.randn(T, (HQ + 2 * HKV + HI + 1) * d, generator=gen).bfloat16(),
        "positions": torch.randint(0, MAX_POS, (T,), generator=gen),
        **{
            k: (0.2 * torch.randn(d, generator=gen)).bfloat16()
            for k in ("q_weight", "k_weight", "index_q_weight", "index_k_weight")
        },
    }
    q, k, v, iq, ik = minimax_index_prologue(
        inputs, table.bfloat16(), spec, num_index_heads=HI, index_head_dim=d, attn_fp8=False,
        index_fp8=False,
    )  # fmt: skip
    slots, index_slots = torch.tensor([3, -1, 15, 0, 9, -1]), torch.tensor([-1, 14, 2, 7, -1, 15])
    caches = [torch.randn(4, BS, HKV, d, generator=gen).bfloat16() for _ in range(2)]
    index_cache = torch.randn(2, IBS, d, generator=gen).bfloat16()
    want = [c.clone() for c in (*caches, index_cache)]
    for cache, x, mapping in zip(want, (k, v, ik), (slots, slots, index_slots)):
        rows = cache.view(-1, x.shape[1])
        rows[mapping[mapping >= 0]] = x[mapping >= 0]
    got_q, got_iq = fqr.split_qkv_index_rmsnorm_rope_cache(
        inputs["qkv"], inputs["positions"], table, inputs["q_weight"], inputs["k_weight"],
        inputs["index_q_weight"], inputs["index_k_weight"], *caches, index_cache, slots,
        index_slots, num_heads=HQ, num_kv_heads=HKV, head_dim=d, num_index_heads=HI,
        index_head_dim=d, numerics="unfused", backend=backend,
    )  # fmt: skip
    for name, got, w in zip(
        ("q", "index_q", "key_cache", "value_cache", "index_cache"),
        (got_q, got_iq, *caches, index_cache),
        (q, iq, *want),
    ):
        if backend == "reference":
            assert torch.equal(bits(got), bits(w)), name
        else:  # the kernel's fp32 sum of squares adds in another order (DESIGN.md, Triton
            # facts): where rstd moves by an fp32 ulp an element on a rounding boundary lands
            # one ULP away; the rest is the chain's bits
            assert (got != w).float().mean() < 0.01, name
            rows = w.reshape(-1, d).double()
            scale = rows.abs().amax(-1, keepdim=True)
            assert ((got.reshape(-1, d).double() - rows).abs() <= 2**-7 * scale).all(), name


@pytest.mark.parametrize("preset_name", ["minimax-m3-index-cache", "minimax-m3-index-cache-fp8"])
def test_bytes_written_counts_each_cache_by_its_own_slots(gen, preset_name):
    """``Variant.bytes_written`` (the bench's traffic): q and index_q once, then per cache one
    entry per slot ``>= 0`` of ITS slot mapping (the index cache's differs from the KV cache's),
    checked against the entries a call really changes in caches filled with NaN."""
    from fqr.presets import get_preset
    from fqr.prologue import variant_of

    preset = get_preset(preset_name, 8)
    variant = variant_of(preset)
    inputs = variant.draw(preset, 9, torch.bfloat16, gen, max_position=MAX_POS)
    inputs["index_slot_mapping"][:5] = -1  # fewer index entries than KV entries
    for name in ("key_cache", "value_cache", "index_cache"):
        inputs[name] = torch.full_like(inputs[name], float("nan"))
    table = preset.cos_sin_cache(MAX_POS)
    q, iq, *caches = variant.run(preset, inputs, table, backend="reference")
    changed = sum(
        int((~c.float().isnan()).reshape(c.shape[0] * c.shape[1], -1).all(-1).sum())
        * c[0, 0].numel()
        * c.element_size()
        for c in caches
    )
    assert (
        changed
        == 2
        * int((inputs["slot_mapping"] >= 0).sum())
        * preset.head_dim
        * (caches[0].element_size())
        + int((inputs["index_slot_mapping"] >= 0).sum()) * 128 * caches[2].element_size()
    )
    outputs = q.numel() * q.element_size() + iq.numel() * iq.element_size()
    assert variant.bytes_written(variant.program(preset), inputs) == outputs + changed


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_slot_mappings_shorter_than_t_store_only_their_tokens(gen, backend):
    """vLLM pads T for CUDA graphs and passes the actual tokens' slots: ``slot_mapping [N]``
    and ``index_slot_mapping [Ni]`` (each its own length, at most T) store exactly what
    ``[T]`` mappings with -1 past them store; q and index_q cover all T tokens."""
    inputs = draw(gen)
    n, ni = 4, 2
    short = dict(inputs)
    short["slot_mapping"] = inputs["slot_mapping"][:n]
    short["index_slot_mapping"] = inputs["index_slot_mapping"][:ni]
    padded = dict(inputs)
    padded["slot_mapping"] = torch.cat([inputs["slot_mapping"][:n], torch.full((T - n,), -1)])
    padded["index_slot_mapping"] = torch.cat(
        [inputs["index_slot_mapping"][:ni], torch.full((T - ni,), -1)]
    )
    caches = ("key_cache", "value_cache", "index_cache")
    for d in (short, padded):
        d.update({c: inputs[c].clone() for c in caches})
    got, want = call(short, backend=backend), call(padded, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for c in caches:
        assert torch.equal(bits(short[c]), bits(padded[c])), c
    assert not torch.equal(bits(short["index_cache"]), bits(inputs["index_cache"]))
