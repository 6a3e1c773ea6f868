"""The tuning sweep (:mod:`fqr.tools.tuning_sweep`, issue 31.4): its kernels compile ahead for
sm_90 on this CPU machine (a bundle, so the GPU visit times and compiles nothing), its rows
become the shipped table's format with the swept shapes replaced and the rest kept, presets
that share a table key are scored as one, and misuse is refused in one line. The timing itself
runs on the GPU (``scripts/gpu_session.sh sweep``)."""

from __future__ import annotations

import json

import pytest
import torch
from support.cuda_ptx import run_compiling

from fqr.lowering.targets import shape_key
from fqr.lowering.tuning import TILING_OPTIONS, TUNING_FILE, parse_table, upgraded
from fqr.tools import tuning_sweep as S

BUILD = """
import json, os
from fqr.tools import tuning_sweep as S
every = S.option_sets()
# two option sets: the build path, not the whole sweep
S.OPTION_SETS["all"] = lambda plan=None: every[:2]
written = S.build({directory!r}, ["deepseek-v3", "qwen3-vl-8b"], [1, 16, 1024], log=lambda m: None)
again = S.build({directory!r}, ["deepseek-v3", "qwen3-vl-8b"], [1, 16, 1024], log=lambda m: None)
files = sorted(os.listdir({directory!r}))
print(json.dumps({{"written": written, "again": again,
                  "cubins": sum(f.endswith(".cubin") for f in files)}}))
"""


def test_the_sweep_kernels_compile_ahead_into_a_bundle(tmp_path):
    """Every (option set, alignment class) launch of the sweep compiles for sm_90 with no GPU;
    a second build finds them all held. qwen3-vl-8b's mRoPE position planes start at ``8 * T``
    bytes: T = 1 and T = 16 specialise apart (deepseek-v3's kernels do not)."""
    directory = tmp_path / "sweep"
    out = run_compiling(BUILD.format(directory=str(directory)), tmp_path / "cache")
    report = json.loads(out.splitlines()[-1])
    assert report["again"] == 0
    assert report["written"] == report["cubins"] > 0
    # deepseek-v3: <= 2 sources x 1 class; qwen3-vl-8b: 2 sources x 2 classes
    assert 5 <= report["cubins"] <= 6


def _row(preset, t, us, **cfg):
    options = dict(num_warps=2, block_t=1, tile_elems=2048, chunk_mode="grid", programs_per_sm=0)
    return {"preset": preset, "T": t, "cfg": {**options, **cfg}, "us": us}


def test_a_regenerated_table_replaces_the_swept_shapes_and_keeps_the_rest():
    """deepseek-v3 is swept: its shape gets the winner of each bucket (the capped grid at large
    T, 4 warps in the middle); every other entry of the shipped table is kept as it was; the
    document parses as the target reads it."""
    base = json.loads(TUNING_FILE.read_text())
    rows = []
    for t in (1, 16):
        rows += [_row("deepseek-v3", t, 2.0), _row("deepseek-v3", t, 2.5, num_warps=4)]
    for t in (1024, 4096):
        rows += [_row("deepseek-v3", t, 9.0), _row("deepseek-v3", t, 7.0, num_warps=4)]
    for t in (16384, 65536):
        rows += [_row("deepseek-v3", t, 60.0), _row("deepseek-v3", t, 50.0, programs_per_sm=8)]
    doc = S.regenerated_table(rows, base, source="test")
    key = S.shape_groups(["deepseek-v3"])["deepseek-v3"]
    entry = [e for e in doc["entries"] if tuple(tuple(c) for c in e["shape"]) == key]
    assert len(entry) == 1 and entry[0]["dtype"] is None
    assert entry[0]["variants"] == [
        [2, 1, 2048, "grid", 0, 0, 0, 0],
        [4, 1, 2048, "grid", 0, 0, 0, 0],
        [2, 1, 2048, "grid", 8, 0, 0, 0],
    ]
    others = [e for e in upgraded(base)["entries"] if tuple(tuple(c) for c in e["shape"]) != key]
    assert [e for e in doc["entries"] if e not in entry] == others
    assert doc["options"] == list(TILING_OPTIONS)
    parse_table(doc)


