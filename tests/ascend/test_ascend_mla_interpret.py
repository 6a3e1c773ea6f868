"""The MLA KV prologue (``tests/support/mla.py``) as the ``ascend``-target kernel under
Triton-Ascend's interpreter (``ascend-interpret``): each cache flavour against the float64
formulation, the fp8_ds_mla entry stored byte by byte (``Tiling.byte_stores="bytes"``: the
compiler refuses pointer casts between widths), the FP8 flavours lowered for the 950."""

from __future__ import annotations

import pytest
import torch
from support.ascend import ASCEND_INTERPRET_MARKS
from support.mla import EPS, KV_LORA, Q_LORA, check_cache, draw, mla_program

from fqr import reference
from fqr.backends import BACKENDS
from fqr.lowering import lower

pytestmark = ASCEND_INTERPRET_MARKS


@pytest.mark.parametrize(
    "flavour, q_lora, dtype",
    [
        ("auto", Q_LORA, torch.bfloat16),
        ("fp8", 0, torch.bfloat16),
        ("fp8_ds_mla", Q_LORA, torch.bfloat16),
        ("fp8_ds_mla", 0, torch.float16),
    ],
    ids=["auto", "fp8-no-q_c", "fp8_ds_mla", "fp8_ds_mla-fp16-no-q_c"],
)
def test_mla_kv_on_ascend_interpret(gen, flavour, q_lora, dtype):
    prog = mla_program(flavour, dtype, q_lora=q_lora)
    kernel = lower(prog, "ascend-interpret")
    assert kernel.tiling.byte_stores == ("bytes" if flavour == "fp8_ds_mla" else "cast")
    kv_a, positions, table, q_w, kv_w, cache, slots, scale = draw(gen, flavour, dtype, q_lora, 9)
    before = cache.clone()
    args = [a for a in (kv_a, positions, table, q_w, kv_w, cache, slots, scale) if a is not None]
    outs = BACKENDS["ascend-interpret"].launch(prog, args)
    assert outs[-1] is cache
    q_c, kv_c, k_pe = reference.mla_kv(
        kv_a, positions, table, q_w, kv_w, q_lora_rank=q_lora, kv_lora_rank=KV_LORA, eps=EPS
    )
    if q_lora:
        from fqr.numerics import compare

        assert compare(outs[0], q_c, head_dim=Q_LORA).passed
    written = check_cache(flavour, cache, before, kv_c, k_pe, slots, scale, dtype)
    assert written == kv_a.shape[0] - 2
