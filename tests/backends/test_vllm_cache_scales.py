"""vLLM's own cache-insert calls with ``k_scale`` / ``v_scale`` (issue 41.2, the non-MLA ops).

vLLM's attention backends pass the layer's scales with every cache dtype
(``vllm/v1/attention/backends/flash_attn.py``)::

    reshape_and_cache_flash(key, value, key_cache, value_cache, attn_metadata.slot_mapping,
                            self.kv_cache_dtype, layer._k_scale, layer._v_scale)

and its kernel tests pass ``k_scale = v_scale = torch.tensor(...)`` (0-dim) with 'auto' too.
Its kernel reads them only for an FP8 cache; with 'auto' (a copy) it ignores them. fqr refused
them there ("vLLM ignores it there; pass None"), and so did the MiniMax / fused KV-cache ops
with a model-dtype cache. Now every cache op takes them and ignores their value where vLLM
does (the bytes are those of the call without them, on the first call and the fast path); their
form (float32 ``[1]`` or 0-dim, on the key's device) is still checked, and a refusal names the
scale and every dtype that takes one."""

from __future__ import annotations

import pytest
import torch

import fqr
from fqr.backends import BACKENDS
from fqr.rope_cache import rope_cos_sin_cache

BACKEND_NAMES = ["reference"] + (["interpret"] if BACKENDS["interpret"].available else [])
FP8_NAMES = ("fp8", "fp8_e4m3", "fp8_e5m2")
TABLE = rope_cos_sin_cache(32, 4096, 1e6)


def _kv(gen, tokens=5, heads=3, head_dim=40, dtype=torch.bfloat16):
    """vLLM's key / value ``[T, Hkv, D]`` (views of a QKV row, rows at its stride), bf16 caches
    holding random values (4 blocks of 16), slots with a negative one and one short of T."""
    qkv = torch.randn(tokens, 3 * heads * head_dim, generator=gen).to(dtype) * 4
    key = qkv[:, heads * head_dim : 2 * heads * head_dim].view(tokens, heads, head_dim)
    value = qkv[:, 2 * heads * head_dim :].view(tokens, heads, head_dim)
    caches = [torch.randn(4, 16, heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
    slots = torch.randperm(64, generator=gen)[: tokens - 1]
    slots[1] = -1
    return key, value, caches, slots


def _layer_scales(gen):
    """A layer's ``_k_scale`` / ``_v_scale``: float32 ``[1]`` (vLLM's layers) and a 0-dim one
    (vLLM's kernel tests), values not 1."""
    k = (0.05 + torch.rand(1, generator=gen)).float()
    return k, torch.tensor(float(0.05 + torch.rand((), generator=gen)))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_reshape_and_cache_flash_call_with_auto_and_scales(gen, backend):
    """vLLM's positional call ``(key, value, key_cache, value_cache, slot_mapping, "auto",
    layer._k_scale, layer._v_scale)`` with bf16 caches: the caches equal the no-scale call's,
    byte for byte."""
    key, value, caches, slots = _kv(gen)
    k_scale, v_scale = _layer_scales(gen)
    want = [c.clone() for c in caches]
    fqr.kv_cache_insert(key, value, *want, slots, "auto", None, None, backend=backend)
    for _ in range(2):  # the second call takes the kept call's fast path
        got = [c.clone() for c in caches]
        fqr.kv_cache_insert(key, value, *got, slots, "auto", k_scale, v_scale, backend=backend)
        for g, w in zip(got, want):
            assert torch.equal(g.view(torch.int16), w.view(torch.int16))
    assert not torch.equal(want[0], caches[0])  # something was written


def test_an_ignored_scale_is_never_read(gen):
    """With 'auto' the scale's value is not read: 0, NaN, inf and a negative one give the
    bytes of the call without a scale (first call and fast path)."""
    key, value, caches, slots = _kv(gen)
    want = [c.clone() for c in caches]
    fqr.kv_cache_insert(key, value, *want, slots, "auto", None, None)
    for v in (0.0, float("nan"), float("inf"), -2.0):
        for _ in range(2):
            got = [c.clone() for c in caches]
            scale = torch.tensor(v)
            fqr.kv_cache_insert(key, value, *got, slots, "auto", scale, scale)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), v


def test_the_torch_op_takes_vllms_scales_with_auto(gen):
    """``torch.ops.fqr.kv_cache_insert`` (tensors first in its schema) with 'auto' and
    scales."""
    key, value, caches, slots = _kv(gen)
    k_scale, v_scale = _layer_scales(gen)
    want = [c.clone() for c in caches]
    fqr.kv_cache_insert(key, value, *want, slots, "auto", None, None)
    got = [c.clone() for c in caches]
    torch.ops.fqr.kv_cache_insert(key, value, *got, slots, k_scale, v_scale, kv_cache_dtype="auto")
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def _prologue_call(gen, *, index: bool, tokens=4):
    """A small MiniMax-like call with bf16 caches: (function, positional args, kwargs)."""
    hq, hkv, d, hi, di = 3, 1, 48, 2, 40
    width = (hq + 2 * hkv) * d + ((hi + 1) * di if index else 0)
    qkv = torch.randn(tokens, width, generator=gen).bfloat16()
    positions = torch.randint(0, TABLE.shape[0], (tokens,), generator=gen)
    w = torch.randn(d, generator=gen).bfloat16()
    caches = [torch.randn(3, 16, hkv, d, generator=gen).bfloat16() for _ in range(2)]
    slots = torch.randperm(48, generator=gen)[:tokens]
    kw = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d)
    if not index:
        return fqr.split_qkv_rmsnorm_rope_cache, [qkv, positions, TABLE, w, w, *caches, slots], kw
    wi = torch.randn(di, generator=gen).bfloat16()
    index_cache = torch.randn(3, 8, di, generator=gen).bfloat16()
    index_slots = torch.randperm(24, generator=gen)[:tokens]
    args = [qkv, positions, TABLE, w, w, wi, wi, *caches, index_cache, slots, index_slots]
    return (
        fqr.split_qkv_index_rmsnorm_rope_cache,
        args,
        kw | dict(num_index_heads=hi, index_head_dim=di),
    )


