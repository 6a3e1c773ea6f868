"""The result document (:data:`SCHEMA`): one JSON object per run, saved as it grows, loaded and
merged to render runs made elsewhere.

``{"schema", "environment", "settings", "ceiling": {bytes, us, gbps}, "rows": [...],
"skipped": {what: why}, "ok", "complete"}`` (``ok``: every implementation passed its check, the
CLI's one pass/fail key); documents of the previous schema (``fqr-bench/1``, ``passed``) load
as this one. The ceiling may also hold ``by`` (the fastest copy), ``candidates`` (each copy's
µs) and ``errors`` (a copy that could not be timed):
:meth:`fqr.bench.timers.CudaTimers.copy_ceiling`. A row is one (preset, dtype, tokens) cell:
``{"preset", "dtype", "tokens", "bytes", "traffic", "input_sets", "impls": {name: result},
"speedup": {peer: peer us / fqr us}}``, and a result holds ``check`` (the numerics check),
``error``, one value per measurement (:mod:`fqr.bench.measurements`), ``gbps`` and
``pct_ceiling``, and ``timing_errors`` where a secondary measurement could not be taken;
a row's ``floors`` (``copy_by`` and ``copy_candidates`` among them) and fqr's ``pct_copy`` /
``after_gemm_us`` / ``after_gemm_x`` (with ``--pdl``, ``after_gemm_pdl_us``), and the run's
``floors: {empty_kernel_us}``, are :mod:`fqr.bench.floors`'.
"""

from __future__ import annotations

import json
import math
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
    """Read a saved ``fqr bench --json`` document: ValueError naming the file and the field
    for anything the report could not render (:func:`document_problem`)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--from-json: no such file {path}")
    try:
        doc = json.loads(path.read_bytes())
    except UnicodeDecodeError:
        raise ValueError(f"--from-json {path}: not JSON (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--from-json {path}: not JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise ValueError(f"--from-json {path}: not a bench document (nested too deeply)") from None
    doc = upgrade_document(doc)
    problem = document_problem(doc)
    if problem is not None:
        raise ValueError(f"--from-json {path}: {problem}")
    return doc


def upgrade_document(doc):
    """A document of a :data:`LEGACY_SCHEMAS` schema as a :data:`SCHEMA` one (keys renamed);
    anything else unchanged."""
    schema = doc.get("schema") if isinstance(doc, dict) else None
    renames = LEGACY_SCHEMAS.get(schema) if isinstance(schema, str) else None
    if renames is None:
        return doc
    doc = {renames.get(k, k): v for k, v in doc.items()}
    doc["schema"] = SCHEMA
    return doc


_ROW_FIELDS = (("preset", str), ("dtype", str), ("tokens", int), ("impls", dict), ("speedup", dict))
# a failed output's check, as fqr.bench.checks writes it (the failure line quotes them)
_FAILED_OUTPUT_FIELDS = {
    "bad": "a count",
    "tolerance": "text",
    "max_ulp": "a count or null",
    "max_rel_head": "a number",
    "nonfinite_all_rows": "a count",
}
_KINDS = {
    "text": lambda v: isinstance(v, str),
    "true or false": lambda v: isinstance(v, bool),
    "a count": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    # the document's times, rates and ratios
    "a number": lambda v: (
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    ),
    # a difference of two times (the prologue after the GEMM): either sign
    "a signed number": lambda v: (
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ),
    "an object": lambda v: isinstance(v, dict),
}


def _is(value, kind: str) -> bool:
    """``value`` is of ``kind`` (a key of :data:`_KINDS`, as the message words it: a count is
    an int >= 0, a number finite and >= 0); "X or null" also allows None."""
    if kind.endswith(" or null"):
        return value is None or _is(value, kind[: -len(" or null")])
    return _KINDS[kind](value)


def _field_problem(obj: dict, key: str, kind: str, where: str, required: bool = True):
    """Why ``obj[key]`` is not of ``kind`` (named ``where.key``), or None; absent is a problem
    only when ``required``."""
    if key not in obj:
        return f"{where} has no {key!r} ({kind})" if required else None
    if not _is(obj[key], kind):
        return f"{where}.{key} must be {kind}, got {obj[key]!r:.40}"
    return None


def _fields_problem(
    obj: dict, fields: dict[str, str], where: str, required: bool = True
) -> str | None:
    """The first problem :func:`_field_problem` finds among ``fields`` (key -> kind, in
    order), or None."""
    for key, kind in fields.items():
        problem = _field_problem(obj, key, kind, where, required)
        if problem:
            return problem
    return None


def _map_problem(obj, kind: str, where: str) -> str | None:
    """Why ``obj`` is not a JSON object of text keys to ``kind`` values, or None."""
    if not isinstance(obj, dict):
        return f"{where} must be a JSON object, got {type(obj).__name__}"
    for key, value in obj.items():
        if not _is(value, kind):
            return f"{where}[{key!r:.40}] must be {kind}, got {value!r:.40}"
    return None


def _optional_map_problem(obj: dict, key: str, kind: str, where: str) -> str | None:
    """:func:`_map_problem` of ``obj[key]`` (named ``where.key``) where ``obj`` has ``key``;
    None where it has not."""
    return _map_problem(obj[key], kind, f"{where}.{key}") if key in obj else None


def _check_problem(check: dict, where: str) -> str | None:
    """Why an implementation's ``check`` cannot be read, or None: ``passed``, and for every
    output (an object) its ``passed`` and, when it failed, its ``error`` or its figures."""
    problem = _field_problem(check, "passed", "true or false", where) or _fields_problem(
        check,
        {"numerics": "text", "error": "text or null", "rows": "a count"},
        where,
        required=False,
    )
    if problem:
        return problem
    for name, out in check.items():
        if not isinstance(out, dict):
            continue
        at = f"{where}[{name!r:.40}]"
        problem = _field_problem(out, "passed", "true or false", at) or _field_problem(
            out, "error", "text or null", at, required=False
        )
        if problem:
            return problem
        if out["passed"] or out.get("error"):
            continue
        problem = _fields_problem(out, _FAILED_OUTPUT_FIELDS, at)
        if problem:
            return problem
    return None


def _impl_problem(impl, where: str) -> str | None:
    """Why one implementation's result cannot be read, or None."""
    if not isinstance(impl, dict):
        return f"{where} must be a JSON object"
    times = ("gbps", "pct_ceiling", "pct_copy", *(m.key for m in MEASUREMENTS))
    differences = ("after_gemm_us", "after_gemm_x", "after_gemm_pdl_us")
    problem = (
        _fields_problem(impl, dict.fromkeys(times, "a number or null"), where, required=False)
        or _fields_problem(
            impl, dict.fromkeys(differences, "a signed number or null"), where, required=False
        )
        or _fields_problem(impl, {"error": "text or null", "check": "an object or null"}, where)
    )
    if problem:
        return problem
    if impl["check"] is not None:
        problem = _check_problem(impl["check"], f"{where}.check")
        if problem:
            return problem
    return _optional_map_problem(impl, "timing_errors", "text", where)


