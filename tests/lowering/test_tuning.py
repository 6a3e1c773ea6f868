"""The cuda target's tuning table as data (issue 24.2: tuning a sweep can regenerate):
``fqr/lowering/tuning.json`` parses into what the target reads, a sweep's rows become a table
by the stated rule (least summed time relative to each T's best, per token bucket), and a
malformed document is refused naming the field."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fqr.bench.config import DEFAULT_PRESETS
from fqr.lowering import plan_program
from fqr.lowering.targets import UNTUNED, shape_key
from fqr.lowering.tuning import (
    TUNING_FILE,
    TuningError,
    load_table,
    parse_table,
    table_from_sweep,
    table_text,
    upgraded,
)
from fqr.presets import get_preset
from fqr.prologue import program_of


def test_the_shipped_table_covers_the_bench_presets():
    _, table = load_table()
    for name in DEFAULT_PRESETS:
        assert shape_key(plan_program(program_of(get_preset(name)))) in table, name


A, B, C = [1, 1, 2048, "grid", 0], [2, 1, 2048, "unroll", 0], [4, 2, 4096, "loop", 8]
OFF = [0, 0, 0]  # the schedule knobs off: heads_per_program, maxnreg, pipeline_stages


def _rows(us: dict) -> list[dict]:
    """Sweep rows of one preset: ``us[(T, config index)]`` (rows of a sweep made before the
    schedule knobs: their cfg names the first five options only), plus a hand-written
    kernel's."""
    configs = (A, B, C)
    rows = [
        {"preset": "p", "T": t, "cfg": dict(zip(("num_warps", "block_t", "tile_elems",
         "chunk_mode", "programs_per_sm"), configs[i])), "us": v}
        for (t, i), v in us.items()
    ]  # fmt: skip
    rows.append({"preset": "p", "T": 1, "cfg": "handwritten-w4", "us": 0.001})
    return rows


def test_a_sweep_becomes_a_table_by_each_buckets_least_relative_time():
    """Per bucket (T <= 256, <= 8192, larger) the option set whose times, each divided by the
    best at its T, sum least: at T = 16 B is 10% slower but A is 3x slower at T = 1."""
    us = {
        (1, 0): 3.0, (1, 1): 1.0, (1, 2): 2.0,
        (16, 0): 1.0, (16, 1): 1.1, (16, 2): 2.0,
        (1024, 0): 5.0, (1024, 1): 6.0, (1024, 2): 9.0,
        (65536, 0): 400.0, (65536, 1): 390.0, (65536, 2): 380.0,
    }  # fmt: skip
    shape = ((8, 128, "neox128", False), (2, 128, "plain", True))
    doc = table_from_sweep(_rows(us), {"p": shape}, UNTUNED, source="test", models={"p": "Model-P"})
    assert doc["entries"] == [
        {
            "model": "Model-P",
            "shape": [[8, 128, "neox128", False], [2, 128, "plain", True]],
            "dtype": None,
            "variants": [B + OFF, A + OFF, C + OFF],
        }
    ]
    untuned, table = parse_table(json.loads(json.dumps(doc)))  # as written to a file
    assert untuned == UNTUNED
    assert table == {shape: (tuple(B + OFF), tuple(A + OFF), tuple(C + OFF))}


