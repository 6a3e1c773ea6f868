"""The peer features (no RoPE, v's own head count and head_dim, padded heads, in place) as the
ascend-target kernel under Triton-Ascend's interpreter (``support.peer_cases``)."""

from __future__ import annotations

import pytest
from support.ascend import ASCEND_INTERPRET_MARKS
from support.peer_cases import PEER_CASES, check_peer_case, check_q_only

pytestmark = ASCEND_INTERPRET_MARKS


@pytest.mark.parametrize("case", PEER_CASES, ids=lambda c: c.name)
def test_peer_feature_on_ascend_interpret(gen, case):
    check_peer_case(case, "ascend-interpret", gen)


def test_q_alone_on_ascend_interpret(gen):
    check_q_only("ascend-interpret", gen)
