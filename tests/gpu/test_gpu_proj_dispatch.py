"""Issue 40 item 4 on the compiled CUDA kernels (skipped without a GPU; on ``meta`` in the bundle
build): the projection dispatch (``fqr.proj_dispatch``, ``torch.ops.fqr.<op>_proj_dispatch``)
runs what the shipped table says for this device, bit for bit the op it names (the projected
kernel, or ``F.linear`` then the prologue op), and each against float64. On the H200 the table
picks the fused kernel at TP 8, T = 1 (seeded from docs/results/projection*-h200-issue40.log) and
the pair at T = 16 and at TP 1; on any other GPU it runs the pair."""

from __future__ import annotations

import pytest
import torch
from support.devices import GPU_DEVICE, has_values
from support.peer_ports import ON_TRITON

from fqr import projection, reference
from fqr.numerics import compare
from fqr.presets import get_preset
from fqr.prologue import DECLARATIONS, variant_of

pytestmark = ON_TRITON

MAX_POSITION = 4096
# (preset, TP, T, what the shipped table picks on the H200)
CASES = [
    ("qwen3-8b", 8, 1, "fused"),
    ("qwen3-8b", 8, 16, "pair"),
    ("qwen3-8b", 1, 1, "pair"),
    ("llama3-8b", 8, 1, "fused"),
    ("qwen3-vl-8b", 8, 1, "fused"),
    ("qwen3-32b", 8, 1, "pair"),
]


@pytest.mark.gpu_memory(1 << 30)
@pytest.mark.parametrize("name,tp,tokens,on_h200", CASES, ids=lambda v: str(v))
def test_dispatch_runs_what_the_table_says(gen, name, tp, tokens, on_h200):
    preset = get_preset(name, tp)
    variant = variant_of(preset)
    proj = DECLARATIONS[variant.declaration.name + "_proj"]
    device = torch.device(GPU_DEVICE)
    table = preset.cos_sin_cache(MAX_POSITION).to(device)
    dtype = torch.bfloat16
    inputs = variant.draw(preset, tokens, dtype, gen, max_position=MAX_POSITION)
    width, hidden = inputs["qkv"].shape[1], preset.hidden_size
    x = torch.randn(tokens, hidden, generator=gen, device=gen.device, dtype=torch.float64)
    w = torch.randn(width, hidden, generator=gen, device=gen.device, dtype=torch.float64)
    x, w = x.to(device, dtype), (w / hidden**0.5).to(device, dtype)
    values = variant.arguments(preset, inputs, table)
    rest = {k: v.to(device) if isinstance(v, torch.Tensor) else v
            for k, v in values.items() if k in proj.index and k != "qkv"}  # fmt: skip
    given = dict(rest, x=x, w_qkv=w)
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
    expected = variant.expected(preset, dict(inputs, qkv=row), table)
    for (out_name, exact), out in zip(expected.items(), outs):
        result = compare(out, exact.to(device), head_dim=preset.head_dim)
        assert result.passed and result.nonfinite == 0, (out_name, choice, result)
