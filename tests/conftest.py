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
from functools import lru_cache

import pytest
import torch

from fqr.inputs import PrologueInputs, random_inputs
from fqr.presets import PrologueSpec
from fqr.rope_cache import rope_cos_sin_cache

# tests/gpu's bundle build and kernel counts (tests/support/gpu_kernels.py)
pytest_plugins = ("support.gpu_kernels",)


@lru_cache(maxsize=8)
def real_table(rotary_dim: int, max_position: int, theta: float) -> torch.Tensor:
    """A real fp32 RoPE table (cached: the 2^18-row ones take a while to build)."""
    return rope_cos_sin_cache(rotary_dim, max_position, theta)


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the OS (or ``FQR_TEST_SEED``). A test of ``tests/gpu`` gets one
    on the GPU (:func:`support.devices.test_generator`): its inputs are drawn where they are
    used, and its float64 references and comparisons run there too."""
    from support.devices import test_generator

    seed = int(os.environ.get("FQR_TEST_SEED") or random.SystemRandom().randrange(2**31))
    print(f"FQR_TEST_SEED={seed}")
    return test_generator(request.path.parent.name == "gpu", seed)


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
) -> PrologueInputs:
    """Random inputs (:func:`fqr.inputs.random_inputs`) of a small prologue: positions anywhere
    in a real RoPE table of ``max_position`` rows."""
    spec = PrologueSpec(
        num_heads,
        num_kv_heads,
        head_dim,
        head_dim if rotary_dim is None else rotary_dim,
        eps=1e-6,
        is_neox=is_neox,
        weight_offset=weight_offset,
        norm=norm,
    )
    cache = real_table(spec.rotary_dim, max_position, theta)
    return random_inputs(spec, tokens, dtype, gen, cache, bias=bias)


@pytest.fixture
def problem(gen) -> PrologueInputs:
    """A small bf16 Qwen3-like problem (4 q heads, 2 kv heads, D=128)."""
    return make_problem(gen)
