"""vllm-ascend's own tests of the base, V-norm and indexer prologues (the ports in
``tests/peers/``), one case with biases each, on the ascend-target kernel under Triton-Ascend's
interpreter: the peer's platform, its reference and tolerances, and fqr's float64 check."""

from __future__ import annotations

import pytest
from support.ascend import ASCEND_INTERPRET_MARKS
from support.peer_ports import case_id, load_port

pytestmark = ASCEND_INTERPRET_MARKS

BASE = load_port("test_vllm_ascend_split_qkv_rmsnorm_rope")
VNORM = load_port("test_vllm_ascend_split_qkv_rmsnorm_rope_vnorm")
INDEX = load_port("test_vllm_ascend_split_qkv_index_rmsnorm_rope")

CASES = [
    (BASE, dict(bias=True, num_tokens=1, heads=(12, 1), head_size=128, rope_dim=64)),
    (VNORM, dict(bias=True, num_tokens=1, shape=(4, 2, 256, 256))),
    (
        INDEX,
        dict(
            num_tokens=1,
            heads=(12, 1),
            head_dim=128,
            num_idx_heads=8,
            idx_head_dim=64,
            rope_dim=64,
            bias=True,
            fp8=(True, True),
        ),
    ),
]


@pytest.mark.parametrize(
    "port, case", CASES, ids=[f"{p.__name__.split('_', 3)[-1]}-{case_id(c)}" for p, c in CASES]
)
def test_peer_case_with_bias_on_ascend_interpret(gen, port, case):
    assert case in port.PEER_GRID  # a case of the peer's own grid
    port.check_case(case, "ascend-interpret", gen)
