"""torch.ops.fqr.* custom ops and the no-split prologue: opcheck, numerics vs float64, bad input,
dynamic token counts under torch.compile. Fast (CPU, reference backend)."""

from __future__ import annotations

import pytest
import torch

import fqr
from fqr import reference
from fqr.fusion import qk_rmsnorm_rope
from fqr.inputs import random_inputs
from fqr.numerics import compare
from fqr.presets import PrologueSpec
from fqr.rope_cache import rope_cos_sin_cache


def make_inputs(tokens, hq, hkv, d, rotary, dtype, bias, g, gemma=False):
    """Fresh random inputs (:mod:`fqr.inputs`) on the real RoPE table in the activation dtype,
    as vLLM keeps it."""
    spec = PrologueSpec(hq, hkv, d, rotary, weight_offset=1.0 if gemma else 0.0)
    cache = rope_cos_sin_cache(rotary, 4096, 1e6, dtype=dtype)
    x = random_inputs(spec, tokens, dtype, g, cache, bias=bias)
    return x.qkv, x.positions, cache, (x.q_weight, x.k_weight), (x.q_bias, x.k_bias)


CASES = [  # tokens, hq, hkv, d, rotary, dtype, neox, bias, offset
    (7, 3, 1, 48, 48, torch.bfloat16, True, False, 0.0),
    (5, 4, 2, 32, 16, torch.bfloat16, False, True, 1.0),
    (6, 2, 2, 64, 64, torch.float32, False, False, 0.0),
    (3, 6, 3, 16, 8, torch.float16, True, True, 0.0),
]


@pytest.mark.parametrize("tokens,hq,hkv,d,rotary,dtype,neox,bias,offset", CASES)
def test_opcheck_split_op(gen, tokens, hq, hkv, d, rotary, dtype, neox, bias, offset):
    qkv, pos, cache, (qw, kw), (qb, kb) = make_inputs(
        tokens, hq, hkv, d, rotary, dtype, bias, gen, gemma=offset == 1.0
    )
    args = (qkv, pos, cache, qw, kw, qb, kb, hq, hkv, d, 1e-6, neox, offset, "head", "unfused")
    torch.library.opcheck(torch.ops.fqr.split_qkv_rmsnorm_rope.default, args)


@pytest.mark.parametrize("tokens,hq,hkv,d,rotary,dtype,neox,bias,offset", CASES)
def test_opcheck_qk_op(gen, tokens, hq, hkv, d, rotary, dtype, neox, bias, offset):
    qkv, pos, cache, (qw, kw), (qb, kb) = make_inputs(
        tokens, hq, hkv, d, rotary, dtype, bias, gen, gemma=offset == 1.0
    )
    q, k = qkv[:, : hq * d].contiguous(), qkv[:, hq * d : (hq + hkv) * d].contiguous()
    args = (q, k, pos, cache, qw, kw, qb, kb, d, 1e-5, neox, offset, "fused")
    torch.library.opcheck(torch.ops.fqr.qk_rmsnorm_rope.default, args)


@pytest.mark.parametrize("numerics", ["fused", "unfused"])
@pytest.mark.parametrize("tokens,hq,hkv,d,rotary,dtype,neox,bias,offset", CASES)
def test_ops_match_float64(gen, tokens, hq, hkv, d, rotary, dtype, neox, bias, offset, numerics):
    qkv, pos, cache, (qw, kw), (qb, kb) = make_inputs(
        tokens, hq, hkv, d, rotary, dtype, bias, gen, gemma=offset == 1.0
    )
    eps = 1e-6
    q_in, k_in = qkv[:, : hq * d], qkv[:, hq * d : (hq + hkv) * d]
    exact_q, exact_k = reference.qk_prologue(
        q_in,
        k_in,
        pos,
        cache,
        qw,
        kw,
        head_dim=d,
        eps=eps,
        is_neox=neox,
        q_bias=qb,
        k_bias=kb,
        weight_offset=offset,
    )

    q, k, v = torch.ops.fqr.split_qkv_rmsnorm_rope(
        qkv, pos, cache, qw, kw, qb, kb, hq, hkv, d, eps, neox, offset, "head", numerics
    )
    q2, k2 = torch.ops.fqr.qk_rmsnorm_rope(
        q_in.contiguous(),
        k_in.contiguous(),
        pos,
        cache,
        qw,
        kw,
        qb,
        kb,
        d,
        eps,
        neox,
        offset,
        numerics,
    )
    for out, exact in ((q, exact_q), (k, exact_k), (q2, exact_q), (k2, exact_k)):
        assert out.dtype == dtype and out.is_contiguous()
        c = compare(out, exact, head_dim=d, numerics=numerics)
        assert c.passed, c
    assert torch.equal(v, qkv[:, (hq + hkv) * d :])
    # the split op and the no-split op share one functional core: same bits
    assert torch.equal(q, q2) and torch.equal(k, k2)


