"""The schedule knobs of issue 38 (``heads_per_program``, ``maxnreg``, ``pipeline_stages``): each
is a choice of how the one traced program maps onto programs, registers and loads, never a
change of what it computes. Under every knob the interpreted kernel meets the fused contract
against the float64 formulation, writes the same bits as the default schedule (a masked or
misplaced head group would leave the NaN poison), and a chain whose norm spans the whole row
(OLMo2's full-width norm, MLA's latent norms) stays in one program. The knobs reach the
compiled code (``.maxnreg`` and ``cp.async`` in the sm_90 PTX), the generated host function
launches the decode schedule's grid, and ``FQR_SCHEDULE`` forces a schedule on the goldens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import make_problem
from support.cuda_ptx import run_compiling
from support.programs import poisoned_outputs

from fqr import reference
from fqr.backends import BACKENDS
from fqr.lowering import (
    forced_schedule,
    kernel_source,
    lower,
    lower_by_tokens,
    plan_program,
    tiling_of,
)
from fqr.lowering.targets import get_target
from fqr.numerics import compare, compare_kind
from fqr.presets import get_preset
from fqr.prologue import variant_of
from fqr.prologue.split_qkv import SPLIT_QKV_RMSNORM_ROPE

pytestmark = pytest.mark.skipif(
    not BACKENDS["interpret"].available, reason=BACKENDS["interpret"].unavailable_reason() or ""
)
ROOT = Path(__file__).resolve().parents[2]


def _program(pb, numerics="fused"):
    return SPLIT_QKV_RMSNORM_ROPE.program_for(*pb.args(), **pb.kwargs(numerics=numerics))


def _run(program, operands, **options):
    kernel = lower(program, "interpret", **options)
    outs = poisoned_outputs(program, operands[0].shape[0])
    kernel(*operands, out=outs)
    return outs, kernel


def _check_float64(pb, outs, numerics="fused"):
    exact = reference.prologue(*pb.args(), **pb.kwargs())
    for name, o, e in zip("qkv", outs, exact):
        c = compare(o, e, head_dim=pb.spec.head_dim, numerics=numerics, bitwise=name == "v")
        assert c.passed, f"{name}: {c}"


# 6 q heads and 2 kv heads of 64, 17 tokens in tiles of 2 over 2 programs: the persistent loop
# runs several tiles, the last one ragged.
LOOP = dict(block_t=2, max_programs=2)


@pytest.mark.parametrize(
    "per_program, programs, marker",
    [
        # q: 6 heads in groups of 1 / 2 / 4 (the last group of 4 masked); k: 2 heads; v: 2 heads
        (1, 6 + 2 + 2, "hh = block * 1 + tl.arange(0, 1)[None, :, None]"),
        (2, 3 + 1 + 1, "elif block == 3:"),  # k after q's three groups
        (4, 2 + 1 + 1, "hvalid = hh < 6"),
    ],
)
def test_the_decode_schedule_spreads_heads_over_programs(gen, per_program, programs, marker):
    """Each chain's heads go in groups of ``heads_per_program``, one program each along grid
    axis 1 (k's and v's 2 heads fit one group: one program each); the outputs meet the
    contract and equal the default grid schedule's bit for bit."""
    pb = make_problem(gen, tokens=17, num_heads=6, num_kv_heads=2, head_dim=64)
    program = _program(pb)
    options = dict(chunk_mode="grid", heads_per_program=per_program, **LOOP)
    outs, kernel = _run(program, pb.operands(), **options)
    assert kernel.grid_blocks == programs
    assert marker in kernel.source
    assert kernel.tiling.heads_per_program == per_program
    _check_float64(pb, outs)
    plain, _ = _run(program, pb.operands(), chunk_mode="grid", **LOOP)
    for o, p in zip(outs, plain):
        assert torch.equal(o.view(torch.int16), p.view(torch.int16))


