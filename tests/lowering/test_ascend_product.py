"""The projected form's kernel on the Ascend targets (issue 40): the cube-unit lowering's plan.

:func:`fqr.lowering.ascend.ascend_product_tiling` sizes the tiles of the QKV GEMM with the
prologue as its epilogue from the chip's stated buffers (the UB for the fp32 accumulators and
the epilogue, L0A / L0B / L0C / L1 for one K step's dot operands and products); the kernel is
a 1-D persistent grid of AI-core programs walking (token tile, head group) items, each item's
K loop whole (no split-K workspace, no atomics). Here, on any machine: every preset's projected
form at two TP sizes fits its chip's stated budgets and takes the largest token tile that does;
a head too wide for the budget and the cuda-only schedule options are refused with one line
before anything runs; the ``ascend-on-cuda`` target lowers the same body and its launcher
passes ``meta`` tensors and an AI-core-sized 1-D grid. The interpreter runs the kernel in
``tests/ascend/test_ascend_projected.py``; Triton-Ascend compiles every preset's in
``fqr lower --target ascend --check``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fqr import ascend_on_cuda
from fqr.lowering import ascend as A
from fqr.lowering import kernel_source, plan_program, tiling_of
from fqr.lowering.ascend import TileDoesNotFit
from fqr.lowering.ascend_compile import launch_arguments
from fqr.lowering.kernel import Kernel
from fqr.lowering.plan import next_pow2
from fqr.lowering.targets import get_target
from fqr.presets import get_preset
from fqr.tools.ascend_check import projected_declaration, projected_program

PRESETS = [
    "qwen3-8b", "llama3-8b", "glm4-9b", "qwen3-vl-8b", "qwen3.5-27b", "gemma4-31b-full",
    "olmo2-7b", "pythia-6.9b", "codegen-2b", "minimax-m3-fp8", "llama4-scout",
]  # fmt: skip


def _fits(plan, chosen, block_t, block_k):
    """Whether each block of ``chosen``'s heads fits the UB and the cube at ``block_t``
    tokens and a K step of ``block_k`` (the footprint model, block by block)."""
    mb, chip = chosen.chip.multibuffer, chosen.chip
    base = A.hoisted_footprint(plan) + A.tile_scope_footprint(plan, block_t, mb)
    for c, chunk in zip(plan.chains, chosen.tiling.head_chunks):
        held = A.heads_held(c.heads, chunk, "unroll") if c.row_reductions else chunk
        ub = base + A.product_chain_footprint(A.ChainShape.of(c, plan), c, block_t, held, mb)
        cube = A.cube_footprint(c, block_t, held, block_k)
        yield ub <= chosen.budget and not cube.over(chip.cube)


def _unloaded_kernel(program, target: str, **options) -> Kernel:
    """The :class:`~fqr.lowering.kernel.Kernel` ``lower`` would make, its source not loaded (a
    compiled target's would load triton compiled into this interpreted test process)."""
    plan = plan_program(program)
    tiling = get_target(target).tiling(plan, **options)
    source = kernel_source(program, target, **options)
    return Kernel(program, plan, get_target(target), tiling, source, Path(), False, None, options)


def _cases():
    for name in PRESETS:
        for tp in (1, 8):
            try:
                get_preset(name, tp)
            except ValueError:
                continue
            yield name, tp


@pytest.mark.parametrize("name,tp", list(_cases()), ids=lambda v: str(v))
def test_every_projected_tiling_fits_the_stated_budgets(name, tp):
    assert projected_declaration(name, tp) is not None
    plan = plan_program(projected_program(name, tp))
    chosen = get_target("ascend").ascend_tiling(plan)
    t, chip = chosen.tiling, chosen.chip
    assert t.persistent_blocks and t.chunk_mode == "grid"
    assert t.split_k == 1 and t.product_dot == "mma" and not t.uses_workspace
    assert chosen.footprint <= chosen.budget
    assert chosen.cube is not None and chosen.cube.over(chip.cube) == []
    depth = max(c.product.depth for c in plan.chains if c.product is not None)
    assert A.MIN_BLOCK_K <= t.block_k <= min(A.MAX_BLOCK_K, max(A.MIN_BLOCK_K, next_pow2(depth)))
    assert A.MIN_BLOCK_T <= t.block_t <= A.PRODUCT_MAX_BLOCK_T
    # the largest token tile that fits: twice as many tokens overflows a buffer
    if t.block_t < A.PRODUCT_MAX_BLOCK_T:
        assert not all(_fits(plan, chosen, 2 * t.block_t, A.MIN_BLOCK_K))
    # a K step twice as long overflows the cube's buffers (or passes K, or the cap)
    if t.block_k < min(A.MAX_BLOCK_K, next_pow2(depth)):
        assert not all(_fits(plan, chosen, t.block_t, 2 * t.block_k))
    assert all(_fits(plan, chosen, t.block_t, t.block_k))


def test_the_kernel_walks_token_tiles_and_head_groups_on_a_1d_grid():
    program = projected_program("qwen3-8b", 8)  # 4 q heads, 1 k, 1 v: 6 head groups
    kernel = _unloaded_kernel(program, "ascend")
    src = kernel.source
    assert "for work in range(pid, tl.cdiv(T, BLOCK_T) * 6, nprog):" in src
    assert "block = work % 6" in src and "tl.program_id(1)" not in src
    assert "tl.dot(" in src and "atomic" not in src and "ws_ptr" not in src
    assert kernel.grid_blocks == 1 and kernel.grid_options["work_per_tile"] == 6
    target = get_target("ascend")
    meta = A.torch.device("meta")
    # one program per AI core (20 on an Atlas A2 offline), never more than the work items
    assert target.grid(1, kernel._block_t, meta, **kernel.grid_options) == 6
    assert target.grid(10_000, kernel._block_t, meta, **kernel.grid_options) == 20
    assert target.grid(10_000, 32, meta, num_aicore=24, work_per_tile=6) == 24


def test_decode_takes_one_fractal_of_tokens():
    """Up to 16 tokens the kernel's tile is at most 16 rows (the cube's fractal)."""
    plan = plan_program(projected_program("qwen3-8b", 8))
    buckets = get_target("ascend").token_buckets(plan)
    assert buckets == ((16, {"max_block_t": 16}), (None, {}))
    assert get_target("ascend").tiling(plan, max_block_t=16).block_t == 16
    assert get_target("ascend").token_buckets(plan, block_k=64) == ((None, {"block_k": 64}),)


def test_a_head_too_wide_for_the_budget_says_the_numbers():
    plan = plan_program(projected_program("qwen3-8b", 8))
    with pytest.raises(TileDoesNotFit) as e:
        get_target("ascend").tiling(plan, ub_bytes=20 * 1024)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("chain0 (4 heads x 128, K = 4096): 1 head of 2 token(s)")
    assert "needs UB 11.7 KiB > 4.0 KiB on A2 (Ascend910B3" in message
    # 32 heads a program: a K step of 16 for 2048 columns (two halves of 32 x 64) is 128 KiB
    # in L0B, double-buffered
    with pytest.raises(TileDoesNotFit, match=r"32 heads of 2 .* L0B 128\.0 KiB > 64 KiB"):
        get_target("ascend").tiling(plan_program(projected_program("qwen3-8b", 1)),
                                    heads_per_program=32)  # fmt: skip


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(split_k=4), r"split_k=4: target ascend multiplies on the cube unit"),
        (dict(product_dot="fma"), "product_dot must be 'mma' there"),
        (dict(product_operands="tf32"), "product_operands must be 'native' there"),
        (dict(k_stages=3), "k_stages must be 0 there"),
        (dict(chunk_mode="unroll"), "chunk_mode='unroll': a kernel with a product"),
        (dict(block_k=8), r"block_k must be 0 or a power of two >= 16, got 8"),
        (dict(heads_per_program=3), "heads_per_program must be 0 or a power of two"),
        (dict(num_aicore=0), "num_aicore must be a positive int"),
        (dict(max_block_t=1), r"max_block_t must be >= 2 for a kernel with a product"),
    ],
)
def test_cuda_only_or_bad_options_are_refused_with_one_line(options, match):
    program = projected_program("qwen3-8b", 8)
    with pytest.raises(ValueError, match=match) as e:
        tiling_of(program, "ascend", **options)
    assert "\n" not in str(e.value)


