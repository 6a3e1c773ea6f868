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


def test_an_fp8_program_defaults_to_the_950(monkeypatch):
    """No chip named and no NPU: a program that stores FP8 (outputs or a cache) is lowered
    for the 950, the one chip with FP8; a chip named by FQR_ASCEND_CHIP is kept (and refuses
    it); a program without FP8 keeps the default A2."""
    from fqr.lowering import plan_program
    from fqr.lowering.ascend import default_chip
    from fqr.lowering.targets import get_target

    monkeypatch.delenv("FQR_ASCEND_CHIP", raising=False)
    target = get_target("ascend")
    for prog, chip in ((program(E4M3), "950"), (program(torch.bfloat16), "A2")):
        assert default_chip(plan_program(prog)).name == chip
        assert target.ascend_tiling(plan_program(prog)).chip.name == chip
    monkeypatch.setenv("FQR_ASCEND_CHIP", "A3")
    assert default_chip(plan_program(program(E4M3))).name == "A3"
    with pytest.raises(UnsupportedOnChip, match="A3"):
        tiling_of(program(E4M3), "ascend")


class ForwardingLauncher:
    """The direct launcher's seat, recording each launch's key and running the arguments it
    is handed through the (interpreted) kernel positionally, as the C launcher would."""

    def __init__(self, fn):
        self.fn, self.keys = fn, []

    def launch(self, grid, args, constexprs, key):
        self.keys.append(key)
        self.fn[grid](*args, **constexprs)


@needs_interpreter
def test_the_direct_launch_path_passes_cache_params_and_donates(gen):
    """What the bound launcher receives for a cache program (the CUDA per-call path): the
    cache strides and rows in signature order, no output slot for an aliased output, the
    cache's ints in the specialisation key; run positionally it updates the donated cache."""
    import dataclasses

    t = 5
    qkv = (torch.randn(t, (HQ + 2 * HKV) * D, generator=gen) * 3).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (t,), generator=gen)
    table = rope_cos_sin_cache(D, 4096, 1e6)
    qw, kw = ((1 + torch.randn(D, generator=gen) * 0.3).to(torch.bfloat16) for _ in range(2))
    slots = torch.tensor([3, -1, 17, 8, 0])
    prog = program(torch.bfloat16)
    kernel = lower(prog, "interpret")
    probe = dataclasses.replace(kernel)
    rec = probe._direct = ForwardingLauncher(kernel.fn)
    keys = []
    for blocks in (BLOCKS, BLOCKS + 3):  # another cache size: another key
        kc, vc = (torch.randn(blocks, BS, HKV, D, generator=gen).to(torch.bfloat16) for _ in "kv")
        k0 = kc.clone()
        q, k_out, v_out = probe.launch([qkv, pos, table, qw, kw, kc, vc, slots], donate=True)
        assert k_out is kc and v_out is vc
        eq, ek, _ = reference.prologue(
            qkv, pos, table, qw, kw, num_heads=HQ, num_kv_heads=HKV, head_dim=D
        )
        assert compare(q, eq, head_dim=D).passed
        expected, written = reference.cache_insert(k0, ek, slots)
        assert compare(kc, expected, head_dim=D).passed
        assert torch.equal(kc[~written].view(torch.int16), k0[~written].view(torch.int16))
        keys.append(rec.keys[-1])
    dense, ints, _aligned, _ = keys[0]
    assert dense and BLOCKS * BS in ints and BS * HKV * D in ints
    assert keys[0] != keys[1]
