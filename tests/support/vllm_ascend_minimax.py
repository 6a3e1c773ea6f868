"""vllm-ascend's ``tests/e2e/pull_request/one_card/test_minimax_qknorm_rope_cache.py`` ported
onto fqr (issue 26, item 8): the peer's four tests as functions any backend runs (the CPU port
``tests/peers/test_vllm_ascend_minimax_qknorm_rope_cache.py``, the GPU file
``tests/gpu/test_gpu_peers_minimax.py``, the Ascend interpreter sample).

The peer's ``reference`` (Gemma ``(1 + w)`` norms rounded to the activation dtype before RoPE,
as the peer's reference and kernel round there) is re-written in float64, its tolerances kept
(atol 0.032 / rtol 0.01; FP8 0.25), untouched cache rows compared bit for bit; fqr is called
through :func:`fqr.minimax_qknorm_rope_cache` exactly as the peer calls its op, and every call of
the grid and replay tests is also checked against fqr's float64 reference
(:func:`fqr.reference.index_cache_prologue`, the numerics contract). Inputs are fresh
random values; the RoPE tables are real ones (:func:`fqr.rope_cache.rope_cos_sin_cache`,
MiniMax-M3's theta) in the peer's table dtype where the peer draws random angles or numbers, so
every rotation is a real one. On ``meta`` (the bundle build) every call runs and no value is
checked (:func:`support.devices.has_values`).
"""

from __future__ import annotations

from functools import lru_cache

import torch

import fqr
from fqr import reference
from fqr.rope_cache import rope_cos_sin_cache
from support.devices import has_values
from support.peer_ports import assert_exact

THETA = 5e6  # MiniMax-M3's rope_theta (fqr.presets, minimax-m3)
E4M3 = torch.float8_e4m3fn


@lru_cache(maxsize=8)
def real_table(rotary_dim: int, max_position: int, dtype: torch.dtype) -> torch.Tensor:
    """A real RoPE table ``[max_position, rotary_dim]`` rounded once to ``dtype`` (cached)."""
    return rope_cos_sin_cache(rotary_dim, max_position, THETA).to(dtype)


def _neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of the first ``2 * cos.shape[-1]`` features of ``x [T, H, D]`` (float64)
    by per-token ``cos``, ``sin [T, r/2]``; the rest passes through."""
    h = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :h], x[..., h : 2 * h]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * h :]], dim=-1)


def assert_close_as_peer(name: str, got, want, atol: float, rtol: float) -> None:
    """``torch.testing.assert_close`` with the peer's tolerances, the output named (nothing to
    check on ``meta``)."""
    if not has_values(got, want):
        return
    torch.testing.assert_close(
        got, want.to(got.device, got.dtype), atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}"
    )


# ------------------------------------------------------------------- minimax_qknorm_rope_cache


def check_exact(packed, table, positions, weights, heads, before, slots, actual, outs) -> tuple:
    """fqr's own check of one call: ``outs = (q, index_q, key, value, index cache)`` against the
    float64 formulation (:func:`fqr.reference.index_cache_prologue`) of the packed row, the
    caches ``before`` the call and the slot mappings ``slots`` (main, index) with the tokens
    past ``actual`` storing nothing. Returns that float64 formulation's outputs."""
    tokens, device = packed.shape[0], packed.device  # computed where the data is

    def mapping(m):
        full = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        full[:actual] = m[:actual]
        return full

    q_heads, kv_heads, index_heads = heads
    exact = reference.index_cache_prologue(
        packed, positions.to(device), table.to(device), *(w.to(device) for w in weights),
        *(c.to(device) for c in before), mapping(slots[0]), mapping(slots[1]), num_heads=q_heads,
        num_kv_heads=kv_heads, head_dim=HD, num_index_heads=index_heads, index_head_dim=HD,
        eps=EPS,
    )  # fmt: skip
    names = ("q", "index_q", "key_cache", "value_cache", "index_cache")
    for name, out, want in zip(names, outs, exact):
        assert_exact(name, out, want, head_dim=HD)
    return exact


def assert_fp8_close_or_nearer(name, got, peer, exact) -> None:
    """The peer's FP8 check (atol 0.25), or, for an element outside it, fqr's value nearer the
    float64 value (saturated to +-448) than the peer's reference: that reference rounds the norm
    to bf16 before RoPE and then to E4M3, a double rounding that can land one E4M3 step away
    (0.5 for ``|x|`` in [4, 8)) where fqr rounds once."""
    g, p = got.double(), peer.to(got.device).double()
    e = exact.to(got.device).double().clamp(-448.0, 448.0)
    outside = (g - p).abs() > FP8_ATOL + CACHE_RTOL * p.abs()
    nearer = (g - e).abs() <= (p - e).abs()
    assert bool(nearer[outside].all()), (
        f"{name}: {int(outside.sum())} elements outside the peer's tolerance, "
        f"{int((outside & ~nearer).sum())} of them no nearer the float64 value than the peer's"
    )


