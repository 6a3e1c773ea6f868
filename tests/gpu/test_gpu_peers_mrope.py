"""The peers' mRoPE tests (issue 26.3, 26.7a), full grids on the triton backend on a CUDA GPU
(skipped without one): vLLM ``test_mrope.py`` (both tests, 8192 tokens included, Inductor
with ``reduce-overhead``), ``test_fused_qk_norm_mrope.py``, and vllm-ascend's ``triton_mrope``
and ``split_qkv_rmsnorm_mrope`` (with gate, 4096 tokens included) tests. The cases, their
references and tolerances are :mod:`support.peers_mrope`'s; ``tests/peers`` runs them sampled
on the CPU backends."""

from __future__ import annotations

import pytest
from support.devices import GPU_DEVICE
from support.peer_ports import ON_TRITON
from support.peers_mrope import (
    ASCEND_SPLIT_MROPE_GRID,
    ASCEND_TRITON_MROPE_GRID,
    VLLM_FUSED_GRID,
    VLLM_MROPE_GRID,
    ascend_split_mrope_case,
    ascend_triton_mrope_case,
    vllm_fused_qk_norm_mrope_case,
    vllm_mrope_case,
    vllm_mrope_compiled_case,
)

pytestmark = ON_TRITON
GPU = dict(backend="triton", device=GPU_DEVICE)


def _ids(grid):
    return [
        "-".join(getattr(x, "name", str(x)).replace("torch.", "").replace(" ", "") for x in c)
        for c in grid
    ]


@pytest.mark.parametrize("case", VLLM_MROPE_GRID, ids=_ids(VLLM_MROPE_GRID))
def test_vllm_mrope(gen, case):
    vllm_mrope_case(*case, gen=gen, **GPU)


@pytest.mark.parametrize("case", VLLM_MROPE_GRID, ids=_ids(VLLM_MROPE_GRID))
def test_vllm_mrope_torch_compile_tracing(gen, case):
    vllm_mrope_compiled_case(
        *case, compile_backend="inductor", mode="reduce-overhead", device=GPU_DEVICE, gen=gen
    )


@pytest.mark.parametrize("case", VLLM_FUSED_GRID, ids=_ids(VLLM_FUSED_GRID))
def test_vllm_fused_qk_norm_mrope(gen, case):
    vllm_fused_qk_norm_mrope_case(*case, gen=gen, **GPU)


@pytest.mark.parametrize("case", ASCEND_TRITON_MROPE_GRID, ids=_ids(ASCEND_TRITON_MROPE_GRID))
def test_ascend_triton_mrope(gen, case):
    ascend_triton_mrope_case(*case, gen=gen, **GPU)


@pytest.mark.parametrize("case", ASCEND_SPLIT_MROPE_GRID, ids=_ids(ASCEND_SPLIT_MROPE_GRID))
def test_ascend_split_qkv_rmsnorm_mrope(gen, case):
    ascend_split_mrope_case(*case, gen=gen, **GPU)
