"""The projected form of the prologues (``fqr.prologue.projected``): the same op from the hidden
states ``x`` and the packed weight ``w_qkv``, held to the fused contract of the float64
composition ``x @ w_qkv.T (+ bias)`` then the prologue, on the reference backend and on the
generated GEMM-epilogue kernel under the interpreter (``tl.dot`` and the broadcast product);
a few forms on the Ascend kernel under Triton-Ascend's interpreter too (skipped elsewhere).

Fresh random inputs (a new generator per case), real RoPE tables (``fqr.rope_cache``), odd
widths and head counts, with and without the projection bias."""

from __future__ import annotations

import pytest
import torch
from support.ascend import ASCEND_INTERPRET_MARKS
from support.peer_ports import INTERPRET

import fqr
from fqr import reference
from fqr.numerics import compare
from fqr.prologue import DECLARATIONS
from fqr.rope_cache import rope_cos_sin_cache

MAX_POSITION = 97
BACKENDS = ("reference", INTERPRET)
# A few forms also on the ascend-target kernel under Triton-Ascend's interpreter (the cube-unit
# lowering; run where that environment is, tests/ascend/test_ascend_projected.py has more)
ASCEND_INTERPRET = pytest.param("ascend-interpret", marks=ASCEND_INTERPRET_MARKS)
SOME_BACKENDS = (*BACKENDS, ASCEND_INTERPRET)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _draw(tokens, hidden, width, dtype, seed, *, bias):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64).to(dtype)
    # a weight scaled as a trained projection's (rows of norm about 1): qkv values of order 1
    w = (torch.randn(width, hidden, generator=g, dtype=torch.float64) / hidden**0.5).to(dtype)
    b = (0.1 * torch.randn(width, generator=g, dtype=torch.float64)).to(dtype) if bias else None
    positions = torch.randint(0, MAX_POSITION, (tokens,), generator=g)
    positions[0] = MAX_POSITION - 1
    return g, x, w, b, positions


def _norm_weights(g, d, dtype):
    return tuple(
        (1 + 0.1 * torch.randn(d, generator=g, dtype=torch.float64)).to(dtype) for _ in "qk"
    )


def _check(outs, expected, head_dim):
    assert len(outs) == len(expected)
    for name, out, exact in zip("qkvg", outs, expected):
        assert torch.isfinite(out).all(), name
        result = compare(out, exact, head_dim=head_dim, numerics="fused")
        assert result.passed, (name, result)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(
    "hq,hkv,d,rotary,hidden,norm",
    [
        (3, 1, 64, 64, 96, "head"),  # Qwen3-like: per-head norm, odd heads, full rotary
        (5, 1, 32, 16, 40, "head"),  # partial rotary, odd hidden
        (3, 1, 64, 64, 72, "none"),  # Llama: no norm
        (2, 2, 32, 32, 48, "full"),  # OLMo2: one norm over the whole q and k
    ],
)
def test_split_qkv_proj_matches_float64(hq, hkv, d, rotary, hidden, norm, bias, dtype, backend):
    tokens, width = 7, (hq + 2 * hkv) * d
    g, x, w, b, positions = _draw(tokens, hidden, width, dtype, 1000 + hq * d + hidden, bias=bias)
    table = rope_cos_sin_cache(rotary, MAX_POSITION, 1e6)
    if norm == "none":
        qw = kw = None
    elif norm == "head":
        qw, kw = _norm_weights(g, d, dtype)
    else:
        qw = (1 + 0.1 * torch.randn(hq * d, generator=g, dtype=torch.float64)).to(dtype)
        kw = (1 + 0.1 * torch.randn(hkv * d, generator=g, dtype=torch.float64)).to(dtype)
    heads = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, norm=norm)
    outs = fqr.split_qkv_rmsnorm_rope_proj(
        x, w, positions, table, qw, kw, qkv_bias=b, backend=backend, **heads
    )
    assert [o.dtype for o in outs] == [dtype] * 3
    assert [o.shape for o in outs] == [(tokens, hq * d), (tokens, hkv * d), (tokens, hkv * d)]
    expected = reference.prologue(reference.project(x, w, b), positions, table, qw, kw, **heads)
    _check(outs, expected, d)
    # the derived reference is the same composition
    decl = DECLARATIONS["split_qkv_rmsnorm_rope_proj"]
    again = decl.reference(x, w, b, positions=positions, cos_sin_cache=table, q_weight=qw,
                           k_weight=kw, **heads)  # fmt: skip
    for a, e in zip(again, expected):
        assert torch.equal(a, e)


