"""`make test` ends with one line for the whole run (scripts/test_step.sh records each step,
scripts/test_summary.py prints the line): every step named with its counts, the verdict first,
and an exit status that fails when any step failed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEP = ROOT / "scripts" / "test_step.sh"
SUMMARY = ROOT / "scripts" / "test_summary.py"


def _junit(path: Path, tests: int, failures: int, errors: int, skipped: int) -> None:
    path.write_text(
        f'<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" '
        f'tests="{tests}" failures="{failures}" errors="{errors}" skipped="{skipped}">'
        "</testsuite></testsuites>"
    )


def _step(results: Path, name: str, *cmd: str) -> None:
    r = subprocess.run(["bash", str(STEP), str(results), name, *cmd], capture_output=True)
    assert r.returncode == 0  # a step never stops the run: the summary gives the verdict


def _summary(results: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SUMMARY), str(results)], capture_output=True, text=True
    )


def test_every_step_passing_is_one_passed_line(tmp_path):
    _step(tmp_path, "main", "true")
    _junit(tmp_path / "main.xml", tests=17, failures=0, errors=0, skipped=4)
    _step(tmp_path, "ascend-compile-sweep", "true")
    _step(tmp_path, "ascend-interpreter-tests", "sh", "-c", "exit 5")  # none collected
    _junit(tmp_path / "ascend-interpreter-tests.xml", tests=0, failures=0, errors=0, skipped=0)
    r = _summary(tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "make test: passed: main 13 passed, 4 skipped; ascend-compile-sweep ok; "
        "ascend-interpreter-tests 0 passed"
    ]


def test_a_failing_step_fails_the_run_and_is_named(tmp_path):
    _step(tmp_path, "main", "sh", "-c", "exit 1")
    _junit(tmp_path / "main.xml", tests=10, failures=2, errors=1, skipped=3)
    _step(tmp_path, "ascend-verify", "sh", "-c", "exit 1")
    _step(tmp_path, "ascend-compile-tests", "true")
    r = _summary(tmp_path)
    assert r.returncode == 1
    assert r.stdout.splitlines() == [
        "make test: FAILED: main 4 passed, 2 failed, 1 errors, 3 skipped (exit 1); "
        "ascend-verify FAILED (exit 1); ascend-compile-tests ok"
    ]


def test_no_recorded_step_is_a_failure(tmp_path):
    r = _summary(tmp_path)
    assert r.returncode == 1 and r.stdout.startswith("make test: FAILED")
