"""FP8 E5M2 outputs of MiniMax-M3's prologue wherever E4M3 ones exist (issue 41.3).

``fqr.split_qkv_index_rmsnorm_rope(..., attn_fp8=, index_fp8=)`` returned float8_e4m3fn
``clamp(y, -448, 448)`` only; with ``quantize_dtype=torch.float8_e5m2`` (FlashInfer's argument,
as ``fqr.mla_q_rope`` takes it) the asked outputs are float8_e5m2 ``clamp(y, -57344, 57344)``.
``fqr.split_qkv_index_rmsnorm_rope_cache`` returns index_q in the index cache's format: a
float8_e5m2 index cache (which its checks advertised) failed deep in the trace; it now stores
E5M2 and returns index_q in E5M2. Each output within one E5M2 ULP of the float64 reference
(:mod:`fqr.reference`), exactly +-57344 past the range, values past E4M3's 448 kept, NaN
nowhere; the unfused mode is the model's own chain bit for bit; the E4M3 outputs are those of
before. Head widths 48 and 40 (not powers of two), a real RoPE table of 32 rotary features."""

from __future__ import annotations

import pytest
import torch

import fqr
from fqr import reference
from fqr.backends import BACKENDS
from fqr.numerics import compare
from fqr.peers import minimax_index_cache_prologue, minimax_index_prologue
from fqr.presets import PrologueSpec
from fqr.rope_cache import rope_cos_sin_cache

BACKEND_NAMES = ["reference"] + (["interpret"] if BACKENDS["interpret"].available else [])
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HQ, HKV, D, HI, DI = 3, 1, 48, 2, 40
STATICS = dict(num_heads=HQ, num_kv_heads=HKV, head_dim=D, num_index_heads=HI, index_head_dim=DI)
TABLE = rope_cos_sin_cache(32, 4096, 5e6)  # MiniMax-M3's theta, 32 of 48 / 40 features rotated
WIDTH = (HQ + 2 * HKV) * D + (HI + 1) * DI
HEADS = (D, D, D, DI, DI)  # q, k, v, index_q, index_k


def _weight(gen, n):
    """A ``(1 + w)`` norm weight of wide range: factors of about 400 (outputs past 448), a few
    of 10^5 (past 57344) and a few of 10^-7 (E5M2's subnormals)."""
    w = torch.randn(n, generator=gen, dtype=torch.float64) * 400
    w[::9] = 1e5
    w[4::13] = -1 + 1e-7
    return w.bfloat16()


def _inputs(gen, tokens=5):
    qkv = torch.randn(tokens, WIDTH, generator=gen, dtype=torch.float64) * 2
    v = qkv[:, (HQ + HKV) * D : (HQ + 2 * HKV) * D]
    v[:, ::5] *= 600  # v is copied: past 448
    v[:, 3::17] *= 1e5  # and past 57344
    return {
        "qkv": qkv.bfloat16(),
        "positions": torch.randint(0, TABLE.shape[0], (tokens,), generator=gen),
        "q_weight": _weight(gen, D),
        "k_weight": _weight(gen, D),
        "index_q_weight": _weight(gen, DI),
        "index_k_weight": _weight(gen, DI),
    }


def _args(inputs):
    return (
        [inputs[n] for n in ("qkv", "positions")]
        + [TABLE]
        + [inputs[n] for n in ("q_weight", "k_weight", "index_q_weight", "index_k_weight")]
    )


def _exact(inputs, **kw):
    return reference.index_prologue(*_args(inputs), eps=1e-6, **STATICS, **kw)


