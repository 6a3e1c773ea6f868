"""The Multi-head Latent Attention KV prologue as the public op composes it, for the lowering
tests (:func:`mla_program` traces the declaration's own composition): vLLM's ``mla.py`` after
the fused ``q_a`` / ``kv_a`` projection, ``[q_c | kv_c | k_pe]`` (DeepSeek-V3: 1536 + 512 +
64; V2-Lite without q_c), ``q_c`` and ``kv_c`` RMS-normalised over their whole width,
``k_pe`` one 64-wide head rotated GPT-J style, ``[kv_c | k_pe]`` written into the paged MLA
cache through the slot mapping: in the model dtype or FP8 E4M3 with a per-tensor scale
(``concat_and_cache_mla``), or DeepSeek-V3.2's ``fp8_ds_mla`` byte entry
(``concat_and_cache_ds_mla``). Fresh inputs (:func:`draw`) and the check of a cache against
the float64 formulation (:func:`check_cache`) beside it."""

from __future__ import annotations

import torch

from fqr import reference
from fqr.core import Aval, trace
from fqr.numerics import compare, compare_ds_mla_entry
from fqr.prologue.mla_kv import TILE, ds_mla_entry_bytes, mla_kv_prologue
from fqr.rope_cache import rope_cos_sin_cache

E4M3 = torch.float8_e4m3fn
Q_LORA, KV_LORA, ROPE = 1536, 512, 64  # DeepSeek-V3 / R1
BLOCKS, BLOCK_SIZE = 3, 4
EPS = 1e-6
FLAVOURS = ("auto", "fp8", "fp8_ds_mla")


def cache_aval(flavour: str, dtype: torch.dtype, kv_lora: int, rope_dim: int) -> Aval:
    if flavour == "fp8_ds_mla":
        return Aval(("B", BLOCK_SIZE, ds_mla_entry_bytes(kv_lora, rope_dim)), torch.uint8)
    return Aval(("B", BLOCK_SIZE, kv_lora + rope_dim), E4M3 if flavour == "fp8" else dtype)


def mla_program(flavour: str, dtype=torch.bfloat16, q_lora=Q_LORA, kv_lora=KV_LORA, rope=ROPE):
    """The public MLA op's own composition (:func:`fqr.prologue.mla_kv.mla_kv_prologue`) traced
    for ``flavour``: outputs ``(q_c, kv_c, k_pe, cache)``, without q_c when ``q_lora`` is 0."""
    return trace(
        mla_kv_prologue,
        Aval(("T", q_lora + kv_lora + rope), dtype),
        Aval(("T",), torch.int64),
        Aval(("P", rope), torch.float32),
        Aval((q_lora,), dtype) if q_lora else None,
        Aval((kv_lora,), dtype),
        cache_aval(flavour, dtype, kv_lora, rope),
        Aval(("T",), torch.int64),
        Aval((1,), torch.float32) if flavour == "fp8" else None,
        None,  # quant_scale_q: q_c in the model dtype
        None,  # kpe_cache: the one combined entry
        q_lora_rank=q_lora,
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope,
        eps=EPS,
        is_neox=False,
        numerics="fused",
        kv_cache_dtype={"fp8": "fp8_e4m3"}.get(flavour, flavour),
    )


def draw(gen, flavour, dtype, q_lora, tokens=5):
    """Fresh inputs: the projection row, positions in a real (DeepSeek-sized) table, weights,
    a cache of random values or bytes, slots with two paddings, the FP8 scale."""
    width = q_lora + KV_LORA + ROPE
    kv_a = (torch.randn(tokens, width, generator=gen, device=gen.device) * 2).to(dtype)
    kv_a[:, q_lora + 2 * TILE : q_lora + 3 * TILE] *= 40  # tiles of different magnitudes
    positions = torch.randint(0, 4096, (tokens,), generator=gen, device=gen.device)
    table = rope_cos_sin_cache(ROPE, 4096, 1e4, rows=torch.arange(4096, device=gen.device))
    q_w = (
        (1 + torch.randn(q_lora, generator=gen, device=gen.device) * 0.2).to(dtype)
        if q_lora
        else None
    )
    kv_w = (1 + torch.randn(KV_LORA, generator=gen, device=gen.device) * 0.2).to(dtype)
    shape = cache_aval(flavour, dtype, KV_LORA, ROPE).shape
    shape = (BLOCKS, *shape[1:])
    if flavour == "fp8_ds_mla":
        cache = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen, device=gen.device)
    else:
        cache = (torch.randn(shape, generator=gen, device=gen.device) * 3).to(
            E4M3 if flavour == "fp8" else dtype
        )
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=gen, device=gen.device)[:tokens]
    slots[[1, tokens - 1]] = -1
    scale = (
        torch.tensor([0.008], device=gen.device) if flavour == "fp8" else None
    )  # some values saturate
    return kv_a, positions, table, q_w, kv_w, cache, slots, scale


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.int8, 2: torch.int16}[x.element_size()])


def check_cache(flavour, out, before, kv_c, k_pe, slots, scale, dtype):
    """The cache against float64: every written entry's parts under the contract, every
    other entry bit for bit."""
    if flavour == "fp8_ds_mla":
        expected = reference.ds_mla_entry(before, kv_c, k_pe, slots, tile=TILE)
        c = compare_ds_mla_entry(out, before, expected, rope_dtype=dtype)
        assert c.passed, c
        return int(expected.written.sum())
    expected, written = reference.mla_cache_entry(before, kv_c, k_pe, slots, scale=scale)
    for cols, head_dim in ((slice(0, KV_LORA), KV_LORA), (slice(KV_LORA, None), ROPE)):
        c = compare(out[written][:, cols], expected[written][:, cols], head_dim=head_dim)
        assert c.passed, (cols, c)
    assert torch.equal(bits(out[~written]), bits(before[~written]))
    return int(written.sum())
