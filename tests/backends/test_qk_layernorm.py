"""LayerNorm on q and k (Persimmon, Chameleon): the op ``layer_norm`` against the float64
formulation (shared and per-head weights, a head width that pads the register layout, both
contracts), the public op ``split_qkv_layernorm_rope`` on the reference and interpreted-kernel
backends, the unfused contract equal to Hugging Face's modules bit for bit on the reference
backend, and its bad arguments refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import real_table
from support.programs import run_kernel

import fqr
from fqr import ops, reference
from fqr.core import Aval, eval_program, trace
from fqr.numerics import compare

BF16 = torch.bfloat16


def _rand(gen, *shape, scale=1.0, centre=0.0, dtype=BF16):
    return (centre + scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("numerics", ["fused", "unfused"])
@pytest.mark.parametrize("per_head", [False, True])
def test_the_op_meets_the_contract_on_both_interpreters(gen, numerics, per_head):
    heads, d = 3, 24  # 24 pads to 32 features in registers: the padding stays out of the sums
    x = _rand(gen, 5, heads * d, scale=2.0, centre=0.7)  # a mean to subtract
    n = heads * d if per_head else d
    w, b = _rand(gen, n, scale=0.3, centre=1.0), _rand(gen, n, scale=0.3)
    rounding = dict(round_to=BF16 if numerics == "unfused" else None, round_before_weight=per_head)

    def f(x, w, b):
        return ops.layer_norm(x, w, b, eps=1e-5, group_size=d, **rounding)

    program = trace(f, Aval(("T", heads * d), BF16), Aval((n,), BF16), Aval((n,), BF16))
    exact = reference.layer_norm(x, w, b, eps=1e-5, group_size=d)
    (ours,) = eval_program(program, [x, w, b])
    (kernel,), _ = run_kernel(program, [x, w, b])
    for out in (ours, kernel):
        assert compare(out, exact, head_dim=d, numerics=numerics).passed
    # mean-subtracting: the RMSNorm of the same rows is another result
    rms = reference.rms_norm(x, w if not per_head else None, eps=1e-5, group_size=d)
    assert not compare(ours, rms, head_dim=d, numerics=numerics).passed


def test_unfused_is_torch_layer_norm_bit_for_bit(gen):
    # nn.LayerNorm (Persimmon): torch's own op in the model dtype
    d = 16
    x, w, b = _rand(gen, 4, 2 * d, scale=3.0), _rand(gen, d, centre=1.0), _rand(gen, d)
    (ours,) = eval_program(
        trace(
            lambda x, w, b: ops.layer_norm(x, w, b, eps=1e-5, group_size=d, round_to=BF16),
            Aval(("T", 2 * d), BF16), Aval((d,), BF16), Aval((d,), BF16),
        ),
        [x, w, b],
    )  # fmt: skip
    theirs = F.layer_norm(x.view(4, 2, d), (d,), w, b, 1e-5).view(4, -1)
    assert torch.equal(ours.to(BF16), theirs)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
@pytest.mark.parametrize(
    "layout, norm_weights, heads, kv_heads, d, rotary",
    [
        ("per-head", "shared", 2, 2, 32, 16),  # Persimmon: per-head row, half rotated
        ("qkv", "per-head", 4, 2, 24, 24),  # Chameleon-like, GQA, a padded head width
    ],
)
def test_the_public_op_against_float64(
    gen, backend, layout, norm_weights, heads, kv_heads, d, rotary
):
    t = 5
    qkv = _rand(gen, t, (heads + 2 * kv_heads) * d, scale=2.0, centre=0.3)
    positions = torch.randint(0, 1000, (t,), generator=gen)
    table = real_table(rotary, 1024, 2.5e4)
    per_head = norm_weights == "per-head"
    affine = [
        _rand(gen, (h if per_head else 1) * d, scale=0.3, centre=c)
        for c in (1.0, 0.0)
        for h in (heads, kv_heads)
    ]
    q_w, k_w, q_b, k_b = affine
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=d, qkv_layout=layout)
    q, k, v = fqr.split_qkv_layernorm_rope(
        qkv, positions, table, q_w, k_w, q_b, k_b, norm_weights=norm_weights, backend=backend,
        **kw,
    )  # fmt: skip
    eq, ek, ev = reference.layernorm_prologue(qkv, positions, table, q_w, k_w, q_b, k_b, **kw)
    assert compare(q, eq, head_dim=d).passed and compare(k, ek, head_dim=d).passed
    assert torch.equal(v, ev)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q_weight=torch.ones(64, dtype=BF16)), r"q_weight .*32"),
        (dict(norm_weights="per-head"), r"q_weight .*64"),
        (dict(k_bias=None), "q_bias and k_bias must be given together"),
        (dict(norm_weights="rows"), "norm_weights must be one of"),
        (dict(qkv_layout="per-head", num_kv_heads=1), "needs num_kv_heads == num_heads"),
    ],
)
def test_bad_arguments_are_refused(gen, change, match):
    d, h = 32, 2
    hkv = change.pop("num_kv_heads", h)
    args = dict(
        qkv=_rand(gen, 2, (h + 2 * hkv) * d), positions=torch.tensor([0, 1]),
        cos_sin_cache=real_table(d, 16, 1e4), q_weight=torch.ones(d, dtype=BF16),
        k_weight=torch.ones(d, dtype=BF16), q_bias=torch.zeros(d, dtype=BF16),
        k_bias=torch.zeros(d, dtype=BF16), num_heads=h, num_kv_heads=hkv, head_dim=d,
    )  # fmt: skip
    with pytest.raises(ValueError, match=match):
        fqr.split_qkv_layernorm_rope(**(args | change))
