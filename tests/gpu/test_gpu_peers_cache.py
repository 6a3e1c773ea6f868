"""The ports of vLLM's cache tests (``tests/peers/test_vllm_fused_qk_norm_rope_kvcache.py``,
``tests/peers/test_vllm_cache.py``) at the peer's full grids and sizes on the ``triton``
backend (skipped without CUDA): every case of ``test_matches_unfused_pair`` (T up to 2048) and
``test_padded_and_short_slot_mapping``, and every expressed call of
``test_reshape_and_cache_flash`` at its cache sizes (num_blocks 512 / 5000). The checks are the
CPU ports' own: the same function runs with the inputs drawn on the GPU."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import torch

from fqr.backends import BACKENDS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peers"))

from test_vllm_cache import (  # noqa: E402
    BLOCK_SIZES,
    DTYPES,
    HEAD_SIZES,
    KV_CACHE_DTYPES,
    LAYOUTS,
    run_reshape_and_cache_flash,
)
from test_vllm_fused_qk_norm_rope_kvcache import (  # noqa: E402
    HEAD_CONFIGS,
    PADDED,
    TOKENS,
    run_and_check,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not BACKENDS["triton"].available, reason=BACKENDS["triton"].unavailable_reason() or ""
    ),
]
PEER_BLOCKS = [512, 5000]  # test_reshape_and_cache_flash halves NUM_BLOCKS [1024, 10000]


@pytest.fixture
def cuda_gen() -> torch.Generator:
    seed = int(os.environ.get("FQR_TEST_SEED") or random.SystemRandom().randrange(2**31))
    print(f"FQR_TEST_SEED={seed}")
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("config", HEAD_CONFIGS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_matches_unfused_pair_triton(cuda_gen, dtype, is_neox, config, tokens):
    run_and_check(cuda_gen, "triton", dtype, is_neox, *config, tokens)


@pytest.mark.parametrize("tokens,slot_tokens,padded", PADDED)
def test_padded_and_short_slot_mapping_triton(cuda_gen, tokens, slot_tokens, padded):
    run_and_check(
        cuda_gen, "triton", torch.bfloat16, True, 16, 4, 128, 128, tokens, slot_tokens, padded
    )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("num_blocks", PEER_BLOCKS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_reshape_and_cache_flash_triton(cuda_gen, head_size, block_size, num_blocks, dtype,
                                        kv_cache_dtype, layout):  # fmt: skip
    run_reshape_and_cache_flash(
        cuda_gen, "triton", head_size, block_size, num_blocks, dtype, kv_cache_dtype, layout
    )