@pytest.mark.parametrize("backend", SOME_BACKENDS)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("gate", [False, True], ids=["mrope", "mrope-gate"])
def test_split_qkv_mrope_proj_matches_float64(bias, gate, backend):
    """Qwen3-VL (interleaved sections) and Qwen3.5's gated row, from the hidden states."""
    hq, hkv, d, rotary, hidden, tokens = 3, 1, 64, 64, 80, 6
    width = (hq * (2 if gate else 1) + 2 * hkv) * d
    g, x, w, b, _ = _draw(tokens, hidden, width, torch.bfloat16, 77 + gate, bias=bias)
    planes = torch.randint(0, MAX_POSITION, (3, tokens), generator=g)
    planes[:, ::3] = planes[0, ::3]  # text tokens: one position on every plane
    table = rope_cos_sin_cache(rotary, MAX_POSITION, 5e6)
    qw, kw = _norm_weights(g, d, torch.bfloat16)
    static = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, mrope_section=(12, 10, 10),
                  mrope_interleaved=True, output_gate=gate)  # fmt: skip
    outs = fqr.split_qkv_rmsnorm_mrope_proj(
        x, w, planes, table, qw, kw, qkv_bias=b, backend=backend, **static
    )
    expected = reference.mrope_prologue(reference.project(x, w, b), planes, table, qw, kw, **static)
    _check(outs, expected, d)


@pytest.mark.parametrize("backend", SOME_BACKENDS)
def test_vnorm_proj_matches_float64(backend):
    """Gemma 4's v norm: v is normalised from the unrounded projection too."""
    hq, hkv, d, hidden, tokens = 3, 1, 64, 64, 5
    g, x, w, b, positions = _draw(tokens, hidden, (hq + 2 * hkv) * d, torch.bfloat16, 5, bias=False)
    table = rope_cos_sin_cache(d, MAX_POSITION, 1e4)
    qw, kw = _norm_weights(g, d, torch.bfloat16)
    static = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d)
    outs = fqr.split_qkv_rmsnorm_rope_vnorm_proj(
        x, w, positions, table, qw, kw, backend=backend, **static
    )
    decl = DECLARATIONS["split_qkv_rmsnorm_rope_vnorm"]
    expected = decl.reference(reference.project(x, w), positions, table, qw, kw, **static)
    _check(outs, expected, d)


def test_proj_rounds_once_where_the_pair_rounds_twice():
    """v of the projected form is the product rounded once; matmul + the prologue rounds it
    at the GEMM's output and copies it: the projected v is within 1 ULP of float64 (the
    fused contract), and is the correctly rounded product on every element here."""
    g, x, w, b, positions = _draw(9, 128, (2 + 2) * 64, torch.bfloat16, 11, bias=True)
    table = rope_cos_sin_cache(64, MAX_POSITION, 1e4)
    qw, kw = _norm_weights(g, 64, torch.bfloat16)
    _, _, v = fqr.split_qkv_rmsnorm_rope_proj(
        x, w, positions, table, qw, kw, qkv_bias=b, num_heads=2, num_kv_heads=1, head_dim=64,
        backend="reference",
    )  # fmt: skip
    exact_v = reference.project(x, w, b)[:, 3 * 64 :]
    assert compare(v, exact_v, head_dim=64).passed


def test_proj_program_is_one_program():
    decl = DECLARATIONS["split_qkv_rmsnorm_rope_proj"]
    x = torch.zeros(2, 96, dtype=torch.bfloat16)
    w = torch.zeros(5 * 64, 96, dtype=torch.bfloat16)
    table = rope_cos_sin_cache(64, MAX_POSITION, 1e4)
    wn = torch.ones(64, dtype=torch.bfloat16)
    text = str(decl.program_for(x, w, torch.zeros(2, dtype=torch.int64), table, wn, wn,
                                num_heads=3, num_kv_heads=1, head_dim=64))  # fmt: skip
    assert text.splitlines()[1].split(" = ")[1].startswith("linear[] ")
    assert "split_heads[" in text and "rms_norm[" in text and "rope[" in text


