"""vLLM's ``tests/kernels/attention/test_cache.py``, its ``test_reshape_and_cache_flash`` cases,
ported onto :func:`fqr.kv_cache_insert` (vLLM's ``reshape_and_cache_flash``: same argument
order), on the reference and interpret backends.

The peer: ``key`` / ``value`` are ``[T, H, D]`` views of a ``[T, 3, H, D]`` qkv (rows at stride
``3*H*D``); the caches come from ``kv_cache_factory_flashinfer``, the key and value halves of
one ``[num_blocks, 2, block_size, H, D]`` buffer (layout ``NHC``) or of one ``[num_blocks, 2,
H, block_size, D]`` buffer permuted to ``[.., block_size, H, D]`` (``HNC``), random values;
``kv_cache_dtype`` ``"auto"`` (the model dtype) or ``"fp8"`` (uint8 bytes of E4M3, per-tensor
``k_scale = key.amax() / 64``); its reference writes each token's raw key / value into a copy
of the cache (dequantised to fp16 for FP8) and compares with ``assert_close`` at torch's
default tolerance ("auto") or ``atol=0.001, rtol=0.1`` (FP8, after dequantising fqr's cache as
``e4m3 * scale``). Kept as it is here, and fqr's cache is also held to the float64
formulation (:func:`fqr.reference.kv_cache_insert`): bit for bit for "auto" (a copy), <= 1
E4M3 ULP of the clamped ``x / scale`` for FP8.

Peer grid: 864 cases (head_size 64/80/256 x block_size 8/16/32 x num_blocks 1024/10000 (halved
by the test) x dtype bf16/fp32 x kv_cache_dtype auto/fp8/nvfp4 x layout NHC/HNC x
kv_scale_type tensor/attn_head x implementation cuda/triton). Expressed: kv_cache_dtype auto
and fp8 with per-tensor scales, both layouts, both implementations (one fqr op: the peer
itself skips triton x HNC): 216 of the peer's runs, 144 distinct calls; with "auto" the
attn_head scales are unused by vLLM (ported as the tensor case: 72 more runs, same calls).
Here: 18 of the 72 calls (every head_size x block_size x kv_cache_dtype, dtype and layout
alternating) with a num_blocks 4 cache on the reference backend, a sample of 6 at 9 tokens on
interpret; the GPU file runs the 144 at the peer's sizes on triton. Not expressed: NVFP4
(288 cases: fqr has no FP4 cache), per-head FP8 scales (``attn_head`` with fp8, 72 cases:
fqr's scale is per tensor, ``[1]``), and ``test_reshape_and_cache`` (the paged-attention v1
layout ``[blocks, H, D/x, block_size, x]``, whose head_dim is split across two dims: no
strided view of a ``[blocks, block_size, H, D]`` cache).
"""

from __future__ import annotations

import pytest
import torch
from support.devices import has_values
from support.peer_caches import Draws, on_device
from support.peer_ports import INTERPRET, case_id, grid, spread

import fqr
from fqr import reference
from fqr.numerics import compare