def _floors_problem(floors, where: str) -> str | None:
    """Why a row's ``floors`` (:mod:`fqr.bench.floors`) cannot be read, or None."""
    if not isinstance(floors, dict):
        return f"{where} must be a JSON object"
    times = ("copy_us", "gemm_us", "gemm_op_us", "gemm_op_pdl_us")
    return (
        _fields_problem(floors, dict.fromkeys(times, "a number or null"), where, required=False)
        or _field_problem(floors, "copy_by", "text", where, required=False)
        or _optional_map_problem(floors, "copy_candidates", "a number", where)
        or _optional_map_problem(floors, "errors", "text", where)
    )


def _row_problem(row, where: str) -> str | None:
    if not isinstance(row, dict):
        return f"{where} must be a JSON object"
    for key, kind in _ROW_FIELDS:
        if not isinstance(row.get(key), kind) or isinstance(row.get(key), bool):
            return f"{where} has no {kind.__name__} {key!r}"
    if row["tokens"] < 1:
        return f"{where}.tokens must be >= 1, got {row['tokens']}"
    problem = _field_problem(row, "ceiling_gbps", "a number or null", where, required=False)
    problem = problem or _map_problem(row["speedup"], "a number", f"{where}.speedup")
    if problem:
        return problem
    if "floors" in row:
        problem = _floors_problem(row["floors"], f"{where}.floors")
        if problem:
            return problem
    if FQR not in row["impls"]:
        return f"{where} has no {FQR!r} measurement"
    for name, impl in row["impls"].items():
        problem = _impl_problem(impl, f"{where}.impls[{name!r:.40}]")
        if problem:
            return problem
    return None


def _dispatch_problem(entries) -> str | None:
    """Why ``dispatch`` (host µs per call, :func:`fqr.bench.run.dispatch_rows`) cannot be
    read, or None."""
    if not isinstance(entries, list):
        return f"'dispatch' must be a JSON list, got {type(entries).__name__}"
    for i, entry in enumerate(entries):
        where = f"dispatch[{i}]"
        if not isinstance(entry, dict):
            return f"{where} must be a JSON object"
        problem = _fields_problem(
            entry, {"preset": "text", "dtype": "text", "tokens": "a count"}, where
        )
        if problem:
            return problem
        for key in ("host_us", "x_rms_norm"):
            if key not in entry:
                return f"{where} has no {key!r} (an object)"
            problem = _map_problem(entry[key], "a number or null", f"{where}.{key}")
            if problem:
                return problem
    return None


def document_problem(doc) -> str | None:
    """Why ``doc`` is not a document the report can render, or None: every field the table,
    the failure lines, the dispatch table and the plot read, with its type (text, counts,
    finite non-negative numbers), named by its place in the document."""
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
    if not _is(doc["ceiling"].get("gbps"), "a number"):
        return "'ceiling' has no number 'gbps'"
    problem = (
        _field_problem(doc["ceiling"], "by", "text", "ceiling", required=False)
        or _optional_map_problem(doc["ceiling"], "candidates", "a number", "ceiling")
        or _optional_map_problem(doc["ceiling"], "errors", "text", "ceiling")
    )
    if problem:
        return problem
    if not isinstance(doc.get("skipped", {}), dict):
        return "'skipped' must be a JSON object"
    if not isinstance(doc.get("complete", True), bool):
        return "'complete' must be true or false"
    for i, row in enumerate(doc["rows"]):
        problem = _row_problem(row, f"rows[{i}]")
        if problem:
            return problem
    if doc.get("floors") is not None:
        floors = doc["floors"]
        if not isinstance(floors, dict):
            return "'floors' must be a JSON object"
        problem = _field_problem(floors, "empty_kernel_us", "a number", "floors")
        if problem:
            return problem
    if doc.get("dispatch") is not None:
        return _dispatch_problem(doc["dispatch"])
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
        if d.get("floors") and "floors" not in merged:
            merged["floors"] = d["floors"]  # the first run's launch floor
        merged["ok"] = merged["ok"] and d.get("ok", False)
        merged["complete"] = merged["complete"] and d.get("complete", True)
    return merged
