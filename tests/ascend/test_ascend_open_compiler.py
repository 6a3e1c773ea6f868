"""Generalised splits and narrow rotary tables as ascend-target kernels under Triton-Ascend's
interpreter: a small persistent grid (3 vector cores, several ragged token tiles each) and, with
a small UB budget, head chunks; every output against float64 with NaN-poisoned buffers.

Needs the Ascend environment (``make ascend-env``) and an interpreted process; skips otherwise.
"""

from __future__ import annotations

import pytest
from support.ascend import ASCEND_INTERPRET_MARKS, CORES
from support.compositions import gated_case, indexer_case, narrow_case, padded_case
from support.programs import check_outputs, run_kernel

pytestmark = ASCEND_INTERPRET_MARKS


@pytest.mark.parametrize(
    "build, options, chunked",
    [
        (lambda gen: gated_case(gen, 19), {}, False),
        # 24 KiB of UB: the q and gate rows no longer fit whole and are cut into head chunks
        (lambda gen: gated_case(gen, 19, hq=6), {"ub_bytes": 24 * 1024}, True),
        (lambda gen: indexer_case(gen, 17), {}, False),
        (lambda gen: padded_case(gen, 13), {}, False),
        (lambda gen: narrow_case(gen, 7, head_dim=512, rotary_dim=2), {}, False),
    ],
    ids=["gated", "gated-chunked", "indexer-heads", "padded-kv-heads", "rotary2-d512"],
)
def test_generalised_splits_under_the_ascend_interpreter(gen, build, options, chunked):
    case = build(gen)
    outs, kernel = run_kernel(
        case.program, case.args, "ascend-interpret", num_vectorcore=CORES, **options
    )
    heads = tuple(c.heads for c in kernel.plan.chains)
    assert (kernel.tiling.head_chunks != heads) == chunked, kernel.tiling
    check_outputs(outs, case.expected, case.head_dims, case.copies)
