"""The ``ascend`` target profile: UB-budget tiling, head chunks, the persistent grid.

Pure Python (no compiler): runs in the main environment and in the Ascend one.
"""

from __future__ import annotations

import re

import pytest
import torch

from fqr.lowering import ascend as A
from fqr.lowering.plan import plan_program
from fqr.lowering.targets import cdiv, get_target
from fqr.presets import PRESETS, get_preset
from fqr.prologue import program_of

VLLM_ASCEND_UB = 85 * 1024  # the hard-coded budget of vllm-ascend's split_qkv_rmsnorm_rope


def all_preset_views():
    for name in PRESETS:
        for tp in (1, 2, 4, 8):
            try:
                yield get_preset(name, tp)
            except ValueError:
                continue


def plan_of(preset, dtype=torch.bfloat16, bias=False):
    """The plan of the preset's own prologue (its variant's program)."""
    return plan_program(program_of(preset, dtype, bias=bias, sharded_full_norm=preset.tp > 1))


def whole_row_bytes(plan, chip, block_t):
    """Footprint of whole rows (no chunking) at ``block_t``, from the model's parts."""
    shapes = [A.ChainShape.of(c, plan) for c in plan.chains]
    return (
        A.hoisted_footprint(plan)
        + A.tile_scope_footprint(plan, block_t, chip.multibuffer)
        + max(A.chain_footprint(s, block_t, s.heads, chip.multibuffer) for s in shapes)
    )


