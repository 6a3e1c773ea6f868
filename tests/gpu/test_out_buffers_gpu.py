"""``out=(q, k, v)`` on the triton backend (skipped without a CUDA GPU): real preset shapes, the
outputs written into NaN-poisoned views of one wider buffer (strided rows), against float64;
nothing outside the views written. The device is :data:`support.devices.GPU_DEVICE` (``meta``
in the bundle build: launches, no values)."""

import pytest
import torch
from support.devices import GPU_DEVICE, gpu_marks, has_values, rope_table

import fqr
from fqr import reference
from fqr.inputs import random_inputs
from fqr.numerics import compare

pytestmark = gpu_marks("triton")
GAP = 8  # poisoned columns after each view


@pytest.mark.parametrize("tokens", [1, 77, 4099])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("name", ["qwen3-8b", "gemma3-27b", "olmo2-7b", "glm4-9b"])
def test_out_views_on_triton(gen, name, dtype, tokens):
    p = fqr.get_preset(name)
    inputs = random_inputs(p.spec, tokens, dtype, gen, rope_table(p, 1 << 16))
    on_gpu = inputs.to(GPU_DEVICE)
    widths = (p.spec.q_size, p.spec.kv_size, p.spec.kv_size)
    shape = (tokens, sum(widths) + 3 * GAP)
    buffer = torch.full(shape, float("nan"), dtype=dtype, device=GPU_DEVICE)
    views, start, written = [], 0, torch.zeros(buffer.shape[1], dtype=torch.bool, device=GPU_DEVICE)
    for w in widths:
        views.append(buffer[:, start : start + w])
        written[start : start + w] = True
        start += w + GAP
    got = fqr.split_qkv_rmsnorm_rope(
        *on_gpu.args(), **on_gpu.kwargs(backend="triton"), out=tuple(views)
    )
    assert all(g is v for g, v in zip(got, views))
    if not has_values(buffer):
        return
    exact = reference.prologue(*inputs.args(), **inputs.kwargs())
    for n, o, e in zip("qkv", views, exact):
        c = compare(o, e, head_dim=p.head_dim, bitwise=n == "v")
        assert c.passed, f"{n}: {c}"
    assert buffer[:, ~written].isnan().all()
