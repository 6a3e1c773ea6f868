"""Run a traced program on the reference interpreter and as its generated kernel, and compare
every output with an independent float64 expectation."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fqr.core import Program, eval_program
from fqr.numerics import compare
from support.devices import has_values


def poisoned_outputs(program: Program, tokens: int, device="cpu") -> list[torch.Tensor]:
    """NaN-filled outputs of the program's shapes and dtypes on ``device`` (unwritten elements
    show)."""
    return [
        torch.full((tokens, v.aval.shape[1]), float("nan"), dtype=v.aval.dtype, device=device)
        for v in program.outputs
    ]


def run_kernel(program: Program, args: Sequence[torch.Tensor], target="interpret", **options):
    """The program's fused kernel on ``args``, into poisoned outputs on the first argument's
    device; (outputs, kernel)."""
    from fqr.lowering import lower

    kernel = lower(program, target, **options)
    outs = poisoned_outputs(program, args[0].shape[0], args[0].device)
    kernel(*args, out=outs)
    return outs, kernel


def check_outputs(outs, expected, head_dims, copies=()) -> None:
    """Each output against its float64 expectation under the fused contract (per-head ULPs);
    outputs listed in ``copies`` (indices) must equal theirs bit for bit (nothing to check on
    ``meta``)."""
    assert len(outs) == len(expected) == len(head_dims)
    if not has_values(*outs):
        return
    for i, (o, e, d) in enumerate(zip(outs, expected, head_dims)):
        c = compare(o, e, head_dim=d, bitwise=i in copies)
        assert c.passed, f"output {i}: {c}"


def check_reference_and_kernel(program, args, expected, head_dims, copies=(), **options):
    """The reference interpreter and the interpreted kernel both meet the contract."""
    check_outputs(eval_program(program, list(args)), expected, head_dims, copies)
    outs, kernel = run_kernel(program, args, **options)
    check_outputs(outs, expected, head_dims, copies)
    return kernel
