"""One summary line for a whole ``make test``: the main suite and every Ascend step.

``make test`` runs each step through ``scripts/test_step.sh RESULTS NAME CMD...``, which records
the step's exit status in ``RESULTS/NAME.rc`` and appends NAME to ``RESULTS/steps`` (a pytest
step also writes its JUnit XML to ``RESULTS/NAME.xml``). This script reads them back, in the
order the steps ran, and prints

    make test: passed: main 1163 passed, 346 skipped; ascend-compile ok; ... (12m 34s)

or ``make test: FAILED ...`` naming each failing step, then exits 0 when every step passed and 1
otherwise. A pytest step counts as passed when it exits 0, or 5 (no tests collected).

Usage: python scripts/test_summary.py RESULTS_DIR [START_EPOCH_SECONDS]
"""

from __future__ import annotations

import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

NO_TESTS_COLLECTED = 5  # pytest's exit status when a run collects nothing


def pytest_counts(xml_path: Path) -> dict[str, int]:
    """Passed / failed / errors / skipped of one JUnit XML report (all its test suites)."""
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures")}
    total |= {key: sum(int(s.get(key, 0)) for s in suites) for key in ("errors", "skipped")}
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return {
        "passed": passed,
        "failed": total["failures"],
        "errors": total["errors"],
        "skipped": total["skipped"],
    }


def step_text(results: Path, name: str, rc: int) -> tuple[str, bool]:
    """One step's part of the line, and whether it passed."""
    xml_path = results / f"{name}.xml"
    if xml_path.is_file():
        counts = pytest_counts(xml_path)
        ok = rc in (0, NO_TESTS_COLLECTED)
        parts = [f"{n} {what}" for what, n in counts.items() if n or what == "passed"]
        return f"{name} {', '.join(parts)}" + ("" if ok else f" (exit {rc})"), ok
    return (f"{name} ok" if rc == 0 else f"{name} FAILED (exit {rc})"), rc == 0


def summary(results: Path, elapsed_s: float | None = None) -> tuple[str, bool]:
    """The line and the verdict of every step recorded in ``results``."""
    order = results / "steps"
    steps = order.read_text().split() if order.is_file() else []
    if not steps:
        return "make test: FAILED: no step recorded a result", False
    texts, ok = [], True
    for name in steps:
        rc_file = results / f"{name}.rc"
        rc = int(rc_file.read_text().strip() or 1) if rc_file.is_file() else 1
        text, passed = step_text(results, name, rc)
        texts.append(text)
        ok &= passed
    took = "" if elapsed_s is None else f" ({int(elapsed_s // 60)}m {int(elapsed_s % 60):02d}s)"
    return f"make test: {'passed' if ok else 'FAILED'}: {'; '.join(texts)}{took}", ok


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    elapsed = time.time() - float(argv[2]) if len(argv) == 3 else None
    line, ok = summary(Path(argv[1]), elapsed)
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
