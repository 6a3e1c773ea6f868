"""The open compiler's compositions compiled for CUDA at model sizes (skipped without a GPU;
issue 15, part A; formerly ``scripts/open_compiler_gpu.py``): the generalised splits and narrow
tables ``tests/lowering/test_open_compiler.py`` runs small under the interpreter, here through
upstream Triton's compiler at 1,037 tokens (odd: the last token tile is partial), each output
NaN-poisoned first and held against float64 computed independently (index arithmetic on the
packed row, then :mod:`fqr.reference`; :mod:`support.compositions`), copies bit for bit."""

from __future__ import annotations

import pytest
import torch
from support.compositions import gated_case, indexer_case, narrow_case, padded_case
from support.devices import GPU_DEVICE, has_values
from support.peer_ports import ON_TRITON
from support.programs import check_outputs, run_kernel

from fqr.lowering import lower

pytestmark = ON_TRITON

TOKENS = 1037


def run_on_gpu(case, out=None):
    """The case's program compiled for CUDA, on its arguments moved to the GPU, into poisoned
    outputs (or ``out``); the outputs, checked against the case's expectation."""
    args = [a.to(GPU_DEVICE) for a in case.args]
    if out is None:
        out, _ = run_kernel(case.program, args, target="cuda")
    else:
        lower(case.program, "cuda")(*args, out=out)
    check_outputs(out, case.expected, case.head_dims, case.copies)
    return out


def test_gate_interleaved_split_at_qwen35_shapes(gen):
    """[q0 g0 q1 g1 ... | k | v], 24 q heads and 4 kv heads of 256, rotary 64, (1 + w)
    norms: q and the gate are views of head stride 512; gate and v copied."""
    run_on_gpu(gated_case(gen, TOKENS, hq=24, hkv=4, d=256, r=64))


def test_sections_with_their_own_head_dims_at_minimax_like_shapes(gen):
    """[q | k | v | index_q | index_k]: 4 indexer q heads of 64 (own GPT-J table of 32) beside
    8 q heads and 1 kv head of 128 (NeoX, rotary 64)."""
    run_on_gpu(indexer_case(gen, TOKENS, hq=8, hkv=1, d=128, hi=4, di=64, r=64, ri=32))


def test_k_and_v_head_counts_in_padded_heads(gen):
    """q 4, k 2, v 3 heads of 80 features, each padded to 96 columns holding NaN."""
    run_on_gpu(padded_case(gen, TOKENS, heads=(4, 2, 3), d=80, stride=96, r=32))


@pytest.mark.parametrize("head_dim,is_neox", [(512, True), (769, False)])
def test_rotary_dim_2_on_wide_heads(gen, head_dim, is_neox):
    """A rotary table 2 wide (one pair) on heads of 512 and of 769 (odd, not a power of 2)."""
    run_on_gpu(narrow_case(gen, TOKENS, head_dim, 2, is_neox))


def test_outputs_written_as_rows_of_a_wider_buffer(gen):
    """``out=`` views of buffers 40 columns wider than each output (row stride a kernel
    argument): the views meet the contract and the 40 columns after each stay NaN."""
    case = narrow_case(gen, TOKENS, 128, 32, True)
    pad = 40
    buffers = [
        torch.full((TOKENS, w + pad), float("nan"), dtype=torch.bfloat16, device=GPU_DEVICE)
        for w in (2 * 128, 128, 128)
    ]
    run_on_gpu(case, out=[b[:, :-pad] for b in buffers])
    for i, b in enumerate(buffers):
        if has_values(b):
            assert b[:, -pad:].isnan().all(), f"output {i}: the padding after its rows was written"