def test_a_full_width_norm_keeps_one_program_per_norm_group(gen):
    """OLMo2 (``norm="full"``): q's and k's norms span their whole rows, so each stays one
    program (its statistic summed over all heads); only v is grouped."""
    pb = make_problem(gen, tokens=9, num_heads=6, num_kv_heads=2, head_dim=64, norm="full")
    program = _program(pb)
    outs, kernel = _run(program, pb.operands(), chunk_mode="grid", heads_per_program=1, **LOOP)
    assert kernel.grid_blocks == 1 + 1 + 2
    assert "hh = (block - 2) * 1" in kernel.source  # v's heads from program 2 on
    _check_float64(pb, outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unfused_bits_do_not_depend_on_the_schedule(gen, dtype):
    """``unfused`` rounds between steps as the model's eager code does: under every knob the
    kernel writes the same bits as under the default schedule, and as the reference rules
    wherever the default does (``tests/lowering/test_lowering.py``)."""
    pb = make_problem(gen, tokens=13, num_heads=6, num_kv_heads=2, head_dim=64, dtype=dtype)
    program = _program(pb, "unfused")
    base, _ = _run(program, pb.operands(), **LOOP)
    _check_float64(pb, base, "unfused")
    for options in (
        dict(chunk_mode="grid", heads_per_program=2),
        dict(pipeline_stages=3),
        dict(chunk_mode="grid", pipeline_stages=2),  # the loop inside each block's branch
        dict(maxnreg=64, chunk_mode="grid", heads_per_program=4, pipeline_stages=2),
    ):
        outs, _ = _run(program, pb.operands(), **options, **LOOP)
        for o, b in zip(outs, base):
            assert torch.equal(o.view(torch.int16), b.view(torch.int16)), options


def test_pipelined_token_loop_and_register_budget(gen):
    """``pipeline_stages``: the token loop is ``tl.range(..., num_stages=n)`` (the interpreter
    runs it as a loop); ``maxnreg``: a launch option of the cuda kernel only (the interpreter
    has no registers). Both leave the outputs right."""
    pb = make_problem(gen, tokens=17, num_heads=4, num_kv_heads=2, head_dim=64)
    program = _program(pb)
    outs, kernel = _run(program, pb.operands(), pipeline_stages=3, maxnreg=64, **LOOP)
    assert "for t0 in tl.range(pid * BLOCK_T, T, nprog * BLOCK_T, num_stages=3):" in kernel.source
    assert "maxnreg" not in kernel._launch
    _check_float64(pb, outs)
    cuda = get_target("cuda")
    assert cuda.launch_options(plan_program(program), maxnreg=64)["maxnreg"] == 64
    assert "maxnreg" not in cuda.launch_options(plan_program(program))
    assert "num_stages=2" in kernel_source(program, "cuda", pipeline_stages=2)
    plain = kernel_source(program, "cuda")
    assert kernel_source(program, "cuda", maxnreg=64) == plain  # a budget changes no source
    # 1 stage is the plain loop: the same source and kernel-cache key
    assert kernel_source(program, "cuda", pipeline_stages=1) == plain


# Presets of every family with a chain the decode schedule splits or must keep whole, at a TP
# size with few heads (small interpreted cases): MLA's latent norms (single heads: nothing to
# split, the kernel unchanged), V3.2's fp8_ds_mla entry, MiniMax's indexer heads and caches,
# gated mRoPE (q and gate heads interleaved in the row).
PRESETS = [
    ("deepseek-v3", 1),
    ("deepseek-v3.2", 8),
    ("minimax-m3-index-cache", 8),
    ("qwen3.5-27b", 8),
    ("qwen3-vl-8b", 8),
]


@pytest.mark.parametrize("name, tp", PRESETS, ids=[p for p, _ in PRESETS])
def test_every_family_under_the_decode_and_wide_schedules(gen, name, tp):
    """Each preset's program under the decode schedule (a head per program) and under the
    wide-row knobs (a register budget, a pipelined loop of 2-token tiles): every output, the
    paged caches included, meets its tolerance against the float64 reference, and equals the
    default schedule's bits."""
    preset = get_preset(name, tp)
    variant = variant_of(preset)
    program = variant.program(preset)
    table = preset.cos_sin_cache()
    drawn = variant.draw(preset, 5, torch.bfloat16, gen, max_position=table.shape[0])
    expected = variant.expected(preset, drawn, table)
    names = variant.outputs_of(preset)

    def run(**options):
        inputs = {k: v.clone() for k, v in drawn.items()}  # the caches are updated in place
        args = variant.program_args(preset, inputs, table)
        return lower(program, "interpret", **options).launch(args, donate=True)

    base = run(**LOOP)
    grouped = tiling_of(program, "interpret", chunk_mode="grid", heads_per_program=1)
    single = all(c.heads == 1 or c.row_reductions for c in lower(program, "interpret").plan.chains)
    assert (grouped.heads_per_program == 0) == single  # MLA: no chain to split, the same kernel
    for options in (
        dict(chunk_mode="grid", heads_per_program=1),
        dict(maxnreg=64, pipeline_stages=2),
        dict(chunk_mode="grid", pipeline_stages=2),
    ):
        outs = run(**options, **LOOP)
        for n, o, b in zip(names, outs, base):
            c = compare_kind(
                variant.tolerance(n, preset),
                o,
                expected[n],
                head_dim=variant.head_dim(preset, n),
                numerics="fused",
            )
            assert c.passed, f"{name} {options} {n}: {c}"
            assert torch.equal(o.view(torch.uint8), b.view(torch.uint8)), (options, n)


def test_the_host_function_launches_the_decode_schedules_grid(gen):
    """The generated host function (``fqr/lowering/host.py``) launches a decode-schedule
    kernel on its whole grid: (token tiles, the programs of every head group)."""
    from fqr.lowering.host import host_function

    pb = make_problem(gen, tokens=7, num_heads=6, num_kv_heads=2, head_dim=64)
    program = _program(pb)
    variants = lower_by_tokens(program, "interpret", chunk_mode="grid", heads_per_program=2)
    args = list(pb.operands())
    variants.launch(args)  # the general path lowers the variant first
    fast = host_function(variants, args)
    assert fast is not None and "[(g, 5)]" in fast.source  # 3 + 1 + 1 programs a token tile
    fast.fn.__globals__["EMPTY"] = lambda size, dtype, device: torch.full(
        size, float("nan"), dtype=dtype, device=device
    )
    outs = fast.fn(args)
    _check_float64(pb, outs)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(chunk_mode="grid", heads_per_program=3), "heads_per_program must be a power of two"),
        (dict(chunk_mode="unroll", heads_per_program=2), "heads_per_program .* chunk_mode='grid'"),
        (dict(heads_per_program=-1), "heads_per_program must be an int >= 0"),
        (dict(pipeline_stages=9), "pipeline_stages must be 0 .. 8"),
        (dict(pipeline_stages="2"), "pipeline_stages must be an int >= 0"),
        (dict(maxnreg=300), "maxnreg must be 0 \\(no budget\\) or 16 .. 255"),
    ],
)
def test_a_bad_knob_is_refused_naming_it(gen, options, message):
    pb = make_problem(gen, tokens=1)
    with pytest.raises(ValueError, match=message):
        lower(_program(pb), "interpret", **options)
    with pytest.raises(ValueError, match=message):
        get_target("cuda").launch_options(plan_program(_program(pb)), **options)
        kernel_source(_program(pb), "cuda", **options)


