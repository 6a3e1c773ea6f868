"""vLLM ``tests/kernels/core/test_fused_qk_norm_mrope.py`` ported onto
:func:`fqr.split_qkv_rmsnorm_mrope` (issue 26.3): per-head ``RMSNorm.forward_native`` then
``MRotaryEmbedding.forward_native`` is the peer's reference, fp16 atol/rtol 2e-3, bf16 4e-2;
its interleaved head configs (``[16, 24, 24]`` over 64 frequencies: 22/21/21) read as vLLM
reads them (:func:`support.peers_mrope.vllm_fused_qk_norm_mrope_case`).

CPU: the whole 48-case grid on the reference backend (7 tokens each); on the interpreter one
case per head config and section layout, dtypes, pairings and eps alternating. The full grid
runs on the GPU too (``tests/gpu/test_gpu_peers_mrope.py``).
"""

from __future__ import annotations

import pytest
import torch
from support.peers_mrope import (
    VLLM_FUSED_GRID,
    VLLM_FUSED_HEAD_CONFIGS,
    vllm_fused_qk_norm_mrope_case,
)

DTYPES = (torch.bfloat16, torch.float16)


def _id(case):
    dtype, neox, interleaved, eps, (hq, hkv, d, _) = case
    pairs, sections = "neox" if neox else "gptj", "interleaved" if interleaved else "contiguous"
    return f"{str(dtype)[6:]}-{pairs}-{sections}-{eps}-{hq}x{hkv}x{d}"


# one case per (head config, section layout), dtype, pairing and eps cycling
INTERPRET_GRID = [
    (DTYPES[j % 2], (True, False)[(j // 2) % 2], interleaved, (1e-5, 1e-6)[(j // 3) % 2], config)
    for j, (config, interleaved) in enumerate(
        (c, il) for c in VLLM_FUSED_HEAD_CONFIGS for il in (False, True)
    )
]


@pytest.mark.parametrize("case", VLLM_FUSED_GRID, ids=_id)
def test_fused_qk_norm_mrope_reference(gen, case):
    vllm_fused_qk_norm_mrope_case(*case, backend="reference", device="cpu", gen=gen)


@pytest.mark.parametrize("case", INTERPRET_GRID, ids=_id)
def test_fused_qk_norm_mrope_interpret(gen, case):
    vllm_fused_qk_norm_mrope_case(*case, backend="interpret", device="cpu", gen=gen)
