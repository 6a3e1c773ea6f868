"""What the ports of vLLM's cache tests share: their inputs as vLLM's tests make them (sizes,
seeds of fresh randomness, real RoPE tables), and the peer's reference re-written in torch from
its own formulas (never from fqr.ops): vLLM's ``fused_qk_norm_rope`` CUDA kernel (fp32 compute,
one rounding at the store) and ``reshape_and_cache_flash`` (:func:`fqr.peers.
vllm_reshape_and_cache_flash`).

Used by ``tests/peers/test_vllm_fused_qk_norm_rope_kvcache.py`` and
``tests/peers/test_vllm_cache.py`` (and through them ``tests/gpu/test_gpu_peers_cache.py``).
Every input is drawn where a :class:`Draws` says (:func:`on_device`): on the GPU for the GPU
file's full-size caches, on ``meta`` (no values) in the bundle build.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from fqr.rope_cache import rope_cos_sin_cache

BLOCK_SIZE = 16  # vLLM's test_fused_qk_norm_rope_kvcache.py
MAX_POSITION = 4096
ROPE_BASE = 10000.0


@dataclass(frozen=True)
class Draws:
    """Where a port's inputs come from: ``generator``'s random numbers, as tensors on
    ``device`` (the generator's own; or ``meta``, where any generator draws, no values)."""

    generator: torch.Generator
    device: torch.device


def on_device(gen: torch.Generator, device: str | torch.device) -> Draws:
    """Draws on ``device``: from ``gen`` where it is there (or ``device`` is ``meta``), else
    from a generator there seeded from it (the GPU file draws the peer's full-size caches on
    the GPU)."""
    device = torch.device(device)
    if device == gen.device or device.type == "meta":
        return Draws(gen, device)
    seed = int(torch.randint(2**62, (1,), generator=gen, device=gen.device))
    return Draws(torch.Generator(device=device).manual_seed(seed), device)


def kvcache_inputs(tokens, heads, kv_heads, head_dim, rotary_dim, is_neox, dtype, draws: Draws):
    """vLLM's ``_make_inputs``: qkv ``randn``, positions in ``[0, 4096)``, weights ``randn *
    0.1 + 1`` in the model dtype, and the RoPE table of ``RotaryEmbedding(head_dim, rotary_dim,
    4096, 10000, is_neox, dtype)``: ``[4096, rotary_dim]`` in the model dtype (here the real
    table of :func:`fqr.rope_cache.rope_cos_sin_cache`, rounded once to it)."""
    width, gen, device = (heads + 2 * kv_heads) * head_dim, draws.generator, draws.device
    qkv = torch.randn(tokens, width, generator=gen, device=device).to(dtype)
    positions = torch.randint(0, MAX_POSITION, (tokens,), generator=gen, device=device)
    q_weight = (torch.randn(head_dim, generator=gen, device=device) * 0.1 + 1.0).to(dtype)
    k_weight = (torch.randn(head_dim, generator=gen, device=device) * 0.1 + 1.0).to(dtype)
    return qkv, positions, q_weight, k_weight, rope_table(rotary_dim, dtype).to(device)


@lru_cache(maxsize=16)
def rope_table(rotary_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The real ``[4096, rotary_dim]`` table in ``dtype`` (kept: the ports never write it)."""
    return rope_cos_sin_cache(rotary_dim, MAX_POSITION, ROPE_BASE, dtype=dtype)


def flash_kv_buffer(tokens, kv_heads, head_dim, dtype, draws: Draws):
    """vLLM's ``_make_flash_kv_cache``: one ``[num_blocks, Hkv, 16, 2*D]`` buffer of random
    values, ``num_blocks = ceil(T / 16) + 2``."""
    blocks = (tokens + BLOCK_SIZE - 1) // BLOCK_SIZE + 2
    shape = (blocks, kv_heads, BLOCK_SIZE, 2 * head_dim)
    return torch.randn(shape, generator=draws.generator, device=draws.device).to(dtype)


def split_kv(kv: torch.Tensor, head_dim: int):
    """vLLM's ``_split_kv``: the key and value caches ``[num_blocks, 16, Hkv, D]`` as strided
    views of the one buffer (what the FlashAttention backend hands the cache-write op)."""
    return kv.transpose(1, 2).split(head_dim, dim=-1)


def slot_mapping(tokens: int, num_slots: int, padded: int, draws: Draws) -> torch.Tensor:
    """vLLM's ``_make_slot_mapping``: distinct random slots, the last ``padded`` ones -1."""
    slots = torch.randperm(num_slots, generator=draws.generator, device=draws.device)
    slots = slots[:tokens].to(torch.int64)
    if padded:
        slots[tokens - padded :] = -1
    return slots


def vllm_fused_qk_norm_rope(
    qkv, heads, kv_heads, head_dim, eps, q_weight, k_weight, cos_sin_cache, is_neox, positions
):  # fmt: skip
    """vLLM's ``fused_qk_norm_rope`` (``csrc/fused_qknorm_rope_kernel.cu``), re-written:
    per q and k head, in fp32, ``y = x * rsqrt(sum(x^2) / D + eps) * w`` then the rotation of
    the first R features by the table row (cos ``[:R/2]``, sin ``[R/2:]``, held in the table's
    dtype and read as fp32; NeoX pairs ``i, i + R/2``, GPT-J ``2i, 2i + 1``), rounded once to
    qkv's dtype; v as it is. Returns ``(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D])``."""
    tokens = qkv.shape[0]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    row = cos_sin_cache[positions].float()
    half = row.shape[1] // 2
    cos, sin = row[:, None, :half], row[:, None, half:]

    def norm_rope(x, n, w):
        x = x.reshape(tokens, n, head_dim).float()
        x = x * torch.rsqrt(x.square().sum(-1, keepdim=True) / head_dim + eps) * w.float()
        rot, rest = x[..., : 2 * half], x[..., 2 * half :]
        if is_neox:
            a, b = rot[..., :half], rot[..., half:]
            rot = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        else:
            a, b = rot[..., 0::2], rot[..., 1::2]
            rot = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
        return torch.cat([rot, rest], dim=-1).to(qkv.dtype)

    return (
        norm_rope(q, heads, q_weight),
        norm_rope(k, kv_heads, k_weight),
        v.reshape(tokens, kv_heads, head_dim),
    )
