"""The projected form's kernel (issue 40): the QKV GEMM with the traced prologue as its epilogue
(:class:`fqr.core.Product`, ``fqr.lowering.plan.ProductSource``, the emitter's K loop).

Under every schedule option (tensor-core tiles or the broadcast product, several heads per
program with the last group masked, K steps that do not divide K, split-K with its workspace
and counts, TF32-widened operands) the interpreted kernel writes every output element (NaN
poison) within the fused contract of the float64 composition, and split-K's counts are back
at zero after each launch. The planner and the cuda target refuse what they cannot do with
one line; the public op's token buckets are the measured ones; the cuda kernels compile for
sm_90 (tests/gpu/test_gpu_projected.py runs them on the H200)."""

from __future__ import annotations

import pytest
import torch
from support.cuda_ptx import run_compiling
from support.programs import poisoned_outputs

from fqr import ops, reference
from fqr.backends import BACKENDS
from fqr.core import spec, trace
from fqr.lowering import PlanError, lower, plan_program
from fqr.lowering.targets import get_target
from fqr.numerics import compare
from fqr.prologue import DECLARATIONS
from fqr.rope_cache import rope_cos_sin_cache

pytestmark = pytest.mark.skipif(
    not BACKENDS["interpret"].available, reason=BACKENDS["interpret"].unavailable_reason() or ""
)
PROJ = DECLARATIONS["split_qkv_rmsnorm_rope_proj"]
MAX_POSITION = 61


def _problem(seed, *, hq=3, hkv=1, d=32, rotary=32, hidden=40, tokens=9, norm="head",
             is_neox=True, dtype=torch.bfloat16):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    width = (hq + 2 * hkv) * d
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(width, hidden, generator=g, dtype=torch.float64) / hidden**0.5).to(dtype)
    b = (0.1 * torch.randn(width, generator=g, dtype=torch.float64)).to(dtype)
    positions = torch.randint(0, MAX_POSITION, (tokens,), generator=g)
    table = rope_cos_sin_cache(rotary, MAX_POSITION, 1e4)
    rows = hq * d if norm == "full" else d
    qw = (1 + 0.1 * torch.randn(rows, generator=g, dtype=torch.float64)).to(dtype)
    kw = (1 + 0.1 * torch.randn(hkv * d if norm == "full" else d, generator=g)).to(dtype)
    statics = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, norm=norm, is_neox=is_neox)
    args = (x, w, positions, table, qw, kw)
    program = PROJ.program_for(*args, qkv_bias=b, **statics)
    expected = reference.prologue(reference.project(x, w, b), positions, table, qw, kw, **statics)
    return program, (*args, b), expected, d


SCHEDULES = [
    {},
    {"block_t": 16},
    {"product_dot": "fma", "block_t": 1},
    {"heads_per_program": 2},
    {"block_k": 16},
    {"product_operands": "tf32"},
    {"split_k": 2},
    {"split_k": 3, "block_k": 16},
    {"split_k": 4, "heads_per_program": 2, "product_dot": "fma", "block_t": 4},
    # the one-token GEMV form (BLOCK_T == 1) with grouped heads and ragged K ranges
    {"split_k": 3, "heads_per_program": 2, "product_dot": "fma", "block_t": 1, "block_k": 16},
    # the K loop pipelined (tl.range with num_stages), K in two ranges of two to three steps
    {"split_k": 2, "product_dot": "fma", "block_t": 1, "block_k": 16, "k_stages": 3},
]


@pytest.mark.parametrize("gptj", [False, True], ids=["neox", "gptj-partial"])
@pytest.mark.parametrize(
    "options", SCHEDULES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default"
)
def test_every_schedule_meets_the_contract(options, gptj):
    program, args, expected, d = _problem(
        7, rotary=16 if gptj else 32, is_neox=not gptj
    )  # fmt: skip
    kernel = lower(program, "interpret", **options)
    for _ in range(2):  # split-K's counts are zero again for the second launch
        outs = poisoned_outputs(program, args[0].shape[0])
        kernel(*args, out=outs)
        for name, out, exact in zip("qkv", outs, expected):
            result = compare(out, exact, head_dim=d)
            assert result.passed and result.nonfinite == 0, (name, options, result)
        for counts in kernel._counts.values():
            assert int(counts.abs().sum()) == 0


def test_full_width_norm_stays_one_program_and_refuses_split_k():
    """OLMo2's norm over the whole row: its chain is one program (its sums of squares over
    every head's product), which split-K cannot divide: refused naming split_k."""
    program, args, expected, d = _problem(3, hq=2, hkv=2, norm="full")
    outs = poisoned_outputs(program, args[0].shape[0])
    lower(program, "interpret", heads_per_program=1)(*args, out=outs)
    for out, exact in zip(outs, expected):
        assert compare(out, exact, head_dim=d).passed
    with pytest.raises(ValueError, match="split_k must be 1 there"):
        lower(program, "interpret", split_k=2)


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(chunk_mode="unroll"), "chunk_mode must be 'grid'"),
        (dict(product_dot="wmma"), "product_dot must be 'mma' or 'fma'"),
        (dict(block_k=8), r"block_k must be a power of two \(at least 16"),
        (dict(product_operands="fp8"), "product_operands must be 'native' or 'tf32'"),
        (dict(heads_per_program=3), "heads_per_program must be a power of two"),
        (dict(split_k=-1), "split_k must be an int >= 0"),
        (dict(k_stages=9), r"k_stages must be 0 \.\. 8, got 9"),
    ],
)
def test_bad_schedule_options_are_refused(options, match):
    program, *_ = _problem(1)
    with pytest.raises(ValueError, match=match):
        lower(program, "interpret", **options)


