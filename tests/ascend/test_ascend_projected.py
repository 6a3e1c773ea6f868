"""The projected form (``<op>_proj``: the QKV GEMM with the prologue as its epilogue) on the
ascend-target kernel under Triton-Ascend's interpreter (issue 40's cube-unit lowering).

A 1-D persistent grid of "AI core" programs walks (token tile, head group) items, each item's K
loop whole: here 3 programs, so that every program runs several items. Each output, written
into NaN-poisoned memory, is held to the fused contract of the independent float64 composition
``fqr.reference.project`` then the prologue's reference, on fresh random inputs and real RoPE
tables: K steps that do not divide K, the decode bucket (T <= 16) and larger tiles, GPT-J
pairs with partial rotary, fp16 and fp32 activations, head groups whose last one is masked, a
row normalised as a whole (OLMo2) in head chunks, the projection bias; and presets' own rows
(gated mRoPE, Gemma 4's v norm, GPT-NeoX's per-head rows, CodeGen's shards, MiniMax's indexer
heads) through the public op. A budget too small for one head is refused before any kernel
runs, in one line.

Needs the Ascend environment (``make ascend-env``) and an interpreted process; skips otherwise.
"""

from __future__ import annotations

import pytest
import torch
from support.ascend import ASCEND_INTERPRET_MARKS
from support.programs import poisoned_outputs

import fqr
from fqr import reference
from fqr.lowering import ascend as A
from fqr.lowering import lower
from fqr.numerics import compare
from fqr.presets import get_preset
from fqr.prologue import DECLARATIONS, variant_of
from fqr.rope_cache import rope_cos_sin_cache

pytestmark = ASCEND_INTERPRET_MARKS
PROJ = DECLARATIONS["split_qkv_rmsnorm_rope_proj"]
MAX_POSITION = 89
PROGRAMS = 3  # "AI cores"


def _problem(seed, *, hq, hkv, d, rotary, hidden, tokens, norm="head", is_neox=True,
             dtype=torch.bfloat16, bias=True):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    width = (hq + 2 * hkv) * d
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(width, hidden, generator=g, dtype=torch.float64) / hidden**0.5).to(dtype)
    b = (0.1 * torch.randn(width, generator=g, dtype=torch.float64)).to(dtype) if bias else None
    positions = torch.randint(0, MAX_POSITION, (tokens,), generator=g)
    table = rope_cos_sin_cache(rotary, MAX_POSITION, 1e4)
    rows = (hq * d, hkv * d) if norm == "full" else (d, d)
    qw, kw = ((1 + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)).to(dtype) for n in rows)
    statics = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, norm=norm, is_neox=is_neox)
    args = (x, w, positions, table, qw, kw)
    program = PROJ.program_for(*args, qkv_bias=b, **statics)
    expected = reference.prologue(reference.project(x, w, b), positions, table, qw, kw, **statics)
    return program, tuple(a for a in (*args, b) if a is not None), expected, d


