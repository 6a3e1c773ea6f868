"""The ascend-target kernel under Triton-Ascend's interpreter, where vllm-ascend's kernel breaks.

vllm-ascend's ``split_qkv_rmsnorm_rope`` returns wrong, run-to-run different q/k once a vector
core processes more than one tile of tokens (issue 16674: from 1024 tokens with 12/1 heads, from
257 tokens with 64/4 heads). Here a small persistent grid (3 "vector cores") makes every program
run many tiles, with token counts that neither the core count nor the tile divides; and a small
UB budget forces head chunks (including the full-width-norm prepass). Every output is compared
with the independent float64 formulation (``fqr.reference.prologue``) under the numerics
contract, on fresh random inputs and real RoPE tables, with NaN-poisoned output buffers.

Needs the Ascend environment (``make ascend-env``) and an interpreted process (the default of
``tests/conftest.py``); skips otherwise.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_problem
from support.ascend import ASCEND_INTERPRET_MARKS, CORES

from fqr import reference
from fqr.lowering import ascend as A
from fqr.lowering import lower
from fqr.lowering.targets import cdiv
from fqr.numerics import compare
from fqr.prologue.split_qkv import SPLIT_QKV_RMSNORM_ROPE

pytestmark = ASCEND_INTERPRET_MARKS


def run_ascend_interpret(pr, numerics="fused", **options):
    """Lower the problem's program for ascend-interpret and run it on NaN-poisoned outputs."""
    tensors = (
        pr.qkv,
        pr.positions,
        pr.cos_sin_cache,
        pr.q_weight,
        pr.k_weight,
        pr.q_bias,
        pr.k_bias,
    )
    program = SPLIT_QKV_RMSNORM_ROPE.program_for(*pr.args(), **pr.kwargs(numerics=numerics))
    kernel = lower(program, "ascend-interpret", num_vectorcore=CORES, **options)
    outs = [
        torch.full((pr.qkv.shape[0], v.aval.shape[1]), float("nan"), dtype=v.aval.dtype)
        for v in program.outputs
    ]
    kernel(*[t for t in tensors if t is not None], out=outs)
    return kernel, outs


def check_against_float64(pr, outs, numerics="fused"):
    eq, ek, ev = reference.prologue(*pr.args(), **pr.kwargs())
    q, k, v = outs
    for name, out, exp in (("q", q, eq), ("k", k, ek)):
        c = compare(out, exp, head_dim=pr.spec.head_dim, numerics=numerics)
        assert c.passed, f"{name}: {c}"
    assert torch.equal(v, ev), "v must be a bit-exact copy"


@pytest.mark.parametrize(
    "heads, kv_heads, tokens",
    [(12, 1, 1031), (64, 4, 263)],
    ids=["12-1heads-1031tok", "64-4heads-263tok"],
)
def test_many_tiles_per_program_where_vllm_ascend_breaks(gen, heads, kv_heads, tokens):
    pr = make_problem(
        gen, tokens=tokens, num_heads=heads, num_kv_heads=kv_heads, head_dim=128, max_position=32768
    )
    kernel, outs = run_ascend_interpret(pr)
    bt = kernel.tiling.block_t
    grid = kernel.target.grid(tokens, bt, pr.qkv.device, **kernel.options)
    assert grid == CORES and tokens % CORES and tokens % bt
    assert cdiv(tokens, bt) >= 4 * CORES, "every program must run several token tiles"
    check_against_float64(pr, outs)


@pytest.mark.parametrize(
    "case",
    [
        dict(num_heads=8, num_kv_heads=4, norm="full", dtype=torch.float16, bias=True),
        dict(num_heads=12, num_kv_heads=2, rotary_dim=64, is_neox=False, weight_offset=1.0),
        dict(
            num_heads=6,
            num_kv_heads=1,
            head_dim=256,
            rotary_dim=64,
            dtype=torch.float32,
            numerics="unfused",
        ),
        dict(num_heads=12, num_kv_heads=4, norm="full", chunk_mode="loop"),
    ],
    ids=[
        "full-norm-fp16-bias",
        "gptj-partial-1+w-bf16",
        "d256-partial-fp32-unfused",
        "full-norm-bf16-loop-chunks",
    ],
)
def test_head_chunks_when_a_row_does_not_fit(gen, case):
    case = dict(case)
    numerics = case.pop("numerics", "fused")
    chunk_mode = case.pop("chunk_mode", "unroll")
    pr = make_problem(gen, tokens=37, **case)
    ub = A.UB_RESERVE_BYTES + 24 * 1024  # small enough that the q row is split
    kernel, outs = run_ascend_interpret(pr, numerics=numerics, ub_bytes=ub, chunk_mode=chunk_mode)
    assert kernel.tiling.chunk_mode == chunk_mode
    assert kernel.tiling.head_chunks[0] < pr.spec.num_heads, kernel.tiling
    check_against_float64(pr, outs, numerics)
