"""Golden directories built in a test's temporary folder, for the hostile-file tests: a copy of
shipped case files under a manifest the test writes (then damages)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fqr.golden import GOLDEN_DIR, list_cases


def write_manifest(d: Path, cases: list, **doc) -> None:
    """``d/manifest.json`` listing ``cases`` (``doc``: more top-level keys)."""
    (d / "manifest.json").write_text(json.dumps({"format": "fqr-golden/1", "cases": cases, **doc}))


def copy_case(d: Path, pattern: str) -> tuple[Path, dict]:
    """``d`` holding the one shipped case named by ``pattern`` and a manifest of it:
    (``d``, its manifest entry)."""
    (entry,) = list_cases(pattern=pattern)
    shutil.copy(GOLDEN_DIR / entry["file"], d / entry["file"])
    write_manifest(d, [entry])
    return d, entry