CASES = {
    # name: (problem, lowering options)
    "qwen3-like-K200-T17": (dict(hq=3, hkv=1, d=64, rotary=64, hidden=200, tokens=17), {}),
    "decode-T1": (dict(hq=3, hkv=1, d=64, rotary=64, hidden=96, tokens=1), {"max_block_t": 16}),
    "gptj-partial-fp16-K48": (
        dict(
            hq=5,
            hkv=1,
            d=32,
            rotary=16,
            hidden=48,
            tokens=3,
            is_neox=False,
            dtype=torch.float16,
            bias=False,
        ),
        {},
    ),  # fmt: skip
    "fp32-groups-of-2-masked-K40": (
        dict(hq=3, hkv=1, d=32, rotary=32, hidden=40, tokens=9, dtype=torch.float32),
        {"heads_per_program": 2, "block_k": 16},
    ),
    "olmo2-row-in-chunks": (
        dict(hq=4, hkv=2, d=32, rotary=32, hidden=96, tokens=5, norm="full"),
        {"ub_bytes": A.UB_RESERVE_BYTES + 4 * 1024},  # one head a chunk
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_projected_kernel_meets_the_contract(case):
    problem, options = CASES[case]
    program, args, expected, d = _problem(len(case), **problem)
    kernel = lower(program, "ascend-interpret", num_aicore=PROGRAMS, **options)
    t = kernel.tiling
    assert t.persistent_blocks and t.block_k and t.split_k == 1
    tokens = args[0].shape[0]
    items = -(-tokens // t.block_t) * kernel.grid_options["work_per_tile"]
    assert kernel.target.grid(tokens, t.block_t, args[0].device, **kernel.grid_options) == min(
        PROGRAMS, items
    )
    if case == "olmo2-row-in-chunks":
        assert t.head_chunks[:2] == (1, 1), t  # the row's sums over its chunks first
    outs = poisoned_outputs(program, tokens)
    kernel(*args, out=outs)
    for name, out, exact in zip("qkv", outs, expected):
        result = compare(out, exact, head_dim=d)
        assert result.passed and result.nonfinite == 0, (name, t, result)


# (preset, TP): the row layouts beyond split_qkv's, each at a small hidden size (x's width is
# the projection's K: the interpreter's time goes with it)
PRESETS = [
    ("qwen3.5-27b", 8),  # gated, interleaved mRoPE, D = 256
    ("gemma4-31b-sliding", 16),  # the weightless v norm
    ("pythia-6.9b", 8),  # GPT-NeoX's per-head [q k v] rows
    ("codegen-2b", 4),  # CodeGen's model-parallel shards
    ("minimax-m3", 8),  # the indexer heads
]


@pytest.mark.parametrize("name,tp", PRESETS, ids=lambda v: str(v))
def test_presets_projected_forms_through_the_public_op(name, tp):
    preset = get_preset(name, tp)
    variant = variant_of(preset)
    proj = DECLARATIONS[variant.declaration.name + "_proj"]
    g = torch.Generator().manual_seed(tp * 1000 + len(name))
    table = preset.cos_sin_cache(MAX_POSITION)
    tokens, hidden, dtype = 3, 80, torch.bfloat16
    inputs = variant.draw(preset, tokens, dtype, g, max_position=MAX_POSITION)
    width = inputs["qkv"].shape[1]
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(width, hidden, generator=g, dtype=torch.float64) / hidden**0.5).to(dtype)
    b = (0.1 * torch.randn(width, generator=g, dtype=torch.float64)).to(dtype)
    values = variant.arguments(preset, inputs, table)
    rest = {k: v for k, v in values.items() if k in proj.index and k != "qkv"}
    outs = proj.function(**rest, x=x, w_qkv=w, qkv_bias=b, backend="ascend-interpret")
    outs = outs if isinstance(outs, tuple) else (outs,)
    expected = variant.expected(preset, dict(inputs, qkv=reference.project(x, w, b)), table)
    assert len(outs) == len(expected)
    for (out_name, exact), out in zip(expected.items(), outs):
        result = compare(out, exact, head_dim=variant.head_dim(preset, out_name))
        assert result.passed and result.nonfinite == 0, (out_name, result)


def test_a_budget_too_small_for_one_head_is_refused_before_the_kernel(monkeypatch):
    """The public op on ascend-interpret with the UB budget of ``$FQR_ASCEND_UB_BYTES``: one
    line with the numbers, and no kernel launched (the outputs are never allocated)."""
    program, args, _, _ = _problem(5, hq=3, hkv=1, d=64, rotary=64, hidden=48, tokens=3)
    monkeypatch.setenv("FQR_ASCEND_UB_BYTES", str(A.UB_RESERVE_BYTES + 2048))
    x, w, positions, table, qw, kw, b = args
    with pytest.raises(ValueError) as e:
        fqr.split_qkv_rmsnorm_rope_proj(
            x, w, positions, table, qw, kw, qkv_bias=b, num_heads=3, num_kv_heads=1,
            head_dim=64, backend="ascend-interpret",
        )  # fmt: skip
    message = str(e.value)
    assert "\n" not in message
    assert "chain0 (3 heads x 64, K = 48): 1 head of 2 token(s)" in message
    assert "> 2.0 KiB on A2 (Ascend910B3" in message
