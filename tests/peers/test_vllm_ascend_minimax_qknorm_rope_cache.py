"""vllm-ascend's ``test_minimax_qknorm_rope_cache.py`` ported onto fqr (issue 26, item 8): the
peer's calls to ``minimax_qknorm_rope_cache`` made, as written, to
:func:`fqr.minimax_qknorm_rope_cache` (the declaration ``split_qkv_index_rmsnorm_rope_cache``):
k and v into the paged KV cache, index_k into its own index cache by its own slot mapping and
block size, the index projection separate or packed, q and index_q returned by the one call.

The peer's reference (Gemma norms rounded to bf16 before RoPE) is re-written in float64
(:func:`support.vllm_ascend_minimax.peer_cache_reference`), its tolerances kept (atol 0.032,
rtol 0.01; FP8 0.25), untouched cache rows compared bit for bit. Here, on CPU:

* ``test_minimax_qknorm_rope_cache`` (peer grid 10 token counts x 3 head configurations x R
  64/128 = 60): on ``reference`` every case up to 64 tokens (36), on ``interpret`` 1 and 4 tokens
  (odd: packed row; even: separate index projection) of every head configuration at R 64, and
  (8, 1, 1) at R 128 (7);
* ``test_empty_minimax_qknorm_rope_cache``: both backends;
* ``test_dynamic_cache_capacity_and_strided_positions`` (4 cases): 3 blocks / 8 tokens on both
  backends, 64 blocks / 192 tokens on ``reference``; positions contiguous (the peer's strided
  view is issue 26 item 6);
* ``test_cache_graph_replay_updates_slots_and_preserves_strides`` (FP8 x 8/192 tokens): the
  data-change semantics without a graph (8 tokens on both backends, 192 on ``reference``).

The whole grid, and the replay as a captured CUDA graph: tests/gpu/test_gpu_peers_minimax.py.
"""

from __future__ import annotations

import pytest
from support.vllm_ascend_minimax import (
    CACHE_HEADS,
    CACHE_ROTARY,
    CACHE_TOKENS,
    run_cache_case,
    run_dynamic_capacity_case,
    run_empty_case,
    run_replay_case,
)

BACKENDS = ["reference", "interpret"]
REFERENCE_GRID = [
    (t, h, r) for t in CACHE_TOKENS if t <= 64 for h in CACHE_HEADS for r in CACHE_ROTARY
]
INTERPRET_GRID = [(t, h, 64) for t in (1, 4) for h in CACHE_HEADS] + [(8, (8, 1, 1), 128)]


def _id(case) -> str:
    t, h, r = case
    return f"t{t}-h{'x'.join(map(str, h))}-r{r}"


@pytest.mark.parametrize(
    "backend, case",
    [("reference", c) for c in REFERENCE_GRID] + [("interpret", c) for c in INTERPRET_GRID],
    ids=lambda x: x if isinstance(x, str) else _id(x),
)
def test_minimax_qknorm_rope_cache(backend, case, gen):
    run_cache_case(*case, backend, gen)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_minimax_qknorm_rope_cache(backend):
    run_empty_case(backend)


@pytest.mark.parametrize(
    "backend, blocks, tokens",
    [("reference", 3, 8), ("interpret", 3, 8), ("reference", 64, 192)],
)
def test_dynamic_cache_capacity(backend, blocks, tokens, gen):
    run_dynamic_capacity_case(blocks, tokens, backend, gen)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(
    "backend, tokens", [("reference", 8), ("interpret", 8), ("reference", 192)]
)
def test_cache_replay_updates_slots_and_preserves_strides(backend, tokens, fp8, gen):
    run_replay_case(fp8, tokens, backend, gen)
