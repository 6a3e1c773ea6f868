"""One vLLM-native case: fresh inputs on a real RoPE table, what vLLM's native path makes of them
(:func:`fqr.unfused.vllm_qk_norm_rope`, written from vLLM's ``RMSNorm`` /
``GemmaRMSNorm.forward_static`` and ``RotaryEmbedding.forward_static``), and the arguments that
ask :func:`fqr.split_qkv_rmsnorm_rope` for the same prologue under ``numerics="unfused"``.

Shared by the CPU test (``tests/core/test_unfused_models.py``), the Ascend interpreter test
(``tests/ascend/test_ascend_unfused_bitwise.py``) and the GPU test
(``tests/gpu/test_unfused_gpu.py``), so the three prove the same claim on the same kind of data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fqr.rope_cache import rope_cos_sin_cache
from fqr.unfused import vllm_qk_norm_rope

EPS = 1e-6


@dataclass(frozen=True)
class VllmNativeCase:
    qkv: torch.Tensor  # [T, (heads + 2 * kv_heads) * head_dim], rows scaled per head
    positions: torch.Tensor
    table: torch.Tensor  # vLLM's cos_sin_cache, fp32 or in the model dtype as vLLM keeps it
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    heads: int
    kv_heads: int
    head_dim: int
    is_neox: bool
    gemma: bool

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.qkv, self.positions, self.table, self.q_weight, self.k_weight)

    def fqr_kwargs(self, **extra) -> dict:
        """:func:`fqr.split_qkv_rmsnorm_rope`'s keywords for vLLM's prologue, unfused."""
        kwargs = dict(
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            eps=EPS,
            is_neox=self.is_neox,
            weight_offset=1.0 if self.gemma else 0.0,
            numerics="unfused",
        )
        return {**kwargs, **extra}

    def vllm(self) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k as vLLM's native path computes them."""
        q, k, _ = vllm_qk_norm_rope(
            *self.args,
            q_size=self.heads * self.head_dim,
            kv_size=self.kv_heads * self.head_dim,
            eps=EPS,
            is_neox=self.is_neox,
            gemma=self.gemma,
        )
        return q, k

    @property
    def v(self) -> torch.Tensor:
        return self.qkv[:, (self.heads + self.kv_heads) * self.head_dim :]


def vllm_native_case(
    gen: torch.Generator,
    dtype: torch.dtype,
    head_dim: int,
    rotary_dim: int,
    *,
    is_neox: bool,
    gemma: bool = False,
    table_in_dtype: bool = False,
    heads: int = 3,
    kv_heads: int = 1,
    tokens: int = 6,
    max_position: int = 4096,
    base: float = 1e6,
    device: str | torch.device = "cpu",
) -> VllmNativeCase:
    """Draw a case from ``gen``: each head's row scaled by its own factor in [0.5, 3.5), norm
    weights around 1 (around 0 for Gemma's ``1 + w``), positions over the whole table."""
    table = rope_cos_sin_cache(rotary_dim, max_position, base)
    if table_in_dtype:
        table = table.to(dtype)  # vLLM keeps its cache in the model dtype
    width = heads + 2 * kv_heads
    scale = 0.5 + 3.0 * torch.rand(width, 1, generator=gen, device=gen.device)
    qkv = (torch.randn(tokens, width, head_dim, generator=gen, device=gen.device) * scale).reshape(
        tokens, -1
    )
    positions = torch.randint(0, max_position, (tokens,), generator=gen, device=gen.device)
    centre = 0.0 if gemma else 1.0
    qw = centre + 0.2 * torch.randn(head_dim, generator=gen, device=gen.device)
    kw = centre + 0.2 * torch.randn(head_dim, generator=gen, device=gen.device)
    return VllmNativeCase(
        qkv.to(device, dtype),
        positions.to(device),
        table.to(device),
        qw.to(device, dtype),
        kw.to(device, dtype),
        heads,
        kv_heads,
        head_dim,
        is_neox,
        gemma,
    )