@pytest.mark.parametrize("chip", ["A2", "950"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_preset_fits_with_the_largest_tile(chip, dtype):
    chip = A.get_chip(chip)
    for p in all_preset_views():
        try:
            plan = plan_of(p, dtype)
        except TypeError as e:  # fp8_ds_mla entries hold 16-bit rope values: no fp32 op
            assert "must be bf16 or fp16" in str(e) and dtype == torch.float32, p.label
            continue
        if A.stores_fp8(plan) and not chip.compile_on_910_95:  # only the 950 has FP8
            with pytest.raises(A.UnsupportedOnChip, match="FP8 stores need an Ascend 950"):
                A.ascend_tiling(plan, chip=chip)
            continue
        t = A.ascend_tiling(plan, chip=chip)
        bt, chunks = t.tiling.block_t, t.tiling.head_chunks
        assert t.footprint <= t.budget == chip.ub_bytes - A.UB_RESERVE_BYTES, p.label
        assert A.MIN_BLOCK_T <= bt <= A.MAX_BLOCK_T and bt & (bt - 1) == 0, p.label
        if chunks == tuple(c.heads for c in plan.chains):
            # Maximal: twice the tokens would not fit (unless already at the cap).
            assert bt == A.MAX_BLOCK_T or whole_row_bytes(plan, chip, 2 * bt) > t.budget, p.label
        else:
            # Chunked only because whole rows of the smallest tile do not fit.
            assert bt == A.MIN_BLOCK_T and whole_row_bytes(plan, chip, bt) > t.budget, p.label


def test_qwen3_32b_at_vllm_ascend_budget_is_chunked_not_clamped():
    p = get_preset("qwen3-32b")
    plan = plan_of(p)
    t = A.ascend_tiling(plan, ub_bytes=VLLM_ASCEND_UB)
    q_chunk = t.tiling.head_chunks[0]
    assert q_chunk < p.num_heads and q_chunk & (q_chunk - 1) == 0
    assert whole_row_bytes(plan, t.chip, A.MIN_BLOCK_T) > t.budget  # a whole row does not fit
    assert t.footprint <= t.budget  # the chunks do
    assert "chain0: 64 heads in chunks of" in t.describe()
    # Every q head is covered by the chunks.
    assert cdiv(p.num_heads, q_chunk) * q_chunk >= p.num_heads


def test_full_width_norm_is_chunked_when_needed():
    p = get_preset("olmo2-7b")  # norm over the whole q (32 x 128) and k projections
    t = A.ascend_tiling(plan_of(p), ub_bytes=VLLM_ASCEND_UB)
    assert t.tiling.head_chunks[0] < p.num_heads and t.footprint <= t.budget


def test_a_head_that_cannot_fit_is_an_error_naming_the_numbers():
    with pytest.raises(
        A.TileDoesNotFit, match=r"chain0 \(64 heads x 128\).*KiB of UB, the budget is"
    ):
        A.ascend_tiling(plan_of(get_preset("qwen3-32b")), ub_bytes=20 * 1024)


@pytest.mark.parametrize("bad", [0, 1000, A.UB_RESERVE_BYTES, -5, 1.5e5, True])
def test_bad_ub_bytes(bad):
    with pytest.raises(ValueError, match="ub_bytes"):
        A.ascend_tiling(plan_of(get_preset("qwen3-8b")), ub_bytes=bad)


def test_ub_override_from_environment(monkeypatch):
    plan = plan_of(get_preset("qwen3-8b"))
    monkeypatch.setenv("FQR_ASCEND_UB_BYTES", str(VLLM_ASCEND_UB))
    assert A.ascend_tiling(plan).budget == VLLM_ASCEND_UB - A.UB_RESERVE_BYTES


@pytest.mark.parametrize(
    "arch, chip",
    [
        ("Ascend910B3", "A2"),
        ("Ascend910B4", "A2"),
        ("Ascend910_9391", "A3"),
        ("Ascend910_9599", "950"),
        ("Ascend950PR", "950"),
    ],
)
def test_chip_of_arch(arch, chip):
    assert A.chip_of_arch(arch).name == chip


def test_unknown_chip_names():
    with pytest.raises(ValueError, match="unknown Ascend SoC"):
        A.chip_of_arch("Ascend310P3")
    with pytest.raises(ValueError, match="chip must be one of A2, A3, 950"):
        A.get_chip("910C")


def test_heads_held_at_once():
    assert A.heads_held(24, 24, "unroll") == 16  # 16 + 8, no padded heads
    assert A.heads_held(24, 24, "loop") == 32  # one chunk padded to a power of two
    assert A.heads_held(24, 8, "unroll") == A.heads_held(24, 8, "loop") == 8
    assert A.heads_held(12, 12, "unroll") == 8 and A.heads_held(3, 3, "unroll") == 2
    with pytest.raises(ValueError, match="chunk_mode"):
        A.heads_held(8, 8, "grid")


def test_unrolled_parts_let_qwen35_keep_a_larger_tile():
    plan = plan_of(get_preset("qwen3.5-27b"))  # 24 q heads x 256
    unroll = A.ascend_tiling(plan, chunk_mode="unroll")
    loop = A.ascend_tiling(plan, chunk_mode="loop")
    assert unroll.tiling.head_chunks[0] == 24 and unroll.tiling.chunk_mode == "unroll"
    assert loop.tiling.head_chunks[0] < 24  # padded to 32 heads, the row does not fit


def test_block_t_override_is_validated():
    plan = plan_of(get_preset("qwen3-8b", 8))
    assert A.ascend_tiling(plan, block_t=2).tiling.block_t == 2
    for bad in (1, 3, 0, 6):
        with pytest.raises(ValueError, match="block_t must be a power of two"):
            A.ascend_tiling(plan, block_t=bad)


# ----------------------------------------------------------------------- grid and cores


def test_vector_core_count_sources(monkeypatch):
    assert A.vector_core_count() == A.DEFAULT_NUM_VECTORCORE
    assert A.vector_core_count(num_vectorcore=7) == 7
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_vectorcore must be a positive int"):
            A.vector_core_count(num_vectorcore=bad)


def test_npu_vector_cores_come_from_the_triton_ascend_driver(monkeypatch):
    triton = pytest.importorskip("triton")
    asked = []

    class Utils:
        def get_device_properties(self, dev):
            asked.append(dev)
            return {"max_shared_mem": 1, "num_aicore": 24, "num_vectorcore": 48}

    class Active:
        utils = Utils()

    class Driver:
        active = Active()

    monkeypatch.setattr(triton.runtime, "driver", Driver())
    assert A.npu_vector_core_count(3) == 48 and asked == [3]


def test_grid_is_one_program_per_core_and_never_more_than_tiles():
    target = get_target("ascend")
    cpu = torch.device("cpu")
    assert target.grid(10_000, 4, cpu) == A.DEFAULT_NUM_VECTORCORE
    assert target.grid(10_000, 4, cpu, num_vectorcore=20) == 20
    assert target.grid(7, 4, cpu) == 2
    assert target.grid(1, 16, cpu) == 1
    assert get_target("ascend-interpret").grid(10_000, 4, cpu) == A.DEFAULT_INTERPRET_VECTORCORES


def test_token_count_is_a_runtime_argument_only():
    """One kernel for every batch size: T changes the grid and the T argument, nothing else.

    (The ascend-interpret kernel: this process runs triton interpreted; its launcher is the
    ascend one with the same tiling.)"""
    from fqr.lowering import lower
    from fqr.lowering.ascend_compile import launch_arguments

    program = program_of(get_preset("qwen3-8b", 2))
    kernel = lower(program, "ascend-interpret", num_vectorcore=20)
    assert kernel.tiling.block_t == get_target("ascend").tiling(kernel.plan).block_t
    bt = kernel.tiling.block_t
    seen = set()
    for tokens in (1, 7, 40, 81, 1000, 100_003):
        args, kwargs, grid = launch_arguments(kernel, tokens)
        assert kwargs == {"BLOCK_T": bt, "DENSE": True}  # DENSE does not depend on T either
        assert args[-1] == tokens
        assert grid[0] == min(20, cdiv(tokens, bt)) and all(g == 1 for g in grid[1:])
        seen.add(tuple(a for a in args[:-1] if not isinstance(a, torch.Tensor)))
    assert len(seen) == 1  # strides and every other scalar argument do not depend on T
    assert '@triton.jit(do_not_specialize=["T"])' in kernel.source
    assert not re.search(r"\bT: tl.constexpr", kernel.source)


# ----------------------------------------------------------------------- the device boundary


def test_ascend_backend_without_an_npu_is_a_clear_error(problem):
    import importlib.util

    import fqr
    from fqr.backends import BACKENDS, BackendUnavailable

    reason = BACKENDS["ascend"].unavailable_reason()
    if importlib.util.find_spec("torch_npu") is None:
        assert reason is not None and ("torch_npu" in reason or "triton-ascend" in reason)
    with pytest.raises((ValueError, BackendUnavailable), match="npu|torch_npu|triton-ascend"):
        fqr.split_qkv_rmsnorm_rope(*problem.args(), **problem.kwargs(), backend="ascend")


def test_doctor_facts_name_the_cann_compiler():
    from fqr.lowering.ascend_compile import ascend_facts

    facts = ascend_facts()
    assert set(facts) == {"bishengir-compile", "npu_devices"}
    assert isinstance(facts["npu_devices"], list)


@pytest.mark.parametrize("preset, tp", [("qwen3-8b", 1), ("glm4-9b", 8), ("olmo2-7b", 1)])
def test_positions_are_read_as_a_vector_of_the_tile(preset, tp):
    """vllm-ascend issue 16674: positions read back as scalars from a tile whose load had not
    finished. Here the token tile's positions are one vector load, used only as a tensor."""
    from fqr.core import ProgramPrinter
    from fqr.lowering import kernel_source

    program = program_of(get_preset(preset, tp), sharded_full_norm=tp > 1)
    source = kernel_source(program, "ascend")
    printer = ProgramPrinter(program)
    pos_ptr = [printer.name(v) for v in program.inputs][1] + "_ptr"  # as the printed program
    uses = [line.strip() for line in source.splitlines() if re.search(rf"\b{pos_ptr}\b", line)]
    loads = [u for u in uses if "tl.load(" in u]
    assert len(loads) == 1 and re.search(rf"= tl\.load\({pos_ptr} \+ tok, mask=tmask\b", loads[0])
    assert not re.search(r"get_element|extract_slice|insert_slice|\.item\(", source)


# ----------------------------------------------------------------------- any shape

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fqr.presets import Preset  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(
    kv=st.integers(1, 16),
    group=st.integers(1, 8),
    d=st.sampled_from([64, 80, 96, 128, 192, 256]),
    rot=st.sampled_from([0.25, 0.5, 1.0]),
    norm=st.sampled_from(["head", "full", "none"]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    ub_kib=st.integers(24, 256),
    mode=st.sampled_from(["unroll", "loop"]),
)
def test_any_shape_fits_or_is_refused(kv, group, d, rot, norm, dtype, ub_kib, mode):
    p = Preset("any", "-", kv * group, kv, d, 1e4, 4096, norm=norm, partial_rotary_factor=rot)
    plan = plan_of(p, dtype)
    try:
        t = A.ascend_tiling(plan, ub_bytes=ub_kib * 1024, chunk_mode=mode)
    except A.TileDoesNotFit:
        shapes = [A.ChainShape.of(c, plan) for c in plan.chains]
        smallest = (
            A.hoisted_footprint(plan)
            + A.tile_scope_footprint(plan, A.MIN_BLOCK_T, True)
            + max(A.chain_footprint(s, A.MIN_BLOCK_T, 1, True, mode) for s in shapes)
        )
        assert smallest > ub_kib * 1024 - A.UB_RESERVE_BYTES
        return
    assert t.footprint <= t.budget
    for c, hc in zip(plan.chains, t.tiling.head_chunks):
        assert 1 <= hc <= c.heads
        if hc < c.heads:
            assert t.tiling.block_t == A.MIN_BLOCK_T
