"""Programmatic dependent launch on the GPU (skipped without one; issue 24.2; formerly
``scripts/pdl_probe.py``): the kernel lowered with ``pdl=True`` (Triton's ``launch_pdl``, and
``gdc_wait`` before its first load) launched right after the QKV projection GEMM that writes its
input must read what the GEMM wrote: its outputs are the plain launch's bit for bit, and both
are within the fused contract of the independent float64 formulation of the GEMM's output
(:func:`fqr.reference.prologue`). What PDL costs or saves there is ``fqr bench --pdl``'s."""

from __future__ import annotations

import pytest
import torch
from support.devices import GPU_DEVICE, has_values, rope_table
from support.peer_ports import ON_TRITON

import fqr
from fqr import reference
from fqr.bench.checks import check_row_index
from fqr.inputs import random_inputs
from fqr.lowering import lower_by_tokens
from fqr.numerics import compare
from fqr.prologue import program_of, variant_of

pytestmark = ON_TRITON


@pytest.mark.parametrize("tokens", [1, 16384])
def test_pdl_launch_after_the_projection_gemm_reads_its_output(gen, tokens):
    """Qwen3-8B bf16 at a decode and a prefill size (two kernel variants): qkv poisoned with
    NaN, then hidden ``[T, 4096]`` times a ``[4096, 6144]`` weight (unit-scale output) into it,
    then the kernel, plain and with PDL: a kernel that read before the GEMM finished would
    read NaN."""
    p, dtype = fqr.get_preset("qwen3-8b"), torch.bfloat16
    program = program_of(p, dtype)
    plain = lower_by_tokens(program, "cuda")
    pdl = lower_by_tokens(program, "cuda", pdl=True)
    x = random_inputs(p.spec, tokens, dtype, gen, rope_table(p))
    in_features = variant_of(p).projection_in_features(p)
    assert in_features == 4096, "Qwen3-8B's hidden size"
    hidden = torch.randn(tokens, in_features, generator=gen, device=gen.device).to(dtype)
    weight = (
        torch.randn(in_features, p.spec.qkv_width, generator=gen, device=gen.device)
        * in_features**-0.5
    ).to(dtype)
    on_gpu = x.to(GPU_DEVICE)
    hidden, weight = hidden.to(GPU_DEVICE), weight.to(GPU_DEVICE)

    def after_gemm(kernels) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """NaN into qkv, the GEMM into it, then ``kernels``: (what the GEMM wrote, the kernel's
        outputs)."""
        on_gpu.qkv.fill_(float("nan"))
        torch.mm(hidden, weight, out=on_gpu.qkv)
        outs = kernels.launch(on_gpu.operands())
        return on_gpu.qkv.clone(), outs

    qkv, plain_outs = after_gemm(plain)
    qkv_again, pdl_outs = after_gemm(pdl)
    if not has_values(qkv, *plain_outs, *pdl_outs):
        return
    assert torch.equal(qkv.view(torch.int16), qkv_again.view(torch.int16)), "the GEMM differs"
    for name, a, b in zip("qkv", plain_outs, pdl_outs):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{name}: pdl changed bits"
    rows = check_row_index(tokens, 1024, gen, gen.device)
    exact = reference.prologue(qkv[rows], x.positions[rows], *x.args()[2:], **x.kwargs())
    for name, out, ex in zip("qkv", pdl_outs, exact):
        c = compare(out[rows], ex, head_dim=p.head_dim, bitwise=name == "v")
        assert c.passed, f"{name} after the GEMM against float64: {c}"