def _args(**change):
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    w = torch.randn(5 * 64, 96, dtype=torch.bfloat16)
    args = dict(
        x=x,
        w_qkv=w,
        positions=torch.tensor([0, 5, 9]),
        cos_sin_cache=rope_cos_sin_cache(64, MAX_POSITION, 1e4),
        q_weight=torch.ones(64, dtype=torch.bfloat16),
        k_weight=torch.ones(64, dtype=torch.bfloat16),
        num_heads=3,
        num_kv_heads=1,
        head_dim=64,
        backend="reference",
    )
    args.update(change)
    return args


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(w_qkv=torch.randn(4 * 64, 96, dtype=torch.bfloat16)), ValueError,
         r"w_qkv has 256 rows != \(num_heads \+ 2\*num_kv_heads\) \* head_dim"),
        (dict(w_qkv=torch.randn(5 * 64, 95, dtype=torch.bfloat16)), ValueError,
         "w_qkv has K = 95 columns but x has 96"),
        (dict(w_qkv=torch.randn(5 * 64, 96, dtype=torch.float16)), TypeError,
         "w_qkv must have x's dtype"),
        (dict(w_qkv=torch.randn(96, 5 * 64, dtype=torch.bfloat16).T), ValueError,
         "w_qkv must be contiguous"),
        (dict(qkv_bias=torch.randn(5 * 64 - 1, dtype=torch.bfloat16)), ValueError,
         r"qkv_bias must be \[N\] with N = 320"),
        (dict(qkv_bias=torch.randn(5 * 64, dtype=torch.float32)), TypeError, "qkv_bias must have"),
        (dict(x=torch.ones(3, 96, dtype=torch.int32)), TypeError, "x must be"),
        (dict(positions=torch.tensor([0, 5])), ValueError,
         r"positions must be \[T\] with T = 3 \(x rows\)"),
        (dict(num_kv_heads=2), ValueError, "num_kv_heads"),
        (dict(backend="interpret", positions=torch.tensor([0, 5])), ValueError,
         r"positions must be \[T\] with T = 3 \(x rows\)"),
    ],
)  # fmt: skip
def test_bad_arguments_name_the_argument(change, error, match):
    with pytest.raises(error, match=match):
        fqr.split_qkv_rmsnorm_rope_proj(**_args(**change))


def test_not_taken_arguments():
    with pytest.raises(TypeError, match="inplace"):
        fqr.split_qkv_rmsnorm_rope_proj(**_args(inplace=True))
    with pytest.raises(ValueError, match="numerics must be one of fused, got 'unfused'"):
        fqr.split_qkv_rmsnorm_rope_proj(**_args(numerics="unfused"))


def test_torch_op_runs_the_projected_form():
    args = _args()
    outs = torch.ops.fqr.split_qkv_rmsnorm_rope_proj(
        args["x"], args["w_qkv"], args["positions"], args["cos_sin_cache"], args["q_weight"],
        args["k_weight"], None, None, None, num_heads=3, num_kv_heads=1, head_dim=64,
    )  # fmt: skip
    again = fqr.split_qkv_rmsnorm_rope_proj(**args)
    for a, b in zip(outs, again):
        assert torch.equal(a, b)


def _ulp(y: torch.Tensor) -> torch.Tensor:
    """float64 spacing of ``y``'s dtype at each of its values (bf16 / fp16)."""
    info = torch.finfo(y.dtype)
    a = y.double().abs().clamp_min(info.smallest_normal)
    return torch.exp2(torch.floor(torch.log2(a)) - (info.nmant if hasattr(info, "nmant") else 0))


def _cancelling_weight(x, width, g, dtype):
    """``[width, K]`` rows whose product with each token of ``x`` cancels: the last column of
    row ``n`` is chosen (then rounded) against token ``n % T``'s sum of the others."""
    tokens, hidden = x.shape
    w = torch.randn(width, hidden, generator=g, dtype=torch.float64) / hidden**0.5
    xd = x.double()
    for n in range(width):
        t = n % tokens
        w[n, -1] = -(xd[t, :-1] @ w[n, :-1]) / xd[t, -1]
    return w.to(dtype)


