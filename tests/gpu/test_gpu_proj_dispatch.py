"""Issue 40 item 4 on the compiled CUDA kernels (skipped without a GPU; on ``meta`` in the bundle
build): the projection dispatch (``fqr.proj_dispatch``, ``torch.ops.fqr.<op>_proj_dispatch``)
runs what the shipped table says for this device, bit for bit the op it names (the projected
kernel, or ``F.linear`` then the prologue op), and each against float64. On the H200 the table
(docs/results/projection-h200-issue40-d.log) picks the fused kernel at T = 1 at TP 8 and at TP 1
but for Qwen3-32B, at T = 2 at TP 8, and the pair at T = 16; on any other GPU it runs the pair."""

from __future__ import annotations

import pytest
import torch
from support.devices import GPU_DEVICE, has_values
from support.peer_ports import ON_TRITON
from support.projected import projected_case

from fqr import projection, reference
from fqr.numerics import compare

pytestmark = ON_TRITON

# (preset, TP, T, what the shipped table picks on the H200)
CASES = [
    ("qwen3-8b", 8, 1, "fused"),
    ("qwen3-8b", 8, 2, "fused"),
    ("qwen3-8b", 8, 16, "pair"),
    ("qwen3-8b", 1, 1, "fused"),
    ("qwen3-8b", 1, 16, "pair"),
    ("llama3-8b", 8, 1, "fused"),
    ("qwen3-vl-8b", 1, 1, "fused"),
    ("qwen3-32b", 8, 1, "fused"),
    ("qwen3-32b", 8, 2, "fused"),
    ("qwen3-32b", 1, 1, "pair"),
    ("qwen3-32b", 1, 2, "pair"),
]


@pytest.mark.gpu_memory(1 << 30)
@pytest.mark.parametrize("name,tp,tokens,on_h200", CASES, ids=lambda v: str(v))
def test_dispatch_runs_what_the_table_says(gen, name, tp, tokens, on_h200):
    case = projected_case(gen, name, tp, tokens, torch.device(GPU_DEVICE))
    proj, device = case.proj, case.x.device
    x, w, rest, given = case.x, case.w, case.rest, case.given
    choice = projection.choice_for(proj.base.name, **given)
    if device.type == "cuda" and projection.device_name(device) == "NVIDIA H200":
        assert choice == on_h200
    outs = projection.proj_dispatch(proj.base.name, **given)
    outs = outs if isinstance(outs, tuple) else (outs,)
    if choice == "fused":
        named = proj.function(**given)
        row = reference.project(x, w)
    else:
        qkv = torch.nn.functional.linear(x, w)
        named = proj.base.function(qkv, **rest)
        row = qkv
    named = named if isinstance(named, tuple) else (named,)
    if not has_values(*outs):
        return
    for got, want in zip(outs, named):
        assert torch.equal(got, want)
    expected = case.variant.expected(case.preset, dict(case.inputs, qkv=row), case.table)
    for (out_name, exact), out in zip(expected.items(), outs):
        result = compare(out, exact.to(device), head_dim=case.preset.head_dim)
        assert result.passed and result.nonfinite == 0, (out_name, choice, result)