def test_the_schedule_knobs_are_options_of_a_row_and_a_bucket_not_swept_keeps_its_variant():
    """A row naming the schedule knobs (issue 38) becomes an option set with them; a bucket
    the sweep measured no T of keeps the variant the table had (``kept``), so a sweep of the
    decode and large buckets alone regenerates a whole entry."""
    knobs = dict(heads_per_program=2, maxnreg=64, pipeline_stages=2)
    base = dict(zip(("num_warps", "block_t", "tile_elems", "chunk_mode", "programs_per_sm"), A))
    rows = [
        {"preset": "p", "T": 1, "cfg": {**base, "heads_per_program": 2}, "us": 1.0},
        {"preset": "p", "T": 1, "cfg": base, "us": 2.0},
        {"preset": "p", "T": 65536, "cfg": {**base, **knobs}, "us": 3.0},
        {"preset": "p", "T": 65536, "cfg": base, "us": 4.0},
    ]
    shape = ((8, 128, "neox128", False),)
    middle = tuple(B + OFF)
    doc = table_from_sweep(
        rows, {"p": shape}, UNTUNED, source="t", kept={"p": (tuple(A + OFF), middle, middle)}
    )
    assert doc["entries"][0]["variants"] == [A + [2, 0, 0], B + OFF, A + [2, 64, 2]]
    with pytest.raises(TuningError, match="no option set measured"):
        table_from_sweep(rows, {"p": shape}, UNTUNED, source="t")


def test_a_version_2_table_is_read_with_the_knobs_off():
    """The table before the schedule knobs (``fqr.tuning/2``, five options) still parses, each
    option set with the knobs off, and :func:`upgraded` writes it in the current schema."""
    doc = upgraded(json.loads(TUNING_FILE.read_text()))
    doc = {
        **doc,
        "entries": [e for e in doc["entries"] if not any(c[5:] != OFF for c in e["variants"])],
    }
    old = _version_2(doc)
    assert parse_table(old) == parse_table(doc) == parse_table(upgraded(old))
    assert upgraded(old)["schema"] == "fqr.tuning/3"
    assert all(len(c) == 8 for e in upgraded(old)["entries"] for c in e["variants"])


def test_a_bucket_without_an_option_set_measured_at_all_its_t_is_refused():
    us = {(1, 0): 1.0, (16, 1): 1.0, (1024, 0): 1.0, (65536, 0): 1.0}
    with pytest.raises(TuningError, match="p: no option set measured at every T of a bucket"):
        table_from_sweep(_rows(us), {"p": ((8, 128, "plain", True),)}, UNTUNED, source="t")


def _version_2(doc: dict) -> dict:
    """A current-schema document as ``fqr.tuning/2`` wrote it (five options a set)."""
    return {
        **doc,
        "schema": "fqr.tuning/2",
        "options": doc["options"][:5],
        "untuned": [c[:5] for c in doc["untuned"]],
        "entries": [{**e, "variants": [c[:5] for c in e["variants"]]} for e in doc["entries"]],
    }


def _break(path: str, value, doc=None):
    """The shipped table (as a ``fqr.tuning/2`` document unless ``doc`` is given) with the
    field at ``path`` set to ``value``."""
    if doc is None:
        doc = _version_2(upgraded(json.loads(TUNING_FILE.read_text())))
    doc = copy.deepcopy(doc)
    target, *keys = path.split(".")
    node = doc
    for key in [target, *keys][:-1]:
        node = node[int(key)] if key.isdigit() else node[key]
    last = [target, *keys][-1]
    node[int(last) if last.isdigit() else last] = copy.deepcopy(value)
    return doc