def _run(fn, args, kw, **more):
    """``fn`` on copies of the caches (the donated arguments): its outputs and the caches."""
    args = [a.clone() if isinstance(a, torch.Tensor) and a.dim() >= 3 else a for a in args]
    outs = fn(*args, **kw, **more)
    return outs, [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 3]


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("index", [False, True], ids=["kv-cache", "index-cache"])
def test_fused_cache_ops_take_scales_with_a_model_dtype_cache(gen, index, backend):
    """split_qkv_rmsnorm_rope_cache and the MiniMax index-cache op with ``k_scale`` /
    ``v_scale`` and bf16 caches (what a vLLM layer holds): the same outputs and caches as
    without the scales."""
    fn, args, kw = _prologue_call(gen, index=index)
    k_scale, v_scale = _layer_scales(gen)
    want_outs, want = _run(fn, args, kw, backend=backend)
    got_outs, got = _run(fn, args, kw, backend=backend, k_scale=k_scale, v_scale=v_scale)
    want_outs = want_outs if isinstance(want_outs, tuple) else (want_outs,)
    got_outs = got_outs if isinstance(got_outs, tuple) else (got_outs,)
    for g, w in zip((*got_outs, *got), (*want_outs, *want)):
        assert torch.equal(g, w)


BAD = [
    ("two elements", torch.ones(2), ValueError, "float32 tensor of shape"),
    ("float64", torch.ones((), dtype=torch.float64), ValueError, "float32 tensor of shape"),
    ("2-D", torch.ones(1, 1), ValueError, "float32 tensor of shape"),
    ("not a tensor", 0.5, TypeError, "must be a torch.Tensor"),
    ("meta", torch.ones((), device="meta"), ValueError, "is on meta"),
]


def _names_every_fp8_dtype(message: str) -> bool:
    return all(repr(n) in message for n in FP8_NAMES) and "float8_e5m2" in message


# every malformed scale with 'auto' (refused before with "pass None"); with the FP8 names the
# ones whose message gained the dtypes (a scale on another device was refused alike before)
MALFORMED = [("auto", *b) for b in BAD] + [
    (name, *b) for name in FP8_NAMES for b in BAD if b[0] != "meta"
]


@pytest.mark.parametrize(
    "name,what,scale,error,says", MALFORMED, ids=[f"{m[0]}-{m[1]}" for m in MALFORMED]
)
def test_a_malformed_scale_is_refused_naming_it(gen, name, what, scale, error, says):
    """A malformed ``k_scale`` is refused with every kv_cache_dtype ('auto' included: its
    form is checked though its value is not read), in one line starting with ``k_scale``
    that names every dtype taking a scale; the caches byte for byte unchanged."""
    key, value, caches, slots = _kv(gen)
    if name != "auto":
        caches = [c.to(fqr.core.KV_CACHE_FP8_DTYPES[name]) for c in caches]
    before = [c.clone() for c in caches]
    with pytest.raises(error) as info:
        fqr.kv_cache_insert(key, value, *caches, slots, name, scale, None)
    message = str(info.value)
    assert message.startswith("k_scale") and says in message and "\n" not in message, message
    if what != "meta":
        assert _names_every_fp8_dtype(message), message
    for c, b in zip(caches, before):
        assert torch.equal(c.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("name", FP8_NAMES)
@pytest.mark.parametrize("value", [0.0, -0.5, float("nan"), float("inf")])
def test_a_read_scale_of_a_bad_value_names_every_fp8_dtype(gen, name, value):
    """Where the scale is read (an FP8 name), 0, negative, NaN and inf are refused naming
    ``v_scale`` and every dtype that takes one (before: the message named none)."""
    key, value_rows, caches, slots = _kv(gen)
    caches = [c.to(fqr.core.KV_CACHE_FP8_DTYPES[name]) for c in caches]
    before = [c.clone() for c in caches]
    with pytest.raises(ValueError) as info:
        fqr.kv_cache_insert(key, value_rows, *caches, slots, name, None, torch.tensor([value]))
    message = str(info.value)
    assert message.startswith("v_scale must be finite and > 0"), message
    assert _names_every_fp8_dtype(message), message
    for c, b in zip(caches, before):
        assert torch.equal(c.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("index", [False, True], ids=["kv-cache", "index-cache"])
def test_the_fused_ops_refuse_a_malformed_scale_naming_it(gen, index):
    """The fused cache ops with a bf16 cache: a malformed ``v_scale`` is still refused, naming
    it and every dtype that takes a scale, nothing written."""
    fn, args, kw = _prologue_call(gen, index=index)
    caches = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 3]
    before = [c.clone() for c in caches]
    with pytest.raises(ValueError) as info:
        fn(*args, **kw, v_scale=torch.ones(3))
    message = str(info.value)
    assert message.startswith("v_scale must be a float32 tensor of shape [1]"), message
    assert _names_every_fp8_dtype(message), message
    assert all(torch.equal(c, b) for c, b in zip(caches, before))