@pytest.mark.parametrize("backend", SOME_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_cancelling_products_stay_within_the_accumulation_bound(dtype, backend):
    """Where ``x @ w.T`` cancels, the fp32 accumulation's own floor
    (:func:`fqr.numerics.accumulation_bound`) is what the outputs are held to: v within
    ``1 ulp + bound``, q and k (RoPE, no norm) within ``1 ulp + sqrt(2) * the head's largest
    bound + the fp32 compute floor``."""
    from fqr.numerics import COMPUTE_FLOOR, accumulation_bound

    hq, hkv, d, hidden, tokens = 2, 1, 64, 256, 4
    g = torch.Generator().manual_seed(4040)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64).to(dtype)
    w = _cancelling_weight(x, (hq + 2 * hkv) * d, g, dtype)
    positions = torch.randint(0, MAX_POSITION, (tokens,), generator=g)
    table = rope_cos_sin_cache(d, MAX_POSITION, 1e4)
    heads = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, norm="none")
    outs = fqr.split_qkv_rmsnorm_rope_proj(
        x, w, positions, table, None, None, backend=backend, **heads
    )
    exact_row = reference.project(x, w)
    expected = reference.prologue(exact_row, positions, table, None, None, **heads)
    bound = accumulation_bound(x, w)
    cuts = (0, hq * d, (hq + hkv) * d, (hq + 2 * hkv) * d)
    for i, (out, exact) in enumerate(zip(outs, expected)):
        err = (out.double() - exact).abs()
        b = bound[:, cuts[i] : cuts[i + 1]]
        assert torch.isfinite(out).all()
        if i == 2:  # v: the product rounded once
            allowed = _ulp(out) + b
        else:  # rotated: a pair keeps its error's length; the head's largest bound
            per_head = b.reshape(tokens, -1, d).amax(-1, keepdim=True)
            scale = exact.abs().reshape(tokens, -1, d).amax(-1, keepdim=True)
            allowed = _ulp(out) + (2**0.5 * per_head + COMPUTE_FLOOR * scale).expand(
                -1, -1, d
            ).reshape(tokens, -1)
        assert (err <= allowed).all(), (i, (err - allowed).max().item())
    # the cancellation is real: each row's value for its token is far below the products
    magnitude = x.double().abs() @ w.double().abs().T
    own = torch.arange(w.shape[0]) % tokens == torch.arange(tokens)[:, None]
    assert (exact_row.abs() < 2**-6 * magnitude)[own].float().mean() > 0.9


# ------------------------------------------------------------ the presets' projected forms

# (preset, TP): Qwen3 (per-head norm), Llama 3 (no norm), Qwen3-VL (mRoPE), Qwen3.5 (mRoPE
# with the gate), Gemma 4 (the v norm): each model's real widths, its own hidden_size.
PRESET_CASES = [
    ("qwen3-8b", 8),
    ("qwen3-32b", 8),
    ("llama3-8b", 8),
    ("qwen3-vl-8b", 4),
    ("qwen3.5-27b", 8),
    ("gemma4-31b-sliding", 16),
    ("persimmon-8b", 8),  # LayerNorm on q and k, the checkpoint's per-head row
    ("chameleon-7b", 8),  # LayerNorm with per-head weights
    ("llama4-scout", 8),  # RoPE then the L2 norm
    ("llama4-scout-nope", 8),  # a NoPE layer: the temperature
    ("hunyuan-a13b", 8),  # RoPE then the RMSNorm
    ("minimax-m3", 8),  # the indexer heads
    ("minimax-m3-fp8", 8),  # FP8 outputs
    ("pythia-6.9b", 8),  # GPT-NeoX's per-head row
    ("codegen-2b", 4),  # CodeGen's model-parallel shards
]


def projected_call(variant, preset, tokens, dtype, gen, *, bias):
    """The projected form's arguments for a preset's call: the variant's draw with its qkv
    replaced by hidden states and a packed weight of the preset's sizes, and the float64
    expectation (``reference.project``, then the variant's reference)."""
    from fqr.prologue import DECLARATIONS

    proj = DECLARATIONS[variant.declaration.name + "_proj"]
    table = preset.cos_sin_cache(MAX_POSITION)
    inputs = variant.draw(preset, tokens, dtype, gen, max_position=MAX_POSITION)
    width, hidden = inputs["qkv"].shape[1], preset.hidden_size
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64).to(dtype)
    w = (torch.randn(width, hidden, generator=gen, dtype=torch.float64) / hidden**0.5).to(dtype)
    b = (0.1 * torch.randn(width, generator=gen, dtype=torch.float64)).to(dtype) if bias else None
    values = variant.arguments(preset, inputs, table)
    values = {k: v for k, v in values.items() if k in proj.index and k != "qkv"}
    expected = variant.expected(preset, dict(inputs, qkv=reference.project(x, w, b)), table)
    return proj, dict(values, x=x, w_qkv=w, qkv_bias=b), expected


