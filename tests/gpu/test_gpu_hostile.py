"""The GPU's own failure modes (issue 23.9), on a CUDA GPU (skipped without one): an
out-of-range position on the ``reference`` backend marks its token NaN as the kernel does and
leaves the CUDA context usable; tensors on another GPU than the current one run on theirs
(skipped with one GPU); no ``torch.ops.fqr`` op returns an output sharing memory with an
input, and ``opcheck`` passes on every variant's op on CUDA. The device is
:data:`support.devices.GPU_DEVICE` (``meta`` in the bundle build: launches, no values)."""

import pytest
import torch
from support.devices import (
    GPU_DEVICE,
    gpu_marks,
    has_values,
    launch_copies,
    rope_table,
    synchronize,
)

import fqr
from fqr.numerics import compare_kind
from fqr.prologue import VARIANTS, presets_of, variant_of

pytestmark = gpu_marks("triton")
ROWS = 4096


def _problem(name: str, gen, tokens: int = 7):
    preset = fqr.PRESETS[presets_of(name)[0]]
    variant = variant_of(preset)
    table = rope_table(preset, ROWS)
    inputs = variant.draw(preset, tokens, torch.bfloat16, gen, max_position=ROWS)
    return preset, variant, inputs, table


def _to(inputs: dict, device) -> dict:
    return {k: x.to(device, copy=True) for k, x in inputs.items()}


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_an_out_of_range_position_marks_its_token_and_the_context_survives(gen, backend):
    preset, variant, inputs, table = _problem("split-qkv", gen)
    expected = variant.expected(preset, inputs, table)
    bad = 3
    on_gpu = launch_copies(inputs)
    on_gpu["positions"][bad] = ROWS  # one past the table: not read back on the host
    q, k, v = variant.run(preset, on_gpu, table.to(GPU_DEVICE), backend=backend)
    synchronize()  # a device-side assert would surface here
    if not has_values(q, k, v):
        return
    good = [t for t in range(q.shape[0]) if t != bad]
    assert q[bad].isnan().all() and k[bad].isnan().all()
    for n, o in (("q", q), ("k", k)):
        c = compare_kind("contract", o[good], expected[n][good], head_dim=preset.head_dim)
        assert c.passed, f"{n}: {c}"
    assert torch.equal(v, inputs["qkv"][:, -v.shape[1] :])  # v is copied through
    assert float(torch.ones(4, device=GPU_DEVICE).sum()) == 4.0  # the context still works


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_tensors_on_another_gpu_run_on_theirs(gen, name):
    preset, variant, inputs, table = _problem(name, gen)
    expected = variant.expected(preset, inputs, table)
    second = torch.device(GPU_DEVICE, 1)
    torch.cuda.set_device(0)
    outs = variant.run(preset, _to(inputs, second), table.to(second), backend="triton")
    torch.cuda.synchronize(second)
    assert torch.cuda.current_device() == 0
    for n, o in zip(variant.outputs_of(preset), outs):
        assert o.device == second
        kind, d = variant.tolerance(n, preset), variant.head_dim(preset, n)
        assert compare_kind(kind, o, expected[n], head_dim=d).passed, n


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_torch_ops_return_no_output_sharing_an_input(gen, name):
    preset, variant, inputs, table = _problem(name, gen)
    op, args = variant.torch_op(preset, launch_copies(inputs), table.to(GPU_DEVICE))
    result = op(*args)
    outs = result if isinstance(result, (tuple, list)) else [result]
    given = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    for o in outs:  # (meta tensors have no memory: every address is 0)
        if isinstance(o, torch.Tensor) and o.numel() and has_values(o):
            assert o.untyped_storage().data_ptr() not in given, f"{name}: an output aliases"
    torch.library.opcheck(op, args)
