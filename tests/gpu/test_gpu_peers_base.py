"""The full grids of the peers' own tests of the base, V-norm and indexer prologues (issue
26), on the compiled kernels (backend ``triton``) of a CUDA GPU; skipped without one. The ports
(``tests/peers/``) keep each peer's grid, reference and tolerances and run a sample of it on
the CPU; here every case runs full-size (up to 10240 tokens), each also checked against fqr's
float64 reference:

- vllm-ascend ``test_split_qkv_rmsnorm_rope.py``: 32 cases (16 without bias, 16 with);
- vllm-ascend ``test_split_qkv_rmsnorm_rope_vnorm.py``: 40 cases (20 + 20 with bias);
- vllm-ascend ``test_split_qkv_index_rmsnorm_rope.py``: 256 cases (192 of them with
  per-head-group rotary width, issue 26 item 2);
- vLLM ``tests/kernels/core/test_fused_qk_norm_rope.py``: 24 cases;
- SGLang ``sgl-kernel/tests/test_fused_qk_norm_rope.py``: 200 cases;
- SGLang ``python/sglang/jit_kernel/tests/test_fused_qknorm_rope.py``: 27 cases (of 34: the
  default-rotary-dim and JIT-against-AOT checks have no reference to port).
"""

from __future__ import annotations

import pytest
from support.devices import GPU_DEVICE
from support.peer_ports import ON_TRITON, case_id, load_port

pytestmark = ON_TRITON

ASCEND_BASE = load_port("test_vllm_ascend_split_qkv_rmsnorm_rope")
ASCEND_VNORM = load_port("test_vllm_ascend_split_qkv_rmsnorm_rope_vnorm")
ASCEND_INDEX = load_port("test_vllm_ascend_split_qkv_index_rmsnorm_rope")
VLLM = load_port("test_vllm_fused_qk_norm_rope")
SGLANG = load_port("test_sglang_fused_qk_norm_rope")
SGLANG_JIT = load_port("test_sglang_jit_fused_qknorm_rope")


@pytest.mark.parametrize("case", ASCEND_BASE.PEER_GRID, ids=case_id)
def test_vllm_ascend_split_qkv_rmsnorm_rope(gen, case):
    ASCEND_BASE.check_case(case, "triton", gen, device=GPU_DEVICE)


@pytest.mark.parametrize("case", ASCEND_VNORM.PEER_GRID, ids=case_id)
def test_vllm_ascend_split_qkv_rmsnorm_rope_vnorm(gen, case):
    ASCEND_VNORM.check_case(case, "triton", gen, device=GPU_DEVICE)


@pytest.mark.parametrize("case", ASCEND_INDEX.gpu_params(), ids=case_id)
def test_vllm_ascend_split_qkv_index_rmsnorm_rope(gen, case):
    ASCEND_INDEX.check_case(case, "triton", gen, device=GPU_DEVICE)


@pytest.mark.parametrize("case", VLLM.PEER_GRID, ids=case_id)
def test_vllm_fused_qk_norm_rope(gen, case):
    VLLM.check_case(case, "triton", gen, device=GPU_DEVICE)


@pytest.mark.parametrize("case", SGLANG.PEER_GRID, ids=case_id)
def test_sglang_fused_qk_norm_rope(gen, case):
    SGLANG.check_case(case, "triton", gen, device=GPU_DEVICE)


@pytest.mark.parametrize("case", SGLANG_JIT.PEER_GRID, ids=case_id)
def test_sglang_jit_fused_qknorm_rope(gen, case):
    SGLANG_JIT.check_case(case, "triton", gen, device=GPU_DEVICE)