# The interpreted GEMM-epilogue kernel on a spread of them (a few seconds each): the row
# layouts (plain, mRoPE, the v norm, GPT-NeoX's per-head row, CodeGen's shards), with and
# without the bias; every preset on the GPU (tests/gpu/test_gpu_projected.py).
INTERPRET_PRESETS = [
    ("qwen3-8b", 8, True),
    ("llama3-8b", 8, False),
    ("qwen3-vl-8b", 4, True),
    ("gemma4-31b-sliding", 16, False),
    ("pythia-6.9b", 8, True),
    ("codegen-2b", 4, False),
]
PRESET_GRID = [
    *(pytest.param(n, tp, bias, "reference") for n, tp in PRESET_CASES for bias in (False, True)),
    *(pytest.param(n, tp, bias, INTERPRET.values[0], marks=INTERPRET.marks)
      for n, tp, bias in INTERPRET_PRESETS),
]  # fmt: skip


@pytest.mark.parametrize("name,tp,bias,backend", PRESET_GRID)
def test_presets_projected_forms_match_float64(name, tp, bias, backend, gen):
    from fqr.presets import get_preset
    from fqr.prologue import variant_of

    preset = get_preset(name, tp)
    variant = variant_of(preset)
    proj, args, expected = projected_call(variant, preset, 3, torch.bfloat16, gen, bias=bias)
    outs = proj.function(**args, backend=backend)
    outs = outs if isinstance(outs, tuple) else (outs,)
    assert len(outs) == len(expected)
    for (out_name, exact), out in zip(expected.items(), outs):
        result = compare(out, exact, head_dim=preset.head_dim)
        assert result.passed, (out_name, result)


def test_torch_op_passes_opcheck():
    """``torch.ops.fqr.split_qkv_rmsnorm_rope_proj``: schema, fake (shapes and dtypes from the
    declaration, no kernel run) and autograd registration, as ``torch.library.opcheck``
    checks them."""
    args = _args(qkv_bias=torch.randn(5 * 64, dtype=torch.bfloat16))
    op = torch.ops.fqr.split_qkv_rmsnorm_rope_proj.default
    positional = (args["x"], args["w_qkv"], args["positions"], args["cos_sin_cache"],
                  args["q_weight"], args["k_weight"], args["qkv_bias"], None, None)  # fmt: skip
    torch.library.opcheck(op, positional, dict(num_heads=3, num_kv_heads=1, head_dim=64))


def test_a_repeat_call_takes_the_fast_path():
    """The second call of one key runs its kept call (no new trace), with the same values."""
    from fqr.prologue import checked_calls, forget_checked_calls

    decl = DECLARATIONS["split_qkv_rmsnorm_rope_proj"]
    forget_checked_calls()
    args = _args()
    first = fqr.split_qkv_rmsnorm_rope_proj(**args)
    kept = checked_calls(decl)
    assert len(kept) == 1
    with pytest.MonkeyPatch.context() as m:
        m.setattr(decl, "program", lambda call: pytest.fail("traced again"))
        again = fqr.split_qkv_rmsnorm_rope_proj(**args)
    assert checked_calls(decl) == kept
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_no_tokens_and_strided_rows():
    """T = 0 returns empty outputs; hidden rows at a stride wider than K are read in place."""
    args = _args(x=torch.randn(0, 96, dtype=torch.bfloat16), positions=torch.zeros(0).long())
    assert [o.shape for o in fqr.split_qkv_rmsnorm_rope_proj(**args)] == [
        (0, 192), (0, 64), (0, 64)
    ]  # fmt: skip
    wide = torch.randn(3, 128, dtype=torch.bfloat16)
    args = _args(x=wide[:, :96])
    strided = fqr.split_qkv_rmsnorm_rope_proj(**args)
    dense = fqr.split_qkv_rmsnorm_rope_proj(**dict(args, x=wide[:, :96].contiguous()))
    for a, b in zip(strided, dense):
        assert torch.equal(a, b)


def test_gradients_flow_to_the_hidden_states_and_the_weight():
    """fp32, reference backend: the projected form's gradients are the prologue's on
    ``x @ w_qkv.T`` (the same fp32 program, differentiated)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 96, generator=g).requires_grad_()
    w = (torch.randn(5 * 64, 96, generator=g) / 96**0.5).requires_grad_()
    rest = _args()
    kw = dict(num_heads=3, num_kv_heads=1, head_dim=64, backend="reference")
    weights = (rest["q_weight"].float(), rest["k_weight"].float())
    tail = (rest["positions"], rest["cos_sin_cache"], *weights)
    outs = fqr.split_qkv_rmsnorm_rope_proj(x, w, *tail, **kw)
    sum(o.square().sum() for o in outs).backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    outs2 = fqr.split_qkv_rmsnorm_rope(x2 @ w2.T, *tail, **kw)
    sum(o.square().sum() for o in outs2).backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-5)
