"""``numerics="unfused"`` on the ascend-target kernel under Triton-Ascend's interpreter equals
vLLM's native prologue (``fqr.unfused``, written from vLLM's code) and the reference
backend bit for bit: NeoX and GPT-J, full and partial rotary, ``RMSNorm`` and ``GemmaRMSNorm``,
bf16 and fp16. Fixed inputs: the kernel's fp32 sum of squares adds in another order than torch's,
so an element on a rounding boundary of ``x * rstd`` could round the other way (about 2^-16 of
them; ``fqr.numerics``)."""

from __future__ import annotations

import pytest
import torch
from support.ascend import ASCEND_INTERPRET_MARKS
from support.vllm_native import vllm_native_case

import fqr

pytestmark = ASCEND_INTERPRET_MARKS

CASES = [
    # (dtype, head_dim, rotary_dim, is_neox, gemma)
    (torch.bfloat16, 64, 64, True, False),
    (torch.bfloat16, 128, 32, False, False),
    (torch.bfloat16, 64, 64, False, True),
    (torch.float16, 64, 32, True, False),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_ascend_unfused_equals_vllm_native_and_reference_bitwise(case):
    dtype, d, r, is_neox, gemma = case
    gen = torch.Generator().manual_seed(20261201)
    native = vllm_native_case(gen, dtype, d, r, is_neox=is_neox, gemma=gemma, tokens=9)
    want_q, want_k = native.vllm()
    got = fqr.split_qkv_rmsnorm_rope(*native.args, **native.fqr_kwargs(backend="ascend-interpret"))
    ref = fqr.split_qkv_rmsnorm_rope(*native.args, **native.fqr_kwargs(backend="reference"))
    for name, g, want, r_ in zip("qk", got, (want_q, want_k), ref):
        assert torch.equal(g.view(torch.int16), want.view(torch.int16)), f"{name} vs vLLM"
        assert torch.equal(g.view(torch.int16), r_.view(torch.int16)), f"{name} vs reference"
