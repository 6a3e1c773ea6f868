"""Rounding points survive compilation (issue 24.4): a kernel that rounds between steps
(``numerics="unfused"``, ``EmitContext.round_point``) is compiled without multiply-add
contraction, because a contraction skips the rounding: in its PTX for sm_90 ``round(round(a *
c) - round(b * s))`` became ``fma.rn.bf16(a, c, -round(b * s))``, which kept CUDA's unfused q
and k off vLLM's bits.

The launch options are checked in this process; the PTX is compiled for sm_90 without a GPU in
a process of its own (:mod:`support.cuda_ptx`)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from support.cuda_ptx import run_compiling
from support.vllm_native import vllm_native_case

from fqr.lowering import _build
from fqr.prologue.split_qkv import SPLIT_QKV_RMSNORM_ROPE as DECL


def unfused_program(numerics: str, head_dim: int = 128, rotary_dim: int = 64):
    """Qwen3-style q/k heads (4 + 2 kv) of ``head_dim``, NeoX RoPE over ``rotary_dim``, as
    vLLM's native prologue is asked for under ``numerics``."""
    native = vllm_native_case(
        torch.Generator().manual_seed(0), torch.bfloat16, head_dim, rotary_dim, is_neox=True,
        table_in_dtype=True, heads=4, kv_heads=2, tokens=3, max_position=64, device="cpu",
    )  # fmt: skip
    call = DECL.bound(DECL.bind(native.args, native.fqr_kwargs(numerics=numerics)))
    DECL.validate(call)
    return DECL.program(call)


@pytest.mark.parametrize("numerics", ["fused", "unfused"])
def test_an_unfused_kernel_launches_without_contraction(numerics):
    """What ``lower(program, "cuda")`` launches with: ``enable_fp_fusion=False`` exactly when
    the emitted code has rounding points (always given: Triton's own default changes in
    3.10); an explicit ``fp_fusion`` option wins."""
    target, plan, _, emitted, _, _ = _build(unfused_program(numerics), "cuda", {})
    assert emitted.rounding_points == (numerics == "unfused")
    launch = target.launch_options(plan, rounding_points=emitted.rounding_points)
    # contraction on where it only adds precision (fused), off across rounding points
    assert launch["enable_fp_fusion"] is (numerics == "fused")
    forced = target.launch_options(plan, rounding_points=emitted.rounding_points, fp_fusion=True)
    assert forced["enable_fp_fusion"] is True


PTX_COUNTS = textwrap.dedent(
    """
    import re
    from support.cuda_ptx import compile_for_sm90
    from lowering.test_rounding_points import unfused_program
    from fqr.lowering import lower
    OPS = ("fma.rn.bf16", "fma.rn.f32", "mul.rn.bf16", "sub.rn.bf16", "add.rn.bf16")
    for d, r in ((128, 64), (64, 64), (256, 256)):
        for options in ({{}}, {{"fp_fusion": True}}):
            ptx = compile_for_sm90(lower(unfused_program("unfused", d, r), "cuda", **options),
                                   64).asm["ptx"]
            print(d, r, bool(options), *(len(re.findall(re.escape(o) + r"\\s", ptx)) for o in OPS))
    """
)


def test_the_unfused_ptx_rounds_every_product(tmp_path):
    """No FMA in the unfused kernel's PTX: each RoPE product and difference rounded to bf16
    on its own (``mul.rn.bf16`` / ``sub.rn.bf16`` / ``add.rn.bf16``), the fp32 statistic
    multiplied and added apart; with contraction forced on, the same source contracts."""
    rows = [line.split() for line in run_compiling(PTX_COUNTS.format(), tmp_path).splitlines()]
    assert len(rows) == 6, rows
    for d, r, forced, fma_bf16, fma_f32, mul, sub, add in rows:
        counts = (int(fma_bf16), int(fma_f32), int(mul), int(sub), int(add))
        if forced == "True":
            assert counts[0] > 0, (d, r, counts)  # what the default was before
        else:
            assert counts[:2] == (0, 0) and min(counts[2:]) > 0, (d, r, counts)
