"""The result document (:data:`SCHEMA`): one JSON object per run, saved as it grows, loaded and
merged to render runs made elsewhere.

``{"schema", "environment", "settings", "ceiling": {bytes, us, gbps}, "rows": [...],
"skipped": {what: why}, "ok", "complete"}`` (``ok``: every implementation passed its check, the
CLI's one pass/fail key); documents of the previous schema (``fqr-bench/1``, ``passed``) load
as this one; a row is one (preset, dtype, tokens) cell:
``{"preset", "dtype", "tokens", "bytes", "traffic", "input_sets", "impls": {name: result},
"speedup": {peer: peer us / fqr us}}``, and a result holds ``check`` (the numerics check),
``error``, one value per measurement (:mod:`fqr.bench.measurements`), ``gbps`` and
``pct_ceiling``, and ``timing_errors`` where a secondary measurement could not be taken.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..files import write_file
from .measurements import MEASUREMENTS

SCHEMA = "fqr.bench/2"
LEGACY_SCHEMAS = {"fqr-bench/1": {"passed": "ok"}}  # old schema -> its renamed keys
FQR = "fqr"  # fqr's own entry in a row's "impls"


def new_document(settings: dict, environment: dict, ceiling: dict) -> dict:
    return {
        "schema": SCHEMA,
        "environment": environment,
        "settings": settings,
        "ceiling": ceiling,
        "rows": [],
        "skipped": {},
        "ok": True,
        "complete": False,
    }


def row_passed(row: dict) -> bool:
    """Every implementation of the cell ran and passed its check."""
    return not any(
        r["error"] or not (r["check"] or {}).get("passed", False) for r in row["impls"].values()
    )


def add_row(doc: dict, row: dict) -> None:
    doc["rows"].append(row)
    doc["ok"] = doc["ok"] and row_passed(row)


def save_document(doc: dict, path) -> None:
    """Write ``doc`` as JSON to ``path`` atomically (a reader never sees half a file), never
    through a symlink (:func:`fqr.files.write_file`)."""
    write_file(path, json.dumps(doc, indent=1) + "\n")


def load_document(path) -> dict:
    """Read a saved ``fqr bench --json`` document (checks its schema)."""
    if not Path(path).is_file():
        raise ValueError(f"--from-json: no such file {path}")
    text = Path(path).read_text()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--from-json {path}: not JSON ({e.msg} at line {e.lineno})") from None
    doc = upgrade_document(doc)
    problem = document_problem(doc)
    if problem is not None:
        raise ValueError(f"--from-json {path}: {problem}")
    return doc


def upgrade_document(doc):
    """A document of a :data:`LEGACY_SCHEMAS` schema as a :data:`SCHEMA` one (keys renamed);
    anything else unchanged."""
    renames = LEGACY_SCHEMAS.get(doc.get("schema")) if isinstance(doc, dict) else None
    if renames is None:
        return doc
    doc = {renames.get(k, k): v for k, v in doc.items()}
    doc["schema"] = SCHEMA
    return doc


_ROW_FIELDS = (("preset", str), ("dtype", str), ("tokens", int), ("impls", dict), ("speedup", dict))


def document_problem(doc) -> str | None:
    """Why ``doc`` is not a document the report can render (every field it reads, with its
    type), or None."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        return f"not an {SCHEMA} document"
    for key, kind in (
        ("environment", dict),
        ("settings", dict),
        ("ceiling", dict),
        ("rows", list),
        ("ok", bool),
    ):
        if key not in doc:
            return f"no {key!r}"
        if not isinstance(doc[key], kind):
            return f"{key!r} must be a JSON {kind.__name__}, got {type(doc[key]).__name__}"
    if not isinstance(doc["ceiling"].get("gbps"), (int, float)):
        return "'ceiling' has no number 'gbps'"
    if not isinstance(doc.get("skipped", {}), dict):
        return "'skipped' must be a JSON object"
    numbers = ("gbps", "pct_ceiling", *(m.key for m in MEASUREMENTS))
    for i, row in enumerate(doc["rows"]):
        where = f"rows[{i}]"
        if not isinstance(row, dict):
            return f"{where} must be a JSON object"
        for key, kind in _ROW_FIELDS:
            if not isinstance(row.get(key), kind) or isinstance(row.get(key), bool):
                return f"{where} has no {kind.__name__} {key!r}"
        if FQR not in row["impls"]:
            return f"{where} has no {FQR!r} measurement"
        for name, impl in row["impls"].items():
            at = f"{where}.impls[{name!r}]"
            if not isinstance(impl, dict):
                return f"{at} must be a JSON object"
            for key in numbers:
                value = impl.get(key)
                if value is not None and (not isinstance(value, (int, float)) or value is True):
                    return f"{at}.{key} must be a number or null, got {value!r:.40}"
            if not isinstance(impl.get("error"), (str, type(None))):
                return f"{at}.error must be text or null"
            if not isinstance(impl.get("check"), (dict, type(None))):
                return f"{at}.check must be an object or null"
    return None


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
        if d.get("dispatch"):
            merged.setdefault("dispatch", []).extend(d["dispatch"])
        merged["ok"] = merged["ok"] and d.get("ok", False)
        merged["complete"] = merged["complete"] and d.get("complete", True)
    return merged