def _check_e5m2(out, exact, head_dim, name):
    assert out.dtype == E5M2 and out.shape == exact.shape, name
    c = compare(out, exact, head_dim=head_dim)
    assert c.passed and c.nonfinite == 0, f"{name}: {c}"
    got, want = out.double(), exact
    past = want.abs() >= 57344
    assert torch.equal(got[past], want[past].sign() * 57344), name
    kept = (want.abs() > 480) & ~past  # beyond E4M3's 448 (and its rounding up to 480)
    assert bool(kept.any()), name  # the inputs reach there
    assert bool((got[kept].abs() > 448).all()), name  # E5M2 keeps them


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize(
    "attn_fp8,index_fp8", [(True, True), (True, False), (False, True)], ids=["both", "attn", "ix"]
)
def test_index_heads_e5m2_against_float64(gen, attn_fp8, index_fp8, backend):
    inputs = _inputs(gen)
    flags = dict(attn_fp8=attn_fp8, index_fp8=index_fp8)
    outs = fqr.split_qkv_index_rmsnorm_rope(
        *_args(inputs), **STATICS, **flags, quantize_dtype=E5M2, backend=backend
    )
    exact = _exact(inputs, **flags, quantize_dtype=E5M2)
    for i, (name, out, e, d) in enumerate(zip(("q", "k", "v", "iq", "ik"), outs, exact, HEADS)):
        if attn_fp8 if i < 3 else index_fp8:
            _check_e5m2(out, e, d, name)
        else:
            assert out.dtype == torch.bfloat16, name
            assert compare(out, e, head_dim=d).passed, name


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_e4m3_outputs_are_unchanged(gen, backend):
    """quantize_dtype None and float8_e4m3fn give the E4M3 outputs of before (clamp 448)."""
    inputs = _inputs(gen, tokens=3)
    kw = dict(**STATICS, attn_fp8=True, index_fp8=True, backend=backend)
    default = fqr.split_qkv_index_rmsnorm_rope(*_args(inputs), **kw)
    explicit = fqr.split_qkv_index_rmsnorm_rope(*_args(inputs), **kw, quantize_dtype=E4M3)
    exact = _exact(inputs, attn_fp8=True, index_fp8=True)
    for a, b, e, d in zip(default, explicit, exact, HEADS):
        assert a.dtype == E4M3 and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert compare(a, e, head_dim=d).passed
        assert float(e.abs().max()) == 448.0


def test_unfused_e5m2_is_the_model_chain(gen):
    """numerics="unfused": the model's chain (GemmaRMSNorm, rotary_emb in bf16, then clamp
    and cast to E5M2), bit for bit on the reference backend."""
    inputs = _inputs(gen)
    spec = PrologueSpec(HQ, HKV, D, TABLE.shape[1], eps=1e-6, weight_offset=1.0)
    flags = dict(attn_fp8=True, index_fp8=True)
    got = fqr.split_qkv_index_rmsnorm_rope(
        *_args(inputs), **STATICS, **flags, quantize_dtype=E5M2, numerics="unfused",
        backend="reference",
    )  # fmt: skip
    chain = minimax_index_prologue(
        inputs, TABLE.bfloat16(), spec, num_index_heads=HI, index_head_dim=DI, **flags,
        quantize_dtype=E5M2,
    )  # fmt: skip
    for name, g, c in zip(("q", "k", "v", "iq", "ik"), got, chain):
        assert g.dtype == c.dtype == E5M2, name
        assert torch.equal(g.view(torch.uint8), c.view(torch.uint8)), name


def test_the_torch_op_takes_quantize_dtype(gen):
    """``torch.ops.fqr.split_qkv_index_rmsnorm_rope``: quantize_dtype appended after the
    released arguments."""
    inputs = _inputs(gen, tokens=3)
    kw = dict(**STATICS, attn_fp8=True, index_fp8=False)
    got = torch.ops.fqr.split_qkv_index_rmsnorm_rope(
        *_args(inputs), None, None, **kw, quantize_dtype=E5M2
    )
    want = fqr.split_qkv_index_rmsnorm_rope(*_args(inputs), **kw, quantize_dtype=E5M2)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert got[0].dtype == E5M2 and got[3].dtype == torch.bfloat16


BAD = [
    ("bf16", torch.bfloat16, TypeError, "^quantize_dtype must be torch.float8_e4m3fn or"),
    ("fnuz", torch.float8_e4m3fnuz, TypeError, "^quantize_dtype must be torch.float8_e4m3fn or"),
    ("a string", "e5m2", TypeError, "^quantize_dtype must be torch.float8_e4m3fn or"),
]


@pytest.mark.parametrize("what,value,error,says", BAD, ids=[b[0] for b in BAD])
def test_a_bad_quantize_dtype_is_refused_naming_it(gen, what, value, error, says):
    with pytest.raises(error, match=says):
        fqr.split_qkv_index_rmsnorm_rope(
            *_args(_inputs(gen)), **STATICS, attn_fp8=True, quantize_dtype=value
        )