def test_qk_op_bad_input_names_the_argument(gen):
    qkv, pos, cache, (qw, kw), _ = make_inputs(4, 2, 1, 32, 32, torch.bfloat16, False, gen)
    q, k = qkv[:, :64].contiguous(), qkv[:, 64:96].contiguous()
    with pytest.raises(ValueError, match="q_weight"):
        qk_rmsnorm_rope(q, k, pos, cache, qw[:16], kw, head_dim=32)
    with pytest.raises(TypeError, match="positions"):
        qk_rmsnorm_rope(q, k, pos.float(), cache, qw, kw, head_dim=32)
    with pytest.raises(ValueError, match="positions out of range"):
        qk_rmsnorm_rope(q, k, pos + 5000, cache, qw, kw, head_dim=32)
    with pytest.raises(ValueError, match="k width"):
        qk_rmsnorm_rope(q, k[:, :20], pos, cache, qw, kw, head_dim=32)
    with pytest.raises(ValueError, match="rotary_dim"):
        qk_rmsnorm_rope(q, k, pos, rope_cos_sin_cache(64, 16, 1e6), qw, kw, head_dim=32)
    with pytest.raises(ValueError, match="numerics"):
        qk_rmsnorm_rope(q, k, pos, cache, qw, kw, head_dim=32, numerics="fast")


def test_ops_trace_with_dynamic_token_count(gen):
    """The fake impls let torch.compile trace the ops once for every token count."""
    p = fqr.get_preset("qwen3-0.6b")
    d, cache = p.head_dim, p.cos_sin_cache(512, dtype=torch.bfloat16)
    g = gen
    qw, kw = (torch.randn(d, generator=g).bfloat16() for _ in range(2))
    frames = []

    def count_backend(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    @torch.compile(backend=count_backend, dynamic=True, fullgraph=True)
    def prologue(qkv, positions):
        return torch.ops.fqr.split_qkv_rmsnorm_rope(
            qkv,
            positions,
            cache,
            qw,
            kw,
            None,
            None,
            p.num_heads,
            p.num_kv_heads,
            d,
            p.eps,
            True,
            0.0,
            "head",
            "fused",
        )

    for tokens in (3, 9, 17):
        qkv = torch.randn(tokens, p.spec.qkv_width, generator=g).bfloat16()
        pos = torch.randint(0, 512, (tokens,), generator=g)
        q, k, v = prologue(qkv, pos)
        want = fqr.split_qkv_rmsnorm_rope(
            qkv,
            pos,
            cache,
            qw,
            kw,
            num_heads=p.num_heads,
            num_kv_heads=p.num_kv_heads,
            head_dim=d,
            eps=p.eps,
        )
        assert all(torch.equal(a, b) for a, b in zip((q, k, v), want))
    assert len(frames) == 1


@pytest.mark.skipif(
    "interpret" not in fqr.available_backends(), reason="upstream triton is not installed"
)
@pytest.mark.parametrize("neox,numerics", [(True, "fused"), (False, "unfused")])
def test_qk_op_generated_kernel_interpreted(gen, neox, numerics):
    """The no-split composition through the generated Triton kernel (interpreter, small)."""
    tokens, hq, hkv, d, rotary = 3, 3, 1, 32, 16
    qkv, pos, cache, (qw, kw), (qb, kb) = make_inputs(
        tokens, hq, hkv, d, rotary, torch.bfloat16, True, gen
    )
    q_in, k_in = qkv[:, : hq * d].contiguous(), qkv[:, hq * d : (hq + hkv) * d].contiguous()
    kw_args = dict(head_dim=d, is_neox=neox, q_bias=qb, k_bias=kb, numerics=numerics)
    q, k = qk_rmsnorm_rope(q_in, k_in, pos, cache, qw, kw, backend="interpret", **kw_args)
    ref = qk_rmsnorm_rope(q_in, k_in, pos, cache, qw, kw, backend="reference", **kw_args)
    exacts = reference.qk_prologue(
        q_in, k_in, pos, cache, qw, kw, head_dim=d, is_neox=neox, q_bias=qb, k_bias=kb
    )
    for out, want, exact in zip((q, k), ref, exacts):
        assert compare(out, exact, head_dim=d, numerics=numerics).passed
        assert torch.equal(out, want)


def test_fusion_refuses_an_untested_torch_clearly(monkeypatch):
    from fqr.fusion import fusion_pass

    monkeypatch.setattr(fusion_pass.torch, "__version__", "2.10.1+cu128")
    with pytest.raises(RuntimeError, match=r"supports torch >= 2\.11 .* found 2\.10\.1"):
        fusion_pass.check_torch_version()
    for supported in ("2.11.0+cu130", "2.13.0+cpu", "2.14.0.dev20260101"):
        monkeypatch.setattr(fusion_pass.torch, "__version__", supported)
        fusion_pass.check_torch_version()
