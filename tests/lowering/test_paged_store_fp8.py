"""FP8 E4M3 stores and paged-cache writes through the lowering facts (Role.SCALAR, PagedStore):
interpreted kernels against float64 on NaN-poisoned caches, negative slots, donation."""

from __future__ import annotations

import pytest
import torch

from fqr import ops, reference
from fqr.backends import BACKENDS
from fqr.core import Aval, trace
from fqr.lowering import lower, tiling_of
from fqr.lowering.ascend import UnsupportedOnChip
from fqr.numerics import compare
from fqr.rope_cache import rope_cos_sin_cache

needs_interpreter = pytest.mark.skipif(
    not BACKENDS["interpret"].available, reason=BACKENDS["interpret"].unavailable_reason() or ""
)
E4M3 = torch.float8_e4m3fn
HQ, HKV, D, BLOCKS, BS = 4, 2, 64, 5, 4


def composition(qkv, pos, table, qw, kw, kc, vc, slots, ks, vs, *, eps):
    q, k, v = ops.split_qkv(qkv, HQ, HKV, D)
    q = ops.rope(ops.rms_norm(q, qw, eps=eps, group_size=D), pos, table, head_dim=D)
    k = ops.rope(ops.rms_norm(k, kw, eps=eps, group_size=D), pos, table, head_dim=D)
    return q, ops.cache_insert(kc, k, slots, ks), ops.cache_insert(vc, v, slots, vs)


def program(cache_dtype):
    fp8 = cache_dtype == E4M3
    cache = Aval(("B", BS, HKV, D), cache_dtype)
    scale = Aval((1,), torch.float32) if fp8 else None
    return trace(
        composition,
        Aval(("T", (HQ + 2 * HKV) * D), torch.bfloat16),
        Aval(("T",), torch.int64),
        Aval(("P", D), torch.float32),
        Aval((D,), torch.bfloat16),
        Aval((D,), torch.bfloat16),
        cache,
        cache,
        Aval(("T",), torch.int64),
        scale,
        scale,
        eps=1e-6,
    )


@needs_interpreter
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, E4M3])
def test_cache_insert_kernel_against_float64(gen, cache_dtype):
    t = 11
    fp8 = cache_dtype == E4M3
    qkv = (torch.randn(t, (HQ + 2 * HKV) * D, generator=gen) * 3).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (t,), generator=gen)
    table = rope_cos_sin_cache(D, 4096, 1e6)
    qw, kw = ((1 + torch.randn(D, generator=gen) * 0.3).to(torch.bfloat16) for _ in range(2))
    slots = torch.randperm(BLOCKS * BS, generator=gen)[:t]
    slots[[2, 7]] = -1
    ks, vs = (torch.tensor([0.05]), torch.tensor([0.03])) if fp8 else (None, None)
    poison = torch.full((BLOCKS, BS, HKV, D), float("nan")).to(cache_dtype)
    kc, vc = poison.clone(), poison.clone()
    prog = program(cache_dtype)
    assert prog.aliases() == {1: 5, 2: 6}
    args = [a for a in (qkv, pos, table, qw, kw, kc, vc, slots, ks, vs) if a is not None]
    kernel = lower(prog, "interpret")
    q, k_out, v_out = kernel(*args, donate=True)
    assert k_out is kc and v_out is vc  # donated: written in place
    eq, ek, ev = reference.prologue(
        qkv, pos, table, qw, kw, num_heads=HQ, num_kv_heads=HKV, head_dim=D
    )
    assert compare(q, eq, head_dim=D).passed
    bits = torch.int8 if fp8 else torch.int16
    for out, x, scale in ((k_out, ek, ks), (v_out, ev, vs)):
        expected, written = reference.cache_insert(poison, x, slots, scale=scale)
        assert int(written.sum()) == t - 2
        c = compare(out[written].reshape(-1, D), expected[written].reshape(-1, D), head_dim=D)
        assert c.passed, c
        assert torch.equal(out[~written].view(bits), poison[~written].view(bits))


@needs_interpreter
def test_fp8_store_is_correctly_rounded_on_the_interpreter(gen):
    """The interpreter's own fp32 -> fp8 cast rounds half up and drops the carry; the emitted
    encoder must give torch's float64 -> E4M3 cast (the oracle) bit for bit."""
    grid = torch.arange(256, dtype=torch.uint8).view(E4M3).to(torch.float64)
    grid = grid[~grid.isnan()].unique()
    x = torch.cat([grid, (grid[:-1] + grid[1:]) / 2, torch.randn(900, generator=gen) * 60])
    x = torch.cat([x, torch.tensor([1e6, -1e6, 0.0])]).to(torch.float32)[None, :1536]
    prog = trace(ops.quantize_fp8, Aval(("T", x.shape[1]), torch.float32), None)
    (out,) = lower(prog, "interpret")(x)
    want = x.double().clamp(-448, 448).to(E4M3)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


def test_ascend_refuses_fp8_before_the_950():
    prog = program(E4M3)
    with pytest.raises(UnsupportedOnChip, match="FP8 stores need an Ascend 950"):
        tiling_of(prog, "ascend", chip="A2")
    tiling_of(program(torch.bfloat16), "ascend", chip="A2")
