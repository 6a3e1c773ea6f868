"""The result document (:data:`SCHEMA`): one JSON object per run, saved as it grows, loaded and
merged to render runs made elsewhere.

``{"schema", "environment", "settings", "ceiling": {bytes, us, gbps}, "rows": [...],
"skipped": {what: why}, "passed", "complete"}``; a row is one (preset, dtype, tokens) cell:
``{"preset", "dtype", "tokens", "bytes", "traffic", "input_sets", "impls": {name: result},
"speedup": {peer: peer us / fqr us}}``, and a result holds ``check`` (the numerics check),
``error``, one value per measurement (:mod:`fqr.bench.measurements`), ``gbps`` and
``pct_ceiling``, and ``timing_errors`` where a secondary measurement could not be taken.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SCHEMA = "fqr-bench/1"


def new_document(settings: dict, environment: dict, ceiling: dict) -> dict:
    return {
        "schema": SCHEMA,
        "environment": environment,
        "settings": settings,
        "ceiling": ceiling,
        "rows": [],
        "skipped": {},
        "passed": True,
        "complete": False,
    }


def row_passed(row: dict) -> bool:
    """Every implementation of the cell ran and passed its check."""
    return not any(
        r["error"] or not (r["check"] or {}).get("passed", False) for r in row["impls"].values()
    )


def add_row(doc: dict, row: dict) -> None:
    doc["rows"].append(row)
    doc["passed"] = doc["passed"] and row_passed(row)


def save_document(doc: dict, path) -> None:
    """Write ``doc`` as JSON to ``path`` atomically (a reader never sees half a file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def load_document(path) -> dict:
    """Read a saved ``fqr bench --json`` document (checks its schema)."""
    if not Path(path).is_file():
        raise ValueError(f"--from-json: no such file {path}")
    text = Path(path).read_text()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--from-json {path}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"--from-json {path}: not an {SCHEMA} document")
    return doc


def merge_documents(docs: list[dict]) -> dict:
    """One document from several runs (each row keeps the ceiling of its own run)."""
    if len(docs) == 1:
        return docs[0]
    merged = new_document(docs[0]["settings"], docs[0]["environment"], docs[0]["ceiling"])
    merged.update(complete=True, runs=[])
    for d in docs:
        merged["runs"].append({"environment": d["environment"], "ceiling": d["ceiling"]})
        for r in d["rows"]:
            merged["rows"].append(dict(r, ceiling_gbps=d["ceiling"]["gbps"]))
        merged["skipped"].update(d.get("skipped", {}))
        merged["passed"] = merged["passed"] and d.get("passed", False)
        merged["complete"] = merged["complete"] and d.get("complete", True)
    return merged
