"""``fqr bench --projection``'s table (fqr.bench.projection.table), from a row as the bench
records it: a schedule outside its T range shows "-", one whose float64 check failed "fail"
(it was not timed either: the two must not read alike), a timed one its µs. And the projection
dispatch table written from those rows (``dispatch_table``, ``--write-dispatch``), stub timings."""

from __future__ import annotations

import pytest

from fqr.bench.projection import dispatch_table, lowering_options, table


@pytest.mark.parametrize(
    "depth,k_range,splits", [(4096, 256, 16), (5120, 256, 20), (5120, 384, 14)]
)
def test_a_schedules_k_range_becomes_split_k_for_each_depth(depth, k_range, splits):
    """One schedule fits Qwen3-8B's K (4,096) and Qwen3-32B's (5,120): ``k_range`` is the K of
    each split-K range, ``split_k`` the ranges that cover K; the token range is no option."""
    schedule = {"product_dot": "fma", "k_range": k_range, "num_warps": 8, "max_tokens": 1}
    options = lowering_options(schedule, depth)
    assert options == {"product_dot": "fma", "num_warps": 8, "split_k": splits}
    assert (splits - 1) * k_range < depth <= splits * k_range
    assert lowering_options({"split_k": 4, "min_tokens": 16}, depth) == {"split_k": 4}


def _row(**fused):
    checks = {n: {"passed": v != "failed", "max_ulp": 1 if v != "failed" else 40} for n, v in
              fused.items() if v is not None}  # fmt: skip
    return dict(preset="qwen3-8b", tp=8, tokens=1, gemm_us=7.61, pair_us=9.37, weights_us=1.94,
                fused_us={n: (None if v in (None, "failed") else v) for n, v in fused.items()},
                checks=checks, fused_over_pair=0.96)  # fmt: skip


def test_untimed_failed_and_timed_schedules_read_apart():
    columns, cells = table([_row(sk8=8.99, t64=None, broken="failed")])
    (row,) = cells
    cell = dict(zip(columns, row))
    assert float(cell["fused[sk8]"]) == 8.99
    assert cell["fused[t64]"] == "-"
    assert cell["fused[broken]"] == "fail"
    assert "broken:40" in cell["max ULP"] and "t64" not in cell["max ULP"]
    assert float(cell["GEMM+op"]) == 9.37 and float(cell["fused/pair"]) == 0.96


def test_no_rows_is_a_header_only():
    columns, cells = table([])
    assert cells == [] and columns[:3] == ["preset", "TP", "T"]


# ----------------------------------------------- the dispatch table from the measured rows


def _cell(preset, tp, tokens, pair, fused, **schedules):
    """A --projection row as projection_cell records it (stub timings)."""
    fused_us = {"default": fused, **schedules}
    checks = {n: {"passed": v is not None, "max_ulp": 1} for n, v in fused_us.items()}
    return dict(preset=preset, tp=tp, tokens=tokens, dtype="bfloat16", gemm_us=pair - 2.0,
                pair_us=pair, fused_us=fused_us, checks=checks, weights_us=1.9)  # fmt: skip


def test_dispatch_table_from_rows():
    """One entry per preset and TP, keyed as the dispatch looks calls up; the public op's
    schedule ('default') is what it compares (a faster other schedule does not count: the
    dispatch does not run it); a failed check keeps the pair."""
    from fqr.projection import parse_table

    rows = [
        _cell("qwen3-8b", 8, 1, 9.37, 8.99, sk16=7.92),
        _cell("qwen3-8b", 8, 2, 9.47, 7.23),
        _cell("qwen3-8b", 8, 16, 9.79, 14.08, sk16=7.0),
        _cell("qwen3-8b", 8, 1024, 16.09, None),  # its check failed: not timed
        _cell("qwen3-8b", 1, 1, 17.46, 18.66),
        _cell("qwen3-vl-8b", 8, 1, 9.62, 8.90),
    ]
    doc = dispatch_table(rows, "NVIDIA H200", source="stub run")
    table = parse_table(doc)  # a valid table
    entries = {e["model"]: e for e in doc["entries"]}
    tp8 = entries["qwen3-8b TP8"]
    assert (tp8["op"], tp8["n"], tp8["k"], tp8["heads"], tp8["norm"], tp8["bias"]) == (
        "split_qkv_rmsnorm_rope",
        768,
        4096,
        [4, 1, 128],
        "head",
        False,
    )
    assert tp8["choice"] == ["fused", "fused", "pair", "pair", "pair"]
    assert tp8["measured"] == [
        [1, 9.37, 8.99],
        [2, 9.47, 7.23],
        [16, 9.79, 14.08],
        [1024, 16.09, None],
    ]
    assert entries["qwen3-8b TP1"]["choice"] == ["pair"] * 5
    assert entries["qwen3-vl-8b TP8"]["op"] == "split_qkv_rmsnorm_mrope"
    assert all(e["device"] == "NVIDIA H200" and e["source"] == "stub run" for e in doc["entries"])
    assert len(table) == 3


