"""vllm-ascend's ``test_minimax_qknorm_rope_cache.py``, whole, on the GPU's ``triton`` backend
(skipped without CUDA): 60 + 1 + 4 + 4 cases of the fused cache op with its index cache (issue
26 item 8), the graph-replay test as a captured CUDA graph. References and tolerances as the CPU
port (tests/peers, :mod:`support.vllm_ascend_minimax`). The index-heads test's whole grid (the
per-group rotary width, item 2) is in tests/gpu/test_gpu_peers_base.py. The device is
:data:`support.devices.GPU_DEVICE` (``meta`` in the bundle build: the graph's launches are made
without the graph, no values)."""

from __future__ import annotations

import pytest
from support.devices import BUILDING, GPU_DEVICE
from support.peer_ports import ON_TRITON
from support.vllm_ascend_minimax import (
    CACHE_HEADS,
    CACHE_ROTARY,
    CACHE_TOKENS,
    DYNAMIC_CASES,
    run_cache_case,
    run_dynamic_capacity_case,
    run_empty_case,
    run_replay_case,
)

pytestmark = ON_TRITON


@pytest.mark.parametrize("rotary_dim", CACHE_ROTARY)
@pytest.mark.parametrize("heads", CACHE_HEADS, ids=lambda h: "x".join(map(str, h)))
@pytest.mark.parametrize("tokens", CACHE_TOKENS)
def test_minimax_qknorm_rope_cache(tokens, heads, rotary_dim, gen):
    run_cache_case(tokens, heads, rotary_dim, "triton", gen, GPU_DEVICE)


def test_empty_minimax_qknorm_rope_cache():
    run_empty_case("triton", GPU_DEVICE)


@pytest.mark.parametrize("blocks, tokens", DYNAMIC_CASES)
def test_dynamic_cache_capacity(blocks, tokens, gen):
    run_dynamic_capacity_case(blocks, tokens, "triton", gen, GPU_DEVICE)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("tokens", [8, 192])
def test_cache_graph_replay_updates_slots_and_preserves_strides(fp8, tokens, gen):
    run_replay_case(fp8, tokens, "triton", gen, GPU_DEVICE, graph=not BUILDING)


def test_the_replay_semantics_hold_without_a_graph(gen):
    """The same data change run eagerly: a graph-only failure is told apart from the op's."""
    run_replay_case(True, 8, "triton", gen, GPU_DEVICE)