def test_ascend_on_cuda_lowers_the_same_body_and_launches_meta_tensors():
    """The ascend-on-cuda kernel is the ascend source (upstream Triton's tl.dot pads small M
    and N as Triton-Ascend's does: even the 8-token tiles of a 512-wide head); its launcher, on
    ``meta`` tensors (a tensor made on another device would not be one), passes a 1-D grid of
    AI-core programs."""
    ascend_on_cuda.register_target()
    body = ascend_on_cuda.generated_body
    for name, tp in (("qwen3-8b", 8), ("gemma4-31b-full", 1)):
        program = projected_program(name, tp)
        assert body(kernel_source(program, "ascend-on-cuda")) == body(
            kernel_source(program, "ascend")
        )
    assert tiling_of(program, "ascend-on-cuda").block_t == 8
    kernel = _unloaded_kernel(projected_program("qwen3-8b", 8), "ascend-on-cuda")
    args, kwargs, grid = launch_arguments(kernel, tokens=1000)
    tensors = [a for a in args if isinstance(a, A.torch.Tensor)]
    assert tensors and all(a.device.type == "meta" for a in tensors)
    assert grid == (20, 1) and kwargs["BLOCK_T"] == kernel.tiling.block_t
    assert "tl.dot(" in kernel.source and "tl.sum(xk" not in kernel.source


def test_narrow_pieces_are_broadcast_products_where_the_dot_takes_16():
    """Triton-Ascend 3.2's interpreter asserts M, N, K >= 16 in tl.dot: there a piece narrower
    (GPT-J's 8 pairs of a 16-wide rotary) is a broadcast product; the ascend kernel keeps its
    dots. Both under the same tiling otherwise."""
    from fqr.prologue.split_qkv import SPLIT_QKV_RMSNORM_ROPE_PROJ as proj

    torch = A.torch
    x = torch.zeros(3, 48, dtype=torch.bfloat16)
    w = torch.zeros(7 * 32, 48, dtype=torch.bfloat16)
    table = torch.zeros(5, 16)
    weight = torch.ones(32, dtype=torch.bfloat16)
    program = proj.program_for(x, w, torch.zeros(3, dtype=torch.int64), table, weight, weight,
                               num_heads=5, num_kv_heads=1, head_dim=32, is_neox=False)  # fmt: skip
    plan = plan_program(program)
    assert get_target("ascend-interpret").tiling(plan).min_dot == 16
    assert get_target("ascend").tiling(plan).min_dot == 1
    compiled, interpreted = (kernel_source(program, t) for t in ("ascend", "ascend-interpret"))
    assert "tl.sum(xk" not in compiled
    assert "tl.sum(xk" in interpreted and "tl.dot(" in interpreted