@pytest.mark.parametrize(
    "case",
    [
        ("schema", "fqr.tuning/1", "'schema' must be 'fqr.tuning/3'"),
        ("options", ["num_warps"], "'options' must be"),
        ("buckets", [256, None], "'buckets' must be"),
        ("untuned", [A, A], "'untuned' must hold one option set per bucket"),
        ("entries.0.variants.2", [3, 1, 2048, "grid", 0], "variants\\[2\\]: .* powers"),
        ("entries.0.variants.0", [2, 1, 2048, "tiles", 0], "chunk_mode must be one of"),
        ("entries.0.variants.1", [2, 1, 2048, "grid", -1], "programs_per_sm must be an int >= 0"),
        ("entries.0.variants.1", [2, 1, 2048, "grid"], "variants\\[1\\] must be a list of 5"),
        ("entries.0.variants.1", [2, 1, 2048, "grid", 0], "variants\\[1\\] must be a list of 8",
         "fqr.tuning/3"),
        ("entries.0.variants.1", [2, 1, 2048, "grid", 0, 3, 0, 0], "heads_per_program must be 0 "
         "or a power of two", "fqr.tuning/3"),
        ("entries.0.variants.1", [2, 1, 2048, "unroll", 0, 2, 0, 0], "heads_per_program needs "
         "chunk_mode grid", "fqr.tuning/3"),
        ("entries.0.variants.1", [2, 1, 2048, "grid", 0, 0, 300, 0], "maxnreg must be 0",
         "fqr.tuning/3"),
        ("entries.0.variants.1", [2, 1, 2048, "grid", 0, 0, 0, -1], "pipeline_stages must be",
         "fqr.tuning/3"),
        ("entries.0.shape", [], "entries\\[0\\].shape must be a non-empty list"),
        ("entries.0.dtype", "bf17", "entries\\[0\\].dtype must be a dtype name"),
        ("entries.1.shape", json.loads(TUNING_FILE.read_text())["entries"][0]["shape"],
         "entries\\[1\\]: .* tuned twice"),
    ],
)  # fmt: skip
def test_a_malformed_table_is_refused_naming_the_field(case):
    """Each case: (path, value, message), and the schema the shipped file is read in first
    where the field is the current schema's."""
    path, value, message, schema = (*case, None)[:4]
    doc = _break(path, value)
    if schema is not None:  # the shipped file in the current schema, then broken
        doc = _break(path, value, upgraded(json.loads(TUNING_FILE.read_text())))
    with pytest.raises(TuningError, match=message):
        parse_table(doc)


def test_an_unreadable_file_is_named(tmp_path):
    bad = tmp_path / "tuning.json"
    bad.write_text("{not json")
    with pytest.raises(TuningError, match="tuning.json: not a readable JSON document"):
        load_table(bad)


def test_the_shipped_file_is_the_text_table_text_writes():
    """``tuning.json`` is laid out as :func:`table_text` writes a regenerated table (so a
    re-tune diffs by entry), and that text parses back to the same document."""
    doc = json.loads(TUNING_FILE.read_text())
    assert table_text(doc) == TUNING_FILE.read_text()
    assert json.loads(table_text(doc)) == doc


def test_programs_per_sm_caps_the_grid_by_the_devices_multiprocessors(monkeypatch):
    """``programs_per_sm`` caps the cuda grid at that many programs per multiprocessor of the
    launching device (the generated host function's expression and the general launch agree);
    0, or a device that is not CUDA (a bundle build on ``meta``), launches a program per tile;
    ``max_programs`` given explicitly wins."""
    from fqr.lowering import targets

    monkeypatch.setattr(targets, "_multiprocessors", lambda index: {0: 132, 1: 78}[index])
    cuda = targets.get_target("cuda")
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert cuda.grid(65536, 1, gpu0, programs_per_sm=4) == 528
    assert cuda.grid(65536, 2, gpu1, programs_per_sm=4) == 312
    assert cuda.grid(100, 1, gpu0, programs_per_sm=4) == 100  # fewer tiles than the cap
    assert cuda.grid(65536, 1, gpu0, programs_per_sm=0) == 65536
    assert cuda.grid(65536, 1, torch.device("meta"), programs_per_sm=4) == 65536
    assert cuda.grid(65536, 1, gpu0, programs_per_sm=4, max_programs=7) == 7
    assert cuda.grid_expression(1, gpu0, programs_per_sm=4) == "min(T, 528)"
    assert cuda.grid_expression(4, gpu1, programs_per_sm=2) == "min((T + 3) // 4, 156)"
    assert cuda.grid_expression(1, gpu0, programs_per_sm=0) == "T"
    for tokens in (1, 5, 528, 529, 100_000):
        assert eval(cuda.grid_expression(1, gpu0, programs_per_sm=4), {"T": tokens}) == cuda.grid(
            tokens, 1, gpu0, programs_per_sm=4
        )