def test_cuda_tensor_core_tiles_take_sixteen_tokens():
    program, *_ = _problem(1)
    target, plan = get_target("cuda"), plan_program(program)
    with pytest.raises(ValueError, match="block_t must be >= 16, got 8"):
        target.block_t(plan, target.tiling(plan), block_t=8)
    assert target.block_t(plan, target.tiling(plan, product_dot="fma"), block_t=8) == 8


def test_a_product_is_read_through_a_view():
    """A per-head op on the product's row itself (no ``split_heads``) is outside the plan."""

    def norm_of_product(x, w, weight):
        return ops.rms_norm(ops.linear(x, w), weight, eps=1e-6, group_size=32)

    program = trace(norm_of_product, spec("T", 64), spec(96, 64), spec(32, dtype=torch.bfloat16))
    with pytest.raises(PlanError, match="cut into heads by a view"):
        plan_program(program)


ONE_STEP = {"product_dot": "fma", "block_k": 256, "num_warps": 8}
PIPELINED = {"product_dot": "fma", "block_k": 64, "k_stages": 4, "num_warps": 4}


@pytest.mark.parametrize(
    "heads,hidden,split,gemv",
    [
        # Qwen3-8B TP 1: 48 heads x 16 ranges > 128 programs; 50 MB of weights: one token
        ((32, 8), 4096, 4, [{**PIPELINED, "split_k": 8}]),
        # Qwen3-8B TP 8: 6 x 16 = 96 programs for one token, 192 for two; 6.3 MB of weights
        ((4, 1), 4096, 8, [{**ONE_STEP, "split_k": 16}, {**PIPELINED, "split_k": 8}]),
        # Qwen3-32B TP 8: 10 x 20 > 128 programs; 13.1 MB
        ((8, 1), 5120, 8, [{**PIPELINED, "split_k": 10}] * 2),
        # K in one step: no ranges, no workspace
        ((4, 1), 200, 1, [ONE_STEP] * 2),
    ],
    ids=["48-heads", "6-heads", "10-heads-k5120", "k200"],
)
def test_the_public_ops_buckets(heads, hidden, split, gemv):
    """T = 1, and T = 2 where the weights are at most 16 MiB (TP 8's, not TP 1's), by the
    GEMV: K in ranges of one 256-wide step and 8 warps where tokens x heads x ranges stay
    within 128 programs, else ranges of 512 in pipelined 64-wide steps, 4 warps; split-K at
    T <= 16 (4 ranges for 32 head programs or more, 8 below, as far as each keeps two 64-wide
    steps), 64-token tiles after; any schedule option pins one variant."""
    hq, hkv = heads
    program, *_ = _problem(2, hq=hq, hkv=hkv, d=128, rotary=128, hidden=hidden, tokens=2)
    buckets = get_target("cuda").token_buckets(plan_program(program))
    assert buckets == (
        *((tokens, options) for tokens, options in enumerate(gemv, start=1)),
        (16, {"num_warps": 4, **({"split_k": split} if split > 1 else {})}),
        (None, {"block_t": 64, "num_warps": 4}),
    )
    assert get_target("cuda").token_buckets(plan_program(program), split_k=2) == (
        (None, {"split_k": 2}),
    )
    # the interpreter runs one variant: the tests pin its tiling
    assert get_target("interpret").token_buckets(plan_program(program)) == ((None, {}),)


def test_a_whole_row_norm_has_no_gemv_bucket():
    """OLMo2's norm over the whole row is one program: no split-K, and no GEMV bucket."""
    program, *_ = _problem(3, hq=2, hkv=2, norm="full", hidden=4096)
    buckets = get_target("cuda").token_buckets(plan_program(program))
    assert buckets == ((16, {"num_warps": 4}), (None, {"block_t": 64, "num_warps": 4}))


SM90 = """
import torch
from support.cuda_ptx import compile_for_sm90
from fqr.lowering import lower
from fqr.prologue import DECLARATIONS
proj = DECLARATIONS["split_qkv_rmsnorm_rope_proj"]
m = dict(device="meta")
x = torch.empty(16, 4096, dtype=torch.bfloat16, **m)
w = torch.empty(768, 4096, dtype=torch.bfloat16, **m)
table = torch.empty(4096, 128, **m)
wn = torch.empty(128, dtype=torch.bfloat16, **m)
program = proj.program_for(x, w, torch.empty(16, dtype=torch.int64, **m), table, wn, wn,
                           num_heads=4, num_kv_heads=1, head_dim=128)
for options in ({"split_k": 8, "num_warps": 4}, {"block_t": 64, "num_warps": 4}):
    ptx = compile_for_sm90(lower(program, "cuda", **options)).asm["ptx"]
    print("mma" in ptx, "atom" in ptx)
"""


def test_the_cuda_kernels_compile_for_sm90(tmp_path):
    """Split-K (tensor cores and its atomic count) and the 64-token tiles compile for sm_90."""
    out = run_compiling(SM90, tmp_path / "cache")
    assert out.split()[-4:] == ["True", "True", "True", "False"]