NUM_HEADS = 8
NUM_TOKENS = 21  # the peer's 42, halved by test_reshape_and_cache_flash
PEER_GRID = grid(
    head_size=[64, 80, 256],
    block_size=[8, 16, 32],
    num_blocks=[512, 5000],  # the peer's [1024, 10000], halved by the test
    dtype=[torch.bfloat16, torch.float32],
    kv_cache_dtype=["auto", "fp8"],
    layout=["NHC", "HNC"],
)
CPU_BLOCKS = 4  # 32+ rows for 21 tokens: the CPU cases' caches
# Every head_size x block_size x kv_cache_dtype once, the dtype and the layout cycling so
# that every kv_cache_dtype x dtype x layout is met twice: 18 of the 72 calls of one cache size
CPU_GRID = [
    dict(
        c,
        num_blocks=CPU_BLOCKS,
        dtype=(torch.bfloat16, torch.float32)[n // 2 % 2],
        layout=("NHC", "HNC")[n // 4 % 2],
    )
    for n, c in enumerate(
        c
        for c in PEER_GRID
        if c["num_blocks"] == 512 and c["dtype"] == torch.bfloat16 and c["layout"] == "NHC"
    )
]
INTERPRET_GRID = [dict(c, tokens=9) for c in spread(CPU_GRID, 6)]
E4M3 = torch.float8_e4m3fn


def flash_caches(blocks, block_size, heads, head_size, kv_cache_dtype, dtype, layout, draws):
    """vLLM's ``kv_cache_factory_flashinfer`` for one layer: the key and value halves of one
    buffer, ``[num_blocks, block_size, H, D]`` views (``HNC``: of a head-major buffer),
    random values (``fp8``: uint8 bytes of random E4M3 values), as ``draws`` says."""
    if layout == "NHC":
        shape, order = (blocks, 2, block_size, heads, head_size), (0, 1, 2, 3, 4)
    else:
        shape, order = (blocks, 2, heads, block_size, head_size), (0, 1, 3, 2, 4)
    values = torch.randn(shape, generator=draws.generator, device=draws.device)
    buffer = values.to(E4M3).view(torch.uint8) if kv_cache_dtype == "fp8" else values.to(dtype)
    kv = buffer.permute(order)
    return kv[:, 0], kv[:, 1]


def dequantize(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The peer's ``convert_fp8_local``, per tensor: E4M3 bytes times the scale, in fp16."""
    return (cache.view(E4M3).to(torch.float32) * scale).to(torch.float16)


def check_case(case: dict, backend: str, gen, device: str = "cpu") -> None:
    """One call of the peer's grid (``tokens``: 21 unless the case says)."""
    run_reshape_and_cache_flash(
        on_device(gen, device), backend, case["head_size"], case["block_size"],
        case["num_blocks"], case["dtype"], case["kv_cache_dtype"], case["layout"],
        case.get("tokens", NUM_TOKENS),
    )  # fmt: skip


def run_reshape_and_cache_flash(draws: Draws, backend, head_size, block_size, blocks, dtype,
                                kv_cache_dtype, layout, tokens=NUM_TOKENS):  # fmt: skip
    """The peer's test body on fqr, inputs as ``draws`` says (on ``meta``: the op runs,
    nothing is compared)."""
    gen, device = draws.generator, draws.device
    slots = torch.randperm(blocks * block_size, generator=gen, device=device)[:tokens].long()
    qkv = torch.randn(tokens, 3, NUM_HEADS, head_size, generator=gen, device=device).to(dtype)
    _, key, value = qkv.unbind(dim=1)
    key_cache, value_cache = flash_caches(
        blocks, block_size, NUM_HEADS, head_size, kv_cache_dtype, dtype, layout, draws
    )
    fp8 = kv_cache_dtype == "fp8"
    k_scale = (key.amax() / 64.0).to(torch.float32).reshape(1) if fp8 else None
    v_scale = (value.amax() / 64.0).to(torch.float32).reshape(1) if fp8 else None
    before_key, before_value = key_cache.clone(), value_cache.clone()

    result = fqr.kv_cache_insert(
        key, value, key_cache, value_cache, slots, kv_cache_dtype, k_scale, v_scale,
        backend=backend,
    )  # fmt: skip
    assert result is None  # the caches are updated in place, as vLLM's op does
    if not has_values(key_cache, value_cache):
        return

    # the peer's reference: the raw values put into (a dequantised) copy of the cache
    if fp8:
        want_key = dequantize(before_key, k_scale)
        want_value = dequantize(before_value, v_scale)
    else:
        want_key, want_value = before_key.clone(), before_value.clone()
    exact_key, exact_value = reference.kv_cache_insert(
        key, value, before_key, before_value, slots, k_scale=k_scale, v_scale=v_scale
    )
    for i, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        want_key[block, offset] = key[i].to(want_key.dtype)
        want_value[block, offset] = value[i].to(want_value.dtype)

    if fp8:
        got_key, got_value = dequantize(key_cache, k_scale), dequantize(value_cache, v_scale)
        torch.testing.assert_close(got_key, want_key, atol=0.001, rtol=0.1)
        torch.testing.assert_close(got_value, want_value, atol=0.001, rtol=0.1)
    else:
        torch.testing.assert_close(key_cache, want_key)
        torch.testing.assert_close(value_cache, want_value)
    # against float64: the stored rows (a copy; <= 1 E4M3 ULP of x / scale), the rest untouched
    written = torch.zeros(blocks * block_size, dtype=torch.bool, device=device)
    written[slots] = True
    width = (-1, NUM_HEADS * head_size)
    for name, cache, exact, before in (
        ("key_cache", key_cache, exact_key, before_key),
        ("value_cache", value_cache, exact_value, before_value),
    ):
        typed = cache.view(E4M3) if fp8 else cache
        rows, exact_rows = typed.reshape(width), exact.reshape(width)
        c = compare(rows[written], exact_rows[written], head_dim=head_size, bitwise=not fp8)
        assert c.passed, f"{name}: {c}"
        assert torch.equal(cache.reshape(width)[~written], before.reshape(width)[~written])


@pytest.mark.parametrize("case", CPU_GRID, ids=case_id)
def test_reshape_and_cache_flash_reference(gen, case):
    """The peer's grid (per-tensor scales), sampled, on a 4-block cache, reference backend."""
    check_case(case, "reference", gen)


@pytest.mark.parametrize("backend", [INTERPRET])
@pytest.mark.parametrize("case", INTERPRET_GRID, ids=case_id)
def test_reshape_and_cache_flash_interpret(gen, case, backend):
    """A sample of the peer's grid through the generated kernel (interpreted, 9 tokens)."""
    check_case(case, backend, gen)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_a_shorter_slot_mapping_stores_its_tokens_only(gen, backend):
    """Issue 26.4 on the insert alone (vLLM's op takes the token count from the slot mapping):
    ``key [T]`` with ``slot_mapping [N]``, N < T: the first N tokens are stored, the padded
    rows are not."""
    tokens, n, head_size, block_size = 9, 6, 64, 8
    key = torch.randn(tokens, NUM_HEADS, head_size, generator=gen, device=gen.device).bfloat16()
    value = torch.randn(tokens, NUM_HEADS, head_size, generator=gen, device=gen.device).bfloat16()
    key_cache, value_cache = flash_caches(
        4, block_size, NUM_HEADS, head_size, "auto", torch.bfloat16, "NHC", on_device(gen, "cpu")
    )
    slots = torch.randperm(4 * block_size, generator=gen, device=gen.device)[:n]
    slots[2] = -1
    exact = reference.kv_cache_insert(key, value, key_cache, value_cache, slots)
    fqr.kv_cache_insert(key, value, key_cache, value_cache, slots, backend=backend)
    assert torch.equal(key_cache.double(), exact[0])
    assert torch.equal(value_cache.double(), exact[1])
    rows = key_cache.reshape(-1, NUM_HEADS, head_size)
    for t in range(n):
        if slots[t] >= 0:
            assert torch.equal(rows[slots[t]], key[t])
