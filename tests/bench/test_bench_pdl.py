"""``fqr bench --pdl``: after the projection GEMM the floors also time fqr's kernel launched with
programmatic dependent launch (:mod:`fqr.bench.floors`), beside the plain launch; the document
keeps the figure and the floors table shows it. Bookkeeping on the CPU (the PDL kernel itself
needs a GPU: its bits are ``tests/gpu/test_pdl_gpu.py``'s), with the test's clock."""

from __future__ import annotations

import json

import fqr_cli.bench as cli_bench
import pytest
import torch
from test_bench import SequenceClock, _config, _document, _must_not_run, run_cli

import fqr.bench as fb
import fqr.bench.run as bench_run
from fqr.bench import report
from fqr.bench.floors import gemm_calls, measure_floors
from fqr.presets import get_preset


def _cell_and_fqr(tokens: int = 5):
    preset = get_preset("qwen3-0.6b")
    cfg = _config(tokens=[tokens], compare=[])
    cache = preset.cos_sin_cache()
    cell = bench_run.make_cell(cfg, preset, torch.bfloat16, tokens, cache, {"l2_bytes": 1 << 20},
                               1000.0, torch.device("cpu"))  # fmt: skip
    fqr = bench_run.implementations(cfg, preset, torch.bfloat16, cache, {})[0]
    return preset, cell, fqr


def test_pdl_is_timed_after_the_gemm_on_its_output():
    """Copy, GEMM, GEMM + op, then GEMM + the PDL launcher, in that order; the PDL launcher
    (here the op itself standing in for the GPU kernel) reads the GEMM's output."""
    preset, cell, fqr = _cell_and_fqr()
    seen = []

    def pdl_launcher(x):
        seen.append(x.qkv.clone())
        return fqr.call(x)

    fqr.pdl_launcher = pdl_launcher
    result = {"graph_us": 4.0}
    clock = SequenceClock([3.0, 10.0, 15.0, 13.5])
    floors = measure_floors(cell, fqr, result, 20.0, clock, seed=7)
    assert floors == {"copy_us": 3.0, "copy_by": "copy_", "copy_candidates": {"copy_": 3.0},
                      "gemm_us": 10.0, "gemm_op_us": 15.0, "gemm_op_pdl_us": 13.5}  # fmt: skip
    assert result["after_gemm_us"] == pytest.approx(5.0)
    assert result["after_gemm_pdl_us"] == pytest.approx(3.5)
    gemm, _ = gemm_calls(cell, fqr, preset.hidden_size, seed=7)
    assert len(seen) == 1 and torch.equal(seen[0], gemm())


def test_without_pdl_nothing_more_is_timed():
    _, cell, fqr = _cell_and_fqr()
    result = {"graph_us": 4.0}
    floors = measure_floors(cell, fqr, result, 20.0, SequenceClock([3.0, 10.0, 15.0]), seed=7)
    assert "gemm_op_pdl_us" not in floors and "after_gemm_pdl_us" not in result


def test_the_floors_table_and_the_document_keep_the_pdl_figure(tmp_path):
    doc = _document(tmp_path, tokens=[3], compare=[])
    row = doc["rows"][0]
    row["floors"]["gemm_op_pdl_us"] = row["floors"]["gemm_us"] - 0.25
    row["impls"]["fqr"]["after_gemm_pdl_us"] = -0.25  # PDL can hide the whole kernel
    table = report.floors_table(doc)
    assert table.columns[-1][0] == "after GEMM us, PDL" and table.rows[0][-1] == "-0.25"
    assert "programmatic dependent launch" in table.caption
    path = tmp_path / "pdl.json"
    path.write_text(json.dumps(doc))
    assert fb.load_document(path) == doc
    row["impls"]["fqr"]["after_gemm_pdl_us"] = "fast"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="after_gemm_pdl_us"):
        fb.load_document(path)


def test_pdl_needs_the_triton_backend(monkeypatch, capsys):
    with pytest.raises(ValueError, match="pdl"):
        _config(pdl=True)  # backend reference
    monkeypatch.setattr(cli_bench, "run_bench", _must_not_run)
    code, out, err = run_cli(monkeypatch, capsys, "--pdl", "--backend", "reference")
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("error:") and "--pdl" in line
