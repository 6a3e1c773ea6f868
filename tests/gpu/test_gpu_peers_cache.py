"""The ports of vLLM's cache tests at the peer's full grids and sizes on the compiled kernels
(backend ``triton``) of a CUDA GPU; skipped without one. The ports (``tests/peers/``) run a
sample on the CPU; here every case, each also checked against fqr's float64 reference:

- vLLM ``tests/kernels/core/test_fused_qk_norm_rope_kvcache.py``: the 80 cases of
  ``test_matches_unfused_pair`` (T up to 2048) and the 3 of
  ``test_padded_and_short_slot_mapping`` (16 ``test_all_token_heads_per_warp`` cases are a
  launch knob fqr's kernel does not have);
- vLLM ``tests/kernels/attention/test_cache.py``, ``test_reshape_and_cache_flash``: the 144
  calls fqr expresses (auto / fp8 with per-tensor scales, NHC / HNC, head_size 64 / 80 / 256,
  block_size 8 / 16 / 32, num_blocks 512 / 5000), inputs drawn on the GPU.
"""

from __future__ import annotations

import pytest
from support.devices import GPU_DEVICE
from support.peer_ports import ON_TRITON, case_id, load_port

pytestmark = ON_TRITON

KVCACHE = load_port("test_vllm_fused_qk_norm_rope_kvcache")
CACHE = load_port("test_vllm_cache")


@pytest.mark.parametrize("case", KVCACHE.PEER_GRID, ids=case_id)
def test_vllm_fused_qk_norm_rope_kvcache(gen, case):
    KVCACHE.check_case(case, "triton", gen, device=GPU_DEVICE)


@pytest.mark.parametrize("case", KVCACHE.PADDED_GRID, ids=case_id)
def test_vllm_fused_qk_norm_rope_kvcache_padded(gen, case):
    KVCACHE.check_case(case, "triton", gen, device=GPU_DEVICE)


def flash_cache_need(params: dict) -> int:
    """GPU memory of one ``reshape_and_cache_flash`` case, from its cache's shape: ``n``
    elements of the key and value caches (``[num_blocks, 2, block_size, 8 heads, head_size]``)
    held as the float64 expectation (8 bytes each), drawn in float32 (4), and about six copies
    in the cache's dtype (the cache, the copy before the call, the peer's expectation, the
    comparisons' temporaries): 1 GiB + n * (12 + 6 * itemsize). The largest case (head_size
    256, block_size 32, 5,000 blocks, float32) needs 23 GiB; the 512-block ones under 3."""
    case = params["case"]
    n = case["num_blocks"] * 2 * case["block_size"] * CACHE.NUM_HEADS * case["head_size"]
    itemsize = 1 if case["kv_cache_dtype"] == "fp8" else case["dtype"].itemsize
    return (1 << 30) + n * (12 + 6 * itemsize)


@pytest.mark.gpu_memory.with_args(flash_cache_need)
@pytest.mark.parametrize("case", CACHE.PEER_GRID, ids=case_id)
def test_vllm_reshape_and_cache_flash(gen, case):
    CACHE.check_case(case, "triton", gen, device=GPU_DEVICE)
