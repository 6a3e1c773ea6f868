"""vllm-ascend ``tests/e2e/nightly/single_node/ops/singlecard_ops/triton/test_mrope.py`` (the
``triton_mrope`` kernel test) ported onto :func:`fqr.qk_mrope` (issue 26.7a): the peer's
``pytorch_forward_native`` re-written, bf16 atol/rtol 1e-2, fp16 1e-3; 64 q heads and one k
head of 128, interleaved ``[32, 32, 32]`` over 64 frequencies (22/21/21, as vLLM reads it),
cos/sin the real table's rows (:func:`support.peers_mrope.ascend_triton_mrope_case`).

CPU: the whole 8-case grid on the reference backend; on the interpreter 1 and 4 tokens in
both dtypes. The whole grid runs on the GPU (``tests/gpu/test_gpu_peers_mrope.py``).
"""

from __future__ import annotations

import pytest
from support.peers_mrope import ASCEND_TRITON_MROPE_GRID, ascend_triton_mrope_case


def _id(case):
    section, tokens, dtype = case
    return f"{'-'.join(map(str, section))}-t{tokens}-{str(dtype)[6:]}"


INTERPRET_GRID = [c for c in ASCEND_TRITON_MROPE_GRID if c[1] in (1, 4)]


@pytest.mark.parametrize("case", ASCEND_TRITON_MROPE_GRID, ids=_id)
def test_triton_mrope_reference(gen, case):
    ascend_triton_mrope_case(*case, backend="reference", device="cpu", gen=gen)


@pytest.mark.parametrize("case", INTERPRET_GRID, ids=_id)
def test_triton_mrope_interpret(gen, case):
    ascend_triton_mrope_case(*case, backend="interpret", device="cpu", gen=gen)
