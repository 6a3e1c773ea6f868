"""The byte-layout cache ops (``fqr.ops.cache_insert_fp8_tiles``, ``cache_insert_bytes``) run
eagerly against the float64 ``fp8_ds_mla`` expectation (``fqr.reference.ds_mla_entry``),
decoded part by part (``fqr.numerics.compare_ds_mla_entry``); their shape rules name the bad
argument; their facts declare the entry fields they write."""

from __future__ import annotations

import pytest
import torch

from fqr import ops, reference
from fqr.core import Aval, trace
from fqr.numerics import compare_ds_mla_entry

L, R, TILE = 512, 64, 128
ENTRY = L + 4 * (L // TILE) + 2 * R  # 656: DeepSeek-V3.2's fp8_ds_mla entry


@pytest.mark.parametrize("rope_dtype", [torch.bfloat16, torch.float16])
def test_eager_ds_mla_entry_against_float64(gen, rope_dtype):
    t = 6
    magnitudes = torch.tensor([0.01, 1.0, 30.0, 1e3]).repeat_interleave(TILE)
    kv_c = (torch.randn(t, L, generator=gen) * magnitudes).to(rope_dtype)
    kv_c[2, 2 * TILE : 3 * TILE] = 0  # a zero tile: scale FLT_MIN
    k_pe = torch.randn(t, R, generator=gen).to(rope_dtype)
    cache = torch.randint(0, 256, (3, 4, ENTRY), dtype=torch.uint8, generator=gen)
    slots = torch.tensor([7, -1, 0, 11, 3, -1])
    out = ops.cache_insert_fp8_tiles(cache, kv_c, slots, tile=TILE, offset=0, scale_offset=L)
    out = ops.cache_insert_bytes(out, k_pe, slots, offset=L + 16, dtype=rope_dtype)
    assert out.dtype == torch.uint8 and out.shape == cache.shape
    expected = reference.ds_mla_entry(cache, kv_c, k_pe, slots, tile=TILE)
    c = compare_ds_mla_entry(out, cache, expected, rope_dtype=rope_dtype)
    assert c.passed, c
    assert c.parts["rope"].max_ulp == 0  # a copy of 16-bit values


def test_bytes_store_fp32_at_an_aligned_offset(gen):
    x = torch.randn(3, 5, generator=gen)
    cache = torch.randint(0, 256, (2, 2, 40), dtype=torch.uint8, generator=gen)
    out = ops.cache_insert_bytes(cache, x, torch.tensor([2, -1, 1]), offset=12, dtype=torch.float32)
    assert torch.equal(out[1, 0, 12:32].view(torch.float32), x[0])
    assert torch.equal(out[0, 1, 12:32].view(torch.float32), x[2])
    keep = torch.ones_like(out, dtype=torch.bool)
    keep[1, 0, 12:32] = keep[0, 1, 12:32] = False
    assert torch.equal(out[keep], cache[keep])


def test_shape_rules_name_the_argument():
    cache = Aval(("B", 16, ENTRY), torch.uint8)
    x, pe, slots = (
        Aval(("T", L), torch.bfloat16),
        Aval(("T", R), torch.bfloat16),
        Aval(("T",), torch.int64),
    )

    def tiles(c=cache, v=x, **kw):
        params = {"tile": TILE, "offset": 0, "scale_offset": L, **kw}
        return trace(lambda a, b, s: ops.cache_insert_fp8_tiles(a, b, s, **params), c, v, slots)

    def raw(c=cache, v=pe, **kw):
        params = {"offset": 528, "dtype": torch.bfloat16, **kw}
        return trace(lambda a, b, s: ops.cache_insert_bytes(a, b, s, **params), c, v, slots)

    tiles(), raw()  # fine
    with pytest.raises(ValueError, match="cache must be a uint8"):
        tiles(c=Aval(("B", 16, ENTRY), torch.bfloat16))
    with pytest.raises(ValueError, match="tile must be an int >= 1 that divides the width 512"):
        tiles(tile=96)
    with pytest.raises(ValueError, match="scale_offset 510 must be a multiple of"):
        tiles(scale_offset=510)
    with pytest.raises(ValueError, match="past the 656-byte entry"):
        tiles(scale_offset=644)
    with pytest.raises(ValueError, match="overlap"):
        tiles(scale_offset=500)
    with pytest.raises(TypeError, match="dtype must be bf16, fp16 or fp32"):
        raw(dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="offset 527 must be a multiple of"):
        raw(offset=527)
    with pytest.raises(ValueError, match="end at byte 658, past the 656-byte entry"):
        raw(offset=530)
    with pytest.raises(TypeError, match="slot_mapping must be int32 or int64"):
        trace(
            lambda a, b, s: ops.cache_insert_bytes(a, b, s, offset=0, dtype=torch.float32),
            cache,
            pe,
            Aval(("T",), torch.float32),
        )


def test_facts_declare_the_fields():
    cache = Aval(("B", 16, ENTRY), torch.uint8)
    x, slots = Aval(("T", L), torch.bfloat16), Aval(("T",), torch.int64)
    facts = ops.cache_insert_fp8_tiles_p.facts(cache, x, slots, tile=TILE, offset=0, scale_offset=L)
    assert [str(f) for f in facts.fields] == ["fp8e4m3[512]@0", "fp32[4]@512"]
    assert facts.head_dim == TILE  # one tile per head of the value in a fused kernel
    facts = ops.cache_insert_bytes_p.facts(cache, x, slots, offset=0, dtype=torch.float16)
    assert [str(f) for f in facts.fields] == ["fp16[512]@0"] and facts.head_dim is None
