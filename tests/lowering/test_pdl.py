"""Programmatic dependent launch (issue 24.2): ``lower(program, "cuda", pdl=True)`` waits on the
previous kernel before its first load (``gdc_wait``), lets the next one launch early
(``gdc_launch_dependents``) and launches with Triton's ``launch_pdl``; the interpreter refuses
it; the kernel compiles for sm_90 to PTX's ``griddepcontrol`` instructions (without a GPU, in a
process of its own: :mod:`support.cuda_ptx`)."""

from __future__ import annotations

import textwrap

import pytest
from support.cuda_ptx import run_compiling

from fqr.lowering import _build, kernel_source
from fqr.presets import get_preset
from fqr.prologue import program_of


def qwen3_program():
    return program_of(get_preset("qwen3-8b", 8))


def test_pdl_waits_before_the_first_load_and_launches_with_launch_pdl():
    source = kernel_source(qwen3_program(), "cuda", pdl=True)
    body = source[source.index("def fqr_cuda_") :]
    wait = body.index("tl.extra.cuda.gdc_wait()")
    assert wait < body.index("tl.load(") and "tl.extra.cuda.gdc_launch_dependents()" in body
    plain = kernel_source(qwen3_program(), "cuda")
    assert "gdc_" not in plain  # off by default
    target, plan, *_ = _build(qwen3_program(), "cuda", {"pdl": True})
    assert target.launch_options(plan, pdl=True)["launch_pdl"] is True
    assert "launch_pdl" not in target.launch_options(plan)


def test_the_interpreter_refuses_pdl():
    with pytest.raises(ValueError, match="pdl: programmatic dependent launch runs on a CUDA GPU"):
        kernel_source(qwen3_program(), "interpret", pdl=True)


PDL_PTX = textwrap.dedent(
    """
    from support.cuda_ptx import compile_for_sm90
    from lowering.test_pdl import qwen3_program
    from fqr.lowering import lower
    for pdl in (False, True):
        ptx = compile_for_sm90(lower(qwen3_program(), "cuda", pdl=pdl), 64).asm["ptx"]
        print(pdl, "griddepcontrol.wait" in ptx, "griddepcontrol.launch_dependents" in ptx)
    """
)


def test_the_pdl_kernel_compiles_to_griddepcontrol(tmp_path):
    rows = [line.split() for line in run_compiling(PDL_PTX, tmp_path).splitlines()]
    assert rows == [["False", "False", "False"], ["True", "True", "True"]]