def test_fqr_schedule_is_a_json_object_of_options(monkeypatch):
    monkeypatch.setenv("FQR_SCHEDULE", '{"chunk_mode": "grid", "heads_per_program": 2}')
    assert forced_schedule() == {"chunk_mode": "grid", "heads_per_program": 2}
    monkeypatch.setenv("FQR_SCHEDULE", "[2]")
    with pytest.raises(ValueError, match="FQR_SCHEDULE must be a JSON object of lowering"):
        forced_schedule()
    monkeypatch.delenv("FQR_SCHEDULE")
    assert forced_schedule() == {}


GOLDEN = """
import json
from fqr.golden import load_case
results = {}
for name in NAMES:
    case = load_case(name)
    outs = case.run("interpret")
    outs = outs if isinstance(outs, tuple) else (outs,)
    checks = case.check(*outs)
    results[name] = all(c.passed for c in checks.values())
print(json.dumps(results))
"""

FORCED_CASES = [
    "deepseek-v3.2-tp8-bf16-t7-fused",
    "deepseek-v3-q-rope-tp8-bf16-t7-fused-pos18",
    "minimax-m3-tp4-bf16-t1-unfused",
    "qwen3.5-27b-tp8-fp16-t7-fused-bias",
    "olmo2-7b-tp4-bf16-t7-fused",
    "glm4-9b-fp16-t7-unfused",
]


def test_goldens_pass_under_a_forced_schedule(tmp_path):
    """``FQR_SCHEDULE`` (set before a process lowers anything) makes every kernel the backends
    run take that schedule: golden cases of each family, fused and unfused, pass under a head
    per program with a pipelined loop (``fqr verify --backend interpret`` runs all of them the
    same way)."""
    schedule = {"chunk_mode": "grid", "heads_per_program": 1, "pipeline_stages": 2}
    env = {
        **os.environ,
        "FQR_SCHEDULE": json.dumps(schedule),
        "FQR_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    script = f"NAMES = {FORCED_CASES!r}\n" + textwrap.dedent(GOLDEN)
    r = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1]) == dict.fromkeys(FORCED_CASES, True)


SM90 = """
from support.cuda_ptx import compile_for_sm90
from fqr.lowering import lower
from fqr.presets import get_preset
from fqr.prologue import program_of

program = program_of(get_preset("qwen3-8b"))
wide = compile_for_sm90(lower(program, "cuda", maxnreg=64, pipeline_stages=2, programs_per_sm=4))
decode = compile_for_sm90(lower(program, "cuda", chunk_mode="grid", heads_per_program=1,
                                num_warps=1), tokens=1)
grid = compile_for_sm90(lower(program, "cuda", chunk_mode="grid", pipeline_stages=2,
                              programs_per_sm=4))
print(".maxnreg 64" in wide.asm["ptx"], "cp.async" in wide.asm["ptx"],
      "cp.async" in grid.asm["ptx"], "cp.async" in decode.asm["ptx"])
"""


def test_the_knobs_reach_the_sm90_code(tmp_path):
    """Compiled for sm_90 here (no GPU): the register budget is the PTX's ``.maxnreg``, the
    pipelined loop's loads are asynchronous copies (``cp.async``: issued ahead of their use),
    in a grid kernel too (its loop inside each block's branch), and the decode schedule
    compiles (no loop to pipeline there)."""
    out = run_compiling(SM90, tmp_path / "cache")
    assert out.split()[-4:] == ["True", "True", "True", "False"]