def test_presets_that_share_a_table_key_are_scored_as_one():
    """qwen3-8b and qwen3-vl-8b lower to one table key (mRoPE's planes are not part of it):
    one entry, whose winner sums both presets' relative times (here the option set that is
    best for neither alone but good for both)."""
    groups = S.shape_groups(["qwen3-8b", "qwen3-vl-8b", "deepseek-v3"])
    assert set(groups) == {"qwen3-8b+qwen3-vl-8b", "deepseek-v3"}
    rows = []
    for t in (1, 1024, 65536):
        rows += [
            _row("qwen3-8b", t, 1.0, num_warps=1),
            _row("qwen3-8b", t, 3.0, num_warps=2),
            _row("qwen3-8b", t, 1.2, num_warps=4),
            _row("qwen3-vl-8b", t, 3.0, num_warps=1),
            _row("qwen3-vl-8b", t, 1.0, num_warps=2),
            _row("qwen3-vl-8b", t, 1.2, num_warps=4),
        ]
    doc = S.regenerated_table(rows, json.loads(TUNING_FILE.read_text()), source="test")
    key = [list(c) for c in groups["qwen3-8b+qwen3-vl-8b"]]
    (entry,) = [e for e in doc["entries"] if e["shape"] == key and e["dtype"] is None]
    assert [v[0] for v in entry["variants"]] == [4, 4, 4]
    assert entry["model"] == "qwen3-8b + qwen3-vl-8b (Qwen/Qwen3-8B, Qwen/Qwen3-VL-8B-Instruct)"


def test_shape_groups_are_the_targets_keys():
    from fqr.lowering import plan_program
    from fqr.presets import get_preset
    from fqr.prologue import program_of

    for name, key in S.shape_groups(["deepseek-v3-q-rope", "minimax-m3"]).items():
        assert key == shape_key(plan_program(program_of(get_preset(name))))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["build", "-o", "x", "--preset", "qwen9"], "error: preset must be one of"),
        (["run", "--out", "x", "--tokens", "1,zero"], "error: invalid literal"),
        (["run", "--out", "x", "--tokens", "0,16"], "error: --tokens must be positive ints"),
    ],
)
def test_misuse_is_one_line_and_exit_2(argv, message, capsys):
    assert S.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_qwen35s_plain_row_takes_the_gated_rows_variants():
    """Sweeping Qwen3.5-27B (gated mRoPE) also sets the entry of its plain q/k/v row to the same
    variants: text-only mRoPE stays plain RoPE's bits only when both reduce alike."""
    rows = [
        _row("qwen3.5-27b", t, us, num_warps=w)
        for t in (1, 1024, 65536)
        for w, us in ((1, 2.0), (4, 1.0))
    ]
    doc = S.regenerated_table(rows, json.loads(TUNING_FILE.read_text()), source="test")
    _, table = parse_table(doc)
    gated = S.shape_groups(["qwen3.5-27b"])["qwen3.5-27b"]
    plain = gated[:3]  # the same row without the gate chain
    assert table[gated] == table[plain] == ((4, 1, 2048, "grid", 0, 0, 0, 0),) * 3


class _CountingTimers:
    """Times nothing: runs each rotating call once per input set (the kernels really launch,
    interpreted) and returns the measurement's ordinal, so rows show which share one."""

    def __init__(self):
        self.measured = 0

    def graph_us(self, call, rep_ms):
        call()
        self.measured += 1
        return float(self.measured)


def test_the_sweep_measures_each_distinct_grid_once(monkeypatch):
    """On the CPU (interpreted kernels): where the caps leave the target's grid as it is (T =
    3, the interpreter's grid of 3 programs), each option set is measured once and that figure
    recorded under every cap; rows carry the option set in the table's option order and the
    traffic as GB/s."""
    every = S.option_sets()
    monkeypatch.setitem(S.OPTION_SETS, "all", lambda plan=None: every[:2])
    timers = _CountingTimers()
    saved = []
    rows = S.run(
        ["deepseek-v3"], [3], device=torch.device("cpu"), timers=timers,
        save=saved.append, log=lambda m: None, target="interpret",
    )  # fmt: skip
    assert timers.measured == 2
    assert len(rows) == 2 * len(S.PROGRAMS_PER_SM) and saved == [rows]
    for i, options in enumerate(every[:2]):
        mine = [r for r in rows if {k: r["cfg"][k] for k in options} == options]
        assert [r["cfg"]["programs_per_sm"] for r in mine] == list(S.PROGRAMS_PER_SM)
        assert {r["us"] for r in mine} == {float(i + 1)}
        assert all(list(r["cfg"]) == list(TILING_OPTIONS) and r["gbps"] > 0 for r in mine)


