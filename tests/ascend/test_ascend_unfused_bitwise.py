"""``numerics="unfused"`` on the ascend-target kernel under Triton-Ascend's interpreter equals
vLLM's native prologue (``fqr.fusion.unfused``, written from vLLM's code) and the reference
backend bit for bit: NeoX and GPT-J, full and partial rotary, ``RMSNorm`` and ``GemmaRMSNorm``,
bf16 and fp16. Fixed inputs: the kernel's fp32 sum of squares adds in another order than torch's,
so an element on a rounding boundary of ``x * rstd`` could round the other way (about 2^-16 of
them; ``fqr.numerics``)."""

from __future__ import annotations

import pytest
import torch
from support.ascend import ASCEND_INTERPRET_MARKS

import fqr
from fqr.fusion.unfused import vllm_qk_norm_rope
from fqr.rope_cache import rope_cos_sin_cache

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
    heads, kv_heads, tokens, max_pos = 3, 1, 9, 4096
    table = rope_cos_sin_cache(r, max_pos, 1e6)
    scale = 0.5 + 3.0 * torch.rand(heads + 2 * kv_heads, 1, generator=gen)
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, d, generator=gen) * scale).reshape(tokens, -1)
    qkv = qkv.to(dtype)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen)
    centre = 0.0 if gemma else 1.0
    qw = (centre + 0.2 * torch.randn(d, generator=gen)).to(dtype)
    kw = (centre + 0.2 * torch.randn(d, generator=gen)).to(dtype)
    want_q, want_k, _ = vllm_qk_norm_rope(
        qkv,
        positions,
        table,
        qw,
        kw,
        q_size=heads * d,
        kv_size=kv_heads * d,
        eps=1e-6,
        is_neox=is_neox,
        gemma=gemma,
    )
    kwargs = dict(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=d,
        eps=1e-6,
        is_neox=is_neox,
        weight_offset=1.0 if gemma else 0.0,
        numerics="unfused",
    )
    args = (qkv, positions, table, qw, kw)
    got = fqr.split_qkv_rmsnorm_rope(*args, **kwargs, backend="ascend-interpret")
    ref = fqr.split_qkv_rmsnorm_rope(*args, **kwargs, backend="reference")
    for name, g, want, r_ in zip("qk", got, (want_q, want_k), ref):
        assert torch.equal(g.view(torch.int16), want.view(torch.int16)), f"{name} vs vLLM"
        assert torch.equal(g.view(torch.int16), r_.view(torch.int16)), f"{name} vs reference"
