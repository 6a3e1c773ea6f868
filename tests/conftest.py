"""Shared test helpers: fresh random inputs on real RoPE tables.

Every test that draws inputs gets a ``gen`` seeded from the OS (fresh inputs each run); the seed
is printed, so a failure can be replayed with ``FQR_TEST_SEED=<seed> pytest ...``.
"""

from __future__ import annotations

import os

import torch as _torch

# One process runs triton either interpreted or compiled, decided when triton is first imported
# (fqr.lowering.loader.triton_mode). Without a GPU the suite runs the generated kernels under the
# interpreter; with one, the compiled backend (and the interpreter tests skip).
if not _torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import random
from dataclasses import dataclass
from functools import lru_cache

import pytest
import torch

from fqr.rope_cache import rope_cos_sin_cache


@lru_cache(maxsize=8)
def real_table(rotary_dim: int, max_position: int, theta: float) -> torch.Tensor:
    """A real fp32 RoPE table (cached: the 2^18-row ones take a while to build)."""
    return rope_cos_sin_cache(rotary_dim, max_position, theta)


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(os.environ.get("FQR_TEST_SEED") or random.SystemRandom().randrange(2**31))
    print(f"FQR_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


@dataclass
class Problem:
    """One random prologue problem: arguments of ``fqr.split_qkv_rmsnorm_rope``."""

    qkv: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    static: dict

    def args(self) -> tuple:
        return (self.qkv, self.positions, self.cos_sin_cache, self.q_weight, self.k_weight)

    def kwargs(self, **extra) -> dict:
        return dict(self.static, q_bias=self.q_bias, k_bias=self.k_bias, **extra)


def make_problem(
    gen: torch.Generator,
    *,
    tokens=5,
    num_heads=4,
    num_kv_heads=2,
    head_dim=128,
    rotary_dim=None,
    dtype=torch.bfloat16,
    is_neox=True,
    bias=False,
    weight_offset=0.0,
    norm="head",
    theta=1e6,
    max_position=4099,
) -> Problem:
    """Random qkv (per-head scales 0.5..3), weights around 1 (around 0 with an offset), small
    biases, positions anywhere in a real RoPE table of ``max_position`` rows."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    heads = num_heads + 2 * num_kv_heads
    scale = 0.5 + 2.5 * torch.rand(heads, generator=gen, dtype=torch.float64)
    qkv = torch.randn(tokens, heads, head_dim, generator=gen, dtype=torch.float64) * scale[:, None]
    qkv = qkv.reshape(tokens, heads * head_dim).to(dtype)
    positions = torch.randint(0, max_position, (tokens,), generator=gen)
    cache = real_table(rotary_dim, max_position, theta)
    weights = [None] * 4
    if norm != "none":
        n_q = head_dim if norm == "head" else num_heads * head_dim
        n_k = head_dim if norm == "head" else num_kv_heads * head_dim
        centre = 0.0 if weight_offset else 1.0

        def draw(n, s, c):
            return (c + s * torch.randn(n, generator=gen, dtype=torch.float64)).to(dtype)

        weights[:2] = draw(n_q, 0.2, centre), draw(n_k, 0.2, centre)
        if bias:
            weights[2:] = draw(n_q, 0.05, 0.0), draw(n_k, 0.05, 0.0)
    static = dict(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        eps=1e-6,
        is_neox=is_neox,
        weight_offset=weight_offset,
        norm=norm,
    )
    return Problem(qkv, positions, cache, *weights, static)


@pytest.fixture
def problem(gen) -> Problem:
    """A small bf16 Qwen3-like problem (4 q heads, 2 kv heads, D=128)."""
    return make_problem(gen)