def test_the_decode_sweep_runs_its_own_option_sets():
    """``--sets decode``: every decode option set (4-16 warps, grid chunks of 512-2,048 values,
    one token per tile) is launched and recorded at each T, nothing else."""
    rows = S.run(
        ["qwen3-8b-kv-insert"], [1, 2], device=torch.device("cpu"), timers=_CountingTimers(),
        log=lambda m: None, target="interpret", option_sets_of="decode",
    )  # fmt: skip
    decode = S.decode_option_sets()
    assert len(decode) == 9
    for t in (1, 2):
        seen = [{k: r["cfg"][k] for k in decode[0]} for r in rows if r["T"] == t]
        assert seen == [o for o in decode for _ in S.PROGRAMS_PER_SM]


def test_the_schedule_sets_sit_beside_the_shipped_variant():
    """``sched-decode`` (issue 38): the shipped decode variant of the shape, then heads per
    program 1, 2, 4 over 1, 2, 4 warps; ``sched-wide``: the shipped large-T variant, under a
    register budget and with its loop pipelined, and over 2 or 4 warps and tokens."""
    from fqr.lowering import plan_program
    from fqr.lowering.targets import tuned_variants
    from fqr.presets import get_preset
    from fqr.prologue import program_of

    plan = plan_program(program_of(get_preset("deepseek-v3")))
    shipped = [dict(zip(TILING_OPTIONS, c)) for c in tuned_variants(plan)]
    decode = S.sched_decode_option_sets(plan)
    assert {k: decode[0][k] for k in decode[0]} == {
        k: v for k, v in shipped[0].items() if k != "programs_per_sm"
    }
    assert {(o["heads_per_program"], o["num_warps"]) for o in decode[1:]} == {
        (h, w) for h in (1, 2, 4) for w in (1, 2, 4)
    }
    wide = S.sched_wide_option_sets(plan)
    large = {k: v for k, v in shipped[2].items() if k != "programs_per_sm"}
    knobs_off = dict(heads_per_program=0, maxnreg=0, pipeline_stages=0)
    assert wide[0] == {**large, **knobs_off}  # the shipped variant, every knob off
    assert {(o["maxnreg"], o["pipeline_stages"]) for o in wide[:6]} == {
        (r, s) for r in (0, 64, 80) for s in (0, 2)
    }
    assert {(o["num_warps"], o["block_t"]) for o in wide[6:]} == {(2, 2), (4, 4)}
    assert len({json.dumps(o, sort_keys=True) for o in wide}) == len(wide)


def test_a_table_from_the_schedule_sweeps_keeps_the_middle_bucket():
    """The visit's two runs (decode rows at T = 1, 16, joined by wide rows at 16,384 and
    65,536) regenerate a whole entry: the middle bucket, not swept, keeps the table's
    variant; the winners carry their knobs."""
    base = json.loads(TUNING_FILE.read_text())
    key = S.shape_groups(["qwen3-8b"])["qwen3-8b"]
    _, before = parse_table(base)
    rows = []
    for t in (1, 16):
        rows += [_row("qwen3-8b", t, 2.0), _row("qwen3-8b", t, 1.5, heads_per_program=1)]
    for t in (16384, 65536):
        rows += [
            _row("qwen3-8b", t, 60.0, chunk_mode="unroll"),
            _row("qwen3-8b", t, 55.0, chunk_mode="unroll", maxnreg=64, programs_per_sm=8),
        ]
    doc = S.regenerated_table(rows, base, source="test")
    _, table = parse_table(doc)
    assert table[key] == (
        (2, 1, 2048, "grid", 0, 1, 0, 0),
        before[key][1],
        (2, 1, 2048, "unroll", 8, 0, 64, 0),
    )


def test_the_decode_schedule_sweep_runs_and_times_each_kernel_once():
    """``--sets sched-decode`` on the CPU (interpreted): the shipped decode variant and the nine
    head-group sets are launched at each T; MLA's programs have no chain to split, so the sets
    that differ only in heads per program lower to one kernel, timed once."""
    timers = _CountingTimers()
    rows = S.run(
        ["deepseek-v3"], [1], device=torch.device("cpu"), timers=timers,
        log=lambda m: None, target="interpret", option_sets_of="sched-decode",
    )  # fmt: skip
    program = S.variant_of(S.get_preset("deepseek-v3")).program(S.get_preset("deepseek-v3"))
    sets = S.sched_decode_option_sets(S.plan_program(program))
    assert len(rows) == len(sets) * len(S.PROGRAMS_PER_SM)
    assert all(list(r["cfg"]) == list(TILING_OPTIONS) for r in rows)
    # one measurement per distinct kernel: heads per program changes nothing here
    kernels = [S.lower(program, "interpret", **o) for o in sets]
    assert all(k.tiling.heads_per_program == 0 for k in kernels)
    distinct = {(repr(k.tiling), k._launch["num_warps"]) for k in kernels}
    assert timers.measured == len(distinct) < len(sets)
