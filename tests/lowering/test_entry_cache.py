"""Paged stores into a 3-D entry cache ``[blocks, block_size, entry]`` at column offsets, several
inserts chained into one buffer (``fqr.ops.cache_insert`` with ``column``; PagedStore fields):
the interpreted kernel and the reference backend against float64 on caches pre-filled with
random values (unwritten entries, and the columns of written entries no insert names, must keep
their bits), negative slots, strided caches; the plan's refusals of stores it cannot fuse."""

from __future__ import annotations

import re

import pytest
import torch

from fqr import ops, reference
from fqr.backends import BACKENDS
from fqr.core import Aval, Section, trace
from fqr.lowering import PlanError, plan_program
from fqr.numerics import compare
from fqr.rope_cache import rope_cos_sin_cache

needs_interpreter = pytest.mark.skipif(
    not BACKENDS["interpret"].available, reason=BACKENDS["interpret"].unavailable_reason() or ""
)
E4M3 = torch.float8_e4m3fn
# The packed row: x = 2 heads of 48 (per-head norm), y = one 32-wide head (GPT-J rope) after a
# gap; the entry is 160 wide: x at columns [16, 112), y at [112, 144), the rest never written.
H, D, R, GAP = 2, 48, 32, 4
WIDTH = H * D + GAP + R
ENTRY, X_AT, Y_AT = 160, 16, 112
BLOCKS, BS = 3, 4


def composition(row, pos, table, w, cache, slots, scale, *, eps):
    x, y = ops.split_heads(row, [Section(H, D, 0), Section(1, R, H * D + GAP)])
    x = ops.rms_norm(x, w, eps=eps, group_size=D)
    y = ops.rope(y, pos, table, head_dim=R, is_neox=False)
    cache = ops.cache_insert(cache, x, slots, scale, column=X_AT)
    return x, ops.cache_insert(cache, y, slots, scale, column=Y_AT)


def program(cache_dtype):
    scale = Aval((1,), torch.float32) if cache_dtype == E4M3 else None
    return trace(
        composition,
        Aval(("T", WIDTH), torch.bfloat16),
        Aval(("T",), torch.int64),
        Aval(("P", R), torch.float32),
        Aval((D,), torch.bfloat16),
        Aval(("B", BS, ENTRY), cache_dtype),
        Aval(("T",), torch.int64),
        scale,
        eps=1e-6,
    )


def random_cache(gen, dtype, strided: bool) -> torch.Tensor:
    """Random finite values (unwritten entries show); strided: a view into a wider buffer whose
    blocks are padded too, so the block, row and column strides are all not the dense ones."""
    shape = (BLOCKS + 1, BS + 1, ENTRY + 24) if strided else (BLOCKS, BS, ENTRY)
    buf = (torch.randn(shape, generator=gen) * 3).to(dtype)
    return buf[1:, 1:, 8 : 8 + ENTRY] if strided else buf


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def check_cache(out, before, x64, y64, slots, scale):
    """Each written entry's fields under the contract (x: heads of D, y: one head of R), every
    other element of the cache bit for bit."""
    fp8 = out.dtype == E4M3
    written = torch.zeros(out.shape[:2], dtype=torch.bool)
    fields = torch.zeros(out.shape, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        at = (slot // BS, slot % BS)
        written[at] = True
        fields[at[0], at[1], X_AT : Y_AT + R] = True
        for value, start, d in ((x64[t], X_AT, D), (y64[t], Y_AT, R)):
            exact = reference.saturate_fp8(value, scale) if fp8 else value
            got = out[at[0], at[1], start : start + value.shape[0]]
            c = compare(got[None], exact[None], head_dim=d)
            assert c.passed, (t, start, c)
    assert torch.equal(bits(out)[~fields], bits(before)[~fields]), "an element outside the fields"
    return written


@needs_interpreter
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, E4M3])
@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_chained_inserts_fill_one_entry(gen, cache_dtype, backend):
    t = 6
    fp8 = cache_dtype == E4M3
    row = (torch.randn(t, WIDTH, generator=gen) * 2).to(torch.bfloat16)
    pos = torch.randint(0, 2048, (t,), generator=gen)
    table = rope_cos_sin_cache(R, 2048, 1e4)
    w = (1 + torch.randn(D, generator=gen) * 0.3).to(torch.bfloat16)
    slots = torch.randperm(BLOCKS * BS, generator=gen)[:t]
    slots[[1, 4]] = -1
    scale = torch.tensor([0.02]) if fp8 else None
    cache = random_cache(gen, cache_dtype, strided=True)
    before = cache.clone()
    prog = program(cache_dtype)
    assert prog.aliases() == {1: 4}  # the last insert's output updates the cache input
    args = [a for a in (row, pos, table, w, cache, slots, scale) if a is not None]
    x, out = BACKENDS[backend].launch(prog, args)
    assert out is cache  # donated: both inserts wrote into the caller's buffer
    x64 = reference.rms_norm(row[:, : H * D], w, eps=1e-6, group_size=D)
    y64 = reference.rope(row[:, H * D + GAP :], pos, table, head_dim=R, is_neox=False)
    assert compare(x, x64, head_dim=D).passed
    written = check_cache(out, before, x64, y64, slots, scale)
    assert int(written.sum()) == t - 2