def test_quantize_dtype_without_fp8_outputs_is_refused(gen):
    """quantize_dtype names the format of the FP8 outputs attn_fp8 / index_fp8 ask for:
    alone it would be silently unused."""
    with pytest.raises(ValueError, match="^quantize_dtype applies to the FP8 outputs attn_fp8"):
        fqr.split_qkv_index_rmsnorm_rope(*_args(_inputs(gen)), **STATICS, quantize_dtype=E5M2)


# ------------------------------------------------------------------ the index cache in E5M2


def _cache_call(gen, tokens=5, kv_dtype=torch.bfloat16):
    """The index-cache op's arguments: a float8_e5m2 index cache of random values (3 blocks of
    8), KV caches of ``kv_dtype`` (2 blocks of 16), slot mappings with padding."""
    inputs = _inputs(gen, tokens)
    caches = [(torch.randn(2, 16, HKV, D, generator=gen) * 100).to(kv_dtype) for _ in range(2)]
    index_cache = (torch.randn(3, 8, DI, generator=gen) * 1e3).to(E5M2)
    slots = torch.randperm(32, generator=gen)[:tokens]
    index_slots = torch.randperm(24, generator=gen)[:tokens]
    slots[1], index_slots[2] = -1, -1
    return inputs, caches, index_cache, slots, index_slots


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, E5M2], ids=["bf16-kv", "e5m2-kv"])
def test_an_e5m2_index_cache_against_float64(gen, kv_dtype, backend):
    inputs, caches, index_cache, slots, index_slots = _cache_call(gen, kv_dtype=kv_dtype)
    written = [c.clone() for c in (*caches, index_cache)]
    q, index_q = fqr.split_qkv_index_rmsnorm_rope_cache(
        *_args(inputs), *written, slots, index_slots, **STATICS, backend=backend
    )
    exact = reference.index_cache_prologue(
        *_args(inputs), *caches, index_cache, slots, index_slots, eps=1e-6, **STATICS
    )
    assert q.dtype == torch.bfloat16 and compare(q, exact[0], head_dim=D).passed
    _check_e5m2(index_q, exact[1], DI, "index_q")
    for name, out, e, d in zip(("key", "value", "index"), written, exact[2:], (D, D, DI)):
        assert out.dtype == kv_dtype if name != "index" else out.dtype == E5M2
        flat = out.reshape(-1, d)
        c = compare(flat, e.reshape(-1, d), head_dim=d)
        assert c.passed and c.nonfinite == 0, f"{name}: {c}"
    rows = index_cache.reshape(-1, DI)
    kept = torch.ones(rows.shape[0], dtype=torch.bool)
    kept[index_slots[index_slots >= 0]] = False
    after = written[2].reshape(-1, DI)
    assert torch.equal(after[kept].view(torch.uint8), rows[kept].view(torch.uint8))


def test_the_e5m2_index_cache_unfused_is_the_model_chain(gen):
    """numerics="unfused" with an E5M2 index cache: index_q and the index cache as the
    model's chain writes them (clamp and cast to the cache's E5M2), bit for bit."""
    inputs, caches, index_cache, slots, index_slots = _cache_call(gen)
    spec = PrologueSpec(HQ, HKV, D, TABLE.shape[1], eps=1e-6, weight_offset=1.0)
    written = [c.clone() for c in (*caches, index_cache)]
    q, index_q = fqr.split_qkv_index_rmsnorm_rope_cache(
        *_args(inputs), *written, slots, index_slots, **STATICS, numerics="unfused",
        backend="reference",
    )  # fmt: skip
    chain_inputs = dict(
        inputs, key_cache=caches[0].clone(), value_cache=caches[1].clone(),
        index_cache=index_cache.clone(), slot_mapping=slots, index_slot_mapping=index_slots,
    )  # fmt: skip
    want = minimax_index_cache_prologue(
        chain_inputs, TABLE.bfloat16(), spec, num_index_heads=HI, index_head_dim=DI
    )
    assert index_q.dtype == E5M2
    assert torch.equal(index_q.view(torch.uint8), want[1].view(torch.uint8))
    assert torch.equal(written[2].view(torch.uint8), want[4].view(torch.uint8))
    assert torch.equal(q, want[0])
