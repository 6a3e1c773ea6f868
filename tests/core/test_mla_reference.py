"""The float64 MLA formulation (``fqr.reference``: ``mla_kv``, ``mla_cache_entry``,
``ds_mla_entry``) against vLLM's math written out another way, and the ``fp8_ds_mla`` entry
comparison (``fqr.numerics.compare_ds_mla_entry``): it passes an entry encoded from the float64
expectation and fails each part corrupted past its bound."""

from __future__ import annotations

import pytest
import torch

from fqr import reference
from fqr.numerics import compare_ds_mla_entry
from fqr.rope_cache import rope_cos_sin_cache

Q, L, R, TILE = 96, 512, 64, 128
ENTRY = L + 4 * (L // TILE) + 2 * R  # 656 bytes


def test_mla_kv_is_vllms_math(gen):
    """q_c / kv_c: ``F.rms_norm`` over the whole width; k_pe: vLLM's GPT-J rotation
    (``apply_rotary_emb_torch``, is_neox_style=False: x1 = x[..., ::2], x2 = x[..., 1::2])."""
    t = 5
    kv_a = (torch.randn(t, Q + L + R, generator=gen) * 2).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (t,), generator=gen)
    table = rope_cos_sin_cache(R, 4096, 1e4)
    qw, kvw = (1 + torch.randn(n, generator=gen) * 0.2 for n in (Q, L))
    q_c, kv_c, k_pe = reference.mla_kv(
        kv_a, pos, table, qw, kvw, q_lora_rank=Q, kv_lora_rank=L, eps=1e-6
    )
    x = kv_a.double()
    for got, part, w in ((q_c, x[:, :Q], qw), (kv_c, x[:, Q : Q + L], kvw)):
        want = torch.nn.functional.rms_norm(part, (part.shape[1],), w.double(), eps=1e-6)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    cos, sin = table[pos].double().chunk(2, dim=-1)
    x1, x2 = x[:, Q + L :: 2], x[:, Q + L + 1 :: 2]
    want = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    torch.testing.assert_close(k_pe, want, rtol=1e-12, atol=1e-12)
    none, kv_c2, _ = reference.mla_kv(
        kv_a[:, Q:], pos, table, None, kvw, q_lora_rank=0, kv_lora_rank=L, eps=1e-6
    )
    assert none is None and torch.equal(kv_c2, kv_c)


def test_mla_cache_entry_places_kv_c_then_k_pe(gen):
    cache = torch.randn(2, 4, L + R, generator=gen).to(torch.float8_e4m3fn)
    kv_c, k_pe = torch.randn(3, L, generator=gen) * 50, torch.randn(3, R, generator=gen)
    slots = torch.tensor([5, -1, 0])
    expected, written = reference.mla_cache_entry(
        cache, kv_c, k_pe, slots, scale=torch.tensor([0.1])
    )
    assert written.tolist() == [[True, False, False, False], [False, True, False, False]]
    want = (torch.cat([kv_c[0], k_pe[0]]).double() / float(torch.tensor(0.1))).clamp(-448, 448)
    torch.testing.assert_close(expected[1, 1], want, rtol=1e-15, atol=0)
    assert torch.equal(expected[~written], cache[~written].double())


def _ds_problem(gen, t=4):
    kv_c = torch.randn(t, L, generator=gen) * torch.tensor(
        [0.01, 1.0, 30.0, 1e3]
    ).repeat_interleave(TILE)
    kv_c[0, :TILE] = 0.0  # an all-zero tile: the scale floor FLT_MIN, values 0
    k_pe = torch.randn(t, R, generator=gen).to(torch.bfloat16)
    cache = torch.randint(0, 256, (3, 4, ENTRY), dtype=torch.uint8, generator=gen)
    slots = torch.tensor([7, -1, 0, 11])[:t]
    return kv_c, k_pe, cache, slots


def _encode(cache, expected, rope_dtype):
    """The cache a correct store would leave: each written entry encoded from the float64
    expectation (values and scales correctly rounded), by plain byte arithmetic."""
    out = cache.clone()
    n, tiles = expected.values.shape[-1], expected.scales.shape[-1]
    for b, r in expected.written.nonzero().tolist():
        out[b, r, :n] = expected.values[b, r].to(torch.float8_e4m3fn).view(torch.uint8)
        out[b, r, n : n + 4 * tiles] = expected.scales[b, r].float().view(torch.uint8)
        rope = expected.rope[b, r].to(rope_dtype).view(torch.uint8)
        out[b, r, expected.rope_offset : expected.rope_offset + rope.numel()] = rope
    return out


def test_ds_mla_entry_and_its_comparison(gen):
    kv_c, k_pe, cache, slots = _ds_problem(gen)
    expected = reference.ds_mla_entry(cache, kv_c, k_pe, slots, tile=TILE)
    assert (expected.scale_offset, expected.rope_offset) == (512, 528)
    b, r = 7 // 4, 7 % 4
    assert expected.scales[b, r, 0] == reference.FLT_MIN and not expected.values[b, r, :TILE].any()
    amax = kv_c[0, TILE : 2 * TILE].double().abs().max()
    assert expected.scales[b, r, 1] == amax / 448
    assert expected.values[b, r].abs().max() == 448  # each tile's largest value maps to 448
    good = _encode(cache, expected, torch.bfloat16)
    c = compare_ds_mla_entry(good, cache, expected, rope_dtype=torch.bfloat16)
    assert c.passed, c

    def corrupted(start, dtype, steps):
        bad = good.clone()
        size = torch.empty(0, dtype=dtype).element_size()
        at = (
            bad[b, r, start : start + size]
            .clone()
            .view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[size])
        )
        bad[b, r, start : start + size] = (at + steps).view(torch.uint8)
        return compare_ds_mla_entry(bad, cache, expected, rope_dtype=torch.bfloat16)

    # a value byte below the largest magnitude (0x7E, 448: one step up from it is NaN)
    at = TILE + next(i for i in range(TILE) if 0 < int(good[b, r, TILE + i]) & 0x7F < 0x7D)
    assert corrupted(at, torch.uint8, 1).passed  # one E4M3 step: within the contract
    assert not corrupted(at, torch.uint8, 2).parts["values"].passed
    assert corrupted(512 + 4, torch.float32, 4).passed  # the fp32 contract: 2^-16 relative
    assert not corrupted(512 + 4, torch.float32, 1000).parts["scales"].passed
    assert not corrupted(528 + 10, torch.int16, 2).parts["rope"].passed
    bad = good.clone()
    bad[0, 1, 100] ^= 1  # an entry no slot names
    c = compare_ds_mla_entry(bad, cache, expected, rope_dtype=torch.bfloat16)
    assert not c.untouched_equal and not c.passed


def test_ds_mla_entry_refuses_a_wrong_layout(gen):
    kv_c, k_pe, cache, slots = _ds_problem(gen)
    with pytest.raises(ValueError, match="is 656 bytes, the cache's is 655"):
        reference.ds_mla_entry(cache[..., :655], kv_c, k_pe, slots)