def test_entry_fields_and_the_kernel_text():
    """The plan records the fields both inserts write into the one cache input; the kernel
    passes the 3-D cache's two strides and stores through one entry address per tile."""
    from fqr.lowering import kernel_source

    prog = program(torch.bfloat16)
    plan = plan_program(prog)
    cache = prog.inputs[4]
    assert [str(f) for f in plan.cache_fields[id(cache)]] == ["bf16[96]@16", "bf16[32]@112"]
    assert plan.cache_root(prog.outputs[1]) is cache
    src = kernel_source(prog, "interpret")
    assert "e_s0, e_s1, e_rows" in src.replace(",\n    ", ", ") and "e_s2" not in src
    assert src.count("* e_s0") == 1  # one entry address per token tile, for both inserts
    assert re.search(r"= \(erow\d+ \+ 16\) \+ hh \* 48", src)  # x: heads of 48 from 16
    assert re.search(r"= \(erow\d+ \+ 112\) \+ hh \* 32", src)


def test_the_plan_refuses_stores_it_cannot_fuse():
    cache3 = Aval(("B", BS, ENTRY), torch.bfloat16)
    cache4 = Aval(("B", BS, 1, 32), torch.bfloat16)
    x, slots = Aval(("T", 32), torch.bfloat16), Aval(("T",), torch.int64)

    def overlap(c, v, s):
        return ops.cache_insert(ops.cache_insert(c, v, s, column=0), v, s, column=16)

    with pytest.raises(PlanError, match="overlapping bytes of one cache entry"):
        plan_program(trace(overlap, cache3, x, slots))

    def fork(c, v, s):  # two updates of one cache value: the kernel has one buffer
        return ops.cache_insert(c, v, s, column=0), ops.cache_insert(c, v, s, column=64)

    with pytest.raises(PlanError, match="already updated by another store"):
        plan_program(trace(fork, cache3, x, slots))

    def both(c, v, s):  # the intermediate cache returned beside the final one
        first = ops.cache_insert(c, v, s, column=0)
        return first, ops.cache_insert(first, v, s, column=64)

    with pytest.raises(PlanError, match="cannot also be an output"):
        plan_program(trace(both, cache3, x, slots))

    def rows_twice(c, v, s):
        return ops.cache_insert(ops.cache_insert(c, v, s), v, s)

    with pytest.raises(PlanError, match="2 stores write whole rows of one cache"):
        plan_program(trace(rows_twice, cache4, x, slots))

    def disjoint(c, v, s):
        return ops.cache_insert(ops.cache_insert(c, v, s, column=64), v, s, column=0)

    fields = plan_program(trace(disjoint, cache3, x, slots)).cache_fields
    assert [str(f) for (f_list) in fields.values() for f in f_list] == [
        "bf16[32]@0",
        "bf16[32]@64",
    ]


def test_a_4d_insert_prints_and_plans_as_before():
    """The 4-D form has no column param (its program text, the kernel-cache key, is as it was)
    and writes whole rows."""
    prog = trace(
        ops.cache_insert,
        Aval(("B", BS, 2, 32), torch.bfloat16),
        Aval(("T", 64), torch.bfloat16),
        Aval(("T",), torch.int64),
        None,
    )
    assert "cache_insert[fp8=False] a b c _" in str(prog)
    assert plan_program(prog).cache_fields[id(prog.inputs[0])] == ()