CACHE_ATOL, CACHE_RTOL, FP8_ATOL = 0.032, 0.01, 0.25
CACHE_TOKENS = [1, 4, 8, 16, 32, 64, 128, 192, 256, 513]
CACHE_HEADS = [(8, 1, 1), (16, 2, 2), (5, 1, 3)]
CACHE_ROTARY = [64, 128]
HD, EPS = 128, 1e-6


def peer_cache_reference(packed, table, positions, weights, q_heads, kv_heads, index_heads, eps):
    """The peer's ``reference``: split in five by ``head_dim``, Gemma ``x * rsqrt(mean(x^2) +
    eps) * (1 + w)`` per head of q, k, index_q, index_k, **rounded to the activation dtype**
    (the peer's ``x.to(packed.dtype)``), then NeoX RoPE over the table's width R in float64 (the
    peer: fp32). Returns ``[q, k, v, index_q, index_k]`` (float64; v as given)."""
    head_dim = weights[0].numel()
    sizes = [q_heads, kv_heads, kv_heads, index_heads, 1]
    parts = list(packed.split([n * head_dim for n in sizes], -1))
    half = table.shape[-1] // 2
    rows = table.double()[positions.long()]
    for part, weight in zip((0, 1, 3, 4), weights):
        x = parts[part].reshape(packed.shape[0], -1, head_dim).double()
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * (1 + weight.double())
        x = x.to(packed.dtype).double()
        parts[part] = _neox(x, rows[:, :half], rows[:, half:]).reshape(packed.shape[0], -1)
    return parts


def _assert_close(name, got, want, atol=CACHE_ATOL):
    assert_close_as_peer(name, got.float(), want.float(), atol, CACHE_RTOL)


def run_cache_case(tokens, heads, rotary_dim, backend, gen, device="cpu") -> None:
    """One case of the peer's ``test_minimax_qknorm_rope_cache``: a padded token stride, slot
    mappings of ``num_actual_tokens = max(1, T - 3)`` entries (every 5th / 7th negative), caches
    full of sentinels, the index projection separate for even T."""
    q_heads, kv_heads, index_heads = heads
    block_size = 16
    total_heads = q_heads + 2 * kv_heads + index_heads + 1
    width = total_heads * HD
    packed = torch.randn((tokens, width + 32), generator=gen, device=gen.device).to(torch.bfloat16)[
        :, :width
    ]
    weights = [
        torch.randn(HD, generator=gen, device=gen.device).to(torch.bfloat16) * 0.1 for _ in range(4)
    ]
    table = real_table(rotary_dim, 257, torch.bfloat16).to(gen.device)
    positions = torch.randint(257, (tokens,), generator=gen, device=gen.device)
    actual = max(1, tokens - 3)
    blocks = (2 * tokens + block_size - 1) // block_size
    slots = torch.randperm(blocks * block_size, generator=gen, device=gen.device)[:actual].long()
    index_slots = torch.randperm(blocks * block_size, generator=gen, device=gen.device)[
        :actual
    ].long()
    slots[::5] = -1
    index_slots[::7] = -1
    key_cache = torch.full((blocks, block_size, kv_heads, HD), -3.0, dtype=torch.bfloat16)
    key_cache = key_cache.to(device)
    value_cache = torch.full_like(key_cache, -4.0)
    index_cache = torch.full((blocks, block_size, HD), -5.0, dtype=torch.bfloat16, device=device)
    before = [c.clone() for c in (key_cache, value_cache, index_cache)]
    packed_dev = torch.empty((tokens, width + 32), dtype=packed.dtype, device=device)[:, :width]
    packed_dev.copy_(packed)
    main_width = (q_heads + 2 * kv_heads) * HD
    separate_index = tokens % 2 == 0
    q, iq = fqr.minimax_qknorm_rope_cache(
        packed_dev[:, :main_width] if separate_index else packed_dev,
        table.to(device),
        positions.to(device),
        *[w.to(device) for w in weights],
        key_cache,
        value_cache,
        index_cache,
        slots.to(device),
        index_slots.to(device),
        actual,
        q_heads,
        kv_heads,
        index_heads,
        EPS,
        index_packed=packed_dev[:, main_width:] if separate_index else None,
        backend=backend,
    )
    if not has_values(q, iq, key_cache, value_cache, index_cache):
        return
    expected = peer_cache_reference(packed, table, positions, weights, *heads, EPS)
    _assert_close("q", q, expected[0].to(q.dtype))
    _assert_close("index_q", iq, expected[3].to(iq.dtype))
    for name, cache, part, mapping, sentinel in (
        ("key_cache", key_cache, expected[1], slots, -3.0),
        ("value_cache", value_cache, expected[2], slots, -4.0),
        ("index_cache", index_cache, expected[4], index_slots, -5.0),
    ):
        gold = torch.full(cache.shape, sentinel, dtype=cache.dtype, device=cache.device)
        gold = gold.view(blocks * block_size, -1)
        mapping = mapping.to(cache.device)
        valid = mapping >= 0
        gold[mapping[valid]] = part[:actual].to(cache.device)[valid].to(cache.dtype)
        _assert_close(name, cache.reshape_as(gold), gold)
        untouched = torch.ones(blocks * block_size, dtype=torch.bool, device=cache.device)
        untouched[mapping[valid]] = False
        assert torch.equal(cache.view(blocks * block_size, -1)[untouched], gold[untouched])
    outs = (q, iq, key_cache, value_cache, index_cache)
    mappings = (slots, index_slots)
    check_exact(packed, table, positions, weights, heads, before, mappings, actual, outs)


