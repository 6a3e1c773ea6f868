"""``fqr bench --projection``'s table (fqr.bench.projection.table), from a row as the bench
records it: a schedule outside its T range shows "-", one whose float64 check failed "fail"
(it was not timed either: the two must not read alike), a timed one its µs."""

from __future__ import annotations

from fqr.bench.projection import table


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
