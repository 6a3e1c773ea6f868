"""FP8 E5M2 q outputs wherever E4M3 ones are given (issue 41.3): FlashInfer's
``mla_rope_quantize_fp8(..., quantize_dtype=torch.float8_e5m2)`` is ``fqr.mla_q_rope(...,
quant_scale_q=s, quantize_dtype=torch.float8_e5m2)``, and the MLA prologue's FP8 q_c takes
the same argument. Each output is ``e5m2(clamp(x * quant_scale_q, -57344, 57344))``: within
one E5M2 ULP of float64 (the contract), exactly +-57344 where the float64 value is past it,
NaN nowhere; ``quant_scale_q`` multiplies as before, and ``quantize_dtype`` None or
float8_e4m3fn gives the E4M3 outputs of before, bit for bit."""

from __future__ import annotations

import pytest
import torch
from support.mla_widths import prologue_call

import fqr
from fqr.backends import BACKENDS
from fqr.numerics import compare
from fqr.prologue.mla_q_rope import mla_q_rope_reference
from fqr.rope_cache import rope_cos_sin_cache

BACKEND_NAMES = ["reference"] + (["interpret"] if BACKENDS["interpret"].available else [])
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TABLE = rope_cos_sin_cache(32, 4096, 1e4)


def _q(gen, tokens=5, heads=4, nope=96, rope=32, dtype=torch.bfloat16):
    """q_b_proj's output with a wide range: some products past 57344, some in E5M2's
    subnormal range."""
    q = torch.randn(tokens, heads * (nope + rope), generator=gen, dtype=torch.float64) * 300
    q[:, ::7] *= 1e3
    q[:, 3::11] *= 1e-7
    return q.to(dtype)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_mla_q_rope_e5m2_matches_float64(gen, dtype, backend):
    q = _q(gen, dtype=dtype)
    positions = torch.randint(0, 4096, (5,), generator=gen)
    scale = torch.tensor(1.5)
    kw = dict(num_heads=4, qk_nope_head_dim=96, quant_scale_q=scale)
    before = q.clone()
    q_nope, q_pe = fqr.mla_q_rope(q, positions, TABLE, **kw, quantize_dtype=E5M2, backend=backend)
    assert torch.equal(q, before)  # q is not written in the FP8 form
    want = mla_q_rope_reference(q, positions, TABLE, **kw, quantize_dtype=E5M2)
    for out, exact, head in zip((q_nope, q_pe), want, (96, 32)):
        assert out.dtype == E5M2 and out.shape == exact.shape
        c = compare(out, exact, head_dim=head)
        assert c.passed and c.nonfinite == 0, c
        past = exact.abs() >= 57344
        assert bool(past.any()) or head == 32
        assert torch.equal(out.float()[past].abs(), torch.full_like(out.float()[past], 57344))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_e4m3_outputs_are_unchanged(gen, backend):
    """quantize_dtype None and float8_e4m3fn are the E4M3 outputs of before (clamp 448)."""
    q = _q(gen)
    positions = torch.randint(0, 4096, (5,), generator=gen)
    kw = dict(num_heads=4, qk_nope_head_dim=96, quant_scale_q=torch.tensor(0.5), backend=backend)
    default = fqr.mla_q_rope(q, positions, TABLE, **kw)
    explicit = fqr.mla_q_rope(q, positions, TABLE, **kw, quantize_dtype=E4M3)
    want = mla_q_rope_reference(q, positions, TABLE, num_heads=4, qk_nope_head_dim=96,
                                quant_scale_q=torch.tensor(0.5))  # fmt: skip
    for a, b, exact, head in zip(default, explicit, want, (96, 32)):
        assert a.dtype == E4M3 and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert compare(a, exact, head_dim=head).passed
        assert float(exact.abs().max()) == 448.0


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_the_prologues_q_c_in_e5m2(gen, backend):
    call = prologue_call(gen, 96, 32, 16, "auto", tokens=4, q_lora=48, backend=backend)
    args = dict(call.args, quant_scale_q=torch.tensor(30000.0), quantize_dtype=E5M2)
    args["kv_cache"] = args["kv_cache"].clone()
    q_c, kv_c, k_pe = fqr.split_mla_rmsnorm_rope_cache(**args)
    decl = fqr.split_mla_rmsnorm_rope_cache.declaration
    exact_q_c = decl.reference(**decl.reference_kwargs(args))[0]
    assert q_c.dtype == E5M2
    c = compare(q_c, exact_q_c, head_dim=48)
    assert c.passed and c.nonfinite == 0, c
    assert bool((exact_q_c.abs() == 57344).any())  # the clamp is exercised


BAD = [
    ("bf16", torch.bfloat16, TypeError, "quantize_dtype must be torch.float8_e4m3fn or"),
    ("fnuz", torch.float8_e4m3fnuz, TypeError, "quantize_dtype must be torch.float8_e4m3fn or"),
    ("a string", "e5m2", TypeError, "quantize_dtype must be torch.float8_e4m3fn or"),
]


@pytest.mark.parametrize("what,value,error,says", BAD, ids=[b[0] for b in BAD])
def test_a_bad_quantize_dtype_is_refused_naming_it(gen, what, value, error, says):
    q = _q(gen)
    before = q.clone()
    with pytest.raises(error, match=says):
        fqr.mla_q_rope(q, torch.zeros(5, dtype=torch.long), TABLE, num_heads=4,
                       qk_nope_head_dim=96, quant_scale_q=torch.tensor(1.0),
                       quantize_dtype=value)  # fmt: skip
    assert torch.equal(q, before)


def test_quantize_dtype_without_quant_scale_q_is_refused(gen):
    """quantize_dtype names the format of the FP8 outputs quant_scale_q asks for: alone it
    would be silently unused (q rotated in place in its own dtype)."""
    q = _q(gen)
    before = q.clone()
    with pytest.raises(ValueError, match="^quantize_dtype applies to the FP8 outputs"):
        fqr.mla_q_rope(q, torch.zeros(5, dtype=torch.long), TABLE, num_heads=4,
                       qk_nope_head_dim=96, quantize_dtype=E5M2)  # fmt: skip
    assert torch.equal(q, before)
    call = prologue_call(gen, 96, 32, 16, "auto", tokens=3)
    with pytest.raises(ValueError, match="^quantize_dtype applies"):
        fqr.split_mla_rmsnorm_rope_cache(**dict(call.args, quantize_dtype=E5M2))


def test_the_torch_op_takes_quantize_dtype(gen):
    q = _q(gen)
    positions = torch.randint(0, 4096, (5,), generator=gen)
    scale = torch.tensor(1.0)
    got = torch.ops.fqr.mla_q_rope(q, positions, TABLE, scale, num_heads=4, qk_nope_head_dim=96,
                                   quantize_dtype=E5M2)  # fmt: skip
    want = fqr.mla_q_rope(q, positions, TABLE, num_heads=4, qk_nope_head_dim=96,
                          quant_scale_q=scale, quantize_dtype=E5M2)  # fmt: skip
    for a, b in zip(got, want):
        assert a.dtype == E5M2 and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