def run_empty_case(backend, device="cpu") -> None:
    """The peer's ``test_empty_minimax_qknorm_rope_cache``: no tokens, no store."""
    weight = torch.zeros(128, dtype=torch.bfloat16, device=device)
    cache = torch.zeros((1, 16, 1, 128), dtype=torch.bfloat16, device=device)
    index_cache = torch.zeros((1, 16, 128), dtype=torch.bfloat16, device=device)
    slots = torch.empty(0, dtype=torch.int64, device=device)
    q, iq = fqr.minimax_qknorm_rope_cache(
        torch.empty((0, 12 * 128), dtype=torch.bfloat16, device=device),
        real_table(64, 16, torch.bfloat16).to(device),
        slots,
        weight,
        weight,
        weight,
        weight,
        cache,
        cache.clone(),
        index_cache,
        slots,
        slots,
        0,
        8,
        1,
        1,
        1e-6,
        backend=backend,
    )
    assert q.shape == (0, 1024) and iq.shape == (0, 128)
    if has_values(cache, index_cache):
        assert torch.count_nonzero(cache).item() == 0
        assert torch.count_nonzero(index_cache).item() == 0


DYNAMIC_CASES = [(3, 8), (64, 192), (5392, 192), (8192, 256)]


def run_dynamic_capacity_case(blocks, tokens, backend, gen, device="cpu") -> None:
    """The peer's ``test_dynamic_cache_capacity_and_strided_positions``: a table with padded
    rows (row stride 80, width 64), slots at the end of a large cache (index slots reversed),
    the index projection separate. The positions are a contiguous ``[T]`` here: the peer's
    strided ``positions[:, 0]`` view of a ``[T, 2]`` buffer is issue 26 item 6."""
    hd, block_size, max_position = 128, 128, 263000
    packed = torch.randn(tokens, 12 * hd, generator=gen, device=gen.device).to(torch.bfloat16)
    weights = [
        torch.randn(hd, generator=gen, device=gen.device).to(packed.dtype) * 0.1 for _ in range(4)
    ]
    cs = real_table(64, max_position, torch.bfloat16)
    cs_dev = torch.empty((max_position, 80), dtype=packed.dtype, device=device)[:, :64]
    cs_dev.copy_(cs)
    positions = torch.randint(max_position, (tokens,), generator=gen, device=gen.device)
    positions[0], positions[-1] = 0, max_position - 1
    slots = torch.arange(blocks * block_size - tokens, blocks * block_size, device=device)
    index_slots = slots.flip(0)
    key = torch.zeros((blocks, block_size, 1, hd), dtype=packed.dtype, device=device)
    value = torch.zeros_like(key)
    index = torch.zeros((blocks, block_size, hd), dtype=packed.dtype, device=device)
    q, iq = fqr.minimax_qknorm_rope_cache(
        packed[:, : 10 * hd].contiguous().to(device),
        cs_dev,
        positions.to(device),
        *[w.to(device) for w in weights],
        key,
        value,
        index,
        slots.to(device),
        index_slots.to(device),
        tokens,
        8,
        1,
        1,
        1e-6,
        index_packed=packed[:, 10 * hd :].contiguous().to(device),
        backend=backend,
    )
    if not has_values(q, iq, key, value, index):
        return
    expected = peer_cache_reference(packed, cs_dev, positions, weights, 8, 1, 1, 1e-6)
    slots_dev, index_dev = slots.to(device), index_slots.to(device)
    for name, got, gold in (
        ("q", q, expected[0]),
        ("index_q", iq, expected[3]),
        ("key_cache", key.view(-1, hd)[slots_dev], expected[1]),
        ("value_cache", value.view(-1, hd)[slots_dev], expected[2]),
        ("index_cache", index.view(-1, hd)[index_dev], expected[4]),
    ):
        _assert_close(name, got, gold.to(packed.dtype))
    assert torch.count_nonzero(key[0].float()).item() == 0


