"""Issue 40 on the compiled CUDA kernel (skipped without a GPU; on ``meta`` in the bundle build):
the projected forms (``<op>_proj``: the QKV GEMM with the prologue as its epilogue, one kernel)
at each preset's real widths and hidden size, against the float64 composition computed on the
device (``fqr.reference.project``, then the prologue's reference), outputs in NaN-poisoned
memory. Token counts 1, 2 (the public op's two-token GEMV where the weights are small), 16
(decode: one 16-token MMA tile) and 300 (several tiles, a ragged last one); the public op's
own schedule (its token buckets), the tensor-core tiles of 16 and 64 tokens (one head a
program, or two), bf16 operands native or widened to TF32, the
broadcast product of a few tokens (``"fma"``, ``block_t=1``: the one-token GEMV form), split-K
(8 K ranges, the last to finish runs the epilogue) and the GEMV in 24 ranges. The interpreted
kernel runs the same forms on small shapes in ``tests/backends/test_projected.py``."""

from __future__ import annotations

import pytest
import torch
from support.devices import GPU_DEVICE, has_values
from support.peer_ports import ON_TRITON
from support.projected import projected_case

from fqr import reference
from fqr.bench.checks import poison_free_memory
from fqr.lowering import lower
from fqr.numerics import compare

pytestmark = ON_TRITON

GIB = 1 << 30
# (preset, TP): the families of issue 40's bench (Qwen3 at two sizes, Llama 3 without q/k norm,
# Qwen3-VL's mRoPE) and the row layouts of the others (the gated mRoPE row, the v norm,
# GPT-NeoX's per-head row, CodeGen's shards, LayerNorm, FP8 outputs).
CASES = [
    ("qwen3-8b", 1), ("qwen3-8b", 8), ("qwen3-32b", 8), ("llama3-8b", 1), ("llama3-8b", 8),
    ("qwen3-vl-8b", 1), ("qwen3-vl-8b", 8), ("qwen3.5-27b", 8), ("gemma4-31b-sliding", 16),
    ("pythia-6.9b", 8), ("codegen-2b", 4), ("persimmon-8b", 8), ("minimax-m3-fp8", 8),
]  # fmt: skip
SCHEDULES = {
    "default": None,  # the public op: its token buckets (GEMV, split-K, 64-token tiles)
    "mma": {"block_t": 16},
    "mma-h2": {"block_t": 16, "heads_per_program": 2},
    "t64": {"block_t": 64, "num_warps": 4},
    "mma-tf32": {"product_operands": "tf32"},
    "fma": {"product_dot": "fma", "block_t": 1},
    "sk8": {"split_k": 8, "num_warps": 4},
    "sk8-tf32": {"split_k": 8, "num_warps": 4, "product_operands": "tf32"},
    # the one-token GEMV in ranges of two 128-wide K steps (some ranges past K, masked)
    "gemv-sk24": {"product_dot": "fma", "block_k": 128, "split_k": 24, "num_warps": 4},
}
FEW_TOKENS = ("fma", "sk8", "sk8-tf32", "gemv-sk24")  # the decode schedules


@pytest.mark.gpu_memory(GIB)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("tokens", [1, 2, 16, 300])
@pytest.mark.parametrize("name,tp", CASES, ids=lambda v: str(v))
def test_projected_kernel_matches_float64(gen, name, tp, tokens, schedule):
    if schedule in FEW_TOKENS and tokens == 300:
        pytest.skip("a decode schedule (the broadcast product, split-K)")
    if tokens == 2 and schedule != "default":
        pytest.skip("T = 2: the public op's bucket (the GEMV a program per token at TP 8)")
    case = projected_case(gen, name, tp, tokens, torch.device(GPU_DEVICE))
    proj, device = case.proj, case.x.device
    given = dict(case.given, backend="triton")
    if device.type == "cuda":
        poison_free_memory(256 << 20, device)
    if SCHEDULES[schedule] is None:
        outs = proj.function(**given)
        outs = outs if isinstance(outs, tuple) else (outs,)
    else:
        call = proj.bound(proj.bind((), given))
        proj.validate(call)
        kernel = lower(proj.program(call), "cuda", **SCHEDULES[schedule])
        outs = kernel.launch(proj.operands(call))
    if not has_values(*outs):
        return
    row = reference.project(case.x, case.w)
    expected = case.variant.expected(case.preset, dict(case.inputs, qkv=row), case.table)
    for (out_name, exact), out in zip(expected.items(), outs):
        result = compare(out, exact.to(device), head_dim=case.preset.head_dim)
        assert result.passed and result.nonfinite == 0, (out_name, result)