def test_dispatch_table_keeps_the_shapes_it_did_not_measure_and_the_worse_of_one_key():
    from fqr.projection import load_table, parse_table

    shipped = load_table()
    rows = [_cell("qwen3-8b", 8, 1, 9.0, 9.5)]  # now slower: the pair
    doc = dispatch_table(rows, "NVIDIA H200", source="stub run", kept=shipped)
    assert len(parse_table(doc)) == len(shipped)
    (new,) = [e for e in doc["entries"] if e.get("source") == "stub run"]
    assert new["choice"] == ["pair"] * 5
    # two presets of one key at one T: the cell less favourable to the fused kernel
    twice = [_cell("qwen3-8b", 8, 1, 9.0, 8.0), _cell("qwen3-8b", 8, 1, 9.0, 8.9)]
    (entry,) = dispatch_table(twice, "NVIDIA H200", source="s")["entries"]
    assert entry["measured"] == [[1, 9.0, 8.9]]


def test_dispatch_table_needs_the_public_ops_schedule():
    row = _cell("qwen3-8b", 8, 1, 9.0, 8.0)
    row["fused_us"] = {"sk16": 7.0}
    with pytest.raises(ValueError, match="needs the 'default' schedule"):
        dispatch_table([row], "NVIDIA H200", source="s")


@pytest.mark.parametrize("shipped", ["readable", "unreadable"])
def test_bench_projection_writes_the_dispatch_table(tmp_path, capsys, monkeypatch, shipped):
    """``fqr bench --projection --write-dispatch PATH`` with the cells stubbed (no GPU here):
    the table is written from the measured rows, the shipped entries of other shapes kept; a
    shipped table that cannot be read (an older bucket layout) keeps nothing, says so in one
    warning line, and the measured table is still written."""
    import torch
    from fqr_cli import bench as cli_bench
    from support.cli import fqr_in_process

    from fqr import projection
    from fqr.bench import projection as bench_projection

    stub = {(1, 1): (17.0, 18.0), (8, 1): (9.0, 8.0), (1, 16): (18.0, 24.0), (8, 16): (9.5, 14.0)}

    def cell(preset, tp, tokens, dtype, schedules, timers, rep_ms, seed):
        assert "default" in schedules
        return _cell(preset, tp, tokens, *stub[tp, tokens])

    monkeypatch.setattr(cli_bench, "require_gpu", lambda: None)
    monkeypatch.setattr(bench_projection, "projection_cell", cell)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(projection, "device_name", lambda device: "NVIDIA H200")
    shipped_entries = len(projection.load_table()) if shipped == "readable" else 0
    if shipped == "unreadable":
        old = tmp_path / "old.json"
        old.write_text('{"schema": "fqr.proj-dispatch/1", "buckets": [1, 16, 1024, null]}')
        read = projection.load_table
        monkeypatch.setattr(projection, "load_table", lambda path=old: read(path))
    path = tmp_path / "dispatch.json"
    args = ["bench", "--projection", "--preset", "llama3-8b", "--tokens", "1,16",
            "--write-dispatch", str(path), "--json"]  # fmt: skip
    code, out, err = fqr_in_process(args, capsys, monkeypatch)
    assert code == 0, err
    assert "dispatch table written to" in err
    table = projection.load_table(path)
    written = [e for e in table.values() if e.measured[0][1:] in (stub[1, 1], stub[8, 1])]
    assert sorted(e.doc["model"] for e in written) == ["llama3-8b TP1", "llama3-8b TP8"]
    choices = {e.doc["model"]: e.choices for e in written}
    assert choices["llama3-8b TP8"] == ("fused", "pair", "pair", "pair", "pair")
    assert choices["llama3-8b TP1"] == ("pair",) * 5
    if shipped == "readable":
        assert len(table) == shipped_entries  # the other shipped entries kept
    else:
        assert len(table) == 2
        warning = [line for line in err.splitlines() if line.startswith("warning:")]
        assert len(warning) == 1 and "'buckets' must be" in warning[0], err


def test_write_dispatch_without_the_default_schedule_is_refused(tmp_path, capsys, monkeypatch):
    from support.cli import fqr_in_process

    args = ["bench", "--projection", "--schedules", '{"sk8": {"split_k": 8}}',
            "--write-dispatch", str(tmp_path / "d.json")]  # fmt: skip
    code, _, err = fqr_in_process(args, capsys, monkeypatch)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--write-dispatch needs the 'default' schedule" in err
