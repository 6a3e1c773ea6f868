"""vllm-ascend ``tests/e2e/nightly/single_node/ops/singlecard_ops/triton/
test_split_qkv_rmsnorm_mrope.py`` (with the gate) ported onto
:func:`fqr.split_qkv_rmsnorm_mrope` (issue 26.3): the peer's naive references re-written
(vectorised over tokens), atol/rtol 1e-2, v and the gate bit for bit; ``[24, 20, 20]``
interleaved over 32 frequencies reads as 11/11/10, as vLLM and vllm-ascend's kernel read it
(:func:`support.peers_mrope.ascend_split_mrope_case`).

CPU: every (heads, head size, sections, layout, gate, dtype) of the 128-case grid on the
reference backend at 1 token (the peer's 4096 replaced by 1); on the interpreter one case per
(sections, layout, gate), heads, head size and dtype cycling, at 1 and 3 tokens. The whole
grid (4096 tokens included) runs on the GPU (``tests/gpu/test_gpu_peers_mrope.py``).
"""

from __future__ import annotations

import pytest
import torch
from support.peers_mrope import ASCEND_SPLIT_MROPE_GRID, ascend_split_mrope_case


def _id(case):
    tokens, (hq, hkv), d, section, interleaved, gate, dtype = case
    layout = "interleaved" if interleaved else "contiguous"
    gated = "gate" if gate else "nogate"
    sections = "-".join(map(str, section))
    return f"t{tokens}-{hq}x{hkv}x{d}-{sections}-{layout}-{gated}-{str(dtype)[6:]}"


REFERENCE_GRID = [c for c in ASCEND_SPLIT_MROPE_GRID if c[0] == 1]
LAYOUTS = [
    (section, interleaved, gate)
    for section in ((11, 11, 10), (24, 20, 20))
    for interleaved in (True, False)
    for gate in (True, False)
]
INTERPRET_GRID = [
    (
        1 + 2 * (j % 2),  # tokens
        ((2, 1), (16, 2))[(j // 2) % 2],
        (128, 256)[j % 2],
        section,
        interleaved,
        gate,
        (torch.bfloat16, torch.float16)[(j // 4) % 2],
    )
    for j, (section, interleaved, gate) in enumerate(LAYOUTS)
]


@pytest.mark.parametrize("case", REFERENCE_GRID, ids=_id)
def test_split_qkv_rmsnorm_mrope_reference(gen, case):
    ascend_split_mrope_case(*case, backend="reference", device="cpu", gen=gen)


@pytest.mark.parametrize("case", INTERPRET_GRID, ids=_id)
def test_split_qkv_rmsnorm_mrope_interpret(gen, case):
    ascend_split_mrope_case(*case, backend="interpret", device="cpu", gen=gen)