def run_replay_case(fp8: bool, tokens: int, backend, gen, device="cpu", graph=False) -> None:
    """The peer's ``test_cache_graph_replay_updates_slots_and_preserves_strides``: caches with
    padded block strides and three block sizes (16, 16, 8), an all-padding call that must leave
    every row untouched, then new positions and slots (tokens past ``num_actual_tokens = 5``
    named slots that must not be written), FP8 caches with v past +-448. ``graph``: the calls
    are a captured CUDA graph replayed after the data change, then 100 more replays beside
    another stream's traffic, as the peer replays its NPU graph (GPU only)."""
    qh, kh, ih, hd, actual = 8, 1, 1, 128, 5
    cache_dtype = E4M3 if fp8 else torch.bfloat16
    packed = (
        torch.randn(tokens, 12 * hd, generator=gen, device=gen.device).to(torch.bfloat16).to(device)
    )
    if fp8:
        packed[:, 9 * hd : 10 * hd] *= 1000  # v saturates whatever the norm does
    weights = [
        (torch.randn(hd, generator=gen, device=gen.device) * 0.1).to(packed.dtype).to(device)
        for _ in range(4)
    ]
    cs = real_table(64, tokens + 32, torch.bfloat16).to(device)
    positions = torch.arange(tokens, device=device)
    key = torch.zeros((3, 17, kh, hd), dtype=cache_dtype, device=device)[:, :16]
    value = torch.zeros((3, 18, kh, hd), dtype=cache_dtype, device=device)[:, :16]
    index = torch.zeros((6, 9, hd), dtype=cache_dtype, device=device)[:, :8]
    slots = torch.full((tokens,), -1, dtype=torch.int64, device=device)
    index_slots = slots.clone()

    def run():
        return fqr.minimax_qknorm_rope_cache(
            packed, cs, positions, *weights, key, value, index, slots, index_slots, actual,
            qh, kh, ih, 1e-6, backend=backend,
        )  # fmt: skip

    run()  # all padding: no row written
    for cache in (key, value, index):
        if has_values(cache):
            assert torch.count_nonzero(cache.float()).item() == 0
    if graph:
        torch.cuda.synchronize()
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            q, iq = run()
    positions.copy_(torch.arange(tokens, device=device) + 11)
    slots[:8].copy_(torch.tensor([17, -1, 0, 35, 7, 20, 21, 22], device=device))
    index_slots[:8].copy_(torch.tensor([4, 18, -1, 9, 34, 30, 31, 32], device=device))
    if graph:
        cuda_graph.replay()
        torch.cuda.synchronize()
    else:
        q, iq = run()
    if not has_values(q, iq, key, value, index):
        return
    expected = peer_cache_reference(packed, cs, positions, weights, qh, kh, ih, 1e-6)
    zeros = [torch.zeros_like(c) for c in (key, value, index)]  # all padding before
    outs = (q, iq, key, value, index)
    mappings = (slots, index_slots)
    exact = check_exact(packed, cs, positions, weights, (qh, kh, ih), zeros, mappings, actual, outs)
    _assert_close("q", q, expected[0].to(q.dtype))
    assert iq.dtype == cache_dtype  # index_q in the index cache's dtype, as the peer's
    if fp8:
        peer_iq = expected[3].clamp(-448, 448).to(iq.dtype)
        assert_fp8_close_or_nearer("index_q", iq, peer_iq.float(), exact[1])
    else:
        _assert_close("index_q", iq, expected[3].to(iq.dtype))
    for name, cache, part, mapping, exact_cache in (
        ("key_cache", key, expected[1], slots, exact[2]),
        ("value_cache", value, expected[2], slots, exact[3]),
        ("index_cache", index, expected[4], index_slots, exact[4]),
    ):
        gold = torch.zeros(cache.shape, dtype=cache_dtype, device=cache.device)
        part = part.to(packed.dtype) if cache is not index else part
        if fp8:
            part = part.float().clamp(-448, 448)
        for token, slot in enumerate(mapping.tolist()[:actual]):  # 8 numbers
            if slot >= 0:
                block, row = divmod(slot, cache.shape[1])
                gold[block, row] = part[token].reshape_as(gold[0, 0]).to(cache_dtype)
        if fp8:
            assert_fp8_close_or_nearer(name, cache.float(), gold.float(), exact_cache)
        else:
            _assert_close(name, cache, gold)
    if graph:
        traffic = torch.empty(1 << 20, device=device)
        stream = torch.cuda.Stream()
        saved = [x.clone() for x in (q, iq, key, index)]
        for _ in range(100):
            with torch.cuda.stream(stream):
                traffic.fill_(1.0)
            cuda_graph.replay()
        torch.cuda.synchronize()
        for before, now in zip(saved, (q, iq, key, index)):
            assert torch.equal(before.float(), now.float())
