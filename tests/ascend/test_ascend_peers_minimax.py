"""vllm-ascend's MiniMax-M3 prologue tests (:mod:`support.vllm_ascend_minimax`), a sample, as the
ascend-target kernel under Triton-Ascend's interpreter: the index heads narrower than the table
(each group over min(R, its head_dim), issue 26 item 2) and minimax_qknorm_rope_cache (the
index cache, separate index projection, FP8 caches, issue 26 item 8)."""

from __future__ import annotations

import pytest
from support.ascend import ASCEND_INTERPRET_MARKS
from support.peer_ports import case_id, load_port
from support.vllm_ascend_minimax import run_cache_case, run_replay_case

pytestmark = ASCEND_INTERPRET_MARKS

INDEX = load_port("test_vllm_ascend_split_qkv_index_rmsnorm_rope")
INDEX_CASES = [  # the peer's cases whose index heads rotate fewer features (item 2)
    c
    for c in INDEX.PEER_GRID
    if c["num_tokens"] == 8 and c["heads"] == (12, 1) and c["num_idx_heads"] == 8
    and not c["bias"] and c["fp8"] == (False, False)
    and (c["idx_head_dim"], c["rope_dim"]) in ((48, 64), (64, 128))
]  # fmt: skip


@pytest.mark.parametrize("case", INDEX_CASES, ids=case_id)
def test_index_heads_narrower_than_the_table(case, gen):
    INDEX.check_case(case, "ascend-interpret", gen)


@pytest.mark.parametrize("tokens", [3, 4])  # odd: the packed row; even: a separate projection
def test_minimax_qknorm_rope_cache(tokens, gen):
    run_cache_case(tokens, (8, 1, 1), 64, "ascend-interpret", gen)


def test_fp8_caches_of_three_block_sizes(gen):
    run_replay_case(True, 8, "ascend-interpret", gen)
