"""The bench picture (issue 13): the documented command on the committed H200 documents
(``docs/results``, an ``fqr-bench/1`` and a merged fp32 run) writes a PNG with one panel per
preset the documents hold (no empty panel for a preset/dtype pair that was not measured) and
the small-T latency panel."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from fqr_cli import bench as bench_cli
from fqr_cli.app import main

from fqr.bench import report

pytest.importorskip("matplotlib")

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
DOCUMENTS = [RESULTS / "bench-h200-16bit.json", RESULTS / "bench-h200-fp32.json"]


def test_documented_command_draws_the_expected_panels(monkeypatch, capsys, tmp_path):
    drawn = []

    def recording(doc, path):
        drawn.append(report.plot_document(doc, path))
        return drawn[-1]

    monkeypatch.setattr(bench_cli, "plot_document", recording)
    png = tmp_path / "bench.png"
    args = [a for d in DOCUMENTS for a in ("--from-json", str(d))] + ["--plot", str(png)]
    monkeypatch.setattr(sys, "argv", ["fqr", "bench", *args])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 0, capsys.readouterr().err
    presets = list(
        dict.fromkeys(r["preset"] for d in DOCUMENTS for r in json.loads(d.read_text())["rows"])
    )
    assert drawn == [[*presets, "qwen3-8b: latency, T <= 256"]]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(png).shape
    assert width > height > 800  # 3 columns of panels, 3 rows, the legend below
