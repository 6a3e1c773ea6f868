"""The Ascend kernel under true parallelism (skipped without a CUDA GPU).

The ``ascend`` target's source, compiled by upstream Triton, runs on the GPU with a persistent
grid of 20-48 programs (an Ascend chip's vector cores), every program looping over dozens of
token tiles at the same time as the others: a race between programs shows as wrong outputs.
10 random bf16 batches of >= 10,000 tokens over several presets, outputs poisoned with NaN
first, against the float64 formulation; and every golden case through the backend. The device
is :data:`support.devices.GPU_DEVICE` (``meta`` in the bundle build: launches, no values).
"""

from __future__ import annotations

import pytest
import torch
from support.devices import GPU_DEVICE, gpu_marks, has_values, synchronize
from test_gpu import preset_problem

import fqr
from fqr import reference
from fqr.ascend_on_cuda import NAME, generated_body, lower_ascend_on_cuda
from fqr.golden import list_cases, load_case
from fqr.numerics import compare
from fqr.prologue import program_of

pytestmark = gpu_marks(NAME)

# (preset, tokens, programs): odd token counts, so the last tile of some program is partial.
BATCHES = [
    ("qwen3-8b", 10_000, 40),
    ("qwen3-8b", 16_411, 20),
    ("gemma3-1b", 10_007, 48),  # head_dim 256 (qwen3.5-27b's gated mRoPE: test_gpu.py)
    ("gemma3-27b", 12_289, 40),  # (1 + w) norm
    ("glm4-9b", 10_243, 24),  # GPT-J, partial rotary
    ("olmo2-7b", 11_003, 32),  # full-width norm
    ("qwen3-0.6b", 20_001, 48),
    ("qwen3-30b-a3b", 10_000, 20),
    ("gemma3-1b", 13_337, 40),
    ("llama3-8b", 10_001, 30),  # no norm
]


@pytest.mark.parametrize("name,tokens,programs", BATCHES)
def test_large_batches_against_float64(gen, name, tokens, programs):
    p, drawn = preset_problem(gen, name, tokens, torch.bfloat16)  # on the GPU
    pb = drawn.to(GPU_DEVICE)
    program = program_of(p, torch.bfloat16)
    kernel = lower_ascend_on_cuda(program, num_vectorcore=programs)
    tiles = -(-tokens // kernel.tiling.block_t)
    assert (
        kernel.target.grid(tokens, kernel.tiling.block_t, pb.qkv.device, num_vectorcore=programs)
        == programs
    )
    assert tiles >= 10 * programs, "every program must run many tiles"
    outs = [
        torch.full((tokens, v.aval.shape[1]), float("nan"), dtype=torch.bfloat16, device=GPU_DEVICE)
        for v in program.outputs
    ]
    args = [t for t in (*pb.args(), pb.q_bias, pb.k_bias) if t is not None]
    kernel(*args, out=outs)
    synchronize()
    if not has_values(*outs):
        return
    exact = reference.prologue(*drawn.args(), **drawn.kwargs())
    for n, o, e in zip("qkv", outs, exact):
        c = compare(o, e, head_dim=p.head_dim, bitwise=n == "v")
        assert c.passed, f"{name} T={tokens} programs={programs} {n}: {c}"


@pytest.mark.parametrize("entry", list_cases(), ids=lambda e: e["name"])
def test_golden_cases(entry):
    case = load_case(entry)
    outputs = case.to(GPU_DEVICE).run(NAME)
    if not has_values(*outputs):
        return
    for name, c in case.check(*outputs).items():
        assert c.passed, f"{entry['name']} {name}: {c}"


def test_backend_is_the_ascend_source():
    from fqr.lowering import kernel_source

    program = program_of(fqr.get_preset("qwen3-8b"), torch.bfloat16)
    ascend = kernel_source(program, "ascend")
    assert generated_body(lower_ascend_on_cuda(program).source) == generated_body(ascend)
